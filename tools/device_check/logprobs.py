"""Check 1: Megatron-Core Qwen3 (dense and MoE, megatron's local layer spec) scores tokens as transformers
does, on the same device and in the same dtype.

For each model (random weights, stored in the check's dtype so both sides load identical numbers) one
spawned process computes per-token log-probs of the same sequences four ways: the trainer's scoring path
(``MegatronEngine.logprobs``: padded micro-batches of two sequences), the trainer's packed path
(``MegatronEngine.forward_logprobs`` on the packs ``plan``/``rank_packs`` build, block-diagonal causal
mask), transformers in the check's dtype, and transformers in fp32 on the same device and weights (the
truth both bf16 results approximate). transformers runs its default attention (SDPA) and, for the MoE,
its eager per-expert loop.

Bounds (GPU, bf16). Two implementations of one bf16 network differ by their rounding: bf16 keeps 8
significant bits (relative step 2^-8 = 3.9e-3), every matmul, norm and residual add rounds, and the final
logits are bf16, so each log-prob carries an error of about 2^-8 of the logits' magnitude from the last
rounding alone, plus what the layers accumulate. The same comparison in bf16 on a CPU (half this width,
32k vocabulary, 676 tokens) measured mean 3.5e-3 / max 1.8e-2 (dense) and 3.4e-3 / 5.1e-2 (MoE), and
megatron's error against fp32 1.08 times transformers'. So:

- mean |Δ log p| ≤ 2e-2 (dense) and ≤ 3e-2 (MoE: a token whose top-k experts tie up to rounding is routed
  differently by the two sides, and each such token moves by more than rounding);
- max |Δ log p| ≤ 0.25 (dense) and ≤ 0.5 (MoE): the worst of several thousand tokens, allowed a few
  rounding steps of the largest logits (and, for the MoE, a flipped expert). A subtle bug is far past
  both: a rotary base of 1e4 instead of 1e6 moved the same CPU model's log-probs by mean 0.2 / max 0.9
  (10x and 3.5x the dense bounds); a wrong mask, norm or expert mapping moves them more;
- megatron's mean error against the fp32 truth ≤ 1.5 × transformers' own bf16 error + 1e-3: whatever
  the absolute scale turns out to be on the card, the trainer in bf16 must be about as accurate as
  transformers in bf16. This bound calibrates itself.

In ``--cpu`` mode (fp32, tiny models) the two implementations differ only by fp32 summation order:
mean ≤ 1e-5, max ≤ 1e-4, and the truth row compares fp32 with fp32 (both errors ~0, the 1e-3 slack).
"""

from __future__ import annotations

import gc
import json
import random
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tools.device_check.common import Context, Row, at_most, shared_qwen3, spawn

CHECK = "1 logprobs"

_QWEN3_VOCAB = 151936


@dataclass(frozen=True)
class Bounds:
    mean: float
    max: float


GPU_BOUNDS = {"dense": Bounds(2e-2, 0.25), "moe": Bounds(3e-2, 0.5)}
CPU_BOUNDS = {"dense": Bounds(1e-5, 1e-4), "moe": Bounds(1e-5, 1e-4)}
TRUTH_RATIO, TRUTH_SLACK = 1.5, 1e-3


def model_configs(cpu: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (HF model_type, config). GPU: Qwen3-0.6B's width (8 of its 28 layers, tied embeddings,
    its 152k vocabulary) and a Qwen3-30B-A3B-like MoE scaled down (32 experts, top 8); CPU: the tiny
    presets' shapes."""
    if cpu:
        common: dict[str, Any] = dict(
            vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=4096,
        )  # fmt: skip
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    else:
        common = dict(
            vocab_size=_QWEN3_VOCAB, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
        )  # fmt: skip
        moe = dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=384)
    base = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False)
    return {
        "dense": ("qwen3", {**common, **base, "tie_word_embeddings": True}),
        "moe": (
            "qwen3_moe",
            {
                **common,
                **base,
                **moe,
                "num_hidden_layers": 2 if cpu else 4,
                "tie_word_embeddings": False,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "router_aux_loss_coef": 0.001,
            },
        ),
    }


