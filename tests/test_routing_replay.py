"""Routing replay (``moe.routing_replay``) on real Megatron-Core against the transformers rollout engine.

The engine generates with the tiny MoE and reports the experts it routed every position to. The trainer
loads a copy whose routers carry a little noise, so its free routing sends some positions to other experts
(as bf16/FP8 kernels or another TP layout do on GPUs). R3 (the engine's experts, the trainer's gate
weights over them) brings its log-probs back to the engine's; free routing does not. Packed (two or more
samples per pack), in one process and in TP2, EP2, PP2 and CP2. R2: after an update, a forward replaying
the routing recorded before it uses exactly those experts, where free routing no longer does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mars_megatron.models.presets import init_model
from mars_megatron.rollout.engine import GenerationRequest, SamplingParams
from mars_megatron.rollout.hf_engine import HFEngine
from mars_megatron.training import parallel
from mars_megatron.training.routing_replay import (
    ROUTE_FREE,
    RoutingError,
    check_routing,
    local_routing,
    pack_routing,
)
from tests.routing_workers import RoutingCase, perturb_routers, score_with_routing

NOISE = 0.03  # relative noise on the trainer's router weights (measured: free max |dlogp| 0.047, R3 7e-4)
R3_TOL = 2e-3
FREE_MIN = 1e-2
LAYOUTS = {"tp2": (2, 1, 1, 1), "ep2": (1, 1, 2, 1), "pp2": (1, 2, 1, 1), "cp2": (1, 1, 1, 2)}


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Engine samples of the tiny MoE with their routing and log-probs, and the router-perturbed copy."""
    root = tmp_path_factory.mktemp("routing")
    model = init_model("tiny-moe", root / "engine")
    perturb_routers(str(model), str(root / "trainer"), NOISE)
    engine = HFEngine(model, capture_routing=True)
    requests = [
        GenerationRequest(f"r{i}", tuple(range(10 + 7 * i, 16 + 8 * i)), SamplingParams(24, 1.0, seed=i))
        for i in range(6)
    ]
    outs = engine.generate(requests)
    return {
        "engine_dir": str(model),
        "trainer_dir": str(root / "trainer"),
        "seqs": [[*r.prompt_ids, *o.token_ids] for r, o in zip(requests, outs, strict=True)],
        "prompt_lens": [len(r.prompt_ids) for r in requests],
        "behaviour": [o.logprobs for o in outs],
        "routing": [o.routed_experts for o in outs],
    }


def _cases(rollout: dict, model: str, prefix: str, layouts: dict, **kwargs) -> list[RoutingCase]:
    return [
        RoutingCase(
            f"{prefix}{name}",
            rollout[model],
            rollout["seqs"],
            rollout["routing"],
            tp=tp,
            pp=pp,
            ep=ep,
            cp=cp,
            **kwargs,
        )
        for name, (tp, pp, ep, cp) in layouts.items()
    ]


@pytest.fixture(scope="module")
def single(rollout: dict) -> dict:
    cases = [
        *_cases(rollout, "engine_dir", "same-", {"1": (1, 1, 1, 1)}),
        *_cases(rollout, "trainer_dir", "", {"1": (1, 1, 1, 1)}, lr=0.05),
    ]
    (out,) = parallel.launch(score_with_routing, 1, cases, timeout_s=600)
    return out


@pytest.fixture(scope="module")
def layouts(rollout: dict) -> list[dict]:
    cases = [
        *_cases(rollout, "trainer_dir", "", LAYOUTS),
        *_cases(rollout, "trainer_dir", "r2-", {"pp2": (1, 2, 1, 1)}, lr=0.05),
        *_cases(rollout, "trainer_dir", "r2-recompute-", {"pp2": (1, 2, 1, 1)}, lr=0.05, recompute="full"),
    ]
    return parallel.launch(score_with_routing, 2, cases, timeout_s=600)


def _merged(results: list[dict], name: str, key: str) -> dict[int, list[float]]:
    """Per-sample log-probs gathered from every rank that returned some (last stage, each DP rank)."""
    out: dict[int, list[float]] = {}
    for r in results:
        out.update(r[name][key] or {})
    return out


def _gap(rollout: dict, logprobs: dict[int, list[float]]) -> float:
    """Largest |trainer - engine| log-prob over every generated token."""
    assert sorted(logprobs) == list(range(len(rollout["seqs"])))
    gaps = []
    for i, behaviour in enumerate(rollout["behaviour"]):
        p = rollout["prompt_lens"][i]
        trainer = torch.tensor(logprobs[i][p - 1 : p - 1 + len(behaviour)])
        gaps.append((trainer - torch.tensor(behaviour)).abs().max())
    return float(torch.stack(gaps).max())


