"""What the pipeline does with one agent output, wherever the schedule runs (Ray workers or this process):
its prompt, its engine request, the request its reward is scored from (the rewards themselves are
:mod:`mars_megatron.rewards.scoring`'s) and its metrics. The output is one record from start to finish
(:class:`~mars_megatron.agents.sample.Sample`); the only conversion is the small
:class:`~mars_megatron.rewards.scoring.ScoreRequest` a reward worker receives, built here from the record.

One definition each, so the Ray driver (:mod:`.driver`) and the in-process runner (:mod:`.local`) cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.prompts import prompt_variables
from mars_megatron.agents.sample import Sample
from mars_megatron.agents.tools import observation, parse_call, run_tool
from mars_megatron.agents.trajectory import PromptInputs
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.scheduler import Batch, Scheduler, SegmentJob, SeqState
from mars_megatron.rewards.metrics import role_metrics
from mars_megatron.rewards.scoring import ScoreRequest, shared_rewards
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams


def prompt_builder(
    graph: AgentGraph, prompt_set: str, encode: Callable[[list[Any]], Sequence[int]]
) -> Callable[[str, Problem, PromptInputs], list[int]]:
    """The scheduler's prompt function for real engines: the position's role's chat messages in
    ``prompt_set``, tokenised."""

    def prompt_fn(position: str, problem: Problem, inputs: PromptInputs) -> list[int]:
        role = graph.role_of(position)
        solution, report = (q.text if q is not None else None for q in (inputs.solution, inputs.report))
        reader = graph.roles[inputs.report.role].verdict if inputs.report is not None else None
        variables = prompt_variables(problem.text, solution, report, reader)
        if inputs.call is not None:
            variables["purpose"], variables["tool_output"] = inputs.call
        return list(encode(role.messages(prompt_set, variables)))

    return prompt_fn


def segment_request(job: SegmentJob, sampling: SamplingParams) -> GenerationRequest:
    """The engine request of one segment: the run's sampling with the segment's budget and seed."""
    return GenerationRequest(job.sample_id, job.context(), sampling.with_budget(job.max_tokens, job.seed))


def record_outputs(
    scheduler: Scheduler,
    jobs: Sequence[SegmentJob],
    outputs: Sequence[GenerationOutput],
    decode: Callable[[Sequence[int]], str],
    version: int | None = None,
    encode_text: Callable[[str], Sequence[int]] | None = None,
) -> list[str]:
    """Record one engine call's outputs as the next segments of their sequences (decoded by policy
    ``version``; default: the version each was issued at). Returns the ids of the sequences this finished,
    in order, their text decoded: they are ready to be scored. Decoded here, once, because the reward and
    the next agent's prompt both read the text.

    Tool calls are served here (:func:`serve_tools`), so ``encode_text`` (plain text to tokens) is needed
    where the graph has a role with a tool."""
    finished: list[str] = []
    for job, out in zip(jobs, outputs, strict=True):
        stopped = out.finish_reason == "stop"
        if scheduler.on_segment(
            job.sample_id,
            out.token_ids,
            out.logprobs,
            stopped=stopped,
            version=version,
            routed_experts=out.routed_experts,
        ):
            sample = scheduler.samples[job.sample_id]
            sample.text = decode(sample.response_ids)
            finished.extend(serve_tools(scheduler, sample, decode, encode_text))
    return finished


def serve_tools(
    scheduler: Scheduler,
    sample: Sample,
    decode: Callable[[Sequence[int]], str],
    encode_text: Callable[[str], Sequence[int]] | None,
) -> list[str]:
    """What a finished output means for tool calls (``ToolSpec`` in agents/graph.py); the ids to score.

    - A turn of a role with a tool that ended by itself with a call (and calls left): the tool runs here,
      locally, and the distiller's sample starts; the caller is parked, not scored.
    - A distiller's digest: appended to the response it serves as an observation (masked out of the
      loss), which then continues (or, with no budget left, is scored as cut); the digest is scored.
    - Anything else: scored.
    """
    role = scheduler.graph.roles[sample.role]
    spec = role.tool
    if spec is not None and sample.finish_reason == "stop" and sample.tool_calls < spec.max_calls:
        call = parse_call(decode(sample.since_observation()))
        if call is not None:
            scheduler.call_out(sample.sample_id, call.purpose, run_tool(call, allowed=[spec.name]))
            return []
    if scheduler.graph.position(sample.position).trigger == "tool_call":
        if encode_text is None:
            raise ValueError(
                f"graph {scheduler.graph.name!r} serves tool calls: record_outputs needs encode_text"
            )
        caller = scheduler.samples[sample.parent_id or ""]
        if scheduler.call_returned(caller.sample_id, list(encode_text(observation(sample.text)))):
            caller.text = decode(caller.response_ids)
            return [sample.sample_id, caller.sample_id]
    return [sample.sample_id]


def score_request(scheduler: Scheduler, sample_id: str) -> ScoreRequest:
    """What a reward worker receives for the finished record ``sample_id`` (the one conversion of a
    record: small, no token or routing arrays)."""
    sample = scheduler.samples[sample_id]
    judged = scheduler.samples.get(sample.judged_id) if sample.judged_id is not None else None
    return ScoreRequest.of(
        sample, scheduler.graph.roles[sample.role], scheduler.problem(sample), judged.text if judged else None
    )


def set_shared_rewards(scheduler: Scheduler, batch: Batch) -> None:
    """``algorithm.reward=shared``: annotate each record of ``batch`` with the reward it trains on, its
    trajectory's outcome (:func:`~mars_megatron.rewards.scoring.shared_rewards`)."""

    def unfinished(sample_id: str) -> str | None:
        state = scheduler.state(sample_id)
        return None if state is SeqState.DONE else state.value

    for sample_id, reward in shared_rewards(
        scheduler.samples, scheduler.graph, batch.samples, unfinished
    ).items():
        scheduler.samples[sample_id].training_reward = reward


