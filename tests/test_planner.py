"""mars_megatron.launch.planner / plan_command (`mars plan`): memory figures against hand calculations,
published parameter counts and published feasible layouts, and errors that name the field. CPU only."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest

from mars_megatron.config import ConfigError, ParallelConfig, load_config
from mars_megatron.launch import plan_command
from mars_megatron.launch.config_fit import check_config
from mars_megatron.launch.planner import (
    GIB,
    LOCAL_SOFTMAX_FUSION,
    LOCAL_SOFTMAX_IN_FP32,
    PRESET_PACKAGE,
    PRESETS,
    Cluster,
    CostModel,
    Layout,
    PlanError,
    Recompute,
    Rollout,
    Workload,
    check_layout,
    check_rollout,
    enumerate_layouts,
    final_norm_bytes,
    gemm_input_bytes,
    layer_activation_bytes,
    local_attention_bytes,
    local_mlp_bytes,
    local_score_buffer_bytes,
    local_score_bytes,
    memory,
    param_counts,
    plan,
    resolve_model,
    rollout_bytes,
    stage_layers,
    step_seconds,
)
from mars_megatron.launch.resources import engine_gpus, rollout_engines, trainer_world_size
from mars_megatron.models.hf_config import Qwen3Arch, load_hf_config, parse_hf_config
from mars_megatron.models.layout import LayoutError, balanced_ends, check_parallel

A30 = PRESETS["qwen3-30b-a3b"]
A235 = PRESETS["qwen3-235b-a22b"]
NO_ROLLOUT = Rollout(colocated=False)
HF_CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "hf_configs"

# A small MoE for hand-checkable activations: h 64, 8 heads / 2 KV heads of 16, 8 experts top-2 of 24.
SMALL_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "max_position_embeddings": 512,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
}
SMALL = parse_hf_config(SMALL_CONFIG, "SMALL")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mars plan")
    plan_command.add_arguments(p)
    return p


def _plan_error(make: Callable[[], object]) -> PlanError:
    """The PlanError ``make`` raises (the tests check which field it names)."""
    with pytest.raises(PlanError) as err:
        make()
    return err.value


def _small_layer_by_hand(tp: int) -> tuple[int, int]:
    """SMALL's (attention, MoE) activations per layer in bf16, written out from the module docstring: one
    pack of s = 128 tokens, cp 1, etp 1, so s_r = 128, s_h = 128 / tp, a_r = 8 / tp, g_r = 2 / tp."""
    s_r, s_h, a_r, g_r = 128, 128 // tp, 8 // tp, 2 // tp
    attention = 4 * s_h * 64 + 6 * s_r * 16 * (a_r + g_r)  # norm + QKV inputs; fused QKV, q/k normed, O
    moe = 4 * s_h * 64 + 4 * s_h * 8 + 4 * 2 * s_h * 1 * 64 + 6 * 2 * s_h * 24  # norm/router in, probs,
    return attention, moe  # expert tokens in and out, SwiGLU in and out


# ------------------------------------------------------------------------------------- parameter counts
def test_parameter_counts_match_the_published_sizes() -> None:
    # Qwen3-30B-A3B: "30.5B total, 3.3B activated"; Qwen3-235B-A22B: "235B total, 22B activated".
    for arch, total, active in ((A30, 30.5e9, 3.3e9), (A235, 235e9, 22e9)):
        counts = param_counts(arch)
        assert counts.total == pytest.approx(total, rel=0.02)
        assert counts.active == pytest.approx(active, rel=0.02)


def test_parameter_count_of_30b_a3b_by_hand() -> None:
    attention = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048  # q, k and v, o: 18,874,368
    norms = 2 * 2048 + 2 * 128  # input + pre-MLP RMSNorm, q/k norms
    router = 2048 * 128
    experts = 128 * 3 * 2048 * 768  # gate, up, down of 128 experts
    embeddings = 2 * 151936 * 2048  # untied input embedding and output layer
    total = 48 * (attention + norms + router + experts) + embeddings + 2048  # + final norm
    assert total == 30_532_122_624
    assert param_counts(A30).total == total
    active = 48 * (attention + norms + router + 8 * 3 * 2048 * 768) + embeddings + 2048
    assert param_counts(A30).active == active == 3_353_032_704


def test_presets_are_the_packaged_hf_configs_that_the_examples_link_to() -> None:
    # one copy of each config.json: package data (so an installed wheel has the presets), which
    # examples/hf_configs/<name>.json and the recipes' model.hf_dir (<name>/config.json) link to
    root = Path(str(resources.files(PRESET_PACKAGE) / "hf_configs"))
    assert list(PRESETS) == ["qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-8b"]
    for name, arch in PRESETS.items():
        packaged = (root / name / "config.json").resolve()
        assert arch == load_hf_config(packaged)
        assert (HF_CONFIGS / f"{name}.json").resolve() == packaged
        if name != "qwen3-8b":  # no recipe uses 8B
            assert (HF_CONFIGS / name / "config.json").resolve() == packaged


# ------------------------------------------------------------------------------------- memory by hand
def test_30b_a3b_ep8_on_8_gpus_weights_grads_optimizer_by_hand() -> None:
    # tp 1, pp 1, ep 8, dp 8: every rank holds all dense parameters and 128 / 8 = 16 experts per layer.
    attention = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048
    norms_and_router = 2 * 2048 + 2 * 128 + 2048 * 128
    embedding_and_output = 2 * 151936 * 2048  # 151936 = 1187 * 128: no vocabulary padding
    dense = 48 * (attention + norms_and_router) + embedding_and_output + 2048
    experts = 48 * 16 * 3 * 2048 * 768
    assert (dense, experts) == (1_541_093_376, 3_623_878_656)
    layout = Layout(tp=1, pp=1, ep=8, dp=8)
    assert layout.edp == 1  # tp*cp*dp / (ep*etp) = 8 / 8: each expert shard has a single copy
    mem = memory(A30, layout, Workload(seq_len=4096), NO_ROLLOUT, Cluster(gpus=8))
    assert mem.weights == 2 * (dense + experts) == 10_329_944_064  # bf16
    assert mem.grads == 4 * (dense + experts)  # fp32 main grads (grad_reduce_in_fp32)
    # distributed optimizer: 12 B/param, dense sharded over dp*cp = 8, experts over edp = 1
    assert mem.optimizer == 12 * dense // 8 + 12 * experts == 45_798_183_936
    assert mem.weights / GIB == pytest.approx(9.62, abs=0.01)


def test_activations_of_a_small_moe_by_hand() -> None:
    # tp 2 (sequence parallel), cp 1, ep 2, etp 1, micro-batch 1, s 128: s_r = 128, s_h = 64, a_r = 4, g_r = 1
    layout = Layout(tp=2, ep=2, etp=1, dp=1)
    work = Workload(seq_len=128)
    check_layout(SMALL, layout, 2, 128)
    attention, moe = _small_layer_by_hand(tp=2)
    assert (attention, moe) == (77_824, 69_632)
    assert layer_activation_bytes(SMALL, layout, work, moe=True) == attention + moe
    # selective recompute drops nothing that flash attention keeps
    selective = Workload(seq_len=128, recompute="selective")
    assert layer_activation_bytes(SMALL, layout, selective, moe=True) == attention + moe
    # pp 1: one micro-batch in flight; the last stage adds final-norm + output inputs and fp32 logits
    mem = memory(SMALL, layout, work, NO_ROLLOUT, Cluster(gpus=2))
    assert mem.activations == 6 * (attention + moe) + 4 * 64 * 64
    assert mem.logits == 128 * 1024 // 2 * 4  # vocabulary padded to 1024, split over tp 2, 4 bytes
    full = memory(SMALL, layout, Workload(seq_len=128, recompute="full"), NO_ROLLOUT, Cluster(gpus=2))
    assert full.activations == 6 * 2 * 64 * 64 + (attention + moe) + 4 * 64 * 64  # layer inputs + one layer


def test_first_pipeline_stage_holds_pp_micro_batches() -> None:
    # tp 1, pp 2: 3 layers per stage; s_r = s_h = 128, a_r = 8, g_r = 2
    attention, moe = _small_layer_by_hand(tp=1)
    layout = Layout(tp=1, pp=2, ep=1, dp=1)
    assert (
        layer_activation_bytes(SMALL, layout, Workload(seq_len=128), moe=True) == attention + moe == 294_912
    )
    mem = memory(SMALL, layout, Workload(seq_len=128, global_batch=8), NO_ROLLOUT, Cluster(gpus=2))
    # stage 0: 2 micro-batches in flight under 1F1B (the last stage: 1, plus 4·s·h and 128·1024·4 of logits)
    assert (mem.stage, mem.activations, mem.logits) == (0, 2 * 3 * (attention + moe), 0)
    one = memory(SMALL, layout, Workload(seq_len=128, global_batch=1), NO_ROLLOUT, Cluster(gpus=2))
    assert one.stage == 1 and one.activations == 3 * (attention + moe) + 4 * 128 * 64  # 1 micro-batch in all


# ----------------------------------------------------------------- the local layer spec (no TE, no flash)
LOCAL_S = 64  # tokens of the measured pack: two samples of 40 and 24
# The measured model: SMALL's shapes in two layers, a dense one (FFN 96) and a MoE one. Each case turns
# what a rule of the local-spec formulas depends on: the dtype (fp32 copies that are views in fp32),
# selective recompute, one KV head (Megatron's query reshape is then a view), no GQA (V is then a view of
# the QKV output), the router's softmax (over the top k or over all experts) and its aux loss.
LOCAL_LAYERS = {**SMALL_CONFIG, "num_hidden_layers": 2, "mlp_only_layers": [0], "norm_topk_prob": True}
LOCAL_CASES: dict[str, tuple[str, Recompute, dict[str, object]]] = {
    "bf16": ("bfloat16", "none", {}),
    "fp32": ("float32", "none", {}),
    "bf16, selective, 1 KV head, no aux loss": (
        "bfloat16", "selective", {"num_key_value_heads": 1, "router_aux_loss_coef": 0.0}
    ),
    "bf16, MHA": ("bfloat16", "none", {"num_key_value_heads": 8}),
    "fp32, 1 KV head, softmax over all experts": (
        "float32", "none", {"num_key_value_heads": 1, "norm_topk_prob": False}
    ),
}  # fmt: skip


def _local_arch(case: str) -> Qwen3Arch:
    return parse_hf_config({**LOCAL_LAYERS, **LOCAL_CASES[case][2]}, case)


class _Saved:
    """What the saved-tensors hook hands autograd in place of a tensor: alive exactly as long as autograd
    keeps the tensor, so a tensor saved by a node that the forward itself frees (top-k indices whose values
    are dropped, as the aux loss's are) is not counted."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: object) -> None:
        self.tensor = tensor


def _local_attention_saved(s: int) -> dict[str, dict[str, int]]:
    """Megatron's local core attention alone (the trainer's spec and TransformerConfig, SMALL's heads: 8
    query, 2 KV, d 16), fed q, k, v and the pack's block-causal mask as the layer feeds them: the bytes of
    the scores (storages of a·s·s elements), the mask, the query and the rest (keys and values) that
    autograd keeps, counted once per storage; per dtype: bf16 and fp32 as the trainer configures them, and
    bf16 with a bf16 softmax (``attention_softmax_in_fp32`` off); plus the bytes of the buffer Megatron
    keeps for baddbmm."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mars_megatron.algorithm.tensors import PackedSequence
    from mars_megatron.training import parallel
    from mars_megatron.training.model_provider import layer_spec, transformer_config

    parallel.init_model_parallel(ParallelConfig(), seed=0)
    a, g, d = SMALL.num_attention_heads, SMALL.num_key_value_heads, SMALL.head_dim
    spans = ((0, 40), (40, s))
    zeros = torch.zeros(1, s, dtype=torch.long)
    pack = PackedSequence(zeros, zeros, zeros, zeros.float(), torch.tensor([0, 40, s], dtype=torch.int32),
                          (0, 1), spans)  # fmt: skip
    mask = pack.attention_mask()
    out: dict[str, dict[str, int]] = {}
    for name, dtype, fp32_softmax in (("bf16", "bfloat16", True), ("fp32", "float32", True),
                                      ("bf16, bf16 softmax", "bfloat16", False)):  # fmt: skip
        config = transformer_config(SMALL, ParallelConfig(), dtype=dtype, impl="local")
        spec = layer_spec(config, "local", 0).layer_specs[0].submodules.self_attention.submodules
        assert spec.core_attention is DotProductAttention  # what the local spec runs
        trainer_settings = (config.attention_softmax_in_fp32, config.masked_softmax_fusion)
        config.attention_softmax_in_fp32 = fp32_softmax
        core = spec.core_attention(config, 1, AttnMaskType.causal, "self")
        torch_dtype = getattr(torch, dtype)
        q = torch.randn(s, 1, a, d, dtype=torch_dtype, requires_grad=True)
        k, v = (torch.randn(s, 1, g, d, dtype=torch_dtype, requires_grad=True) for _ in range(2))
        saved: dict[int, tuple[int, int]] = {}

        def keep(t: torch.Tensor, saved: dict[int, tuple[int, int]] = saved) -> torch.Tensor:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = (storage.nbytes(), t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            context = core(q, k, v, mask)
        context.float().sum().backward()  # the saved tensors serve a real backward
        ptr = {"mask": mask.untyped_storage().data_ptr(), "query": q.untyped_storage().data_ptr()}
        parts = {part: saved.pop(p)[0] for part, p in ptr.items()}
        parts["scores"] = sum(n for n, numel in saved.values() if numel == a * s * s)
        parts["rest"] = sum(n for n, numel in saved.values() if numel != a * s * s)
        parts["buffer"] = (
            ps.get_global_memory_buffer().buffer[("mpu", torch_dtype)].untyped_storage().nbytes()
        )
        parts["softmax_in_fp32"], parts["softmax_fusion"] = trainer_settings
        out[name] = parts
    return out


def _local_layers_saved(s: int) -> dict[str, dict[str, int]]:
    """The trainer's own model on the local spec (``build_model``, ``transformer_impl="local"``) per case
    of LOCAL_CASES, one pack of ``s`` tokens: the bytes autograd keeps for backward at the end of the
    forward, once per storage, parameters excluded, by the module that saved them: ``attention 0``/``1``
    (input norm and self-attention of layer 0/1), ``dense`` (layer 0's pre-MLP norm and MLP), ``moe``
    (layer 1's), ``final`` (final norm and output layer), ``mask`` (the pack's mask, wherever saved) and
    ``other`` (the rest of the model)."""
    import weakref

    import torch
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mars_megatron.algorithm.tensors import PackedSequence
    from mars_megatron.training import parallel
    from mars_megatron.training.model_provider import build_model

    out: dict[str, dict[str, int]] = {}
    for case, (dtype, recompute, _) in LOCAL_CASES.items():
        parallel.init_model_parallel(ParallelConfig(), seed=0)
        model = build_model(_local_arch(case), ParallelConfig(), dtype=dtype, transformer_impl="local",
                            recompute=recompute)  # fmt: skip
        for p in model.parameters():  # build_model leaves the weights uninitialised; the router needs some
            torch.nn.init.normal_(p, std=0.05)
        where = ["other"]

        def tag(module: torch.nn.Module, part: str, where: list[str] = where) -> None:
            module.register_forward_pre_hook(lambda *_: where.__setitem__(0, part))
            module.register_forward_hook(lambda *_: where.__setitem__(0, "other"))

        for i, layer in enumerate(m for m in model.modules() if isinstance(m, TransformerLayer)):
            for module in (layer.input_layernorm, layer.self_attention):
                tag(module, f"attention {i}")
            for module in (layer.pre_mlp_layernorm, layer.mlp):
                tag(module, "moe" if i else "dense")
        tag(model.decoder.final_layernorm, "final")
        tag(model.output_layer, "final")
        records: list[tuple[weakref.ref, int, int, str]] = []

        def pack(t: torch.Tensor, records: list = records, where: list[str] = where) -> _Saved:
            held, storage = _Saved(t), t.untyped_storage()
            records.append((weakref.ref(held), storage.data_ptr(), storage.nbytes(), where[0]))
            return held

        tokens = torch.randint(0, SMALL.vocab_size, (1, s))
        zeros = torch.zeros(1, s, dtype=torch.long)
        cu_seqlens = torch.tensor([0, 40, s], dtype=torch.int32)
        mask = PackedSequence(tokens, zeros, zeros, zeros.float(), cu_seqlens, (0, 1),
                              ((0, 40), (40, s))).attention_mask()  # fmt: skip
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
            logits = model(tokens, torch.arange(s)[None], mask)
        seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
        parts: dict[str, int] = {}
        for alive, ptr, nbytes, part in records:
            if alive() is None or ptr in seen:
                continue
            seen.add(ptr)
            part = "mask" if ptr == mask.untyped_storage().data_ptr() else part
            parts[part] = parts.get(part, 0) + nbytes
        logits.float().sum().backward()  # the saved tensors serve a real backward
        out[case] = parts
    return out


def _local_saved(s: int) -> dict[str, dict[str, dict[str, int]]]:
    """Spawned (a world of one): both measurements, in one process."""
    return {"attention": _local_attention_saved(s), "layers": _local_layers_saved(s)}


@pytest.fixture(scope="module")
def local_saved() -> dict[str, dict[str, dict[str, int]]]:
    from mars_megatron.training import parallel

    return parallel.launch(_local_saved, 1, LOCAL_S, timeout_s=300)[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(LOCAL_CASES))
def test_local_layer_keeps_what_the_planner_counts(local_saved: dict, case: str) -> None:
    """Every byte a local-spec layer keeps for backward, measured on the trainer's own model, is what the
    planner counts, part by part (module docstring: our RMSNorm's fp32 copies, the q/k norms, RoPE's cos
    and sin, the repeated K and V, the scores, the unfused SwiGLU, router, dispatcher and experts). Before,
    the planner counted Transformer Engine's fused norms and SwiGLU plus the local attention's extras: of
    what the bf16 case keeps, 83 % of the attention, 56 % of the dense MLP, 74 % of the MoE MLP."""
    dtype, recompute, _ = LOCAL_CASES[case]
    arch, layout = _local_arch(case), Layout()
    work = Workload(seq_len=LOCAL_S, recompute=recompute, transformer_impl="local")
    got = local_saved["layers"][case]
    attention = local_attention_bytes(arch, layout, work, dtype)
    assert got["attention 0"] == got["attention 1"] == attention
    assert got["dense"] == local_mlp_bytes(arch, layout, work, moe=False, dtype=dtype)
    assert got["moe"] == local_mlp_bytes(arch, layout, work, moe=True, dtype=dtype)
    assert got["final"] == final_norm_bytes(arch, layout, work, dtype)
    assert got["mask"] == LOCAL_S * LOCAL_S  # one bool per (query, key) of the pack, shared by the layers
    assert got["other"] == 8 * LOCAL_S  # the embedding's int64 token indices: left out by the planner


@pytest.mark.multiproc
def test_local_spec_memory_is_every_byte_the_model_keeps(local_saved: dict) -> None:
    """The planner's activations of the measured two-layer model in bf16 (one GPU, one pack) are the sum of
    everything it keeps (the token indices aside) plus Megatron's "mpu" buffer, measured."""
    arch, layout = _local_arch("bf16"), Layout()
    work = Workload(seq_len=LOCAL_S, global_batch=1, transformer_impl="local")
    got = local_saved["layers"]["bf16"]
    assert layer_activation_bytes(arch, layout, work, moe=False) == got["attention 0"] + got["dense"]
    assert layer_activation_bytes(arch, layout, work, moe=True) == got["attention 1"] + got["moe"]
    buffer = local_saved["attention"]["bf16"]["buffer"]
    assert buffer == local_score_buffer_bytes(arch, layout, work)
    mem = memory(arch, layout, work, NO_ROLLOUT, Cluster(gpus=1))
    assert mem.activations == sum(got.values()) - got["other"] + buffer


@pytest.mark.multiproc
def test_local_attention_scores_mask_and_buffer(local_attention_saved: dict) -> None:
    """Megatron's local core attention alone, in bf16: the scores at 6 B (its fp32 softmax output and the
    bf16 probabilities of the PV matmul; the raw bf16 scores are not kept), K and V repeated to the query
    heads, the pack's mask and baddbmm's buffer (2 B a score), as the planner counts them."""
    got = local_attention_saved["bf16"]
    s, a, d = LOCAL_S, SMALL.num_attention_heads, SMALL.head_dim
    assert (got["softmax_in_fp32"], got["softmax_fusion"]) == (LOCAL_SOFTMAX_IN_FP32, LOCAL_SOFTMAX_FUSION)
    assert got["scores"] == local_score_bytes() * a * s * s == 6 * a * s * s
    assert got["query"] + got["rest"] == 3 * 2 * s * a * d  # the rotated q, K and V repeated to 8 heads
    assert got["mask"] == s * s  # one bool per (query, key) of the pack
    local = Workload(seq_len=s, transformer_impl="local")
    assert got["buffer"] == local_score_buffer_bytes(SMALL, Layout(ep=1), local) == 2 * a * s * s


@pytest.fixture(scope="module")
def local_attention_saved(local_saved: dict) -> dict[str, dict[str, int]]:
    return local_saved["attention"]


@pytest.mark.multiproc
def test_local_score_bytes_by_dtype_and_softmax(local_attention_saved: dict) -> None:
    """Bytes per score element by dtype and softmax setting, measured: fp32 training (the CPU runs) keeps
    one fp32 tensor, which the softmax and the PV matmul share; a bf16 softmax one bf16 tensor."""
    elements = SMALL.num_attention_heads * LOCAL_S * LOCAL_S
    measured = {name: got["scores"] / elements for name, got in local_attention_saved.items()}
    assert measured == {"bf16": 6, "fp32": 4, "bf16, bf16 softmax": 2}
    assert local_score_bytes("bfloat16") == 6 and local_score_bytes("float32") == 4
    assert local_score_bytes("bfloat16", softmax_in_fp32=False) == 2
    assert local_score_bytes("float16", fused=True) == 2  # Megatron's CUDA softmax kernels (not on CPU)
    assert _plan_error(lambda: local_score_bytes("int8")).path == "dtype"


def test_local_layer_under_tp_cp_ep_by_hand() -> None:
    """The local-spec terms scale as Megatron shards them, written out for SMALL (h 64, 8 / 2 heads of 16,
    FFN 96, 8 experts top-2 of 24, softmax over all experts, aux loss) with b 2, s 256 and tp 2 (sequence
    parallel: norms and router on s_h = s_r / 2 tokens; heads, FFN and the gathered region on s_r), cp 2
    (s_r = s / 2; K and V all-gathered to s tokens), ep 2 with etp 1 (the dispatcher gathers etp·ep·s_h
    tokens a sequence; each rank routes k·s_h·etp of them to its E / ep experts)."""
    b, s, s_r, s_h, a_r, g_r, d, h = 2, 256, 128, 64, 4, 1, 16, 64
    layout = Layout(tp=2, cp=2, ep=2, etp=1, dp=1)
    work = Workload(seq_len=s, micro_batch=b, global_batch=2, transformer_impl="local")
    check_layout(SMALL, layout, 4, s)
    norm = (4 + 2 * 2) * b * s_h * h + 4 * b * s_h  # fp32 copy, normalised, output; rsqrt per row
    qk_norms = b * s_r * (d * (4 + 2) * (a_r + g_r) + 4 * (a_r + g_r))  # fp32 rows, normalised, rsqrt
    rope = 4 * 2 * s_r * d  # cos and sin for q and k: one table for the micro-batch
    q, o = 2 * b * s_r * a_r * d, 2 * b * s_r * a_r * d
    scores = 6 * b * a_r * s_r * s
    kv = 2 * 2 * b * s * a_r * d  # K and V gathered to s tokens and repeated to a_r heads
    assert local_attention_bytes(SMALL, layout, work) == norm + qk_norms + rope + q + scores + kv + o
    # selective: no scores, no K/V copies; the checkpoint keeps q, the rotated local k, V's QKV output
    # (a view of it: all of it, (a_r + 2 g_r)·d wide) and the mask type
    selective = replace(work, recompute="selective")
    kept = 2 * b * s_r * g_r * d + 2 * b * s_r * (a_r + 2 * g_r) * d + 4
    assert local_attention_bytes(SMALL, layout, selective) == norm + qk_norms + rope + q + kept + o
    # the dense MLP (FFN split over tp, on the gathered s_r tokens): the unfused SwiGLU's five halves
    assert local_mlp_bytes(SMALL, layout, work, moe=False) == norm + 5 * 2 * b * s_r * 96 // 2
    n, routed = b * s_h * 1 * 2, 2 * b * s_h * 1  # gathered tokens (etp·ep), routed to this rank's experts
    router = b * s_h * (8 * 2 + 4 * 8) + (4 * 8 * b * s_h + 8 * 8 + 4)  # top-k, softmax; aux loss
    dispatcher = 5 * (8 // 2) * n + routed * (8 + 4 + 2 * h)  # local map and probs; index, prob, token
    experts = routed * 6 * 2 * 24
    assert local_mlp_bytes(SMALL, layout, work, moe=True) == norm + router + dispatcher + experts
    assert final_norm_bytes(SMALL, layout, work) == norm
    # without GQA and CP, V is a view of the QKV output (all of it kept) and K the rotated k itself
    mha, one = replace(SMALL, num_key_value_heads=8), Layout(ep=1)
    plain = replace(work, micro_batch=1)
    norm = 8 * s * h + 4 * s
    qk_norms = s * (d * 6 * 16 + 4 * 16)
    qkv, k = 2 * s * 24 * d, 2 * s * 8 * d
    expect = norm + qk_norms + qkv + 4 * 2 * s * d + 2 * s * 8 * d + 6 * 8 * s * s + k + 2 * s * 8 * d
    assert local_attention_bytes(mha, one, plain) == expect


def test_local_buffer_is_the_largest_use_of_megatrons_mpu_buffer() -> None:
    """Megatron's "mpu" buffer holds baddbmm's scores, the sequence-parallel all-gathers and the MoE
    dispatcher's: the largest counts, once per rank; Transformer Engine's layers use none."""
    s, h = 256, 64
    local = Workload(seq_len=s, micro_batch=2, global_batch=2, transformer_impl="local")
    layout = Layout(tp=2, cp=2, ep=2, etp=1, dp=1)
    assert local_score_buffer_bytes(SMALL, layout, local) == 2 * 2 * 4 * 128 * s  # scores: a_r 4, s_r 128
    assert local_score_buffer_bytes(SMALL, layout, replace(local, transformer_impl="transformer_engine")) == 0
    short = replace(local, seq_len=8)  # 8-token packs: scores 2·2·4·8·8, SP gather 2·2·8·64
    wide = Layout(tp=2, ep=4, etp=1, dp=2)  # the dispatcher gathers 4 ranks' 4 tokens: 2·2·16·64
    assert local_score_buffer_bytes(SMALL, wide, short) == 2 * 2 * 16 * h
    dense = parse_hf_config({**SMALL_CONFIG, "architectures": ["Qwen3ForCausalLM"]}, "dense")
    assert local_score_buffer_bytes(dense, Layout(tp=2, dp=1), short) == 2 * 2 * 8 * h


def test_local_spec_terms_in_memory_by_hand() -> None:
    """memory(): pp 2, first stage, 3 micro-batches (pp = 2 in flight, each with its mask), one buffer;
    the last stage's final norm is our RMSNorm's (4 + 2·2)·s·h + 4·s instead of TE's 4·s·h."""
    s = 256
    layout = Layout(pp=2, dp=1, ep=1)
    local = Workload(seq_len=s, global_batch=3, transformer_impl="local")
    got = memory(SMALL, layout, local, NO_ROLLOUT, Cluster(gpus=2))
    per_layer = layer_activation_bytes(SMALL, layout, local, moe=True)
    assert per_layer == local_attention_bytes(SMALL, layout, local) + local_mlp_bytes(
        SMALL, layout, local, True
    )
    assert got.stage == 0
    assert got.activations == 2 * (3 * per_layer + s * s) + 2 * 8 * s * s
    one = memory(SMALL, layout, replace(local, global_batch=1), NO_ROLLOUT, Cluster(gpus=2))
    assert one.stage == 1 and one.activations == 3 * per_layer + s * s + 2 * 8 * s * s + 8 * s * 64 + 4 * s
    te = memory(SMALL, layout, Workload(seq_len=s, global_batch=1), NO_ROLLOUT, Cluster(gpus=2))
    te_layer = layer_activation_bytes(SMALL, layout, Workload(seq_len=s), moe=True)
    assert te.stage == 1 and te.activations == 3 * te_layer + 4 * s * 64


# ------------------------------------------------------------------------------------------------ FP8
def test_fp8_activations_of_a_small_moe_by_hand() -> None:
    # As test_activations_of_a_small_moe_by_hand (tp 2: s_r 128, s_h 64, a_r 4, g_r 1, h 64, d 16, E 8, k 2,
    # f_e 24), with TE's FP8 GEMMs: the GEMM inputs saved for backward take q bytes instead of 2.
    layout = Layout(tp=2, ep=2, etp=1, dp=1)
    # hybrid and e4m3 scale per tensor: q = 1
    attention = (
        2 * 64 * 64  # input-norm input, bf16
        + 1 * 64 * 64  # QKV-linear input: TE's fused norm writes it in FP8
        + 6 * 128 * 16 * (4 + 1)  # fused QKV output, normed and rotated q and k, O: bf16 as before
        + 1 * 128 * 16 * 4  # the output projection's FP8 copy of O (flash attention keeps the bf16 O)
    )
    moe = (
        4 * 64 * 64  # pre-MLP norm input and router input, bf16
        + 4 * 64 * 8  # fp32 router probs
        + (1 + 2) * 2 * 64 * 1 * 64  # permuted expert inputs in FP8, expert outputs bf16 (the combine)
        + (4 + 1) * 2 * 64 * 24  # SwiGLU input bf16 (2·f_e wide), SwiGLU output = fc2 input in FP8
    )
    assert (attention, moe) == (81_920, 58_368)
    for mode in ("hybrid", "e4m3"):
        work = Workload(seq_len=128, fp8=mode)
        assert layer_activation_bytes(SMALL, layout, work, moe=True) == attention + moe
    # blockwise: 1x128 blocks, one fp32 scale per 128 elements: q = 1 + 4/128 = 33/32 B
    assert gemm_input_bytes("blockwise") == 1 + 4 / 128 and gemm_input_bytes(None) == 2
    block_attention = 2 * 64 * 64 + 64 * 64 * 33 // 32 + 6 * 128 * 16 * (4 + 1) + 128 * 16 * 4 * 33 // 32
    block_moe = 4 * 64 * 64 + 4 * 64 * 8 + 2 * 2 * 64 * 64 + 2 * 64 * 64 * 33 // 32
    block_moe += 4 * 2 * 64 * 24 + 2 * 64 * 24 * 33 // 32
    assert (block_attention, block_moe) == (82_304, 58_720)
    blockwise = Workload(seq_len=128, fp8="blockwise")
    assert layer_activation_bytes(SMALL, layout, blockwise, moe=True) == block_attention + block_moe
    # full recompute: the 6 layer inputs stay bf16 (2·s_h·h), and the layer being recomputed is an FP8 one
    full = Workload(seq_len=128, recompute="full", fp8="hybrid")
    mem = memory(SMALL, layout, full, NO_ROLLOUT, Cluster(gpus=2))
    assert mem.activations == 6 * 2 * 64 * 64 + (attention + moe) + 4 * 64 * 64  # + final-norm/output inputs
    assert mem.logits == 128 * 1024 // 2 * 4  # the loss is untouched


def test_fp8_weight_copies_of_30b_a3b_by_hand() -> None:
    # tp 1, pp 1, ep 8 as in test_30b_a3b_ep8_on_8_gpus_weights_grads_optimizer_by_hand. TE quantizes
    # q/k/v/o and the experts (not the embedding, output layer, router or norms) and keeps each FP8 weight
    # and its transpose (Hopper's dgrad GEMM): 2 bytes per such parameter, on top of the bf16 weights.
    attention = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048
    experts = 16 * 3 * 2048 * 768  # 128 / ep 8 experts per layer
    quantized = 48 * (attention + experts)
    assert quantized == 4_529_848_320
    layout, cluster = Layout(tp=1, pp=1, ep=8, dp=8), Cluster(gpus=8)
    bf16 = memory(A30, layout, Workload(seq_len=4096), NO_ROLLOUT, cluster)
    for mode in ("hybrid", "e4m3", "blockwise"):  # all three cache row-wise + column-wise copies
        fp8 = memory(A30, layout, Workload(seq_len=4096, fp8=mode), NO_ROLLOUT, cluster)
        assert fp8.weights == 10_329_944_064 + 2 * quantized  # bf16 primary weights + FP8 copies
        assert fp8.fp8_weight_cache == 2 * quantized and bf16.fp8_weight_cache == 0
        assert (fp8.grads, fp8.optimizer) == (bf16.grads, bf16.optimizer)  # parameters stay bf16


def test_fp8_lowers_activations_and_raises_weights_by_the_documented_amounts() -> None:
    # 30B-A3B, tp 2, cp 2, ep 4, etp 1, dp 4 on 16 GPUs, 8192-token packs: s_r = 4096, s_h = 2048, a_r = 16;
    # one stage of 48 MoE layers, one micro-batch in flight.
    layout, cluster = Layout(tp=2, cp=2, ep=4, etp=1, dp=4), Cluster(gpus=16)
    bf16 = memory(A30, layout, Workload(seq_len=8192), NO_ROLLOUT, cluster)
    # weights: + 2 B · P_lin, P_lin = q/k/v/o over tp 2 and 128 / ep 4 = 32 experts a layer
    p_lin = 48 * (2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048) // 2 + 48 * 32 * 3 * 2048 * 768
    # activations, per layer: (2 - q)·(s_h·h QKV input + k·s_h·etp·h expert input + k·s_h·f_e SwiGLU output)
    # saved, q·s_r·d·a_r added (the FP8 copy of O)
    gemm_inputs = 2048 * 2048 + 8 * 2048 * 1 * 2048 + 8 * 2048 * 768
    o_copy = 4096 * 128 * 16
    for mode, q in (("hybrid", 1), ("e4m3", 1), ("blockwise", 1 + 4 / 128)):
        fp8 = memory(A30, layout, Workload(seq_len=8192, fp8=mode), NO_ROLLOUT, cluster)
        assert fp8.weights - bf16.weights == 2 * p_lin == 15_401_484_288
        assert bf16.activations - fp8.activations == 48 * ((2 - q) * gemm_inputs - q * o_copy)
        assert fp8.activations < bf16.activations and fp8.weights > bf16.weights
        assert (fp8.grads, fp8.optimizer, fp8.logits) == (bf16.grads, bf16.optimizer, bf16.logits)
    hybrid = memory(A30, layout, Workload(seq_len=8192, fp8="hybrid"), NO_ROLLOUT, cluster)
    assert bf16.activations - hybrid.activations == 48 * 41_943_040  # 1.9 GiB less, for 14.3 GiB more weights


def test_fp8_engines_hold_linear_weights_in_one_byte() -> None:
    # vLLM's quantization="fp8": q/k/v/o and the experts at 1 B, the embedding, lm_head, router gate and norms
    # (635,123,712 parameters of 30B-A3B) stay bf16; the KV cache is unchanged.
    linear = 48 * (2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048 + 128 * 3 * 2048 * 768)
    assert linear == 29_896_998_912 and 30_532_122_624 - linear == 635_123_712
    bf16 = Rollout(tp=2, max_seqs=16, seq_len=32768)
    weights, kv = rollout_bytes(A30, replace(bf16, fp8=True))
    assert weights == (1 * linear + 2 * 635_123_712) // 2 == 15_583_623_168  # bf16: 2 * 30.5e9 / 2
    assert weights < rollout_bytes(A30, bf16)[0] and kv == rollout_bytes(A30, bf16)[1]
    # colocated, the engine term of the rollout phase shrinks by the same amount
    layout, cluster = Layout(ep=16, etp=1, dp=16), Cluster(gpus=16)
    fp8 = memory(A30, layout, Workload(seq_len=4096, fp8="hybrid"), replace(bf16, fp8=True), cluster)
    assert fp8.rollout_weights == weights and fp8.kv_cache == kv


def test_distributed_optimizer_gives_megatrons_6_plus_12_over_d_bytes_per_param() -> None:
    # Megatron-Core's distributed-optimizer table: bf16 params + fp32 grads = 6 + 12/d bytes per parameter.
    dense = PRESETS["qwen3-8b"]  # 151936-entry vocabulary: no padding
    params = param_counts(dense).total
    for dp in (1, 2, 8):
        mem = memory(dense, Layout(dp=dp), Workload(seq_len=4096), NO_ROLLOUT, Cluster(gpus=dp))
        assert (mem.weights + mem.grads + mem.optimizer) / params == pytest.approx(6 + 12 / dp, rel=1e-6)
    plain = Workload(seq_len=4096, distributed_optimizer=False)
    mem = memory(dense, Layout(dp=8), plain, NO_ROLLOUT, Cluster(gpus=8))
    assert (mem.weights + mem.grads + mem.optimizer) / params == pytest.approx(18, rel=1e-6)


def test_expert_optimizer_state_is_sharded_over_expert_data_parallel_ranks() -> None:
    work, cluster = Workload(seq_len=4096), Cluster(gpus=16)
    dense = 1_541_093_376  # as in the hand calculation above (tp 1, pp 1)
    one = memory(A30, Layout(ep=16, etp=1, dp=16), work, NO_ROLLOUT, cluster)  # 8 experts a layer, edp 1
    assert one.optimizer == 12 * dense // 16 + 12 * (48 * 8 * 3 * 2048 * 768) // 1
    two = memory(A30, Layout(ep=8, etp=1, dp=16), work, NO_ROLLOUT, cluster)  # 16 experts a layer, edp 2
    assert two.optimizer == 12 * dense // 16 + 12 * (48 * 16 * 3 * 2048 * 768) // 2


def test_recompute_ordering() -> None:
    layout, cluster = Layout(tp=2, pp=2, ep=4, etp=1, dp=2), Cluster(gpus=8)
    for impl in ("transformer_engine", "local"):
        acts = {
            r: memory(
                A30, layout, Workload(seq_len=8192, recompute=r, transformer_impl=impl), NO_ROLLOUT, cluster
            )
            for r in ("none", "selective", "full")
        }
        assert acts["full"].activations < acts["selective"].activations <= acts["none"].activations
        flash = impl == "transformer_engine"
        assert (acts["selective"].activations == acts["none"].activations) is flash  # flash stores no scores


def test_rollout_kv_cache_and_colocated_peak() -> None:
    # 30B-A3B engines of 2 GPUs: 2 of 4 KV heads per GPU; 16 sequences x 32768 tokens
    weights, kv = rollout_bytes(A30, Rollout(tp=2, max_seqs=16, seq_len=32768))
    assert weights == 2 * 30_532_122_624 // 2
    assert kv == (2 * 48 * 2 * 128 * 2) * 16 * 32768 == 24 * GIB
    _, kv8 = rollout_bytes(A30, Rollout(tp=8, max_seqs=16, seq_len=32768))
    assert kv8 == (2 * 48 * 1 * 128 * 2) * 16 * 32768  # tp 8 > 4 KV heads: vLLM replicates, one per GPU
    layout, work, cluster = Layout(ep=16, etp=1, dp=16), Workload(seq_len=4096), Cluster(gpus=16)
    mem = memory(A30, layout, work, Rollout(tp=2), cluster)
    static = mem.weights + mem.grads + mem.optimizer
    # engines sleep while the trainer steps; the trainer stays resident while engines roll out
    assert mem.total == mem.overhead + max(static + mem.activations + mem.logits, static + weights + kv)
    offload = memory(A30, layout, work, Rollout(tp=2, trainer_offload=True), cluster)
    assert offload.rollout == weights + kv
    apart = memory(A30, layout, work, NO_ROLLOUT, cluster)
    assert (apart.rollout_weights, apart.kv_cache, apart.total) == (0, 0, apart.overhead + apart.train)


def _ends(layers: int, pp: int) -> dict[str, int | None]:
    first, last = balanced_ends(layers, pp)
    return {"first_stage_layers": first, "last_stage_layers": last}


def test_pipeline_stages_split_like_megatron() -> None:
    assert balanced_ends(94, 8) == (11, 11)
    assert stage_layers(A235, Layout(pp=8, tp=4, ep=8, etp=1, dp=4, **_ends(94, 8))) == (11, *(12,) * 6, 11)
    assert stage_layers(A235, Layout(pp=16, **_ends(94, 16))) == (
        5,
        *(6,) * 14,
        5,
    )  # as account_for_embedding
    assert balanced_ends(48, 2) == (None, None)
    assert stage_layers(A30, Layout(pp=2)) == (24, 24)
    assert stage_layers(A235, Layout(pp=7, **_ends(94, 7))) == (12, *(14,) * 5, 12)
    assert stage_layers(A235, Layout(pp=4, first_stage_layers=22)) == (22, 24, 24, 24)
    assert sum(stage_layers(A235, Layout(pp=32, **_ends(94, 32)))) == 94
    # Megatron needs explicit first/last stage sizes when the layers do not divide: so does the planner,
    # and the layouts it enumerates carry them
    assert _plan_error(lambda: check_layout(A235, Layout(pp=8, dp=1), 8, 4096)).path == "pp"
    uneven = [lay for lay in enumerate_layouts(A235, 64, 4096) if 94 % lay.pp]
    assert uneven and all(lay.first_stage_layers is not None for lay in uneven)


# ------------------------------------------------------------------------------- published layouts
# Layouts NVIDIA publishes for these models, with their sequence length and recompute. Our assumptions are
# at least as heavy as theirs (fp32 main grads everywhere), so each must come out under 80 GiB. Training
# memory only (colocated=False): NeMo-RL offloads the policy while its vLLM engines generate.
PUBLISHED = [
    # Megatron-Bridge src/megatron/bridge/recipes/qwen/h100/qwen3_moe.py (commit 04eb4f8d):
    # qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config: TP4 PP2 EP4 ETP1, seq 4096, full recompute
    ("bridge-30b-pretrain-8gpu", A30, 8, Layout(tp=4, pp=2, ep=4, etp=1, dp=1), 4096, "full", 68.9),
    # qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config: TP1 PP1 EP16, seq 4096, "fits without recompute"
    ("bridge-30b-pretrain-16gpu", A30, 16, Layout(tp=1, ep=16, etp=1, dp=16), 4096, "none", 73.3),
    # qwen3_30b_a3b_sft_8gpu_h100_bf16_config: TP4 PP2 EP4 ETP1, seq 2048, no recompute
    ("bridge-30b-sft-8gpu", A30, 8, Layout(tp=4, pp=2, ep=4, etp=1, dp=1), 2048, "none", 71.4),
    # qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config: TP4 PP16 CP2 EP8 ETP1, seq 4096, no recompute;
    # its 94 layers split 5 + 14*6 + 5 (Bridge's account_for_embedding/loss; here explicit stage sizes)
    (
        "bridge-235b-pretrain-256gpu",
        A235,
        256,
        Layout(tp=4, pp=16, cp=2, ep=8, etp=1, dp=2, first_stage_layers=5, last_stage_layers=5),
        4096,
        "none",
        37.6,
    ),
    # qwen3_235b_a22b_sft_64gpu_h100_bf16_config: TP4 PP16 EP4 ETP1, seq 2048, no recompute
    (
        "bridge-235b-sft-64gpu",
        A235,
        64,
        Layout(tp=4, pp=16, ep=4, etp=1, dp=1, first_stage_layers=5, last_stage_layers=5),
        2048,
        "none",
        79.1,
    ),
    # NeMo-RL examples/configs/recipes/llm/performance/grpo-qwen3-30ba3b-4n8g.yaml (commit 0b88cccc):
    # 4 nodes x 8, TP1 PP1 EP8 (ETP 1: grpo_math_1B.yaml), max_total_sequence_length 4096, vLLM TP2
    ("nemo-rl-grpo-30b-4n8g", A30, 32, Layout(tp=1, ep=8, etp=1, dp=32), 4096, "none", 72.8),
    # .../grpo-qwen3-30ba3b-4n8g-40K.yaml (commit 850f69f2): TP4 CP8 EP8, 40960 tokens, activation ckpt.
    ("nemo-rl-grpo-30b-4n8g-40k", A30, 32, Layout(tp=4, cp=8, ep=8, etp=1, dp=1), 40960, "full", 38.3),
    # .../grpo-qwen3-235b-16n8g.yaml (commit 850f69f2): TP2 PP8 CP2 EP16, first/last stage 11 layers,
    # 8192 tokens, activation checkpointing, vLLM TP16
    (
        "nemo-rl-grpo-235b-16n8g",
        A235,
        128,
        Layout(tp=2, pp=8, cp=2, ep=16, etp=1, dp=4, first_stage_layers=11, last_stage_layers=11),
        8192,
        "full",
        39.3,
    ),
]


@pytest.mark.parametrize(("name", "arch", "gpus", "layout", "seq", "recompute", "gib"), PUBLISHED)
def test_published_layouts_fit_80_gib(
    name: str, arch: Qwen3Arch, gpus: int, layout: Layout, seq: int, recompute: str, gib: float
) -> None:
    work = Workload(seq_len=seq, recompute=recompute, global_batch=256)
    mem = memory(arch, layout, work, NO_ROLLOUT, Cluster(gpus=gpus))
    assert mem.total / GIB == pytest.approx(gib, abs=0.05)
    assert mem.total <= 80 * GIB
    result = plan(arch, Cluster(gpus=gpus), work, NO_ROLLOUT, layouts=[layout], recomputes=[recompute])
    assert len(result.fitting) == 1


def test_nemo_rl_engine_sizes_leave_room_for_kv_cache() -> None:
    # NeMo-RL gives vLLM 60 % of the GPU (gpu_memory_utilization 0.6): 30B-A3B on TP2, 235B-A22B on TP16.
    for arch, rtp in ((A30, 2), (A235, 16)):
        weights, _ = rollout_bytes(arch, Rollout(tp=rtp))
        assert weights < 0.6 * 80 * GIB
        check_rollout(arch, rtp, 128)


# ---------------------------------------------------------------------------------- planning and cost
def test_plan_ranks_fitting_candidates_by_cost() -> None:
    cluster = Cluster(gpus=16)
    result = plan(A30, cluster, Workload(seq_len=8192), Rollout(max_seqs=8, seq_len=8192))
    assert result.fitting and result.considered > len(result.fitting)
    costs = [c.seconds for c in result.fitting]
    assert costs == sorted(costs) and result.relative_cost(result.fitting[0]) == 1.0
    assert all(c.memory.total <= 80 * GIB for c in result.fitting)
    assert all(c.memory.total > 80 * GIB for c in result.not_fitting)
    assert {c.workload.recompute for c in result.fitting} <= {"none", "full"}  # flash: selective == none
    assert all(c.rollout.tp is not None for c in result.fitting)  # each got the smallest engine that fits


def test_enumerated_layouts_obey_megatron_rules() -> None:
    layouts = list(enumerate_layouts(A30, 16, 32768))
    assert Layout(tp=1, pp=1, ep=16, etp=1, dp=16) in layouts
    for lay in layouts:
        assert lay.world == 16 and 4 % lay.tp == 0 and 128 % lay.ep == 0
        assert (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.expert_tp) == 0


def test_cost_penalises_recompute_bubbles_and_network_all_to_all() -> None:
    cluster, model = Cluster(gpus=16), CostModel()
    lay = Layout(tp=1, pp=2, ep=8, etp=1, dp=8)
    seconds = {
        r: step_seconds(A30, lay, Workload(seq_len=4096, recompute=r), cluster, model)
        for r in ("none", "full")
    }
    assert seconds["full"] > seconds["none"]
    few, many = (
        step_seconds(A30, lay, Workload(seq_len=4096, global_batch=g), cluster, model) for g in (8, 256)
    )
    assert few / 8 > many / 256  # fewer micro-batches per pipeline: a larger share of bubble
    inside = step_seconds(A30, Layout(ep=8, etp=1, dp=16), Workload(seq_len=4096), cluster, model)
    across = step_seconds(A30, Layout(ep=16, etp=1, dp=16), Workload(seq_len=4096), cluster, model)
    assert across > inside


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("arch", "layout", "gpus", "field"),
    [
        (A30, Layout(tp=3, dp=2), 6, "tp"),  # 3 does not divide 32 heads
        (A30, Layout(tp=8, ep=8, etp=1), 8, "tp"),  # 8 > 4 KV heads: Megatron splits KV groups over tp
        (A30, Layout(ep=3, etp=1, dp=6), 6, "ep"),  # 3 does not divide 128 experts
        (A30, Layout(ep=16, etp=1, dp=8), 8, "ep"),  # 16 experts-ranks from 8 ranks per stage
        (A30, Layout(tp=2, ep=1, etp=1, dp=4), 8, "etp"),  # ep 1 needs etp == tp
        (A30, Layout(tp=2, dp=2), 8, "gpus"),  # 4 != 8
        (A30, Layout(pp=49), 49, "pp"),  # more stages than layers
        (A30, Layout(pp=4, first_stage_layers=10, last_stage_layers=9), 4, "first_stage_layers"),  # 29 / 2
        (A30, Layout(pp=1, first_stage_layers=10), 1, "first_stage_layers"),
    ],
)
def test_bad_layouts_name_the_field(arch: Qwen3Arch, layout: Layout, gpus: int, field: str) -> None:
    err = _plan_error(lambda: check_layout(arch, layout, gpus, 4096))
    assert err.path == field
    assert str(err).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Cluster(gpus=12, gpus_per_node=8), "gpus"),
        (lambda: Cluster(gpus=0), "gpus"),
        (lambda: Layout(tp=0), "tp"),
        (lambda: Workload(recompute="some"), "recompute"),  # type: ignore[arg-type]
        (lambda: check_layout(A30, Layout(tp=2, cp=4, ep=8, etp=1), 8, 4100), "seq_len"),
        (lambda: check_rollout(A30, 3, 12), "rollout_tp"),
        (lambda: check_rollout(A30, 16, 8), "rollout_tp"),
        (lambda: resolve_model("qwen3-999b"), "model"),
        (lambda: plan_command.parse_layout("tp=3", 16), "gpus"),
        (lambda: plan_command.parse_layout("tp=2,dp=3", 16), "dp"),
        (lambda: plan_command.parse_layout("tp=two", 16), "tp"),
        (lambda: plan_command.parse_layout("tensor=2", 16), "layout"),
        (lambda: Workload(fp8="fp16"), "fp8"),  # type: ignore[arg-type]
        (lambda: Workload(transformer_impl="te"), "transformer_impl"),  # type: ignore[arg-type]
        (lambda: Workload(transformer_impl="local", fp8="hybrid"), "fp8"),  # FP8 needs Transformer Engine
        (lambda: local_attention_bytes(SMALL, Layout(), Workload(), "int8"), "dtype"),
        # FP8 GEMMs need 16-token shards: 4112 / (cp 4 * tp 2) = 514
        (lambda: check_layout(A30, Layout(tp=2, cp=4, ep=8, etp=1), 8, 4112, fp8=True), "seq_len"),
    ],
)
def test_bad_inputs_name_the_field(make: Callable[[], object], field: str) -> None:
    err = _plan_error(make)
    assert err.path == field, str(err)


