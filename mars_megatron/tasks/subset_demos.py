"""Demonstrations of the subset-sum task's roles for the warm start: careful and careless modes, as
:mod:`mars_megatron.tasks.demos` has them for sums (the first token tells the modes apart, and a low
careful share leaves reinforcement learning a reward to raise for every role).

What each mode writes, with ``Pick from 1,3,4,6,8 to sum 12.``:

=====================================  =========================================  ==========================
kind                                   careful                                    careless
=====================================  =========================================  ==========================
solution, first position               tries the first number: ``12-1=11.         guesses two numbers of
                                       \\boxed{1+11}`` (wrong: 11 is no number     the list: ``\\boxed{3+6}``
                                       of the list)
report with a ``correctness`` verdict  reads the list up to the second number,    rubber-stamps:
                                       then subtracts it from the target beside   ``Correctness: Correct``
                                       the first: ``8: 1,3,4,6,8 in. 12-8=4 vs
                                       4.\\nCorrectness: Correct`` (a miss:
                                       ``11: 1,3,4,6,8 out.``; a wrong pair:
                                       ``6: 1,3,4,6 in. 12-6=6 vs 3, no.``)
solution revising a judged one         tries the number of the list after the     stubborn: repeats the
                                       rejected one's first: ``12-3=9.            rejected answer
                                       \\boxed{3+9}``
=====================================  =========================================  ==========================

Why this shape: the Verifier's careful check is a look-up and a subtraction, each step local (see
:func:`careful_report`), always right once learned; the Solver's careful search tries one candidate, the
first number of the list, and is right only when that number is part of an answer (38 % of the problems);
each careful correction tries the next candidate, so the loop (verify until 4 passes in a row, at most 10
verdicts) walks the list and finds an answer for every problem (at most four candidates are needed) if the
Verifier judges right. The system can beat its Solver by as much as the Solver's one try misses, and only
through the Verifier and the Corrector: MarsRL's claim in miniature.

The solutions a report or a revision is given (:func:`judged_solution`) are right with
``DemoConfig.input_accuracy``, in both solution formats; the wrong ones are what the other roles get
wrong: a careful try whose partner is not in the list (sum right, look-up fails), a guess whose sum is
wrong, or a careful try with a slip of the subtraction (``12-4=9.``: the report must add, not copy).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.roles import Message
from mars_megatron.evaluation.data import Problem
from mars_megatron.rewards.answers import extract_boxed
from mars_megatron.rewards.subset_sum import SubsetSum, parse_answer
from mars_megatron.tasks.demos import Demo, DemoConfig, Maker, RoleContext, draw_demos
from mars_megatron.tasks.subset_sum import parse_problem

CARELESS_REPORT = "Correctness: Correct"
"""The careless report's whole text: a verdict without any check (no bug report)."""


def boxed(chosen: Sequence[int]) -> str:
    return "\\boxed{" + "+".join(map(str, chosen)) + "}"


def attempt(problem: SubsetSum, first: int, partner: int | None = None) -> str:
    """A careful try of ``first``: the subtraction that names its partner, then both boxed. ``partner``
    other than ``target - first`` writes a slip (the trace's arithmetic is wrong)."""
    partner = problem.target - first if partner is None else partner
    return f"{problem.target}-{first}={partner}. {boxed((first, partner))}"


def candidates(problem: SubsetSum) -> list[int]:
    """The numbers a careful search tries, in order: those of the list below the target."""
    return [n for n in problem.numbers if n < problem.target]


def first_try(problem: SubsetSum) -> int:
    """The careful Solver's candidate: the first (smallest) number of the list."""
    return candidates(problem)[0]


def next_try(problem: SubsetSum, rejected_first: int) -> int:
    """The careful Corrector's candidate: the first candidate after the rejected answer's first number
    (after the last, the first again)."""
    return next((n for n in candidates(problem) if n > rejected_first), first_try(problem))


def careful_report(problem: SubsetSum, chosen: Sequence[int]) -> str:
    """The careful report on two chosen numbers ``a+b``: ``b`` looked up by reading the list in order up to
    the first number not below it (``5: 1,2,5``) and saying whether that is ``b`` (``in``) or not (``out``,
    which ends it; ``twice`` when ``b`` is ``a`` again and the list holds it once); then the target less
    ``b`` set beside ``a`` (``12-5=7 vs 7``; a mismatch: ``12-5=7 vs 6, no``), and the verdict that follows:
    ``Correct`` exactly when the answer is right.

    Why so spelled out (measured on the tiny model's warm start): every step is local: the next number of
    the list, a subtraction of a one-digit number, two numbers side by side. A look-up of ``b`` in the
    whole list at once was right on about half of the wrong solutions; a comparison with a number several
    tokens back was learned as "always different" by reinforcement learning; redoing the Solver's own
    ``12-7=`` let the model copy the Solver's result instead of computing it, so the report subtracts the
    other number. The first number is taken to be from the list (every role writes one of the list's
    numbers first); the reward's checker, not this report, is the truth."""
    if len(chosen) != 2:
        raise ValueError(f"careful_report: the demos judge answers of two numbers, got {chosen}")
    a, b = chosen
    verdict = "Correct" if problem.is_solution(chosen) else "Wrong"
    read = []
    for n in problem.numbers:
        read.append(n)
        if n >= b:
            break
    if read[-1] != b:
        found = "out"
    else:
        found = "twice" if b == a and problem.numbers.count(a) < 2 else "in"
    text = f"{b}: {','.join(map(str, read))} {found}"
    if found == "in":
        rest = problem.target - b
        text += f". {problem.target}-{b}={rest} vs {a}" + ("" if rest == a else ", no")
    return f"{text}.\nCorrectness: {verdict}"