def test_engine_routing_has_a_row_per_fed_position(rollout: dict) -> None:
    for seq, routed in zip(rollout["seqs"], rollout["routing"], strict=True):
        assert routed.shape == (len(seq) - 1, 2, 2) and routed.dtype == np.uint8


def test_replaying_the_engines_own_routing_into_the_same_weights_changes_nothing(
    rollout: dict, single: dict
) -> None:
    assert _gap(rollout, single["same-1"]["free"]) < 1e-4
    assert _gap(rollout, single["same-1"]["r3"]) < 1e-4
    replayed, changed = single["same-1"]["changes"]
    assert replayed > 0 and changed == 0  # the trainer's routers agree with every replayed decision


def test_r3_brings_a_perturbed_router_back_to_the_engines_logprobs(rollout: dict, single: dict) -> None:
    assert single["1"]["packs"] < len(rollout["seqs"])  # samples share packs
    free, r3 = _gap(rollout, single["1"]["free"]), _gap(rollout, single["1"]["r3"])
    assert free > FREE_MIN, free
    assert r3 < R3_TOL, r3
    replayed, changed = single["1"]["changes"]
    assert 0 < changed < replayed  # replay overrode the perturbed routers' choice, where it differs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_r3_under_tp_ep_pp_cp_scores_like_one_process(
    rollout: dict, single: dict, layouts: list[dict], layout: str
) -> None:
    free, r3 = _merged(layouts, layout, "free"), _merged(layouts, layout, "r3")
    assert _gap(rollout, free) > FREE_MIN
    assert _gap(rollout, r3) < R3_TOL
    for i, lp in single["1"]["r3"].items():
        torch.testing.assert_close(torch.tensor(r3[i]), torch.tensor(lp), rtol=0, atol=1e-5)


def test_r2_replays_the_routing_recorded_before_the_update(single: dict, layouts: list[dict]) -> None:
    for result in [single["1"], *(r["r2-pp2"] for r in layouts), *(r["r2-recompute-pp2"] for r in layouts)]:
        changed, total = result["free_vs_old"]
        assert total > 0 and changed > 0, "the update must move some positions to other experts"
        assert result["replay_vs_old"] == (0, total)


def test_r2_under_full_recompute_takes_the_same_step(layouts: list[dict]) -> None:
    """The recompute in the backward replays each micro-batch's routing (queued per router), so full
    recompute computes the very step that keeping activations does."""
    for r in layouts:
        plain, recomputed = r["r2-pp2"]["step"], r["r2-recompute-pp2"]["step"]
        assert recomputed["loss"] == pytest.approx(plain["loss"], abs=1e-6)
        assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- pure
def test_pack_routing_places_each_samples_rows_at_its_span_and_leaves_the_rest_free() -> None:
    a = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2)  # a sample of 4 tokens: 3 fed positions
    b = np.full((5, 2, 2), 7, dtype=np.uint8)
    packed = pack_routing([a, b, None], [(0, 4), (4, 8), (8, 10)], 12, 2, 2)
    assert packed.shape == (1, 12, 2, 2) and packed.dtype == torch.int16
    assert torch.equal(packed[0, :3], torch.from_numpy(a.astype(np.int16)))
    assert (packed[0, 3] == ROUTE_FREE).all()  # sample a's last token: never fed back by the engine
    assert (packed[0, 4:8] == 7).all()  # sample b truncated to its span: its first 4 rows
    assert (packed[0, 8:] == ROUTE_FREE).all()


def test_local_routing_takes_the_sequence_parallel_slice_in_router_order() -> None:
    routing = torch.arange(8 * 1 * 1).view(1, 8, 1, 1)
    assert local_routing(routing, 1, 2, True)[:, 0, 0].tolist() == [4, 5, 6, 7]
    assert local_routing(routing, 1, 2, False)[:, 0, 0].tolist() == list(range(8))


@pytest.mark.parametrize(
    ("shape", "fill", "match"),
    [((9, 2, 2), 0, r"sample 's1'.*shape \(9, 2, 2\), expected \(10, 2, 2\)"),
     ((10, 3, 2), 0, r"expected \(10, 2, 2\)"),
     ((10, 2, 2), 4, r"sample 's1'.*expert ids in \[4, 4\].*experts 0..3")],
)  # fmt: skip
def test_bad_routing_names_the_sample(shape: tuple, fill: int, match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        check_routing("s1", np.full(shape, fill, dtype=np.uint8), 11, 2, 2, 4)
