"""A rollout engine in its own Ray actor, and the local proxy that trainers and agents call.

:class:`RolloutActor` holds any engine built by a picklable factory (e.g.
``functools.partial(HFEngine, model_dir, seed=0)``); :class:`RemoteEngine` implements
:class:`~mars_megatron.rollout.engine.RolloutEngine` and
:class:`~mars_megatron.rollout.engine.WeightUpdatable` on top of it, so the trainer's
:class:`~mars_megatron.training.weight_sync.WeightSync` and the agents use a remote engine exactly like a
local one. The proxy holds only the actor handle: it pickles, so it can be handed to a trainer rank that
itself runs in a Ray actor.

Weight updates travel in buckets of at most ``bucket_bytes`` through the object store, at most two in
flight, so the sender never holds more than two buckets; the actor collects them and calls the engine's
``update_weights`` *once* at commit, because vLLM's in-place reload only finishes a layer whose weights
all arrive within one call. The actor therefore holds one full copy of the weights during an update.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, RolloutEngine, Sleepable

DEFAULT_BUCKET_BYTES = 256 * 1024**2
MAX_BUCKETS_IN_FLIGHT = 2


@dataclass(frozen=True)
class UpdateStats:
    """The last committed weight update: the version the engine now holds and what arrived."""

    version: int
    tensors: int
    buckets: int
    bytes: int
    largest_bucket: int  # bytes; at most bucket_bytes unless one tensor is larger
    seconds: float  # from begin_update to the end of the engine's update_weights


class RolloutActor:
    """Body of the Ray actor that owns one rollout engine (wrap with ``ray.remote``, or use
    :func:`start_rollout_actor`). Methods are called in order from one sender, which Ray guarantees
    for calls made through one actor handle."""

    def __init__(self, factory: Callable[[], RolloutEngine], threads: int | None = None) -> None:
        if threads is not None:
            self.set_threads(threads)
        self.engine = factory()
        self._version = 0
        self._pending: list[tuple[str, torch.Tensor]] | None = None
        self._buckets = 0
        self._bytes = 0
        self._largest = 0
        self._started = 0.0
        self._last: UpdateStats | None = None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        return self.engine.generate(requests)

    def generate_versioned(self, requests: Sequence[GenerationRequest]) -> tuple[list[GenerationOutput], int]:
        """``generate``, and the policy version that decoded it: the actor runs one call at a time, so a
        call never straddles a weight update (the agentic pipeline records this per segment)."""
        return self.engine.generate(requests), self._version

    def begin_update(self) -> None:
        """Start collecting a new set of weights (drops a previous, uncommitted one)."""
        self._pending, self._buckets, self._bytes, self._largest = [], 0, 0, 0
        self._started = time.perf_counter()

    def receive(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Keep one bucket of HF-named tensors until commit; returns how many tensors are pending."""
        if self._pending is None:
            raise RuntimeError("receive() before begin_update()")
        self._pending.extend(bucket)
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        self._buckets += 1
        self._bytes += size
        self._largest = max(self._largest, size)
        return len(self._pending)

    def commit_update(self, version: int | None = None) -> int:
        """Load every received tensor with one ``update_weights`` call; the engine then holds policy
        ``version`` (the previous version + 1 if not given). Returns how many tensors were loaded."""
        if self._pending is None:
            raise RuntimeError("commit_update() before begin_update()")
        if version is not None and version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        pending, self._pending = self._pending, None
        update = getattr(self.engine, "update_weights", None)
        if update is None:
            raise TypeError(f"{type(self.engine).__name__} cannot update its weights (no update_weights)")
        loaded = int(update(iter(pending)))
        self._version = self._version + 1 if version is None else version
        self._last = UpdateStats(
            self._version,
            len(pending),
            self._buckets,
            self._bytes,
            self._largest,
            time.perf_counter() - self._started,
        )
        return loaded

    def abort_update(self) -> None:
        """Drop an update whose sender failed half-way; the engine keeps its current weights."""
        self._pending = None

    def version(self) -> int:
        return self._version

    def sleep(self) -> None:
        """Free the engine's device memory while a colocated trainer updates (no-op for engines that
        cannot, e.g. transformers on CPU). The weights are discarded: wake with :meth:`wake_weights`,
        push the new weights, then :meth:`wake` (:class:`~mars_megatron.rollout.engine.Sleepable`)."""
        if isinstance(self.engine, Sleepable):
            self.engine.sleep()

    def wake_weights(self) -> None:
        """Allocate the weights' memory again, ready for the weight push (KV cache still asleep)."""
        if isinstance(self.engine, Sleepable):
            self.engine.wake_weights()

    def wake(self) -> None:
        """Allocate the rest (the KV cache) once the weights are in: rollouts may resume."""
        if isinstance(self.engine, Sleepable):
            self.engine.wake()

    def resources(self) -> dict[str, Any]:
        """The Ray resources this actor holds, its (logical) GPU ids and placement group."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            **ctx.get_assigned_resources(),
            "gpu_ids": [int(i) for i in ray.get_gpu_ids()],
            "placement_group": ctx.get_placement_group_id(),
            # what CUDA will see in this process (None: unset, i.e. every device of the node)
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_RAY_")},
        }

    def last_update(self) -> UpdateStats | None:
        return self._last

    def set_threads(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def _portable(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its bytes: pickling a view ships its whole storage (a view into
    megatron's contiguous parameter buffer would ship every parameter), and a CUDA tensor would need a
    GPU on the receiving side."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    nbytes = t.numel() * t.element_size()
    if not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != nbytes:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class RemoteEngine:
    """Local proxy of a :class:`RolloutActor`: a ``RolloutEngine`` and ``WeightUpdatable``."""

    def __init__(self, actor: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.actor = actor
        self.bucket_bytes = bucket_bytes

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        import ray

        return ray.get(self.actor.generate.remote(list(requests)))

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        """Stream ``named_tensors`` to the actor in buckets, then load them all at once; returns how many
        tensors the engine loaded. A tensor larger than ``bucket_bytes`` travels alone."""
        import ray

        in_flight: collections.deque = collections.deque()

        def send(bucket: list[tuple[str, torch.Tensor]]) -> None:
            while len(in_flight) >= MAX_BUCKETS_IN_FLIGHT:
                ray.get(in_flight.popleft())
            in_flight.append(self.actor.receive.remote(ray.put(bucket)))

        self.actor.begin_update.remote()
        try:
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in named_tensors:
                t = _portable(tensor)
                nbytes = t.numel() * t.element_size()
                if bucket and size + nbytes > self.bucket_bytes:
                    send(bucket)
                    bucket, size = [], 0
                bucket.append((name, t))
                size += nbytes
            if bucket:
                send(bucket)
            while in_flight:
                ray.get(in_flight.popleft())
        except BaseException:
            self.actor.abort_update.remote()
            raise
        return ray.get(self.actor.commit_update.remote(version))

    def version(self) -> int:
        """The policy version the engine holds (number of commits, or the last version given)."""
        import ray

        return ray.get(self.actor.version.remote())

    def last_update(self) -> UpdateStats | None:
        import ray

        return ray.get(self.actor.last_update.remote())

    def set_threads(self, n: int) -> None:
        import ray

        ray.get(self.actor.set_threads.remote(n))

    def kill(self) -> None:
        """End the actor (and its engine) now, instead of when the last handle goes away."""
        import ray

        ray.kill(self.actor)


class EngineGroup:
    """Several rollout engines of one policy behind one ``update_weights``: every engine gets the same
    weights and version. With more than one engine the tensors are gathered once and held while they go
    out to each (a full copy on the sending rank); one engine is streamed to directly."""

    def __init__(self, engines: Sequence[RemoteEngine]) -> None:
        if not engines:
            raise ValueError("EngineGroup: no engines")
        self.engines = list(engines)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> int:
        if len(self.engines) == 1:  # streamed: no copy of the weights held
            return self.engines[0].update_weights(named_tensors, version)
        tensors = [(name, _portable(t)) for name, t in named_tensors]
        counts = {e.update_weights(iter(tensors), version) for e in self.engines}
        return counts.pop() if len(counts) == 1 else max(counts)


def start_rollout_actor(
    factory: Callable[[], RolloutEngine],
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    threads: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    env: dict[str, str] | None = None,
    scheduling_strategy: Any = None,
) -> RemoteEngine:
    """Start a :class:`RolloutActor` running ``factory()`` and wait until the engine is built (so a bad
    model directory fails here, not at the first rollout). ``threads`` defaults to ``num_cpus``."""
    import ray

    if num_cpus <= 0:
        raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    actor = (
        ray.remote(RolloutActor)
        .options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            runtime_env={"env_vars": {k: str(v) for k, v in env.items()}} if env else None,
            scheduling_strategy=scheduling_strategy,
        )
        .remote(factory, threads if threads is not None else max(1, int(num_cpus)))
    )
    try:
        ray.get(actor.version.remote())
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(f"the rollout actor failed to start its engine: {e}") from None
    return RemoteEngine(actor, bucket_bytes=bucket_bytes)