def test_unknown_model_error_lists_the_presets() -> None:
    with pytest.raises(PlanError, match="qwen3-235b-a22b, qwen3-30b-a3b"):
        plan_command.run(_parser().parse_args(["--model", "llama-70b", "--gpus", "8"]))


# ------------------------------------------------------------------------------------------ CLI and HF
def test_hf_dir_model_plans_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mars_megatron.models.presets import init_model

    hf = init_model("tiny-moe", tmp_path / "hf")
    assert resolve_model(str(hf)) == load_hf_config(hf)
    argv = [
        "--model",
        str(hf),
        "--gpus",
        "2",
        "--seq-len",
        "512",
        "--gpu-mem-gib",
        "1",
        "--overhead-gib",
        "0.5",
    ]
    args = _parser().parse_args(argv)
    assert plan_command.run(args) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in out and "fits in 1 GiB:" in out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    assert header.split()[:10] == ["rank", "tp", "pp", "cp", "ep", "etp", "dp", "edp", "recompute", "rtp"]
    assert any(line.split()[0] == "1" for line in out.splitlines() if line.strip())


def test_cli_one_layout_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--seq-len", "4096", "--no-colocated"]
    args = _parser().parse_args([*argv, "--layout", "tp=4,pp=2,ep=4,etp=1", "--recompute", "full", "--json"])
    assert plan_command.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    (only,) = data["fitting"]
    assert only["layout"] == {
        "tp": 4,
        "pp": 2,
        "cp": 1,
        "ep": 4,
        "etp": 1,
        "dp": 1,
        "first_stage_layers": None,
        "last_stage_layers": None,
        "edp": 1,
    }
    assert only["gib"]["total"] == pytest.approx(68.88, abs=0.01) and only["fits"]
    for layout, field in (("tp=3,pp=2", "gpus"), ("tp=4,ep=3,etp=1", "ep")):
        args = _parser().parse_args([*argv, "--layout", layout])
        assert _plan_error(lambda args=args: plan_command.run(args)).path == field


