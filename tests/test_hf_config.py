"""mars_megatron.models.hf_config: HF Qwen3 / Qwen3-MoE config.json -> Qwen3Arch, and its refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from mars_megatron.models.hf_config import HFConfigError, Qwen3Arch, load_hf_config, parse_hf_config

HF_CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "hf_configs"

DENSE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "max_position_embeddings": 512,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "initializer_range": 0.01,
    "torch_dtype": "bfloat16",
}
MOE: dict[str, Any] = {
    **DENSE,
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 6,
    "tie_word_embeddings": False,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}


def cfg(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of ``base`` with ``changes``; a value of ``...`` deletes the key."""
    out = copy.deepcopy(base)
    for k, v in changes.items():
        if v is ...:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def error(c: dict[str, Any], source: str = "ckpt/config.json") -> str:
    with pytest.raises(HFConfigError) as e:
        parse_hf_config(c, source)
    msg = str(e.value)
    assert msg.startswith(source), msg  # every message names the file first
    return msg


# ------------------------------------------------------------------------------------------ parsing
def test_dense_config_maps_every_field() -> None:
    arch = parse_hf_config(DENSE)
    assert arch == Qwen3Arch(
        architecture="Qwen3ForCausalLM",
        vocab_size=1000,
        hidden_size=64,
        num_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        ffn_hidden_size=96,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_bias=False,
        initializer_range=0.01,
        dtype="bfloat16",
    )
    assert not arch.is_moe
    assert arch.moe_layers == ()
    assert isinstance(arch.rope_theta, float)  # JSON int accepted for a float field


def test_moe_config_maps_every_field() -> None:
    arch = parse_hf_config(MOE)
    assert arch.is_moe
    assert arch.architecture == "Qwen3MoeForCausalLM"
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == (8, 2, 24)
    assert arch.norm_topk_prob is True
    assert arch.router_aux_loss_coef == 0.001
    assert arch.moe_layers == (True,) * 6
    assert arch.ffn_hidden_size == 96 and arch.num_layers == 6


def test_optional_fields_take_hf_defaults() -> None:
    dense = parse_hf_config(
        cfg(
            DENSE,
            num_attention_heads=32,
            num_key_value_heads=...,
            tie_word_embeddings=...,
            attention_bias=...,
            initializer_range=...,
            torch_dtype=...,
        )
    )
    assert dense.num_key_value_heads == 32  # Qwen3Config's default, not num_attention_heads
    assert parse_hf_config(cfg(DENSE, num_key_value_heads=None)).num_key_value_heads == 8  # null: = heads
    assert (dense.tie_word_embeddings, dense.attention_bias) == (False, False)
    assert dense.initializer_range == 0.02
    assert dense.dtype == "float32"
    moe = parse_hf_config(
        cfg(MOE, norm_topk_prob=..., router_aux_loss_coef=..., decoder_sparse_step=..., mlp_only_layers=...)
    )
    assert moe.norm_topk_prob is False  # Qwen3MoeConfig's default
    assert moe.router_aux_loss_coef == 0.001  # Qwen3MoeConfig's default
    assert parse_hf_config(cfg(MOE, num_key_value_heads=...)).num_key_value_heads == 4  # Qwen3MoeConfig's
    assert moe.moe_layers == (True,) * 6


def test_moe_head_dim_defaults_to_hidden_over_heads() -> None:
    # Qwen3-MoE attention uses getattr(config, "head_dim", hidden_size // num_attention_heads).
    assert parse_hf_config(cfg(MOE, head_dim=...)).head_dim == 64 // 8
    assert "field 'head_dim' is null" in error(cfg(MOE, head_dim=None))  # the attention would take None
    assert parse_hf_config(cfg(MOE, head_dim=32)).head_dim == 32  # explicit head_dim wins


def test_dense_head_dim_default_matches_transformers() -> None:
    from transformers import Qwen3Config

    c = cfg(DENSE, head_dim=...)
    assert parse_hf_config(c).head_dim == Qwen3Config.from_dict(c).head_dim == 128  # not 64 // 8


