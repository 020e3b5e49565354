"""Processes for the transfer-channel tests: a sender broadcasting seeded tensors, receivers checking
them (spawned processes import these by module path); an engine that fails its first join."""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from typing import Any

import torch

from mars_megatron.rollout.hf_engine import HFEngine
from mars_megatron.transfer.channel import receive_buckets, send_buckets
from mars_megatron.transfer.group import GroupSpec, TransferGroup
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


class NoShowHFEngine(HFEngine):
    """A transformers engine that does not take part in its first join (its worker fails before it
    reaches the groups), then joins like any other."""

    def __init__(self, model_dir: str, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self.joins = 0

    def join_transfer(self, groups: Mapping[int, GroupSpec], first_rank: int) -> None:
        self.joins += 1
        if self.joins == 1:
            raise RuntimeError("this worker could not reach its transfer groups")
        super().join_transfer(groups, first_rank)