def test_cli_fp8_reaches_the_trainer_and_the_engines(capsys: pytest.CaptureFixture[str]) -> None:
    # the layout of test_fp8_lowers_activations_and_raises_weights_by_the_documented_amounts, with engines
    argv = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--seq-len", "8192", "--rollout-tp", "2"]
    argv += ["--layout", "tp=2,cp=2,ep=4,etp=1", "--recompute", "none"]
    gib = {}
    for fp8 in (None, "hybrid"):
        assert (
            plan_command.run(_parser().parse_args([*argv, "--json", *(["--fp8", fp8] if fp8 else [])])) == 0
        )
        data = json.loads(capsys.readouterr().out)
        assert (data["workload"]["fp8"], data["rollout"]["fp8"]) == (fp8, fp8 is not None)
        (only,) = data["fitting"] + data["not_fitting"]
        gib[fp8] = only["gib"]
    assert gib["hybrid"]["weights"] - gib[None]["weights"] == pytest.approx(15_401_484_288 / GIB, abs=2e-3)
    assert gib[None]["activations"] - gib["hybrid"]["activations"] == pytest.approx(1.875, abs=2e-3)
    engine = (30_532_122_624 * 2 - 15_583_623_168 * 2) / 2 / GIB  # FP8 engines of tp 2: linear layers at 1 B
    assert gib[None]["rollout_weights"] - gib["hybrid"]["rollout_weights"] == pytest.approx(engine, abs=2e-3)
    assert plan_command.run(_parser().parse_args([*argv, "--fp8", "e4m3"])) == 0
    out = capsys.readouterr().out
    assert "global batch 64, FP8 e4m3 GEMMs" in out and "rollout: colocated FP8 vLLM engines" in out