def test_num_local_experts_is_the_transformers5_spelling_of_num_experts() -> None:
    new = parse_hf_config(cfg(MOE, num_experts=..., num_local_experts=16))
    assert new.num_experts == 16
    # both, equal: fine; different: refused (transformers reads num_local_experts); a null: refused
    assert parse_hf_config(cfg(MOE, num_experts=8, num_local_experts=8)).num_experts == 8
    msg = error(cfg(MOE, num_experts=8, num_local_experts=16))
    assert "fields 'num_experts' (8) and 'num_local_experts' (16) disagree" in msg
    assert "field 'num_experts' is null" in error(cfg(MOE, num_experts=None, num_local_experts=4))
    msg = error(cfg(MOE, num_experts=...))
    assert "'num_experts'" in msg and "'num_local_experts'" in msg


def test_rope_theta_nested_under_rope_parameters() -> None:
    nested = cfg(DENSE, rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 5000000})
    assert parse_hf_config(nested).rope_theta == 5e6
    # both, disagreeing: refused naming both (transformers reads rope_parameters; 0.26 log-prob gap)
    both = cfg(DENSE, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    msg = error(both)
    assert "field 'rope_parameters.rope_theta' (5000000.0) and field 'rope_theta' (10000.0) disagree" in msg
    same = cfg(DENSE, rope_theta=5e6, rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    assert parse_hf_config(same).rope_theta == 5e6
    msg = error(cfg(DENSE, rope_theta=...))
    assert "rope_parameters" in msg and "'rope_theta'" in msg and "missing" in msg


def test_dtype_key_wins_over_torch_dtype() -> None:
    assert parse_hf_config(cfg(DENSE, dtype="float16", torch_dtype="bfloat16")).dtype == "float16"
    assert parse_hf_config(cfg(DENSE, torch_dtype=..., dtype="float32")).dtype == "float32"
    assert parse_hf_config(cfg(DENSE, torch_dtype="bfloat16")).dtype == "bfloat16"
    msg = error(cfg(DENSE, torch_dtype="int8"))
    assert "'int8'" in msg and "dtype" in msg


def test_unhashable_dtype_is_a_config_error() -> None:
    assert "dtype" in error(cfg(DENSE, torch_dtype=["bfloat16"]))


@pytest.mark.parametrize(
    ("layers", "step", "mlp_only", "expected"),
    [
        # sparse iff layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
        (6, 1, [], "SSSSSS"),
        (6, 2, [], "DSDSDS"),
        (6, 3, [], "DDSDDS"),
        (6, 1, [0, 4], "DSSSDS"),
        (6, 2, [1], "DDDSDS"),
        (4, 4, [3], "DDDD"),
        (5, 7, [], "DDDDD"),
    ],
)
def test_moe_layers_from_sparse_step_and_mlp_only_layers(
    layers: int, step: int, mlp_only: list[int], expected: str
) -> None:
    arch = parse_hf_config(
        cfg(MOE, num_hidden_layers=layers, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    )
    assert arch.moe_layers == tuple(c == "S" for c in expected)


def test_padded_vocab_size() -> None:
    arch = parse_hf_config(DENSE)  # vocab 1000
    assert arch.padded_vocab_size(128) == 1024
    assert arch.padded_vocab_size(1) == 1000
    assert arch.padded_vocab_size(8) == 1000
    assert arch.padded_vocab_size(3) == 1002
    assert arch.padded_vocab_size(1000) == 1000
    assert arch.padded_vocab_size(1001) == 1001
    assert parse_hf_config(cfg(DENSE, vocab_size=151936)).padded_vocab_size(128) == 151936  # 1187 * 128
    assert parse_hf_config(cfg(DENSE, vocab_size=129)).padded_vocab_size(128) == 256


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "field",
    [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "intermediate_size",
        "rms_norm_eps",
        "max_position_embeddings",
    ],
)
def test_missing_required_field_is_named(field: str) -> None:
    msg = error(cfg(DENSE, **{field: ...}))
    assert f"missing required field '{field}'" in msg
    assert error(cfg(DENSE, **{field: None})) == msg  # null counts as missing


@pytest.mark.parametrize("field", ["num_experts_per_tok", "moe_intermediate_size"])
def test_missing_moe_field_is_named(field: str) -> None:
    assert f"missing required field '{field}'" in error(cfg(MOE, **{field: ...}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", True),
        ("hidden_size", "64"),
        ("hidden_size", 64.0),
        ("num_hidden_layers", False),
        ("vocab_size", "1000"),
        ("num_experts", True),
        ("num_experts_per_tok", "2"),
        ("rms_norm_eps", "1e-6"),
        ("rms_norm_eps", True),
        ("tie_word_embeddings", "false"),
        ("tie_word_embeddings", 0),
        ("attention_bias", 1),
    ],
)
def test_wrong_type_is_named(field: str, value: Any) -> None:
    msg = error(cfg(MOE, **{field: value}))
    assert f"field '{field}' must be" in msg and repr(value) in msg


@pytest.mark.parametrize(
    "field",
    [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
    ],
)
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_size_is_named(field: str, value: int) -> None:
    msg = error(cfg(MOE, **{field: value}))
    assert f"field '{field}' must be positive, got {value}" in msg


@pytest.mark.parametrize(
    ("architectures", "needle"),
    [
        (["LlamaForCausalLM"], "unsupported architecture 'LlamaForCausalLM'"),
        (["Qwen2ForCausalLM"], "unsupported architecture 'Qwen2ForCausalLM'"),
        ([], "one-element list"),
        (["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"], "one-element list"),
        ("Qwen3ForCausalLM", "one-element list"),
        (None, "one-element list"),
    ],
)
def test_unsupported_architecture(architectures: Any, needle: str) -> None:
    msg = error(cfg(DENSE, architectures=architectures))
    assert "'architectures'" in msg and needle in msg


def test_missing_architectures() -> None:
    assert "'architectures'" in error(cfg(DENSE, architectures=...))


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"type": "yarn", "factor": 4.0},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        "yarn",
    ],
)
def test_rope_scaling_is_refused(scaling: Any) -> None:
    msg = error(cfg(DENSE, rope_scaling=scaling))
    assert "'rope_scaling'" in msg and "not supported" in msg


