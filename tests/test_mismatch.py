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

from mars_megatron.agents.sample import Sample
from mars_megatron.algorithm.mismatch import (
    SEQUENCE_KEYS,
    SUM_KEYS,
    MismatchTally,
    engine_layout,
    mismatch_metrics,
    role_sums,
    token_sums,
)
from mars_megatron.algorithm.tensors import MicroBatch
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from mars_megatron.training.context_parallel import rank_indices
from mars_megatron.training.packing import build_pack
from tests.rl_workers import train_once_counting_each, train_samples
from tests.routing_workers import hf_routed_forward

BASE = ["train.pack_length=64", "rollout.max_response_tokens=32", "optimizer.lr=1e-3", "train.seed=0"]
ROLES = {"solver": "solver", "verifier_1": "verifier", "corrector_1": "corrector"}
SAMPLES = 12


# ---------------------------------------------------------------------------------------------- pure
def test_token_sums_by_hand() -> None:
    d = torch.tensor([0.0, 0.5, 5.0, 0.0, -2.0, 1.0])
    owner = torch.tensor([0, 0, -1, 0, 0, 2])  # token 2 is not compared; sequence 1 has no token
    sums = token_sums(d, owner, 3, threshold=2.0)
    assert sums.dtype == torch.float64 and sums.shape == (3, len(SEQUENCE_KEYS))
    k3 = (math.exp(0.5) - 1 - 0.5) + (math.exp(-2) - 1 + 2)
    torch.testing.assert_close(sums[0], torch.tensor([4, 2.5, k3, 1, -1.5], dtype=torch.float64))
    assert sums[1].tolist() == [0.0] * 5
    torch.testing.assert_close(sums[2], torch.tensor([1, 1, math.e - 2, 1, 1], dtype=torch.float64))


def test_role_sums_decide_outliers_on_whole_sequences() -> None:
    """A sequence split in two (context-parallel columns) adds up to the whole; its outlier verdict is the
    whole sequence's, not a part's."""
    d = torch.tensor([0.0, 0.5, 0.0, -2.0])  # mean -0.375: ratio 0.69, inside [1/2, 2], outside [1/1.3, 1.3]
    owner = torch.zeros(4, dtype=torch.long)
    whole = token_sums(d, owner, 1, 2.0)
    parts = token_sums(d[:2], owner[:2], 1, 2.0) + token_sums(d[2:], owner[2:], 1, 2.0)
    torch.testing.assert_close(parts, whole)
    assert token_sums(d[2:], owner[2:], 1, 2.0)[0, 4] / 2 < -math.log(2)  # that half alone is beyond 2x
    sums, outliers = role_sums(whole, ["solver"], 2.0)
    assert outliers == set() and sums["solver"] == sums["all"]
    assert sums["all"][SUM_KEYS.index("seqs")] == 1 and sums["all"][SUM_KEYS.index("tokens_over")] == 1
    assert role_sums(whole, ["solver"], 1.3)[1] == {0}


def test_mismatch_metrics_are_means_of_summed_groups() -> None:
    d = torch.tensor([1.0, 1.0, 0.0, 0.3])
    owner = torch.tensor([0, 0, 1, 2])  # solver a: d = 1, 1 (ratio e > 2); solver b: 0; verifier: 0.3
    roles = ["solver", "solver", "verifier", "corrector"]
    sums, outliers = role_sums(token_sums(d, owner, 4, 2.0), roles, 2.0)
    assert outliers == {0}
    assert "corrector" not in sums  # no tokens compared, no sums
    m = mismatch_metrics(sums)
    assert m["mismatch/solver/abs_mean"] == pytest.approx(2 / 3)
    assert m["mismatch/solver/kl"] == pytest.approx(2 * (math.e - 2) / 3)
    assert m["mismatch/solver/token_outliers"] == pytest.approx(2 / 3)
    assert m["mismatch/solver/seq_outliers"] == pytest.approx(0.5)
    assert m["mismatch/verifier/abs_mean"] == pytest.approx(0.3)
    assert m["mismatch/all/tokens"] == 4 and m["mismatch/all/seq_outliers"] == pytest.approx(1 / 3)
    assert "mismatch/corrector/abs_mean" not in m


