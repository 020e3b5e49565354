"""Trainer-vs-engine mismatch: the pure sums, and what a MarsRL update (real Megatron-Core) reports and masks.

The engine's log-probs come from transformers: the trainer's own weights (engine and trainer agree, the
metrics are ~0), or a deliberately stale engine (other weights: the metrics are far from 0, and masked
importance sampling drops the sequences the trainer would score very differently). R3 through the worker:
samples carry the engine's routing; routing of the wrong shape or with expert ids out of range is refused
naming the sample.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mars_megatron.agents.trajectory import Position
from mars_megatron.algorithm.mismatch import SUM_KEYS, mismatch_metrics, sequence_mismatch
from mars_megatron.algorithm.sample import Sample
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.rl_workers import train_samples
from tests.routing_workers import hf_routed_forward

BASE = ["train.pack_length=64", "rollout.max_response_tokens=32", "optimizer.lr=1e-3", "train.seed=0"]
ROLES = {Position.SOLVER: "solver", Position.VERIFIER_1: "verifier", Position.CORRECTOR_1: "corrector"}
SAMPLES = 12


# ---------------------------------------------------------------------------------------------- pure
def test_sequence_mismatch_sums_by_hand() -> None:
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    engine = torch.tensor([-1.0, -2.5, -0.5, -1.0])  # d = 0, 0.5, 0, -2
    m = sequence_mismatch(trainer, engine, threshold=2.0)
    assert m.tokens == 4
    assert m.abs_sum == pytest.approx(2.5)
    assert m.k3_sum == pytest.approx((math.exp(0.5) - 1 - 0.5) + (math.exp(-2) - 1 + 2))
    assert m.tokens_over == 1  # |d| > log 2 only for -2
    assert m.outlier is False  # mean d = -0.375: geometric-mean ratio 0.69 is inside [1/2, 2]
    assert sequence_mismatch(trainer, engine, threshold=1.3).outlier is True  # 0.69 < 1/1.3
    same = sequence_mismatch(trainer, trainer, threshold=2.0)
    assert (same.abs_sum, same.k3_sum, same.tokens_over, same.outlier) == (0.0, 0.0, 0, False)


def test_mismatch_metrics_are_means_of_summed_groups() -> None:
    a = sequence_mismatch(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -2.0]), 2.0)  # d = 1, 1
    b = sequence_mismatch(torch.tensor([-1.0]), torch.tensor([-1.0]), 2.0)
    sums = {"solver": [x + y for x, y in zip(a.sums(), b.sums(), strict=True)], "verifier": [0.0] * 6}
    m = mismatch_metrics(sums)
    assert m["mismatch/solver/abs_mean"] == pytest.approx(2 / 3)
    assert m["mismatch/solver/kl"] == pytest.approx(2 * (math.e - 2) / 3)
    assert m["mismatch/solver/token_outliers"] == pytest.approx(2 / 3)
    assert m["mismatch/solver/seq_outliers"] == pytest.approx(0.5)  # a: ratio e > 2; b: 1
    assert "mismatch/verifier/abs_mean" not in m  # no tokens, no metrics
    assert len(SUM_KEYS) == 6


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold must be > 1"):
        sequence_mismatch(torch.zeros(2), torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match=r"trainer log-probs \(2,\) vs engine \(3,\)"):
        sequence_mismatch(torch.zeros(2), torch.zeros(3), 2.0)


# --------------------------------------------------------------------------------------------- worker
@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mismatch")
    return {
        "trainer": init_model("tiny-moe", root / "trainer"),
        "stale": init_model("tiny-moe", root / "stale", seed=7),
    }


def _samples(engine_dir: Path, n: int = SAMPLES, seed: int = 0) -> list[Sample]:
    """Samples whose behaviour log-probs and routing are ``engine_dir``'s (transformers, one forward)."""
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32).eval()
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(3, 10))]
        response = [rng.randrange(1, 1000) for _ in range(rng.randint(4, 14))]
        logits, picked = hf_routed_forward(model, [*prompt, *response])
        lp = torch.log_softmax(logits, -1)
        behaviour = [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]
        routing = picked[:-1].numpy().astype(np.uint8)
        position = list(ROLES)[i % 3]
        out.append(
            Sample(
                prompt,
                response,
                position,
                f"p{i // 6}",
                f"g{i // 2}",
                reward=float(i % 2),
                advantage=rng.choice([-1.0, 1.0]),
                behaviour_logprobs=behaviour,
                sample_id=f"s{i}",
                routed_experts=routing,
            )
        )
    return out