def test_cli_local_layer_spec(capsys: pytest.CaptureFixture[str]) -> None:
    """``--transformer-impl local`` (the trainer's ``model.transformer_impl``) and its alias
    ``--no-flash-attention`` plan Megatron-Core's local layer spec; ``auto`` plans what it means on a GPU,
    Transformer Engine's."""
    argv = ["--model", "qwen3-8b", "--gpus", "8", "--seq-len", "4096", "--no-colocated", "--layout", "tp=2"]
    argv += ["--recompute", "none"]

    def planned(*extra: str) -> tuple[dict, dict]:
        assert plan_command.run(_parser().parse_args([*argv, *extra, "--json"])) == 0
        data = json.loads(capsys.readouterr().out)
        (only,) = data["fitting"] + data["not_fitting"]
        return data["workload"], only["gib"]

    (work, local), alias = planned("--transformer-impl", "local"), planned("--no-flash-attention")
    (te_work, te), auto = planned(), planned("--transformer-impl", "auto")
    assert (work["transformer_impl"], te_work["transformer_impl"]) == ("local", "transformer_engine")
    assert alias == (work, local) and auto == (te_work, te)
    layout, arch = Layout(tp=2, dp=4), PRESETS["qwen3-8b"]
    expect = memory(
        arch, layout, Workload(seq_len=4096, transformer_impl="local"), NO_ROLLOUT, Cluster(gpus=8)
    )
    assert local["activations"] == pytest.approx(expect.activations / GIB, abs=1e-3)
    assert local["activations"] > te["activations"] and local["weights"] == te["weights"]
    assert plan_command.run(_parser().parse_args([*argv, "--no-flash-attention"])) == 0
    assert "Megatron-Core's local layer spec" in capsys.readouterr().out
    both = _parser().parse_args([*argv, "--no-flash-attention", "--transformer-impl", "transformer_engine"])
    assert _plan_error(lambda: plan_command.run(both)).path == "--no-flash-attention"


