"""Worker classes and launch functions for the Ray worker-group tests (Ray actors and spawned processes
import them by module path, so they cannot live in the test file)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.rollout.hf_engine import HFEngine
from mars_megatron.training import parallel
from mars_megatron.training.weight_sync import SendsWeights


class TrainerRank(SendsWeights):
    """One trainer rank: megatron's parallel state for ``layout``, the model from ``model_dir`` and an
    Adam optimizer; built after torch.distributed is up (by a worker group or ``parallel.launch``)."""

    def __init__(
        self,
        model_dir: str,
        layout: dict[str, int],
        seed: int = 0,
        lr: float = 1e-2,
        bucket_bytes: int = 64 * 1024,
    ) -> None:
        from mars_megatron.jobs import load_engine

        self.bucket_bytes = bucket_bytes
        parallel.init_model_parallel(ParallelConfig(**layout), seed=seed)
        self.engine = load_engine(
            model_dir, ParallelConfig(**layout), dtype=None, impl="local", optimizer=OptimizerConfig(lr=lr)
        )

    def describe(self) -> dict[str, Any]:
        """What the group set up on this rank."""
        return {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "backend": dist.get_backend(),
            "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }

    def train_step(self, seqs: list[list[int]], **step_kwargs: Any) -> dict[str, float]:
        return self.engine.train_step(seqs, **step_kwargs)

    def logprobs(self, seqs: list[list[int]], micro_batch: int) -> list[list[float]] | None:
        return self.engine.logprobs(seqs, micro_batch)

    def weight_senders(self) -> dict[str, tuple[Any, Any]]:
        """One policy, "policy", for EngineFleet (as PolicyWorker has one per policy)."""
        from mars_megatron.training.weight_sync import WeightSender

        if getattr(self, "sender", None) is None:
            self.sender = WeightSender(self.engine.arch, self.bucket_bytes)
        return {"policy": (self.engine.model, self.sender)}

    def received(self, share: list[int]) -> tuple[int, list[int]]:
        """This rank and what it was sent (``call_async_each``)."""
        return dist.get_rank(), share

    def fail_on(self, rank: int, message: str) -> int:
        if dist.get_rank() == rank:
            raise ValueError(message)
        return dist.get_rank()


def train_once(model_dir: str, layout: dict[str, int], seqs: list[list[int]], step_kwargs: dict) -> dict:
    """The reference: one train step on ranks spawned by ``parallel.launch`` (one thread each, like the
    Ray ranks in the test)."""
    torch.set_num_threads(1)
    return TrainerRank(model_dir, layout).train_step(seqs, **step_kwargs)


class DyingHFEngine(HFEngine):
    """A transformers engine whose process dies (``os._exit``, as if killed) while it loads bucket
    ``die_at`` of its ``on_transfer``-th weight transfer."""

    def __init__(self, model_dir: str, die_at: int, on_transfer: int = 2, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self.die_at, self.on_transfer = die_at, on_transfer
        self.transfers = self.buckets = 0

    def receive_weights(self, plan: Any, load: bool = True) -> Any:
        self.transfers += 1
        self.buckets = 0
        return super().receive_weights(plan, load)

    def update_weights(self, named_tensors: Any) -> int:
        if self.transfers == self.on_transfer and self.buckets == self.die_at:
            os._exit(3)
        self.buckets += 1
        return super().update_weights(named_tensors)


def start_fleet(group: Any, factories: list[Any], replacement: Any, **kwargs: Any) -> Any:
    """An EngineFleet over ``group`` (TrainerRank workers) and engines of one policy, "policy", each in an
    actor of its own (one per factory), over gloo on loopback; dead engines come back as ``replacement``."""
    from mars_megatron.pipeline.fleet import EngineFleet
    from mars_megatron.rollout.ray_engine import start_rollout_actor

    engines = [("policy", start_rollout_actor(f, threads=1)) for f in factories]
    restart = lambda i: start_rollout_actor(replacement, threads=1)  # noqa: E731
    options = {"host": "127.0.0.1", "backend": "gloo", "timeout_s": 60, **kwargs}
    return EngineFleet(group, engines, restart, **options)


class PromptEcho:
    """A rollout engine that answers each request with a few tokens derived from its prompt and returns
    the prompt it was given in the output's extras: a test compares what the engine saw with what the
    scheduler meant to send."""

    def generate(self, requests: Any) -> list[Any]:
        import numpy as np

        from mars_megatron.rollout.engine import GenerationOutput

        outputs = []
        for r in requests:
            prompt = np.asarray(r.prompt_ids)
            n = min(r.sampling.max_tokens, 3)
            ids = (int(prompt.sum()) + np.arange(n)) % 997 + 3
            outputs.append(
                GenerationOutput(r.request_id, ids, [-0.5] * n, "length", {"prompt": prompt.tolist()})
            )
        return outputs


class SocketsRank:
    """A trainer rank that only says which interfaces its collectives bind and sums a tensor over the group
    (the group's gloo sockets, on the interface given)."""

    def sockets(self) -> tuple[str | None, str | None, float]:
        total = torch.ones(1)
        dist.all_reduce(total)
        return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME"), float(total)
