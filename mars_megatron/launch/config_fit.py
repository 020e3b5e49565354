"""``mars plan --config``: a MarsRL config's own layout through the planner. Does it fit the GPUs?

Trainer: the layout of ``parallel.*`` (context parallelism included) on the ranks that
:func:`~.resources.trainer_world_size` leaves, one pack of ``train.pack_length`` tokens per micro-batch,
``train.recompute``, and the worst 1F1B case (stage i holds pp − i micro-batches in flight). With
``algorithm.policies=per_role`` every rank holds three policies (weights, grads and optimizer state each);
with ``algorithm.kl_coef > 0`` also a bf16 reference model per policy. One policy trains at a time, so
activations and logits count once.

Engines: one per ``rollout.tp`` GPUs, with a KV cache for ``max_seqs`` sequences of
``rollout.max_input_tokens + rollout.max_response_tokens`` tokens (:func:`~.planner.rollout_bytes`; vLLM
pages its cache, so shorter sequences share that space). Colocated engines (tp 1) count in the trainer's
peak (:class:`~.planner.Memory`); other engines hold GPUs of their own, which must hold weights / tp +
KV cache + overhead. An engine is one Ray actor, so it lives on one node (tp <= gpus per node).

``model.fp8`` reaches both sides (the planner's module docstring has the terms): the trainer's workload
gets TE's FP8 weight copies and FP8 GEMM inputs, and the engines vLLM's FP8 weights when
:func:`~mars_megatron.training.fp8.vllm_quantization` asks for them. A KL reference runs forward only,
without grad, so TE caches only the row-wise FP8 copy of its weights: half a policy's copies.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import Any

from mars_megatron.config import ConfigError, MarsConfig
from mars_megatron.launch.planner import (
    GIB,
    Cluster,
    Layout,
    Memory,
    PlanError,
    Rollout,
    Workload,
    check_rollout,
    memory,
    notes,
    param_counts,
    resolve_model,
    rollout_bytes,
)
from mars_megatron.launch.resources import rollout_engines, trainer_world_size
from mars_megatron.launch.sync_estimate import Links, SyncEstimate, estimate_sync, format_estimate
from mars_megatron.models.hf_config import Qwen3Arch
from mars_megatron.training.fp8 import vllm_quantization

# planner field -> config field, for layout errors
_CONFIG_FIELDS = {"seq_len": "train.pack_length", "gpus": "parallel"}


@dataclass(frozen=True)
class ConfigFit:
    """Memory per GPU of a config on a cluster: the trainer's worst stage and one engine GPU."""

    arch: Qwen3Arch
    cluster: Cluster  # every GPU of the run
    placement: str
    layout: Layout  # the trainer's
    workload: Workload
    rollout: Rollout  # the engines: colocated or not, tp, KV cache size
    engines: int
    trainer: Memory  # includes colocated engines
    engine_weights: int  # bytes on one engine GPU; for colocated engines also inside ``trainer``
    engine_kv: int
    engine_fits_node: bool
    notes: tuple[str, ...] = ()
    sync: SyncEstimate | None = None  # seconds per weight push, on paper

    @property
    def trainer_world(self) -> int:
        return self.layout.world

    @property
    def engine_total(self) -> int:
        """One GPU of a separate engine (0 when colocated: its share is in ``trainer``)."""
        if self.rollout.colocated:
            return 0
        return self.engine_weights + self.engine_kv + self.trainer.overhead

    @property
    def trainer_fits(self) -> bool:
        return self.trainer.total <= self.cluster.gpu_mem_gib * GIB

    @property
    def engine_fits(self) -> bool:
        return self.engine_fits_node and self.engine_total <= self.cluster.gpu_mem_gib * GIB

    @property
    def fits(self) -> bool:
        return self.trainer_fits and self.engine_fits


def config_layout(cfg: MarsConfig, world: int) -> Layout:
    p = cfg.parallel
    return Layout(
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        etp=p.etp,
        dp=world // (p.tp * p.pp * p.cp),
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
    )