def sequences(cpu: bool, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Seeded random token sequences of mixed lengths (padding and packing both matter), and the pack
    length the packed path uses."""
    rng = random.Random(seed)
    lengths = [40, 25, 17, 9, 31] if cpu else [1024, 700, 513, 300, 160, 90]
    seqs = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    return seqs, (64 if cpu else 2048)


def _hf_logprobs(model_dir: str, dtype: torch.dtype, seqs: list[list[int]]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    config = json.loads((Path(model_dir) / "config.json").read_text())
    # MoE: transformers' plain per-expert loop, the reference least likely to lack a kernel for a dtype
    # (its default grouped_mm depends on the card, the torch version and the dtype)
    kwargs = {"experts_implementation": "eager"} if "num_experts" in config else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).to(device).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s], device=device)
            logits = model(ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(lp.cpu().tolist())
    del model
    _free()
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def score(model_dir: str, seqs: list[list[int]], pack_length: int) -> dict[str, list[list[float]]]:
    """The four scorings of ``seqs`` (per sequence, log p of tokens 1..n-1); parallel state must be up."""
    from mars_megatron.config import ParallelConfig
    from mars_megatron.jobs import load_engine

    engine = load_engine(model_dir, ParallelConfig(), dtype=None, impl="local")
    padded = engine.logprobs(seqs, micro_batch=2)
    plan = engine.plan([len(s) for s in seqs], pack_length)
    mbs = engine.rank_packs(seqs, plan)
    packed: list[list[float]] = [[] for _ in seqs]
    for mb, lp in zip(mbs, engine.forward_logprobs(mbs), strict=True):
        assert mb.pack is not None
        for sample, (a, b) in zip(mb.pack.sample_ids, mb.pack.sample_spans, strict=True):
            packed[sample] = lp[0, a : b - 1].float().cpu().tolist()
    dtype = next(engine.model.parameters()).dtype
    del engine
    _free()
    return {
        "megatron": padded,
        "megatron_packed": packed,
        "transformers": _hf_logprobs(model_dir, dtype, seqs),
        "fp32": _hf_logprobs(model_dir, torch.float32, seqs),
    }


def score_models(jobs: list[tuple[str, str, list[list[int]], int]]) -> dict[str, Any]:
    """Spawned: :func:`score` of every ``(name, model_dir, seqs, pack_length)``; a model that fails gives
    its traceback instead, so the other's rows still come back."""
    from mars_megatron.config import ParallelConfig
    from mars_megatron.training import parallel

    parallel.init_model_parallel(ParallelConfig(), seed=0)
    out: dict[str, Any] = {}
    for name, model_dir, seqs, pack_length in jobs:
        try:
            out[name] = score(model_dir, seqs, pack_length)
        except Exception:
            out[name] = traceback.format_exc()
            _free()
    return out


def _flat(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for r in rows for x in r], dtype=torch.float64)


def compare(name: str, dtype: str, got: dict[str, list[list[float]]], bounds: Bounds) -> list[Row]:
    """The rows of one model from its four scorings."""
    ref = _flat(got["transformers"])
    truth = _flat(got["fp32"])
    rows = []
    for key, label in (("megatron", "micro-batches"), ("megatron_packed", "packed")):
        lp = _flat(got[key])
        if lp.shape != ref.shape:
            raise RuntimeError(f"{name} {label}: {lp.numel()} log-probs, transformers gave {ref.numel()}")
        diff = (lp - ref).abs()
        figures = {"tokens": lp.numel(), "mean": float(diff.mean()), "max": float(diff.max())}
        rows.append(
            at_most(CHECK, f"{name} {dtype} {label}: mean |Δ log p| vs transformers", figures["mean"],
                    bounds.mean, **figures)
        )  # fmt: skip
        rows.append(
            at_most(CHECK, f"{name} {dtype} {label}: max |Δ log p| vs transformers", figures["max"],
                    bounds.max, **figures)
        )  # fmt: skip
    ours = float((_flat(got["megatron"]) - truth).abs().mean())
    theirs = float((ref - truth).abs().mean())
    bound = TRUTH_RATIO * theirs + TRUTH_SLACK
    rows.append(
        at_most(CHECK, f"{name} {dtype}: mean |log p − fp32 truth|, megatron (bound: 1.5 × transformers' "
                "+ 1e-3)", ours, bound, megatron=ours, transformers=theirs)
    )  # fmt: skip
    return rows


def run(ctx: Context) -> list[Row]:
    bounds = CPU_BOUNDS if ctx.cpu else GPU_BOUNDS
    jobs = []
    for name, (model_type, config) in model_configs(ctx.cpu).items():
        ctx.log(f"{name}: a random {model_type} checkpoint ({ctx.dtype_name})")
        model_dir = shared_qwen3(ctx, name, model_type, config, seed=1)
        seqs, pack_length = sequences(ctx.cpu, config["vocab_size"])
        jobs.append((name, str(model_dir), seqs, pack_length))
    ctx.log(f"scoring {sum(len(s) for s in jobs[0][2])} tokens per model with megatron and transformers")
    results = spawn(score_models, jobs, timeout_s=ctx.timeout(300))
    rows: list[Row] = []
    for name, _, _, _ in jobs:
        got = results[name]
        if isinstance(got, str):
            ctx.log(f"{name} failed:\n{got}")
            last = got.strip().splitlines()[-1]
            rows.append(Row(CHECK, f"{name}: scoring", f"exception: {last}", "no exception", False))
        else:
            rows += compare(name, ctx.dtype_name, got, bounds[name])
    return rows
