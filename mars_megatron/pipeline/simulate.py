"""A discrete-event simulation of the pipeline: the real :class:`~.scheduler.Scheduler` on a virtual clock.

Why: the agentic pipeline's pay-off depends on long-tail response lengths and on how decode and training
costs compare, which a CPU machine cannot show at paper scale (G = 8, 64k-token responses, 5 positions).
The simulation keeps every scheduling decision real — admission, segments, carry-over, selection of the
next agent's inputs, group completion, staleness, batching — and replaces only the work: a segment takes
``steps x step_time(batch)`` (decoding is one forward per token for the whole batch, whose cost grows
slowly with the batch), an update takes ``train_s_per_token x tokens``, a weight sync ``sync_s``.
Response lengths come from a seeded long-tail distribution per role, rewards from seeded coin flips with
a per-role accuracy.

Placement: ``disaggregated`` rollout workers keep decoding while the trainer trains (separate devices);
``colocated`` workers stop for every update (engines sleep, the trainer takes the devices).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from mars_megatron.agents.sample import Sample
from mars_megatron.agents.trajectory import PromptInputs
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.scheduler import Batch, PromptFn, Scheduler, SegmentJob
from mars_megatron.seeds import derive_seed

Placement = Literal["disaggregated", "colocated"]


@dataclass(frozen=True)
class Costs:
    """Seconds of the simulated work."""

    decode_step_s: float
    """One decode step (one token for every sequence of a batch) at batch size 1."""
    decode_step_per_seq_s: float
    """Extra seconds per decode step for each further sequence in the batch."""
    train_s_per_token: float
    """Update time per trained token (prompt + response), forward, backward and optimizer."""
    sync_s: float = 0.0
    """Weight sync after each update."""


@dataclass(frozen=True)
class Lengths:
    """Response lengths: log-normal around ``median`` (tokens) with ``sigma``, capped by the scheduler."""

    median: Mapping[str, float]
    """By role of the graph."""
    sigma: float = 0.8
    prompt_tokens: int = 512
    """The problem statement and instructions."""
    max_input_tokens: int = 32768
    """Cap of a prompt that carries earlier outputs (the solution judged, the report)."""

    def draw(self, seq: Sample, seed: int) -> int:
        rng = random.Random(derive_seed(seed, seq.sample_id, "length"))
        return max(1, int(self.median[seq.role] * math.exp(self.sigma * rng.gauss(0.0, 1.0))))


@dataclass
class SimResult:
    wall_s: float
    updates: int
    samples: int
    """Samples trained."""
    tokens: int
    train_busy_s: float
    rollout_busy_s: float
    """Summed over workers."""
    workers: int
    counters: dict[str, int] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    """Per trained sample: the update's version minus the sample's oldest segment version."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def trainer_idle(self) -> float:
        return 1.0 - self.train_busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rollout_idle(self) -> float:
        total = self.wall_s * self.workers
        return 1.0 - self.rollout_busy_s / total if total > 0 else 0.0


def simple_prompts(lengths: Lengths) -> PromptFn:
    """Prompts of the right length for the simulation (placeholder ids: their content never matters): the
    problem, plus the solution judged and, for a revision, the report that judged it, up to
    ``max_input_tokens``."""

    def prompt_fn(position: str, problem: Problem, inputs: PromptInputs) -> list[int]:
        carried = sum(len(q.response_ids) for q in (inputs.solution, inputs.report) if q is not None)
        return [0] * min(lengths.prompt_tokens + carried, lengths.max_input_tokens)

    return prompt_fn


