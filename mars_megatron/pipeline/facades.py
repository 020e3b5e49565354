"""What the pipeline driver talks to, besides the engines (:class:`~.fleet.EngineFleet`): the trainer
group, the reward workers and the problem source, each a small class with typed methods.

These are the Ray edge of the pipeline: the driver waits on the handles they return (``ray.wait``) and
never builds an actor itself. The schedule without Ray (engines, answer checker and scoring in this
process) is :func:`mars_megatron.pipeline.local.run_round`, which scores through the same
:func:`~mars_megatron.rewards.scoring.score_requests`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.sample import Sample
from mars_megatron.config import TrainConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.fleet import EngineFleet
from mars_megatron.pipeline.nodes import NodeWatch
from mars_megatron.reaper import WorkerProcess, reap
from mars_megatron.rewards.scoring import RewardWorker, ScoreRequest
from mars_megatron.rl.data import ProblemStream
from mars_megatron.rl.shares import BatchShare, shard_batch
from mars_megatron.training.packing import PackSpec


@dataclass(frozen=True)
class TrainerRanks:
    """What the driver needs to know of the trainer ranks to address them: asked once at start."""

    writer_rank: int
    """The rank whose metrics are an update's (it holds every policy's reduced figures)."""
    dp_ranks: tuple[int, ...]
    """Each rank's data-parallel rank: the ranks of one replica (TP/PP/CP) get the same share."""
    spec: PackSpec
    """How the trainer packs a batch; every rank's engine has the same."""
    backend: str
    """The ranks' torch.distributed backend (``nccl`` or ``gloo``: the devices they really have)."""

    @classmethod
    def ask(cls, group: Any) -> TrainerRanks:
        info = group.call("rank_info")
        return cls(
            writer_rank=next(i for i, rank in enumerate(info) if rank["writer"]),
            dp_ranks=tuple(int(rank["dp_rank"]) for rank in info),
            spec=group.call_rank(0, "pack_spec"),
            backend=str(info[0]["backend"]),
        )


class TrainerGroup:
    """The trainer ranks of every policy (:class:`~mars_megatron.rl.worker.PolicyWorker` actors) and the
    weights they push into the engines.

    An update is :meth:`submit` (the samples of each policy, cut here into each data-parallel rank's
    share: :mod:`~mars_megatron.rl.shares`; returns the handles to wait on) and then :meth:`finish` (the
    writer rank's metrics, and the new weights in every engine as the next policy version)."""

    def __init__(
        self,
        group: Any,
        fleet: EngineFleet,
        names: Sequence[str],
        graph: AgentGraph,
        train: TrainConfig,
        ranks: TrainerRanks,
    ) -> None:
        self.group = group
        """The ranks (:class:`~mars_megatron.training.ray_group.RayWorkerGroup`)."""
        self.graph = graph
        self.fleet = fleet
        self.names = list(names)
        self.train = train
        self.ranks = ranks
        self.versions: dict[str, int] = dict.fromkeys(self.names, 0)
        """The policy version each policy's engines hold."""

    def rebind(self, group: Any, ranks: TrainerRanks) -> None:
        """A new group of ranks in place of a lost one (:meth:`~.trainer.MarsRLTrainer.recover`)."""
        self.group = group
        self.ranks = ranks

    def policy_of(self, role: str) -> str:
        return self.graph.policy_of(role, self.names)

    def roles_of(self, name: str) -> set[str]:
        """The roles policy ``name`` serves."""
        return {r for r in self.graph.roles if self.policy_of(r) == name}

    def split(self, samples: Sequence[Sample]) -> dict[str, list[Sample]]:
        """``samples`` by the policy that trains on them (order kept)."""
        batches: dict[str, list[Sample]] = {name: [] for name in self.names}
        for s in samples:
            batches[self.policy_of(s.role)].append(s)
        return batches

    def shares(self, batches: Mapping[str, Sequence[Sample]]) -> list[dict[str, BatchShare]]:
        """Per data-parallel rank, its share of every policy's batch (policies without samples left out),
        each mini-batch planned once here."""
        per_policy = {
            name: shard_batch(samples, self.ranks.spec, self.train.pack_length, self.train.updates_per_batch)
            for name, samples in batches.items()
            if samples
        }
        return [{name: shares[dp] for name, shares in per_policy.items()} for dp in range(self.ranks.spec.dp)]

    def submit(self, batches: Mapping[str, list[Sample]]) -> list[Any]:
        """Start one update on every rank, each sent only its replica's share; the handles to wait on,
        the writer rank's among them."""
        per_dp = [(share,) for share in self.shares(batches)]
        return self.group.call_async_each("train", [per_dp[dp] for dp in self.ranks.dp_ranks])

    def finish(self, results: Sequence[Any]) -> dict[str, float]:
        """An update's per-rank ``results`` are in: its metrics, after the new weights (every version + 1)
        are pushed into the engines."""
        metrics: dict[str, float] = dict(results[self.ranks.writer_rank])
        metrics.update(self.push({name: v + 1 for name, v in self.versions.items()}))
        metrics["policy_version"] = float(max(self.versions.values()))
        if len(self.names) > 1:
            metrics.update({f"policy_version/{n}": float(v) for n, v in self.versions.items()})
        return metrics

    def push(self, versions: Mapping[str, int]) -> dict[str, float]:
        """Push the trainer's weights into every engine as policy ``versions``; the sync metrics."""
        reports = self.fleet.push_weights(versions)
        self.versions = {name: r.version for name, r in reports.items()}
        return {
            "time/sync": sum(r.seconds for r in reports.values()),
            "sync/bytes": float(sum(r.bytes for r in reports.values())),
            "sync/sender_peak_bytes": float(max(r.sender_peak_bytes for r in reports.values())),
            "sync/receiver_peak_bytes": float(max(r.receiver_peak_bytes for r in reports.values())),
            "sync/recovered_engines": float(sum(r.recovered for r in reports.values())),
        }


