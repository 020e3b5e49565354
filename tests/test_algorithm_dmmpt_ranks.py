"""DMMPT's on/off decision on real Megatron-Core ranks: taken once per update from the whole batch's entropy.

The decision (policy entropy below ``algorithm.dmmpt_entropy_target``) used to be made from each pack's
own log-probs, and under context parallelism from each rank's share of a pack, so the packs and ranks of
one update could disagree. Here the target sits between the entropies of the two data-parallel ranks'
packs; every rank of one process, DP2 and CP2 must still report the batch's entropy (a transformers
reference) and one decision, and train on exactly the tokens that decision keeps.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mars_megatron.agents.sample import Sample
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from mars_megatron.training.packing import plan_packs
from tests.rl_workers import train_samples, train_samples_each

PACK = 64
BASE = [f"train.pack_length={PACK}", "rollout.max_response_tokens=32", "optimizer.lr=1e-2", "train.seed=0"]


def _samples(n: int = 12) -> list[Sample]:
    rng = random.Random(3)
    positions = list(("solver", "verifier_1", "corrector_1", "verifier_2", "corrector_2"))
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(3, 12))]
        # short and long responses: the packs (and so the two ranks) see different entropies
        response = [rng.randrange(1, 1000) for _ in range(rng.randint(4, 16))]
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                position=positions[i % len(positions)],
                problem_id=f"p{i // 4}",
                group_id=f"g{i // 2}",
                reward=float(i % 2),
                advantage=(1.0 if i % 2 else -1.0) * rng.uniform(0.5, 1.5),
            )
        )
    return out


SAMPLES = _samples()


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("dmmpt") / "moe")


@pytest.fixture(scope="module")
def reference(moe: Path) -> list[torch.Tensor]:
    """Each sample's response-token log-probs under the initial weights (transformers)."""
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in SAMPLES:
            logp = torch.log_softmax(model(torch.tensor([s.tokens])).logits[0].float(), -1)
            start = len(s.prompt_ids) - 1
            targets = torch.tensor(s.response_ids)
            out.append(logp[start : start + s.response_len].gather(-1, targets[:, None])[:, 0].double())
    return out


def _entropy(reference: list[torch.Tensor], indices: list[int]) -> float:
    """Token-mean of −log p over the response tokens of ``indices`` (what DMMPT reads as entropy)."""
    return float(torch.cat([-reference[i] for i in indices]).mean())


def _threshold(reference: list[torch.Tensor]) -> float:
    """A probability threshold in the widest gap near the median of the positive samples' token
    probabilities: about half of them count as mastered, none within float noise of the threshold."""
    pairs = zip(SAMPLES, reference, strict=True)
    lps = sorted(float(lp) for s, ref in pairs if s.advantage > 0 for lp in ref)
    mid = len(lps) // 2
    k = max(range(mid - 3, mid + 4), key=lambda j: lps[j + 1] - lps[j])
    assert lps[k + 1] - lps[k] > 1e-3
    return math.exp((lps[k] + lps[k + 1]) / 2)


def _kept(reference: list[torch.Tensor], log_threshold: float, active: set[int]) -> list[torch.Tensor]:
    """Per sample, the response tokens DMMPT keeps when it is on for the samples ``active``: all but the
    mastered (p > threshold) tokens of positive samples."""
    return [
        (ref <= log_threshold) | torch.tensor(not (i in active and s.advantage > 0))
        for i, (s, ref) in enumerate(zip(SAMPLES, reference, strict=True))
    ]


def test_ranks_with_different_pack_entropies_make_one_decision(
    moe: Path, reference: list[torch.Tensor]
) -> None:
    plan = plan_packs([len(s.tokens) for s in SAMPLES], PACK, 2, pad_ranks=True)
    ranks = [[i for k in plan.rank_packs[r] for i in plan.packs[k]] for r in range(2)]
    entropies = [_entropy(reference, rank) for rank in ranks]
    assert abs(entropies[0] - entropies[1]) > 0.02, "the DP ranks' packs must differ in entropy"
    target = sum(entropies) / 2  # one rank's packs below it, the other's above
    batch = _entropy(reference, list(range(len(SAMPLES))))
    assert abs(batch - target) > 1e-3  # no float-noise tie
    active = batch < target
    log_threshold = math.log(threshold := _threshold(reference))
    kept = _kept(reference, log_threshold, set(range(len(SAMPLES))) if active else set())
    tokens = sum(int(k.sum()) for k in kept)
    # what deciding per rank would train on: DMMPT on for the lower-entropy rank only
    per_rank = _kept(reference, log_threshold, set(ranks[entropies.index(min(entropies))]))
    assert sum(int(k.sum()) for k in per_rank) != tokens, "the decision must change the trained tokens"
    # POIS: the loss is −A per kept token, over the kept token count
    loss = -sum(s.advantage * int(k.sum()) for s, k in zip(SAMPLES, kept, strict=True)) / tokens

    overrides = [
        *BASE,
        "algorithm.dmmpt=true",
        f"algorithm.dmmpt_prob_threshold={threshold!r}",
        f"algorithm.dmmpt_entropy_target={target!r}",
    ]
    two = [(overrides, 1), ([*overrides, "parallel.cp=2"], 1)]  # DP2 and CP2 in one launch
    ranks = parallel.launch(train_samples_each, 2, str(moe), two, SAMPLES, timeout_s=300)
    dp2, cp2 = zip(*ranks, strict=True)
    runs = {
        "one": parallel.launch(train_samples, 1, str(moe), overrides, SAMPLES, 1, timeout_s=300),
        "dp2": list(dp2),
        "cp2": list(cp2),
    }
    for name, results in runs.items():
        for rank, (got,) in enumerate(results):
            where = f"{name} rank {rank}"
            assert got["train/dmmpt_active"] == float(active), where
            assert got["train/dmmpt_batch_entropy"] == pytest.approx(batch, abs=1e-5), where
            assert got["train/tokens"] == tokens, where
            assert got["train/loss"] == pytest.approx(loss, abs=1e-6), where
