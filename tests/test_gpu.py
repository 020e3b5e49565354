"""The GPU paths, end to end: Transformer Engine layer spec, THD packed sequences, NCCL, context
parallelism over THD (two GPUs), FP8 training and rollout, official vLLM as the RL engine, colocated vLLM
engines freeing their memory in sleep mode. Marked ``gpu``:
skipped where CUDA is missing (every CPU machine and CI here), run with ``pytest -m gpu`` on a GPU node.
None of these has run yet (README, GPU status)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mars_megatron.models.presets import init_model
from tests.test_cli import TOKENS, hf_logprobs, mars, ok, read_logprobs, write_tokens

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]
TE = ["model.transformer_impl=transformer_engine", "model.dtype=bfloat16"]


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("gpu") / "hf")


def test_transformer_engine_spec_scores_like_transformers(tiny: Path, tmp_path: Path) -> None:
    """TE layers (fused attention, grouped GEMM experts) on the GPU give HF's log-probs."""
    tokens = write_tokens(tmp_path / "tokens.jsonl", TOKENS)
    out = tmp_path / "te.jsonl"
    ok(mars("score", "--model-dir", tiny, "--input", tokens, "--output", out, "--impl", "transformer_engine",
            cwd=REPO))  # fmt: skip
    for got, ref in zip(read_logprobs(out), hf_logprobs(tiny, TOKENS), strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)  # TF32 GEMMs on the GPU


def _train(model: Path, run: Path, *extra: str) -> list[dict]:
    ok(mars("train", REPO / "examples" / "tiny_cpu.yaml", f"model.hf_dir={model}",
            f"data.train_file={REPO / 'examples/data/arith_train.jsonl'}", f"logging.run_dir={run}",
            "parallel.ep=1", "train.steps=2", "data.problems_per_step=4", *extra, cwd=REPO))  # fmt: skip
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_rl_steps_with_te_thd_packing_and_nccl(tiny: Path, tmp_path: Path) -> None:
    """`mars train` on one GPU: TE spec, packed THD micro-batches, NCCL process group."""
    records = _train(tiny, tmp_path / "run", *TE)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/update_ok"] == 1.0 and r["train/grad_norm"] > 0 for r in records)


@pytest.mark.parametrize("mode", ["hybrid", "e4m3", "blockwise"])
def test_fp8_training_steps(tiny: Path, tmp_path: Path, mode: str) -> None:
    need = (9, 0) if mode == "blockwise" else (8, 9)
    if _capability() < need:
        pytest.skip(f"model.fp8={mode} needs compute capability {need}")
    records = _train(tiny, tmp_path / "run", *TE, f"model.fp8={mode}", "train.pack_length=1024")
    assert all(r["train/update_ok"] == 1.0 and r["train/loss"] == r["train/loss"] for r in records)


@pytest.mark.vllm
def test_official_vllm_as_the_rl_engine_with_fp8_rollout(tiny: Path, tmp_path: Path) -> None:
    """vLLM on the GPU generates the rollouts and takes the trainer's weights after every update; with
    model.fp8 it quantizes them online."""
    if _capability() < (8, 9):
        pytest.skip("FP8 rollout needs compute capability 8.9")
    fp8 = ["model.fp8=hybrid", "train.pack_length=1024"]
    records = _train(tiny, tmp_path / "run", "rollout.engine=vllm", *TE, *fp8)
    assert [r["policy_version"] for r in records] == [1.0, 2.0]


@pytest.mark.vllm
def test_colocated_vllm_engine_frees_its_memory_asleep_and_decodes_after_wake_and_push(
    tmp_path: Path,
) -> None:
    """A colocated engine as `mars train` builds one (sleep mode, a share of the GPU): sleep (level 2)
    gives back most of that share, which this process (standing in for the trainer) can then allocate;
    after wake_weights, the weight push and wake it decodes what it decoded before."""
    from safetensors.torch import load_file

    from mars_megatron.rollout.engine import GenerationRequest, SamplingParams
    from mars_megatron.rollout.factory import build_engine
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    dense = init_model("tiny-dense", tmp_path / "dense", dtype="bfloat16")
    share = 0.3
    engine = build_engine("vllm", str(dense), dtype="bfloat16", seed=0, max_batch=8,
                          gpu_memory_utilization=share, enable_sleep_mode=True)  # fmt: skip
    assert isinstance(engine, VLLMEngine) and engine.sleep_frees_memory
    assert engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization == share
    greedy = SamplingParams(max_tokens=16, temperature=0)
    requests = [GenerationRequest(f"r{i}", tuple(range(5 + i, 12 + 2 * i)), greedy) for i in range(4)]
    before = engine.generate(requests)
    free_awake, total = torch.cuda.mem_get_info()
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    gib = 2**30
    assert freed >= 0.5 * share * total, f"sleep freed {freed / gib:.2f} GiB of {share * total / gib:.1f}"
    held = torch.empty(int(0.9 * freed), dtype=torch.uint8, device="cuda")  # the trainer's turn
    del held
    torch.cuda.empty_cache()
    engine.wake_weights()
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(dense.glob("*.safetensors")):
        tensors.update(load_file(f))
    assert engine.update_weights(tensors.items()) == len(tensors)
    engine.wake()
    after = engine.generate(requests)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


@pytest.mark.vllm
def test_rl_steps_with_a_colocated_vllm_engine(tiny: Path, tmp_path: Path) -> None:
    """`mars train` with pipeline.placement=colocated on one GPU: the trainer rank and the vLLM engine
    share it; the engine sleeps through each update and wakes around the weight push."""
    records = _train(tiny, tmp_path / "run", "rollout.engine=vllm", "pipeline.placement=colocated", *TE)
    assert [r["policy_version"] for r in records] == [1.0, 2.0]
    assert all(r["train/update_ok"] == 1.0 for r in records)


def test_context_parallel_thd_steps_on_two_gpus(tiny: Path) -> None:
    """CP2 with TE's ring attention over THD packs (every sample padded to a multiple of 2*cp and split
    per sample) takes the step one GPU takes, within bf16 rounding."""
    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism needs two GPUs")
    from mars_megatron.training import parallel
    from tests.rl_workers import train_samples
    from tests.test_rl_train import BASE, SAMPLES

    overrides = [*BASE, *TE, "optimizer.lr=1e-3"]
    (one,) = parallel.launch(train_samples, 1, str(tiny), overrides, SAMPLES, 1, timeout_s=600)
    ranks = parallel.launch(
        train_samples, 2, str(tiny), [*overrides, "parallel.cp=2"], SAMPLES, 1, timeout_s=600
    )
    for r in ranks:
        assert r[0]["train/tokens"] == one[0]["train/tokens"]
        assert r[0]["train/loss"] == pytest.approx(one[0]["train/loss"], rel=2e-2)
        assert r[0]["train/grad_norm"] == pytest.approx(one[0]["train/grad_norm"], rel=2e-2)
