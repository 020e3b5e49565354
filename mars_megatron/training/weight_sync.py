"""A trainer rank's part in pushing a policy's weights to its rollout engines.

Every rank walks the export (:func:`~mars_megatron.conversion.model_io.export_at_senders`): the holders of a
parameter gather it over their TP/expert-TP group, and its *sender* (the lowest rank holding it in
TP/expert-TP rank 0 of data-parallel replica 0: one per pipeline stage and expert-parallel rank) packs it
into a bucket and broadcasts the bucket over its transfer group (:mod:`mars_megatron.transfer`) to every
worker of every engine at once. Nothing goes through rank 0 or the Ray object store (on GPUs nothing
is copied to the host either); a sender holds at most two buckets beyond the model.

The orchestrating driver (:class:`~mars_megatron.pipeline.fleet.EngineFleet`) asks each rank for the
plan once, has the senders and the engines join the groups, then calls :meth:`WeightSender.send` on all
ranks while the engines receive.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from mars_megatron.comm.collectives import comm_device
from mars_megatron.conversion.model_io import ExportStep, export_at_senders, export_senders, plan_export
from mars_megatron.models.hf_config import Qwen3Arch
from mars_megatron.transfer.channel import TransferStats, send_buckets
from mars_megatron.transfer.group import GroupSpec, TransferGroup
from mars_megatron.transfer.ipc import ColocatedSpec, Publisher, colocated_send
from mars_megatron.transfer.plan import TensorSpec, TransferPlan, dtype_name, plan_buckets

DEFAULT_BUCKET_BYTES = 512 * 1024**2


class WeightSender:
    """One policy's weight push on this trainer rank (construct it on every rank)."""

    def __init__(self, arch: Qwen3Arch, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.arch = arch
        self.bucket_bytes = bucket_bytes
        self._steps: tuple[int, list[ExportStep]] | None = None  # (id of the model, its export plan)
        self._plan: TransferPlan | None = None
        self._group: TransferGroup | None = None
        self._copies: frozenset[str] | None = None  # names the export hands out as copies (learnt)
        self._colocated: dict[int, TransferGroup] | None = None  # colocated: groups by sender
        self._publisher: Publisher | None = None  # colocated: this rank hosts engine workers

    def plan(self, model: Any) -> TransferPlan:
        """Collective the first time (resolves who sends what): the bucket plan, the same on every rank."""
        if self._steps is None or self._steps[0] != id(model):
            steps = plan_export(model, self.arch)
            dtype = dtype_name(next(iter(getattr(model, "module", model).parameters())).dtype)
            specs = [TensorSpec(n, tuple(s), dtype, r) for n, s, r in export_senders(steps)]
            self._steps = (id(model), steps)
            self._plan = plan_buckets(specs, self.bucket_bytes)
        assert self._plan is not None
        return self._plan

    def join(self, groups: Mapping[int, GroupSpec] | ColocatedSpec) -> None:
        """Join the transfer group this rank sends on (``groups``: by sending global rank), leaving any
        earlier one; ranks that send nothing do nothing. Blocks until every member joined.

        Colocated engines (a :class:`~mars_megatron.transfer.ipc.ColocatedSpec`): every sender's group
        spans the sender and the ranks hosting engine workers, and hosts publish handles to them."""
        self.leave()
        me = dist.get_rank()
        if isinstance(groups, ColocatedSpec):
            self._colocated = {}
            for sender in sorted(groups.groups):
                members = groups.members[sender]
                if me in members:
                    self._colocated[sender] = TransferGroup(groups.groups[sender], members.index(me))
            if me in groups.publishers:
                self._publisher = Publisher(groups.publishers[me])
            return
        if me in groups:
            self._group = TransferGroup(groups[me], rank=0)

    def leave(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        for group in (self._colocated or {}).values():
            group.close()
        self._colocated, self._publisher = None, None

    def send(self, model: Any, raw: bool = False) -> TransferStats | None:
        """Collective over the trainer ranks: broadcast this rank's buckets (senders) or take part in the
        gathers (everyone). Returns this sender's stats, None on ranks that send nothing. A failure
        closes this rank's group, so that receivers waiting on it fail at once instead of timing out.
        ``raw``: broadcast buckets of the same sizes with nothing exported into them (the wire-speed
        baseline of ``tools/bench/weight_sync.py``; not collective over the trainer ranks)."""
        plan = self.plan(model)
        assert self._steps is not None
        me = dist.get_rank()
        if raw:
            stream: Any = ((t.name, None) for t in plan.tensors)
        else:
            stream = export_at_senders(model, self.arch, self._steps[1])
        if self._colocated is not None:
            return self._send_colocated(model, plan, stream)
        if me not in plan.senders:
            for _ in stream:  # the gathers need every holder
                pass
            return None
        if self._group is None:
            raise RuntimeError(f"rank {me} sends weights but joined no transfer group (join first)")
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        copied: set[str] = set()
        try:
            stats = send_buckets(
                self._group,
                plan,
                me,
                stream,
                owned=lambda t: t.untyped_storage().data_ptr() in storages,
                copies=frozenset() if raw else self._copies,
                copied=copied,
            )
        except BaseException:
            self.leave()
            for _ in stream:  # finish the walk: the other trainer ranks still gather with this one
                pass
            raise
        if not raw:  # the first push treats every tensor as a possible copy; later ones know which are
            self._copies = frozenset(copied)
        return stats

    def _send_colocated(self, model: Any, plan: TransferPlan, stream: Any) -> TransferStats | None:
        """Every rank walks; senders broadcast to the hosting ranks, hosts publish to their workers."""
        assert self._colocated is not None
        me = dist.get_rank()
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        device = comm_device(None)
        try:
            stats = colocated_send(
                self._colocated,
                plan,
                me,
                stream,
                self._publisher,
                device,
                owned=lambda t: t.untyped_storage().data_ptr() in storages,
            )
        except BaseException:
            self.leave()
            for _ in stream:
                pass
            raise
        return stats if me in plan.senders else None


class SendsWeights:
    """The trainer side of :class:`~mars_megatron.pipeline.fleet.EngineFleet`, for a trainer-rank worker
    (a Ray actor per rank): the methods the fleet calls on every rank. The worker provides
    :meth:`weight_senders`, its policies' models and senders by policy name."""

    def weight_senders(self) -> dict[str, tuple[Any, WeightSender]]:
        raise NotImplementedError

    def transfer_plans(self) -> dict[str, TransferPlan]:
        """Collective: every policy's bucket plan (the same on all ranks)."""
        return {name: sender.plan(model) for name, (model, sender) in self.weight_senders().items()}

    def join_transfer(self, policy: str, groups: Mapping[int, GroupSpec] | ColocatedSpec) -> None:
        """This rank joins ``policy``'s transfer groups (:meth:`WeightSender.join`)."""
        self.weight_senders()[policy][1].join(groups)

    def send_weights(self, policy: str, raw: bool = False) -> dict[str, float] | None:
        """Collective: broadcast ``policy``'s weights to its engines, which receive at the same time
        (``raw``: :meth:`WeightSender.send`)."""
        model, sender = self.weight_senders()[policy]
        return stats_dict(sender.send(model, raw=raw))

    def leave_transfer(self, policy: str) -> None:
        self.weight_senders()[policy][1].leave()

    def release_device_memory(self) -> tuple[int, int] | None:
        """Give the memory this rank's allocator caches but does not use back to the device, and say
        what is free: ``(free, total)`` bytes of its GPU, None without one. The fleet calls it before a
        colocated engine is replaced, since the new engine sizes itself by what is free on this GPU."""
        import torch

        if not torch.cuda.is_available():
            return None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)


def stats_dict(stats: TransferStats | None) -> dict[str, float] | None:
    """Plain numbers for the driver's metrics (Ray returns them from every rank)."""
    if stats is None:
        return None
    return {
        "buckets": float(stats.buckets),
        "tensors": float(stats.tensors),
        "bytes": float(stats.bytes),
        "seconds": stats.seconds,
        "peak_bytes": float(stats.peak_bytes),
    }
