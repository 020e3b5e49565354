"""hf_config reads config.json as transformers 5 does, or refuses it naming the field.

Each case is one config.json loaded both ways: by :func:`load_hf_config` and by ``AutoConfig`` plus the
model transformers builds from it (head size, kv heads, RoPE frequencies, MoE layers are read off the
modules, not the config). Where the reader accepts, every fact must equal transformers'; where it refuses,
the message names the field. The issue's case: a ``rope_theta`` beside a different
``rope_parameters.rope_theta`` was read as the top-level one while transformers uses the nested one (the
converted model's log-probs then differed from transformers' by 0.26).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from mars_megatron.models.hf_config import HFConfigError, Qwen3Arch, load_hf_config
from tests.test_hf_config import DENSE as BASE_DENSE
from tests.test_hf_config import MOE as BASE_MOE
from tests.test_hf_config import cfg

# test_hf_config's configs, with the model_type transformers' AutoConfig dispatches on
DENSE: dict[str, Any] = {**BASE_DENSE, "model_type": "qwen3"}
MOE: dict[str, Any] = {**BASE_MOE, "model_type": "qwen3_moe"}


def rope(theta: float, **more: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **more}


# Read alike: both load, every fact equal.
SAME: dict[str, dict[str, Any]] = {
    "dense": DENSE,
    "moe": MOE,
    "dense, theta only in rope_parameters": cfg(DENSE, rope_theta=..., rope_parameters=rope(5e6)),
    "dense, theta in both, equal": cfg(DENSE, rope_theta=5e6, rope_parameters=rope(5e6)),
    "dense, old 'type' key": cfg(
        DENSE, rope_theta=..., rope_parameters={"type": "default", "rope_theta": 2e4}
    ),
    "dense, rope_scaling default + top-level theta": cfg(DENSE, rope_scaling={"rope_type": "default"}),
    "dense, rope_scaling holds theta": cfg(DENSE, rope_theta=..., rope_scaling=rope(3e4)),
    "dense, rope_scaling and rope_parameters equal": cfg(
        DENSE, rope_theta=..., rope_scaling=rope(3e4), rope_parameters=rope(3e4)
    ),
    "dense, null rope_parameters": cfg(DENSE, rope_parameters=None),
    "dense, partial_rotary_factor 1": cfg(DENSE, partial_rotary_factor=1.0),
    "dense, kv heads absent (default 32)": cfg(DENSE, num_attention_heads=32, num_key_value_heads=...),
    "dense, kv heads null (= heads)": cfg(DENSE, num_key_value_heads=None),
    "dense, head_dim absent (default 128)": cfg(DENSE, head_dim=...),
    "dense, optional flags absent": cfg(
        DENSE, tie_word_embeddings=..., attention_bias=..., initializer_range=..., hidden_act=...
    ),
    "dense, attention bias": cfg(DENSE, attention_bias=True),
    "dense, dtype beside torch_dtype": cfg(DENSE, dtype="float16", torch_dtype="bfloat16"),
    "dense, no dtype": cfg(DENSE, torch_dtype=...),
    "dense, layer_types all full": cfg(DENSE, layer_types=["full_attention"] * 3),
    "dense, sliding_window size without use_sliding_window": cfg(
        DENSE, use_sliding_window=False, sliding_window=4096
    ),
    "moe, head_dim absent (hidden // heads)": cfg(MOE, head_dim=...),
    "moe, kv heads absent (default 4)": cfg(MOE, num_key_value_heads=...),
    "moe, num_local_experts only": cfg(MOE, num_experts=..., num_local_experts=16),
    "moe, both expert counts equal": cfg(MOE, num_local_experts=8),
    "moe, optional fields absent": cfg(
        MOE, norm_topk_prob=..., router_aux_loss_coef=..., decoder_sparse_step=..., mlp_only_layers=...
    ),
    "moe, null mlp_only_layers": cfg(MOE, mlp_only_layers=None),
    "moe, sparse step 2 and mlp-only layers": cfg(MOE, decoder_sparse_step=2, mlp_only_layers=[1]),
}

# Refused, with the field named (transformers would read one of two disagreeing values, build another
# function than the Megatron model, refuse the file itself, or take some other model's default size).
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    # two spellings that disagree
    "theta top-level vs rope_parameters": (
        cfg(DENSE, rope_theta=1e4, rope_parameters=rope(5e6)),
        "field 'rope_parameters.rope_theta' (5000000.0) and field 'rope_theta' (10000.0) disagree",
    ),
    "theta top-level vs rope_scaling": (
        cfg(DENSE, rope_theta=1e4, rope_scaling=rope(2e4)),
        "field 'rope_scaling.rope_theta' (20000.0) and field 'rope_theta' (10000.0) disagree",
    ),
    "rope_scaling beside a different rope_parameters": (
        cfg(DENSE, rope_theta=..., rope_scaling={"rope_type": "default"}, rope_parameters=rope(5e6)),
        "fields 'rope_scaling'",
    ),
    "num_experts vs num_local_experts": (
        cfg(MOE, num_experts=8, num_local_experts=16),
        "fields 'num_experts' (8) and 'num_local_experts' (16) disagree",
    ),
    "model_type of the other architecture": (cfg(DENSE, model_type="qwen3_moe"), "field 'model_type'"),
    "model_type of another family": (cfg(MOE, model_type="mixtral"), "field 'model_type'"),
    # another function than the Megatron model's
    "partial rotary (top-level)": (cfg(DENSE, partial_rotary_factor=0.5), "field 'partial_rotary_factor'"),
    "partial rotary (nested)": (
        cfg(DENSE, rope_theta=..., rope_parameters=rope(1e6, partial_rotary_factor=0.5)),
        "field 'rope_parameters.partial_rotary_factor'",
    ),
    "yarn": (cfg(DENSE, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "field 'rope_scaling'"),
    "gelu": (cfg(DENSE, hidden_act="gelu"), "field 'hidden_act'"),
    "sliding layer_types": (
        cfg(DENSE, layer_types=["full_attention", "sliding_attention", "full_attention"]),
        "field 'layer_types'",
    ),
    "use_sliding_window": (cfg(DENSE, use_sliding_window=True), "field 'use_sliding_window'"),
    "kv heads default that does not divide": (
        cfg(DENSE, num_key_value_heads=...),
        "field 'num_key_value_heads' (32) (absent: transformers' default for Qwen3ForCausalLM) must divide",
    ),
    # nulls transformers refuses (its strict config) or would pass on as None
    "dense null head_dim": (cfg(DENSE, head_dim=None), "field 'head_dim' is null"),
    "moe null head_dim": (cfg(MOE, head_dim=None), "field 'head_dim' is null"),
    "null tie_word_embeddings": (cfg(DENSE, tie_word_embeddings=None), "field 'tie_word_embeddings' is null"),
    "moe null kv heads": (cfg(MOE, num_key_value_heads=None), "field 'num_key_value_heads' is null"),
    "moe null num_experts": (cfg(MOE, num_experts=None, num_local_experts=4), "field 'num_experts' is null"),
    "null rope_theta": (cfg(DENSE, rope_theta=None), "field 'rope_theta' is null"),
    "null decoder_sparse_step": (cfg(MOE, decoder_sparse_step=None), "field 'decoder_sparse_step' is null"),
    # wrong types, signs, sizes
    "float size": (cfg(DENSE, hidden_size=64.0), "field 'hidden_size' must be int"),
    "bool size": (cfg(DENSE, hidden_size=True), "field 'hidden_size' must be int"),
    "string size": (cfg(DENSE, hidden_size="64"), "field 'hidden_size' must be int"),
    "negative size": (cfg(DENSE, hidden_size=-64), "field 'hidden_size' must be positive"),
    "huge size": (cfg(DENSE, vocab_size=2**40), "field 'vocab_size' must be at most 2147483647"),
    "string theta": (cfg(DENSE, rope_theta="1e6"), "field 'rope_theta' must be float"),
    "negative theta": (cfg(DENSE, rope_theta=-1e6), "field 'rope_theta' must be >= 0"),
    "zero theta": (cfg(DENSE, rope_theta=0), "field 'rope_theta' must be positive"),
    "zero eps": (cfg(DENSE, rms_norm_eps=0.0), "field 'rms_norm_eps' must be positive"),
    "negative aux coefficient": (
        cfg(MOE, router_aux_loss_coef=-0.1),
        "field 'router_aux_loss_coef' must be >= 0",
    ),
    # absent where transformers would take another model's size
    "no rope_theta anywhere": (cfg(DENSE, rope_theta=...), "missing required field 'rope_theta'"),
    "no hidden_size": (cfg(DENSE, hidden_size=...), "missing required field 'hidden_size'"),
    "no expert count": (cfg(MOE, num_experts=...), "missing required field 'num_experts'"),
}

# Non-finite numbers cannot be written as JSON, but Python's json reads NaN and Infinity.
NON_FINITE: dict[str, tuple[str, str]] = {
    "nan eps": ('"rms_norm_eps": NaN', "field 'rms_norm_eps' must be finite, got nan"),
    "inf theta": ('"rope_theta": Infinity', "field 'rope_theta' must be finite, got inf"),
    "-inf init range": (
        '"initializer_range": -Infinity',
        "field 'initializer_range' must be finite, got -inf",
    ),
    "nan nested theta": (
        '"rope_theta": 5e6, "rope_parameters": {"rope_type": "default", "rope_theta": NaN}',
        "field 'rope_theta' must be finite, got nan",
    ),
}


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def transformers_facts(model_dir: Path) -> dict[str, Any]:
    """Every Qwen3Arch fact as transformers has it: from AutoConfig, and from the modules of the model it
    builds where the model decides (head size, kv heads, RoPE frequencies, which layers are MoE)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    c = AutoConfig.from_pretrained(model_dir)
    dtype = (
        str(c.dtype).removeprefix("torch.") if c.dtype is not None else "float32"
    )  # before from_config sets it
    model = AutoModelForCausalLM.from_config(c, dtype=torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    facts: dict[str, Any] = {
        "architecture": c.architectures[0],
        "vocab_size": model.model.embed_tokens.num_embeddings,
        "hidden_size": c.hidden_size,
        "num_layers": len(model.model.layers),
        "num_attention_heads": attn.q_proj.out_features // attn.head_dim,
        "num_key_value_heads": attn.k_proj.out_features // attn.head_dim,
        "head_dim": attn.head_dim,
        "ffn_hidden_size": c.intermediate_size,
        "rms_norm_eps": model.model.norm.variance_epsilon,
        "inv_freq": model.model.rotary_emb.inv_freq,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
        "attention_bias": attn.q_proj.bias is not None,
        "initializer_range": c.initializer_range,
        "dtype": dtype,
        "act": type(getattr(mlp, "act_fn", None) or mlp.experts.act_fn),
    }
    if c.model_type == "qwen3_moe":
        moe = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
        block = next(layer.mlp for layer, sparse in zip(model.model.layers, moe, strict=True) if sparse)
        facts |= {
            "num_experts": block.experts.num_experts,
            "moe_topk": block.gate.top_k,
            "moe_ffn_hidden_size": c.moe_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob,
            "moe_layers": tuple(moe),
            "router_aux_loss_coef": c.router_aux_loss_coef,
        }
    return facts


def reader_facts(arch: Qwen3Arch) -> dict[str, Any]:
    d = arch.head_dim
    facts = {
        "architecture": arch.architecture,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "num_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": d,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "inv_freq": 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)),
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias,
        "initializer_range": arch.initializer_range,
        "dtype": arch.dtype,
    }
    if arch.is_moe:
        facts |= {
            "num_experts": arch.num_experts,
            "moe_topk": arch.moe_topk,
            "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
            "norm_topk_prob": arch.norm_topk_prob,
            "moe_layers": arch.moe_layers,
            "router_aux_loss_coef": arch.router_aux_loss_coef,
        }
    return facts


