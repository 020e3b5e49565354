"""One record from rollout to gradient: the tokens a policy saw and wrote, and what training needs of them.

A :class:`Sample` is built once an agent output has been decoded (possibly over several segments, each
by a different policy version) and scored. GRPO fills in ``advantage``; the loss reads the rest.
Validation runs on construction (and on :func:`dataclasses.replace`), and every error names the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mars_megatron.agents.roles import Role
from mars_megatron.agents.trajectory import Position, RolloutRecord


@dataclass(frozen=True)
class Segment:
    """Response tokens ``[start, end)`` decoded by policy version ``version``."""

    start: int
    end: int
    version: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"Segment: need 0 <= start < end, got start={self.start}, end={self.end}")
        if self.version < 0:
            raise ValueError(f"Segment.version must be >= 0, got {self.version}")


@dataclass
class Sample:
    """One agent output as the trainer sees it.

    Token lists are per response token unless they say otherwise: ``loss_mask[j]``,
    ``behaviour_logprobs[j]`` belong to ``response_ids[j]``.
    """

    prompt_ids: list[int]
    """The tokenised input (chat template applied); at least one token."""
    response_ids: list[int]
    """The tokens the policy wrote."""
    position: Position
    """Trajectory step that produced it; its role is ``position.role``."""
    problem_id: str
    group_id: str
    """Samples sharing it share role, position and input; GRPO normalises over them."""
    reward: float | None = None
    advantage: float | None = None
    """Filled in by :func:`mars_megatron.algorithm.advantages.assign_advantages`."""
    loss_mask: list[int] | None = None
    """1 for response tokens that are trained on, 0 otherwise; None means all ones."""
    behaviour_logprobs: list[float] | None = None
    """Log-probs the rollout engine sampled each response token with (for TIS); None if not recorded."""
    segment_versions: list[Segment] = field(default_factory=list)
    """Policy version per response segment; contiguous spans covering the response, in order.
    Empty means unknown (then :meth:`staleness` cannot be asked)."""
    sample_id: str = ""
    routed_experts: np.ndarray | None = None
    """MoE: the experts the engine routed each position of :attr:`tokens` to, except the last
    (``[len(tokens) - 1, moe_layers, top_k]``; ``GenerationOutput.routed_experts``), for R3 replay."""

    def __post_init__(self) -> None:
        if not isinstance(self.position, Position):
            raise ValueError(f"Sample.position must be a Position, got {self.position!r}")
        if len(self.prompt_ids) == 0:
            raise ValueError("Sample.prompt_ids must hold at least one token")
        n = len(self.response_ids)
        if self.loss_mask is None:
            self.loss_mask = [1] * n
        if len(self.loss_mask) != n:
            raise ValueError(f"Sample.loss_mask has {len(self.loss_mask)} entries, response_ids has {n}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("Sample.loss_mask entries must be 0 or 1")
        if self.behaviour_logprobs is not None:
            if len(self.behaviour_logprobs) != n:
                raise ValueError(
                    f"Sample.behaviour_logprobs has {len(self.behaviour_logprobs)} entries, "
                    f"response_ids has {n}"
                )
            if any(not lp <= 0.0 for lp in self.behaviour_logprobs):
                raise ValueError("Sample.behaviour_logprobs must all be <= 0 (and not NaN)")
        for name in ("reward", "advantage"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"Sample.{name} must be finite, got {value}")
        self._check_segments(n)
        if self.routed_experts is not None:
            positions = len(self.prompt_ids) + n - 1
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != positions:
                raise ValueError(
                    f"Sample {self.sample_id!r}: routed_experts has shape {self.routed_experts.shape}, "
                    f"expected ({positions}, moe_layers, top_k): one row per token but the last"
                )

    def _check_segments(self, n: int) -> None:
        if not self.segment_versions:
            return
        expected_start = 0
        for i, seg in enumerate(self.segment_versions):
            if seg.start != expected_start:
                raise ValueError(
                    f"Sample.segment_versions[{i}] starts at {seg.start}, expected {expected_start} "
                    "(segments must be contiguous and in order)"
                )
            expected_start = seg.end
        if expected_start != n:
            raise ValueError(f"Sample.segment_versions cover {expected_start} tokens, response_ids has {n}")

    @classmethod
    def from_record(
        cls, record: RolloutRecord, prompt_ids: Sequence[int], response_ids: Sequence[int], **kwargs
    ) -> Sample:
        """Build from a trajectory record (position, problem, group and reward come from it)."""
        kwargs.setdefault("reward", record.reward)
        return cls(
            prompt_ids=list(prompt_ids),
            response_ids=list(response_ids),
            position=record.position,
            problem_id=record.problem_id,
            group_id=record.group_id,
            sample_id=record.sample_id,
            **kwargs,
        )

    @property
    def role(self) -> Role:
        return self.position.role

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by response: the sequence the trainer scores."""
        return [*self.prompt_ids, *self.response_ids]

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version that wrote any of the response (None when unknown)."""
        return min((s.version for s in self.segment_versions), default=None)

    def staleness(self, current_version: int) -> int:
        """How many versions the oldest segment lags ``current_version`` (0: fully on-policy)."""
        oldest = self.oldest_version
        if oldest is None:
            raise ValueError(f"Sample {self.sample_id!r}: staleness needs segment_versions, which is empty")
        if current_version < oldest:
            raise ValueError(f"staleness: current_version {current_version} is older than segment {oldest}")
        return current_version - oldest
