"""A rollout engine in its own Ray actor, and the local proxy that agents call.

:class:`RolloutActor` holds any engine built by a picklable factory (e.g.
``functools.partial(HFEngine, model_dir, seed=0)``); :class:`RemoteEngine` implements
:class:`~mars_megatron.rollout.engine.RolloutEngine` on top of it. The proxy holds only the actor handle:
it pickles, so it can be handed to any process.

Weights do not travel through this actor's calls: the engine's workers join the trainer's transfer groups
(:mod:`mars_megatron.transfer`) and receive the buckets by collective broadcast while
:meth:`RolloutActor.receive_weights` runs; the call carries only the plan. The actor keeps the policy
version and refuses to generate from weights a failed transfer left half-loaded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mars_megatron import deadline
from mars_megatron.reaper import WorkerProcess, reap, whereabouts
from mars_megatron.rollout.batch import OutputBatch, RequestBatch, answer
from mars_megatron.rollout.engine import (
    GenerationOutput,
    GenerationRequest,
    RolloutEngine,
    Sleepable,
    TransferTarget,
)
from mars_megatron.transfer.channel import TransferStats
from mars_megatron.transfer.group import GroupSpec
from mars_megatron.transfer.plan import TransferPlan


class TornWeightsError(RuntimeError):
    """The engine's last weight transfer failed part-way: some layers hold the new weights, some the old."""


@dataclass(frozen=True)
class UpdateStats:
    """The last committed weight update: the version the engine now holds and what arrived."""

    version: int
    tensors: int
    buckets: int
    bytes: int
    largest_bucket: int  # bytes; at most the plan's bucket_bytes unless one tensor is larger
    peak_bytes: int  # the most bytes any worker of the engine held for the transfer
    seconds: float

    @classmethod
    def of(cls, version: int, plan: TransferPlan, stats: TransferStats, seconds: float) -> UpdateStats:
        return cls(
            version, stats.tensors, stats.buckets, stats.bytes, plan.largest_bucket, stats.peak_bytes, seconds
        )