@pytest.mark.parametrize("scaling", [None, {}, {"rope_type": "default"}, {"type": "default"}])
def test_plain_rope_scaling_is_accepted(scaling: Any) -> None:
    assert parse_hf_config(cfg(DENSE, rope_scaling=scaling)).rope_theta == 1e6


def test_rope_scaling_nested_in_rope_parameters_is_refused() -> None:
    c = cfg(
        DENSE,
        rope_theta=...,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "rope_theta": 1e6,
        },
    )
    msg = error(c)
    assert "'yarn'" in msg and "not supported" in msg
    # transformers 5's plain form (rope_type default beside rope_theta) stays accepted
    plain = cfg(DENSE, rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert parse_hf_config(plain).rope_theta == 1e6


def test_sliding_window_is_refused() -> None:
    msg = error(cfg(DENSE, use_sliding_window=True, sliding_window=4096))
    assert "'use_sliding_window'" in msg and "not supported" in msg
    # a sliding_window size alone is inert in Qwen3 (use_sliding_window gates it)
    assert parse_hf_config(cfg(DENSE, use_sliding_window=False, sliding_window=4096)).num_layers == 3


@pytest.mark.parametrize(("heads", "kv"), [(8, 3), (8, 16), (6, 4)])
def test_kv_heads_must_divide_heads(heads: int, kv: int) -> None:
    msg = error(cfg(DENSE, num_attention_heads=heads, num_key_value_heads=kv))
    assert f"'num_key_value_heads' ({kv}) must divide num_attention_heads ({heads})" in msg


def test_topk_cannot_exceed_experts() -> None:
    msg = error(cfg(MOE, num_experts=4, num_experts_per_tok=5))
    assert "'num_experts_per_tok' (5) exceeds num_experts (4)" in msg
    assert parse_hf_config(cfg(MOE, num_experts=4, num_experts_per_tok=4)).moe_topk == 4


@pytest.mark.parametrize("bad", [[6], [-1], [0, 9], ["1"], [1.0], "0,1", {"0": 1}])
def test_bad_mlp_only_layers(bad: Any) -> None:
    msg = error(cfg(MOE, mlp_only_layers=bad))  # MOE has 6 layers
    assert "'mlp_only_layers'" in msg and "< 6" in msg


# ------------------------------------------------------------------------------------------- files
def test_load_from_directory_and_from_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MOE))
    assert load_hf_config(tmp_path) == parse_hf_config(MOE)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(DENSE))
    assert load_hf_config(str(other)) == parse_hf_config(DENSE)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(HFConfigError, match="no such file") as e:
        load_hf_config(tmp_path)  # a directory without config.json
    assert str(tmp_path / "config.json") in str(e.value)
    with pytest.raises(HFConfigError, match="no such file") as e:
        load_hf_config(tmp_path / "missing.json")
    assert str(tmp_path / "missing.json") in str(e.value)

    bad = tmp_path / "config.json"
    bad.write_text('{"architectures": ["Qwen3ForCausalLM"],')
    with pytest.raises(HFConfigError, match=r"unreadable or corrupt \(invalid JSON \(Expecting") as e:
        load_hf_config(tmp_path)
    assert str(bad) in str(e.value)

    bad.write_text("[1, 2]")
    with pytest.raises(HFConfigError, match="expected a JSON object") as e:
        load_hf_config(tmp_path)
    assert str(bad) in str(e.value)

    # parse errors from a file name that file, too
    bad.write_text(json.dumps(cfg(DENSE, hidden_size="64")))
    with pytest.raises(HFConfigError) as e:
        load_hf_config(tmp_path)
    assert str(e.value).startswith(f"{bad}: field 'hidden_size' must be int")


