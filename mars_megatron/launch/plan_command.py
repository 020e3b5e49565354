"""``mars plan``: the Megatron layouts that fit a model on a cluster, with memory per GPU and a relative
cost, ranked; with ``--config``, whether that config's own layout fits (:mod:`.config_fit`; exit code 1 if
not). The arithmetic (and every formula) lives in :mod:`.planner`; this module parses options and prints.
Errors are :class:`~.planner.PlanError` or :class:`~mars_megatron.config.ConfigError` (both
``ValueError`` naming the field), reported by ``mars``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from mars_megatron.launch.planner import (
    FP8_MODES,
    GIB,
    PRESETS,
    RECOMPUTE,
    TRANSFORMER_IMPLS,
    Candidate,
    Cluster,
    Layout,
    Plan,
    PlanError,
    Rollout,
    Workload,
    param_counts,
    plan,
    resolve_model,
)
from mars_megatron.launch.sync_estimate import Links

# option dest -> (dataclass, field); unset options take the dataclass default (defaults live there only)
_FIELDS: dict[str, tuple[type, str]] = {
    "gpus_per_node": (Cluster, "gpus_per_node"),
    "gpu_mem_gib": (Cluster, "gpu_mem_gib"),
    "overhead_gib": (Cluster, "overhead_gib"),
    "seq_len": (Workload, "seq_len"),
    "micro_batch": (Workload, "micro_batch"),
    "global_batch": (Workload, "global_batch"),
    "logits_bytes": (Workload, "logits_bytes"),
    "grad_bytes": (Workload, "grad_bytes"),
    "fp8": (Workload, "fp8"),
    "rollout_tp": (Rollout, "tp"),
    "rollout_seqs": (Rollout, "max_seqs"),
    "colocated": (Rollout, "colocated"),
    "trainer_offload": (Rollout, "trainer_offload"),
}
_LAYOUT_KEYS = {
    **{key: key for key in ("tp", "pp", "cp", "ep", "etp", "dp")},
    "first": "first_stage_layers",
    "last": "last_stage_layers",
}


def _default(name: str) -> Any:
    cls, attr = _FIELDS[name]
    return next(f.default for f in dataclasses.fields(cls) if f.name == attr)


# options that --config takes from the config instead: dest -> where it comes from
_FROM_CONFIG = {
    "layout": "parallel.*",
    "seq_len": "train.pack_length",
    "micro_batch": "one pack per micro-batch",
    "global_batch": "the worst case: pp micro-batches per rank",
    "recompute": "train.recompute",
    "transformer_impl": "model.transformer_impl (auto: Transformer Engine's, as on a GPU)",
    "no_flash_attention": "model.transformer_impl (auto: Transformer Engine's, as on a GPU)",
    "colocated": "pipeline.placement",
    "rollout_tp": "rollout.tp",
    "rollout_seq_len": "rollout.max_input_tokens + rollout.max_response_tokens",
    "trainer_offload": "the trainer, which keeps its state on the GPU",
    "logits_bytes": "the trainer's loss",
    "grad_bytes": "the trainer's fp32 main grads",
    "fp8": "model.fp8",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mars plan``."""
    p.add_argument(
        "--model",
        help=f"preset ({', '.join(PRESETS)}) or HF directory with config.json; with --config: instead of "
        "model.hf_dir",
    )
    p.add_argument(
        "--config",
        help="check this MarsRL config's own layout on --gpus GPUs (trainer and engines); exit code 1 if it "
        "does not fit",
    )
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of --config")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the training job")
    p.add_argument("--gpus-per-node", type=int, help=f"default {_default('gpus_per_node')}")
    p.add_argument("--gpu-mem-gib", type=float, help=f"memory per GPU; default {_default('gpu_mem_gib')}")
    p.add_argument(
        "--overhead-gib",
        type=float,
        help=f"CUDA context, NCCL, fragmentation; default {_default('overhead_gib')}",
    )
    p.add_argument("--seq-len", type=int, help=f"packed sequence length; default {_default('seq_len')}")
    p.add_argument(
        "--micro-batch", type=int, help=f"packed sequences per micro-batch; default {_default('micro_batch')}"
    )
    p.add_argument(
        "--global-batch", type=int, help=f"packed sequences per step; default {_default('global_batch')}"
    )
    p.add_argument("--recompute", choices=RECOMPUTE, help="only this recompute mode (default: none and full)")
    p.add_argument(
        "--transformer-impl",
        choices=("auto", *TRANSFORMER_IMPLS),
        help="model.transformer_impl: transformer_engine (default; auto on a GPU means it) or local, "
        "Megatron-Core's local layer spec (no TE: unfused norms and SwiGLU, attention that materialises its "
        "scores; selective recompute is tried too)",
    )
    p.add_argument(
        "--no-flash-attention",
        action="store_true",
        help="the same as --transformer-impl local: this trainer's only attention without flash is the local "
        "spec's",
    )
    p.add_argument(
        "--logits-bytes", type=float, help=f"bytes per logit at the loss; default {_default('logits_bytes')}"
    )
    p.add_argument(
        "--grad-bytes", type=int, choices=[2, 4], help=f"main-grad bytes; default {_default('grad_bytes')}"
    )
    p.add_argument(
        "--fp8",
        choices=FP8_MODES,
        help="model.fp8: Transformer Engine FP8 GEMMs on bf16 weights (adds FP8 weight copies, saves GEMM "
        "inputs in FP8) and FP8 vLLM engines; default bf16",
    )
    p.add_argument(
        "--colocated",
        action=argparse.BooleanOptionalAction,
        help=f"vLLM engines share the training GPUs; default {_default('colocated')}",
    )
    p.add_argument("--rollout-tp", type=int, help="GPUs per engine (default: the smallest that fits)")
    p.add_argument(
        "--rollout-seqs",
        type=int,
        help=f"sequences an engine holds (full length); default {_default('rollout_seqs')}",
    )
    p.add_argument("--rollout-seq-len", type=int, help="tokens per rollout sequence (default: --seq-len)")
    p.add_argument(
        "--trainer-offload",
        action="store_true",
        default=None,
        help="trainer state leaves the GPU during rollout",
    )
    p.add_argument(
        "--layout", help="evaluate one layout, e.g. tp=4,pp=2,ep=4 (also cp, etp, dp, first, last)"
    )
    p.add_argument(
        "--nic-gbps",
        type=float,
        default=Links.nic_gbps,
        help="with --config: one NIC's bandwidth in Gb/s, for the weight-sync estimate; default "
        f"{Links.nic_gbps:g}",
    )
    p.add_argument(
        "--nics-per-node",
        type=int,
        default=Links.nics_per_node,
        help=f"with --config: NICs per node the weight broadcast spreads over; default {Links.nics_per_node}",
    )
    p.add_argument("--top", type=int, default=10, help="fitting layouts to print")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parse_layout(text: str, gpus: int) -> Layout:
    """``tp=4,pp=2,ep=4`` -> :class:`Layout`; dp is what the GPUs leave unless given (then it must match)."""
    values: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in _LAYOUT_KEYS:
            raise PlanError(f"{item!r} is not KEY=INT with KEY in {', '.join(_LAYOUT_KEYS)}", "layout")
        try:
            values[_LAYOUT_KEYS[key]] = int(value)
        except ValueError:
            raise PlanError(f"expected an int, got {value!r}", key) from None
    layout = Layout(**values)
    model_parallel = layout.tp * layout.pp * layout.cp
    if gpus % model_parallel:
        raise PlanError(f"{gpus} GPUs are not divisible by tp*pp*cp = {model_parallel}", "gpus")
    if "dp" in values and layout.dp * model_parallel != gpus:
        raise PlanError(
            f"{layout.dp} but {gpus} GPUs / (tp*pp*cp = {model_parallel}) = {gpus // model_parallel}", "dp"
        )
    return dataclasses.replace(layout, dp=gpus // model_parallel)


def _build(args: argparse.Namespace) -> tuple[Cluster, Workload, Rollout]:
    given: dict[type, dict[str, Any]] = {Cluster: {"gpus": args.gpus}, Workload: {}, Rollout: {}}
    for name, (cls, attr) in _FIELDS.items():
        if getattr(args, name, None) is not None:
            given[cls][attr] = getattr(args, name)
    impl = args.transformer_impl
    if args.no_flash_attention:
        if impl not in (None, "local"):
            raise PlanError(f"means --transformer-impl local, not {impl}", "--no-flash-attention")
        impl = "local"
    if impl is not None:  # auto: what the trainer resolves on a GPU with Transformer Engine
        given[Workload]["transformer_impl"] = "transformer_engine" if impl == "auto" else impl
    work = Workload(**given[Workload])
    given[Rollout].setdefault("seq_len", args.rollout_seq_len or work.seq_len)
    given[Rollout]["fp8"] = work.fp8 is not None  # the engines follow model.fp8 (training/fp8.py)
    return Cluster(**given[Cluster]), work, Rollout(**given[Rollout])


def run(args: argparse.Namespace) -> int:
    """The ``mars plan`` job: rank the candidates and print them (a table, or JSON with ``--json``); with
    ``--config``, check that config (0 if it fits, 1 if not)."""
    if args.config is not None:
        return run_config(args)
    if args.overrides:
        raise PlanError(f"{args.overrides[0]!r}: overrides need --config", "overrides")
    if args.model is None:
        raise PlanError("give --model PRESET|DIR, or --config FILE", "model")
    if args.top < 0:
        raise PlanError(f"must be >= 0, got {args.top}", "top")
    arch = resolve_model(args.model)
    cluster, work, rollout = _build(args)
    layouts = [parse_layout(args.layout, cluster.gpus)] if args.layout else None
    result = plan(
        arch,
        cluster,
        work,
        rollout,
        layouts=layouts,
        recomputes=[args.recompute] if args.recompute else None,
        keep_not_fitting=len(RECOMPUTE) if layouts else 3,
    )
    print(json.dumps(plan_dict(result, args.top), indent=1) if args.json else format_plan(result, args.top))
    return 0


def run_config(args: argparse.Namespace) -> int:
    """``mars plan --config FILE [overrides] --gpus N``: print :func:`.config_fit.format_fit`."""
    from mars_megatron.config import load_config
    from mars_megatron.launch.config_fit import check_config, fit_dict, format_fit

    for dest, source in _FROM_CONFIG.items():
        if getattr(args, dest, None) not in (None, False):
            flag = "--" + dest.replace("_", "-")
            raise PlanError(f"comes from the config with --config ({source})", flag)
    cfg = load_config(args.config, args.overrides)
    given = {name: getattr(args, name) for name in ("gpus_per_node", "gpu_mem_gib", "overhead_gib")}
    cluster = Cluster(gpus=args.gpus, **{k: v for k, v in given.items() if v is not None})
    try:
        links = Links(nic_gbps=args.nic_gbps, nics_per_node=args.nics_per_node)
    except ValueError as e:
        raise PlanError(str(e), "--nic-gbps/--nics-per-node") from None
    fit = check_config(cfg, cluster, model=args.model, max_seqs=args.rollout_seqs, links=links)
    print(json.dumps(fit_dict(fit), indent=1) if args.json else format_fit(fit, args.config))
    return 0 if fit.fits else 1


# ------------------------------------------------------------------------------------------------ output
_COMPONENTS = ("weights", "grads", "optimizer", "activations", "logits", "rollout_weights", "kv_cache")
_HEADER = (
    "rank",
    "tp",
    "pp",
    "cp",
    "ep",
    "etp",
    "dp",
    "edp",
    "recompute",
    "rtp",
    "weights",
    "grads",
    "optim",
    "activ",
    "logits",
    "engine",
    "kv",
    "total",
    "cost",
    "notes",
)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _row(rank: str, c: Candidate, result: Plan) -> list[str]:
    lay, mem = c.layout, c.memory
    rtp = str(c.rollout.tp) if c.rollout.colocated else "-"
    stage = [f"stage {mem.stage}"] if lay.pp > 1 else []
    parts = [lay.tp, lay.pp, lay.cp, lay.ep, lay.expert_tp, lay.dp, lay.edp]
    sizes = [_gib(getattr(mem, name)) for name in _COMPONENTS]
    cost = f"{result.relative_cost(c):.2f}"
    return [
        rank,
        *map(str, parts),
        c.workload.recompute,
        rtp,
        *sizes,
        _gib(mem.total),
        cost,
        "; ".join(stage + list(c.notes)),
    ]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    aligned = []
    for r in rows:
        cells = [
            cell.ljust(w) if i in (8, len(r) - 1) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ]
        aligned.append("  ".join(cells).rstrip())
    return aligned


def format_plan(result: Plan, top: int) -> str:
    """The human-readable report: a header, the fitting candidates ranked, then the leanest misfits."""
    arch, cluster, rollout = result.arch, result.cluster, result.rollout
    counts = param_counts(arch)
    w = result.workload
    lines = [
        f"model: {arch.architecture}, {counts.total / 1e9:.2f}B parameters "
        f"({counts.active / 1e9:.2f}B active), {arch.num_layers} layers",
        f"cluster: {cluster.gpus} GPUs ({cluster.gpus_per_node} per node), {cluster.gpu_mem_gib:g} GiB each, "
        f"{cluster.overhead_gib:g} GiB overhead counted per GPU",
        f"step: packed sequences of {w.seq_len} tokens, micro-batch {w.micro_batch}, "
        f"global batch {w.global_batch}"
        + ("" if w.fp8 is None else f", FP8 {w.fp8} GEMMs (bf16 weights + TE's FP8 copies)")
        + (", Megatron-Core's local layer spec (no TE, no flash attention)" if not w.flash_attention else ""),
    ]
    if rollout.colocated:
        state = "offloaded" if rollout.trainer_offload else "resident"
        lines.append(
            f"rollout: colocated {'FP8 ' if rollout.fp8 else ''}vLLM engines of rtp GPUs, KV cache for "
            f"{rollout.max_seqs} sequences x {rollout.seq_len} tokens per engine; trainer state {state} "
            "while they run"
        )
    else:
        lines.append("rollout: engines on other GPUs (not counted)")
    lines.append("")
    lines.append(
        f"fits in {cluster.gpu_mem_gib:g} GiB: {len(result.fitting)} of {result.considered} candidates"
    )
    rows = [list(_HEADER)] + [_row(str(i + 1), c, result) for i, c in enumerate(result.fitting[:top])]
    if len(rows) > 1:
        lines += _table(rows)
    if result.not_fitting:
        lines += ["", "does not fit (leanest first):"]
        lines += _table([list(_HEADER)] + [_row("-", c, result) for c in result.not_fitting])
    lines += [
        "",
        "GiB per GPU on the worst pipeline stage; total = overhead + max(train, trainer state + engine + kv)",
        "cost: estimated step time relative to the best candidate (a heuristic); formulas in "
        "mars_megatron/launch/planner.py",
    ]
    return "\n".join(lines)


def _candidate_dict(c: Candidate, result: Plan) -> dict[str, Any]:
    mem = c.memory
    return {
        "layout": {**dataclasses.asdict(c.layout), "etp": c.layout.expert_tp, "edp": c.layout.edp},
        "recompute": c.workload.recompute,
        "rollout_tp": c.rollout.tp if c.rollout.colocated else None,
        "stage": mem.stage,
        "gib": {
            name: round(getattr(mem, name) / GIB, 3)
            for name in (*_COMPONENTS, "fp8_weight_cache", "overhead", "train", "rollout", "total")
        },
        "fits": c.fits,
        "step_seconds": round(c.seconds, 3),
        "relative_cost": round(result.relative_cost(c), 4),
        "notes": list(c.notes),
    }


def plan_dict(result: Plan, top: int) -> dict[str, Any]:
    """The report as JSON-ready data (GiB rounded to MiB precision)."""
    counts = param_counts(result.arch)
    return {
        "model": {
            "architecture": result.arch.architecture,
            "params": counts.total,
            "active_params": counts.active,
        },
        "cluster": dataclasses.asdict(result.cluster),
        "workload": dataclasses.asdict(result.workload),
        "rollout": dataclasses.asdict(result.rollout),
        "considered": result.considered,
        "fitting": [_candidate_dict(c, result) for c in result.fitting[:top]],
        "not_fitting": [_candidate_dict(c, result) for c in result.not_fitting],
    }
