"""Engines for the fleet's tests (Ray actors import them by module path): the transformers engine with
one fault each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mars_megatron.rollout.hf_engine import HFEngine
from mars_megatron.transfer.group import GroupSpec


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
