"""The agentic pipeline's scheduler: what to decode next, what to score, what to train on, and when.

Pure bookkeeping: no engines, no Ray, no clock. The real pipeline (Ray actors) and the simulator
(:mod:`mars_megatron.pipeline.simulate`, a virtual clock) both drive this one class, so the benchmark
measures the schedule the trainer actually runs.

The unit of work is a *segment*: at most ``segment_tokens`` more tokens of one agent output
(its record, a :class:`~mars_megatron.agents.sample.Sample`, grows by one segment at a time). A
sequence that is not finished after its segment is carried over and continues with whatever weights
the engines hold by then; each segment records that policy version. When a sequence finishes it is
scored; when every output of a position for a problem is scored, the next position's inputs are
selected (:func:`~mars_megatron.agents.selection.select_inputs`) and its sequences start at once,
without waiting for other problems; when every member of a group (same role, same input) is scored,
the group joins the training queue. Nothing waits for whole trajectories.

Staleness. A segment decoded by version ``v`` and trained by the update of version ``u`` (the update that
makes ``u + 1``) is ``u - v`` versions stale; ``max_staleness[role]`` bounds it. The scheduler keeps the
bound by construction, so nothing is ever dropped or restarted for it:

* *admission*: at most ``problems_per_step`` new problems start per policy version, so rollout never
  runs further ahead of training than the data one update consumes;
* *issue*: no segment of a role with bound 0 is issued while an update runs (only a later update could
  train it);
* *update start*: update ``u`` waits while a group is incomplete whose first segment was issued at a
  version ``<= u - bound`` (it could only be trained by ``u + 1`` or later); carried-over sequences and
  the siblings of started groups are decoded first, so the wait is short. Otherwise it starts once
  ``batch_groups`` groups are complete (or nothing else is coming) and takes the oldest ``batch_groups``
  groups plus every complete group that would be too stale for the update after it.

With bound 0 for every role this is exactly the synchronous schedule — admit ``problems_per_step``
problems, finish all their trajectories, train on everything — whatever the timing (tested), and it is
what ``pipeline.mode=sync`` runs: the two modes differ only in their bounds. An update's groups are put
in one canonical order (admission, position, group id), so the same data packs the same way whatever
order it completed in.

``whole_trajectories`` (the shared, trajectory-level reward) holds complete groups back until every
output of their problem's tree is scored; a held group counts as open for the staleness gate.

Fault tolerance. Every sequence has a stable ``sample_id`` and a state (:class:`SeqState`, the
scheduler's own bookkeeping beside the record). A worker that dies loses the
segments and scores it held; :meth:`Scheduler.requeue` puts those sequences back exactly as they were
before the lost call (the tokens of a lost segment were never recorded), so nothing is lost and nothing
is recorded twice. :meth:`Scheduler.check` verifies the counts.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.sample import RoutingRef, Sample, fetch_routing, group_id, token_array
from mars_megatron.agents.selection import select_inputs
from mars_megatron.agents.trajectory import PromptInputs
from mars_megatron.config import AgentsConfig, MarsConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.rewards.scoring import outcome_rewards
from mars_megatron.seeds import derive_seed


class SeqState(StrEnum):
    READY = "ready"
    """Waiting for its next segment (new, or carried over)."""
    DECODING = "decoding"
    """A segment is out at a rollout worker."""
    SCORING = "scoring"
    """Finished decoding; its reward is being computed."""
    TOOL = "tool"
    """Its turn ended with a tool call: waiting for the distiller's digest of the tool's output."""
    DONE = "done"
    """Scored; waiting in (or already taken from) the training queue."""


@dataclass
class _Flight:
    """The scheduler's bookkeeping of one record: where it is, and at which versions it was issued."""

    state: SeqState = SeqState.READY
    first_version: int | None = None
    """The policy version its first segment was issued at (None until then)."""
    issued_version: int | None = None
    """The policy version of the segment now being decoded."""


