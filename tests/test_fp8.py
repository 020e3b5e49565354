"""``model.fp8``: the mode → Transformer Engine / vLLM mapping, and clear, early errors where FP8 cannot
run (this CPU machine among them). The FP8 train step and FP8 rollout themselves are in tests/test_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from mars_megatron.config import ConfigError, load_config
from mars_megatron.models.presets import init_model
from mars_megatron.training.fp8 import check_fp8, fp8_problem, megatron_fp8_kwargs, vllm_quantization

REPO = Path(__file__).resolve().parents[1]


def test_modes_map_to_megatron_recipes() -> None:
    delayed = {"fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"}
    assert megatron_fp8_kwargs("hybrid", moe=False) == {"fp8": "hybrid", "fp8_recipe": "delayed", **delayed}
    assert megatron_fp8_kwargs("e4m3", moe=False) == {"fp8": "e4m3", "fp8_recipe": "tensorwise"}
    blockwise = megatron_fp8_kwargs("blockwise", moe=True)
    assert blockwise == {
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "moe_router_padding_for_quantization": True,
    }
    from megatron.core.enums import Fp8Recipe  # every recipe name is one megatron knows

    assert {megatron_fp8_kwargs(m, moe=False)["fp8_recipe"] for m in ("hybrid", "e4m3", "blockwise")} <= {
        r.value for r in Fp8Recipe
    }
    assert vllm_quantization("blockwise") == "fp8" and vllm_quantization(None) is None


@pytest.mark.parametrize(
    ("mode", "machine", "expected"),
    [
        ("hybrid", dict(cuda=False, capability=None, te_version=None), "no CUDA device"),
        ("hybrid", dict(cuda=True, capability=(8, 0), te_version="2.5.0"), "Ada or Hopper-class GPU"),
        ("blockwise", dict(cuda=True, capability=(8, 9), te_version="2.5.0"), "Hopper-class GPU"),
        ("e4m3", dict(cuda=True, capability=(9, 0), te_version=None), "Transformer Engine"),
        ("e4m3", dict(cuda=True, capability=(9, 0), te_version="2.1.0"), ">= 2.2, found 2.1.0"),
        (
            "blockwise",
            dict(cuda=True, capability=(9, 0), te_version="2.2.1+cu12"),
            ">= 2.3, found 2.2.1+cu12",
        ),
        (
            "blockwise",
            dict(cuda=True, capability=(9, 0), te_version="2.11.0", cuda_version="12.8"),
            "needs CUDA >= 12.9 (Transformer Engine's block-scaled FP8 GEMMs come from cuBLASLt 12.9), torch "
            "was built with CUDA 12.8",
        ),
        ("blockwise", dict(cuda=True, capability=(9, 0), te_version="2.11.0"), "built with CUDA unknown"),
    ],
)
def test_fp8_problems_name_what_is_missing(mode: str, machine: dict, expected: str) -> None:
    problem = fp8_problem(mode, **machine)  # type: ignore[arg-type]
    assert problem is not None and expected in problem


def test_fp8_runs_where_the_hardware_has_it() -> None:
    for mode in ("hybrid", "e4m3", "blockwise"):
        for cuda in ("12.9", "13.0"):
            assert (
                fp8_problem(mode, cuda=True, capability=(9, 0), te_version="2.8.0", cuda_version=cuda) is None
            )  # type: ignore[arg-type]
    assert fp8_problem("hybrid", cuda=True, capability=(8, 9), te_version="1.13.0") is None  # no CUDA floor


def test_this_cpu_machine_is_refused_early_with_the_field(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU refusal is what is tested here")
    with pytest.raises(ConfigError, match=r"model\.fp8: 'hybrid' needs an NVIDIA GPU .*model\.fp8=null"):
        check_fp8("hybrid")
    # `mars train` refuses in prepare(), before Ray or any rank starts
    from mars_megatron.pipeline.trainer import prepare

    model = init_model("tiny-moe", tmp_path / "hf")
    common = [f"model.hf_dir={model}", f"data.train_file={REPO / 'examples/data/arith_train.jsonl'}",
              f"logging.run_dir={tmp_path / 'run'}", "model.fp8=e4m3",
              "model.transformer_impl=auto"]  # fmt: skip
    example = REPO / "examples" / "tiny_cpu.yaml"
    cfg = load_config(example, [*common, "parallel.moe_token_dispatcher=alltoall"])
    with pytest.raises(ConfigError, match=r"model\.fp8: 'e4m3' needs an NVIDIA GPU"):
        prepare(cfg, nproc=None, resume=None)
    cfg = load_config(
        REPO / "examples" / "tiny_cpu.yaml", [*common, "parallel.moe_token_dispatcher=allgather"]
    )
    with pytest.raises(ConfigError, match=r"parallel\.moe_token_dispatcher: .* alltoall dispatcher"):
        prepare(cfg, nproc=None, resume=None)


def test_fp8_rollout_needs_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU refusal is what is tested here")
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    with pytest.raises(RuntimeError, match=r"quantization='fp8' needs a GPU"):
        VLLMEngine("unused", quantization="fp8")
