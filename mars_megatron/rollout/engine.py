"""What the agents and the trainer need from a rollout engine, and nothing more.

Requests are token ids, not text: chat templates are applied once, by the caller, with the policy's
tokenizer, so every engine sees the same tokens and the trainer can score exactly what was sampled. A
request whose prompt ends with part of an earlier response continues that response (segment rollout).

Log-probs are those of the sampled tokens under the model's *raw* distribution (temperature 1, no
top-k/top-p), the quantity the trainer recomputes; every engine reports the same definition.

Optional capabilities are separate protocols rather than methods that raise NotImplementedError.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from mars_megatron.agents.sample import RoutingRef

if TYPE_CHECKING:
    from mars_megatron.transfer.channel import TransferStats
    from mars_megatron.transfer.group import GroupSpec
    from mars_megatron.transfer.plan import TransferPlan

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; ``temperature == 0`` is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's end-of-sequence tokens

    def __post_init__(self) -> None:
        """Every engine gets these as they are, so they are checked here once: a non-finite temperature
        passes ``< 0`` and made every token equally likely (a run trained to its end at reward 0)."""
        for name in ("max_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), numbers.Real):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # nan fails both comparisons
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")
        self._check_seed(self.seed)

    def with_budget(self, max_tokens: int, seed: int | None) -> SamplingParams:
        """These params with another token budget and seed (a segment's), checking only those two: the
        driver makes one per segment, 15,000 a paper step, and the rest was checked when these were
        made."""
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        self._check_seed(seed)
        params = copy.copy(self)
        object.__setattr__(params, "max_tokens", max_tokens)
        object.__setattr__(params, "seed", seed)
        return params

    @staticmethod
    def _check_seed(seed: object) -> None:
        if seed is not None and not (_is_int(seed) and -(2**63) <= seed < 2**63):  # type: ignore[operator]
            # engines seed a torch.Generator (int64 here, uint64 on its own) or send it as JSON int64
            raise ValueError(f"seed must be a 64-bit int or None, got {seed!r}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: Sequence[int] | np.ndarray
    """A tuple, or the scheduler's int32 array (pickled as one buffer, not one object a token)."""
    sampling: SamplingParams

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt_ids is empty")

    def prompt_list(self) -> list[int]:
        """The prompt as Python ints, for engines that serialise it themselves (vLLM's inputs, JSON)."""
        ids = self.prompt_ids
        return ids.tolist() if isinstance(ids, np.ndarray) else [int(t) for t in ids]


@dataclass
class GenerationOutput:
    request_id: str
    token_ids: list[int] | np.ndarray
    logprobs: list[float] | np.ndarray  # one per generated token, raw distribution
    finish_reason: FinishReason
    extra: dict[str, object] = field(default_factory=dict)
    routed_experts: np.ndarray | RoutingRef | None = None
    """MoE engines asked to (``capture_routing``): the experts this call routed each position to,
    ``[len(prompt_ids) + len(token_ids) - 1, moe_layers, top_k]`` (:func:`routing_dtype`): every position
    the model consumed as input, the prompt's included (the last generated token is never fed back).
    Rows follow the MoE layers in model order (dense layers have none), each row's top-k in the router's
    order. The trainer replays them (``moe.routing_replay=R3``)."""


def _is_int(value: object) -> bool:
    """An int, numpy's included; not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type for expert ids: Qwen3's 128 experts fit one byte, so a 32k-token sample
    of Qwen3-30B-A3B (48 layers, top-8) carries 12 MiB of routing."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates continuations of token-id prompts. Implementations: transformers, vLLM, OpenAI HTTP."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """One output per request, in request order."""
        ...


@runtime_checkable
class WeightUpdatable(Protocol):
    """Engines whose weights the trainer can replace in place (HF tensor names)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the given HF-named tensors; returns how many were loaded."""
        ...


@runtime_checkable
class TransferTarget(Protocol):
    """Engines that take weights by collective broadcast from the trainer's senders
    (:mod:`mars_megatron.transfer`): every worker of the engine joins one group per sender, then loads
    every bucket of a transfer as it arrives. Driven by :class:`~mars_megatron.pipeline.fleet.EngineFleet`.
    """

    transfer_ranks: int
    """How many group members this engine brings (its workers: vLLM's TP size, 1 for transformers)."""

    def join_transfer(self, groups: Mapping[int, GroupSpec], first_rank: int) -> None:
        """Join each sender's group (``groups`` by sending trainer rank); worker ``w`` is rank
        ``first_rank + w``. Blocks until every member joined."""
        ...

    def receive_weights(self, plan: TransferPlan, load: bool = True) -> TransferStats:
        """Receive and load every bucket of ``plan``; the largest per-worker memory peak is reported.
        ``load=False`` receives and drops the buckets: the same bytes over the same groups with nothing
        loaded, the wire-speed baseline of ``tools/bench/weight_sync.py``."""
        ...

    def leave_transfer(self) -> None: ...


@runtime_checkable
class Sleepable(Protocol):
    """Engines that can free their memory between rollouts (GPU engines colocated with the trainer).

    Sleeping discards the weights too, not only the KV cache: the trainer pushes every weight after each
    update, so keeping a copy would only cost memory. Waking is therefore two calls around that push,
    ``wake_weights`` → ``update_weights`` → ``wake``, so the KV cache is allocated only once the weights
    are in place and the peak stays at the weights plus whatever the trainer still holds."""

    def sleep(self) -> None:
        """Free the device memory of the weights and the KV cache; no generation until :meth:`wake`."""
        ...

    def wake_weights(self) -> None:
        """Allocate the weights' memory again (contents undefined until ``update_weights``)."""
        ...

    def wake(self) -> None:
        """Allocate whatever still sleeps (the KV cache): generation may resume."""
        ...