@dataclass
class _Trajectory:
    """The scheduler's bookkeeping of one admitted problem's trajectory tree (keyed by trajectory id)."""

    problem: Problem
    sample_ids: list[str] = field(default_factory=list)
    """Every record of the tree, in the order they were started."""
    active: int = 0
    """Its sequences not yet scored; 0 once the whole tree is (its outcomes are then resolved)."""
    untrained: int = 0
    """Its groups not yet trained: the tree is forgotten once this and ``active`` are 0."""
    position_left: dict[str, int] = field(default_factory=dict)
    """Per position, its outputs not yet scored: at 0 the next positions' inputs are selected."""
    held: list[str] = field(default_factory=list)
    """Complete groups held back until the whole tree is scored (outcome and shared rewards)."""


@dataclass(frozen=True)
class SegmentJob:
    """What a rollout worker decodes: ``max_tokens`` more tokens after the input ``prompt_ids`` and the
    ``prefix`` decoded so far, sampled with ``seed``, by the weights of policy ``version``."""

    sample_id: str
    role: str
    prompt_ids: np.ndarray
    prefix: np.ndarray
    """The sequence's tokens so far (shared with the scheduler; unchanged while the job is out)."""
    max_tokens: int
    seed: int
    version: int

    def context(self) -> np.ndarray:
        """The engine's prompt: the input followed by the tokens decoded so far."""
        return np.concatenate((self.prompt_ids, self.prefix)) if len(self.prefix) else self.prompt_ids


@dataclass(frozen=True)
class Limits:
    """The schedule's knobs as the scheduler reads them, resolved from the config (see :meth:`from_config`
    and :class:`Scheduler`). Not validated here: :mod:`mars_megatron.config` checks every setting once."""

    max_response_tokens: int
    segment_tokens: int
    """Tokens per segment; >= max_response_tokens decodes every output in one segment."""
    max_staleness: Mapping[str, int]
    """A bound for every role of the graph."""
    problems_per_step: int
    """New problems admitted per policy version (``data.problems_per_step``)."""
    batch_groups: int
    """Complete groups an update waits for (ignored where a bound of 0 makes it drain)."""
    whole_trajectories: bool = False
    """A complete group joins the training queue only once every sequence of its problem's trajectory
    tree is scored (``algorithm.reward=shared`` rewards every output with its trajectory's outcome)."""

    @classmethod
    def from_config(cls, cfg: MarsConfig, graph: AgentGraph) -> Limits:
        """A run's schedule: sync mode is agentic with every bound 0; a role's bound is its
        ``pipeline.staleness_per_role`` entry or ``pipeline.max_staleness``; ``segment_tokens`` 0 means the
        whole response and ``batch_groups`` 0 means ``data.problems_per_step``."""
        p, max_tokens, per_step = cfg.pipeline, cfg.rollout.max_response_tokens, cfg.data.problems_per_step
        if p.mode == "sync":
            bounds = dict.fromkeys(graph.roles, 0)
        else:
            bounds = {r: p.staleness_per_role.get(r, p.max_staleness) for r in graph.roles}
        return cls(
            max_response_tokens=max_tokens,
            segment_tokens=p.segment_tokens or max_tokens,
            max_staleness=bounds,
            problems_per_step=per_step,
            batch_groups=p.batch_groups or per_step,
            whole_trajectories=cfg.algorithm.reward == "shared",
        )


PromptFn = Callable[[str, Problem, PromptInputs], list[int]]
"""(position name, problem, what the prompt is built from) -> the prompt's token ids."""


@dataclass
class Batch:
    """One update's training data: complete groups, oldest first."""

    version: int
    """The policy version this update trains (it produces ``version + 1``)."""
    groups: list[list[Sample]]

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