def valid_pairs(problem: SubsetSum) -> list[tuple[int, int]]:
    """The right answers of two numbers, each pair in both orders."""
    return [(a, b) for a in problem.numbers for b in problem.numbers if a != b and a + b == problem.target]


def guess(problem: SubsetSum, rng: random.Random) -> tuple[int, int]:
    """Two distinct numbers of the list, in random order (the careless Solver's answer)."""
    a, b = rng.sample(problem.numbers, 2)
    return a, b


def judged_solution(problem: SubsetSum, right: bool, rng: random.Random) -> tuple[str, tuple[int, ...]]:
    """``(text, chosen)``: a solution for a report or a revision to work on, right or wrong as asked (see the
    module docstring for the kinds of wrong ones)."""
    if right:
        pair = rng.choice(valid_pairs(problem))
        return (attempt(problem, pair[0]) if rng.random() < 0.5 else boxed(pair)), pair
    kind = rng.random()
    misses = [n for n in candidates(problem) if not problem.is_solution((n, problem.target - n))]
    # a one-digit partner that is not in the list: only the look-up tells (a two-digit one is plainly out)
    hidden = [n for n in misses if problem.target - n <= 9]
    if kind < 0.4 and misses:
        first = rng.choice(hidden if hidden and rng.random() < 0.7 else misses)
        return attempt(problem, first), (first, problem.target - first)
    if kind < 0.65 or not candidates(problem):
        while True:
            pair = guess(problem, rng)
            if not problem.is_solution(pair):
                return boxed(pair), pair
    first = rng.choice(candidates(problem))
    partner = max(1, problem.target - first + rng.choice((-2, -1, 1, 2)))
    if partner == problem.target - first:  # max() undid the slip
        partner += 1
    return attempt(problem, first, partner), (first, partner)


_Maker = Maker[RoleContext]


def demo_maker(graph: AgentGraph, role: str) -> _Maker:
    """What ``role`` demonstrates, from its kind in the graph (see the module docstring)."""
    spec = graph.roles[role]
    fed = any(p.role == role and p.input is not None for p in graph.positions)
    if spec.output == "solution":
        return _revision_demo if fed else _solution_demo
    if spec.output == "report" and spec.verdict == "correctness":
        return _report_demo
    raise ValueError(
        f"build_subset_demos: no subset-sum demos for role {role!r} ({spec.output}, verdict {spec.verdict}); "
        "the task has demos for a solver, a report with a correctness verdict and a corrector"
    )


def build_subset_demos(
    problems: Sequence[Problem], graph: AgentGraph, prompt_set: str, cfg: DemoConfig, n: int
) -> list[Demo]:
    """``n`` demos of ``graph``'s roles, each of a role drawn by the weights, on a problem drawn from
    ``problems`` (subset-sum problems of :mod:`~mars_megatron.tasks.subset_sum`), in ``prompt_set``.
    Deterministic for a given ``cfg.seed`` (a longer list starts with the shorter one)."""
    if not problems:
        raise ValueError("build_subset_demos: no problems")
    return draw_demos(
        problems,
        graph,
        cfg,
        n,
        lambda role: demo_maker(graph, role),
        lambda role: RoleContext(role, graph, prompt_set, cfg),
    )


def _solution_demo(p: Problem, c: RoleContext, rng: random.Random) -> Demo:
    problem = parse_problem(p)
    careful = rng.random() < c.careful_share
    response = attempt(problem, first_try(problem)) if careful else boxed(guess(problem, rng))
    return _answer_demo(c.role, p, problem, c.messages(p), response, careful)


def _report_demo(p: Problem, c: RoleContext, rng: random.Random) -> Demo:
    problem = parse_problem(p)
    right = rng.random() < c.cfg.input_accuracy
    solution, chosen = judged_solution(problem, right, rng)
    careful = rng.random() < c.careful_share
    response = careful_report(problem, chosen) if careful else CARELESS_REPORT
    return Demo(c.role, p.problem_id, c.messages(p, solution), response, careful, careful or right)


def _revision_demo(p: Problem, c: RoleContext, rng: random.Random) -> Demo:
    problem = parse_problem(p)
    solution, chosen = judged_solution(problem, False, rng)
    report = careful_report(problem, chosen)  # the careful report that rejected it
    careful = rng.random() < c.careful_share
    response = attempt(problem, next_try(problem, chosen[0])) if careful else boxed(chosen)
    return _answer_demo(c.role, p, problem, c.messages(p, solution, report), response, careful)


def _answer_demo(
    role: str, p: Problem, problem: SubsetSum, messages: list[Message], response: str, careful: bool
) -> Demo:
    chosen = parse_answer(extract_boxed(response) or "")
    return Demo(
        role, p.problem_id, messages, response, careful, chosen is not None and problem.is_solution(chosen)
    )