def batch_metrics(batch: Batch, graph: AgentGraph) -> dict[str, float]:
    """Per-role agent rewards of an update's samples (:func:`role_metrics`), and how stale its segments
    were."""
    samples = batch.samples
    out = role_metrics(samples, graph)
    out["problems"] = float(len({q.trajectory_id for q in samples}))
    staleness = [batch.version - s.version for q in samples for s in q.segment_versions]
    out["pipeline/staleness_max"] = float(max(staleness, default=0))
    out["pipeline/staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
    out["pipeline/multi_version_samples"] = float(
        sum(len({s.version for s in q.segment_versions}) > 1 for q in samples)
    )
    return out


def write_rollouts(folder: Path, step: int, batch: Batch, trained: Sequence[Sample]) -> Path:
    """One JSON line per output of ``step``'s update (``batch.samples``: its records, with training
    rewards; ``trained``: those kept, with advantages). Written whole, then renamed, so a resumed run
    that redoes the step replaces the file."""
    import json

    trained_ids = {s.sample_id for s in trained}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for sample in batch.samples:
            record = {"step": step, "policy_version": batch.version, **sample.summary()}
            if sample.sample_id not in trained_ids:  # filtered or balanced out: not trained on
                record["advantage"] = None
            f.write(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def read_rollouts(folder: Path) -> list[list[dict[str, Any]]]:
    """Per update, in step order, the records :func:`write_rollouts` wrote (those of the steps a run
    kept: a step done again after a resume or a rebuilt trainer replaced its file)."""
    import json

    files = sorted(folder.glob("step_*.jsonl"))
    return [[json.loads(line) for line in f.read_text(encoding="utf-8").splitlines()] for f in files]


def trained_ids(folder: Path) -> list[list[str]]:
    """Per update, the ids of the outputs trained on: with an uninterrupted run's, what a run that lost
    work lost (ids missing) or trained twice (ids repeated)."""
    return [[r["sample_id"] for r in step if r["advantage"] is not None] for step in read_rollouts(folder)]