def _pack_samples() -> tuple[list[Sample], MicroBatch]:
    """Three samples of 5 tokens each in one pack: the first and the third cut to 5, the second without
    engine log-probs."""

    def sample(i: int, prompt: int, response: int, behaviour: bool) -> Sample:
        return Sample(
            list(range(1, prompt + 1)),
            list(range(1, response + 1)),
            list(ROLES)[i],
            "p",
            f"g{i}",
            advantage=1.0,
            behaviour_logprobs=[-0.1 * (j + 1) for j in range(response)] if behaviour else None,
            sample_id=f"s{i}",
        )

    samples = [sample(0, 3, 4, True), sample(1, 2, 3, False), sample(2, 2, 5, True)]
    pack = build_pack([s.tokens for s in samples], max_len=5, multiple=16)
    return samples, MicroBatch.from_pack(pack)


def test_tokens_the_policy_did_not_write_are_not_compared() -> None:
    """A tool's observation inside a response (loss_mask 0) has no engine log-prob of its own."""
    samples, mb = _pack_samples()
    assert mb.pack is not None
    samples[2].loss_mask = [1, 0, 1, 1, 1]  # sample 2's second response token was an observation
    _, owner = engine_layout(samples, mb.pack)
    assert owner[0].tolist() == [-1, -1, 0, 0, -1, -1, -1, -1, -1, -1, -1, 2, -1, 2, -1, -1]


def test_tally_reads_a_pack_and_any_context_parallel_split_of_it() -> None:
    samples, mb = _pack_samples()
    assert mb.pack is not None and mb.pack.sample_spans == ((0, 5), (5, 10), (10, 15))  # truncated to 5
    engine, owner = engine_layout(samples, mb.pack)
    # sample 0 (prompt 3): response tokens 0, 1 predicted at 2, 3 (the rest cut off); sample 1: none
    # compared; sample 2 (prompt 2): response tokens 0..2 predicted at 11..13
    assert owner[0].tolist() == [-1, -1, 0, 0, -1, -1, -1, -1, -1, -1, -1, 2, 2, 2, -1, -1]
    assert engine[0, [2, 3, 11, 12, 13]].tolist() == pytest.approx([-0.1, -0.2, -0.1, -0.2, -0.3])
    trainer = torch.full((1, 16), -50.0)  # what is not compared would swamp every sum
    trainer[0, [2, 3]] = engine[0, [2, 3]].float() - 1.0  # sample 0: d = -1, an outlier at t = 2
    trainer[0, [11, 12, 13]] = engine[0, [11, 12, 13]].float() + 0.1  # sample 2: d = 0.1
    whole = MismatchTally(2.0)
    whole.add_batch(samples, [mb])
    whole.add(trainer, mb)
    split = MismatchTally(2.0)
    split.add_batch(samples, [mb])
    for index in rank_indices(16, 2):  # each CP rank scores its own columns
        split.add(trainer[:, index], dataclasses.replace(mb, cp_index=index))
    assert split.flat() == pytest.approx(whole.flat(), abs=1e-12)
    sums, outliers = whole.finish(whole.flat())
    assert outliers == [{0}] and set(sums) == {"all", "solver", "corrector"}
    assert sums["solver"] == pytest.approx([2, 2.0, 2 * math.expm1(-1) + 2, 2, 1, 1])
    assert sums["corrector"] == pytest.approx([3, 0.3, 3 * (math.expm1(0.1) - 0.1), 0, 1, 0], rel=1e-6)
    # two mini-batches (several updates per batch): sums add up, outliers index each one's own samples
    _, other = _pack_samples()
    two = MismatchTally(2.0)
    two.add_batch(samples[1:], [])  # verifier and corrector only: sample 0 of this one is not an outlier
    two.add_batch(samples, [other])
    two.add(trainer, other)
    sums2, outliers2 = two.finish(two.flat())
    assert outliers2 == [set(), {0}] and sums2.keys() == sums.keys()
    assert all(sums2[g] == pytest.approx(sums[g]) for g in sums)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold must be > 1"):
        token_sums(torch.zeros(2), torch.zeros(2, dtype=torch.long), 1, 1.0)
    with pytest.raises(ValueError, match=r"d \(2,\) vs owner \(3,\)"):
        token_sums(torch.zeros(2), torch.zeros(3, dtype=torch.long), 1, 2.0)
    with pytest.raises(ValueError, match=r"per-sequence sums \(2, 5\), expected \(1, 5\)"):
        role_sums(torch.zeros(2, 5), ["solver"], 2.0)


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


