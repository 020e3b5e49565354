"""The two ends of a weight transfer: a trainer rank broadcasting its buckets, an engine worker receiving
every bucket and loading it. Each end holds at most two buckets at a time (one on the wire, one being
packed or loaded), whatever the size of the model.

The memory these ends hold is *counted*, not inferred from a process's RSS: every buffer is allocated
here and recorded in a :class:`MemoryTally`, and the sender also counts the full tensors the export
gathered for it (they are new memory, unlike parameters it sends as they are).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mars_megatron.transfer.group import TransferGroup
from mars_megatron.transfer.plan import Bucket, TransferPlan, torch_dtype, unpack

MAX_IN_FLIGHT = 2


@dataclass
class MemoryTally:
    """Bytes a transfer end holds now and at most, beyond the model it sends from or loads into."""

    live: int = 0
    peak: int = 0

    def hold(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        self.live -= nbytes

    def transient(self, nbytes: int) -> None:
        """Memory held only for a moment on top of what is live (a gathered tensor being packed)."""
        self.peak = max(self.peak, self.live + nbytes)


@dataclass(frozen=True)
class TransferStats:
    """What one end of one transfer moved, how long it took, and the most memory it held."""

    buckets: int
    tensors: int
    bytes: int
    seconds: float
    peak_bytes: int


class BucketBuffers:
    """The bucket buffers a sending rank holds: at most :data:`MAX_IN_FLIGHT`, each until the work that
    reads it (its broadcast) ended and ``on_release(k)`` returned (colocated: every worker acknowledged
    it). Buckets are named by their index in the plan; ``slot`` places each tensor ``sender`` sends."""

    def __init__(
        self,
        plan: TransferPlan,
        sender: int,
        allocate: Callable[[int], torch.Tensor],
        on_release: Callable[[int], None] | None = None,
    ) -> None:
        self.buckets = plan.buckets
        self.slot = {
            spec.name: (k, off, spec)
            for k, b in enumerate(plan.buckets)
            if b.sender == sender
            for spec, off in zip(b.tensors, b.offsets, strict=True)
        }
        self.allocate, self.on_release = allocate, on_release
        self.tally = MemoryTally()
        self._buffers: dict[int, torch.Tensor] = {}
        self._held: collections.deque[tuple[Any, int]] = collections.deque()

    def get(self, k: int, copy_held: int = 0) -> torch.Tensor:
        """Bucket ``k``'s buffer, allocated on first use once at most one other bucket is held (none
        while a gathered copy of ``copy_held`` bytes waits to be packed: it counts as one)."""
        if k not in self._buffers:
            while len(self._buffers) + (1 if copy_held else 0) >= MAX_IN_FLIGHT and self._held:
                self.release_oldest()
            self._buffers[k] = self.allocate(self.buckets[k].nbytes)
            self.tally.hold(self.buckets[k].nbytes)
        return self._buffers[k]

    def hold(self, k: int, work: Any) -> None:
        """Keep bucket ``k`` until ``work`` (None: nothing) is done."""
        self._held.append((work, k))

    def release_oldest(self) -> None:
        work, k = self._held.popleft()
        if work is not None:
            work.wait()
        if self.on_release is not None:
            self.on_release(k)
        self.tally.release(self.buckets[k].nbytes)
        del self._buffers[k]

    def make_room(self) -> None:
        """Release until at most one bucket is held (before the export makes a copy)."""
        while len(self._buffers) >= MAX_IN_FLIGHT and self._held:
            self.release_oldest()

    def drain(self) -> None:
        while self._held:
            self.release_oldest()

    def pack(self, name: str, tensor: torch.Tensor, owned: Callable[[torch.Tensor], bool]) -> int:
        """Copy ``tensor`` into its place in its bucket; returns the bytes of the copy the export made of
        it (0 for memory of the model itself), which is counted with the buffers live while it existed."""
        k, off, spec = self.slot[name]
        fresh = 0 if owned(tensor) else tensor.numel() * tensor.element_size()
        self.tally.transient(fresh)  # as handed out: with the buffers live while it was gathered
        target = self.get(k, fresh)
        self.tally.transient(fresh)
        target[off : off + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape).copy_(tensor)
        return fresh


def send_buckets(
    group: TransferGroup,
    plan: TransferPlan,
    sender: int,
    stream: Iterable[tuple[str, torch.Tensor | None]],
    *,
    owned: Callable[[torch.Tensor], bool] = lambda t: False,
    copies: Collection[str] | None = None,
    copied: set[str] | None = None,
) -> TransferStats:
    """Broadcast ``sender``'s buckets of ``plan`` over ``group`` (as its rank 0).

    ``stream``: every tensor of the plan in plan order, as ``(name, tensor)`` where this rank sends it and
    ``(name, None)`` elsewhere; the walk must reach each bucket's due position before it is broadcast
    (:mod:`~mars_megatron.transfer.plan`). ``owned(t)``: whether ``t`` is memory of the model itself (a
    parameter sent as is) rather than a copy the export made (a TP gather, a re-laid-out QKV).

    Memory: before pulling a tensor the stream will hand out as a copy (``copies``: their names; None =
    any may be), the sender waits until at most one bucket is held, so buffers and the copy together
    stay within two buckets; otherwise the next bucket is packed while the previous one is on the wire.
    ``copied``: filled with the names that came out as copies, to pass as ``copies`` next time."""
    start = time.perf_counter()
    mine = [k for k, b in enumerate(plan.buckets) if b.sender == sender]
    pool = BucketBuffers(plan, sender, lambda n: torch.empty(n, dtype=torch.uint8, device=group.device))
    launched = 0
    tensors = 0

    def launch(k: int) -> None:
        buf = pool.get(k)  # a bucket of nothing but empty tensors still goes out: receivers expect it
        pool.hold(k, group.broadcast(buf, src=0))

    def pulled(
        source: Iterable[tuple[str, torch.Tensor | None]],
    ) -> Iterable[tuple[str, torch.Tensor | None]]:
        for position, item in enumerate(source):
            yield item
            following = position + 1
            if following < len(plan.tensors) and plan.tensors[following].name in pool.slot:
                if copies is None or plan.tensors[following].name in copies:
                    pool.make_room()

    for position, (name, tensor) in enumerate(pulled(stream)):
        if plan.tensors[position].name != name:
            raise RuntimeError(
                f"weight transfer: export gave {name!r} at position {position}, the plan "
                f"{plan.tensors[position].name!r}"
            )
        while launched < len(mine) and plan.buckets[mine[launched]].due <= position:
            launch(mine[launched])
            launched += 1
        if tensor is None:
            continue
        if name not in pool.slot:
            raise RuntimeError(f"weight transfer: rank {sender} got {name!r}, which another rank sends")
        if pool.pack(name, tensor, owned) and copied is not None:
            copied.add(name)
        tensors += 1
    while launched < len(mine):
        launch(mine[launched])
        launched += 1
    pool.drain()
    group.synchronize()  # the time is the wire's: every broadcast completed on the device
    nbytes = sum(t.nbytes for k in mine for t in plan.buckets[k].tensors)
    return TransferStats(len(mine), tensors, nbytes, time.perf_counter() - start, pool.tally.peak)


def receive_buckets(
    groups: Mapping[int, TransferGroup],
    plan: TransferPlan,
    load: Callable[[Sequence[tuple[str, torch.Tensor]]], int],
) -> TransferStats:
    """Receive every bucket of ``plan`` (from each bucket's sender, over ``groups[sender]``) and ``load``
    it; the next bucket is on the wire while this one loads. Returns what arrived and the peak bytes the
    buffers held (``load`` must copy what it keeps: the buffer is dropped after it returns)."""
    start = time.perf_counter()
    tally = MemoryTally()
    buckets = list(plan.buckets)

    def post(bucket: Bucket) -> tuple[Any, torch.Tensor]:
        group = groups[bucket.sender]
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
        tally.hold(bucket.nbytes)
        return group.broadcast(buf, src=0), buf

    pending = post(buckets[0]) if buckets else None
    loaded = 0
    for i, bucket in enumerate(buckets):
        assert pending is not None
        work, buf = pending
        work.wait()
        pending = post(buckets[i + 1]) if i + 1 < len(buckets) else None
        loaded += load(unpack(bucket, buf))
        del buf, work
        tally.release(bucket.nbytes)
    if loaded != len(plan.tensors):
        raise RuntimeError(f"weight transfer: loaded {loaded} tensors, the plan has {len(plan.tensors)}")
    for group in groups.values():  # the loads queued behind the last bucket finished too
        group.synchronize()
    return TransferStats(len(buckets), loaded, plan.nbytes, time.perf_counter() - start, tally.peak)