class RewardPool:
    """The reward workers: one Ray actor of :class:`~mars_megatron.rewards.scoring.RewardWorker` each,
    replaced when one dies."""

    def __init__(self, workers: int, nodes: NodeWatch | None = None) -> None:
        """``nodes``: asked before a worker is started again (a lost node whose work the nodes left cannot
        take stops the run: :mod:`~mars_megatron.pipeline.nodes`)."""
        if workers < 1:
            raise ValueError(f"RewardPool: need at least one worker, got {workers}")
        self.nodes = nodes
        self.actors = [self._start() for _ in range(workers)]
        self._processes = [actor.process.remote() for actor in self.actors]
        """Each worker's process (its first call: answered before any score), for :meth:`restart`."""

    @staticmethod
    def _start() -> Any:
        import ray

        return ray.remote(RewardWorker).options(num_cpus=1).remote()

    def __len__(self) -> int:
        return len(self.actors)

    def score(self, worker: int, requests: Sequence[ScoreRequest]) -> Any:
        """Send ``requests`` to ``worker``; the handle of its ``(sample_id, reward, verdict)`` list."""
        return self.actors[worker].score.remote(list(requests))

    def processes(self) -> list[WorkerProcess | None]:
        """Each worker's process and node (None: it has not said, it died or hung while starting)."""
        return [self._process(worker) for worker in range(len(self.actors))]

    def _process(self, worker: int) -> WorkerProcess | None:
        import contextlib

        import ray

        with contextlib.suppress(Exception):  # answered at its start: at once, even after it died
            return ray.get(self._processes[worker], timeout=1)
        return None

    def restart(self, worker: int) -> None:
        """``worker`` died or hung: it is killed, its process for sure (a stopped one outlives
        ``ray.kill``), and a new actor takes its place (if a lost node left room for it)."""
        import contextlib

        import ray

        if self.nodes is not None:
            self.nodes.before_replacing("reward", worker)
        process = self._process(worker)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actors[worker])
        reap(process)
        self.actors[worker] = self._start()
        self._processes[worker] = self.actors[worker].process.remote()

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)


class ProblemFeed:
    """The problems the schedule admits: ``per_update`` at a time from the run's resumable
    :class:`~mars_megatron.rl.data.ProblemStream`."""

    def __init__(self, stream: ProblemStream[Problem], per_update: int) -> None:
        self.stream = stream
        self.per_update = per_update

    def take(self) -> list[Problem]:
        return self.stream.take(self.per_update)
