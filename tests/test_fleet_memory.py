"""A replacement colocated vLLM engine's memory share: vLLM 0.32 starts a GPU worker only if
``ceil(total × gpu_memory_utilization)`` bytes are free on its device (``v1/worker/utils.request_memory``).
The first colocated engine starts on an empty GPU with ``rollout.gpu_memory_utilization`` (0.5); a
replacement starts beside a trainer rank that may hold more than the other half, so it takes what is free
(less a margin) instead of dying inside vLLM, and is refused early, with the numbers, when even that
cannot hold its weights. The fleet side (the trainer rank gives back its cached memory before the
replacement starts) is in tests/test_weight_sync.py (colocated engines)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mars_megatron.models.presets import init_model
from mars_megatron.rollout.vllm_engine import STARTUP_MARGIN_BYTES, startup_memory_share, weight_bytes

GIB = 2**30
TOTAL = 80 * GIB


def _vllm_accepts(share: float, free: int) -> bool:
    """vLLM 0.32's start-up check, as request_memory makes it."""
    return free >= math.ceil(TOTAL * share)


def test_the_share_asked_for_when_it_is_free() -> None:
    assert startup_memory_share(0.5, 60 * GIB, TOTAL, weights=2 * GIB, fit=True) == 0.5
    assert startup_memory_share(0.9, 75 * GIB, TOTAL, weights=2 * GIB, fit=False) == 0.9


def test_a_replacement_beside_a_trainer_rank_takes_what_is_free() -> None:
    """The trainer rank holds 50 of 80 GiB: 0.5 would be refused by vLLM; the replacement gets what the
    free 30 GiB allow after the margin its own start-up allocates, and vLLM accepts it."""
    free = 30 * GIB
    assert not _vllm_accepts(0.5, free)
    share = startup_memory_share(0.5, free, TOTAL, weights=2 * GIB, fit=True)
    assert 0.35 < share < 0.5
    assert _vllm_accepts(share, free - STARTUP_MARGIN_BYTES)


def test_too_little_free_memory_is_refused_early_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization=0.5 asks for 40.0 GiB .* 2.5 GiB"):
        startup_memory_share(0.5, int(2.5 * GIB), TOTAL, weights=2 * GIB, fit=True)
    # an engine with a GPU of its own (not colocated) does not shrink: refused before vLLM would be
    with pytest.raises(ValueError, match=r"0.9 asks for 72.0 GiB of this GPU's 80.0 GiB, and 30.0 GiB"):
        startup_memory_share(0.9, 30 * GIB, TOTAL, weights=2 * GIB, fit=False)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        startup_memory_share(1.5, TOTAL, TOTAL, weights=0, fit=True)


def test_weight_bytes_from_the_config(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = init_model("tiny-dense", tmp_path / "dense")
    stored = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            stored += sum(handle.get_tensor(k).nbytes for k in handle.keys())
    assert weight_bytes(model, "float32") == stored
    assert weight_bytes(model, "bfloat16", tensor_parallel_size=2) == stored // 4
