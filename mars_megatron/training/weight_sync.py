"""Trainer → rollout engine weight sync.

Every trainer rank takes part (the export gathers TP/EP/PP shards with collectives); global rank 0 holds
the engine and hands it the export as *one stream* of full HF-named tensors. One call, not buckets:
vLLM's in-place reload processes a layer once all of its weights arrived within a call (measured: split
calls leave layers half-loaded and produce NaNs), and a stream keeps rank 0's memory at one tensor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from checkpoints_conversion.model_io import ExportStep, export_weights, plan_export
from mars_megatron.rollout.engine import WeightUpdatable
from mars_megatron.training.hf_config import Qwen3Arch


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved; ``version`` is the policy version the engine now holds."""

    version: int
    tensors: int
    bytes: int
    seconds: float


class WeightSync:
    """Pushes the trainer's weights into a rollout engine and counts policy versions.

    Construct it on every trainer rank; pass the engine only on global rank 0 (``None`` elsewhere).
    """

    def __init__(self, arch: Qwen3Arch, engine: WeightUpdatable | None) -> None:
        if (engine is not None) != (dist.get_rank() == 0):
            raise ValueError("the engine must be given on global rank 0 and only there")
        self.arch = arch
        self.engine = engine
        self.version = 0
        self._plan: tuple[int, list[ExportStep]] | None = None  # (id of the model, its export plan)

    def sync(self, model: Any) -> SyncStats:
        """Collective: export ``model`` into the engine; returns the new policy version and what moved."""
        start = time.perf_counter()
        counts = [0, 0]

        def counted(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                counts[0] += 1
                counts[1] += tensor.numel() * tensor.element_size()
                yield name, tensor

        if self._plan is None or self._plan[0] != id(model):
            self._plan = (id(model), plan_export(model, self.arch))  # collective, once per model
        stream = export_weights(model, self.arch, self._plan[1])
        if self.engine is not None:
            if _takes_version(self.engine):  # Ray engines: set the version (a restarted one starts at 0)
                self.engine.update_weights(counted(stream), version=self.version + 1)  # type: ignore[call-arg]
            else:
                self.engine.update_weights(counted(stream))
        else:
            for _ in stream:  # take part in the gathers and sends
                pass
        self.version += 1
        return SyncStats(self.version, counts[0], counts[1], time.perf_counter() - start)


def _takes_version(engine: Any) -> bool:
    import inspect

    return "version" in inspect.signature(engine.update_weights).parameters
