"""The schedule run in this process, with in-process engines and answer checker: no Ray, no trainer.

For measuring what a model does inside the training rollout (``role_accuracy`` after SFT) and for tests
that drive the rollout with rule-based engines. It runs the very scheduler of ``mars train`` (positions,
input selection, groups, sample ids, seeds), so its figures are on the scale of the training run's
``reward/<role>``. Deterministic: engine calls are made in the scheduler's order, one role's engine at a
time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mars_megatron.agents.graph import AgentGraph, prompt_set_of
from mars_megatron.agents.sample import Sample
from mars_megatron.config import AgentsConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.agents import (
    batch_metrics,
    prompt_builder,
    record_outputs,
    score_request,
    segment_request,
    set_shared_rewards,
)
from mars_megatron.pipeline.scheduler import Batch, Limits, Scheduler
from mars_megatron.rewards.agent_rewards import Checker
from mars_megatron.rewards.functions import FunctionPools
from mars_megatron.rewards.scoring import RewardMode, score_requests
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.rollout.engine import RolloutEngine, SamplingParams


@dataclass
class Round:
    """Every output of one synchronous round, scored, with the trainer's records and the metrics."""

    batch: Batch
    samples: list[Sample]
    """One record per output, scored (with its training reward under ``reward=shared``)."""
    metrics: dict[str, float]
    scheduler: Scheduler


def run_round(
    problems: Sequence[Problem],
    *,
    engines: Mapping[str, RolloutEngine],
    codec: ChatCodec,
    checker: Checker,
    graph: AgentGraph,
    agents: AgentsConfig,
    sampling: SamplingParams,
    seed: int,
    reward: RewardMode = "agent",
    segment_tokens: int | None = None,
    max_batch: int = 64,
    version: int = 0,
    functions: FunctionPools | None = None,
) -> Round:
    """All trajectories of ``problems`` (the synchronous schedule: staleness 0), decoded by ``engines``
    as policy ``version``; ``engines`` by role of ``graph``, prompts in ``agents.prompts``."""
    missing = [role for role in graph.roles if role not in engines]
    if missing:
        raise ValueError(f"run_round: no engine for role(s) {missing}")
    if not problems:
        raise ValueError("run_round: no problems")
    limits = Limits(
        max_response_tokens=sampling.max_tokens,
        segment_tokens=segment_tokens or sampling.max_tokens,
        max_staleness=dict.fromkeys(graph.roles, 0),
        problems_per_step=len(problems),
        batch_groups=len(problems),
        whole_trajectories=reward == "shared",
    )
    prompts = prompt_builder(graph, prompt_set_of(graph, agents.prompts), codec.encode)
    scheduler = Scheduler(agents, limits, prompts, graph, seed=seed)
    scheduler.version = version
    scheduler.add_problems(problems)
    by_engine: dict[int, tuple[RolloutEngine, set[str]]] = {}
    for role, engine in engines.items():
        by_engine.setdefault(id(engine), (engine, set()))[1].add(role)
    while not scheduler.update_ready():
        finished: list[str] = []
        issued = 0
        for engine, roles in by_engine.values():
            jobs = scheduler.take_segments(max_batch, roles=roles)
            issued += len(jobs)
            if not jobs:
                continue
            outputs = engine.generate([segment_request(j, sampling) for j in jobs])
            finished += record_outputs(scheduler, jobs, outputs, codec.decode, encode_text=codec.encode_text)
        if not issued:  # every sequence waits on a score, and none is being scored: a scheduler bug
            raise RuntimeError(f"run_round stalled: {scheduler.stats()}")
        if finished:
            requests = [score_request(scheduler, sid) for sid in finished]
            for sid, value, verdict, info in score_requests(requests, checker, functions):
                scheduler.on_scored(sid, value, verdict, info)
    batch = scheduler.take_batch()
    assert batch is not None
    if reward == "shared":
        set_shared_rewards(scheduler, batch)
    return Round(batch, batch.samples, batch_metrics(batch, graph), scheduler)
