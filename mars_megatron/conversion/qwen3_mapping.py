"""Which HF Qwen3 tensors make each Megatron parameter, and how they are cut for TP/EP.

Pure functions over names and tensors, no process groups: :func:`plan_for` maps a Megatron parameter
name (local spec or Transformer Engine spec, with this rank's layer and expert offsets) to the HF tensors
it is made of; :func:`shard` cuts the full HF tensors into this rank's piece; :func:`unshard` is its
exact inverse over the gathered pieces. Round trips are bit-exact because every step is a view, a
concatenation or a slice — no arithmetic touches the values.

Megatron layouts that differ from HF:
- ``linear_qkv`` fuses q, k, v per query group: ``[g0: q-heads, k, v | g1: ... ]``; TP splits groups.
- ``linear_fc1`` fuses ``[gate; up]``, and TP splits each half separately: rank r holds
  ``[gate_r; up_r]``.
- the embedding and output layer are padded with zero rows to the padded vocabulary, split by rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from mars_megatron.models.hf_config import Qwen3Arch

Split = Literal["none", "row", "col", "qkv", "gated", "vocab"]
Group = Literal["tp", "etp", "none"]


class MappingError(ValueError):
    """A parameter name that no rule covers (an unsupported module in the model)."""


@dataclass(frozen=True)
class ParamPlan:
    """How one Megatron parameter is made from HF tensors."""

    hf_names: tuple[str, ...]
    split: Split
    group: Group
    layer: int | None = None  # global layer index, None for embedding/final norm/output
    expert: int | None = None  # global expert index for expert weights


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQ_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

# Local-spec and TE-spec names for the same thing: TE fuses the pre-norms into the following linear.
_LAYER_RULES: dict[str, tuple[tuple[str, ...], Split, Group]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "none", "none"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "none", "none"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
        "tp",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
        "tp",
    ),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "col", "tp"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "none", "none"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "none", "none"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "none", "none"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "none", "none"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gated", "tp"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "col", "tp"),
    "mlp.router.weight": (("mlp.gate.weight",), "none", "none"),
}


def plan_for(name: str, arch: Qwen3Arch, layer_offset: int = 0, expert_offset: int = 0) -> ParamPlan:
    """The plan for Megatron parameter ``name`` on a rank whose first layer is ``layer_offset`` and whose
    first local expert is ``expert_offset``."""
    if name == "embedding.word_embeddings.weight":
        return ParamPlan(("model.embed_tokens.weight",), "vocab", "tp")
    if name == "decoder.final_layernorm.weight":
        return ParamPlan(("model.norm.weight",), "none", "none")
    if name == "output_layer.weight":
        src = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return ParamPlan((src,), "vocab", "tp")
    m = _LAYER.match(name)
    if m is None:
        raise MappingError(f"no HF tensor is known for Megatron parameter '{name}'")
    layer = int(m.group(1)) + layer_offset
    rest = m.group(2)
    prefix = f"model.layers.{layer}."
    if rest in _LAYER_RULES:
        hf, split, group = _LAYER_RULES[rest]
        return ParamPlan(tuple(prefix + h for h in hf), split, group, layer=layer)
    em = _SEQ_EXPERT.match(rest)
    if em is not None:
        local, which = int(em.group(1)), em.group(2)
    else:
        em = _GROUPED_EXPERT.match(rest)
        if em is None:
            raise MappingError(f"no HF tensor is known for Megatron parameter '{name}'")
        which, local = em.group(1), int(em.group(2))
    expert = local + expert_offset
    ep = f"{prefix}mlp.experts.{expert}."
    if which == "linear_fc1":
        return ParamPlan((ep + "gate_proj.weight", ep + "up_proj.weight"), "gated", "etp", layer, expert)
    return ParamPlan((ep + "down_proj.weight",), "col", "etp", layer, expert)


def _qkv_groups(arch: Qwen3Arch) -> tuple[int, int, int]:
    groups = arch.num_key_value_heads
    return groups, arch.num_attention_heads // groups * arch.head_dim, arch.head_dim


def shard_into(
    dst: torch.Tensor,
    plan: ParamPlan,
    full: list[torch.Tensor],
    rank: int,
    size: int,
    arch: Qwen3Arch,
) -> torch.Tensor:
    """Copy this rank's piece of the parameter into ``dst`` (a parameter or an empty tensor of its shape),
    from the full HF tensors ``full`` (in ``plan.hf_names`` order); returns ``dst``.

    Pieces are copied straight into slices of ``dst``: no fused temporary is built, so loading a model
    costs one copy of its weights. ``rank``/``size`` are the TP (or expert-TP) coordinates named by
    ``plan.group``. Shapes must agree exactly (the caller checks them first for a clear error).
    """
    if plan.split == "none":
        dst.copy_(full[0])
    elif plan.split == "row":
        dst.copy_(full[0].chunk(size, dim=0)[rank])
    elif plan.split == "col":
        dst.copy_(full[0].chunk(size, dim=1)[rank])
    elif plan.split == "vocab":
        # Rows [rank*n, (rank+1)*n) of the padded vocabulary; rows past the real vocabulary are zeros.
        rows = dst.shape[0]
        start = rank * rows
        real = max(0, min(rows, full[0].shape[0] - start))
        dst[:real].copy_(full[0][start : start + real])
        dst[real:].zero_()
    elif plan.split == "gated":
        gate, up = full
        half = dst.shape[0] // 2
        dst[:half].copy_(gate.chunk(size, dim=0)[rank])
        dst[half:].copy_(up.chunk(size, dim=0)[rank])
    elif plan.split == "qkv":
        q, k, v = full
        groups, q_rows, head_dim = _qkv_groups(arch)
        tail = q.shape[1:]
        local = groups // size
        g0 = rank * local
        fused = dst.view(local, q_rows + 2 * head_dim, *tail)
        fused[:, :q_rows].copy_(q.reshape(groups, q_rows, *tail)[g0 : g0 + local])
        fused[:, q_rows : q_rows + head_dim].copy_(k.reshape(groups, head_dim, *tail)[g0 : g0 + local])
        fused[:, q_rows + head_dim :].copy_(v.reshape(groups, head_dim, *tail)[g0 : g0 + local])
    else:
        raise AssertionError(plan.split)
    return dst


def shard_shape(
    plan: ParamPlan, full_shapes: list[tuple[int, ...]], size: int, arch: Qwen3Arch, padded_vocab: int
) -> tuple[int, ...]:
    """Shape of one rank's piece, from the HF shapes alone (checked before any data is read)."""
    first = full_shapes[0]
    if plan.split == "none":
        return tuple(first)
    if plan.split in ("row", "gated"):
        rows = first[0] // size * (2 if plan.split == "gated" else 1)
        return (rows, *first[1:])
    if plan.split == "col":
        return (first[0], first[1] // size, *first[2:])
    if plan.split == "vocab":
        return (padded_vocab // size, *first[1:])
    if plan.split == "qkv":
        return (sum(s[0] for s in full_shapes) // size, *first[1:])
    raise AssertionError(plan.split)


def shard(
    plan: ParamPlan, full: list[torch.Tensor], rank: int, size: int, arch: Qwen3Arch, padded_vocab: int
) -> torch.Tensor:
    """This rank's piece as a new tensor (see :func:`shard_into`)."""
    shape = shard_shape(plan, [tuple(t.shape) for t in full], size, arch, padded_vocab)
    return shard_into(full[0].new_empty(shape), plan, full, rank, size, arch)


def unshard(plan: ParamPlan, pieces: list[torch.Tensor], arch: Qwen3Arch) -> list[torch.Tensor]:
    """The full HF tensors (in ``plan.hf_names`` order) from every rank's piece, in rank order."""
    if plan.split == "none":
        return [pieces[0]]
    if plan.split == "row":
        return [_cat(pieces, 0)]
    if plan.split == "col":
        return [_cat(pieces, 1)]
    if plan.split == "vocab":
        return [_cat(pieces, 0)[: arch.vocab_size]]
    if plan.split == "gated":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return [_cat([h[0] for h in halves], 0), _cat([h[1] for h in halves], 0)]
    if plan.split == "qkv":
        groups, q_rows, head_dim = _qkv_groups(arch)
        tail = pieces[0].shape[1:]
        fused = _cat(pieces, 0).reshape(groups, q_rows + 2 * head_dim, *tail)
        q, k, v = fused.split([q_rows, head_dim, head_dim], dim=1)
        return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]
    raise AssertionError(plan.split)


def _cat(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` that returns the single piece itself (a view) instead of copying it."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def expected_hf_tensors(arch: Qwen3Arch) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``arch`` holds, with its shape, in a canonical order."""
    h, hd = arch.hidden_size, arch.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (arch.num_attention_heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = (arch.num_key_value_heads * hd, h)
        out[p + "self_attn.v_proj.weight"] = (arch.num_key_value_heads * hd, h)
        if arch.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (arch.num_attention_heads * hd,)
            out[p + "self_attn.k_proj.bias"] = (arch.num_key_value_heads * hd,)
            out[p + "self_attn.v_proj.bias"] = (arch.num_key_value_heads * hd,)
        out[p + "self_attn.o_proj.weight"] = (h, arch.num_attention_heads * hd)
        out[p + "self_attn.q_norm.weight"] = (hd,)
        out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if arch.is_moe and arch.moe_layers[layer]:
            assert arch.num_experts is not None and arch.moe_ffn_hidden_size is not None
            out[p + "mlp.gate.weight"] = (arch.num_experts, h)
            f = arch.moe_ffn_hidden_size
            for e in range(arch.num_experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (f, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (f, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, f)
        else:
            f = arch.ffn_hidden_size
            out[p + "mlp.gate_proj.weight"] = (f, h)
            out[p + "mlp.up_proj.weight"] = (f, h)
            out[p + "mlp.down_proj.weight"] = (h, f)
    out["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = (arch.vocab_size, h)
    return out


def init_tensor(name: str, shape: tuple[int, ...], seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """A freshly initialised HF tensor that depends only on (seed, name): norms are ones, everything else
    N(0, std). Drawing per *HF name* makes every TP/PP/EP layout start from the same model."""
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    import zlib

    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(dtype)
