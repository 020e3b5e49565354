"""Module-level workers for the weight-sync tests (spawned processes import them)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.rollout.engine import GenerationRequest, SamplingParams
from mars_megatron.training import parallel


def train_sync_and_compare(
    hf: str, layout: dict[str, int], train_seqs: list[list[int]], prompts: list[list[int]], engine_kind: str
) -> dict[str, Any]:
    """One train step, sync into an engine on rank 0, then compare engine and trainer log-probs of the
    tokens the engine generated after the sync."""
    from mars_megatron.jobs import load_engine
    from mars_megatron.training.weight_sync import WeightSync

    pc = ParallelConfig(**layout)
    parallel.init_model_parallel(pc, seed=0)
    trainer = load_engine(hf, pc, dtype=None, impl="local", optimizer=OptimizerConfig(lr=1e-2))
    rollout = None
    if dist.get_rank() == 0:
        if engine_kind == "vllm":
            from mars_megatron.rollout.vllm_engine import VLLMEngine

            rollout = VLLMEngine(hf)
        else:
            from mars_megatron.rollout.hf_engine import HFEngine

            rollout = HFEngine(hf)
    requests = [
        GenerationRequest(f"p{i}", tuple(p), SamplingParams(max_tokens=8, temperature=0))
        for i, p in enumerate(prompts)
    ]
    before = rollout.generate(requests) if rollout is not None else None
    trainer.train_step(train_seqs, pack_length=48)
    stats = WeightSync(trainer.arch, rollout).sync(trainer.model)
    after = rollout.generate(requests) if rollout is not None else None
    holder = [[(o.token_ids, o.logprobs) for o in after] if after is not None else None]
    dist.broadcast_object_list(holder, src=0)
    generated = holder[0]
    full = [list(p) + tokens for p, (tokens, _) in zip(prompts, generated, strict=True)]
    trainer_lp = trainer.logprobs(full, micro_batch=2)
    out: dict[str, Any] = {"stats": stats}
    if trainer_lp is not None:
        out["trainer"] = [lp[len(p) - 1 :] for p, lp in zip(prompts, trainer_lp, strict=True)]
    if rollout is not None:
        out["engine"] = [lps for _, lps in generated]
        out["before"] = [o.logprobs for o in before]
    return out
