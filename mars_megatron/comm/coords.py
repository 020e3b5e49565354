"""Where each rank sits in Megatron's process groups, gathered on every rank.

Why here, below ``conversion`` and ``training``: the weight export (``conversion/model_io.py``) finds each
tensor's sender from every rank's coordinates, and the export must not depend on the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class RankCoords:
    """Where this rank sits in every megatron group; gathered once so any rank can find a tensor's owner."""

    rank: int
    pp: int
    tp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int


def rank_coords() -> RankCoords:
    from megatron.core import parallel_state as ps

    return RankCoords(
        rank=dist.get_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(),
        edp=ps.get_expert_data_parallel_rank(),
    )


def all_rank_coords() -> list[RankCoords]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank_coords())
    return gathered
