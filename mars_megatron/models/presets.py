"""Tiny random Qwen3 checkpoints (dense and MoE) written in the Hugging Face hub layout.

Why: the trainer, the HF<->Megatron converter and the rollout engine all consume HF checkpoint
directories.  Tests and CI cannot download real Qwen3 weights, so :func:`init_model` writes a
checkpoint with the same architecture class, tensor names and file layout as a published Qwen3
model (``config.json``, sharded ``model-*.safetensors`` + index, ``generation_config.json``,
tokenizer files), only a few hundred KB in size.  The shapes respect the constraints of the
kernels that will load them (e.g. vLLM's CPU backend needs ``head_dim >= 32``).

The weights are random (seeded) and meaningless; the checkpoint exists to exercise plumbing.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from mars_megatron.dtypes import torch_dtype
from mars_megatron.models.tokenizer import (
    MIN_TINY_VOCAB_SIZE,
    build_tiny_tokenizer,
    tiny_special_token_ids,
)

__all__ = ["PRESETS", "init_model"]

_TINY_VOCAB: Final[int] = 1024
_TINY_IDS: Final[dict[str, int]] = tiny_special_token_ids(_TINY_VOCAB)

# Shared by both presets.  Token ids follow Qwen3's convention: bos = pad = <|endoftext|>,
# eos = <|im_end|>; here they are the tiny tokenizer's ids for that vocabulary size.
_COMMON: Final[dict[str, Any]] = {
    "vocab_size": _TINY_VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention backend rejects head sizes below 32
    "intermediate_size": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "use_cache": True,
    "bos_token_id": _TINY_IDS["<|endoftext|>"],
    "eos_token_id": _TINY_IDS["<|im_end|>"],
    "pad_token_id": _TINY_IDS["<|endoftext|>"],
    "dtype": "float32",
}

# HF config kwargs of each preset (``AutoConfig.for_model(model_type, **kwargs)``).
PRESETS: Final[dict[str, dict[str, Any]]] = {
    "tiny-dense": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_COMMON,
        "max_window_layers": 2,
    },
    "tiny-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_COMMON,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    },
}


def _build_config(preset: str, dtype: str, overrides: dict[str, Any] | None) -> PretrainedConfig:
    """Preset kwargs + overrides -> HF config; token ids follow a ``vocab_size`` override."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(sorted(PRESETS))}")
    torch_dtype(dtype)  # fails early, naming the valid dtypes
    kwargs = copy.deepcopy(PRESETS[preset])
    overrides = dict(overrides or {})
    vocab_size = int(overrides.get("vocab_size", kwargs["vocab_size"]))
    if vocab_size < MIN_TINY_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for the tiny tokenizer "
            f"(minimum {MIN_TINY_VOCAB_SIZE}: 256 byte tokens + special tokens + merges)"
        )
    # The special tokens sit at the end of the tiny vocabulary, so their ids move with its size.
    ids = tiny_special_token_ids(vocab_size)
    kwargs["bos_token_id"] = ids["<|endoftext|>"]
    kwargs["eos_token_id"] = ids["<|im_end|>"]
    kwargs["pad_token_id"] = ids["<|endoftext|>"]
    kwargs.update(overrides)
    kwargs["dtype"] = dtype
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def init_model(
    preset: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    overrides: dict[str, Any] | None = None,
    max_shard_size: str = "300KB",
) -> Path:
    """Write a randomly initialised tiny Qwen3 checkpoint of ``preset`` to ``out_dir``.

    Args:
        preset: a key of :data:`PRESETS` (``"tiny-dense"`` or ``"tiny-moe"``).
        out_dir: directory to create; it must not exist yet (parents are created).
        seed: torch seed for the weights.  The same seed (and arguments) gives byte-identical
            safetensors files; the caller's global RNG state is left untouched.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; weights are stored in it.
        overrides: HF config keys replacing the preset's, e.g. ``{"vocab_size": 1000,
            "tie_word_embeddings": True}``.  The tokenizer is trained to the final
            ``vocab_size`` (300 <= vocab_size <= what the built-in corpus supports, ~1100).
        max_shard_size: passed to ``save_pretrained``; deliberately small by default so that
            even a tiny checkpoint is sharded and consumers of the index are exercised.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    The checkpoint is assembled in a temporary sibling directory and renamed into place at the
    end, so a failure at any step leaves nothing behind at ``out_dir``.

    Raises:
        FileExistsError: ``out_dir`` already exists.
        ValueError: unknown preset, unsupported dtype, or unusable ``vocab_size``.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        raise FileExistsError(f"refusing to overwrite existing path: {out_dir}")
    config = _build_config(preset, dtype, overrides)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        model = model.to(torch_dtype(dtype))
        model.config.dtype = dtype
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            # Qwen3 stops on <|im_end|> and on <|endoftext|>.
            eos_token_id=[config.eos_token_id, config.pad_token_id],
            pad_token_id=config.pad_token_id,
        )
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        build_tiny_tokenizer(config.vocab_size).save_pretrained(tmp)
        # mkdtemp makes the directory 0700; give it the permissions a plain mkdir would.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if out_dir.exists() or out_dir.is_symlink():
            raise FileExistsError(f"refusing to overwrite existing path: {out_dir}")
        os.rename(tmp, out_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    return out_dir