LAYOUTS = {"cp2": "parallel.cp=2", "pp2": "parallel.pp=2", "tp2": "parallel.tp=2", "dp2": "parallel.ep=2"}
"""Two ranks each; ``parallel.ep=2`` makes the dense part two data-parallel replicas."""


@pytest.fixture(scope="module")
def runs(models: dict[str, Path]) -> dict:
    """One update per setting, each with a PolicyWorker of its own, the settings of one world size in one
    launch. Under POIS with one update per batch the update's own forward measures the mismatch;
    ``importance=none`` needs the old log-probs, so its scoring forward measures it instead (MIS too: it
    needs the outliers before the loss)."""
    trainer = str(models["trainer"])
    agree, stale = _samples(models["trainer"]), _samples(models["stale"])
    settings = {
        "agree": (agree, [], 1),
        "stale": (stale, [], 1),
        "stale-scored": (stale, ["algorithm.importance=none"], 1),
        "stale-mis": (stale, ["algorithm.mis=true", "algorithm.mismatch_threshold=1.05"], 1),
        "agree-r3": (agree, ["moe.routing_replay=R3"], 1),
        "stale-r3": (stale, ["moe.routing_replay=R3"], 1),
        "stale-r3-scored": (stale, ["moe.routing_replay=R3", "algorithm.importance=none"], 1),
        "stale-r3-cp2": (stale, ["moe.routing_replay=R3", LAYOUTS["cp2"]], 2),
        **{f"stale-{name}": (stale, [layout], 2) for name, layout in LAYOUTS.items()},
    }
    out: dict = {"response_tokens": sum(s.response_len for s in agree)}
    for world in (1, 2):
        names = [name for name, (_, _, w) in settings.items() if w == world]
        jobs = [([*BASE, *settings[name][1]], settings[name][0]) for name in names]
        ranks = parallel.launch(train_once_counting_each, world, trainer, jobs, timeout_s=600)
        out.update(zip(names, ranks[0], strict=True))
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


def _role_metrics(m: dict) -> dict[str, float]:
    return {k: v for k, v in m.items() if k.startswith("train/mismatch/")}


def test_the_update_measures_what_a_scoring_forward_does(runs: dict) -> None:
    """The update's own forward (no scoring forward taken) reports the metrics a scoring forward of the
    same weights does, per role; R3's routing count as well."""
    assert runs["stale"]["scoring_forwards"] == 0 and runs["stale-r3"]["scoring_forwards"] == 0
    assert runs["stale-scored"]["scoring_forwards"] == 1 and runs["stale-mis"]["scoring_forwards"] == 1
    for fused, scored in (("stale", "stale-scored"), ("stale-r3", "stale-r3-scored")):
        ours, theirs = _role_metrics(runs[fused]), _role_metrics(runs[scored])
        assert len(ours) == 4 * 5 and ours.keys() == theirs.keys()  # all + 3 roles, 5 metrics each
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert runs["stale-r3"]["train/routing_changed"] == runs["stale-r3-scored"]["train/routing_changed"]


@pytest.mark.parametrize("layout", [*LAYOUTS, "r3-cp2"])
def test_the_update_measures_the_same_in_every_layout(runs: dict, layout: str) -> None:
    """Split over context-parallel columns, pipeline stages, tensor-parallel ranks or data-parallel
    replicas, the update's forward counts every response token once and measures what one process does
    (within the layouts' rounding: a token or sequence at the bound may tip over)."""
    single = runs["stale-r3" if layout.startswith("r3") else "stale"]
    split = runs[f"stale-{layout}"]
    assert split["scoring_forwards"] == 0
    assert split["train/mismatch/all/tokens"] == runs["response_tokens"]
    for key, value in _role_metrics(single).items():
        if key.endswith(("abs_mean", "kl")):
            assert split[key] == pytest.approx(value, rel=1e-4), key
        elif key.endswith("outliers"):
            assert split[key] == pytest.approx(value, abs=1 / SAMPLES), key
        else:
            assert split[key] == value, key
    if layout.startswith("r3"):
        assert split["train/routing_changed"] == pytest.approx(single["train/routing_changed"], abs=0.01)


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