@pytest.fixture(scope="module")
def runs(models: dict[str, Path]) -> dict:
    """One update per setting, one process each launch."""
    trainer = str(models["trainer"])
    agree, stale = _samples(models["trainer"]), _samples(models["stale"])
    settings = {
        "agree": (agree, []),
        "stale": (stale, []),
        "stale-mis": (stale, ["algorithm.mis=true", "algorithm.mismatch_threshold=1.05"]),
        "agree-r3": (agree, ["moe.routing_replay=R3"]),
        "stale-r3": (stale, ["moe.routing_replay=R3"]),
    }
    out: dict = {"response_tokens": sum(s.response_len for s in agree)}
    for name, (samples, extra) in settings.items():
        (steps,) = parallel.launch(train_samples, 1, trainer, [*BASE, *extra], samples, 1, timeout_s=300)
        out[name] = steps[0]
    return out


def test_mismatch_is_zero_when_engine_and_trainer_agree(runs: dict) -> None:
    m = runs["agree"]
    for role in ROLES.values():
        assert m[f"train/mismatch/{role}/abs_mean"] < 1e-5
        assert m[f"train/mismatch/{role}/kl"] < 1e-9
        assert m[f"train/mismatch/{role}/token_outliers"] == 0.0
    assert m["train/mismatch/all/tokens"] == runs["response_tokens"]


def test_a_stale_engine_shows_up_per_role(runs: dict) -> None:
    m = runs["stale"]
    for role in ROLES.values():
        assert m[f"train/mismatch/{role}/abs_mean"] > 0.1
        assert m[f"train/mismatch/{role}/kl"] > 0.01
    assert m["train/mismatch/all/token_outliers"] > 0


def test_mis_leaves_outlier_sequences_out_of_the_loss(runs: dict) -> None:
    masked = runs["stale-mis"]["train/mis_masked_samples"]
    assert masked == pytest.approx(runs["stale-mis"]["train/mismatch/all/seq_outliers"] * SAMPLES)
    assert 0 < masked < SAMPLES
    assert runs["stale-mis"]["train/tokens"] < runs["stale"]["train/tokens"]


def test_r3_through_the_worker_replays_the_engines_routing(runs: dict) -> None:
    """The engine (transformers, same weights) and the trainer agree; replaying the engine's routing keeps
    them agreeing, and the update is the one free routing takes."""
    assert runs["agree-r3"]["train/mismatch/all/abs_mean"] < 1e-5
    assert runs["agree-r3"]["train/grad_norm"] == pytest.approx(runs["agree"]["train/grad_norm"], rel=1e-5)
    assert runs["agree-r3"]["train/routing_changed"] == 0.0
    # another engine's routing: R3 overrides the trainer's own choice at many positions
    assert 0.1 < runs["stale-r3"]["train/routing_changed"] < 1.0


@pytest.mark.parametrize(
    ("change", "match"),
    [(lambda r: r[:-1], r"Sample 's0'.*routed_experts has shape"),
     (lambda r: np.full_like(r, 9), r"sample 's0'.*expert ids in \[9, 9\].*experts 0..3")],
)  # fmt: skip
def test_r3_refuses_bad_routing_naming_the_sample(models: dict[str, Path], change, match: str) -> None:
    samples = _samples(models["trainer"], n=4)
    bad = samples[0]
    routing = change(bad.routed_experts)
    if routing.shape[0] != bad.routed_experts.shape[0]:  # Sample itself refuses the wrong row count
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(bad, routed_experts=routing)
        return
    samples[0] = dataclasses.replace(bad, routed_experts=routing)
    with pytest.raises(RuntimeError, match=match):
        parallel.launch(
            train_samples, 1, str(models["trainer"]), [*BASE, "moe.routing_replay=R3"], samples, 1
        )