class RolloutActor:
    """Body of the Ray actor that owns one rollout engine (wrap with ``ray.remote``, or use
    :func:`start_rollout_actor`). Methods are called in order from one sender, which Ray guarantees
    for calls made through one actor handle."""

    def __init__(self, factory: Callable[[], RolloutEngine], threads: int | None = None) -> None:
        if threads is not None:
            self.set_threads(threads)
        self.engine = factory()
        self._version = 0
        self._torn = False
        self._last: UpdateStats | None = None

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        self._check_whole()
        return self.engine.generate(requests)

    def _check_whole(self) -> None:
        if self._torn:
            raise TornWeightsError(
                f"the last weight transfer into this engine failed part-way (it still reports policy "
                f"version {self._version}); it generates again once a transfer completes"
            )

    def generate_versioned(self, batch: RequestBatch) -> tuple[OutputBatch, int]:
        """``generate`` of one call's requests as columns (:mod:`~mars_megatron.rollout.batch`: a few
        objects to pickle, whatever the call's size), and the policy version that decoded them: the actor
        runs one call at a time, so a call never straddles a weight update (the agentic pipeline records
        this per segment). Each output its budget cut carries its next context back in the result, which
        stays in the object store for that segment's request to name."""
        self._check_whole()
        import ray

        by_reference = ray.is_initialized()  # a Ray actor: the routing stays in this node's object store
        return answer(batch, self.engine.generate, by_reference), self._version

    def process(self) -> WorkerProcess:
        """This actor's process: where it runs (the run logs its node's address), and for
        :func:`~mars_megatron.reaper.reap` if it must be given up on."""
        return whereabouts("ray::RolloutActor")

    # ------------------------------------------------------------------------------ weight transfer
    def transfer_ranks(self) -> int:
        """How many members of each transfer group this engine brings (its workers)."""
        return int(self._target().transfer_ranks)

    def join_transfer(self, groups: Mapping[int, GroupSpec], first_rank: int) -> None:
        self._target().join_transfer(groups, first_rank)

    def receive_weights(self, plan: TransferPlan, version: int) -> UpdateStats:
        """Receive and load a whole transfer; only then does the engine hold policy ``version``. If it
        fails part-way the engine keeps reporting its old version and refuses to generate
        (:class:`TornWeightsError`) until a transfer completes."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        started = time.perf_counter()
        self._torn = True
        stats = self._target().receive_weights(plan)
        self._torn = False
        self._version = version
        self._last = UpdateStats.of(version, plan, stats, time.perf_counter() - started)
        return self._last

    def receive_discard(self, plan: TransferPlan) -> UpdateStats:
        """Receive a transfer and drop it (the weights and the version stay): the link's share of a
        push, for ``tools/bench/weight_sync.py``."""
        started = time.perf_counter()
        stats = self._target().receive_weights(plan, load=False)
        return UpdateStats.of(self._version, plan, stats, time.perf_counter() - started)

    def leave_transfer(self) -> None:
        self._target().leave_transfer()

    def _target(self) -> TransferTarget:
        if not isinstance(self.engine, TransferTarget):
            raise TypeError(f"{type(self.engine).__name__} cannot receive weight transfers")
        return self.engine

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

    def shutdown(self) -> None:
        """End the engine's own workers and give back what it reserved (a vLLM engine: its workers and
        the placement group its Ray executor made, :meth:`~mars_megatron.rollout.vllm_engine.VLLMEngine.
        shutdown`), before the actor goes."""
        stop = getattr(self.engine, "shutdown", None)
        if callable(stop):
            stop()

    def set_threads(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {n}")
        torch.set_num_threads(n)


class RemoteEngine:
    """Local proxy of a :class:`RolloutActor`: a ``RolloutEngine``. Every call waits at most
    ``timeout_s`` (``pipeline.rollout_timeout_s`` in a run), then raises
    :class:`~mars_megatron.deadline.DeadlineError`: a hung engine is named instead of waited on forever."""

    def __init__(self, actor: Any, timeout_s: float = 3600.0, process: WorkerProcess | None = None) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.process = process
        """The actor's process (asked at start), ended for sure by :meth:`kill`."""

    def _get(self, ref: Any, what: str) -> Any:
        return deadline.get(ref, f"rollout engine {what}", self.timeout_s, "pipeline.rollout_timeout_s")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        return self._get(self.actor.generate.remote(list(requests)), f"generate ({len(requests)} requests)")

    def version(self) -> int:
        """The policy version the engine holds (number of commits, or the last version given)."""
        return self._get(self.actor.version.remote(), "version")

    def last_update(self) -> UpdateStats | None:
        return self._get(self.actor.last_update.remote(), "last_update")

    def set_threads(self, n: int) -> None:
        self._get(self.actor.set_threads.remote(n), "set_threads")

    def kill(self, grace_s: float = 60.0) -> None:
        """End the actor (and its engine) now, instead of when the last handle goes away: the engine
        shuts down first (within ``grace_s``; 0: not asked, for a hung one; a dead or stuck one is killed
        all the same, its process too: :func:`~mars_megatron.reaper.reap`)."""
        import contextlib

        import ray

        if grace_s > 0:
            with contextlib.suppress(Exception):  # dead already, or stuck: killed below
                ray.get(self.actor.shutdown.remote(), timeout=grace_s)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actor)
        reap(self.process)


@dataclass
class StartingEngine:
    """A :class:`RolloutActor` whose engine is being built (:func:`launch_rollout_actor`): other work can
    go on meanwhile (a run builds its trainer ranks), and :meth:`ready` waits for it."""

    actor: Any
    process: Any  # the ref of the actor's first call, answered once its engine is built
    timeout_s: float
    start_timeout_s: float

    def ready(self) -> RemoteEngine:
        """The engine's proxy once it is built; a bad model directory fails here."""
        import ray

        try:
            process = deadline.get(self.process, "a rollout engine's start", self.start_timeout_s)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"the rollout actor failed to start its engine: {e}") from None
        return RemoteEngine(self.actor, self.timeout_s, process)


def start_rollout_actor(factory: Callable[[], RolloutEngine], **options: Any) -> RemoteEngine:
    """:func:`launch_rollout_actor` and wait until the engine is built (so a bad model directory fails
    here, not at the first rollout)."""
    return launch_rollout_actor(factory, **options).ready()


def launch_rollout_actor(
    factory: Callable[[], RolloutEngine],
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    scheduling_strategy: Any = None,
    timeout_s: float = 3600.0,
    start_timeout_s: float = 3600.0,
) -> StartingEngine:
    """Start a :class:`RolloutActor` running ``factory()``, without waiting for its engine.
    ``threads`` defaults to ``num_cpus``; ``start_timeout_s`` bounds the start (a process, its imports
    and the model's load: minutes for a large model), ``timeout_s`` every call of the proxy."""
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
    return StartingEngine(actor, actor.process.remote(), timeout_s, start_timeout_s)