@pytest.mark.parametrize("name", list(SAME))
def test_reader_agrees_with_transformers(tmp_path: Path, name: str) -> None:
    model_dir = write(tmp_path, SAME[name])
    ours, theirs = reader_facts(load_hf_config(model_dir)), transformers_facts(model_dir)
    act = theirs.pop("act")
    assert act.__name__ == "SiLUActivation"  # the Megatron model's SwiGLU
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key == "inv_freq":
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=f"{name}: {key}")
        else:
            assert ours[key] == theirs[key], (name, key, ours[key], theirs[key])


@pytest.mark.parametrize("name", list(REFUSED))
def test_reader_refuses_naming_the_field(tmp_path: Path, name: str) -> None:
    config, message = REFUSED[name]
    model_dir = write(tmp_path, config)
    with pytest.raises(HFConfigError) as err:
        load_hf_config(model_dir)
    assert str(err.value).startswith(f"{model_dir / 'config.json'}: ") and message in str(err.value), str(
        err.value
    )


@pytest.mark.parametrize("name", list(NON_FINITE))
def test_non_finite_numbers_are_refused(tmp_path: Path, name: str) -> None:
    fragment, message = NON_FINITE[name]
    base = {k: v for k, v in DENSE.items() if k not in ("rms_norm_eps", "rope_theta", "initializer_range")}
    base |= {"rms_norm_eps": 1e-6, "initializer_range": 0.02}
    text = json.dumps(base)[:-1] + ", " + fragment + "}"
    if '"rope_theta"' not in fragment:
        text = text[:-1] + ', "rope_theta": 1e6}'
    for key in ("rms_norm_eps", "initializer_range"):  # the fragment's key wins: drop the base's
        if f'"{key}"' in fragment:
            text = text.replace(f'"{key}": {base[key]}, ', "", 1)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(HFConfigError) as err:
        load_hf_config(tmp_path)
    assert message in str(err.value), str(err.value)


