"""Move weights between HF tensors and a live, sharded Megatron model, in any TP/PP/EP layout.

Loading: every rank reads only the HF tensors its parameters need, one at a time, and keeps its piece.
Export: for each parameter of the whole model (a canonical order every rank agrees on), the ranks that
hold it gather its pieces over their TP (or expert-TP) group, one holder sends it to global rank 0, and
rank 0 yields full HF tensors one at a time (HF checkpoints). The weight push to rollout engines walks the
same export without the trip to rank 0 (:func:`export_at_senders`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.comm import collectives
from mars_megatron.conversion.qwen3_mapping import (
    ParamPlan,
    expected_hf_tensors,
    init_tensor,
    plan_for,
    shard_into,
    shard_shape,
    unshard,
)
from mars_megatron.dtypes import SAFETENSORS_TAGS, torch_dtype
from mars_megatron.models.hf_config import Qwen3Arch


class TensorSource(Protocol):
    """Anything that hands out full HF tensors by name."""

    def get(self, name: str) -> torch.Tensor: ...


@dataclass
class SeededInit:
    """A :class:`TensorSource` of freshly initialised weights that depend only on (seed, tensor name)."""

    arch: Qwen3Arch
    seed: int
    dtype: torch.dtype

    def get(self, name: str) -> torch.Tensor:
        shape = expected_hf_tensors(self.arch)[name]
        return init_tensor(name, shape, self.seed, self.arch.initializer_range, self.dtype)


def validate_hf_checkpoint(reader: Any, arch: Qwen3Arch) -> None:
    """Fail before touching the model if names or shapes differ from what ``arch`` implies."""
    expected = expected_hf_tensors(arch)
    present = set(reader.names())
    missing = [n for n in expected if n not in present]
    if missing:
        raise CheckpointError(
            f"{reader.dir}: {len(missing)} tensor(s) missing from the checkpoint, e.g. '{missing[0]}'"
        )
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{reader.dir}: {len(unexpected)} tensor(s) not expected for {arch.architecture}, "
            f"e.g. '{unexpected[0]}'"
        )
    tag = SAFETENSORS_TAGS[torch_dtype(arch.dtype)]
    for name, shape in expected.items():
        if reader.dtype(name) != tag:
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor '{name}' is {reader.dtype(name)}, config.json declares "
                f"{arch.dtype} ({tag}); refusing to cast silently"
            )
        got = reader.shape(name)
        if got != shape:
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor '{name}' has shape {list(got)}, "
                f"config.json implies {list(shape)}"
            )


def _stage_layers(model: torch.nn.Module, arch: Qwen3Arch) -> list[int]:
    """Layers per pipeline stage of ``model``'s layout (even, or megatron's first/last-stage counts)."""
    from megatron.core import parallel_state as ps

    from mars_megatron.models.layout import stage_layers

    config = getattr(model, "module", model).config
    return stage_layers(
        arch.num_layers,
        ps.get_pipeline_model_parallel_world_size(),
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
    )


def _offsets(model: torch.nn.Module, arch: Qwen3Arch) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    layer_offset = sum(_stage_layers(model, arch)[: ps.get_pipeline_model_parallel_rank()])
    expert_offset = 0
    if arch.is_moe:
        assert arch.num_experts is not None
        expert_offset = ps.get_expert_model_parallel_rank() * (
            arch.num_experts // ps.get_expert_model_parallel_world_size()
        )
    return layer_offset, expert_offset


def _group_coords(plan: ParamPlan) -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if plan.group == "tp":
        return (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group(),
        )
    if plan.group == "etp":
        return (
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_group(),
        )
    return 0, 1, None


def _local_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    # DDP wraps the GPTModel as ``.module``; names are those of the bare model.
    inner = getattr(model, "module", model)
    yield from inner.named_parameters()


@torch.no_grad()
def load_weights(model: torch.nn.Module, source: TensorSource, arch: Qwen3Arch, padded_vocab: int) -> int:
    """Fill this rank's parameters from ``source``; returns how many parameters were set.

    Each HF tensor is read once per parameter that needs it and copied straight into the parameter's
    slices, so loading costs one copy of the weights and at most a few full HF tensors at a time.
    """
    layer_offset, expert_offset = _offsets(model, arch)
    count = 0
    for name, param in _local_params(model):
        plan = plan_for(name, arch, layer_offset, expert_offset)
        rank, size, _ = _group_coords(plan)
        full = [source.get(n) for n in plan.hf_names]
        shape = shard_shape(plan, [tuple(t.shape) for t in full], size, arch, padded_vocab)
        if shape != tuple(param.shape):
            raise CheckpointError(
                f"tensor(s) {list(plan.hf_names)} give {name} shape {list(shape)} on this rank, "
                f"the model expects {list(param.shape)}"
            )
        shard_into(param.data, plan, full, rank, size, arch)
        count += 1
    return count


@dataclass(frozen=True)
class _GlobalParam:
    """One parameter of the whole model, named by where it lives, not by which rank holds it."""

    stage: int
    local_name: str  # name on the holding stage (layer index local to the stage)
    expert: int | None  # global expert index, for expert weights


def _global_params(arch: Qwen3Arch, per_stage: list[int]) -> list[_GlobalParam]:
    pp = len(per_stage)
    stage_of = [s for s, n in enumerate(per_stage) for _ in range(n)]
    first_layer = [sum(per_stage[:s]) for s in range(pp)]
    out = [_GlobalParam(0, "embedding.word_embeddings.weight", None)]
    for layer in range(arch.num_layers):
        stage = stage_of[layer]
        local = layer - first_layer[stage]
        p = f"decoder.layers.{local}."
        names = [
            "input_layernorm.weight",
            "self_attention.linear_qkv.weight",
            *(["self_attention.linear_qkv.bias"] if arch.attention_bias else []),
            "self_attention.linear_proj.weight",
            "self_attention.q_layernorm.weight",
            "self_attention.k_layernorm.weight",
            "pre_mlp_layernorm.weight",
        ]
        out += [_GlobalParam(stage, p + n, None) for n in names]
        if arch.is_moe and arch.moe_layers[layer]:
            assert arch.num_experts is not None
            out.append(_GlobalParam(stage, p + "mlp.router.weight", None))
            for e in range(arch.num_experts):
                out.append(_GlobalParam(stage, p + "mlp.experts.local_experts.{}.linear_fc1.weight", e))
                out.append(_GlobalParam(stage, p + "mlp.experts.local_experts.{}.linear_fc2.weight", e))
        else:
            out += [
                _GlobalParam(stage, p + n, None) for n in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
            ]
    out.append(_GlobalParam(pp - 1, "decoder.final_layernorm.weight", None))
    if not arch.tie_word_embeddings:
        out.append(_GlobalParam(pp - 1, "output_layer.weight", None))
    return out


def _te_alias(name: str) -> list[str]:
    """Local-spec name first, then the Transformer Engine spec's name for the same parameter."""
    aliases = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    for local, te in aliases.items():
        if name.endswith(local):
            return [name, name[: -len(local)] + te]
    if ".mlp.experts.local_experts." in name:
        head, rest = name.split(".mlp.experts.local_experts.", 1)
        idx, tail = rest.split(".", 1)
        return [name, f"{head}.mlp.experts.{tail.removesuffix('.weight')}.weight{idx}"]
    return [name]