def trainer_memory(
    cfg: MarsConfig, arch: Qwen3Arch, world: int, rollout: Rollout, cluster: Cluster
) -> tuple[Layout, Workload, Memory]:
    """The trainer's layout, workload and per-GPU memory on ``world`` ranks (see the module docstring)."""
    from mars_megatron.agents.graph_file import policy_names

    layout = config_layout(cfg, world)
    work = Workload(
        seq_len=cfg.train.pack_length,
        micro_batch=1,
        global_batch=layout.dp * layout.pp,  # pp micro-batches per rank: the first stage's worst case
        recompute=cfg.train.recompute,
        distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        fp8=cfg.model.fp8,
        # auto is Transformer Engine's layers on a GPU (training/model_provider.py)
        transformer_impl="local" if cfg.model.transformer_impl == "local" else "transformer_engine",
    )
    # memory() takes the trainer's share of the nodes as a cluster; the node size does not enter memory
    share = Cluster(
        gpus=world,
        gpus_per_node=math.gcd(world, cluster.gpus_per_node),
        gpu_mem_gib=cluster.gpu_mem_gib,
        overhead_gib=cluster.overhead_gib,
    )
    try:
        mem = memory(arch, layout, work, rollout, share)
    except PlanError as err:
        raise ConfigError(err.message, _CONFIG_FIELDS.get(err.path, f"parallel.{err.path}")) from None
    policies = len(policy_names(cfg))
    references = policies if cfg.algorithm.kl_coef > 0 else 0
    cache = mem.fp8_weight_cache * policies + mem.fp8_weight_cache // 2 * references  # references: row-wise
    mem = replace(
        mem,
        weights=(mem.weights - mem.fp8_weight_cache) * (policies + references) + cache,
        grads=mem.grads * policies,
        optimizer=mem.optimizer * policies,
        fp8_weight_cache=cache,
    )
    return layout, work, mem


def check_config(
    cfg: MarsConfig,
    cluster: Cluster,
    *,
    model: str | None = None,
    max_seqs: int | None = None,
    links: Links | None = None,
) -> ConfigFit:
    """Evaluate ``cfg``'s layout on ``cluster`` (all GPUs of the run). ``model``: a preset or HF directory
    instead of ``model.hf_dir``; ``max_seqs``: full-length sequences of KV cache per engine (default:
    the planner's); ``links``: the bandwidths of the weight-sync estimate (default :class:`Links`).
    Raises :class:`ConfigError` naming the config field for a layout that cannot run."""
    source = model or cfg.model.hf_dir
    if source is None:
        raise ConfigError("is null: set it, or pass --model PRESET|DIR", "model.hf_dir")
    try:
        arch = resolve_model(source)
    except PlanError as err:
        raise ConfigError(err.message, "model.hf_dir" if model is None else "model") from None
    world = trainer_world_size(cfg, cluster.gpus)
    engines = rollout_engines(cfg)
    placement = cfg.pipeline.placement
    colocated = placement == "colocated"
    rtp = cfg.rollout.tp  # trainer_world_size refused colocated engines with more GPUs than the trainer's
    try:
        check_rollout(arch, rtp, rtp * engines)
    except PlanError as err:
        raise ConfigError(err.message, "rollout.tp") from None
    seqs = {} if max_seqs is None else {"max_seqs": max_seqs}
    seq_len = cfg.rollout.max_input_tokens + cfg.rollout.max_response_tokens
    fp8 = vllm_quantization(cfg.model.fp8) == "fp8"
    rollout = Rollout(colocated=colocated, tp=rtp, seq_len=seq_len, fp8=fp8, **seqs)
    layout, work, trainer = trainer_memory(cfg, arch, world, rollout, cluster)
    weights, kv = rollout_bytes(arch, rollout)
    remarks = list(notes(layout, cluster))
    fits_node = rtp <= cluster.gpus_per_node
    if not fits_node:
        remarks.append(
            f"rollout.tp {rtp} > {cluster.gpus_per_node} GPUs per node: an engine's tensor-parallel "
            "workers would talk across nodes"
        )
    if placement == "none":
        remarks.append(
            f"placement none: Ray places the {engines} engines; on GPUs they need {engines * rtp} GPUs "
            f"beside the {world} trainer ranks (mars train refuses fewer)"
        )
    return ConfigFit(
        arch,
        cluster,
        placement,
        layout,
        work,
        rollout,
        engines,
        trainer,
        weights,
        kv,
        fits_node,
        tuple(remarks),
        estimate_sync(
            arch, layout, rtp, one_node=cluster.gpus <= cluster.gpus_per_node, links=links or Links()
        ),
    )


# ------------------------------------------------------------------------------------------------ output
_TRAINER = ("weights", "grads", "optimizer", "activations", "logits")


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _verdict(ok: bool) -> str:
    return "fits" if ok else "does not fit"