def test_the_issue_case_differs_in_transformers(tmp_path: Path) -> None:
    """What the refusal guards: transformers reads the nested value, so reading the top-level one builds
    another RoPE (a refusal, not a guess, because an older file writer may have meant either)."""
    from transformers import AutoConfig

    model_dir = write(tmp_path, cfg(DENSE, rope_theta=1e4, rope_parameters=rope(5e6)))
    assert AutoConfig.from_pretrained(model_dir).rope_parameters["rope_theta"] == 5e6
    with pytest.raises(HFConfigError, match="disagree"):
        load_hf_config(model_dir)


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_shipped_production_configs_read_as_transformers_config(name: str) -> None:
    """The shipped Qwen3 configs (too big to build here): the config-level facts agree."""
    from transformers import AutoConfig

    path = Path(__file__).resolve().parents[1] / "examples" / "hf_configs" / f"{name}.json"
    arch, c = load_hf_config(path), AutoConfig.from_pretrained(path)
    assert arch.rope_theta == c.rope_parameters["rope_theta"]
    assert arch.num_key_value_heads == c.num_key_value_heads
    assert arch.head_dim == getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    assert arch.tie_word_embeddings == c.tie_word_embeddings
    if arch.is_moe:
        assert (arch.num_experts, arch.moe_topk) == (c.num_experts, c.num_experts_per_tok)
        assert arch.norm_topk_prob == c.norm_topk_prob
