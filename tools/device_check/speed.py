"""Check 6: speed and memory of the MarsRL train step on the card, beside a bare Megatron-Core loop.

Per model one spawned process (``--cpu``: one for both) builds the trainer's ``PolicyWorker``
(megatron's local layer spec: no Transformer Engine on the GPU machine, so attention is the unfused
``DotProductAttention``, which materialises the scores) and times, alternately (ours, bare, bare,
ours, ...), the machinery of ``tools/bench/train_step.py``: ``ours`` = ``PolicyWorker.train`` on a
packed GRPO batch as the trainer calls it, ``bare`` = the same packs pre-built, megatron's
forward/backward schedule with a minimal loss and ``optimizer.step``. Before timing, the two sides'
gradients on one batch are compared (same work, or the ratio means nothing).

Models (GPU, bf16, random weights, Qwen3's 151,936-token vocabulary): ``dense``, 0.88 B parameters (hidden
2048, FFN 8192, 10 layers, 8 query / 4 KV heads of 128, tied embeddings as Qwen3-1.7B); ``moe``, 0.74 B
parameters of which 0.39 B active (hidden 1024, 8 layers, 8 / 4 heads, 32 experts of FFN 512, top 4).
Eight query heads and ten layers keep the local spec's score tensors within an H100 at 8k: each layer
keeps 8 · s² scores (8k: 0.5 G elements) for its backward, 6 bytes each in bf16 (the fp32 softmax
output its backward needs, ``attention_softmax_in_fp32``, and the bf16 probabilities the PV matmul
saves), as ``mars plan --transformer-impl local`` counts them with the rest of the local spec's layer
(``planner.local_attention_bytes``/``local_mlp_bytes``, measured with saved-tensor hooks by
tests/test_planner.py). Pack lengths 4096 and 8192, 16 samples of 0.5–2k (4k) or
1–4k tokens (8k) per batch.

Rows per model and pack length:

- ``ours/bare`` step time (median of 4 each, after one warm-up each) ≤ 1.10 on the GPU — the trainer's
  packing, loss inputs, MarsRL objective and metrics may add at most 10 % to the bare loop — and the
  gradients of both sides equal within max |Δg| / max |g| ≤ 2e-2 (bf16 rounds the two losses'
  backward passes differently, by a few 2^-8 steps; a different objective differs by order 1).
  ``--cpu``: the fastest step of each side (2 each), ≤ 3.0, and 1e-5 (fp32). Tiny models on two shared
  cores take milliseconds per step, so the trainer's fixed per-step host work (planning, pack building,
  loss inputs: the bench's breakdown) is a large share, and other processes' load moves single steps
  (a median of two measured 2.7× once under a load of 5 on 2 cores, 1.0–1.2× without); the CPU row
  shows that the ratio is computed from the same machinery and stays bounded, not the GPU target.
- tokens/s and MFU of our step, reported. MFU = model FLOPs / (median step time × peak); model FLOPs =
  6 · (active matmul parameters: attention, dense MLP or the router and top-k experts, output layer;
  :attr:`~mars_megatron.launch.planner.ParamCounts.matmul_active`) · tokens + 6 · layers · heads ·
  head_dim · Σ ℓ² (each sample's causal attention within itself, forward and backward), no recompute,
  padding not counted. Peak: the nominal dense bf16 tensor throughput of the card: 989 TFLOP/s for an
  H100 SXM or H200 (756 for an H100 PCIe, 835 for the NVL cards); another card or the CPU: MFU not
  computed.
- peak memory of our step (``torch.cuda.max_memory_allocated``, the bare loop's pre-built packs freed
  first) against ``mars plan``'s prediction for the same model, layout (one GPU, tp = pp = ep = 1,
  distributed optimizer), pack length, one pack per micro-batch and layer spec: ``mars plan
  --transformer-impl local`` (``Workload(transformer_impl="local")``, recompute none). Compared with the
  prediction's training peak without its fixed ``overhead_gib`` (CUDA context, NCCL buffers,
  fragmentation), which the allocator's count does not see either; the planner's error in %, target
  ±10 %. ``--cpu``: not applicable — the planner predicts bf16 weights and fp32 gradients on a GPU, the
  CPU run is fp32 throughout, and a CPU process has no allocator count of its own (RSS holds the
  interpreter and libraries); the row computes the planner's prediction for the tiny shape and reports
  it.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tools.device_check.common import Context, Row, fmt, spawn, write_qwen3

CHECK = "6 speed"
RATIO_BOUND = {"gpu": 1.10, "cpu": 3.0}
GRAD_RTOL = {"gpu": 2e-2, "cpu": 1e-5}
PLANNER_TARGET_PCT = 10.0
PEAK_FLOPS = (("NVL", 835e12), ("PCIE", 756e12), ("H100", 989e12), ("H200", 989e12))
"""Nominal dense bf16 tensor FLOP/s by a substring of the device name, first match wins."""
_QWEN3_VOCAB = 151_936


@dataclass(frozen=True)
class Plan:
    """How the check measures in one mode."""

    shapes: tuple[Any, ...]  # tools.bench.train_step.Shape
    repeats: int
    warmup: int
    models: dict[str, tuple[str, dict[str, Any]]]  # name -> (HF model_type, config)


def plan_for(cpu: bool) -> Plan:
    """The models, shapes and step counts of ``--cpu`` or GPU mode (module docstring)."""
    from tools.bench.train_step import Shape

    base = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False)
    moe = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
    if cpu:
        common: dict[str, Any] = dict(
            vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=4096,
        )  # fmt: skip
        dense = {**common, **base, "tie_word_embeddings": False}
        experts = {**common, **base, **moe, "num_experts": 4, "num_experts_per_tok": 2}
        experts |= {"moe_intermediate_size": 64, "tie_word_embeddings": False}
        shapes = (Shape("64", 8, (6, 24), (4, 24), 64), Shape("128", 8, (12, 48), (8, 64), 128))
        return Plan(shapes, 2, 1, {"dense": ("qwen3", dense), "moe": ("qwen3_moe", experts)})
    heads = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960)
    dense = dict(vocab_size=_QWEN3_VOCAB, hidden_size=2048, num_hidden_layers=10, intermediate_size=8192)
    dense |= {**heads, **base, "tie_word_embeddings": True}
    experts = dict(vocab_size=_QWEN3_VOCAB, hidden_size=1024, num_hidden_layers=8, intermediate_size=3072)
    experts |= {**heads, **base, **moe, "num_experts": 32, "num_experts_per_tok": 4}
    experts |= {"moe_intermediate_size": 512, "tie_word_embeddings": False}
    shapes = (
        Shape("4k", 16, (100, 400), (400, 1600), 4096),
        Shape("8k", 16, (200, 800), (800, 3200), 8192),
    )
    return Plan(shapes, 4, 1, {"dense": ("qwen3", dense), "moe": ("qwen3_moe", experts)})


# ------------------------------------------------------------------------------------- spawned worker
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measure_shape(trainer: Any, shape: Any, repeats: int, warmup: int) -> dict[str, Any]:
    """One pack length: the gradient comparison, the alternated timings, then our step's peak memory."""
    from mars_megatron.agents.graph import SHARED
    from tools.bench.train_step import (
        _breakdown,
        _check_same_gradient,
        bare_step,
        make_samples,
        prepare_bare,
        time_alternately,
    )

    engine = trainer.policies[SHARED].megatron
    trainer.cfg.train.pack_length = shape.pack_length  # PolicyWorker packs every batch with it
    samples = make_samples(shape, engine.arch.vocab_size)
    packs = prepare_bare(engine, samples, shape.pack_length, trainer.loss)
    grad_diff, grad_scale = _check_same_gradient(trainer, engine, samples, packs, rtol=math.inf)

    def ours() -> None:
        trainer.train(trainer.local_shares({SHARED: samples}))

    def bare() -> None:
        bare_step(engine, packs)

    out: dict[str, Any] = {
        "times": time_alternately(ours, bare, repeats, warmup),
        "grad_diff": grad_diff,
        "grad_scale": grad_scale,
        "lengths": [len(s.tokens) for s in samples],
        "packs": len(packs),
        "pack_tokens": sum(p.tokens.shape[1] for p in packs),
        # where ours spends what bare does not: if ours - bare exceeds this host work, ours waits on syncs
        "breakdown_s": _breakdown(trainer, engine, samples, repeats=3),
    }
    packs.clear()  # the bare loop's pre-built packs are not the trainer's memory
    _free()
    if torch.cuda.is_available():
        _sync()
        out["state_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ours()
        _sync()
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    return out


def measure(
    models: list[tuple[str, str]], overrides: list[str], shapes: list[Any], repeats: int, warmup: int
) -> dict[str, Any]:
    """Spawned (a world of one): for each ``(name, model_dir)`` the trainer on it, then each shape in
    turn. A model or shape that fails (an out-of-memory at 8k) gives its traceback, the others their
    figures."""
    from mars_megatron.agents.graph import SHARED
    from mars_megatron.config import load_config
    from mars_megatron.rl.worker import PolicyWorker

    longest = max(s.pack_length for s in shapes)
    shortest = min(min(s.response[1], s.pack_length) for s in shapes)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name, model_dir in models:
        cfg = load_config(
            None,
            [
                f"model.hf_dir={model_dir}",
                "model.transformer_impl=local",
                f"train.pack_length={longest}",
                f"rollout.max_response_tokens={shortest}",
                "train.updates_per_batch=1",
                "optimizer.lr=1e-5",
                "train.seed=0",
                *overrides,
            ],
        )
        try:
            trainer = PolicyWorker(cfg, model_dir, [SHARED])
        except Exception:
            out[name] = traceback.format_exc()
            continue
        out[name] = {}
        for shape in shapes:
            try:
                out[name][shape.name] = _measure_shape(trainer, shape, repeats, warmup)
            except Exception:
                out[name][shape.name] = traceback.format_exc()
                _free()
        del trainer
        _free()
    return out


# --------------------------------------------------------------------------------------------- figures
def peak_flops(device_name: str) -> float | None:
    """Nominal dense bf16 FLOP/s of a card by its name (:data:`PEAK_FLOPS`); None when unknown."""
    name = device_name.upper()
    if "H100" not in name and "H200" not in name:
        return None
    return next(flops for key, flops in PEAK_FLOPS if key in name)


def model_flops(arch: Any, lengths: list[int]) -> float:
    """Training FLOPs of one batch of samples of ``lengths`` (module docstring: MFU)."""
    from mars_megatron.launch.planner import param_counts

    attention = 6 * arch.num_layers * arch.num_attention_heads * arch.head_dim * sum(n * n for n in lengths)
    return 6 * param_counts(arch).matmul_active * sum(lengths) + attention


def planned(model_dir: Path, pack_length: int) -> tuple[int, dict[str, int], str]:
    """``mars plan``'s training peak (bytes, without ``overhead_gib``) for ``model_dir`` on one GPU with
    packs of ``pack_length`` on the local layer spec; its terms; the equivalent command."""
    from mars_megatron.launch.planner import Cluster, Layout, Rollout, Workload, memory, resolve_model

    arch = resolve_model(str(model_dir))
    work = Workload(
        seq_len=pack_length, micro_batch=1, global_batch=1, recompute="none", transformer_impl="local"
    )
    mem = memory(arch, Layout(), work, Rollout(colocated=False), Cluster(gpus=1, overhead_gib=0.0))
    terms = {k: getattr(mem, k) for k in ("weights", "grads", "optimizer", "activations", "logits")}
    command = (
        f"mars plan --model {model_dir} --gpus 1 --layout tp=1 --seq-len {pack_length} --micro-batch 1 "
        "--global-batch 1 --recompute none --transformer-impl local --no-colocated --overhead-gib 0"
    )
    return mem.train, terms, command


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def shape_rows(
    ctx: Context, name: str, arch: Any, model_dir: Path, shape: Any, got: dict[str, Any], device: str
) -> list[Row]:
    """The three rows of one model at one pack length."""
    mode = "cpu" if ctx.cpu else "gpu"
    label = f"{name} {shape.name}"
    t = got["times"]
    ours, bare = statistics.median(t["ours"]), statistics.median(t["bare"])
    # CPU: the fastest step of each side, the one least disturbed by other processes on shared cores
    ratio = min(t["ours"]) / min(t["bare"]) if ctx.cpu else ours / bare
    dgrad = got["grad_diff"] / got["grad_scale"] if got["grad_scale"] > 0 else math.inf
    tokens = sum(got["lengths"])
    common = {
        "ours_s": t["ours"],
        "bare_s": t["bare"],
        "ours_cpu_s": t["ours_cpu"],  # process CPU time per step: host-bound if near the wall time
        "bare_cpu_s": t["bare_cpu"],
        "breakdown_s": got["breakdown_s"],
        "tokens": tokens,
        "packs": got["packs"],
    }
    rows = [
        Row(
            CHECK,
            f"{label}: ours/bare step time ({'fastest' if ctx.cpu else 'median'}); same gradient "
            f"(max|Δg|/max|g| ≤ {fmt(GRAD_RTOL[mode])})",
            f"{ratio:.3f}× (Δg {fmt(dgrad)})",
            f"≤ {RATIO_BOUND[mode]:.2f}×",
            bool(ratio <= RATIO_BOUND[mode] and dgrad <= GRAD_RTOL[mode]),
            {"ratio": ratio, "dgrad": dgrad, "ours_median_s": ours, "bare_median_s": bare, **common},
        )
    ]
    flops = model_flops(arch, got["lengths"])
    peak = peak_flops(device)
    mfu = flops / ours / peak if peak else None
    value = f"{tokens / ours:,.0f} tok/s" + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ", MFU n/a")
    peak_text = f"{peak / 1e12:g} TFLOP/s" if peak else "unknown"
    figures: dict[str, Any] = {
        "tokens_per_s": tokens / ours,
        "bare_tokens_per_s": tokens / bare,
        "model_flops": flops,
        "mfu": mfu,
        "peak_flops": peak,
        "device": device,
        "pack_tokens": got["pack_tokens"],
    }
    rows.append(
        Row(CHECK, f"{label}: our step's tokens/s and MFU (peak {peak_text})", value, "—",
            bool(math.isfinite(tokens / ours) and tokens / ours > 0), figures)
    )  # fmt: skip
    predicted, terms, command = planned(model_dir, shape.pack_length)
    figures = {"planned_bytes": predicted, "planned_terms": terms, "command": command}
    if "peak_bytes" not in got:
        rows.append(
            Row(
                CHECK,
                f"{label}: peak memory vs mars plan --transformer-impl local",
                f"n/a on CPU (plan: {_gib(predicted)} in bf16 on a GPU)",
                "—",
                predicted > 0,
                figures,
            )
        )
        return rows
    error = 100.0 * (predicted - got["peak_bytes"]) / got["peak_bytes"]
    figures |= {"peak_bytes": got["peak_bytes"], "state_bytes": got["state_bytes"], "error_pct": error}
    figures["planned_state_bytes"] = terms["weights"] + terms["grads"] + terms["optimizer"]
    rows.append(
        Row(
            CHECK,
            f"{label}: mars plan --transformer-impl local vs peak memory (max_memory_allocated)",
            f"{error:+.1f}% ({_gib(predicted)} planned, {_gib(got['peak_bytes'])} measured)",
            f"±{PLANNER_TARGET_PCT:g}%",
            bool(abs(error) <= PLANNER_TARGET_PCT),
            figures,
        )
    )
    return rows


