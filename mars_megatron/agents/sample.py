"""One record from the engine's output to the loss: :class:`Sample`.

The scheduler creates a sample when it starts an agent output (its prompt, ids and place in the
trajectory tree) and appends each decoded segment to it (:meth:`Sample.add_segment`: the tokens, the
log-probs the engine sampled them with, the policy version that decoded them, the routing). Input
selection, the reward, the per-role metrics, GRPO (``advantage``), the packer and the loss all read
and annotate this one record; nothing copies it into another type.

The per-token fields are numpy arrays (token ids ``int32``, log-probs ``float32``, the loss mask ``int8``),
made from whatever sequence a caller passes: at paper scale a step holds hundreds of millions of tokens,
and the driver only moves them (appends a segment, pickles a share for its trainer rank), which for an
array is a memory copy and for a list of Python numbers tens of nanoseconds a token
(``tools/bench/control_plane.py``). The types are the narrowest that lose nothing: vocabularies are far
below 2**31 ids, and every engine computes its log-probs in float32 (the trainer reads them as float32
too). Compare them with ``.tolist()`` or ``np.array_equal``.

The checks hold for partial records too (a sample still decoding has fewer tokens, and every per-token
array has as many entries as ``response_ids``). Every token's values are checked once: all of them on
construction (and restore), then each segment's as it is added; :meth:`Sample.finish` checks the complete
record's lengths and segments, and :meth:`Sample.check_scores` the scalars set later. Every error names
the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


TOKEN_DTYPE = np.dtype(np.int32)
"""int32: half the bytes of int64 on every hop (engine reply, request, record, share); a vocabulary is
far below 2**31 ids (Qwen3's 151,936), and an id outside the type is refused, not wrapped."""
LOGPROB_DTYPE = np.dtype(np.float32)
"""float32: what every engine computes (HF's and vLLM's log-softmax in float32, sent as Python floats
that are float32 values) and what the loss and the mismatch metrics read (they cast to float32 first),
so nothing the trainer sees changes; the scheduler's checkpoint kept them as float32 already."""
MASK_DTYPE = np.dtype(np.int8)
_TOKEN_MAX = int(np.iinfo(TOKEN_DTYPE).max)


def token_array(values: ArrayLike) -> np.ndarray:
    """Token ids as the record keeps them (no copy when they already are). Ids from a wider integer
    array are range-checked before the cast (numpy would wrap them); Python ints out of range raise in
    numpy itself."""
    ids = np.asarray(values)
    if ids.dtype == TOKEN_DTYPE:
        return ids.reshape(-1)
    if ids.dtype.kind in "iu" and ids.size and (int(ids.min()) < 0 or int(ids.max()) > _TOKEN_MAX):
        raise ValueError(f"token ids must be in [0, {_TOKEN_MAX}], got {int(ids.min())}..{int(ids.max())}")
    try:
        return np.asarray(values, dtype=TOKEN_DTYPE).reshape(-1)
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, {_TOKEN_MAX}]: {e}") from None


def logprob_array(values: ArrayLike) -> np.ndarray:
    return np.asarray(values, dtype=LOGPROB_DTYPE).reshape(-1)


def _at_most_zero(logprobs: np.ndarray) -> np.ndarray:
    """Log-probs clamped to <= 0: an engine's rounding can put a certain token a hair above."""
    return np.where(logprobs > 0.0, 0.0, logprobs)


def group_id(problem_id: str, position: str, parent_id: str | None) -> str:
    """Identify a group: same problem, same position, same parent sample (so the same input)."""
    return f"{problem_id}/{position}/{parent_id or '-'}"


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


@dataclass(frozen=True)
class RoutingRef:
    """A sample's R3 routing left in the object store of the process that made it (a rollout actor's,
    under Ray): ``[positions, moe_layers, top_k]`` bytes, 98 % of a Qwen3-MoE batch, so the driver that
    schedules the sample never holds them; the trainer rank that trains it fetches them
    (:func:`fetch_routing`).

    The store's owner is the engine's actor: if that actor dies before the update, the routing is gone
    and fetching it fails naming the samples (the sample must be decoded again)."""

    ref: Any
    """Ray's ``ObjectRef`` of the array."""
    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def put(cls, routing: np.ndarray) -> RoutingRef:
        """``routing`` into this process's object store (Ray must be initialised)."""
        import ray

        return cls(ray.put(routing), tuple(routing.shape), routing.dtype.str)


