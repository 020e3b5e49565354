"""The MarsRL train step on real Megatron-Core: packed samples, the clipped policy-gradient objective.

* its first loss and gradient norm equal a transformers autograd reference of the same objective (with
  POIS the ratio is 1, so the gradient is that of −Σ A·log π over the response tokens / token count);
* TP2, PP2, EP2, DP2 and CP2 take the same step as one process;
* packs never split or drop a sample: the trained token count is the responses' length.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mars_megatron.agents.sample import Sample
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.rl_workers import train_samples_each

POSITIONS = list(("solver", "verifier_1", "corrector_1", "verifier_2", "corrector_2"))


def _samples(seed: int = 0, n: int = 10) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(3, 12))]
        response = [rng.randrange(1, 1000) for _ in range(rng.randint(2, 15))]
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                position=POSITIONS[i % len(POSITIONS)],
                problem_id=f"p{i // 4}",
                group_id=f"g{i // 2}",
                reward=float(i % 2),
                advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5),
                loss_mask=[1] * (len(response) - 1) + [0] if i == 3 else None,  # one masked last token
            )
        )
    return out


SAMPLES = _samples()
# pack_length 64: the 10 samples (8..27 tokens) need several packs, so packing really happens.
BASE = ["train.pack_length=64", "rollout.max_response_tokens=32", "optimizer.lr=1e-2", "train.seed=0"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("rl") / "moe")


def _reference(hf: Path) -> dict[str, float]:
    """Loss and gradient norm of the POIS objective with transformers autograd."""
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.zero_grad()
    total = torch.zeros(())
    count = 0
    for s in SAMPLES:
        ids = torch.tensor([s.tokens])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        start = len(s.prompt_ids) - 1
        targets = torch.tensor(s.response_ids)
        lp = logp[start : start + s.response_len].gather(-1, targets[:, None])[:, 0]
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        ratio = torch.exp(lp - lp.detach())
        total = total + (-(s.advantage * ratio) * mask).sum()
        count += int(mask.sum())
    loss = total / count
    loss.backward()
    with torch.no_grad():
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return {"loss": loss.detach().item(), "grad_norm": norm.item(), "tokens": float(count)}


# Every setting trains with a PolicyWorker of its own, built from the same model; the settings of one world
# size run in one launch (rl_workers.train_samples_each), sparing a launch's spawn and imports per setting.
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "ep2": ["parallel.ep=2", "parallel.etp=1"],
           "dp2": []}  # fmt: skip
"""Two ranks each; no layout flag: two data-parallel replicas."""
RECOMPUTE = ("full", "selective")
# lr 1e-3: at 1e-2 Adam turns the 1e-7 float noise of near-zero gradients into lr-sized steps and the second
# update differs by 2e-4 between any two layouts (measured for DP2 and CP2 alike).
CP_OBJECTIVE = [*BASE, "optimizer.lr=1e-3", "algorithm.importance=none", "algorithm.kl_coef=0.05",
                "train.updates_per_batch=2"]  # fmt: skip


@pytest.fixture(scope="module")
def one_rank(moe: Path) -> dict[str, list[dict]]:
    """Setting name -> the steps' metrics of one process."""
    runs = {
        "base": (BASE, 2),
        **{f"recompute-{r}": ([*BASE, f"train.recompute={r}"], 1) for r in RECOMPUTE},
        "cp-objective": (CP_OBJECTIVE, 2),
    }
    (out,) = parallel.launch(train_samples_each, 1, str(moe), list(runs.values()), SAMPLES, timeout_s=600)
    return dict(zip(runs, out, strict=True))


@pytest.fixture(scope="module")
def two_ranks(moe: Path) -> dict[str, list[list[dict]]]:
    """Setting name -> per rank, the steps' metrics."""
    runs = {
        **{name: (BASE + layout, 1) for name, layout in LAYOUTS.items()},
        "cp2": ([*CP_OBJECTIVE, "parallel.cp=2"], 2),
    }
    ranks = parallel.launch(train_samples_each, 2, str(moe), list(runs.values()), SAMPLES, timeout_s=600)
    return {name: [rank[i] for rank in ranks] for i, name in enumerate(runs)}


@pytest.fixture(scope="module")
def one_process(one_rank: dict[str, list[dict]]) -> list[dict]:
    return one_rank["base"]


def test_first_step_equals_transformers_autograd(moe: Path, one_process: list[dict]) -> None:
    ref = _reference(moe)
    first = one_process[0]
    assert first["train/tokens"] == ref["tokens"] == sum(sum(s.loss_mask) for s in SAMPLES)
    assert first["train/loss"] == pytest.approx(ref["loss"], abs=1e-6)
    # megatron adds the MoE router's load-balancing loss (coefficient 0.001): within 1e-4 relative
    assert first["train/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert first["train/packs"] >= 3 and first["train/truncated_samples"] == 0
    assert first["train/ratio_mean"] == pytest.approx(1.0)


def test_second_step_moves_the_policy(one_process: list[dict]) -> None:
    """With POIS the reported loss is −mean(A) weighted by tokens, whatever the weights: the gradient norm
    is what shows the update happened."""
    assert one_process[1]["train/grad_norm"] != pytest.approx(one_process[0]["train/grad_norm"], rel=1e-3)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_take_the_same_step(two_ranks: dict, one_process: list[dict], layout: str) -> None:
    ranks = two_ranks[layout]
    writer = [r[0] for r in ranks if "train/pg_loss" in r[0]]
    assert writer, "the last pipeline stage reports the loss statistics"
    for r in ranks:
        got = r[0]
        assert got["train/tokens"] == one_process[0]["train/tokens"]
        assert got["train/loss"] == pytest.approx(one_process[0]["train/loss"], abs=1e-5)
        assert got["train/grad_norm"] == pytest.approx(one_process[0]["train/grad_norm"], rel=1e-4)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_recompute_takes_the_same_step(one_rank: dict, one_process: list[dict], recompute: str) -> None:
    """``train.recompute`` trades compute for memory; the step is unchanged."""
    steps = one_rank[f"recompute-{recompute}"]
    assert steps[0]["train/loss"] == pytest.approx(one_process[0]["train/loss"], abs=1e-6)
    assert steps[0]["train/grad_norm"] == pytest.approx(one_process[0]["train/grad_norm"], rel=1e-5)


@pytest.mark.multiproc
def test_context_parallel_takes_the_same_steps(one_rank: dict, two_ranks: dict) -> None:
    """CP2 against one process on an objective that reads every per-token input a CP rank must take its
    share of: old log-probs (two updates per batch, so the second one's ratios are not 1) and the
    reference's log-probs for the KL term, both scored under CP and gathered back into pack order
    (:data:`CP_OBJECTIVE`)."""
    one, ranks = one_rank["cp-objective"], two_ranks["cp2"]
    assert one[1]["train/ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    assert one[0]["train/kl"] > 0
    for r in ranks:
        for got, ref in zip(r, one, strict=True):
            assert got["train/tokens"] == ref["train/tokens"]
            assert got["train/loss"] == pytest.approx(ref["train/loss"], abs=1e-5)
            assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)
