"""Colocated engines: bucket buffers handed over by memory handle instead of over the wire.

A colocated engine worker shares its GPU with a trainer rank, and NCCL refuses two members of one
communicator on one device, so the broadcast groups of :mod:`.group` cannot include it. Instead:

1. each sender broadcasts its buckets to the trainer ranks that *host* engine workers (one group per
   sender over the sender and the other hosts: distinct GPUs, so NCCL is fine);
2. each host publishes a handle of the bucket buffer on its own GPU through the store (CUDA IPC: the
   worker maps the very memory, no copy) and its workers load from it and acknowledge;
3. the host frees the buffer once every worker acknowledged.

The same code runs on CPU with POSIX shared memory handles instead of CUDA IPC (the tests). Handles
travel as JSON of plain fields, rebuilt with the storage constructors torch itself uses for IPC: nothing
read from the store is unpickled.

A CUDA handle names its GPU by UUID, never by device index: an index only means something inside one
process. A trainer rank sees its GPU as ``cuda:0`` (``CUDA_VISIBLE_DEVICES`` narrowed to it), while
vLLM's Ray workers (``RayExecutorV2``) leave ``CUDA_VISIBLE_DEVICES`` unset and see every GPU of the
node, so index 0 in the trainer's handle is the node's first GPU in a worker: it would map the bucket
through another GPU (an extra CUDA context there, copies over the bus, or failure without peer access).
The opener finds the UUID among the devices it can see (:func:`local_device_index`).

Every reader of a bucket opens a handle of its own. A CUDA handle carries a reference counter in shared
memory that ``storage._share_cuda_()`` creates at 1 for exactly one opener: the opener's mapping
decrements it when freed, and the producer's allocation is released once it reads 0 (held in torch's
"limbo" until then, ``torch.cuda.ipc_collect``). Two readers of one handle would take it to -1, which the
unsigned counter reads as a huge count, and the producer's buffer would stay allocated for good, silently.
So the host shares the buffer once per reader (as ``torch.multiprocessing`` does once per send), and each
reader claims one of those handles through the store. Shared-memory handles (CPU) count their openers
themselves; they take the same path.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.transfer.channel import BucketBuffers, MemoryTally, TransferStats
from mars_megatron.transfer.group import STORE_PREFIX, GroupSpec
from mars_megatron.transfer.plan import unpack


@dataclass(frozen=True)
class ColocatedSpec:
    """A policy's colocated transfer, as the trainer ranks join it."""

    groups: dict[int, GroupSpec]
    """Per sender: its group over the sender (rank 0) and the other hosting ranks; absent when the sender
    is the only host."""
    members: dict[int, tuple[int, ...]]
    """Per sender with a group: the global trainer ranks of its group in group-rank order."""
    publishers: dict[int, GroupSpec]
    """Per hosting trainer rank: where it publishes handles (backend ``ipc``; ``world`` = 1 + workers)."""


def share_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A byte buffer other processes of this node can map: shared memory on the host, any CUDA
    allocation on a GPU (CUDA IPC shares the allocator's block)."""
    if device.type == "cpu":
        storage = torch.UntypedStorage(nbytes)
        # into shared memory now, while nothing uses it: sharing later would move the bytes under a
        # broadcast that is reading them
        storage._share_filename_cpu_()
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _b64(x: bytes) -> str:
    return base64.b64encode(x).decode("ascii")


def gpu_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index``: the one name of a GPU that every process on the
    node shares, whatever devices it was given to see."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of the CUDA devices this process sees, by local index."""
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())]


def _uuid_key(uuid: str) -> str:
    # nvidia-smi and CUDA_VISIBLE_DEVICES write "GPU-<uuid>", torch the bare hex form
    key = uuid.strip().lower()
    return key[4:] if key.startswith("gpu-") else key


def local_device_index(uuid: str, visible: Sequence[str]) -> int:
    """This process's index of the GPU named ``uuid``, given the UUIDs of its visible devices by index
    (:func:`visible_gpu_uuids`). Fails, naming the UUID, when this process cannot see that GPU."""
    key = _uuid_key(uuid)
    for index, candidate in enumerate(visible):
        if _uuid_key(candidate) == key:
            return index
    seen = ", ".join(f"cuda:{i}={u}" for i, u in enumerate(visible)) or "none"
    raise RuntimeError(
        f"weight transfer: the bucket's GPU {uuid} is not visible to this process (it sees {seen}); a "
        "colocated engine worker must see the GPU of the trainer rank it shares (CUDA_VISIBLE_DEVICES)"
    )