def fetch_routing(samples: Iterable[Sample], timeout_s: float | None = None) -> int:
    """Replace each :class:`RoutingRef` of ``samples`` by its array, fetched in one call; returns the bytes
    fetched. Samples whose routing is already an array (made without Ray, or fetched) are left as they
    are. ``timeout_s``: the most to wait (Ray raises ``GetTimeoutError``)."""
    pending = [s for s in samples if isinstance(s.routed_experts, RoutingRef)]
    if not pending:
        return 0
    import ray

    refs = [cast(RoutingRef, s.routed_experts).ref for s in pending]
    try:
        arrays = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.ObjectLostError as e:  # OwnerDiedError is one: the engine's actor died
        ids = [s.sample_id for s in pending]
        raise RuntimeError(
            f"the R3 routing of {len(ids)} samples ({ids[:3]}{' ...' if len(ids) > 3 else ''}) is lost: the "
            f"rollout engine that held it is gone ({type(e).__name__})"
        ) from e
    fetched = 0
    for sample, routing in zip(pending, arrays, strict=True):
        sample.routed_experts = routing
        fetched += routing.nbytes
    return fetched


@dataclass(eq=False)
class Sample:
    """One agent output, from the engine to the loss.

    Token arrays are per response token unless they say otherwise: ``loss_mask[j]``,
    ``behaviour_logprobs[j]`` belong to ``response_ids[j]``. The constructor takes any sequence and keeps
    numpy arrays (see the module docstring).
    """

    prompt_ids: np.ndarray
    """The tokenised input (chat template applied); at least one token."""
    response_ids: np.ndarray
    """The tokens the policy wrote (so far, while it decodes)."""
    position: str
    """The trajectory position (of the agent graph) that produced it."""
    problem_id: str
    group_id: str = ""
    """Samples sharing it share role, position and input; GRPO normalises over them. Empty: derived from
    the trajectory, position and parent (:func:`group_id`)."""
    reward: float | None = None
    """The agent-specific reward (:mod:`mars_megatron.rewards.agent_rewards`); None until scored."""
    advantage: float | None = None
    """Filled in by :func:`mars_megatron.algorithm.advantages.assign_advantages`."""
    loss_mask: np.ndarray | None = None
    """1 for response tokens that are trained on, 0 otherwise; None means all ones."""
    behaviour_logprobs: np.ndarray | None = None
    """Log-probs the rollout engine sampled each response token with (for TIS); None if not recorded."""
    segment_versions: list[Segment] = field(default_factory=list)
    """Policy version per response segment; contiguous spans covering the response, in order.
    Empty means unknown (then :meth:`staleness` cannot be asked)."""
    sample_id: str = ""
    routed_experts: np.ndarray | RoutingRef | None = None
    """MoE: the experts the engine routed each position of :attr:`tokens` to, except the last
    (``[len(tokens) - 1, moe_layers, top_k]``; ``GenerationOutput.routed_experts``), for R3 replay. The
    latest segment's call routed every earlier position again, under the weights that decoded its tokens,
    so it is the routing of the newest policy version for every position. Under Ray, a :class:`RoutingRef`
    until the trainer rank fetches it."""
    trajectory_id: str = ""
    """This admission of the problem (``<problem id>@<n>``): a problem met again in a later epoch is a
    new trajectory tree with new sample ids. Empty: ``problem_id``."""
    parent_id: str | None = None
    """The output this one's input was built from (None at the first position)."""
    judged_id: str | None = None
    """The latest solution on the way here: the one a report judges or a revision revises; None at the
    first position."""
    text: str = ""
    """The response decoded to text (once, when it finished: the reward and the next prompt read it)."""
    finish_reason: str | None = None
    """``stop`` (the engine ended it) or ``length`` (the token budget did); None while decoding."""
    verdict: bool | None = None
    """Outputs of a role that decides (a verdict reader): the parsed verdict; None: unparseable, or a role
    that reads none."""
    judged_right: bool | None = None
    """Outputs with an input: whether the solution it judged or revised was right; None for the first
    position."""
    training_reward: float | None = None
    """The reward trained on where it differs in kind from :attr:`reward` (``algorithm.reward=shared``:
    the trajectory's outcome); None: train on :attr:`reward`."""
    tool_calls: int = 0
    """Tool calls served inside this response (each added an observation, masked out of the loss)."""
    role: str = ""
    reward_info: dict[str, float] = field(default_factory=dict)
    """A reward function's notes for the metrics (its details; ``fail/<reason>: 1`` when it failed)."""
    """The agent of the graph that wrote it (the position's role). Empty: the position's name without a
    trailing ``_<n>``, for positions named after their role (``verifier_2``: ``verifier``)."""

    def __post_init__(self) -> None:
        self.prompt_ids = token_array(self.prompt_ids)
        self.response_ids = token_array(self.response_ids)
        if self.loss_mask is not None:
            self.loss_mask = _mask_array(self.loss_mask)
        if self.behaviour_logprobs is not None:
            self.behaviour_logprobs = logprob_array(self.behaviour_logprobs)
        if not self.role:
            self.role = re.sub(r"_\d+$", "", self.position)
        if not self.trajectory_id:
            self.trajectory_id = self.problem_id
        if not self.group_id:
            self.group_id = group_id(self.trajectory_id, self.position, self.parent_id)
        self.check()

    def check(self) -> None:
        """Every invariant of the record, each token's values included (they hold while it decodes, too);
        raises naming the field. Runs once, when the record is made (and restored); after that the
        decoding methods check what they append and :meth:`finish` and :meth:`check_scores` only what can
        still change, so nothing on the way to the loss scans a response again."""
        self._check_shape()
        assert self.loss_mask is not None
        if ((self.loss_mask != 0) & (self.loss_mask != 1)).any():
            raise ValueError("Sample.loss_mask entries must be 0 or 1")
        if self.behaviour_logprobs is not None and not (self.behaviour_logprobs <= 0.0).all():
            raise ValueError("Sample.behaviour_logprobs must all be <= 0 (and not NaN)")
        self.check_scores()

    def check_scores(self) -> None:
        """The scalars a record is annotated with on its way (reward, training reward, advantage) are
        finite."""
        for name in ("reward", "advantage", "training_reward"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"Sample.{name} must be finite, got {value}")

    def _check_shape(self) -> None:
        """Names, lengths, segments and routing: what holds by count, not by each token's value."""
        if not isinstance(self.position, str) or not self.position:
            raise ValueError(f"Sample.position must be a position name, got {self.position!r}")
        if len(self.prompt_ids) == 0:
            raise ValueError("Sample.prompt_ids must hold at least one token")
        n = len(self.response_ids)
        if self.loss_mask is None:
            self.loss_mask = np.ones(n, dtype=MASK_DTYPE)
        if len(self.loss_mask) != n:
            raise ValueError(f"Sample.loss_mask has {len(self.loss_mask)} entries, response_ids has {n}")
        if self.behaviour_logprobs is not None and len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"Sample.behaviour_logprobs has {len(self.behaviour_logprobs)} entries, response_ids has {n}"
            )
        self._check_segments(n)
        self._check_routing(self.routed_experts, n)

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

    def _check_routing(self, routed: np.ndarray | RoutingRef | None, n: int) -> None:
        if routed is None:
            return
        positions = len(self.prompt_ids) + n - 1
        if routed.ndim != 3 or routed.shape[0] != positions:
            raise ValueError(
                f"Sample {self.sample_id!r}: routed_experts has shape {routed.shape}, "
                f"expected ({positions}, moe_layers, top_k): one row per token but the last"
            )

    # ------------------------------------------------------------------------------------- decoding
    def add_segment(
        self,
        token_ids: ArrayLike,
        logprobs: ArrayLike,
        version: int,
        routed_experts: np.ndarray | RoutingRef | None = None,
    ) -> None:
        """Append one decoded segment: its tokens, the log-probs the engine sampled them with (clamped to
        <= 0: an engine's rounding can put a certain token a hair above), the policy ``version`` that
        decoded them, and the call's routing of every position it fed (it replaces the record's)."""
        ids, lps = token_array(token_ids), logprob_array(logprobs)
        if len(ids) != len(lps):
            raise ValueError(f"{self.sample_id}: {len(ids)} tokens but {len(lps)} log-probs")
        if not len(ids):
            return
        highest = lps.max()  # one pass for both checks: a NaN anywhere makes the maximum NaN
        if np.isnan(highest):
            raise ValueError(f"{self.sample_id}: the engine returned a NaN log-prob (behaviour_logprobs)")
        self._check_routing(routed_experts, len(self.response_ids) + len(ids))
        if routed_experts is not None:
            self.routed_experts = routed_experts
        assert self.loss_mask is not None
        start = len(self.response_ids)
        self._append(ids, _at_most_zero(lps) if highest > 0.0 else lps, np.ones(len(ids), dtype=MASK_DTYPE))
        self.segment_versions.append(Segment(start, len(self.response_ids), version))

    def _append(self, ids: np.ndarray, logprobs: np.ndarray, mask: np.ndarray) -> None:
        """Grow the per-token arrays by one segment (one copy of each: a response has a few segments).

        The first segment is kept as given, not copied: most responses are one segment, and an engine
        call's outputs are views of its :class:`~mars_megatron.rollout.batch.OutputBatch` (under Ray, of
        the object store's read-only buffer), which nothing writes to. Nothing writes to a record's
        arrays in place either; each later segment makes new ones."""
        if not len(self.response_ids):
            self.response_ids, self.behaviour_logprobs, self.loss_mask = ids, logprobs, mask
            return
        before = self.behaviour_logprobs
        if before is None:
            before = np.zeros(len(self.response_ids), dtype=LOGPROB_DTYPE)
        self.response_ids = np.concatenate((self.response_ids, ids))
        self.behaviour_logprobs = np.concatenate((before, logprobs))
        self.loss_mask = np.concatenate((cast(np.ndarray, self.loss_mask), mask))

    def add_observation(self, token_ids: ArrayLike, version: int) -> None:
        """Append what a served tool call returned (the distiller's digest, tokenised) after the turn that
        made the call: context the policy did not write, so masked out of the loss (``loss_mask`` 0,
        behaviour log-prob 0). Its segment carries the policy ``version`` current when it was added. The
        routing is dropped: it no longer covers every position, and the next segment's call routes them
        all again."""
        ids = token_array(token_ids)
        if not len(ids):
            return
        start = len(self.response_ids)
        self._append(ids, np.zeros(len(ids), dtype=LOGPROB_DTYPE), np.zeros(len(ids), dtype=MASK_DTYPE))
        self.segment_versions.append(Segment(start, len(self.response_ids), version))
        self.routed_experts = None
        self.tool_calls += 1

    def since_observation(self) -> np.ndarray:
        """The response tokens written since the last observation (all of them when there is none)."""
        assert self.loss_mask is not None
        masked = np.flatnonzero(self.loss_mask == 0)
        return self.response_ids[(int(masked[-1]) + 1 if len(masked) else 0) :]

    def finish(self, finish_reason: str) -> None:
        """Decoding is over: the model ended it (``stop``) or the token budget did (``length``). Checks
        the complete record's shape (each token's values were checked as its segment was added)."""
        if finish_reason not in ("stop", "length"):
            raise ValueError(f"Sample.finish_reason must be 'stop' or 'length', got {finish_reason!r}")
        self.finish_reason = finish_reason
        self._check_shape()

    # ------------------------------------------------------------------------------------------- views
    @property
    def tokens(self) -> np.ndarray:
        """Prompt followed by response: the sequence the trainer scores (a new array)."""
        return np.concatenate((self.prompt_ids, self.response_ids))

    @property
    def length(self) -> int:
        """``len(tokens)``, without building them."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def truncated(self) -> bool:
        """The token budget, not the model, ended the response."""
        return self.finish_reason == "length"

    @property
    def found_errors(self) -> bool:
        """An output whose verdict failed its solution (an unparseable one found nothing)."""
        return self.verdict is False

    @property
    def reward_trained_on(self) -> float | None:
        """What GRPO normalises: :attr:`training_reward` where set, else the agent reward."""
        return self.reward if self.training_reward is None else self.training_reward

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

    # ------------------------------------------------------------------------------- saved and written
    def state(self) -> dict[str, Any]:
        """The record as plain values, to continue it in a new process (the scheduler's checkpoint): the
        token, mask and log-prob arrays (the log-probs as float32: compact in ``torch.save``). The
        annotations made for an update (training reward, advantage) are not kept: a record is saved between
        updates. A routing still in the object store must be fetched first (:func:`fetch_routing`)."""
        if isinstance(self.routed_experts, RoutingRef):
            raise ValueError(f"Sample {self.sample_id!r}: fetch_routing before saving its state")
        return {
            "sample_id": self.sample_id,
            "key": self.trajectory_id,
            "position": self.position,
            "group_id": self.group_id,
            "role": self.role,
            "parent_id": self.parent_id,
            "judged_id": self.judged_id,
            "prompt_ids": self.prompt_ids,
            "tokens": self.response_ids,
            "loss_mask": np.asarray(self.loss_mask if self.loss_mask is not None else [], dtype=np.int8),
            "tool_calls": self.tool_calls,
            "logprobs": np.asarray(
                self.behaviour_logprobs if self.behaviour_logprobs is not None else [], dtype=np.float32
            ),
            "segments": [(g.start, g.end, g.version) for g in self.segment_versions],
            "routing": self.routed_experts,
            "finish_reason": self.finish_reason,
            "text": self.text,
            "reward": self.reward,
            "verdict": self.verdict,
            "judged_right": self.judged_right,
            **({"reward_info": self.reward_info} if self.reward_info else {}),
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any], problem_id: str, role: str) -> Sample:
        """The record :meth:`state` saved (checked like a new one). ``role``: the saved one where the
        state has it (checkpoints from before agent graphs do not); the keys older checkpoints lack
        (``group_id``, ``routing``, ``judged_right``, ``loss_mask``, ``tool_calls``) get what they meant
        then."""
        key, position = d["key"], str(d["position"])
        return cls(
            d["prompt_ids"],
            d["tokens"],
            position,
            problem_id,
            d.get("group_id") or group_id(key, position, d["parent_id"]),
            reward=d["reward"],
            behaviour_logprobs=_at_most_zero(logprob_array(d["logprobs"])),
            segment_versions=[Segment(*g) for g in d["segments"]],
            sample_id=d["sample_id"],
            routed_experts=d.get("routing"),
            trajectory_id=key,
            parent_id=d["parent_id"],
            judged_id=d["judged_id"],
            text=d["text"],
            finish_reason=d["finish_reason"],
            verdict=d["verdict"],
            judged_right=d.get("judged_right"),
            role=d.get("role") or role,
            loss_mask=d.get("loss_mask"),
            tool_calls=int(d.get("tool_calls", 0)),
            reward_info=dict(d.get("reward_info", {})),
        )

    def summary(self) -> dict[str, Any]:
        """The record as one JSON object for people and analysis scripts (a run's ``rollouts/``): ids and
        place in the trajectory, tokens and text, verdict, the agent reward, the reward trained on and the
        advantage, and which policy version wrote each segment. No log-probs or routing."""
        return {
            "sample_id": self.sample_id,
            "problem_id": self.problem_id,
            "position": self.position,
            "role": self.role,
            "group_id": self.group_id,
            "parent_id": self.parent_id,
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "verdict": self.verdict,
            "agent_reward": self.reward,
            "reward": self.reward_trained_on,
            "advantage": self.advantage,
            "segments": [[g.start, g.end, g.version] for g in self.segment_versions],
        }


class SampleLookup(Protocol):
    """Samples by index in their mini-batch: the whole mini-batch (a list), or the part of it one trainer
    rank holds (:class:`~mars_megatron.rl.shares.MiniBatchShare`). The packs name samples by these
    indices; ``len`` is the whole mini-batch's size either way."""

    def __getitem__(self, index: int, /) -> Sample: ...

    def __len__(self) -> int: ...


def _mask_array(values: ArrayLike) -> np.ndarray:
    """A loss mask as the record keeps it; a value that is not 0 or 1 is kept as it is, for
    :meth:`Sample.check` to name (an ``int8`` cast would wrap it)."""
    mask = np.asarray(values).reshape(-1)
    if mask.dtype == MASK_DTYPE:
        return mask
    return mask.astype(MASK_DTYPE) if len(mask) == 0 or np.isin(mask, (0, 1)).all() else mask