def run(ctx: Context) -> list[Row]:
    from mars_megatron.models.hf_config import load_hf_config

    p = plan_for(ctx.cpu)
    overrides = [f"model.dtype={ctx.dtype_name}"]
    dirs = {}
    for name, (model_type, config) in p.models.items():
        dirs[name] = write_qwen3(ctx.workdir / "speed" / name, model_type, config, ctx.dtype_name)
        ctx.log(f"check 6: {name}, {_params(load_hf_config(dirs[name])) / 1e9:.2f} B parameters, written")
    # GPU: a process per model, so one model's out-of-memory or CUDA error and its allocations stay
    # its own; CPU (nothing measured per allocation): one process for both, one start-up less in CI
    groups = [[name] for name in dirs] if not ctx.cpu else [list(dirs)]
    rows: list[Row] = []
    for names in groups:
        start = time.perf_counter()
        ctx.log(
            f"check 6: timing {' and '.join(names)} at packs of {', '.join(s.name for s in p.shapes)} ..."
        )
        jobs = [(name, str(dirs[name])) for name in names]
        try:
            got = spawn(
                measure, jobs, overrides, list(p.shapes), p.repeats, p.warmup, timeout_s=ctx.timeout(420)
            )
        except RuntimeError as err:
            rows += [_failed(f"{name}: the measurement process", str(err)) for name in names]
            continue
        for name in names:
            if isinstance(got[name], str):
                rows.append(_failed(f"{name}: building the trainer", got[name]))
                continue
            arch = load_hf_config(dirs[name])
            for shape in p.shapes:
                result = got[name][shape.name]
                if isinstance(result, str):
                    rows.append(_failed(f"{name} {shape.name}: the measurement", result))
                else:
                    rows += shape_rows(ctx, name, arch, dirs[name], shape, result, got["device"])
        ctx.log(f"check 6: {' and '.join(names)} done in {time.perf_counter() - start:.0f} s")
    return rows


def _failed(what: str, error: str) -> Row:
    lines = error.strip().splitlines()
    return Row(
        CHECK, what, f"failed: {lines[-1] if lines else 'no message'}", "runs", False, {"error": error}
    )


def _params(arch: Any) -> int:
    from mars_megatron.launch.planner import param_counts

    return param_counts(arch).total