def cuda_fields(shared: Sequence[Any], uuid: str) -> dict[str, Any]:
    """The JSON fields of a CUDA handle from ``storage._share_cuda_()`` on the GPU named ``uuid``. The
    producer's device index (``shared[0]``) is left out on purpose: it means another GPU elsewhere."""
    _, handle, size, offset, rc_handle, rc_offset, event, sync = shared
    return {
        "kind": "cuda",
        "uuid": uuid,
        "handle": _b64(handle),
        "size": int(size),
        "offset": int(offset),
        "rc_handle": _b64(rc_handle),
        "rc_offset": int(rc_offset),
        "event": _b64(event),
        "sync": bool(sync),
    }


def cuda_open_args(fields: Mapping[str, Any], visible: Sequence[str]) -> tuple[Any, ...]:
    """The arguments of ``torch.UntypedStorage._new_shared_cuda`` for a handle's ``fields``
    (:func:`cuda_fields`), opened on this process's own index of the handle's GPU."""
    uuid = fields.get("uuid")
    if not isinstance(uuid, str) or not uuid:
        raise ValueError(
            "weight transfer: a CUDA buffer handle without its GPU's uuid (from an older mars-megatron?); "
            "the device index alone names different GPUs in different processes"
        )
    return (
        local_device_index(uuid, visible),
        base64.b64decode(fields["handle"]),
        int(fields["size"]),
        int(fields["offset"]),
        base64.b64decode(fields["rc_handle"]),
        int(fields["rc_offset"]),
        base64.b64decode(fields["event"]),
        bool(fields["sync"]),
    )


def handle_of(buffer: torch.Tensor) -> str:
    """The JSON handle of ``buffer`` (from :func:`share_buffer`)."""
    storage = buffer.untyped_storage()
    if buffer.device.type == "cpu":
        manager, name, size = storage._share_filename_cpu_()
        fields: dict[str, Any] = {"kind": "shm", "manager": _b64(manager), "name": _b64(name), "size": size}
    else:
        index = buffer.device.index if buffer.device.index is not None else torch.cuda.current_device()
        fields = cuda_fields(storage._share_cuda_(), gpu_uuid(index))
    fields.update(byte_offset=buffer.storage_offset(), nbytes=buffer.numel())
    return json.dumps(fields)


def open_handle(text: str) -> torch.Tensor:
    """The buffer a handle from :func:`handle_of` names, mapped into this process (bytes, 1-D); a CUDA
    buffer on this process's index of the producer's GPU."""
    f = json.loads(text)
    if not isinstance(f, dict) or f.get("kind") not in ("shm", "cuda"):
        raise ValueError("weight transfer: malformed buffer handle in the store")
    if f["kind"] == "shm":
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            base64.b64decode(f["manager"]), base64.b64decode(f["name"]), int(f["size"])
        )
    else:
        storage = torch.UntypedStorage._new_shared_cuda(*cuda_open_args(f, visible_gpu_uuids()))
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return whole[int(f["byte_offset"]) : int(f["byte_offset"]) + int(f["nbytes"])]


def _store(spec: GroupSpec) -> Any:
    store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
    return store, dist.PrefixStore(f"{STORE_PREFIX}/{spec.key}", store)


def handle_key(round_: int, index: int, slot: int) -> str:
    """The store key of reader ``slot``'s (1-based) handle of bucket ``index`` in push ``round_``. Slot 1
    reads the bucket's own key, the only one when a host has one worker."""
    return f"r{round_}/b{index}" + (f"/h{slot}" if slot > 1 else "")


