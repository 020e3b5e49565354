"""conversion.qwen3_mapping: Megatron parameter names -> HF tensors, TP sharding, seeded init."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mars_megatron.conversion.hf_io import HFReader
from mars_megatron.conversion.qwen3_mapping import (
    MappingError,
    ParamPlan,
    expected_hf_tensors,
    init_tensor,
    plan_for,
    shard,
    unshard,
)
from mars_megatron.models.hf_config import Qwen3Arch, load_hf_config


def make_arch(**changes: object) -> Qwen3Arch:
    base = Qwen3Arch(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=10,
        hidden_size=6,
        num_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=3,
        ffn_hidden_size=8,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        initializer_range=0.02,
        dtype="float32",
        num_experts=8,
        moe_topk=2,
        moe_ffn_hidden_size=4,
        moe_layers=(True,) * 4,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


ARCH = make_arch()
DENSE = make_arch(architecture="Qwen3ForCausalLM", num_experts=None, moe_topk=None, moe_ffn_hidden_size=None)


# ------------------------------------------------------------------------------------------ plan_for
@pytest.mark.parametrize(
    ("name", "hf", "split", "group"),
    [
        ("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], "vocab", "tp"),
        ("decoder.final_layernorm.weight", ["model.norm.weight"], "none", "none"),
        ("output_layer.weight", ["lm_head.weight"], "vocab", "tp"),
    ],
)
def test_plan_for_non_layer_params(name: str, hf: list[str], split: str, group: str) -> None:
    plan = plan_for(name, ARCH, layer_offset=5, expert_offset=3)  # offsets do not apply here
    assert plan == ParamPlan(tuple(hf), split, group, None, None)  # type: ignore[arg-type]


def test_tied_output_layer_reads_the_embedding() -> None:
    plan = plan_for("output_layer.weight", dataclasses.replace(ARCH, tie_word_embeddings=True))
    assert plan.hf_names == ("model.embed_tokens.weight",) and plan.split == "vocab"


L = "model.layers.7."  # local layer 2 on a stage whose first layer is 5


@pytest.mark.parametrize(
    ("rest", "hf", "split", "group"),
    [
        # local spec
        ("input_layernorm.weight", ["input_layernorm.weight"], "none", "none"),
        (
            "self_attention.linear_qkv.weight",
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            "qkv",
            "tp",
        ),
        (
            "self_attention.linear_qkv.bias",
            ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
            "qkv",
            "tp",
        ),
        ("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], "col", "tp"),
        ("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"], "none", "none"),
        ("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"], "none", "none"),
        ("pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"], "none", "none"),
        ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "gated", "tp"),
        ("mlp.linear_fc2.weight", ["mlp.down_proj.weight"], "col", "tp"),
        ("mlp.router.weight", ["mlp.gate.weight"], "none", "none"),
        # Transformer Engine spec: the pre-norms are fused into the following linear
        ("self_attention.linear_qkv.layer_norm_weight", ["input_layernorm.weight"], "none", "none"),
        ("mlp.linear_fc1.layer_norm_weight", ["post_attention_layernorm.weight"], "none", "none"),
    ],
)
def test_plan_for_layer_params_applies_layer_offset(rest: str, hf: list[str], split: str, group: str) -> None:
    plan = plan_for(f"decoder.layers.2.{rest}", ARCH, layer_offset=5, expert_offset=4)
    assert plan == ParamPlan(tuple(L + h for h in hf), split, group, layer=7, expert=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight",  # local spec, sequential experts
        "decoder.layers.2.mlp.experts.linear_fc1.weight1",  # TE grouped GEMM
    ],
)
def test_plan_for_expert_fc1_applies_both_offsets(name: str) -> None:
    plan = plan_for(name, ARCH, layer_offset=5, expert_offset=4)
    assert plan == ParamPlan(
        (L + "mlp.experts.5.gate_proj.weight", L + "mlp.experts.5.up_proj.weight"), "gated", "etp", 7, 5
    )


@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
        "decoder.layers.0.mlp.experts.linear_fc2.weight3",
    ],
)
def test_plan_for_expert_fc2(name: str) -> None:
    assert plan_for(name, ARCH) == ParamPlan(
        ("model.layers.0.mlp.experts.3.down_proj.weight",), "col", "etp", 0, 3
    )


def test_plan_for_grouped_gemm_multi_digit_index() -> None:
    plan = plan_for(
        "decoder.layers.11.mlp.experts.linear_fc1.weight3", ARCH, layer_offset=0, expert_offset=64
    )
    assert plan.hf_names == (
        "model.layers.11.mlp.experts.67.gate_proj.weight",
        "model.layers.11.mlp.experts.67.up_proj.weight",
    )
    assert (plan.layer, plan.expert) == (11, 67)


@pytest.mark.parametrize(
    "name",
    [
        "embedding.position_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv._extra_state",
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight",  # grouped GEMM name without an index
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc3.weight",
        "decoder.layers.x.input_layernorm.weight",
        "layers.0.input_layernorm.weight",
        "module.embedding.word_embeddings.weight",  # a DDP-wrapped name must be unwrapped first
        "",
    ],
)
def test_plan_for_unknown_name_raises(name: str) -> None:
    with pytest.raises(MappingError, match="no HF tensor is known"):
        plan_for(name, ARCH)


# ---------------------------------------------------------------------------------- shard / unshard
def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def full_tensors(split: str, arch: Qwen3Arch) -> list[torch.Tensor]:
    h, hd, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q_rows, kv_rows = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    return {
        "none": lambda: [rand(h, seed=1)],
        "row": lambda: [rand(f, h, seed=2)],
        "col": lambda: [rand(h, f, seed=3)],
        "vocab": lambda: [rand(arch.vocab_size, h, seed=4)],
        "gated": lambda: [rand(f, h, seed=5), rand(f, h, seed=6)],
        "qkv": lambda: [rand(q_rows, h, seed=7), rand(kv_rows, h, seed=8), rand(kv_rows, h, seed=9)],
        "qkv_bias": lambda: [rand(q_rows, seed=10), rand(kv_rows, seed=11), rand(kv_rows, seed=12)],
    }[split]()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("split", ["none", "row", "col", "vocab", "gated", "qkv", "qkv_bias"])
def test_shard_unshard_round_trip_is_exact(split: str, tp: int) -> None:
    arch = ARCH  # 8 heads, 4 kv groups, head_dim 3, ffn 8, vocab 10 -> padded 12 (divisible by 1, 2, 4)
    kind = "qkv" if split == "qkv_bias" else split
    plan = ParamPlan(("a", "b", "c")[: {"qkv": 3, "gated": 2}.get(kind, 1)], kind, "tp")  # type: ignore[arg-type]
    full = full_tensors(split, arch)
    pieces = [shard(plan, full, r, tp, arch, padded_vocab=12) for r in range(tp)]
    back = unshard(plan, pieces, arch)
    assert len(back) == len(full)
    for b, f in zip(back, full, strict=True):
        assert b.shape == f.shape and torch.equal(b, f)
    if kind != "none":
        # every rank holds an equal, distinct share
        assert len({tuple(p.shape) for p in pieces}) == 1
        assert sum(p.numel() for p in pieces) == sum(t.numel() for t in full) + (
            (12 - arch.vocab_size) * arch.hidden_size if kind == "vocab" else 0
        )


def test_row_and_col_shards_are_contiguous_blocks() -> None:
    w = torch.arange(24.0).reshape(4, 6)
    row, col = ParamPlan(("w",), "row", "tp"), ParamPlan(("w",), "col", "tp")
    assert torch.equal(shard(row, [w], 1, 2, ARCH, 12), w[2:4])
    assert torch.equal(shard(col, [w], 1, 2, ARCH, 12), w[:, 3:6])
    assert torch.equal(shard(col, [w], 2, 3, ARCH, 12), w[:, 4:6])


def tiny_qkv_arch() -> Qwen3Arch:
    return make_arch(num_attention_heads=4, num_key_value_heads=2, head_dim=1, hidden_size=1)


def test_qkv_layout_is_megatrons_per_group_interleave() -> None:
    arch = tiny_qkv_arch()  # 4 heads in 2 query groups, head_dim 1, hidden 1
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # q0..q3
    k = torch.tensor([[10.0], [11.0]])  # k0, k1
    v = torch.tensor([[20.0], [21.0]])  # v0, v1
    plan = plan_for("decoder.layers.0.self_attention.linear_qkv.weight", arch)
    fused = shard(plan, [q, k, v], 0, 1, arch, 12)
    # group 0: q0 q1 k0 v0 | group 1: q2 q3 k1 v1
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert fused.shape == (8, 1)
    # TP=2 splits whole groups
    assert shard(plan, [q, k, v], 0, 2, arch, 12).flatten().tolist() == [0, 1, 10, 20]
    assert shard(plan, [q, k, v], 1, 2, arch, 12).flatten().tolist() == [2, 3, 11, 21]
    # the same order for biases (1-D)
    bias = plan_for("decoder.layers.0.self_attention.linear_qkv.bias", arch)
    assert shard(bias, [q.flatten(), k.flatten(), v.flatten()], 0, 1, arch, 12).tolist() == [
        0,
        1,
        10,
        20,
        2,
        3,
        11,
        21,
    ]
    # and unshard reads that order back
    q2, k2, v2 = unshard(
        plan, [torch.tensor([[0.0], [1.0], [10.0], [20.0], [2.0], [3.0], [11.0], [21.0]])], arch
    )
    assert (q2.flatten().tolist(), k2.flatten().tolist(), v2.flatten().tolist()) == (
        [0, 1, 2, 3],
        [10, 11],
        [20, 21],
    )


def test_qkv_layout_with_head_dim_two_keeps_heads_whole() -> None:
    arch = make_arch(num_attention_heads=2, num_key_value_heads=1, head_dim=2, hidden_size=1)
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # head 0 = rows 0,1; head 1 = rows 2,3
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    plan = plan_for("decoder.layers.0.self_attention.linear_qkv.weight", arch)
    assert shard(plan, [q, k, v], 0, 1, arch, 12).flatten().tolist() == [0, 1, 2, 3, 10, 11, 20, 21]


def test_gated_fc1_piece_is_gate_then_up_of_this_rank() -> None:
    gate = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # g0..g3
    up = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # u0..u3
    plan = plan_for("decoder.layers.0.mlp.linear_fc1.weight", ARCH)
    assert shard(plan, [gate, up], 0, 1, ARCH, 12).flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert shard(plan, [gate, up], 0, 2, ARCH, 12).flatten().tolist() == [0, 1, 10, 11]
    assert shard(plan, [gate, up], 1, 2, ARCH, 12).flatten().tolist() == [2, 3, 12, 13]
    assert shard(plan, [gate, up], 3, 4, ARCH, 12).flatten().tolist() == [3, 13]
    pieces = [torch.tensor([[0.0], [1.0], [10.0], [11.0]]), torch.tensor([[2.0], [3.0], [12.0], [13.0]])]
    g, u = unshard(plan, pieces, ARCH)
    assert (g.flatten().tolist(), u.flatten().tolist()) == ([0, 1, 2, 3], [10, 11, 12, 13])


def test_vocab_padding_adds_zero_rows_and_unshard_strips_them() -> None:
    arch = make_arch(vocab_size=5, hidden_size=2)
    emb = torch.arange(1.0, 11.0).reshape(5, 2)  # no zero entries
    plan = plan_for("embedding.word_embeddings.weight", arch)
    padded = shard(plan, [emb], 0, 1, arch, padded_vocab=8)
    assert padded.shape == (8, 2)
    assert torch.equal(padded[:5], emb) and torch.equal(padded[5:], torch.zeros(3, 2))
    r0, r1 = (shard(plan, [emb], r, 2, arch, padded_vocab=8) for r in range(2))
    assert torch.equal(r0, emb[:4])
    assert torch.equal(r1, torch.cat([emb[4:], torch.zeros(3, 2)]))
    (back,) = unshard(plan, [r0, r1], arch)
    assert torch.equal(back, emb)
    # already at the padded size: nothing is added
    assert torch.equal(shard(plan, [emb], 0, 1, arch, padded_vocab=5), emb)
    # the output layer is padded the same way
    out = plan_for("output_layer.weight", arch)
    assert torch.equal(shard(out, [emb], 1, 2, arch, padded_vocab=8), r1)


def test_shard_keeps_dtype() -> None:
    arch = tiny_qkv_arch()
    q, k, v = (torch.ones(n, 1, dtype=torch.bfloat16) for n in (4, 2, 2))
    plan = plan_for("decoder.layers.0.self_attention.linear_qkv.weight", arch)
    assert shard(plan, [q, k, v], 1, 2, arch, 12).dtype == torch.bfloat16
    emb = torch.ones(10, 6, dtype=torch.float16)
    assert (
        shard(plan_for("embedding.word_embeddings.weight", arch), [emb], 0, 1, arch, 12).dtype
        == torch.float16
    )


# ---------------------------------------------------------------------------- expected_hf_tensors
def test_expected_tensors_dense_by_hand() -> None:
    arch = dataclasses.replace(DENSE, num_layers=2)
    names = expected_hf_tensors(arch)
    # embed + 2 x (input norm, q, k, v, o, q_norm, k_norm, post norm, gate, up, down) + norm + lm_head
    assert len(names) == 1 + 2 * 11 + 2
    assert names["model.embed_tokens.weight"] == (10, 6)
    assert names["model.layers.1.self_attn.q_proj.weight"] == (24, 6)  # 8 heads x 3
    assert names["model.layers.1.self_attn.k_proj.weight"] == (12, 6)  # 4 kv heads x 3
    assert names["model.layers.1.self_attn.o_proj.weight"] == (6, 24)
    assert names["model.layers.0.self_attn.q_norm.weight"] == (3,)
    assert names["model.layers.0.mlp.gate_proj.weight"] == (8, 6)
    assert names["model.layers.0.mlp.down_proj.weight"] == (6, 8)
    assert names["lm_head.weight"] == (10, 6)
    order = list(names)
    assert order[0] == "model.embed_tokens.weight" and order[-1] == "lm_head.weight"
    tied = expected_hf_tensors(dataclasses.replace(arch, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied and len(tied) == len(names) - 1
    biased = expected_hf_tensors(dataclasses.replace(arch, attention_bias=True))
    assert len(biased) == len(names) + 2 * 3
    assert biased["model.layers.0.self_attn.k_proj.bias"] == (12,)


def test_expected_tensors_moe_by_hand() -> None:
    arch = dataclasses.replace(ARCH, moe_layers=(False, True, False, True))
    names = expected_hf_tensors(arch)
    # dense layers: 11 tensors; MoE layers: 8 attention/norm + router + 8 experts x 3
    assert len(names) == 1 + 2 * 11 + 2 * (8 + 1 + 8 * 3) + 2
    assert names["model.layers.1.mlp.gate.weight"] == (8, 6)
    assert names["model.layers.3.mlp.experts.7.gate_proj.weight"] == (4, 6)
    assert names["model.layers.3.mlp.experts.7.down_proj.weight"] == (6, 4)
    assert names["model.layers.0.mlp.gate_proj.weight"] == (8, 6)
    assert "model.layers.0.mlp.gate.weight" not in names
    assert "model.layers.1.mlp.gate_proj.weight" not in names


def hf_checkpoint_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    reader = HFReader(path)
    return {n: reader.shape(n) for n in reader.names()}


@pytest.mark.parametrize(
    ("preset", "overrides", "count"),
    [
        ("tiny-dense", None, 1 + 2 * 11 + 2),
        ("tiny-dense", {"tie_word_embeddings": True}, 1 + 2 * 11 + 1),
        ("tiny-moe", None, 1 + 2 * (8 + 1 + 4 * 3) + 2),
        ("tiny-moe", {"tie_word_embeddings": True, "vocab_size": 1000}, 1 + 2 * (8 + 1 + 4 * 3) + 1),
        # 4 layers, sparse step 2, layer 3 forced dense -> only layer 1 is MoE
        (
            "tiny-moe",
            {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
            1 + 3 * 11 + (8 + 1 + 4 * 3) + 2,
        ),
    ],
)
def test_expected_tensors_match_a_real_hf_checkpoint(
    tmp_path: Path, preset: str, overrides: dict | None, count: int
) -> None:
    from mars_megatron.models.presets import init_model

    out = init_model(preset, tmp_path / "ckpt", overrides=overrides)
    arch = load_hf_config(out)
    written = hf_checkpoint_tensors(out)
    expected = expected_hf_tensors(arch)
    assert len(expected) == count
    assert written == expected  # same names and shapes
    assert ("lm_head.weight" in expected) is not bool((overrides or {}).get("tie_word_embeddings"))


# -------------------------------------------------------------------------------------- init_tensor
def test_init_tensor_depends_only_on_seed_and_name() -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.manual_seed(0)
    a = init_tensor(name, (16, 8), 3, 0.02, torch.float32)
    torch.manual_seed(999)  # the global RNG does not matter
    torch.randn(100)
    b = init_tensor(name, (16, 8), 3, 0.02, torch.float32)
    assert torch.equal(a, b)
    assert not torch.equal(a, init_tensor(name, (16, 8), 4, 0.02, torch.float32))  # other seed
    assert not torch.equal(
        a, init_tensor("model.layers.1.self_attn.q_proj.weight", (16, 8), 3, 0.02, torch.float32)
    )
    # the order of draws does not matter either: each name has its own generator
    c = init_tensor("lm_head.weight", (4, 8), 3, 0.02, torch.float32)
    assert torch.equal(c, init_tensor("lm_head.weight", (4, 8), 3, 0.02, torch.float32))


def test_init_tensor_distribution_and_dtype() -> None:
    t = init_tensor("model.embed_tokens.weight", (256, 256), 0, 0.05, torch.float32)
    assert abs(t.mean().item()) < 0.002
    assert abs(t.std().item() - 0.05) < 0.002
    h = init_tensor("model.embed_tokens.weight", (256, 256), 0, 0.05, torch.bfloat16)
    assert h.dtype == torch.bfloat16 and torch.equal(h, t.to(torch.bfloat16))


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.post_attention_layernorm.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.layers.3.self_attn.k_norm.weight",
        "model.norm.weight",
    ],
)
def test_init_tensor_norms_are_ones(name: str) -> None:
    t = init_tensor(name, (5,), 11, 0.02, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and torch.equal(t, torch.ones(5, dtype=torch.bfloat16))


def test_init_tensor_biases_are_zeros() -> None:
    t = init_tensor("model.layers.0.self_attn.q_proj.bias", (6,), 1, 0.02, torch.float32)
    assert torch.equal(t, torch.zeros(6))


def test_every_expected_tensor_gets_the_expected_init() -> None:
    arch = dataclasses.replace(ARCH, moe_layers=(True, False, True, False))
    for name, shape in expected_hf_tensors(arch).items():
        t = init_tensor(name, shape, 0, arch.initializer_range, torch.float32)
        assert tuple(t.shape) == shape
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones(shape)), name
        else:
            assert t.abs().sum() > 0 and not torch.equal(t, torch.ones(shape)), name
