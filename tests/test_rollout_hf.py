"""The transformers rollout engine against transformers itself: tokens, log-probs, sampling, updates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mars_megatron.models.presets import init_model
from mars_megatron.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams, WeightUpdatable
from mars_megatron.rollout.hf_engine import HFEngine, sample_token
from tests.routing_workers import hf_routed_forward

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rollout")
    return {
        "moe": init_model("tiny-moe", root / "moe"),
        "moe-other": init_model("tiny-moe", root / "moe-other", seed=7),
        "dense": init_model("tiny-dense", root / "dense"),
    }


def requests(sampling: SamplingParams, lengths: tuple[int, ...] = (3, 9, 5)) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", tuple(range(7 + i, 7 + i + n)), sampling) for i, n in enumerate(lengths)
    ]


def reference_logprobs(engine: HFEngine, prompt: tuple[int, ...], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([[*prompt, *tokens]])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[len(prompt) - 1 + j, t] for j, t in enumerate(tokens)])


@pytest.mark.parametrize("preset", ["moe", "dense"])
def test_greedy_tokens_and_logprobs_match_transformers(models: dict[str, Path], preset: str) -> None:
    engine = HFEngine(models[preset])
    assert isinstance(engine, RolloutEngine) and isinstance(engine, WeightUpdatable)
    reqs = requests(GREEDY)
    outs = engine.generate(reqs)
    assert [o.request_id for o in outs] == ["r0", "r1", "r2"]
    for r, o in zip(reqs, outs, strict=True):
        ref = engine.model.generate(
            torch.tensor([r.prompt_ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=sorted(engine.eos_ids),
            pad_token_id=engine.pad_id,
        )[0, len(r.prompt_ids) :].tolist()
        assert o.token_ids == ref
        assert len(o.logprobs) == len(o.token_ids)
        torch.testing.assert_close(
            torch.tensor(o.logprobs), reference_logprobs(engine, r.prompt_ids, o.token_ids), rtol=0, atol=1e-5
        )
        assert o.finish_reason == ("stop" if o.token_ids[-1] in engine.eos_ids else "length")


def test_seeded_sampling_does_not_depend_on_the_batch(models: dict[str, Path]) -> None:
    engine = HFEngine(models["moe"], max_batch=8)
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=3)
    alone = engine.generate([GenerationRequest("a", (5, 6, 7), sampling)])[0]
    batched = engine.generate([*requests(GREEDY), GenerationRequest("a", (5, 6, 7), sampling)])[-1]
    assert alone.token_ids == batched.token_ids
    other = engine.generate(
        [GenerationRequest("a", (5, 6, 7), SamplingParams(max_tokens=10, temperature=0.9, seed=4))]
    )
    assert other[0].token_ids != alone.token_ids


def test_stop_tokens_and_max_tokens(models: dict[str, Path]) -> None:
    engine = HFEngine(models["moe"])
    first = engine.generate(requests(GREEDY, (4,)))[0]
    stop_at = first.token_ids[2]
    stopped = engine.generate(
        requests(SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,)), (4,))
    )[0]
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    short = engine.generate(requests(SamplingParams(max_tokens=2, temperature=0), (4,)))[0]
    assert short.token_ids == first.token_ids[:2] and short.finish_reason == "length"


def test_continuing_a_partial_response_equals_one_long_generation(models: dict[str, Path]) -> None:
    engine = HFEngine(models["dense"])
    prompt = (11, 12, 13, 14)
    whole = engine.generate([GenerationRequest("w", prompt, SamplingParams(max_tokens=10, temperature=0))])[0]
    part = engine.generate([GenerationRequest("p", prompt, SamplingParams(max_tokens=4, temperature=0))])[0]
    rest = engine.generate(
        [GenerationRequest("p", (*prompt, *part.token_ids), SamplingParams(max_tokens=6, temperature=0))]
    )[0]
    assert part.token_ids + rest.token_ids == whole.token_ids
    torch.testing.assert_close(
        torch.tensor(part.logprobs + rest.logprobs), torch.tensor(whole.logprobs), rtol=0, atol=1e-5
    )


def test_update_weights_makes_the_engine_compute_the_other_model(models: dict[str, Path]) -> None:
    engine, other = HFEngine(models["moe"]), HFEngine(models["moe-other"])
    reqs = requests(GREEDY)
    before, target = engine.generate(reqs), other.generate(reqs)
    assert [o.token_ids for o in before] != [o.token_ids for o in target]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(models["moe-other"].glob("*.safetensors")):
        tensors.update(load_file(f))
    assert engine.update_weights(tensors.items()) == len(tensors)  # hub names, experts included
    after = engine.generate(reqs)
    assert [o.token_ids for o in after] == [o.token_ids for o in target]
    torch.testing.assert_close(
        torch.tensor(after[1].logprobs), torch.tensor(target[1].logprobs), rtol=0, atol=1e-6
    )


def test_update_weights_errors_name_the_tensor(models: dict[str, Path]) -> None:
    engine = HFEngine(models["moe"])
    with pytest.raises(KeyError, match=r"no parameter for HF tensor 'model\.layers\.9\.mlp\.gate\.weight'"):
        engine.update_weights([("model.layers.9.mlp.gate.weight", torch.zeros(4, 128))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[3\], the model expects \[128\]"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_sample_token_rules() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert sample_token(logits, SamplingParams(max_tokens=1, temperature=0), g) == 1
    top1 = {sample_token(logits, SamplingParams(max_tokens=1, top_k=1), g) for _ in range(20)}
    assert top1 == {1}
    # p(1) = e^3 / (1 + e^3 + e^2 + e^-1) = 0.696: top_p 0.6 keeps only token 1, top_p 0.75 adds token 2
    assert {sample_token(logits, SamplingParams(max_tokens=1, top_p=0.6), g) for _ in range(20)} == {1}
    assert {sample_token(logits, SamplingParams(max_tokens=1, top_p=0.75), g) for _ in range(200)} == {1, 2}
    seen = {sample_token(logits, SamplingParams(max_tokens=1, top_k=2), g) for _ in range(200)}
    assert seen == {1, 2}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 1, "temperature": -1}, "temperature must be >= 0"),
        ({"max_tokens": 1, "top_p": 0}, "top_p must be in"),
        ({"max_tokens": 1, "top_k": 0}, "top_k must be -1 or >= 1"),
    ],
)
def test_sampling_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="request x: prompt_ids is empty"):
        GenerationRequest("x", (), GREEDY)


def test_captured_routing_is_what_the_model_routes_for_every_consumed_position(
    models: dict[str, Path],
) -> None:
    """Left-padded batches, prefill and decode: each output carries one row per position the model read
    (prompt + generated - 1), and the rows are the experts one full forward of those tokens picks."""
    engine = HFEngine(models["moe"], capture_routing=True)
    cfg = engine.model.config
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    outs = engine.generate(requests(sampling, lengths=(3, 9, 5)))
    for r, o in zip(requests(sampling, lengths=(3, 9, 5)), outs, strict=True):
        routed = o.routed_experts
        assert routed is not None and routed.dtype == np.uint8
        assert routed.shape == (
            len(r.prompt_ids) + len(o.token_ids) - 1,
            cfg.num_hidden_layers,
            cfg.num_experts_per_tok,
        )
        _, full = hf_routed_forward(engine.model, [*r.prompt_ids, *o.token_ids[:-1]])
        # the same experts per position (the order within the top-k may differ only on exact ties)
        assert torch.equal(torch.from_numpy(routed.astype(np.int64)).sort(-1).values, full.sort(-1).values)
    assert HFEngine(models["moe"]).generate(requests(sampling))[0].routed_experts is None


def test_capture_routing_on_a_dense_model_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="no MoE layers"):
        HFEngine(models["dense"], capture_routing=True)