# ----------------------------------------------------------------------------- a config's own layout
REPO = HF_CONFIGS.parents[1]
# (recipe, GPUs, full-length sequences of KV cache per engine, trainer GiB, engine GiB, trainer layout
# (tp, pp, cp, ep, etp), recompute): the figures in each recipe's header comment, and its `mars plan
# --config` command.
RECIPES = [
    ("qwen3_30b_a3b.yaml", 64, 16, 66.3, 54.2, (4, 2, 4, 8, 1), "none"),
    ("qwen3_235b_a22b.yaml", 256, 4, 53.1, 76.4, (2, 8, 8, 8, 1), "full"),
]


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the recipes' model.hf_dir is relative to the working directory


@pytest.mark.parametrize(
    ("recipe", "gpus", "seqs", "trainer_gib", "engine_gib", "layout", "recompute"), RECIPES
)
def test_shipped_recipes_fit_80_gib_gpus(
    in_repo: None,
    recipe: str,
    gpus: int,
    seqs: int,
    trainer_gib: float,
    engine_gib: float,
    layout: tuple[int, ...],
    recompute: str,
) -> None:
    cfg = load_config(REPO / "examples" / recipe)
    fit = check_config(cfg, Cluster(gpus=gpus, gpus_per_node=8, gpu_mem_gib=80), max_seqs=seqs)
    assert fit.arch == load_hf_config(cfg.model.hf_dir)
    assert fit.trainer_world == gpus // 2 and fit.engines * cfg.rollout.tp == gpus // 2
    assert fit.trainer.total / GIB == pytest.approx(trainer_gib, abs=0.05)
    assert fit.engine_total / GIB == pytest.approx(engine_gib, abs=0.05)
    assert fit.trainer_fits and fit.engine_fits and fit.fits
    assert fit.notes == ("cp spans nodes",)  # tp*cp ranks per stage exceed a node: ring attention over IB
    got = fit.layout  # the config's own layout
    assert (got.tp, got.pp, got.cp, got.ep, got.expert_tp) == layout
    assert (fit.workload.seq_len, fit.workload.recompute) == (98304, recompute)
    assert (fit.rollout.colocated, fit.rollout.seq_len) == (False, 98304)


