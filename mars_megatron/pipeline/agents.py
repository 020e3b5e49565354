"""What the pipeline does with one agent output, wherever the schedule runs (Ray workers or this process):
its prompt, its engine request, its reward, its training record and its metrics.

One definition each, so the Ray driver (:mod:`.driver`) and the in-process runner (:mod:`.local`) cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mars_megatron.agents.prompts import PromptSet
from mars_megatron.agents.roles import Role
from mars_megatron.agents.trajectory import Position
from mars_megatron.agents.verdict import bug_report, parse_verdict
from mars_megatron.algorithm.sample import Sample
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.scheduler import Batch, Scheduler, SegmentJob, Seq
from mars_megatron.rewards.agent_rewards import Checker, answer_rewards, verifier_reward
from mars_megatron.rl.rollout import Scored, role_metrics
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams

RewardItem = tuple[str, str, str, Any, bool]
"""``(sample_id, role, text, reference, judged_right)``: what a reward worker needs of a finished output."""


def prompt_builder(prompts: PromptSet, encode: Callable[[list[Any]], Sequence[int]]) -> Callable:
    """The scheduler's prompt function for real engines: the role's chat messages, tokenised."""

    def prompt_fn(position: Position, problem: Problem, parent: Seq | None, judged: Seq | None) -> list[int]:
        if position.role is Role.SOLVER:
            messages = prompts.solver_messages(problem.text)
        elif position.role is Role.VERIFIER:
            assert parent is not None
            messages = prompts.verifier_messages(problem.text, parent.text)
        else:
            assert parent is not None and judged is not None
            messages = prompts.corrector_messages(problem.text, judged.text, bug_report(parent.text))
        return list(encode(messages))

    return prompt_fn


def segment_request(job: SegmentJob, sampling: SamplingParams) -> GenerationRequest:
    """The engine request of one segment: the run's sampling with the segment's budget and seed."""
    params = SamplingParams(
        max_tokens=job.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=job.seed,
        stop_token_ids=sampling.stop_token_ids,
    )
    return GenerationRequest(job.sample_id, tuple(job.context()), params)


def record_outputs(
    s: Scheduler,
    jobs: Sequence[SegmentJob],
    outputs: Sequence[GenerationOutput],
    decode: Callable[[Sequence[int]], str],
    version: int | None = None,
) -> list[str]:
    """Record one engine call's outputs as the next segments of their sequences (decoded by policy
    ``version``; default: the version each was issued at). Returns the ids of the sequences this finished,
    in order, their text decoded: they are ready to be scored. Decoded here, once, because the reward and
    the next agent's prompt both read the text."""
    finished: list[str] = []
    for job, out in zip(jobs, outputs, strict=True):
        stopped = out.finish_reason == "stop"
        if s.on_segment(
            job.sample_id,
            out.token_ids,
            out.logprobs,
            stopped=stopped,
            version=version,
            routed_experts=out.routed_experts,
        ):
            seq = s.seqs[job.sample_id]
            seq.text = decode(seq.tokens)
            finished.append(job.sample_id)
    return finished


def reward_item(s: Scheduler, sample_id: str) -> RewardItem:
    """A finished output as a reward worker sees it; a Verifier's or Corrector's ``judged_right`` is
    whether the solution it judged or revised was right."""
    seq = s.seqs[sample_id]
    judged = True if seq.judged_id is None else bool(s.seqs[seq.judged_id].reward)
    return (sample_id, seq.role.value, seq.text, seq.problem.reference, judged)


def score_items(items: Sequence[RewardItem], checker: Checker) -> list[tuple[str, float, bool | None]]:
    """``(sample_id, reward, verdict)`` per item. Solver/Corrector: 1 if the last boxed answer matches
    the reference (one batched math-verify call). Verifier: 1 if its verdict is right about the solution
    it judged."""
    answers = [(i, text, ref) for i, (_, role, text, ref, _) in enumerate(items) if role != Role.VERIFIER]
    rewards = answer_rewards([(text, ref) for _, text, ref in answers], checker)
    out: list[tuple[str, float, bool | None]] = [("", 0.0, None)] * len(items)
    for (i, _, _), reward in zip(answers, rewards, strict=True):
        out[i] = (items[i][0], reward, None)
    for i, (sid, role, text, _, judged_right) in enumerate(items):
        if role == Role.VERIFIER:
            verdict = parse_verdict(text)
            out[i] = (sid, verifier_reward(verdict, judged_right), verdict)
    return out


def to_sample(seq: Seq, reward: float | None = None) -> Sample:
    """The trainer's record of a scored sequence (segments keep their policy versions); ``reward``
    overrides the agent reward (the shared reward)."""
    return Sample(
        prompt_ids=list(seq.prompt_ids),
        response_ids=list(seq.tokens),
        position=seq.position,
        problem_id=seq.problem.problem_id,
        group_id=seq.group_id,
        reward=seq.reward if reward is None else reward,
        behaviour_logprobs=[min(lp, 0.0) for lp in seq.logprobs],
        segment_versions=list(seq.segments),
        sample_id=seq.sample_id,
        routed_experts=seq.routing,
    )


def batch_metrics(
    batch: Batch, judged_right: Mapping[str, bool], training_reward: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Per-role agent rewards of an update's samples (:func:`role_metrics`; ``training_reward`` where
    it differs in kind, the shared reward), and how stale its segments were."""
    out = role_metrics(
        [
            Scored(
                q.position,
                q.reward or 0.0,
                judged_right.get(q.sample_id),
                len(q.prompt_ids),
                len(q.tokens),
                q.finish_reason == "length",
                q.verdict,
                None if training_reward is None else training_reward[q.sample_id],
            )
            for q in batch.seqs
        ]
    )
    out["problems"] = float(len({q.key for q in batch.seqs}))
    staleness = [batch.version - s.version for q in batch.seqs for s in q.segments]
    out["pipeline/staleness_max"] = float(max(staleness, default=0))
    out["pipeline/staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
    out["pipeline/multi_version_samples"] = float(
        sum(len({s.version for s in q.segments}) > 1 for q in batch.seqs)
    )
    return out
