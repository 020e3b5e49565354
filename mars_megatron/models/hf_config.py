"""Read a Hugging Face Qwen3 / Qwen3-MoE ``config.json`` into the architecture facts the trainer needs.

Pure: a dict (or a file) in, a frozen :class:`Qwen3Arch` out. Everything Megatron needs to build a model
that computes *the same function* as the HF checkpoint is here, and anything that would silently change
that function (rope scaling, sliding windows, unknown architectures) is refused with the file and field
named, instead of being ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars_megatron.config import DTYPE_NAMES
from mars_megatron.json_file import read_json

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}


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


_REQUIRED: Any = object()
"""``_get``'s default for a field the file must give (transformers' default is some other model's size)."""
_INT_MAX = 2**31 - 1
"""Largest size a field may give: model dimensions beyond int32 are no model, and they overflow kernels."""
MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
"""The ``model_type`` transformers' AutoConfig builds each architecture's config (and model) from."""
DEFAULT_KV_HEADS = {"Qwen3ForCausalLM": 32, "Qwen3MoeForCausalLM": 4}
"""transformers 5's Qwen3Config / Qwen3MoeConfig default of num_key_value_heads, when the field is absent."""


def _get(
    cfg: dict[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    source: str,
    default: Any = _REQUIRED,
    *,
    null: Any = _REQUIRED,
    minimum: float | None = None,
) -> Any:
    """``cfg[key]`` checked as transformers 5 reads it: absent = ``default`` (its class default), JSON null
    = ``null`` where transformers maps null to a value, refused otherwise (its strict config refuses a null
    where the field is typed int/float/bool). Ints must be positive and at most 2**31 - 1, floats finite and
    at least ``minimum``."""
    if key not in cfg or (cfg[key] is None and default is _REQUIRED):
        if default is _REQUIRED:
            raise HFConfigError(f"{source}: missing required field '{key}'")
        return default
    value = cfg[key]
    if value is None:
        if null is _REQUIRED:
            raise HFConfigError(
                f"{source}: field '{key}' is null; transformers refuses a null here (give a value or leave "
                "the field out for its default)"
            )
        return null
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise HFConfigError(f"{source}: field '{key}' must be {_kind_name(kinds)}, got {value!r}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise HFConfigError(f"{source}: field '{key}' must be {_kind_name(kinds)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise HFConfigError(f"{source}: field '{key}' must be finite, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0 and key != "decoder_sparse_step":
            raise HFConfigError(f"{source}: field '{key}' must be positive, got {value!r}")
        if value > _INT_MAX:
            raise HFConfigError(f"{source}: field '{key}' must be at most {_INT_MAX}, got {value!r}")
    if minimum is not None and isinstance(value, float) and value < minimum:
        raise HFConfigError(f"{source}: field '{key}' must be >= {minimum}, got {value!r}")
    return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _rope_theta(cfg: dict[str, Any], source: str) -> float:
    """RoPE base as transformers 5 resolves it (``PreTrainedConfig.convert_rope_params_to_dict``): the rope
    dict is ``rope_scaling`` when set, else ``rope_parameters``; its ``rope_theta`` wins over a top-level
    ``rope_theta``. Two values that disagree are refused naming both fields (read with the other one, the
    model's log-probs differed from transformers' by 0.26), as is anything but plain RoPE over the whole
    head (a scaling type, ``partial_rotary_factor`` != 1, per-layer-type parameters)."""
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for name, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise HFConfigError(f"{source}: field '{name}' = {value!r} is not supported (plain RoPE only)")
    if scaling and params and scaling != params:
        raise HFConfigError(
            f"{source}: fields 'rope_scaling' ({scaling!r}) and 'rope_parameters' ({params!r}) differ; "
            "transformers reads rope_scaling and drops rope_parameters: keep one"
        )
    field, rope = ("rope_scaling", scaling) if scaling else ("rope_parameters", params or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))  # transformers' standardisation
    if rope_type != "default" or any(isinstance(v, dict) for v in rope.values()):  # dicts: per layer type
        raise HFConfigError(f"{source}: field '{field}' = {rope!r} is not supported (plain RoPE only)")
    for where, holder in ((f"{field}.partial_rotary_factor", rope), ("partial_rotary_factor", cfg)):
        factor = holder.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            raise HFConfigError(
                f"{source}: field '{where}' = {factor!r} is not supported (rotary embedding over the "
                "whole head only)"
            )
    nested = _get(rope, "rope_theta", float, f"{source} ({field})", None, minimum=0)
    top = _get(cfg, "rope_theta", float, source, None, minimum=0)
    if nested is not None and top is not None and nested != top:
        raise HFConfigError(
            f"{source}: field '{field}.rope_theta' ({nested}) and field 'rope_theta' ({top}) disagree; "
            f"transformers reads {field}.rope_theta: make them equal or drop one"
        )
    theta = nested if nested is not None else top
    if theta is None:
        raise HFConfigError(f"{source}: missing required field 'rope_theta' (or '{field}.rope_theta')")
    if theta <= 0:
        raise HFConfigError(f"{source}: field 'rope_theta' must be positive, got {theta}")
    return theta


def _check_attention_layout(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> None:
    """Refuse what would make transformers' attention or MLP differ from the Megatron model's: a model
    type other than the architecture's (AutoConfig builds the model ``model_type`` names), an activation
    other than SiLU, and sliding-window attention (``use_sliding_window`` or sliding ``layer_types``)."""
    model_type = cfg.get("model_type")
    if model_type is not None and model_type != MODEL_TYPES[arch]:
        raise HFConfigError(
            f"{source}: field 'model_type' = {model_type!r} does not match architectures [{arch!r}] "
            f"(expected {MODEL_TYPES[arch]!r}; transformers builds the model model_type names)"
        )
    act = _get(cfg, "hidden_act", str, source, "silu")
    if act != "silu":
        raise HFConfigError(
            f"{source}: field 'hidden_act' = {act!r} is not supported (SwiGLU with silu only)"
        )
    if _get(cfg, "use_sliding_window", bool, source, False):
        raise HFConfigError(f"{source}: field 'use_sliding_window' = true is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and layer_types != ["full_attention"] * num_layers:
        raise HFConfigError(
            f"{source}: field 'layer_types' must list 'full_attention' for each of the {num_layers} layers "
            f"(sliding attention is not supported), got {layer_types!r}"
        )


def parse_hf_config(cfg: dict[str, Any], source: str = "config.json") -> Qwen3Arch:
    """Map an HF config dict to :class:`Qwen3Arch`, validating every field the model depends on.

    Every field is read as transformers 5 reads it (its precedence between spellings, its defaults for
    absent fields), or refused with the field named where the file is ambiguous (two spellings that
    disagree) or transformers would build a different function than the Megatron model (tests compare
    each fact with ``AutoConfig``)."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        raise HFConfigError(f"{source}: field 'architectures' must be a one-element list, got {archs!r}")
    arch = archs[0]
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise HFConfigError(
            f"{source}: unsupported architecture {arch!r} in field 'architectures'; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    rope_theta = _rope_theta(cfg, source)
    num_layers = _get(cfg, "num_hidden_layers", int, source)
    _check_attention_layout(cfg, arch, num_layers, source)
    hidden = _get(cfg, "hidden_size", int, source)
    heads = _get(cfg, "num_attention_heads", int, source)
    # Qwen3Config maps a null to num_attention_heads; Qwen3MoeConfig refuses it. Absent: the class default.
    kv_heads = _get(
        cfg,
        "num_key_value_heads",
        int,
        source,
        DEFAULT_KV_HEADS[arch],
        null=heads if arch == "Qwen3ForCausalLM" else _REQUIRED,
    )
    if heads % kv_heads:
        given = "" if "num_key_value_heads" in cfg else f" (absent: transformers' default for {arch})"
        raise HFConfigError(
            f"{source}: field 'num_key_value_heads' ({kv_heads}){given} must divide num_attention_heads "
            f"({heads})"
        )
    dtype_key = "dtype" if cfg.get("dtype") is not None else "torch_dtype"  # transformers keeps dtype
    dtype = cfg.get(dtype_key) or "float32"
    if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
        raise HFConfigError(
            f"{source}: field '{dtype_key}' must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}"
        )
    common: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=_get(cfg, "vocab_size", int, source),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # transformers' defaults when config.json omits it: Qwen3Config 128, Qwen3-MoE attention
        # hidden // heads (not a config field there: a null would reach the attention as None).
        head_dim=_get(cfg, "head_dim", int, source, 128 if arch == "Qwen3ForCausalLM" else hidden // heads),
        ffn_hidden_size=_get(cfg, "intermediate_size", int, source),
        rms_norm_eps=_get(cfg, "rms_norm_eps", float, source, minimum=0),
        rope_theta=rope_theta,
        max_position_embeddings=_get(cfg, "max_position_embeddings", int, source),
        tie_word_embeddings=_get(cfg, "tie_word_embeddings", bool, source, False),
        attention_bias=_get(cfg, "attention_bias", bool, source, False),
        initializer_range=_get(cfg, "initializer_range", float, source, 0.02, minimum=0),
        dtype=dtype,
    )
    if common["rms_norm_eps"] <= 0:
        raise HFConfigError(f"{source}: field 'rms_norm_eps' must be positive, got {common['rms_norm_eps']}")
    if arch == "Qwen3ForCausalLM":
        return Qwen3Arch(**common)
    experts = _experts(cfg, source)
    topk = _get(cfg, "num_experts_per_tok", int, source)
    if topk > experts:
        raise HFConfigError(f"{source}: field 'num_experts_per_tok' ({topk}) exceeds num_experts ({experts})")
    step = _get(cfg, "decoder_sparse_step", int, source, 1)
    if step < 1:
        raise HFConfigError(f"{source}: field 'decoder_sparse_step' must be >= 1, got {step}")
    mlp_only = cfg.get("mlp_only_layers") or []  # Qwen3MoeConfig maps null to []
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
        router_aux_loss_coef=_get(cfg, "router_aux_loss_coef", float, source, 0.001, minimum=0),
    )


def _experts(cfg: dict[str, Any], source: str) -> int:
    """Experts per MoE layer. Hub configs of Qwen3-MoE say ``num_experts``, transformers 5 saves
    ``num_local_experts`` (its attribute_map aliases the two, and a file's num_local_experts is set last, so
    it wins); both with different values are refused."""
    given = {
        key: _get(cfg, key, int, source, None) for key in ("num_experts", "num_local_experts") if key in cfg
    }
    if not given:
        raise HFConfigError(f"{source}: missing required field 'num_experts' (or 'num_local_experts')")
    if len(set(given.values())) > 1:
        raise HFConfigError(
            f"{source}: fields 'num_experts' ({given['num_experts']}) and 'num_local_experts' "
            f"({given['num_local_experts']}) disagree; transformers reads num_local_experts: keep one"
        )
    return next(iter(given.values()))


def load_hf_config(model_dir: str | Path) -> Qwen3Arch:
    """Read ``model_dir/config.json`` (or a config file path) and parse it."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path}: no such file (expected an HF checkpoint directory with config.json)")
    cfg = read_json(path, HFConfigError)  # not UTF-8, bad JSON, nested too deeply: named, not raised raw
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{path}: expected a JSON object")
    return parse_hf_config(cfg, str(path))