def test_recipe_fit_by_hand() -> None:
    """The 30B recipe: each engine GPU holds a quarter of the bf16 weights and 24 KiB of KV cache per token;
    the trainer's figure is the planner's for its layout on 32 ranks."""
    cfg = load_config(REPO / "examples" / "qwen3_30b_a3b.yaml")
    fit = check_config(cfg, Cluster(gpus=64), model="qwen3-30b-a3b", max_seqs=16)
    assert fit.engine_weights == 2 * 30_532_122_624 // 4
    assert fit.engine_kv == 2 * 48 * 1 * 128 * 2 * 16 * 98304  # K and V, layers, KV heads per GPU, d, bf16
    layout = Layout(tp=4, pp=2, cp=4, ep=8, etp=1, dp=1)
    alone = memory(
        A30, layout, Workload(seq_len=98304, recompute="none", global_batch=8), NO_ROLLOUT, Cluster(32)
    )
    assert fit.trainer == alone
    # per-role policies: three models' state on every rank; a KL reference adds bf16 weights per policy
    # (on 40 trainer ranks: a layout without pipeline and context parallelism)
    overrides = ["algorithm.policies=per_role", "algorithm.kl_coef=0.01", "pipeline.rollout_workers=2",
                 "parallel.pp=1", "parallel.cp=1", "train.recompute=full"]  # fmt: skip
    cfg = load_config(REPO / "examples" / "qwen3_30b_a3b.yaml", overrides)
    per_role = check_config(cfg, Cluster(gpus=64), model="qwen3-30b-a3b")
    assert per_role.engines == 6 and per_role.trainer_world == 64 - 24
    work = Workload(seq_len=98304, recompute="full", global_batch=10)
    one = memory(A30, Layout(tp=4, ep=8, etp=1, dp=10), work, NO_ROLLOUT, Cluster(40))
    assert per_role.trainer.weights == 6 * one.weights and per_role.trainer.grads == 3 * one.grads
    assert per_role.trainer.optimizer == 3 * one.optimizer and per_role.trainer.activations == one.activations


