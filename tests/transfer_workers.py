"""Processes for the transfer-channel tests: a sender broadcasting seeded tensors, receivers checking
them (spawned processes import these by module path); on GPUs, an NCCL member that stalls."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Mapping
from typing import Any

import torch

from mars_megatron.transfer.channel import receive_buckets, send_buckets
from mars_megatron.transfer.group import BACKSTOP, GroupSpec, TransferGroup, TransferTimeout
from mars_megatron.transfer.plan import TensorSpec, TransferPlan, torch_dtype


def seeded(spec: TensorSpec) -> torch.Tensor:
    """The value of every test tensor, a function of its name only."""
    g = torch.Generator().manual_seed(sum(map(ord, spec.name)) * 7919 + len(spec.name))
    return torch.randn(spec.shape, generator=g).to(torch_dtype(spec.dtype))


def send(groups: Mapping[int, GroupSpec], plan: TransferPlan, me: int, out: Any) -> None:
    """Sender ``me``: broadcast my buckets of ``plan``; put ``("ok", stats)`` or ``("error", text)``."""
    try:
        torch.set_num_threads(1)
        group = TransferGroup(groups[me], 0)
        stream = ((t.name, seeded(t) if t.sender == me else None) for t in plan.tensors)
        out.put(("ok", send_buckets(group, plan, me, stream)))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def receive(
    groups: Mapping[int, GroupSpec], plan: TransferPlan, rank: int, out: Any, die_at_bucket: int = -1
) -> None:
    """Receiver ``rank``: take every bucket and compare each tensor with its seeded value; with
    ``die_at_bucket`` >= 0, exit abruptly (like a killed process) while loading that bucket."""
    try:
        torch.set_num_threads(1)
        joined = {s: TransferGroup(spec, rank) for s, spec in sorted(groups.items())}
        specs = {t.name: t for t in plan.tensors}
        seen = [0, 0]  # buckets, mismatches

        def load(named: list[tuple[str, torch.Tensor]]) -> int:
            if seen[0] == die_at_bucket:
                os._exit(3)
            seen[0] += 1
            for name, tensor in named:
                if not torch.equal(tensor, seeded(specs[name])):
                    seen[1] += 1
            return len(named)

        stats = receive_buckets(joined, plan, load)
        out.put(("ok", stats, seen[1]))
    except BaseException:
        out.put(("error", traceback.format_exc(), -1))


def nccl_member_stalls(spec: GroupSpec, rank: int, out: Any) -> None:
    """GPU ``rank`` of a two-member NCCL transfer group: rank 1 joins, then takes part in nothing (a dead
    member, as NCCL sees one); rank 0 broadcasts, reports how long its wait took to give up, that its
    GPU still computes, and that it is still alive after the group's NCCL watchdog timeout has passed."""
    try:
        torch.cuda.set_device(rank)
        group = TransferGroup(spec, rank)
        if rank == 1:
            out.put(("joined", rank))
            time.sleep(spec.timeout_s * (BACKSTOP + 2))
            return
        start = time.monotonic()
        try:
            # 256 MiB: more than NCCL buffers for the peer, so the root cannot finish without it
            group.broadcast(torch.ones(1 << 26, device="cuda"), src=0).wait()
            out.put(("completed", rank))
            return
        except TransferTimeout:
            took = time.monotonic() - start
        group.close()
        total = float(torch.ones(1024, device="cuda").sum().item())
        time.sleep(spec.timeout_s * BACKSTOP + 5)  # past the watchdog's timeout of the group
        out.put(("timed out", took, total))
    except BaseException:
        out.put(("error", traceback.format_exc()))