def format_fit(fit: ConfigFit, config: str) -> str:
    """The report of ``mars plan --config``: where everything runs, GiB per GPU, and the verdict."""
    c, lay, r, mem = fit.cluster, fit.layout, fit.rollout, fit.trainer
    counts = param_counts(fit.arch)
    mem_gib = f"{c.gpu_mem_gib:g} GiB"
    lines = [
        f"config: {config}",
        f"model: {fit.arch.architecture}, {counts.total / 1e9:.2f}B parameters "
        f"({counts.active / 1e9:.2f}B active), {fit.arch.num_layers} layers",
        f"cluster: {c.gpus} GPUs ({c.gpus_per_node} per node), {mem_gib} each, {c.overhead_gib:g} GiB "
        "overhead counted per GPU",
    ]
    where = {
        "disaggregated": f" = {fit.engines * (r.tp or 1)} GPUs of their own",
        "colocated": " on the trainer's GPUs",
        "none": ", placed by Ray",
    }[fit.placement]
    lines.append(
        f"placement {fit.placement}: {fit.trainer_world} trainer ranks; {fit.engines} rollout engines x "
        f"rollout.tp {r.tp}{where}"
    )
    stage = f", worst stage {mem.stage}" if lay.pp > 1 else ""
    parts = "  ".join(f"{name} {_gib(getattr(mem, name))}" for name in _TRAINER)
    w = fit.workload
    lines += [
        "",
        f"trainer: {lay.label()} (edp {lay.edp}), packs of {w.seq_len} tokens, micro-batch 1, "
        f"recompute {w.recompute}"
        + ("" if w.fp8 is None else f", FP8 {w.fp8} (weights include TE's FP8 copies)"),
        f"  GiB per GPU{stage}: {parts}  overhead {_gib(mem.overhead)}",
    ]
    if r.colocated:
        lines.append(
            f"  rollout phase: trainer state + engine {_gib(fit.engine_weights)} + KV cache "
            f"{_gib(fit.engine_kv)} = {_gib(mem.rollout)}"
        )
    lines.append(f"  total {_gib(mem.total)} of {mem_gib}: {_verdict(fit.trainer_fits)}")
    kv = f"KV cache {_gib(fit.engine_kv)} ({r.max_seqs} sequences x {r.seq_len} tokens)"
    vllm = "FP8 vLLM" if r.fp8 else "vLLM"
    if r.colocated:
        lines.append(
            f"engine: {vllm} on the trainer's GPUs (in its total): weights {_gib(fit.engine_weights)}  {kv}"
        )
    else:
        lines += [
            f"engine: {vllm} tp {r.tp} on GPUs of its own",
            f"  GiB per GPU: weights {_gib(fit.engine_weights)}  {kv}  overhead {_gib(mem.overhead)}",
            f"  total {_gib(fit.engine_total)} of {mem_gib}: {_verdict(fit.engine_fits)}",
        ]
    if fit.sync is not None:
        lines += ["", *format_estimate(fit.sync)]
    lines += [f"note: {n}" for n in fit.notes]
    lines += ["", _verdict(fit.fits)]
    return "\n".join(lines)


def fit_dict(fit: ConfigFit) -> dict[str, Any]:
    """The report as JSON-ready data (GiB rounded to MiB precision)."""
    mem = fit.trainer

    def gib(n: int) -> float:
        return round(n / GIB, 3)

    return {
        "cluster": dataclasses.asdict(fit.cluster),
        "placement": fit.placement,
        "trainer_world": fit.trainer_world,
        "engines": fit.engines,
        "layout": {**dataclasses.asdict(fit.layout), "etp": fit.layout.expert_tp, "edp": fit.layout.edp},
        "workload": dataclasses.asdict(fit.workload),
        "rollout": dataclasses.asdict(fit.rollout),
        "trainer_gib": {
            name: gib(getattr(mem, name))
            for name in (*_TRAINER, "fp8_weight_cache", "overhead", "train", "rollout", "total")
        },
        "engine_gib": {
            "weights": gib(fit.engine_weights),
            "kv_cache": gib(fit.engine_kv),
            "total": gib(fit.engine_total),
        },
        "trainer_fits": fit.trainer_fits,
        "engine_fits": fit.engine_fits,
        "fits": fit.fits,
        "notes": list(fit.notes),
        "weight_sync": None
        if fit.sync is None
        else {
            "seconds": round(fit.sync.seconds, 4),
            "gather_s": round(fit.sync.gather_s, 4),
            "wire_s": round(fit.sync.wire_s, 4),
            "load_s": round(fit.sync.load_s, 4),
            "bytes": fit.sync.bytes,
            "senders": fit.sync.senders,
            "links": dataclasses.asdict(fit.sync.links),
        },
    }