@dataclass(frozen=True)
class ExportStep:
    """One parameter of the whole model in export order, resolved for this rank."""

    plan: ParamPlan
    sender: int  # the global rank that sends the full tensors to rank 0
    param: torch.nn.Parameter | None  # this rank's piece, when it takes part in the gather
    group_size: int
    group: Any
    shapes: tuple[tuple[int, ...], ...]  # full HF shapes, for receiving on rank 0


def plan_export(model: torch.nn.Module, arch: Qwen3Arch) -> list[ExportStep]:
    """Resolve, once, who holds and who sends every parameter (collective: gathers the rank layout).

    Reusing the plan makes repeated exports (weight sync every step) cost only the gathers and copies.
    """
    from megatron.core import parallel_state as ps

    params = dict(_local_params(model))
    pp_rank = ps.get_pipeline_model_parallel_rank()
    per_stage = _stage_layers(model, arch)
    ep_rank = ps.get_expert_model_parallel_rank()
    experts_per_rank = (arch.num_experts or 1) // ps.get_expert_model_parallel_world_size()
    me = dist.get_rank()
    coords = _all_coords()
    shapes = expected_hf_tensors(arch)
    steps = []
    for gp in _global_params(arch, per_stage):
        owner_ep = None if gp.expert is None else gp.expert // experts_per_rank
        local_name = (
            gp.local_name if gp.expert is None else gp.local_name.format(gp.expert % experts_per_rank)
        )
        plan = plan_for(
            local_name,
            arch,
            sum(per_stage[: gp.stage]),
            0 if gp.expert is None else gp.expert - gp.expert % experts_per_rank,
        )
        sender = _sender(coords, gp.stage, owner_ep, plan.group)
        holds = pp_rank == gp.stage and (owner_ep is None or owner_ep == ep_rank)
        param = None
        if holds and _in_sender_replica(coords[me], plan.group, coords[sender]):
            param = params[next(n for n in _te_alias(local_name) if n in params)]
        _, size, group = _group_coords(plan)
        steps.append(ExportStep(plan, sender, param, size, group, tuple(shapes[n] for n in plan.hf_names)))
    return steps


