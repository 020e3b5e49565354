"""The supervised warm start: it really trains the responses, writes a checkpoint that both the trainer
and the rollout engine load, behaves the same in an expert-parallel layout, and its per-role rewards
can be measured."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mars_megatron.config import ParallelConfig
from mars_megatron.convert import is_mcore_checkpoint
from mars_megatron.models.presets import init_model
from mars_megatron.tasks.arith import arith_problems
from mars_megatron.tasks.sft import SFTConfig, role_accuracy, sft_job, step_batches
from mars_megatron.training import parallel
from tests.sft_workers import score_checkpoint

TINY = {"steps": 12, "skill_steps": 9, "demos_per_step": 32, "warmup_steps": 2, "lr": 5e-3}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("sft") / "moe")


@pytest.fixture(scope="module")
def trained(moe: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("sft-out") / "sft"
    sft = SFTConfig(out_dir=str(out), **TINY)
    history = parallel.launch(
        sft_job, 1, str(moe), ParallelConfig(), sft, None, "local", False, timeout_s=300
    )
    return out, history[0]


def _response_loss(hf_dir: Path, seqs: list[list[int]], masks: list[list[int]]) -> float:
    """Mean next-token loss of the trained (response) tokens under the HF model in ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in zip(seqs, masks, strict=True):
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            m = torch.tensor(mask, dtype=torch.float32)
            total += float(-(lp * m).sum())
            count += int(m.sum())
    return total / count


@pytest.mark.multiproc
def test_sft_lowers_the_response_loss_on_fresh_demos(moe: Path, trained: tuple[Path, list[dict]]) -> None:
    out, history = trained
    assert [h["step"] for h in history] == list(range(1, 13))
    assert all(h["update_ok"] == 1.0 for h in history)
    # only response tokens (and their end-of-turn) carry loss
    batches = step_batches(SFTConfig(**TINY), moe)
    assert [h["tokens"] for h in history] == [sum(map(sum, masks)) for _, masks in batches]
    assert all(sum(map(sum, masks)) < sum(map(len, masks)) / 3 for _, masks in batches)
    # fresh demos (another seed) measured outside the trainer, with transformers
    held_out = SFTConfig(steps=1, skill_steps=0, demos_per_step=24, demos={"seed": 99})
    seqs, masks = step_batches(held_out, moe)[0]
    before, after = _response_loss(moe, seqs, masks), _response_loss(out / "hf", seqs, masks)
    assert before > 6.0  # a random model: about ln(1024) = 6.9 per token
    assert after < 0.5 * before, (before, after)
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]


@pytest.mark.multiproc
def test_checkpoint_loads_in_the_trainer_and_the_engine_alike(trained: tuple[Path, list[dict]]) -> None:
    """``out`` is a mars Megatron checkpoint (what ``mars train`` starts from) and ``out/hf`` a complete HF
    model (what the rollout engine loads): both hold the same weights."""
    from transformers import AutoModelForCausalLM

    out, _ = trained
    assert is_mcore_checkpoint(out) and (out / "hf" / "model.safetensors.index.json").is_file()
    seqs = step_batches(SFTConfig(steps=1, skill_steps=0, demos_per_step=3), out / "hf")[0][0]
    megatron = parallel.launch(score_checkpoint, 1, str(out), seqs, timeout_s=300)[0]
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    for seq, lp in zip(seqs, megatron, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1]
        hf = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), hf, rtol=0, atol=1e-4)


@pytest.mark.multiproc
def test_expert_parallel_run_takes_the_same_steps(
    moe: Path, trained: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    """EP=2 over 2 processes (also 2 data-parallel ranks) trains on the same demos with the same losses."""
    _, single = trained
    sft = SFTConfig(out_dir=str(tmp_path / "ep2"), **TINY)
    runs = parallel.launch(
        sft_job, 2, str(moe), ParallelConfig(ep=2), sft, None, "local", False, timeout_s=300
    )
    for rank in runs:
        torch.testing.assert_close(
            torch.tensor([h["loss"] for h in rank]),
            torch.tensor([h["loss"] for h in single]),
            rtol=1e-4,
            atol=0,
        )
    assert is_mcore_checkpoint(tmp_path / "ep2")


def test_an_existing_output_is_refused_before_training(moe: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="already exists"):
        sft_job(str(moe), ParallelConfig(), SFTConfig(out_dir=str(tmp_path)))


@pytest.mark.multiproc
def test_role_accuracy_samples_every_role(trained: tuple[Path, list[dict]]) -> None:
    out, _ = trained
    problems = arith_problems(4, seed=0)
    kwargs = {"group_size": 2, "inputs_per_agent": 2, "max_steps": 3, "max_tokens": 24, "seed": 1}
    stats = role_accuracy(out / "hf", problems, **kwargs)
    assert stats["samples/solver"] == 8
    assert stats["samples/verifier"] == 16  # 2 solutions per problem, 2 reports each
    assert 0 <= stats["samples/corrector"] <= 16
    for role in ("solver", "verifier"):
        assert 0.0 <= stats[f"reward/{role}"] <= 1.0
    assert math.isnan(stats["reward/corrector"]) == (stats["samples/corrector"] == 0)
    again = role_accuracy(out / "hf", problems, **kwargs)
    assert stats.keys() == again.keys()
    for key, value in stats.items():  # seeded sampling: the same measurement twice
        assert value == again[key] or (math.isnan(value) and math.isnan(again[key])), key