def test_qwen3_30b_a3b() -> None:
    arch = load_hf_config(HF_CONFIGS / "qwen3-30b-a3b.json")
    assert arch.architecture == "Qwen3MoeForCausalLM" and arch.is_moe
    assert arch.num_layers == 48
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == (128, 8, 768)
    assert arch.hidden_size == 2048
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (32, 4, 128)
    assert arch.moe_layers == (True,) * 48
    assert arch.norm_topk_prob is True and arch.router_aux_loss_coef == 0.001
    assert arch.rope_theta == 1e7 and arch.dtype == "bfloat16" and arch.tie_word_embeddings is False
    assert arch.vocab_size == 151936 and arch.padded_vocab_size(128) == 151936


def test_qwen3_235b_a22b() -> None:
    arch = load_hf_config(HF_CONFIGS / "qwen3-235b-a22b.json")
    assert arch.is_moe and arch.num_layers == 94 and arch.moe_layers == (True,) * 94
    assert arch.hidden_size == 4096
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (64, 4, 128)
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size) == (128, 8, 1536)
    assert arch.rope_theta == 5e6


def test_qwen3_8b_dense() -> None:
    arch = load_hf_config(HF_CONFIGS / "qwen3-8b.json")
    assert arch.architecture == "Qwen3ForCausalLM" and not arch.is_moe
    assert arch.num_experts is None and arch.moe_layers == ()
    assert (arch.num_layers, arch.hidden_size, arch.ffn_hidden_size) == (36, 4096, 12288)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (32, 8, 128)
    assert arch.rope_theta == 1e6 and arch.max_position_embeddings == 40960


def test_dtype_error_names_the_key_the_file_uses() -> None:
    assert "field 'dtype' must be one of" in error(cfg(DENSE, torch_dtype=..., dtype="int8"))
    assert "field 'torch_dtype' must be one of" in error(cfg(DENSE, dtype=..., torch_dtype="int8"))


def test_nested_yarn_error_names_rope_parameters() -> None:
    msg = error(
        cfg(DENSE, rope_theta=..., rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    )
    assert "field 'rope_parameters'" in msg


@pytest.mark.parametrize("step", [0, -1])
def test_decoder_sparse_step_below_one_is_refused(step: int) -> None:
    assert f"field 'decoder_sparse_step' must be >= 1, got {step}" in error(
        cfg(MOE, decoder_sparse_step=step)
    )


def test_bool_in_mlp_only_layers_is_refused() -> None:
    assert "field 'mlp_only_layers' must list layer indices" in error(cfg(MOE, mlp_only_layers=[True]))