@torch.no_grad()
def export_weights(
    model: torch.nn.Module, arch: Qwen3Arch, steps: list[ExportStep] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model on global rank 0; other ranks yield nothing
    but must iterate too (they take part in the gathers and sends). ``steps`` from :func:`plan_export`
    may be reused across calls on the same model.

    The tensors are on the device of the collectives (:mod:`~mars_megatron.comm.collectives`: the
    GPU under NCCL, the host under gloo); consumers that need host memory copy them there."""
    steps = plan_export(model, arch) if steps is None else steps
    me = dist.get_rank()
    dtype = next(_local_params(model))[1].dtype  # every parameter has the model's dtype
    for step in steps:
        full = _gather(step, me, arch)
        if step.sender != 0:
            if me == step.sender:
                assert full is not None
                for t in full:
                    collectives.send(t, dst=0)
            elif me == 0:
                full = [collectives.recv(shape, dtype, src=step.sender) for shape in step.shapes]
        if me == 0:
            assert full is not None
            yield from zip(step.plan.hf_names, full, strict=True)


@torch.no_grad()
def export_at_senders(
    model: torch.nn.Module, arch: Qwen3Arch, steps: list[ExportStep]
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The export without the trip to rank 0: on every rank, ``(hf_name, tensor)`` for each HF tensor of
    the model in export order, the tensor where this rank is the step's sender and ``None`` elsewhere.
    Senders (one per pipeline stage and expert-parallel rank) then send on their own, nothing goes through
    rank 0 (:mod:`mars_megatron.training.weight_sync`)."""
    me = dist.get_rank()
    for step in steps:
        full = _gather(step, me, arch)
        if me == step.sender:
            assert full is not None
            yield from zip(step.plan.hf_names, full, strict=True)
        else:
            for name in step.plan.hf_names:
                yield name, None


def export_senders(steps: list[ExportStep]) -> list[tuple[str, tuple[int, ...], int]]:
    """``(hf_name, shape, sending global rank)`` of every HF tensor, in export order (the same on all
    ranks)."""
    return [
        (name, shape, step.sender)
        for step in steps
        for name, shape in zip(step.plan.hf_names, step.shapes, strict=True)
    ]


def _gather(step: ExportStep, me: int, arch: Qwen3Arch) -> list[torch.Tensor] | None:
    """The step's full HF tensors on its sender (None elsewhere); every holder of a piece takes part."""
    if step.param is None:
        return None
    pieces = [step.param.detach()]
    if step.group_size > 1:
        pieces = collectives.all_gather(pieces[0], group=step.group)
    return unshard(step.plan, pieces, arch) if me == step.sender else None


def _all_coords() -> list[Any]:
    from mars_megatron.comm.coords import all_rank_coords

    return all_rank_coords()


def _sender(coords: list[Any], stage: int, owner_ep: int | None, group: str) -> int:
    """The lowest global rank that holds the parameter in TP/expert-TP rank 0 of data-parallel replica 0
    (context-parallel rank 0: CP ranks hold the same weights)."""
    for c in coords:
        if c.pp != stage:
            continue
        if owner_ep is not None:
            if c.ep == owner_ep and c.etp == 0 and c.edp == 0:
                return c.rank
        elif c.tp == 0 and c.dp == 0 and c.cp == 0:
            return c.rank
    raise AssertionError(f"no rank holds stage {stage} expert {owner_ep}")


def _in_sender_replica(me: Any, group: str, sender: Any) -> bool:
    """True if this rank belongs to the (expert-)TP group whose rank 0 is the sender."""
    if group == "etp":
        return me.edp == sender.edp and me.ep == sender.ep
    if group == "tp":
        return me.dp == sender.dp and me.cp == sender.cp
    return me.rank == sender.rank
