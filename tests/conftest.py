"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from mars_megatron.config import ParallelConfig
from mars_megatron.models.presets import init_model
from mars_megatron.tasks.sft import SFTConfig, sft_job
from mars_megatron.training import parallel

# Modules whose tests take minutes, handed out first (seconds on 2 cores from `--durations=0`, serial), so
# that scripts/test.sh's pytest-xdist workers (`--dist loadfile`, modules handed out in collection order as
# workers free up) start the long modules early and finish together, instead of one worker meeting a
# 6-minute module at the end. Roughly longest first, but the first two start together and only one of them
# may need `sft_model`: two that both did would leave one worker waiting about a minute for the other's
# build. Refresh with the figures of a new measurement.
FIRST = (
    "test_repeat",  # 190 s, and sft_model's build
    "test_weight_sync",  # 327 s
    "test_rl_loop",  # 373 s
    "test_pipeline_loop",  # 369 s
    "test_slurm_real",  # 300 s
    "test_pipeline_placement",  # 277 s
    "test_cli",  # 196 s
    "test_eval",  # 188 s
    "test_device_check",  # 161 s
    "test_conversion",  # 143 s
)


def _module_rank(item: pytest.Item) -> int:
    name = item.path.stem
    return FIRST.index(name) if name in FIRST else len(FIRST)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller: a worker has finished. scripts/test.sh starts the phases that wait for
    the main one (vLLM, network) when its first worker is done, on the core that worker leaves: beside both
    workers they slowed the main phase's multi-process tests more than they saved (each collective hop
    waits for a time slice when three test processes share 2 cores)."""
    flag = os.environ.get("MARS_FIRST_WORKER_DONE")
    if flag:
        Path(flag).touch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long modules first (:data:`FIRST`, a stable sort: each module's own order stays);
    ``gpu`` tests need CUDA: skipped, with the reason, where there is none."""
    import torch

    items.sort(key=_module_rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU node)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A briefly supervised tiny MoE (a mars checkpoint): rewards are neither all 0 nor all 1, so RL
    updates are real. Built once per test session, by every RL end-to-end module that asks for it; under
    pytest-xdist (scripts/test.sh), once for all workers: the first to ask builds it under a lock in the
    run's shared temporary folder, the others wait and read it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return _build_sft_model(tmp_path_factory.mktemp("sft"))
    shared = tmp_path_factory.getbasetemp().parent / "sft-shared"  # this run's, beside each worker's own
    with FileLock(str(shared) + ".lock"):
        if not (shared / "built").exists():
            shutil.rmtree(shared, ignore_errors=True)
            shared.mkdir()
            _build_sft_model(shared)
            (shared / "built").write_text(worker)
    return shared / "sft"


def _build_sft_model(root: Path) -> Path:
    hf = init_model("tiny-moe", root / "hf")
    out = root / "sft"
    sft = SFTConfig(out_dir=str(out), steps=40, skill_steps=30)
    parallel.launch(sft_job, 1, str(hf), ParallelConfig(), sft, timeout_s=600)
    return out
