"""Demonstrations of every role of an agent graph for the supervised warm start of the tiny run.

What they must do: teach every role its *format* and the *skill* (adding, comparing), yet leave each
role right only part of the time when sampled at temperature 1, so that reinforcement learning has a
reward to raise for every role.

How: every role has two modes, told apart by the first token of the response. The *careful* mode
works the sum out and is right; the *careless* mode skips the work. What a role writes follows from
its kind in the graph (:mod:`mars_megatron.agents.graph`), not its name:

=====================================  ==========================================  ===========================
kind                                   careful                                      careless
=====================================  ==========================================  ===========================
solution, first position               ``3+4=7. \\boxed{7}``                        guesses: ``\\boxed{R}``
report with a ``correctness`` verdict  ``3+4=7.\\nCorrectness: Wrong`` (recomputes;   rubber-stamps:
                                       Correct iff the sum is the solution's)        ``Correctness: Correct``
report without a verdict               ``3+4=7.`` (the recomputed sum: the log a     ``Fine.``
                                       judgement reads)
judgement (``yes_no``)                 ``yes``/``no``: the report's sum against the  ``yes``
                                       solution's answer (no sum in it: ``yes``)
solution revising a judged one         ``3+4=7. \\boxed{7}``                        stubborn: repeats its
                                                                                    previous answer
=====================================  ==========================================  ===========================

Why modes rather than noisy answers: measured on the tiny MoE, 150 warm-start steps on demos whose
answers were right 40% of the time (no marker) left the greedy Solver at 6% (chance: 5%): the noise
drowned the skill. The same steps on clean demos gave 99%. With modes, every careful demo is a clean
lesson, the careless ones only teach how often to skip the work, and reinforcement learning has one
early decision per response to shift (work it out) whose pay-off is shared across all problems.

The shares are low (20 % careful by default) so that every role starts mostly careless and the room left
to reinforcement learning is the decision to work carefully, not arithmetic it never learned: the warm
start's skill phase makes careful sums right 92-97 % of the time (``SFTConfig.skill_steps``).

Demos are chat conversations in one of the graph's prompt sets (``compact`` for the tiny model), rendered
by the graph's own templates; :func:`encode_demo` turns one into token ids with the policy's chat template
and the mask of the tokens that are trained.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.prompts import prompt_variables
from mars_megatron.agents.roles import Message
from mars_megatron.config import ConfigError, Section, _field
from mars_megatron.evaluation.data import Problem
from mars_megatron.tasks.arith import operands


@dataclass
class DemoConfig(Section):
    """How often each role works carefully in the demos, and the mix of roles (a config section)."""

    careful: dict[str, float] = _field(  # noqa: RUF009 — _field gives mutable defaults a factory
        {},
        "Share of each role's demos that work the sum out (the rest skip the work), by role of the graph, "
        "e.g. {verifier: 0.3}; missing roles: default_careful.",
        min=0,
        max=1,
    )
    default_careful: float = _field(0.2, "Careful share of the roles careful does not list.", min=0, max=1)
    weights: dict[str, float] = _field(  # noqa: RUF009
        {}, "Relative number of each role's demos, by role of the graph; missing roles weigh 1.", min=0
    )
    input_accuracy: float = _field(
        0.5, "Share of the judged solutions (in report and judgement demos) that are correct.", min=0, max=1
    )
    seed: int = _field(0, "Seed of the demos' roles, problems and modes.", min=0)

    def careful_share(self, role: str) -> float:
        return self.careful.get(role, self.default_careful)

    def with_careful(self, share: float) -> DemoConfig:
        """The same demos with every role careful at ``share`` (the warm start's skill phase)."""
        return dataclasses.replace(self, careful={}, default_careful=share)


@dataclass(frozen=True)
class Demo:
    """One demonstration: the role's input messages and the response it is trained to write."""

    role: str
    problem_id: str
    messages: list[Message]
    response: str
    careful: bool
    """Written in the careful mode."""
    rewarded: bool
    """Whether this response earns reward 1 under the role's real reward."""


def boxed(answer: int) -> str:
    return f"\\boxed{{{answer}}}"


def careful_solution(a: int, b: int) -> str:
    """The careful solution (first or revised): the sum worked out, then boxed."""
    return f"{a}+{b}={a + b}. {boxed(a + b)}"


def careful_report(a: int, b: int, shown: int) -> str:
    """The careful report with a Correctness verdict: the recomputed sum, then the verdict that follows."""
    verdict = "Correct" if a + b == shown else "Wrong"
    return f"{a}+{b}={a + b}.\nCorrectness: {verdict}"


CARELESS_REPORT = "Correctness: Correct"
"""The careless report's whole text: a verdict without any check (no bug report)."""

CARELESS_LOG = "Fine."
"""The careless log of a report without a verdict: nothing checked, nothing found."""


def careful_log(a: int, b: int) -> str:
    """The careful log of a report without a verdict: the recomputed sum, for a judgement to compare."""
    return f"{a}+{b}={a + b}."


def judge(report: str, shown: int) -> str:
    """The careful judgement of a report: ``no`` when the sum it recomputed differs from the solution's
    answer, ``yes`` otherwise (a report that recomputed nothing found nothing)."""
    match = _SUM.search(report)
    return "no" if match is not None and int(match.group(1)) != shown else "yes"


_SUM = re.compile(r"=(\d+)\.")


@dataclass(frozen=True)
class RoleContext:
    """What a demo maker of one role needs besides the problem and the random draws: the role's prompts
    in the run's prompt set and its careful share. Every task's demos use it."""

    role: str
    graph: AgentGraph
    prompt_set: str
    cfg: DemoConfig

    def messages(
        self, problem: Problem, solution: str | None = None, report: str | None = None
    ) -> list[Message]:
        variables = prompt_variables(problem.text, solution, report)
        return self.graph.roles[self.role].messages(self.prompt_set, variables)

    @property
    def careful_share(self) -> float:
        return self.cfg.careful_share(self.role)


@dataclass(frozen=True)
class _Context(RoleContext):
    top: int
    """The largest answer of the problems: guesses and wrong solutions are drawn from ``0..top``."""


C = TypeVar("C", bound=RoleContext)
Maker = Callable[[Problem, C, random.Random], Demo]
_Maker = Maker[_Context]


def draw_demos(
    problems: Sequence[Problem],
    graph: AgentGraph,
    cfg: DemoConfig,
    n: int,
    maker_of: Callable[[str], Maker[C]],
    context_of: Callable[[str], C],
) -> list[Demo]:
    """``n`` demos, each of a role of ``graph`` drawn by ``cfg.weights`` on a problem drawn from
    ``problems``, made by ``maker_of(role)`` with ``context_of(role)``. The one draw order of every task
    (role, problem, then the maker's draws, from ``cfg.seed``), so a longer list starts with the shorter
    one. Roles in ``cfg`` that the graph lacks, or weights all zero, are errors naming the field."""
    unknown = sorted((set(cfg.weights) | set(cfg.careful)) - set(graph.roles))
    if unknown:
        raise ConfigError(f"graph {graph.name!r} has no role {unknown[0]!r}", "demos")
    roles = tuple(graph.roles)
    weights = tuple(cfg.weights.get(r, 1.0) for r in roles)
    if not any(weights):
        raise ConfigError("at least one role needs a positive weight", "demos.weights")
    makers = {r: maker_of(r) for r in roles}
    contexts = {r: context_of(r) for r in roles}
    rng = random.Random(cfg.seed)
    demos = []
    for _ in range(n):
        role = rng.choices(roles, weights)[0]
        demos.append(makers[role](rng.choice(problems), contexts[role], rng))
    return demos


def wrong_answer(rng: random.Random, answer: int, max_answer: int) -> int:
    """A uniformly random integer in ``0..max(max_answer, 1)`` other than ``answer``."""
    while True:
        value = rng.randint(0, max(max_answer, 1))
        if value != answer:
            return value


def _shown_solution(rng: random.Random, a: int, b: int, shown: int) -> str:
    """A solution with answer ``shown`` in either of the first position's formats, so that the format
    says nothing about correctness."""
    return f"{a}+{b}={shown}. {boxed(shown)}" if rng.random() < 0.5 else boxed(shown)


def demo_maker(graph: AgentGraph, role: str) -> _Maker:
    """What ``role`` demonstrates, from its kind (see the module docstring)."""
    spec = graph.roles[role]
    fed = any(p.role == role and p.input is not None for p in graph.positions)
    if spec.output == "solution":
        return _revision_demo if fed else _solution_demo
    if spec.output == "report":
        return _report_demo if spec.verdict == "correctness" else _log_demo
    if spec.verdict == "yes_no":
        return _judgement_demo
    raise ValueError(f"build_demos: no demos for role {role!r} ({spec.output}, verdict {spec.verdict})")


def build_demos(
    problems: Sequence[Problem], graph: AgentGraph, prompt_set: str, cfg: DemoConfig, n: int
) -> list[Demo]:
    """``n`` demos of ``graph``'s roles, each of a role drawn by the weights, on a problem drawn from
    ``problems``, in ``prompt_set``.

    Deterministic for a given ``cfg.seed`` (a longer list starts with the shorter one). Guesses and
    wrong solutions are drawn from ``0..the largest answer`` of ``problems``. Reports and judgements
    judge solutions in both of the first position's formats, right or wrong in either; a revision
    revises a wrong guess with the careful report that rejected it.
    """
    if not problems:
        raise ValueError("build_demos: no problems")
    top = max(int(p.reference) for p in problems)
    return draw_demos(
        problems,
        graph,
        cfg,
        n,
        lambda role: demo_maker(graph, role),
        lambda role: _Context(role, graph, prompt_set, cfg, top),
    )


def _solution_demo(p: Problem, c: _Context, rng: random.Random) -> Demo:
    a, b = operands(p)
    careful = rng.random() < c.careful_share
    response = careful_solution(a, b) if careful else boxed(rng.randint(0, c.top))
    return _demo(c.role, p, c.messages(p), response, careful, a + b)


def _report_demo(p: Problem, c: _Context, rng: random.Random) -> Demo:
    return _judging_demo(p, c, rng, careful_report, CARELESS_REPORT)


def _log_demo(p: Problem, c: _Context, rng: random.Random) -> Demo:
    # Its reward is the outcome of the judgements of it: a careful log lets a careful judge be right.
    return _judging_demo(p, c, rng, lambda a, b, shown: careful_log(a, b), CARELESS_LOG)


def _judged(p: Problem, c: _Context, rng: random.Random) -> tuple[int, int, bool, int, str]:
    """``(a, b, right, shown, solution)``: a solution to judge, right with ``input_accuracy``, in either
    format."""
    a, b = operands(p)
    right = rng.random() < c.cfg.input_accuracy
    shown = a + b if right else wrong_answer(rng, a + b, c.top)
    return a, b, right, shown, _shown_solution(rng, a, b, shown)


def _judging_demo(
    p: Problem, c: _Context, rng: random.Random, careful_text: Callable[[int, int, int], str], careless: str
) -> Demo:
    """A report on a solution: careful (``careful_text(a, b, shown)``) or the ``careless`` text."""
    a, b, right, shown, solution = _judged(p, c, rng)
    careful = rng.random() < c.careful_share
    response = careful_text(a, b, shown) if careful else careless
    return Demo(c.role, p.problem_id, c.messages(p, solution), response, careful, careful or right)


def _judgement_demo(p: Problem, c: _Context, rng: random.Random) -> Demo:
    a, b, right, shown, solution = _judged(p, c, rng)
    report = careful_log(a, b) if rng.random() < 0.5 else CARELESS_LOG
    careful = rng.random() < c.careful_share
    response = judge(report, shown) if careful else "yes"
    messages = c.messages(p, solution, report)
    return Demo(c.role, p.problem_id, messages, response, careful, (response == "yes") == right)


def _revision_demo(p: Problem, c: _Context, rng: random.Random) -> Demo:
    a, b = operands(p)
    previous = wrong_answer(rng, a + b, c.top)
    report = careful_log(a, b)  # the careful report that rejected it, before its verdict
    # the rejected solution in either format: a careful first solution's slips reach it too
    solution = _shown_solution(rng, a, b, previous)
    messages = c.messages(p, solution, report)
    careful = rng.random() < c.careful_share
    response = careful_solution(a, b) if careful else boxed(previous)
    return _demo(c.role, p, messages, response, careful, a + b)


def _demo(role: str, p: Problem, messages: list[Message], response: str, careful: bool, answer: int) -> Demo:
    return Demo(role, p.problem_id, messages, response, careful, response.endswith(boxed(answer)))


def encode_demo(demo: Demo, codec: Any) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response + end-of-turn, and the target mask for them.

    ``codec`` is a :class:`~mars_megatron.rollout.chat.ChatCodec`: the prompt is exactly what a rollout
    engine is given (chat template with the generation prompt), the response is the tokenised text
    followed by the tokenizer's end-of-turn token (``<|im_end|>``) so the model learns to stop where
    the engines stop. ``target_mask`` has ``len(ids) - 1`` entries: entry t is 1 when token t+1 is a
    response token (trained), 0 for prompt tokens.
    """
    prompt = list(codec.encode(demo.messages))
    tokenizer = codec.tokenizer
    response = list(tokenizer(demo.response, add_special_tokens=False)["input_ids"])
    response.append(int(tokenizer.eos_token_id))
    ids = prompt + response
    return ids, [0] * (len(prompt) - 1) + [1] * len(response)