class Publisher:
    """A hosting trainer rank's side: publish each bucket's handles, one per worker (module docstring),
    wait until every worker loaded it.

    Keys carry the push's round (counted on both sides: a failed push rebuilds the channel under a new
    key), so an acknowledgement of one push is never taken for the next one's."""

    def __init__(self, spec: GroupSpec) -> None:
        self.readers = spec.world - 1
        self.timeout_s = spec.timeout_s
        self.round = 0
        self._base, self.store = _store(spec)

    def begin(self) -> None:
        self.round += 1

    def publish(self, index: int, buffer: torch.Tensor) -> None:
        if buffer.device.type == "cuda":
            torch.cuda.current_stream(buffer.device).synchronize()  # the bytes are there before the handle
        for slot in range(1, self.readers + 1):  # a CUDA handle with its own reference counter each
            self.store.set(handle_key(self.round, index, slot), handle_of(buffer))

    def wait(self, index: int) -> None:
        """Block until every reader acknowledged bucket ``index`` (then the buffer may be freed)."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        ack = f"r{self.round}/a{index}"
        while int(self.store.add(ack, 0)) < self.readers:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"weight transfer: {self.readers} colocated worker(s) did not load bucket {index} within "
                    f"{self.timeout_s:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        for slot in range(1, self.readers + 1):
            self.store.delete_key(handle_key(self.round, index, slot))
        if self.readers > 1:
            self.store.delete_key(f"r{self.round}/c{index}")
        self.store.delete_key(ack)


class Subscriber:
    """An engine worker's side: claim a handle of each bucket its host published, map it, load it,
    acknowledge. ``slots``: the slot this worker claimed per bucket of the current push."""

    def __init__(self, spec: GroupSpec) -> None:
        self.readers = spec.world - 1
        self.round = 0
        self.slots: dict[int, int] = {}
        self._base, self.store = _store(spec)

    def begin(self) -> None:
        self.round += 1
        self.slots = {}

    def claim(self, index: int) -> int:
        """This worker's slot among bucket ``index``'s handles: the store's counter hands out 1, 2, ...
        (one reader: slot 1 without asking)."""
        slot = 1 if self.readers == 1 else int(self.store.add(f"r{self.round}/c{index}", 1))
        if slot > self.readers:
            raise RuntimeError(
                f"weight transfer: bucket {index} claimed by more colocated workers than the {self.readers} "
                "its host publishes handles for (the host's ipc GroupSpec.world is 1 + its workers)"
            )
        self.slots[index] = slot
        return slot

    def take(self, index: int) -> torch.Tensor:
        key = handle_key(self.round, index, self.claim(index))
        self.store.wait([key])
        return open_handle(self.store.get(key).decode())

    def done(self, index: int) -> None:
        self.store.add(f"r{self.round}/a{index}", 1)


def colocated_send(
    groups: dict[int, Any],
    plan: Any,
    me: int,
    stream: Any,
    publisher: Publisher | None,
    device: torch.device,
    *,
    owned: Any = lambda t: False,
) -> Any:
    """This trainer rank's part of a colocated transfer (every rank runs it; module docstring).

    ``groups``: this rank's memberships by sender (as rank 0 of its own, as a receiver of the others'
    when it hosts workers); ``publisher``: set when this rank hosts engine workers. Buckets are handled in
    the plan's global order as they fall due, so the walk is deadlock-free as in
    :func:`~mars_megatron.transfer.channel.send_buckets`; at most two buffers are held (a bucket stays
    held until its broadcast ended and every local worker acknowledged it)."""
    start = time.perf_counter()
    if publisher is not None:
        publisher.begin()
    buckets = list(plan.buckets)
    pool = BucketBuffers(
        plan, me, lambda n: share_buffer(n, device), publisher.wait if publisher is not None else None
    )
    handled = 0
    tensors = 0

    def handle(k: int) -> None:
        b = buckets[k]
        if b.sender == me:
            buf = pool.get(k)
            work = groups[me].broadcast(buf, src=0) if me in groups else None
        elif publisher is not None and b.sender in groups:
            buf = pool.get(k)
            groups[b.sender].broadcast(buf, src=0).wait()
            work = None
        else:
            return  # neither sender nor host: nothing to do with this bucket
        if publisher is not None:
            publisher.publish(k, buf)
        pool.hold(k, work)

    for position, (name, tensor) in enumerate(stream):
        while handled < len(buckets) and buckets[handled].due <= position:
            handle(handled)
            handled += 1
        if tensor is None:
            continue
        pool.pack(name, tensor, owned)
        tensors += 1
    while handled < len(buckets):
        handle(handled)
        handled += 1
    pool.drain()
    mine = [b for b in buckets if b.sender == me]
    nbytes = sum(t.nbytes for b in mine for t in b.tensors)
    return TransferStats(len(mine), tensors, nbytes, time.perf_counter() - start, pool.tally.peak)


def colocated_receive(subscriber: Subscriber, plan: Any, load: Any) -> Any:
    """An engine worker's side: load every bucket straight from its host's buffer, in plan order."""
    start = time.perf_counter()
    tally = MemoryTally()
    loaded = 0
    subscriber.begin()
    for k, bucket in enumerate(plan.buckets):
        view = subscriber.take(k)
        tally.hold(bucket.nbytes)  # mapped, not copied: counted while it is held all the same
        loaded += load(unpack(bucket, view))
        del view
        tally.release(bucket.nbytes)
        subscriber.done(k)
    return TransferStats(len(plan.buckets), loaded, plan.nbytes, time.perf_counter() - start, tally.peak)
