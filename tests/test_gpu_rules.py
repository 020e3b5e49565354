"""What decides the GPU paths, checked on CPU: every `mars train` configuration of tests/test_gpu.py
passes the config checks (the FP8 runs once failed there, before any GPU), the layer spec a GPU gets, the
arguments vLLM is built with (executor, CUDA graphs, memory), and the machine checks `mars train` makes
before anything starts. The placements themselves are in tests/test_pipeline_placement.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars_megatron.config import ConfigError, load_config
from mars_megatron.models.presets import init_model
from mars_megatron.rollout.vllm_engine import llm_kwargs
from mars_megatron.training.model_provider import resolve_impl

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("rules") / "hf")


def test_every_gpu_run_passes_the_config_checks(tiny: Path, tmp_path: Path) -> None:
    from mars_megatron.launch.resources import trainer_world_size
    from mars_megatron.pipeline.trainer import prepare
    from tests.test_gpu import RUNS, run_overrides

    assert len(RUNS) >= 8
    for name, (gpus, _) in RUNS.items():
        cfg = load_config(REPO / "examples" / "tiny_cpu.yaml", run_overrides(name, tiny, tmp_path / name))
        plan = prepare(cfg, nproc=None, resume=None, check_machine=False)
        # the GPUs the test asks for hold its trainer ranks and its engines
        assert trainer_world_size(cfg, gpus) == plan.world_size, name


def test_the_fp8_runs_would_fail_without_the_alltoall_dispatcher(tiny: Path, tmp_path: Path) -> None:
    """What the FP8 GPU runs met before: tiny_cpu.yaml's allgather dispatcher with a MoE model."""
    from mars_megatron.pipeline.trainer import prepare
    from tests.test_gpu import run_overrides

    overrides = run_overrides("fp8_hybrid", tiny, tmp_path)
    cfg = load_config(
        REPO / "examples" / "tiny_cpu.yaml", [*overrides, "parallel.moe_token_dispatcher=allgather"]
    )
    with pytest.raises(ConfigError, match=r"parallel\.moe_token_dispatcher: .* alltoall dispatcher"):
        prepare(cfg, nproc=None, resume=None, check_machine=False)


def test_auto_is_transformer_engine_on_gpus_and_refuses_without_it() -> None:
    assert resolve_impl("auto", cuda=False, te=False) == "local"
    assert resolve_impl("auto", cuda=True, te=True) == "transformer_engine"
    assert resolve_impl("local", cuda=True, te=False) == "local"  # asked for explicitly
    assert resolve_impl("transformer_engine", cuda=True, te=True) == "transformer_engine"
    with pytest.raises(RuntimeError, match=r"transformer_impl=auto on a GPU needs Transformer Engine.*T x T"):
        resolve_impl("auto", cuda=True, te=False)
    with pytest.raises(RuntimeError, match="transformer_impl=transformer_engine on a GPU needs Transformer"):
        resolve_impl("transformer_engine", cuda=True, te=False)
    with pytest.raises(RuntimeError, match="transformer_engine needs a CUDA GPU; this machine has none"):
        resolve_impl("transformer_engine", cuda=False, te=False)
    with pytest.raises(ValueError, match="must be 'auto', 'local' or 'transformer_engine', got 'te'"):
        resolve_impl("te")


def test_mars_train_checks_this_machine_before_starting(tiny: Path, tmp_path: Path) -> None:
    import torch

    from mars_megatron.pipeline.trainer import prepare

    if torch.cuda.is_available():
        pytest.skip("the CPU refusal is what is tested here")
    cfg = load_config(
        REPO / "examples" / "tiny_cpu.yaml",
        [f"model.hf_dir={tiny}", f"data.train_file={REPO / 'examples/data/arith_train.jsonl'}",
         f"logging.run_dir={tmp_path / 'run'}", "model.transformer_impl=transformer_engine"],
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"model\.transformer_impl: .* needs a CUDA GPU; this machine has none"
    ):
        prepare(cfg, nproc=None, resume=None)
    assert prepare(cfg, nproc=None, resume=None, check_machine=False).world_size == 2  # the rest is fine


def _kwargs(**overrides: object) -> dict:
    args: dict = dict(on_gpu=True, dtype="bfloat16", max_model_len=4096, seed=0)
    return llm_kwargs("model", **{**args, **overrides})  # type: ignore[arg-type]


def test_vllm_executor_and_cuda_graphs() -> None:
    """One GPU: the model in the engine's process. Several: vLLM's Ray executor, named, with one worker per
    bundle (left to choose, vLLM inside a Ray actor that holds no GPU would refuse the world size). CUDA
    graphs on GPUs unless asked otherwise; eager on CPU."""
    one, four = _kwargs(), _kwargs(tensor_parallel_size=4)
    assert (one["distributed_executor_backend"], one["tensor_parallel_size"]) == ("uni", 1)
    assert (four["distributed_executor_backend"], four["tensor_parallel_size"]) == ("ray", 4)
    assert one["enforce_eager"] is False and _kwargs(enforce_eager=True)["enforce_eager"] is True
    assert _kwargs(on_gpu=False)["enforce_eager"] is True
    assert _kwargs(on_gpu=False, enforce_eager=False)["enforce_eager"] is False


def test_vllm_memory_sleep_and_weights() -> None:
    gpu = _kwargs(gpu_memory_utilization=0.5, enable_sleep_mode=True, weights=False)
    assert (gpu["gpu_memory_utilization"], gpu["enable_sleep_mode"], gpu["load_format"]) == (
        0.5,
        True,
        "dummy",
    )
    assert "kv_cache_memory_bytes" not in gpu
    cpu = _kwargs(on_gpu=False, enable_sleep_mode=True, kv_cache_bytes=2**20)
    assert cpu["kv_cache_memory_bytes"] == 2**20 and "enable_sleep_mode" not in cpu
    assert "gpu_memory_utilization" not in cpu and cpu["load_format"] == "auto"
    fp8 = _kwargs(quantization="fp8", capture_routing=True)
    assert (
        fp8["quantization"] == "fp8" and fp8["enable_return_routed_experts"] and fp8["enable_prefix_caching"]
    )


def test_rollout_enforce_eager_reaches_the_engine() -> None:
    from mars_megatron.rollout.factory import run_engine_recipe

    for value, expected in (("null", None), ("true", True), ("false", False)):
        cfg = load_config(None, ["rollout.engine=vllm", f"rollout.enforce_eager={value}"])
        assert run_engine_recipe(cfg, "dir").keywords["enforce_eager"] is expected
