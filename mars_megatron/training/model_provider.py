"""Build Megatron-Core GPT models that compute the same function as an HF Qwen3 / Qwen3-MoE checkpoint.

Two layer specs: the *local* spec (pure torch, runs on CPU, used by tests and small runs) and the
Transformer Engine spec (fused kernels, THD packing, FP8) on GPUs. The local spec needs one change: its
torch RMSNorm refuses sequence parallelism, which MoE with TP requires, so our own RMSNorm (which also
normalises in fp32, exactly as HF Qwen3 does) is swapped into the spec tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mars_megatron.config import ParallelConfig
from mars_megatron.dtypes import torch_dtype
from mars_megatron.models.hf_config import Qwen3Arch
from mars_megatron.models.layout import check_parallel
from mars_megatron.training import cpu_compat


class RMSNorm(torch.nn.Module):
    """RMSNorm with HF Qwen3 numerics (fp32 statistics) that declares sequence-parallel params.

    Marking the weight ``sequence_parallel`` makes ``finalize_model_grads`` all-reduce its gradient over
    TP when activations are sequence-sharded, which megatron's own torch norm does not support.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def resolve_impl(
    transformer_impl: str, *, cuda: bool | None = None, te: bool | None = None
) -> Literal["local", "transformer_engine"]:
    """The layer spec ``model.transformer_impl`` means on this machine (``cuda``/``te``: whether it has a
    CUDA device and Transformer Engine; None = look). ``auto``: Transformer Engine on GPUs, local on CPU.

    On a GPU without Transformer Engine ``auto`` refuses rather than fall back to the local spec: that spec
    builds a ``T x T`` attention mask per pack (98k-token packs: tens of GiB), so a silent fallback would
    only show as an out-of-memory error in the first step. ``local`` asks for it explicitly."""
    if transformer_impl not in ("auto", "local", "transformer_engine"):
        raise ValueError(
            "model.transformer_impl must be 'auto', 'local' or 'transformer_engine', "
            f"got {transformer_impl!r}"
        )
    if transformer_impl == "local":
        return "local"
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        if transformer_impl == "transformer_engine":
            raise RuntimeError(
                "model.transformer_impl=transformer_engine needs a CUDA GPU; this machine has none "
                "(use model.transformer_impl=local or auto)"
            )
        return "local"
    te = _has_transformer_engine() if te is None else te
    if not te:
        raise RuntimeError(
            f"model.transformer_impl={transformer_impl} on a GPU needs Transformer Engine, which is not "
            "installed (scripts/setup_gpu.sh builds it; the container of docker/Dockerfile has it). The "
            "local spec would attend through a T x T mask per pack, out of memory at production pack "
            "lengths: set model.transformer_impl=local only for short packs"
        )
    return "transformer_engine"


def _has_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(
    arch: Qwen3Arch,
    parallel: ParallelConfig,
    *,
    dtype: str,
    impl: str,
    fp8: str | None = None,
    recompute: str = "none",
) -> Any:
    """The megatron ``TransformerConfig`` equivalent to ``arch`` in layout ``parallel``."""
    from megatron.core.transformer import TransformerConfig

    params_dtype = torch_dtype(dtype)
    gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.effective_etp,
        sequence_parallel=parallel.effective_sequence_parallel,
        # Weights come from a checkpoint or from ``weights.init_weights``, never from megatron's per-rank
        # initialisers, which depend on the layout.
        perform_initialization=False,
        use_cpu_initialization=not gpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # HF renormalises the top-k softmax probabilities when norm_topk_prob is set, which equals a
            # softmax over the top-k logits (megatron's post-softmax routing). Without it HF keeps the
            # full-softmax probabilities of the chosen experts: megatron's pre-softmax routing.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_layer_freq=[1 if m else 0 for m in arch.moe_layers],
            moe_router_load_balancing_type="aux_loss" if arch.router_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=arch.router_aux_loss_coef,
            moe_token_dispatcher_type=parallel.moe_token_dispatcher,
            moe_grouped_gemm=impl == "transformer_engine",
            moe_router_dtype="fp32" if dtype != "float32" else None,
        )
    if recompute != "none":
        cpu_compat.enable_recompute()
    if recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    elif recompute != "none":
        raise ValueError(f"train.recompute: expected 'none', 'selective' or 'full', got {recompute!r}")
    if fp8 is not None:
        if impl != "transformer_engine":
            raise ValueError("model.fp8 needs model.transformer_impl=transformer_engine on a GPU")
        from mars_megatron.training.fp8 import megatron_fp8_kwargs

        kwargs.update(megatron_fp8_kwargs(fp8, moe=arch.is_moe))
    return TransformerConfig(**kwargs)


def _swap_module(spec: Any, old: type, new: type, seen: set[int] | None = None) -> Any:
    """Replace ``old`` by ``new`` everywhere in a ModuleSpec tree (specs are data, so this is a rewrite)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    seen = set() if seen is None else seen
    if spec is old:
        return new
    if id(spec) in seen:
        return spec
    seen.add(id(spec))
    if isinstance(spec, ModuleSpec):
        spec.module = _swap_module(spec.module, old, new, seen)
        spec.submodules = _swap_module(spec.submodules, old, new, seen)
        return spec
    if isinstance(spec, list):
        return [_swap_module(s, old, new, seen) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _swap_module(getattr(spec, f.name), old, new, seen))
    return spec


def layer_spec(config: Any, impl: str, pp_rank: int) -> Any:
    """Decoder block spec for this pipeline stage, with our RMSNorm in the local spec (and, under context
    parallelism, attention over all-gathered keys/values: megatron's local attention has no CP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    use_te = impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=pp_rank
    )
    if not use_te:
        spec = _swap_module(spec, WrappedTorchNorm, RMSNorm)
        if config.context_parallel_size > 1:
            from mars_megatron.training.context_parallel import cp_attention_class

            spec = _swap_module(spec, DotProductAttention, cp_attention_class())
    return spec


def build_model(
    arch: Qwen3Arch,
    parallel: ParallelConfig,
    *,
    dtype: str | None = None,
    transformer_impl: str = "auto",
    vocab_pad_multiple: int = 128,
    fp8: str | None = None,
    recompute: str = "none",
) -> Any:
    """This rank's pipeline stage of the model (megatron parallel state must be initialised).

    Weights are left uninitialised: load a checkpoint or call ``weights.init_weights``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    cpu_compat.install()
    check_parallel(arch, parallel, vocab_pad_multiple)
    impl = resolve_impl(transformer_impl)
    config = transformer_config(
        arch, parallel, dtype=dtype or arch.dtype, impl=impl, fp8=fp8, recompute=recompute
    )
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, impl, pp_rank),
        vocab_size=arch.padded_vocab_size(vocab_pad_multiple),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta),
    )
    mark_tensor_parallel_params(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def mark_tensor_parallel_params(model: torch.nn.Module) -> int:
    """Tag TP-split weights the way megatron's initialisers do; returns how many were tagged.

    megatron sets ``tensor_model_parallel``/``partition_dim`` inside its weight initialisers, so with
    ``perform_initialization=False`` the tags are missing and the gradient norm (hence clipping) counts
    only TP rank 0's shard of every split weight. Modules that already carry the tags (TE) are left alone.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    tagged = 0
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding | ColumnParallelLinear):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)
            tagged += 1
        bias = getattr(module, "bias", None)
        if (
            dim == 0
            and isinstance(bias, torch.nn.Parameter)
            and not getattr(bias, "tensor_model_parallel", False)
        ):
            set_tensor_model_parallel_attributes(bias, True, 0, 1)
    return tagged
