"""FP8 (``model.fp8``): what each mode means for Megatron-Core / Transformer Engine and for the vLLM
rollout engine, and whether this machine can run it.

The modes follow the recipes the field uses for Qwen3 MoE training on Hopper:

* ``hybrid``: E4M3 forward, E5M2 gradients, *delayed* scaling (scales from an amax history of the last
  1024 steps, max over it). The long-standing default of Megatron/NeMo FP8 training.
* ``e4m3``: E4M3 everywhere with *current* (per-tensor, just-in-time) scaling: no amax history to go
  stale when RL changes the policy quickly; needs Transformer Engine >= 2.2.
* ``blockwise``: E4M3 with 1x128 activation and 128x128 weight block scales (DeepSeek-V3's recipe); the
  most robust to outliers; needs Transformer Engine >= 2.3 and a Hopper GPU.

MoE layers additionally pad each expert's token count to the FP8 GEMM alignment
(``moe_router_padding_for_quantization``), which Megatron only supports with the all-to-all dispatcher.

The rollout engine runs FP8 too (vLLM's online ``quantization="fp8"``: the bf16 weights the trainer
pushes are quantized per tensor as they load), so what the engine samples is close to what FP8 training
computes; the trainer-vs-engine mismatch metrics watch the rest.

The hardware check runs before any process starts (``mars train`` calls :func:`check_fp8` from its
``prepare``), not when a config is loaded: a Slurm launch renders FP8 recipes on a login node without GPUs.
"""

from __future__ import annotations

from typing import Any, Literal

from mars_megatron.config import ConfigError

Fp8Mode = Literal["hybrid", "e4m3", "blockwise"]

MIN_TE_VERSION: dict[str, tuple[int, int]] = {"hybrid": (1, 11), "e4m3": (2, 2), "blockwise": (2, 3)}
"""Transformer Engine needed per mode (Megatron-Core's ``fp8_utils``: current scaling from 2.2, block
scaling from 2.3; FP8 grouped GEMM for MoE from 1.11)."""

MIN_CAPABILITY: dict[str, tuple[int, int]] = {"hybrid": (8, 9), "e4m3": (8, 9), "blockwise": (9, 0)}
"""CUDA compute capability per mode: FP8 tensor cores arrive with Ada (8.9) and Hopper (9.0); block
scaling kernels are Hopper's."""

MIN_CUDA: dict[str, tuple[int, int]] = {"blockwise": (12, 9)}
"""CUDA (of torch's build, which TE is built against) per mode: block scaling needs cuBLASLt 12.9."""


def megatron_fp8_kwargs(mode: Fp8Mode, *, moe: bool) -> dict[str, Any]:
    """``TransformerConfig`` fields for ``mode``."""
    if mode == "hybrid":
        kwargs: dict[str, Any] = dict(
            fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max"
        )
    elif mode == "e4m3":
        kwargs = dict(fp8="e4m3", fp8_recipe="tensorwise")
    elif mode == "blockwise":
        kwargs = dict(fp8="e4m3", fp8_recipe="blockwise")
    else:
        raise ValueError(f"model.fp8: expected one of 'hybrid', 'e4m3', 'blockwise' or null, got {mode!r}")
    if moe:
        kwargs["moe_router_padding_for_quantization"] = True
    return kwargs


def vllm_quantization(mode: Fp8Mode | None) -> str | None:
    """The vLLM ``quantization`` argument of the rollout engine for ``model.fp8``."""
    return None if mode is None else "fp8"


def _version(text: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in text.split(".")[:2]]
    parts = [*parts, 0, 0]
    return parts[0], parts[1]


def fp8_problem(
    mode: Fp8Mode,
    *,
    cuda: bool,
    capability: tuple[int, int] | None,
    te_version: str | None,
    cuda_version: str | None = None,
) -> str | None:
    """Why ``mode`` cannot run on a machine with these properties, or None if it can. Pure, so every
    branch is tested on CPU. ``cuda_version``: the CUDA torch was built with (``torch.version.cuda``)."""
    if not cuda:
        return f"{mode!r} needs an NVIDIA GPU with FP8 tensor cores; this machine has no CUDA device"
    need = MIN_CAPABILITY[mode]
    if capability is None or capability < need:
        have = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        kind = "Hopper" if need >= (9, 0) else "Ada or Hopper"
        return f"{mode!r} needs an {kind}-class GPU (compute capability >= {need[0]}.{need[1]}), found {have}"
    if te_version is None:
        return f"{mode!r} needs Transformer Engine (transformer-engine[pytorch]), which is not installed"
    te = MIN_TE_VERSION[mode]
    if _version(te_version) < te:
        return f"{mode!r} needs Transformer Engine >= {te[0]}.{te[1]}, found {te_version}"
    want = MIN_CUDA.get(mode)
    if want is not None and (cuda_version is None or _version(cuda_version) < want):
        return (
            f"{mode!r} needs CUDA >= {want[0]}.{want[1]} (Transformer Engine's block-scaled FP8 GEMMs come "
            f"from cuBLASLt {want[0]}.{want[1]}), torch was built with CUDA {cuda_version or 'unknown'}"
        )
    return None


def machine() -> dict[str, Any]:
    """This machine's CUDA device, torch's CUDA version and Transformer Engine's version (imported only if
    CUDA is present)."""
    import torch

    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    cuda_version = torch.version.cuda
    te_version = None
    if cuda:
        try:
            import transformer_engine

            te_version = str(transformer_engine.__version__)
        except ImportError:
            te_version = None
    return {"cuda": cuda, "capability": capability, "te_version": te_version, "cuda_version": cuda_version}


def check_fp8(mode: Fp8Mode | None) -> None:
    """Raise :class:`~mars_megatron.config.ConfigError` (field ``model.fp8``) when ``mode`` cannot run
    here."""
    if mode is None:
        return
    problem = fp8_problem(mode, **machine())
    if problem is not None:
        raise ConfigError(problem + "; set model.fp8=null to train in bf16", "model.fp8")
