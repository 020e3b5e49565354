"""The schedule on Ray, for both ``pipeline.mode`` values: the :class:`~.scheduler.Scheduler` driving
rollout workers, reward workers and the trainer group at once.

The driver owns no heavy work. It asks the scheduler for segments and hands them to idle rollout workers
(:class:`~mars_megatron.rollout.ray_engine.RolloutActor`, one engine each), sends finished outputs to
reward workers (:class:`~.facades.RewardPool`), and starts an update on the trainer group
(:class:`~.facades.TrainerGroup`) whenever the scheduler says one is due, all without blocking:
``ray.wait`` on whatever is in flight, and react to the first result. So rollouts go on while the
trainer trains (where the staleness bounds allow it: not at all in sync mode), and every output reaches
the training queue the moment its reward is known.

Versions: a rollout worker reports the policy version its engine held for each call (an actor runs one call
at a time, so a call never straddles a weight update), and that is what the segment records. Engines are
reached through the run's :class:`~.fleet.EngineFleet`, which pushes the weights into every engine after
each update (:meth:`~.facades.TrainerGroup.finish`). Colocated engines (``pipeline.placement=colocated``)
sleep before the update with their weights discarded, then wake their weights, take the push, and only
then wake their KV cache (:class:`~mars_megatron.rollout.engine.Sleepable`).

Failures: a rollout or reward worker that dies is replaced by a new actor (a rollout worker gets the
current weights from the fleet at once, or at the next push if the trainer is busy; it takes no work
before) and the work it held is requeued from its last recorded state; the scheduler's counts
are checked after every update. Every call in flight has a deadline (:class:`Deadlines`): a rollout or
reward worker past it counts as hung (a stopped process, a wedged library) and is killed, then handled
as a dead one. A trainer rank cannot be replaced alone (the others wait for it in a collective): an
update past its deadline raises :class:`TrainerLost` naming the ranks (a rank's death raises the error
Ray or the rank reported, which the trainer tells apart from a fault in the code:
:meth:`~.trainer.MarsRLTrainer.lost_if_dead`), and the trainer rebuilds the whole group from its last
checkpoint with a new driver (:meth:`~.trainer.MarsRLTrainer.recover`): what was in flight is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars_megatron.algorithm.advantages import assign_advantages, balance_roles
from mars_megatron.pipeline.agents import (
    batch_metrics,
    record_outputs,
    score_request,
    set_shared_rewards,
    write_rollouts,
)
from mars_megatron.pipeline.contexts import ContextIndex
from mars_megatron.pipeline.facades import ProblemFeed, RewardPool, TrainerGroup
from mars_megatron.pipeline.fleet import EngineFleet
from mars_megatron.pipeline.scheduler import Batch, Scheduler
from mars_megatron.rollout.batch import ContextLostError, OutputBatch
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.rollout.engine import SamplingParams


@dataclass(frozen=True)
class Deadlines:
    """Seconds a call of each kind may take (``pipeline.rollout_timeout_s``, ``reward_timeout_s``,
    ``train_timeout_s``)."""

    rollout_s: float = 3600.0
    reward_s: float = 600.0
    train_s: float = 7200.0

    def of(self, kind: str) -> float:
        return {"rollout": self.rollout_s, "reward": self.reward_s}.get(kind, self.train_s)


_SETTING = {"rollout": "rollout_timeout_s", "reward": "reward_timeout_s"}


class TrainerLost(RuntimeError):
    """Trainer ranks died (``reason`` "died"), stopped answering ("hung") or were cut off ("unreachable")
    during an update: the group cannot go on, and nothing of the update is kept."""

    def __init__(self, message: str, ranks: list[int], reason: str) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.reason = reason


@dataclass
class _InFlight:
    kind: str  # "rollout" | "reward" | "train" (one trainer rank's share of an update)
    worker: int = -1  # the rollout or reward worker; the trainer rank of a "train" call
    payload: Any = None
    due: float = float("inf")  # time.monotonic() by which it must have answered


class PipelineDriver:
    """Runs the schedule; :meth:`run_update` returns when the next update has finished.

    It talks to typed handles: ``fleet`` (the rollout engines and their weight pushes), ``trainers`` (an
    update's samples in, its metrics out, the new weights pushed: ``colocated`` engines wake their weights
    before the push and their KV cache after it), ``rewards`` (the reward workers) and ``problems``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        fleet: EngineFleet,
        trainers: TrainerGroup,
        rewards: RewardPool,
        problems: ProblemFeed,
        codec: ChatCodec,
        sampling: SamplingParams,
        max_batch: int,
        colocated: bool = False,
        shared_reward: bool = False,
        filter_zero_variance: bool = False,
        rollouts_dir: Path | None = None,
        deadlines: Deadlines | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.scheduler = scheduler
        self.deadlines = deadlines or Deadlines()
        self.log = log
        self.fleet = fleet
        self.trainers = trainers
        self.rewards = rewards
        self.problems = problems
        self.codec = codec
        self.sampling = sampling
        self.max_batch = max_batch
        self.colocated = colocated
        """Engines share devices with the trainer: they finish their segments, sleep through the update
        (weights and KV cache freed) and wake around the weight sync: weights, push, KV cache (no
        overlap)."""
        self.shared_reward = shared_reward
        """Train every output on its trajectory's outcome (the scheduler holds groups until their
        trajectory tree is scored: ``Limits.whole_trajectories``)."""
        self.filter_zero_variance = filter_zero_variance
        """Leave out the groups whose rewards are all equal (``algorithm.filter_zero_variance``)."""
        self.rollouts_dir = rollouts_dir
        """Where each update's outputs are written, one JSON line each (``logging.rollouts``); None: not."""
        self.flight: dict[Any, _InFlight] = {}
        self.contexts = ContextIndex()
        """Where each continuing sequence's context is in the object store (its next request names it)."""
        self.to_score: list[str] = []
        self.busy_rollout: set[int] = set()
        self.busy_reward: set[int] = set()
        self.train_handles: list[Any] | None = None
        self._train_results: dict[int, Any] = {}  # the update's rank results received so far
        self.counters = {
            "rollout_restarts": 0,
            "reward_restarts": 0,
            "rollout_timeouts": 0,
            "reward_timeouts": 0,
            "segments_during_update": 0,
        }
        self._train_started = 0.0

    # ------------------------------------------------------------------------------------------ dispatch
    def _dispatch(self, rollouts: bool = True) -> None:
        if self.scheduler.waiting() < self.scheduler.limits.problems_per_step:
            self.scheduler.add_problems(self.problems.take())
        for w, (name, engine) in enumerate(self.fleet.engines if rollouts else []):
            if w in self.busy_rollout or w in self.fleet.stale:
                continue
            jobs = self.scheduler.take_segments(self.max_batch, roles=self.trainers.roles_of(name))
            if not jobs:
                continue
            ref = engine.actor.generate_versioned.remote(self.contexts.request_batch(jobs, self.sampling))
            self.flight[ref] = self._in_flight("rollout", w, jobs)
            self.busy_rollout.add(w)
        while self.to_score:
            free = [i for i in range(len(self.rewards)) if i not in self.busy_reward]
            if not free:
                break
            w = free[0]
            requests = [score_request(self.scheduler, sid) for sid in self.to_score]
            ref = self.rewards.score(w, requests)
            self.flight[ref] = self._in_flight("reward", w, list(self.to_score))
            self.busy_reward.add(w)
            self.to_score = []

    def _in_flight(self, kind: str, worker: int, payload: Any) -> _InFlight:
        return _InFlight(kind, worker, payload, time.monotonic() + self.deadlines.of(kind))

    # ----------------------------------------------------------------------------------------- results
    def _on_rollout(self, item: _InFlight, result: tuple[OutputBatch, int], ref: Any) -> None:
        outputs, version = result
        self.busy_rollout.discard(item.worker)
        codec = self.codec
        recorded = record_outputs(
            self.scheduler, item.payload, outputs.outputs(), codec.decode, version, codec.encode_text
        )
        self.contexts.received(outputs, ref, self.scheduler)
        self.to_score.extend(recorded)

    def _on_reward(self, item: _InFlight, results: list[tuple[str, float, bool | None, dict]]) -> None:
        self.busy_reward.discard(item.worker)
        for sid, reward, verdict, info in results:
            self.scheduler.on_scored(sid, reward, verdict, info)

    def _overdue(self, step: int) -> None:
        """Handle every call past its deadline: a hung rollout or reward worker is killed and replaced
        (:meth:`_lost`); an update raises :class:`TrainerLost`."""
        now = time.monotonic()
        late = [(ref, item) for ref, item in self.flight.items() if item.due <= now]
        if any(item.kind == "train" for _, item in late):
            ranks = sorted(item.worker for item in self.flight.values() if item.kind == "train")
            raise TrainerLost(
                f"update {step}: trainer rank(s) {ranks} did not answer within pipeline.train_timeout_s = "
                f"{self.deadlines.train_s:g} s (a hung collective or a stopped rank)",
                ranks,
                "hung",
            )
        for ref, item in late:
            del self.flight[ref]
            what = "rollout" if item.kind == "rollout" else "reward"
            limit = self.deadlines.of(item.kind)
            self.counters[f"{what}_timeouts"] += 1
            self.log(
                f"{what} worker {item.worker}: no answer within pipeline.{_SETTING[item.kind]} = {limit:g} s "
                "(hung): killed"
            )
            self._lost(item)

    def _lost(self, item: _InFlight) -> None:
        """The worker of ``item`` died (or hung and was killed): replace it and put its work back."""
        if item.kind == "rollout":
            self.counters["rollout_restarts"] += 1
            # the trainer must be idle to send the weights now; otherwise the next push brings them
            self.fleet.replace(item.worker, push=self.train_handles is None)
            name = self.fleet.engines[item.worker][0]
            self._log_restart(item.worker, name)
            self.busy_rollout.discard(item.worker)
            self._requeue_rollout(item)
        else:
            self.counters["reward_restarts"] += 1
            self.rewards.restart(item.worker)
            sent = len(item.payload)
            self.log(f"reward worker {item.worker} lost: restarted, its {sent} requests sent again")
            self.busy_reward.discard(item.worker)
            self.scheduler.requeue(item.payload)
            self.to_score.extend(item.payload)

    def _requeue_rollout(self, item: _InFlight) -> None:
        """The call's segments are decoded again, their contexts sent inline (the objects they named may
        be what was lost)."""
        sample_ids = [job.sample_id for job in item.payload]
        self.contexts.forget(sample_ids)
        self.scheduler.requeue(sample_ids)

    def _log_restart(self, worker: int, name: str) -> None:
        version = self.fleet.versions.get(name)
        when = "at the next push" if worker in self.fleet.stale else f"at policy version {version}"
        self.log(f"rollout worker {worker} ({name}) died: restarted, weights {when}")

    # -------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The schedule between updates (work out at workers resumes from its last recorded segment)."""
        return {"scheduler": self.scheduler.state_dict(), "counters": dict(self.counters)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from mars_megatron.pipeline.scheduler import SeqState

        self.scheduler.load_state_dict(state["scheduler"])
        self.counters.update(state["counters"])
        self.to_score = [
            sid for sid in self.scheduler.samples if self.scheduler.state(sid) is SeqState.SCORING
        ]

    # ------------------------------------------------------------------------------------------ updates
    def _start_update(self, step: int) -> None:
        """Take the due batch, build its training data and submit it to the trainer group (colocated
        engines sleep first: the trainer needs their devices)."""
        if self.colocated:
            self.fleet.sleep()
        batch = self.scheduler.take_batch()
        assert batch is not None
        if self.shared_reward:
            set_shared_rewards(self.scheduler, batch)
        samples, stats = self._training_data(batch, step)
        self.train_handles = self.trainers.submit(samples)
        for rank, h in enumerate(self.train_handles):
            self.flight[h] = self._in_flight("train", rank, (batch, stats))
        self._train_started = time.perf_counter()

    def _training_data(self, batch: Batch, step: int) -> tuple[dict[str, list[Any]], dict[str, float]]:
        """GRPO advantages of ``batch``'s records, by policy, and the counts of what is trained."""
        raw = batch.samples
        samples, adv = assign_advantages(raw, filter_zero_variance=self.filter_zero_variance)
        samples, balanced = balance_roles(samples, self.scheduler.graph.balance)
        batches = self.trainers.split(samples)
        if self.rollouts_dir is not None:
            write_rollouts(self.rollouts_dir, step, batch, samples)
        stats = {
            "tokens": float(sum(len(s.prompt_ids) + s.response_len for s in samples)),
            "samples": float(len(raw)),
            "samples/trained": float(len(samples)),
            "groups/filtered": adv["filtered_groups"],
            **balanced,
        }
        return batches, stats

    def _finish_update(self, item: _InFlight) -> tuple[dict[str, float], float]:
        """Every rank's result is in: push the new weights (colocated engines wake their weights before
        the push and their KV cache after it, so the device never holds the cache before the weights)
        and let the scheduler move on. Returns the update's metrics and the training time."""
        results = [self._train_results.pop(rank) for rank in range(len(self.train_handles or []))]
        train_s = time.perf_counter() - self._train_started
        if self.colocated:
            self.fleet.wake_weights()
        metrics = self.trainers.finish(results)
        if self.colocated:
            self.fleet.wake()
        batch, stats = item.payload
        self.scheduler.on_trained()
        self.scheduler.release(batch)
        self.scheduler.check()
        self.contexts.prune(self.scheduler)
        self.train_handles = None
        metrics.update(batch_metrics(batch, self.scheduler.graph))
        metrics.update(stats)
        return metrics, train_s

    def _pipeline_metrics(self, step_s: float, train_s: float) -> dict[str, float]:
        return {
            "time/step": step_s,
            "time/train": train_s,
            "pipeline/trainer_busy": min(1.0, train_s / step_s) if step_s > 0 else 0.0,
            "pipeline/queue_groups": float(self.scheduler.stats()["queue"]),
            "pipeline/rollout_restarts": float(self.counters["rollout_restarts"]),
            "pipeline/reward_restarts": float(self.counters["reward_restarts"]),
            "pipeline/rollout_timeouts": float(self.counters["rollout_timeouts"]),
            "pipeline/reward_timeouts": float(self.counters["reward_timeouts"]),
            "pipeline/segments_during_update": float(self.counters["segments_during_update"]),
            "pipeline/requeued": float(self.scheduler.counters["requeued"]),
            "pipeline/trained_total": float(self.scheduler.census()["trained"]),
        }

    def _on_result(self, ref: Any, item: _InFlight) -> None:
        """A rollout or reward call returned (or its worker died)."""
        import ray

        try:
            result = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
            self._lost(item)
            return
        except ContextLostError as e:  # the engine is well; an object a request continued from is gone
            self.log(f"rollout worker {item.worker}: {e}")
            self.busy_rollout.discard(item.worker)
            self._requeue_rollout(item)
            return
        if item.kind == "rollout":
            if self.train_handles is not None:
                self.counters["segments_during_update"] += 1
            self._on_rollout(item, result, ref)
        else:
            self._on_reward(item, result)

    def _train_result(self, ref: Any, item: _InFlight, step: int) -> Any:
        """A trainer rank's share of update ``step``; its error is raised at once, a rank cut off
        (Ray's ``ActorUnavailableError``: alive, but its connection broke) as :class:`TrainerLost`."""
        import ray

        from mars_megatron.training.ray_group import unreachable

        try:
            return ray.get(ref)
        except ray.exceptions.ActorUnavailableError as e:
            world = len(self.train_handles or [])
            raise TrainerLost(f"update {step}: {unreachable(item.worker, world, e)}", [item.worker],
                              "unreachable") from None  # fmt: skip

    # -------------------------------------------------------------------------------------------- loop
    def run_update(self, step: int) -> dict[str, float]:
        """Drive everything until one update (the run's ``step``) has finished; returns its metrics."""
        import ray

        t0 = time.perf_counter()
        while True:
            update_due = self.train_handles is None and self.scheduler.update_ready()
            self._dispatch(rollouts=not (self.colocated and (update_due or self.train_handles is not None)))
            if update_due and not (self.colocated and self.busy_rollout):
                self._start_update(step)
            if not self.flight:  # the problem stream never ends, so nothing to wait on is a bug
                raise RuntimeError(f"pipeline stalled with nothing in flight: {self.scheduler.stats()}")
            first_due = min(item.due for item in self.flight.values())
            left = max(0.0, first_due - time.monotonic())
            ready, _ = ray.wait(list(self.flight), num_returns=1, timeout=left)
            if not ready:
                self._overdue(step)
                continue
            ref = ready[0]
            item = self.flight.pop(ref)
            if item.kind == "train":  # an update ends when its last rank has answered
                self._train_results[item.worker] = self._train_result(ref, item, step)
                if any(other.kind == "train" for other in self.flight.values()):
                    continue
                metrics, train_s = self._finish_update(item)
                metrics.update(self._pipeline_metrics(time.perf_counter() - t0, train_s))
                return metrics
            self._on_result(ref, item)