class Scheduler:
    """The agentic schedule of one run; see the module docstring for the rules."""

    def __init__(
        self, agents: AgentsConfig, limits: Limits, prompt_fn: PromptFn, graph: AgentGraph, *, seed: int = 0
    ) -> None:
        self.agents = agents
        self.graph = graph
        self.limits = limits
        self.prompt_fn = prompt_fn
        self.seed = seed
        self.version = 0
        """The policy version the rollout engines hold."""
        self.training: int | None = None
        """The version an update is now training, or None."""
        self.samples: dict[str, Sample] = {}
        """Every record not yet retired, by sample id."""
        self._flight: dict[str, _Flight] = {}
        self._trajectories: dict[str, _Trajectory] = {}  # trajectory id -> its tree, until retired
        self._waiting: deque[Problem] = deque()
        self._admitted_at: dict[int, int] = {}  # version -> problems admitted while it was current
        self._queue: list[str] = []  # group ids complete and not yet trained, in completion order
        self._groups: dict[str, list[str]] = {}
        self._trained: set[str] = set()
        self._unfinished: dict[str, int] = dict.fromkeys(graph.roles, 0)
        # per role: incomplete groups by the version their first segment was issued at (update_ready)
        self._open_oldest: dict[str, Counter[int]] = {r: Counter() for r in graph.roles}
        self._group_first: dict[str, int] = {}
        self._ready: dict[str, tuple[int, str]] = {}  # READY sample ids -> their order among new work
        self._trajectory = graph.trajectory(agents.max_steps)
        self._depth = {p.name: i for i, p in enumerate(self._trajectory)}
        self.counters = {"requeued": 0, "problems": 0, "spawned": 0}

    # ------------------------------------------------------------------------------------------ problems
    def add_problems(self, problems: Iterable[Problem]) -> None:
        self._waiting.extend(problems)

    def waiting(self) -> int:
        """Problems given but not yet started."""
        return len(self._waiting)

    def _admit(self) -> None:
        budget = self.limits.problems_per_step - self._admitted_at.get(self.version, 0)
        while budget > 0 and self._waiting:
            problem = self._waiting.popleft()
            key = f"{problem.problem_id}@{self.counters['problems']}"
            self._admitted_at[self.version] = self._admitted_at.get(self.version, 0) + 1
            self.counters["problems"] += 1
            self._trajectories[key] = _Trajectory(problem)
            self._spawn(self._trajectory[0].name, key, None)
            budget -= 1

    def _spawn(self, position: str, key: str, parent: Sample | None) -> None:
        tree = self._trajectories[key]
        problem = tree.problem
        inputs = PromptInputs.of(parent, self.samples, self.graph)
        judged = inputs.solution
        role = self.graph.position(position).role
        prompt = token_array(self.prompt_fn(position, problem, inputs))
        gid = group_id(key, position, parent.sample_id if parent else None)
        members = []
        for k in range(self.agents.group_size):
            sid = f"{gid}/{k}"
            if sid in self.samples:
                raise ValueError(f"sample id {sid!r} issued twice")
            self.samples[sid] = Sample(
                prompt,
                [],
                position,
                problem.problem_id,
                gid,
                behaviour_logprobs=[],
                sample_id=sid,
                trajectory_id=key,
                parent_id=parent.sample_id if parent else None,
                judged_id=judged.sample_id if judged else None,
                judged_right=None if judged is None else bool(judged.reward),
                role=role,
            )
            self._flight[sid] = _Flight()
            members.append(sid)
            self.counters["spawned"] += 1
            self._unfinished[role] += 1
            self._ready[sid] = (-self._depth[position], sid)
        self._groups[gid] = members
        tree.sample_ids.extend(members)
        tree.untrained += 1
        tree.position_left[position] = tree.position_left.get(position, 0) + len(members)
        tree.active += len(members)

    # ---------------------------------------------------------------------------------------- rollouts
    def take_segments(self, limit: int | None = None, roles: Iterable[str] | None = None) -> list[SegmentJob]:
        """Up to ``limit`` segments to decode now (of ``roles`` only, e.g. one policy's): carried-over
        sequences first, then later positions (they finish trajectories), then new work at the first
        position; admits
        new problems first."""
        self._admit()
        started = self._group_first

        def priority(sid: str) -> tuple[bool, bool, tuple[int, str]]:
            seq = self.samples[sid]
            return (len(seq.response_ids) == 0, seq.group_id not in started, self._ready[sid])

        order = sorted(self._ready, key=priority)
        jobs = []
        wanted = set(roles) if roles is not None else None
        for seq in (self.samples[sid] for sid in order):
            if limit is not None and len(jobs) >= limit:
                break
            if wanted is not None and seq.role not in wanted:
                continue
            if self.limits.max_staleness[seq.role] == 0 and self.training is not None:
                continue  # anything decoded now could only be trained by a later update
            jobs.append(self._issue(seq))
        return jobs

    def _issue(self, seq: Sample) -> SegmentJob:
        left = self.limits.max_response_tokens - len(seq.response_ids)
        flight = self._flight[seq.sample_id]
        flight.state = SeqState.DECODING
        del self._ready[seq.sample_id]
        flight.issued_version = self.version
        if flight.first_version is None:
            flight.first_version = self.version
        if seq.group_id not in self._group_first:
            self._group_first[seq.group_id] = self.version
            self._open_oldest[seq.role][self.version] += 1
        return SegmentJob(
            seq.sample_id,
            seq.role,
            seq.prompt_ids,
            seq.response_ids,
            min(self.limits.segment_tokens, left),
            derive_seed(self.seed, seq.sample_id, len(seq.segment_versions)),
            self.version,
        )

    def on_segment(
        self,
        sample_id: str,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        *,
        stopped: bool,
        version: int | None = None,
        routed_experts: np.ndarray | RoutingRef | None = None,
    ) -> bool:
        """Record a decoded segment; True when the sequence is finished (then score it).

        ``stopped``: the engine ended the sequence (end-of-turn or stop token) rather than the segment's
        token budget. ``version``: the policy version that decoded it, as the engine reports it (default:
        the version it was issued at). ``routed_experts``: the call's routing of every position it fed
        (``GenerationOutput.routed_experts``); it replaces the sequence's.
        """
        seq = self._expect(sample_id, SeqState.DECODING)
        flight = self._flight[sample_id]
        assert flight.issued_version is not None
        decoded_by = flight.issued_version if version is None else version
        seq.add_segment(token_ids, logprobs, decoded_by, routed_experts)
        flight.issued_version = None
        full = len(seq.response_ids) >= self.limits.max_response_tokens
        if stopped or full or not len(token_ids):
            seq.finish("stop" if stopped else "length")
            flight.state = SeqState.SCORING
            return True
        flight.state = SeqState.READY
        self._ready[seq.sample_id] = (-self._depth[seq.position], seq.sample_id)
        return False

    # ------------------------------------------------------------------------------------------ scoring
    def on_scored(
        self, sample_id: str, reward: float, verdict: bool | None = None, info: dict[str, float] | None = None
    ) -> None:
        """Record a finished sequence's reward (``info``: a reward function's notes for the metrics);
        completes groups and starts the next position."""
        seq = self._expect(sample_id, SeqState.SCORING)
        seq.reward, seq.verdict = reward, verdict
        if info:
            seq.reward_info = dict(info)
        seq.check_scores()
        self._flight[sample_id].state = SeqState.DONE
        self._unfinished[seq.role] -= 1
        pid = seq.trajectory_id
        tree = self._trajectories[pid]
        tree.active -= 1
        gid = seq.group_id
        if all(self._flight[m].state is SeqState.DONE for m in self._groups[gid]):
            if self.limits.whole_trajectories or self.graph.roles[seq.role].reward == "outcome":
                if gid not in tree.held:  # a tool-call group completes again when a later call joins it
                    tree.held.append(gid)
            else:
                self._enqueue(gid)
        tree.position_left[seq.position] -= 1
        if tree.position_left[seq.position] == 0:
            self._next_position(pid, seq.position)
        if tree.active == 0:
            self._resolve_outcomes(pid)
            held, tree.held = tree.held, []
            for complete in held:
                self._enqueue(complete)
            self._retire(pid)

    def _resolve_outcomes(self, pid: str) -> None:
        """``pid``'s tree is finished: its outputs rewarded by their outcome get it
        (:func:`~mars_megatron.rewards.scoring.outcome_rewards`)."""
        members = [self.samples[sid] for sid in self._trajectories[pid].sample_ids]
        for sid, reward in outcome_rewards(members, self.graph, self._depth).items():
            self.samples[sid].reward = reward

    def _enqueue(self, gid: str) -> None:
        """A group becomes trainable (it stays open for the staleness gate until then)."""
        self._queue.append(gid)
        self._open_oldest[self.samples[self._groups[gid][0]].role][self._group_first.pop(gid)] -= 1

    def _retire(self, pid: str) -> None:
        """Forget a problem whose sequences are all done and whose groups are all trained."""
        tree = self._trajectories.get(pid)
        if tree is None or tree.active > 0 or tree.untrained > 0:
            return
        del self._trajectories[pid]
        for sid in tree.sample_ids:
            seq = self.samples.pop(sid)
            del self._flight[sid]
            self._groups.pop(seq.group_id, None)

    def _next_position(self, key: str, position: str) -> None:
        later = self.graph.next_positions(position, self.agents.max_steps)
        if not later:
            return
        candidates = [self.samples[sid] for sid in self._trajectories[key].sample_ids]
        candidates = sorted((s for s in candidates if s.position == position), key=lambda s: s.sample_id)
        for nxt in later:
            rng = random.Random(derive_seed(self.seed, key, position, "select"))
            k = len(candidates) if nxt.inputs == "all" else nxt.inputs or self.agents.inputs_per_agent
            chosen = select_inputs(
                candidates,
                k,
                nxt.strategy or self.agents.strategy,
                rng,
                when=nxt.when,
                prefer=nxt.prefer,
                positive_share=nxt.positive_share,
            )
            for parent in chosen:
                self._spawn(nxt.name, key, parent)

    # ------------------------------------------------------------------------------------------ tool calls
    def call_out(self, sample_id: str, purpose: str, tool_output: str) -> str:
        """A finished turn of ``sample_id`` made a tool call (served: the tool ran, ``tool_output``): park
        the sequence (:attr:`SeqState.TOOL`) and start the distiller's sample that digests the output for
        ``purpose``; its id. The distillers served to one group of the caller's position form one group
        (their advantages compare digests written for the same problem); see ``ToolSpec`` in
        agents/graph.py."""
        seq = self._expect(sample_id, SeqState.SCORING)
        spec = self.graph.roles[seq.role].tool
        if spec is None or seq.tool_calls >= spec.max_calls:
            raise ValueError(f"call_out: {sample_id} ({seq.role}) may make no further tool call")
        (position,) = self.graph.tool_positions(seq.position, self.agents.max_steps)
        seq.finish_reason = None
        self._flight[sample_id].state = SeqState.TOOL
        key = seq.trajectory_id
        tree = self._trajectories[key]
        inputs = PromptInputs(seq, seq, None, (purpose, tool_output))
        prompt = token_array(self.prompt_fn(position.name, tree.problem, inputs))
        gid = group_id(key, position.name, seq.group_id)
        members = self._groups.setdefault(gid, [])
        if not members:
            tree.untrained += 1
        sid = f"{gid}/{len(members)}"
        self.samples[sid] = Sample(
            prompt,
            [],
            position.name,
            seq.problem_id,
            gid,
            behaviour_logprobs=[],
            sample_id=sid,
            trajectory_id=key,
            parent_id=sample_id,
            role=position.role,
        )
        self._flight[sid] = _Flight()
        members.append(sid)
        tree.sample_ids.append(sid)
        self.counters["spawned"] += 1
        self._unfinished[position.role] += 1
        self._ready[sid] = (-self._depth[position.name], sid)
        tree.position_left[position.name] = tree.position_left.get(position.name, 0) + 1
        tree.active += 1
        return sid

    def call_returned(self, sample_id: str, observation_ids: Sequence[int]) -> bool:
        """The digest of ``sample_id``'s call is written: append it (tokenised:
        :func:`~mars_megatron.agents.tools.observation`) to the response, masked out of the loss, and let
        the sequence continue. True when no token budget is left to go on: the response is cut (finish
        reason ``length``) and must be scored now."""
        seq = self._expect(sample_id, SeqState.TOOL)
        seq.add_observation(observation_ids, self.version)
        if len(seq.response_ids) >= self.limits.max_response_tokens:
            seq.finish("length")
            self._flight[sample_id].state = SeqState.SCORING
            return True
        self._flight[sample_id].state = SeqState.READY
        self._ready[sample_id] = (-self._depth[seq.position], sample_id)
        return False

    # ----------------------------------------------------------------------------------------- training
    def unfinished(self, roles: Iterable[str] | None = None) -> int:
        """Sequences not yet scored, of ``roles`` (default: all)."""
        return sum(self._unfinished[r] for r in (roles if roles is not None else self._unfinished))

    def update_ready(self) -> bool:
        """Whether the next update should start now (no side effects; see the module docstring)."""
        if self.training is not None or not self._queue:
            return False
        more_now = bool(self._waiting) and self._admission_open()  # problems this version still takes
        zero = [r for r, b in self.limits.max_staleness.items() if b == 0]
        if zero:
            return not (self.unfinished(zero) or more_now)
        # An update now would leave groups begun at version <= u - bound (a member decoded then) to
        # updates u + 1 and later: too stale. Wait for them (their sequences are decoded first).
        u = self.version
        for role, bound in self.limits.max_staleness.items():
            if any(n > 0 and v <= u - bound for v, n in self._open_oldest[role].items()):
                return False
        return len(self._queue) >= self.limits.batch_groups or not (self.unfinished() or more_now)

    def take_batch(self) -> Batch | None:
        """The next update's groups, or None if it should wait."""
        if not self.update_ready():
            return None
        zero = [r for r, b in self.limits.max_staleness.items() if b == 0]
        u = self.version
        chosen: list[list[Sample]] = []
        kept: list[str] = []
        for gid in self._queue:
            members = [self.samples[m] for m in self._groups[gid]]
            bound = self.limits.max_staleness[members[0].role]
            oldest = min((s.segment_versions[0].version for s in members if s.segment_versions), default=u)
            if u - oldest > bound:  # update_ready and the rule below make this impossible
                raise AssertionError(f"group {gid} is {u - oldest} versions old, bound {bound}")
            if len(chosen) < self.limits.batch_groups or zero or u + 1 - oldest > bound:
                chosen.append(members)
            else:
                kept.append(gid)
        self._queue = kept
        if not chosen:
            return None
        # One order for the same data whatever the timing (packing, and so the numerics, follow it):
        # by admission, then position, then group id.
        chosen.sort(key=lambda g: (_admission(g[0].trajectory_id), self._depth[g[0].position], g[0].group_id))
        self.training = u
        for members in chosen:
            for seq in members:
                if seq.sample_id in self._trained:
                    raise AssertionError(f"{seq.sample_id} would be trained twice")
                self._trained.add(seq.sample_id)
        return Batch(u, chosen)

    def _settle(self, pid: str) -> None:
        self._trajectories[pid].untrained -= 1
        self._retire(pid)

    def _admission_open(self) -> bool:
        return self._admitted_at.get(self.version, 0) < self.limits.problems_per_step

    def on_trained(self) -> None:
        """The running update finished: the engines now hold ``version + 1``."""
        if self.training is None:
            raise RuntimeError("on_trained: no update is running")
        self.training = None
        self.version += 1

    def release(self, batch: Batch) -> None:
        """The driver is done with ``batch``'s sequences (samples built): let finished problems go."""
        for members in batch.groups:
            self._settle(members[0].trajectory_id)

    # ---------------------------------------------------------------------------------- fault tolerance
    def requeue(self, sample_ids: Iterable[str]) -> None:
        """Sequences whose segment or score was lost with a worker: back to where they were before."""
        for sid in sample_ids:
            seq, flight = self.samples[sid], self._flight[sid]
            if flight.state is SeqState.DECODING:
                flight.state = SeqState.READY
                flight.issued_version = None
                if not seq.segment_versions:  # its first segment was lost (the group keeps its start version)
                    flight.first_version = None
                self._ready[sid] = (-self._depth[seq.position], sid)
            elif flight.state is not SeqState.SCORING:  # SCORING stays: the driver sends it to score again
                raise ValueError(f"requeue: {sid} is {flight.state.value}, not in flight")
            self.counters["requeued"] += 1

    def idle(self) -> bool:
        """Nothing left to decode, score or train, and no problem waiting."""
        return not self._waiting and not self.unfinished() and not self._queue and self.training is None

    @property
    def trained(self) -> int:
        """Samples handed to updates so far (each at most once)."""
        return len(self._trained)

    def census(self) -> dict[str, int]:
        """Every sample ever started is trained, scored and waiting (for its group or an update), or not
        yet scored."""
        trained = len(self._trained)
        done = sum(1 for f in self._flight.values() if f.state is SeqState.DONE) - sum(
            1 for sid in self._trained if sid in self.samples
        )
        return {
            "spawned": self.counters["spawned"],
            "trained": trained,
            "scored": done,
            "unfinished": self.unfinished(),
        }

    def check(self) -> None:
        """Nothing lost or counted twice (:meth:`census` adds up); groups are whole and distinct; every
        trained sample was done when it was trained."""
        c = self.census()
        if c["spawned"] != c["trained"] + c["scored"] + c["unfinished"]:
            raise AssertionError(f"sample count mismatch: {c}")
        seen: set[str] = set()
        for gid, members in self._groups.items():
            per_call = self.graph.position(self.samples[members[0]].position).trigger == "tool_call"
            if (not per_call and len(members) != self.agents.group_size) or seen.intersection(members):
                raise AssertionError(f"group {gid}: {members}")
            seen.update(members)
        for sid in self._trained:
            flight = self._flight.get(sid)
            if flight is not None and flight.state is not SeqState.DONE:
                raise AssertionError(f"{sid} was trained but is {flight.state.value}")

    # -------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this schedule in a new process (between updates): each record's
        :meth:`~mars_megatron.agents.sample.Sample.state` with its problem and where it stands. A segment
        out at a worker is not saved: its sequence resumes from its recorded segments (as if the worker
        had died); scores out are redone. Routing left in engines' object stores is fetched to be saved."""
        if self.training is not None:
            raise RuntimeError("Scheduler.state_dict: an update is running; save between updates")
        fetch_routing(self.samples.values())
        seqs = []
        for q in self.samples.values():
            f = self._flight[q.sample_id]
            seqs.append(
                {
                    **q.state(),
                    "problem": _problem_state(self.problem(q)),
                    "state": (SeqState.READY if f.state is SeqState.DECODING else f.state).value,
                    "first_version": f.first_version
                    if q.segment_versions or f.state is SeqState.DONE
                    else None,
                }
            )
        return {
            "graph": self.graph.name,
            "version": self.version,
            "seqs": seqs,
            "groups": dict(self._groups),
            "waiting": [_problem_state(p) for p in self._waiting],
            "admitted_at": dict(self._admitted_at),
            "queue": list(self._queue),
            "trained": sorted(self._trained),
            "group_first": dict(self._group_first),
            "held": {k: list(tree.held) for k, tree in self._trajectories.items() if tree.held},
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the schedule :meth:`state_dict` saved, in this fresh scheduler built with the same
        config; its indices are rebuilt from the records and checked (:meth:`check`)."""
        if self.samples or self._waiting or self.version:
            raise RuntimeError("Scheduler.load_state_dict: the scheduler is not fresh")
        saved = state.get("graph", "marsrl")  # checkpoints from before agent graphs ran MarsRL's
        if saved != self.graph.name:
            raise ValueError(
                f"the checkpoint's rollouts are of agent graph {saved!r}, this run's agents.graph is "
                f"{self.graph.name!r}: resume with the graph that made them"
            )
        self.version = int(state["version"])
        for d in state["seqs"]:
            problem = Problem(**d["problem"])
            key = d["key"]
            # before graphs, a record's role was its position's
            q = Sample.from_state(d, problem.problem_id, self.graph.position(str(d["position"])).role)
            state_ = SeqState(d["state"])
            self.samples[q.sample_id] = q
            self._flight[q.sample_id] = _Flight(state_, d["first_version"])
            tree = self._trajectories.setdefault(key, _Trajectory(problem))
            tree.sample_ids.append(q.sample_id)
            if state_ is not SeqState.DONE:
                self._unfinished[q.role] += 1
                tree.active += 1
                tree.position_left[q.position] = tree.position_left.get(q.position, 0) + 1
            else:
                tree.position_left.setdefault(q.position, 0)
            if state_ is SeqState.READY:
                self._ready[q.sample_id] = (-self._depth[q.position], q.sample_id)
        for q in self.samples.values():  # checkpoints from before the record carried it
            if q.judged_id is not None and q.judged_right is None:
                q.judged_right = bool(self.samples[q.judged_id].reward)
        self._groups = {g: list(m) for g, m in state["groups"].items()}
        self._trained = set(state["trained"])
        for members in self._groups.values():
            key = self.samples[members[0]].trajectory_id
            if not all(m in self._trained for m in members):
                self._trajectories[key].untrained += 1
        self._waiting.extend(Problem(**p) for p in state["waiting"])
        self._admitted_at = {int(k): int(v) for k, v in state["admitted_at"].items()}
        self._queue = list(state["queue"])
        self._group_first = {g: int(v) for g, v in state["group_first"].items()}
        for key, held in state.get("held", {}).items():
            self._trajectories[key].held = list(held)
        for gid, version in self._group_first.items():
            self._open_oldest[self.samples[self._groups[gid][0]].role][version] += 1
        self.counters.update(state["counters"])
        self.check()

    def _expect(self, sample_id: str, state: SeqState) -> Sample:
        seq = self.samples.get(sample_id)
        if seq is None:
            raise KeyError(f"unknown sample id {sample_id!r}")
        if self._flight[sample_id].state is not state:
            raise ValueError(
                f"{sample_id}: expected state {state.value}, it is {self._flight[sample_id].state.value}"
            )
        return seq

    # ------------------------------------------------------------------------------------------- views
    def state(self, sample_id: str) -> SeqState:
        """Where the record ``sample_id`` is in the schedule."""
        return self._flight[sample_id].state

    def first_version(self, sample_id: str) -> int | None:
        """The policy version the first segment of ``sample_id`` was issued at (None until then)."""
        return self._flight[sample_id].first_version

    def problem(self, sample: Sample) -> Problem:
        """The problem of ``sample``'s trajectory (its text and reference)."""
        return self._trajectories[sample.trajectory_id].problem

    # ---------------------------------------------------------------------------------------- metrics
    def stats(self) -> dict[str, Any]:
        by_state: dict[str, int] = {}
        for f in self._flight.values():
            by_state[f.state.value] = by_state.get(f.state.value, 0) + 1
        return {**self.counters, **{f"seqs/{k}": v for k, v in by_state.items()}, "queue": len(self._queue)}


def _admission(key: str) -> int:
    return int(key.rsplit("@", 1)[1])


# -------------------------------------------------------------------------------------------- checkpoints
def _problem_state(p: Problem) -> dict[str, Any]:
    state = {"problem_id": p.problem_id, "text": p.text, "reference": p.reference, "line": p.line}
    return {**state, "extra": p.extra} if p.extra else state  # checkpoints of tasks without extra: as before
