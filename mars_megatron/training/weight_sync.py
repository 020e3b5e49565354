"""Trainer → rollout engine weight sync.

Every trainer rank takes part (the export gathers TP/EP/PP shards with collectives); global rank 0 holds
the engine and receives full HF-named tensors one at a time, which it hands to the engine in buckets of
about ``bucket_bytes``. Buckets bound the memory on rank 0 to one bucket, and amortise the engine's
per-call cost (vLLM's reload walks its layers once per call).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from checkpoints_conversion.model_io import export_weights
from mars_megatron.rollout.engine import WeightUpdatable
from mars_megatron.training.hf_config import Qwen3Arch


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved; ``version`` is the policy version the engine now holds."""

    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float


def buckets(
    named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into lists of about ``bucket_bytes`` (a larger tensor forms its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class WeightSync:
    """Pushes the trainer's weights into a rollout engine and counts policy versions.

    Construct it on every trainer rank; pass the engine only on global rank 0 (``None`` elsewhere).
    """

    def __init__(
        self, arch: Qwen3Arch, engine: WeightUpdatable | None, *, bucket_bytes: int = 256 * 2**20
    ) -> None:
        if (engine is not None) != (dist.get_rank() == 0):
            raise ValueError("the engine must be given on global rank 0 and only there")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.arch = arch
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.version = 0

    def sync(self, model: Any) -> SyncStats:
        """Collective: export ``model`` and load it into the engine; returns the new policy version."""
        start = time.perf_counter()
        tensors = nbytes = count = 0
        for bucket in buckets(export_weights(model, self.arch), self.bucket_bytes):
            assert self.engine is not None  # only rank 0 receives tensors
            self.engine.update_weights(bucket)
            tensors += len(bucket)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            count += 1
        self.version += 1
        return SyncStats(self.version, tensors, nbytes, count, time.perf_counter() - start)