def test_config_fp8_reaches_the_trainer_and_the_engines(
    in_repo: None, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe, cluster = REPO / "examples" / "qwen3_30b_a3b.yaml", Cluster(gpus=64)
    bf16 = check_config(load_config(recipe), cluster, max_seqs=16)
    fp8 = check_config(load_config(recipe, ["model.fp8=hybrid"]), cluster, max_seqs=16)
    assert (fp8.workload.fp8, fp8.rollout.fp8, bf16.rollout.fp8) == ("hybrid", True, False)
    assert fp8.notes == bf16.notes == ("cp spans nodes",)  # no "not modelled" note any more
    # engines of tp 4: linear layers at 1 B, embedding, lm_head, routers and norms at 2 B
    assert fp8.engine_weights == (29_896_998_912 + 2 * 635_123_712) // 4
    # trainer (tp 4, pp 2, cp 4, ep 8: 24 layers a stage): FP8 copies of q/k/v/o over tp and of 16 experts
    cache = 2 * (
        24 * (2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048) // 4 + 24 * 16 * 3 * 2048 * 768
    )
    assert fp8.trainer.stage == bf16.trainer.stage == 0
    assert fp8.trainer.weights == bf16.trainer.weights + cache and fp8.trainer.fp8_weight_cache == cache
    assert fp8.trainer.activations < bf16.trainer.activations and fp8.trainer.total < bf16.trainer.total
    # a KL reference: bf16 weights of its own and, forward only without grad, only the row-wise FP8 copies
    kl = check_config(
        load_config(recipe, ["model.fp8=hybrid", "algorithm.kl_coef=0.01"]), cluster, max_seqs=16
    )
    assert kl.trainer.weights == 2 * bf16.trainer.weights + cache + cache // 2
    # the CLI takes FP8 from the config (model.fp8), not from --fp8
    argv = ["--config", "examples/qwen3_30b_a3b.yaml", "--gpus", "64", "--rollout-seqs", "16"]
    err = _plan_error(lambda: plan_command.run(_parser().parse_args([*argv, "--fp8", "hybrid"])))
    assert err.path == "--fp8" and "model.fp8" in err.message
    assert plan_command.run(_parser().parse_args([*argv, "model.fp8=blockwise"])) == 0
    out = capsys.readouterr().out
    assert "recompute none, FP8 blockwise" in out and "engine: FP8 vLLM tp 4 on GPUs of its own" in out


def test_config_transformer_impl_reaches_the_trainer_plan(in_repo: None) -> None:
    """``model.transformer_impl=local`` is planned with the local spec's activations (scores kept, fp32
    norm copies); ``auto`` is Transformer Engine's, as on a GPU."""
    recipe, cluster = REPO / "examples" / "qwen3_30b_a3b.yaml", Cluster(gpus=64)
    auto = check_config(load_config(recipe), cluster, max_seqs=16)
    local = check_config(load_config(recipe, ["model.transformer_impl=local"]), cluster, max_seqs=16)
    impls = (auto.workload.transformer_impl, local.workload.transformer_impl)
    assert impls == ("transformer_engine", "local")
    assert local.trainer.activations > auto.trainer.activations
    assert local.trainer.weights == auto.trainer.weights


NO_CP = ["parallel.pp=1", "parallel.cp=1"]  # a recipe layout that fits any trainer world of 8k ranks


@pytest.mark.parametrize(
    ("gpus", "overrides", "field", "message"),
    [
        (
            64,
            ["pipeline.rollout_workers=7"],
            "parallel",
            "36 trainer ranks (64 GPUs - 28 engine GPUs): world size 36 is not divisible by tp*cp*pp = 4*4*2",
        ),
        (
            32,
            [],
            "pipeline.rollout_workers",
            "8 rollout engines x rollout.tp 4 = 32 GPUs leave no trainer rank",
        ),
        (64, ["rollout.tp=3", *NO_CP], "rollout.tp", "3 must divide the attention heads (32)"),
        (
            64,
            ["parallel.tp=8", *NO_CP],
            "parallel.tp",
            "8 must divide num_key_value_heads (4): Megatron splits the KV groups",
        ),
        (
            64,
            ["pipeline.placement=colocated", "rollout.tp=1", "pipeline.rollout_workers=65"],
            "pipeline.rollout_workers",
            "65 colocated engines x rollout.tp 1 = 65 GPUs, more than the 64 trainer GPUs they share",
        ),
        (64, ["model.hf_dir=/no/such/model"], "model.hf_dir", "is neither a preset"),
    ],
)
def test_a_config_that_cannot_run_names_the_field(
    in_repo: None, gpus: int, overrides: list[str], field: str, message: str
) -> None:
    cfg = load_config(REPO / "examples" / "qwen3_30b_a3b.yaml", overrides)
    with pytest.raises(ConfigError) as err:
        check_config(cfg, Cluster(gpus=gpus))
    assert err.value.path == field and message in err.value.message, str(err.value)


def test_engines_must_fit_one_node_and_placement_none_is_noted() -> None:
    cfg = load_config(
        REPO / "examples" / "qwen3_235b_a22b.yaml", ["rollout.tp=16", "pipeline.rollout_workers=8"]
    )
    fit = check_config(cfg, Cluster(gpus=256), model="qwen3-235b-a22b", max_seqs=4)
    assert fit.engine_total < 80 * GIB and not fit.engine_fits and not fit.fits  # memory fits, the node not
    assert (
        "rollout.tp 16 > 8 GPUs per node: an engine's tensor-parallel workers would talk across nodes"
        in fit.notes
    )
    cfg = load_config(REPO / "examples" / "qwen3_30b_a3b.yaml", ["pipeline.placement=none"])
    fit = check_config(cfg, Cluster(gpus=64), model="qwen3-30b-a3b")
    assert fit.trainer_world == 32 and fit.fits  # the vLLM engines take 32 GPUs of their own
    assert any(n.startswith("placement none: Ray places the 8 engines") for n in fit.notes)


def test_trainer_world_size_and_engine_gpus() -> None:
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.tp=2", "pipeline.rollout_workers=3"])
    # placement none: the vLLM engines hold GPUs of their own (Ray picks which); transformers engines none
    assert (rollout_engines(cfg), engine_gpus(cfg), trainer_world_size(cfg, 10)) == (3, 6, 4)
    with pytest.raises(
        ConfigError, match=r"= 6 GPUs leave no trainer rank of 6 GPUs \(pipeline.placement=none"
    ):
        trainer_world_size(cfg, 6)
    hf = load_config(None, ["pipeline.rollout_workers=3"])
    assert trainer_world_size(hf, 4) == 4
    disaggregated = load_config(None, ["pipeline.placement=disaggregated", "algorithm.policies=per_role",
                                       "rollout.engine=vllm", "rollout.tp=2"])  # fmt: skip
    assert (engine_gpus(disaggregated), trainer_world_size(disaggregated, 10)) == (6, 4)
    with pytest.raises(
        ConfigError, match=r"pipeline.rollout_workers: 3 rollout engines x rollout.tp 2 = 6 GPUs"
    ):
        trainer_world_size(disaggregated, 6)
    colocated = load_config(None, ["pipeline.placement=colocated", "parallel.tp=2"])
    assert trainer_world_size(colocated, 8) == 8
    wide = load_config(None, ["pipeline.placement=colocated", "rollout.engine=vllm", "rollout.tp=4",
                              "pipeline.rollout_workers=3"])  # fmt: skip
    assert trainer_world_size(wide, 12) == 12
    with pytest.raises(ConfigError, match=r"3 colocated engines x rollout.tp 4 = 12 GPUs, more than the 8"):
        trainer_world_size(wide, 8)
    with pytest.raises(
        ConfigError, match=r"^parallel: 7 trainer ranks: world size 7 is not divisible by tp\*cp\*pp"
    ):
        trainer_world_size(colocated, 7)


def test_cli_checks_a_config(in_repo: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "examples/qwen3_30b_a3b.yaml", "--gpus", "64", "--rollout-seqs", "16"]
    assert plan_command.run(_parser().parse_args(argv)) == 0
    out = capsys.readouterr().out
    assert "placement disaggregated: 32 trainer ranks; 8 rollout engines x rollout.tp 4 = 32 GPUs" in out
    assert "  total 66.3 of 80 GiB: fits" in out and "  total 54.2 of 80 GiB: fits" in out
    assert out.rstrip().endswith("\nfits")
    # an override that no longer fits: exit code 1, and which side does not
    assert plan_command.run(_parser().parse_args([*argv, "parallel.cp=1", "--json"])) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["trainer_fits"], data["engine_fits"], data["fits"]) == (False, True, False)
    assert data["layout"]["dp"] == 4 and data["trainer_gib"]["total"] > 80
    with pytest.raises(PlanError) as err:  # the layout and the workload come from the config
        plan_command.run(_parser().parse_args([*argv, "--seq-len", "4096"]))
    assert err.value.path == "--seq-len" and "train.pack_length" in err.value.message
    with pytest.raises(PlanError, match="overrides need --config"):
        plan_command.run(_parser().parse_args(["--model", "qwen3-30b-a3b", "--gpus", "8", "train.steps=2"]))
    with pytest.raises(PlanError, match=r"give --model PRESET\|DIR, or --config FILE"):
        plan_command.run(_parser().parse_args(["--gpus", "8"]))


