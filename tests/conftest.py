"""Fixtures shared across test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars_megatron.config import ParallelConfig
from mars_megatron.models.presets import init_model
from mars_megatron.tasks.sft import SFTConfig, sft_job
from mars_megatron.training import parallel


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests need CUDA: skipped, with the reason, where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU node)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly supervised tiny MoE (a mars checkpoint): rewards are neither all 0 nor all 1, so RL
    updates are real. Built once per test session, by every RL end-to-end module that asks for it."""
    root = tmp_path_factory.mktemp("sft")
    hf = init_model("tiny-moe", root / "hf")
    out = root / "sft"
    sft = SFTConfig(out_dir=str(out), steps=40, skill_steps=30)
    parallel.launch(sft_job, 1, str(hf), ParallelConfig(), sft, timeout_s=600)
    return out
