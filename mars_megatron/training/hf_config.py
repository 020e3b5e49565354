"""Read a Hugging Face Qwen3 / Qwen3-MoE ``config.json`` into the architecture facts the trainer needs.

Pure: a dict (or a file) in, a frozen :class:`Qwen3Arch` out. Everything Megatron needs to build a model
that computes *the same function* as the HF checkpoint is here, and anything that would silently change
that function (rope scaling, sliding windows, unknown architectures) is refused with the file and field
named, instead of being ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
DTYPE_NAMES = ("float32", "bfloat16", "float16")


class HFConfigError(ValueError):
    """A config.json that cannot be mapped onto a Megatron Qwen3 model; the message names file and field."""


@dataclass(frozen=True)
class Qwen3Arch:
    """Architecture of a Qwen3 dense or MoE model, in HF terms (sizes are unpadded)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    initializer_range: float
    dtype: str
    num_experts: int | None = None
    moe_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def padded_vocab_size(self, multiple: int) -> int:
        """Embedding rows in Megatron: a multiple of ``multiple`` that does not depend on TP.

        Megatron pads to ``divisible_by * tp``, which makes the checkpoint's embedding shape depend on the
        layout. Padding to a TP-free multiple keeps one checkpoint loadable in every layout; a layout whose
        TP does not divide it is rejected when the model is built.
        """
        return -(-self.vocab_size // multiple) * multiple


def _get(
    cfg: dict[str, Any], key: str, kind: type | tuple[type, ...], source: str, default: Any = ...
) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise HFConfigError(f"{source}: missing required field '{key}'")
        return default
    value = cfg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise HFConfigError(f"{source}: field '{key}' must be {_kind_name(kinds)}, got {value!r}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise HFConfigError(f"{source}: field '{key}' must be {_kind_name(kinds)}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and key != "decoder_sparse_step":
        raise HFConfigError(f"{source}: field '{key}' must be positive, got {value!r}")
    return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def parse_hf_config(cfg: dict[str, Any], source: str = "config.json") -> Qwen3Arch:
    """Map an HF config dict to :class:`Qwen3Arch`, validating every field the model depends on."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        raise HFConfigError(f"{source}: field 'architectures' must be a one-element list, got {archs!r}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFConfigError(
            f"{source}: unsupported architecture {arch!r} in field 'architectures'; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    rope_scaling = cfg.get("rope_scaling")
    rope_field = "rope_scaling"
    if rope_scaling in (None, {}) and isinstance(cfg.get("rope_parameters"), dict):
        rope_field = "rope_parameters"
        # transformers 5 nests the scaling type beside rope_theta in rope_parameters.
        nested = {k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"}
        rope_scaling = nested or None
    if rope_scaling not in (None, {}) and not (
        isinstance(rope_scaling, dict)
        and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default"
    ):
        raise HFConfigError(
            f"{source}: field '{rope_field}' = {rope_scaling!r} is not supported (plain RoPE only)"
        )
    if cfg.get("use_sliding_window"):
        raise HFConfigError(f"{source}: field 'use_sliding_window' = true is not supported")
    hidden = _get(cfg, "hidden_size", int, source)
    heads = _get(cfg, "num_attention_heads", int, source)
    kv_heads = _get(cfg, "num_key_value_heads", int, source, heads)
    if heads % kv_heads:
        raise HFConfigError(
            f"{source}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})"
        )
    dtype_key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    dtype = cfg.get(dtype_key) or "float32"
    if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
        raise HFConfigError(
            f"{source}: field '{dtype_key}' must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}"
        )
    num_layers = _get(cfg, "num_hidden_layers", int, source)
    rope_theta = _get(cfg, "rope_theta", float, source, None)
    if rope_theta is None:  # transformers 5 may nest it under rope_parameters
        params = cfg.get("rope_parameters") or {}
        rope_theta = _get(params, "rope_theta", float, f"{source} (rope_parameters)")
    common: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=_get(cfg, "vocab_size", int, source),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # transformers' defaults when config.json omits it: Qwen3Config 128, Qwen3-MoE hidden // heads.
        head_dim=_get(cfg, "head_dim", int, source, 128 if arch == "Qwen3ForCausalLM" else hidden // heads),
        ffn_hidden_size=_get(cfg, "intermediate_size", int, source),
        rms_norm_eps=_get(cfg, "rms_norm_eps", float, source),
        rope_theta=rope_theta,
        max_position_embeddings=_get(cfg, "max_position_embeddings", int, source),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", bool, source, False),
        attention_bias=_get(cfg, "attention_bias", bool, source, False),
        initializer_range=_get(cfg, "initializer_range", float, source, 0.02),
        dtype=dtype,
    )
    if arch == "Qwen3ForCausalLM":
        return Qwen3Arch(**common)
    # transformers 5 saves ``num_local_experts``; hub configs of Qwen3-MoE say ``num_experts``.
    experts_key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    if cfg.get(experts_key) is None:
        raise HFConfigError(f"{source}: missing required field 'num_experts' (or 'num_local_experts')")
    experts = _get(cfg, experts_key, int, source)
    topk = _get(cfg, "num_experts_per_tok", int, source)
    if topk > experts:
        raise HFConfigError(f"{source}: field 'num_experts_per_tok' ({topk}) exceeds num_experts ({experts})")
    step = _get(cfg, "decoder_sparse_step", int, source, 1)
    if step < 1:
        raise HFConfigError(f"{source}: field 'decoder_sparse_step' must be >= 1, got {step}")
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in mlp_only
    ):
        raise HFConfigError(f"{source}: field 'mlp_only_layers' must list layer indices < {num_layers}")
    # Same rule as transformers' Qwen3MoeDecoderLayer: sparse unless listed or off the sparse step.
    moe_layers = tuple((i not in mlp_only) and (i + 1) % step == 0 for i in range(num_layers))
    return Qwen3Arch(
        **common,
        num_experts=experts,
        moe_topk=topk,
        moe_ffn_hidden_size=_get(cfg, "moe_intermediate_size", int, source),
        norm_topk_prob=_get(cfg, "norm_topk_prob", bool, source, False),
        moe_layers=moe_layers,
        router_aux_loss_coef=_get(cfg, "router_aux_loss_coef", float, source, 0.0),
    )


def load_hf_config(model_dir: str | Path) -> Qwen3Arch:
    """Read ``model_dir/config.json`` (or a config file path) and parse it."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path}: no such file (expected an HF checkpoint directory with config.json)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path}: expected a JSON object")
    return parse_hf_config(cfg, str(path))
