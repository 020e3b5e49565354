"""Every reward of a run, by the kind the agent graph gives a role, in one module: what a reward worker
scores for one finished output (``answer``, ``verdict``), what a finished trajectory decides for the
outputs whose reward is what followed them (``outcome``), and the shared reward of
``algorithm.reward=shared`` (the trajectory's final outcome for every output in it).

Pure functions of records (:class:`~mars_megatron.agents.sample.Sample`) and the graph; the scheduler
applies what they return to its records, and the reward workers (:class:`RewardWorker`, in Ray actors or
in this process) run :func:`score_requests`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mars_megatron.agents.graph import AgentGraph, RewardFunction, RewardKind, RoleSpec, VerdictReader
from mars_megatron.agents.sample import Sample
from mars_megatron.agents.verdict import read_verdict
from mars_megatron.reaper import WorkerProcess, whereabouts
from mars_megatron.rewards.agent_rewards import Checker, answer_rewards, verdict_reward
from mars_megatron.rewards.functions import FunctionPools

RewardMode = Literal["agent", "shared"]
"""``algorithm.reward``: every output trains on its role's own reward, or on its trajectory's outcome."""

Score = tuple[str, float, bool | None, dict[str, float]]
"""``(sample_id, reward, verdict, info)``: what a reward worker returns for one request. ``info``: what a
reward function adds for the metrics (its details, and ``fail/<reason>: 1`` when the output scored 0
without its say); empty for the built-in rewards."""


@dataclass(frozen=True)
class ScoreRequest:
    """What a reward worker needs of a finished record (small and picklable: no token or routing arrays).
    Built from the record by :meth:`of`, and only there; the score goes back onto the record (the
    scheduler's ``on_scored``)."""

    sample_id: str
    reward: RewardKind
    """How the output's role is rewarded (the graph's ``roles.<name>.reward``)."""
    verdict: VerdictReader | None
    """How a verdict is read from the output (None: its role reads none)."""
    text: str
    reference: Any
    judged_right: bool
    """Outputs with an input: whether the solution it judged or revised was right (True otherwise)."""
    role: str = ""
    function: RewardFunction | None = None
    """``reward: function``: the user's function (by name; the worker imports it)."""
    problem: str = ""
    problem_id: str = ""
    extra: Mapping[str, Any] | None = None
    judged_solution: str | None = None
    has_input: bool = False

    @classmethod
    def of(
        cls,
        sample: Sample,
        role: RoleSpec,
        problem: Any,
        judged_solution: str | None = None,
    ) -> ScoreRequest:
        """The request for ``sample``, an output of ``role`` on ``problem`` (its text, reference answer and
        extra columns); ``judged_solution``: the text of the solution it judged or revised (only a reward
        function reads it)."""
        judged_right = True if sample.judged_right is None else sample.judged_right
        function = role.function if role.reward == "function" else None
        return cls(
            sample.sample_id, role.reward, role.verdict, sample.text, problem.reference, judged_right,
            role.name, function, problem.text if function else "", problem.problem_id,
            dict(problem.extra) if function and problem.extra else None,
            judged_solution if function else None, sample.judged_id is not None,
        )  # fmt: skip

    def reward_request(self) -> Any:
        """What the user's function receives (:class:`~.functions.RewardRequest`)."""
        from mars_megatron.rewards.functions import RewardRequest

        return RewardRequest(
            self.problem, self.reference, self.text, self.role, dict(self.extra or {}), self.judged_solution,
            self.judged_right if self.has_input else None, self.problem_id, self.sample_id,
        )  # fmt: skip


def score_requests(
    requests: Sequence[ScoreRequest], checker: Checker, functions: FunctionPools | None = None
) -> list[Score]:
    """``(sample_id, reward, verdict, info)`` per request, by the role's reward kind. ``answer``: 1 if the
    last boxed answer matches the reference (one batched math-verify call). ``verdict``: 1 if the verdict
    is right about the solution it judged. ``outcome``: 0 for now; :func:`outcome_rewards` sets the mean
    reward of what followed once the trajectory is finished. ``function``: the user's function's score
    (in its own process, ``functions``), its verdict when it gives one; 0 when it fails. A role's verdict
    is read whatever its reward."""
    answers = [(i, r.text, r.reference) for i, r in enumerate(requests) if r.reward == "answer"]
    rewards = answer_rewards([(text, ref) for _, text, ref in answers], checker)
    out: list[Score] = [(r.sample_id, 0.0, read_verdict(r.verdict, r.text), {}) for r in requests]
    for (i, _, _), reward in zip(answers, rewards, strict=True):
        out[i] = (requests[i].sample_id, reward, out[i][2], {})
    for i, r in enumerate(requests):
        if r.reward == "verdict":
            verdict = out[i][2]
            out[i] = (r.sample_id, verdict_reward(verdict, r.judged_right), verdict, {})
    by_function: dict[RewardFunction, list[int]] = {}
    for i, r in enumerate(requests):
        if r.reward == "function":
            if r.function is None:
                raise ValueError(f"{r.sample_id}: role {r.role!r} is rewarded by a function but names none")
            by_function.setdefault(r.function, []).append(i)
    if by_function and functions is None:
        raise ValueError("score_requests: a reward function needs its FunctionPools")
    for spec, indices in by_function.items():
        pool = functions.get(spec.target, spec.timeout_s)  # type: ignore[union-attr]
        outcomes = pool.score([requests[i].reward_request() for i in indices])
        for i, o in zip(indices, outcomes, strict=True):
            info = {**o.details, **({f"fail/{o.reason}": 1.0} if o.reason else {})}
            verdict = o.verdict if o.verdict is not None else out[i][2]
            out[i] = (requests[i].sample_id, o.score, verdict, info)
    return out


class RewardWorker:
    """Body of a reward worker (the driver wraps it with ``ray.remote``): math-verify answers and parsed
    verdicts, with the checker's own worker process and hard timeouts."""

    def __init__(self) -> None:
        from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig

        self.checker = AnswerChecker(CheckerConfig(num_workers=1))
        self.functions = FunctionPools()

    def score(self, requests: Sequence[ScoreRequest]) -> list[Score]:
        return score_requests(requests, self.checker, self.functions)

    def ping(self) -> bool:
        return True

    def process(self) -> WorkerProcess:
        """This worker's process, for :func:`~mars_megatron.reaper.reap` if it hangs."""
        return whereabouts("ray::RewardWorker")


def _children(records: Iterable[Sample]) -> dict[str, list[Sample]]:
    children: dict[str, list[Sample]] = {}
    for q in records:
        if q.parent_id is not None:
            children.setdefault(q.parent_id, []).append(q)
    return children


def outcome_rewards(
    members: Sequence[Sample], graph: AgentGraph, depth: Mapping[str, int]
) -> dict[str, float]:
    """The rewards of the outputs of one finished trajectory tree (``members``) whose role is rewarded by
    its outcome: the mean reward of the outputs that followed it, deepest first, so that an outcome can
    rest on outcomes (``depth``: each position's depth in the trajectory). A digest (a position triggered
    by a tool call) gets the reward of the response it served. An output that nothing followed is left
    out (it keeps the 0 it was scored with)."""
    outcome_roles = {r.name for r in graph.roles.values() if r.reward == "outcome"}
    if not outcome_roles:
        return {}
    reward = {q.sample_id: q.reward for q in members}
    children = _children(members)
    out: dict[str, float] = {}
    for q in sorted(members, key=lambda q: -depth[q.position]):
        if q.role not in outcome_roles:
            continue
        kids = children.get(q.sample_id, [])
        if graph.position(q.position).trigger == "tool_call":  # a digest: the response it served
            out[q.sample_id] = reward[q.sample_id] = reward[q.parent_id or ""]  # type: ignore[assignment]
        elif kids:
            value = sum(reward[k.sample_id] or 0.0 for k in kids) / len(kids)
            out[q.sample_id] = reward[q.sample_id] = value
    return out


def shared_rewards(
    records: Mapping[str, Sample],
    graph: AgentGraph,
    seqs: Iterable[Sample],
    unfinished: Callable[[str], str | None],
) -> dict[str, float]:
    """``algorithm.reward=shared``: each output's reward is the outcome of the trajectories through it —
    whether their final solution is right, averaged over its continuations (the whole tree must be scored:
    ``unfinished(sample_id)`` names the state of a record that is not, and that is an error).

    A solution's trajectory ends with it when nothing followed it; any other output's ends with the
    solution it judged when nothing followed it (it passed the solution, or its branch was not selected).
    ``records``: every live record by id (children are found among them)."""
    children = _children(records.values())
    memo: dict[str, float] = {}

    def outcome(sid: str) -> float:
        if sid not in memo:
            q = records[sid]
            state = unfinished(sid)
            if state is not None:
                raise ValueError(f"shared reward of {sid}: its trajectory is not finished ({state})")
            kids = children.get(sid, [])
            if kids:
                memo[sid] = sum(outcome(k.sample_id) for k in kids) / len(kids)
            elif graph.roles[q.role].output != "solution" and q.judged_id is not None:
                memo[sid] = float(records[q.judged_id].reward or 0.0)
            else:
                memo[sid] = float(q.reward or 0.0)
        return memo[sid]

    return {q.sample_id: outcome(q.sample_id) for q in seqs}
