"""The schedule on Ray, for both ``pipeline.mode`` values: the :class:`~.scheduler.Scheduler` driving
rollout workers, reward workers and the trainer group at once.

The driver owns no heavy work. It asks the scheduler for segments and hands them to idle rollout workers
(:class:`~mars_megatron.rollout.ray_engine.RolloutActor`, one engine each), sends finished outputs to
reward workers (:class:`RewardActor`), and starts an update on the trainer group whenever the scheduler
says one is due, all without blocking: ``ray.wait`` on whatever is in flight, and react to the first
result. So rollouts go on while the trainer trains (where the staleness bounds allow it: not at all in
sync mode), and every output reaches the training queue the moment its reward is known.

Versions: a rollout worker reports the policy version its engine held for each call (an actor runs one call
at a time, so a call never straddles a weight update), and that is what the segment records. Engines are
reached through the run's :class:`~.fleet.EngineFleet`, which pushes the weights into every engine after
each update (``finish_train``). Colocated engines (``pipeline.placement=colocated``) sleep before the update
with their weights discarded, then wake their weights, take the push, and only then wake their KV cache
(:class:`~mars_megatron.rollout.engine.Sleepable`).

Failures: a rollout or reward worker that dies is replaced by a new actor (a rollout worker gets the
current weights from the fleet at once, or at the next push if the trainer is busy; it takes no work
before) and the work it held is requeued from its last recorded state; the scheduler's counts
are checked after every update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mars_megatron.agents.roles import Role
from mars_megatron.algorithm.sample import Sample
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.agents import (
    RewardItem,
    batch_metrics,
    record_outputs,
    reward_item,
    score_items,
    segment_request,
)
from mars_megatron.pipeline.fleet import EngineFleet
from mars_megatron.pipeline.scheduler import Batch, Scheduler, shared_rewards
from mars_megatron.rollout.engine import SamplingParams


class RewardActor:
    """Body of a reward worker (wrap with ``ray.remote``): math-verify answers and parsed verdicts."""

    def __init__(self) -> None:
        from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig

        self.checker = AnswerChecker(CheckerConfig(num_workers=1))

    def score(self, items: Sequence[RewardItem]) -> list[tuple[str, float, bool | None]]:
        return score_items(items, self.checker)

    def ping(self) -> bool:
        return True


@dataclass
class _InFlight:
    kind: str  # "rollout" | "reward" | "train" | "train-rank"
    worker: int = -1
    payload: Any = None


class PipelineDriver:
    """Runs the schedule; :meth:`run_update` returns when the next update has finished.

    ``fleet``: the rollout engines and their weight pushes; ``start_reward`` builds a replacement reward
    actor after a death. ``train``: submits one update's samples (per policy) to the
    trainer group and returns the handles to wait on; ``finish_train`` turns their results into metrics
    and pushes the new weights (into every engine: ``colocated`` engines wake their weights before it
    and their KV cache after it).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        fleet: EngineFleet,
        policy_of: Callable[[Role], str],
        start_reward: Callable[[], Any],
        reward_workers: int,
        decode: Callable[[Sequence[int]], str],
        sampling: SamplingParams,
        feed: Callable[[], list[Problem]],
        train: Callable[[dict[str, list[Sample]]], list[Any]],
        finish_train: Callable[[list[Any]], dict[str, float]],
        samples_for: Callable[
            [Batch, Mapping[str, float] | None], tuple[dict[str, list[Sample]], dict[str, float]]
        ],
        max_batch: int,
        colocated: bool = False,
        shared_reward: bool = False,
        log: Callable[[str], None] = print,
    ) -> None:
        self.s = scheduler
        self.log = log
        self.fleet = fleet
        self.policy_of = policy_of
        self.start_reward = start_reward
        self.rewards = [start_reward() for _ in range(reward_workers)]
        self.decode = decode
        self.sampling = sampling
        self.feed = feed
        self.train = train
        self.finish_train = finish_train
        self.samples_for = samples_for
        self.max_batch = max_batch
        self.colocated = colocated
        """Engines share devices with the trainer: they finish their segments, sleep through the update
        (weights and KV cache freed) and wake around the weight sync: weights, push, KV cache (no
        overlap)."""
        self.shared_reward = shared_reward
        """Train every output on its trajectory's outcome (the scheduler holds groups until their
        trajectory tree is scored: ``Limits.whole_trajectories``)."""
        self.flight: dict[Any, _InFlight] = {}
        self.to_score: list[str] = []
        self.judged_right: dict[str, bool] = {}
        self.busy_rollout: set[int] = set()
        self.busy_reward: set[int] = set()
        self.train_handles: list[Any] | None = None
        self.counters = {"rollout_restarts": 0, "reward_restarts": 0, "segments_during_update": 0}
        self._train_started = 0.0

    # ------------------------------------------------------------------------------------------ dispatch
    def _dispatch(self, rollouts: bool = True) -> None:
        if self.s.waiting() < self.s.limits.problems_per_step:
            self.s.add_problems(self.feed())
        for w, (name, engine) in enumerate(self.fleet.engines if rollouts else []):
            if w in self.busy_rollout or w in self.fleet.stale:
                continue
            jobs = self.s.take_segments(self.max_batch, roles=self._roles_of(name))
            if not jobs:
                continue
            ref = engine.actor.generate_versioned.remote([segment_request(j, self.sampling) for j in jobs])
            self.flight[ref] = _InFlight("rollout", w, jobs)
            self.busy_rollout.add(w)
        while self.to_score:
            free = [i for i in range(len(self.rewards)) if i not in self.busy_reward]
            if not free:
                break
            w = free[0]
            items = [self._reward_item(sid) for sid in self.to_score]
            ref = self.rewards[w].score.remote(items)
            self.flight[ref] = _InFlight("reward", w, list(self.to_score))
            self.busy_reward.add(w)
            self.to_score = []

    def _roles_of(self, name: str) -> set[Role]:
        return {r for r in Role if self.policy_of(r) == name}

    def _reward_item(self, sid: str) -> RewardItem:
        item = reward_item(self.s, sid)
        if self.s.seqs[sid].judged_id is not None:
            self.judged_right[sid] = item[4]
        return item

    # ----------------------------------------------------------------------------------------- results
    def _on_rollout(self, item: _InFlight, result: tuple[list[Any], int]) -> None:
        outputs, version = result
        self.busy_rollout.discard(item.worker)
        self.to_score.extend(record_outputs(self.s, item.payload, outputs, self.decode, version))

    def _on_reward(self, item: _InFlight, results: list[tuple[str, float, bool | None]]) -> None:
        self.busy_reward.discard(item.worker)
        for sid, reward, verdict in results:
            self.s.on_scored(sid, self.s.seqs[sid].text, reward, verdict)

    def _lost(self, item: _InFlight) -> None:
        """The worker of ``item`` died: replace it and put its work back."""
        if item.kind == "rollout":
            self.counters["rollout_restarts"] += 1
            # the trainer must be idle to send the weights now; otherwise the next push brings them
            self.fleet.replace(item.worker, push=self.train_handles is None)
            name = self.fleet.engines[item.worker][0]
            self._log_restart(item.worker, name)
            self.busy_rollout.discard(item.worker)
            self.s.requeue(job.sample_id for job in item.payload)
        else:
            self.counters["reward_restarts"] += 1
            self.rewards[item.worker] = self.start_reward()
            self.busy_reward.discard(item.worker)
            self.s.requeue(item.payload)
            self.to_score.extend(item.payload)

    def _log_restart(self, worker: int, name: str) -> None:
        version = self.fleet.versions.get(name)
        when = "at the next push" if worker in self.fleet.stale else f"at policy version {version}"
        self.log(f"rollout worker {worker} ({name}) died: restarted, weights {when}")

    # -------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The schedule between updates (work out at workers resumes from its last recorded segment)."""
        from mars_megatron.pipeline.scheduler import scheduler_state

        return {"scheduler": scheduler_state(self.s), "counters": dict(self.counters)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from mars_megatron.pipeline.scheduler import SeqState, restore_scheduler

        restore_scheduler(self.s, state["scheduler"])
        self.counters.update(state["counters"])
        self.to_score = [sid for sid, q in self.s.seqs.items() if q.state is SeqState.SCORING]
        for sid, q in self.s.seqs.items():
            if q.state is SeqState.DONE and q.judged_id is not None:
                self.judged_right[sid] = bool(self.s.seqs[q.judged_id].reward)

    # -------------------------------------------------------------------------------------------- loop
    def run_update(self) -> dict[str, float]:
        """Drive everything until one update has finished; returns its metrics."""
        import ray

        t0 = time.perf_counter()
        batch: Batch | None = None
        stats: dict[str, float] = {}
        training: Mapping[str, float] | None = None
        while True:
            due = self.train_handles is None and self.s.update_ready()
            self._dispatch(rollouts=not (self.colocated and (due or self.train_handles is not None)))
            if due and not (self.colocated and self.busy_rollout):
                if self.colocated:
                    self.fleet.sleep()
                batch = self.s.take_batch()
                assert batch is not None
                training = shared_rewards(self.s, batch.seqs) if self.shared_reward else None
                samples, stats = self.samples_for(batch, training)
                self.train_handles = self.train(samples)
                self.flight[self.train_handles[0]] = _InFlight("train", payload=batch)
                for h in self.train_handles[1:]:
                    self.flight[h] = _InFlight("train-rank", payload=batch)
                self._train_started = time.perf_counter()
            if not self.flight:  # the problem stream never ends, so nothing to wait on is a bug
                raise RuntimeError(f"pipeline stalled with nothing in flight: {self.s.stats()}")
            ready, _ = ray.wait(list(self.flight), num_returns=1)
            ref = ready[0]
            item = self.flight.pop(ref)
            if item.kind == "train-rank":
                continue
            if item.kind == "train":
                rest = [h for h in self.train_handles or [] if h is not ref]
                for h in rest:
                    self.flight.pop(h, None)
                results = [ray.get(ref), *ray.get(rest)]
                train_s = time.perf_counter() - self._train_started
                # Colocated engines slept with their weights discarded: give the weights their memory
                # back, push the new ones (finish_train), and only then allocate the KV cache, so the
                # device never holds the cache before the weights are in.
                if self.colocated:
                    self.fleet.wake_weights()
                metrics = self.finish_train(results)
                if self.colocated:
                    self.fleet.wake()
                done = item.payload
                self.s.on_trained()
                self.s.release(done)
                self.s.check()
                self.train_handles = None
                step_s = time.perf_counter() - t0
                metrics.update(batch_metrics(done, self.judged_right, training))
                metrics.update(stats)
                metrics.update(
                    {
                        "time/step": step_s,
                        "time/train": train_s,
                        "pipeline/trainer_busy": min(1.0, train_s / step_s) if step_s > 0 else 0.0,
                        "pipeline/queue_groups": float(self.s.stats()["queue"]),
                        "pipeline/rollout_restarts": float(self.counters["rollout_restarts"]),
                        "pipeline/reward_restarts": float(self.counters["reward_restarts"]),
                        "pipeline/segments_during_update": float(self.counters["segments_during_update"]),
                        "pipeline/requeued": float(self.s.counters["requeued"]),
                        "pipeline/trained_total": float(self.s.census()["trained"]),
                    }
                )
                for sid in [q.sample_id for q in done.seqs]:
                    self.judged_right.pop(sid, None)
                return metrics
            try:
                result = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                self._lost(item)
                continue
            if item.kind == "rollout":
                if self.train_handles is not None:
                    self.counters["segments_during_update"] += 1
                self._on_rollout(item, result)
            else:
                self._on_reward(item, result)