@pytest.mark.parametrize("arch", [A30, A235], ids=["30b", "235b"])
def test_planner_and_trainer_accept_the_same_layouts(arch: Qwen3Arch) -> None:
    """One layout check (models/layout.py) behind the planner, the launcher's config fit and the model
    provider: over a grid of layouts (uneven stages, bad stage sizes, tp/ep/etp that do not divide), the
    planner accepts exactly what the trainer's check accepts, where the planner's own extra rules (world
    size, ranks per stage for ep*etp, sequence length) are met."""
    seen = {True: 0, False: 0}
    for tp in (1, 2, 3, 4, 8):
        for pp in (1, 2, 3, 4, 8, 16, 94, 95):
            for ends in ((None, None), balanced_ends(arch.num_layers, pp), (1, None), (None, 50), (10, 9)):
                for ep, etp in ((1, tp), (2, 1), (3, 1), (8, tp), (8, 1), (16, 1)):
                    first, last = ends
                    if pp == 1 and ends != (None, None):
                        continue  # ParallelConfig refuses stage sizes without pipeline parallelism
                    layout = Layout(
                        tp=tp,
                        pp=pp,
                        ep=ep,
                        etp=etp,
                        dp=ep * 16,
                        first_stage_layers=first,
                        last_stage_layers=last,
                    )
                    parallel = ParallelConfig(
                        tp=tp, pp=pp, ep=ep, etp=etp, first_stage_layers=first, last_stage_layers=last
                    )
                    try:
                        check_parallel(arch, parallel, 128)
                        trainer = True
                    except LayoutError:
                        trainer = False
                    try:
                        check_layout(arch, layout, layout.world, 4096 * tp)
                        planner = True
                    except PlanError:
                        planner = False
                    assert planner == trainer, (layout, planner, trainer)
                    seen[trainer] += 1
    assert seen[True] > 20 and seen[False] > 20