class Simulation:
    """Drives ``scheduler`` with ``workers`` rollout engines of ``worker_batch`` sequences each."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        workers: int,
        worker_batch: int,
        costs: Costs,
        lengths: Lengths,
        accuracy: Mapping[str, float],
        placement: Placement = "disaggregated",
        seed: int = 0,
    ) -> None:
        if workers < 1 or worker_batch < 1:
            raise ValueError("Simulation: workers and worker_batch must be >= 1")
        self.scheduler = scheduler
        self.workers = workers
        self.worker_batch = worker_batch
        self.costs = costs
        self.lengths = lengths
        self.accuracy = accuracy
        self.placement = placement
        self.seed = seed
        self.batches: list[Batch] = []

    def _step_time(self, batch: int) -> float:
        return self.costs.decode_step_s + self.costs.decode_step_per_seq_s * (batch - 1)

    def _decode(self, jobs: list[SegmentJob]) -> tuple[float, list[tuple[SegmentJob, int, bool]]]:
        out = []
        for job in jobs:
            seq = self.scheduler.samples[job.sample_id]
            target = self.lengths.draw(seq, self.seed)
            n = min(job.max_tokens, max(0, target - len(seq.response_ids)))
            out.append((job, n, len(seq.response_ids) + n >= target))
        steps = max((n for _, n, _ in out), default=0)
        return steps * self._step_time(len(jobs)), out

    def _score(self, seq: Sample) -> tuple[float, bool | None]:
        rng = random.Random(derive_seed(self.seed, seq.sample_id, "reward"))
        right = rng.random() < self.accuracy[seq.role]
        if not self.scheduler.graph.roles[seq.role].decides:
            return float(right), None
        judged = self.scheduler.samples[seq.judged_id or ""]
        truth = bool(judged.reward)
        verdict = truth if right else not truth
        return float(right), verdict

    def run(self, updates: int, *, max_wall_s: float = math.inf) -> SimResult:
        """Simulate until ``updates`` updates have finished (or the data runs out)."""
        clock = 0.0
        events: list[tuple[float, int, str, object]] = []  # (time, tiebreak, kind, payload)
        tick = 0
        free = list(range(self.workers))
        training = False
        done_updates = 0
        train_busy = rollout_busy = 0.0
        samples = tokens = 0
        staleness: list[int] = []

        def push(at: float, kind: str, payload: object) -> None:
            nonlocal tick
            tick += 1
            heapq.heappush(events, (at, tick, kind, payload))

        colocated = self.placement == "colocated"

        def dispatch() -> None:
            nonlocal training, rollout_busy
            update_due = not training and self.scheduler.update_ready()
            if update_due and colocated and len(free) < self.workers:
                return  # colocated: let the engines finish their segments, then they sleep
            if update_due:
                batch = self.scheduler.take_batch()
                assert batch is not None
                training = True
                n_tokens = sum(len(q.prompt_ids) + q.response_len for q in batch.samples)
                cost = self.costs.train_s_per_token * n_tokens + self.costs.sync_s
                self.batches.append(batch)
                push(clock + cost, "trained", (batch, cost, n_tokens))
            if colocated and training:
                return  # engines asleep while the trainer holds the devices
            while free:
                jobs = self.scheduler.take_segments(self.worker_batch)
                if not jobs:
                    break
                worker = free.pop()
                seconds, results = self._decode(jobs)
                rollout_busy += seconds
                push(clock + seconds, "decoded", (worker, results))

        dispatch()
        while events and done_updates < updates and clock < max_wall_s:
            clock, _, kind, payload = heapq.heappop(events)
            if kind == "decoded":
                worker, results = payload  # type: ignore[misc]
                free.append(worker)
                for job, n, stopped in results:
                    ids = [1] * n
                    if self.scheduler.on_segment(job.sample_id, ids, [-1.0] * n, stopped=stopped):
                        reward, verdict = self._score(self.scheduler.samples[job.sample_id])
                        self.scheduler.on_scored(job.sample_id, reward, verdict)
            elif kind == "trained":
                batch, cost, n_tokens = payload  # type: ignore[misc]
                train_busy += cost
                samples += len(batch.samples)
                tokens += n_tokens
                staleness.extend(batch.version - (q.oldest_version or batch.version) for q in batch.samples)
                self.scheduler.on_trained()
                self.scheduler.release(batch)
                training = False
                done_updates += 1
            dispatch()
        self.scheduler.check()
        return SimResult(
            wall_s=clock,
            updates=done_updates,
            samples=samples,
            tokens=tokens,
            train_busy_s=train_busy,
            rollout_busy_s=rollout_busy,
            workers=self.workers,
            counters=dict(self.scheduler.counters),
            staleness=staleness,
        )
