"""Programmatic checks: references that name a task's rule instead of holding one answer.

Most references are one answer that math-verify compares with the solution's boxed answer. A task with
many right answers (subset sum: any subset that reaches the target) instead stores, behind an unambiguous
task prefix, what its rule needs (``subset_sum: 1 3 4 6 8 = 13``), and the rule decides. The answer
checker (:class:`~mars_megatron.rewards.checker.AnswerChecker`) asks :func:`program_of` first, so every
reward path (``answer`` rewards, the Verifier's ``verdict`` reward that is scored against them, ``mars
eval``) uses the rule unchanged; the data loader's reference check
(:func:`~mars_megatron.rewards.answers.check_reference`) reads a program's reference whole, so a malformed
one is refused when its file is read, naming the line.

A reference without a known prefix is an ordinary answer (:func:`program_of` gives None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mars_megatron.rewards import subset_sum


@dataclass(frozen=True)
class Program:
    """A task's rule: whether a reference is the task's (``claims``), how it is read (``parse``: ValueError
    when malformed) and how a boxed answer is judged against what was read (``judge``: True/False, None
    when the answer is unreadable)."""

    name: str
    claims: Callable[[object], bool]
    parse: Callable[[str], Any]
    judge: Callable[[str, Any], bool | None]

    def read(self, reference: str) -> Any:
        """The parsed reference (cached: a training run checks the same references over and over)."""
        return _parsed(self, reference)

    def check(self, answer: str, reference: str) -> bool | None:
        """Whether ``answer`` (a boxed answer's content) is right for ``reference``; None: unreadable.
        ValueError when the reference is malformed."""
        return self.judge(answer, self.read(reference))


PROGRAMS: tuple[Program, ...] = (
    Program("subset_sum", subset_sum.is_reference, subset_sum.parse_reference, subset_sum.check_answer),
)


@lru_cache(maxsize=4096)
def _parsed(program: Program, reference: str) -> Any:
    return program.parse(reference)


def program_of(reference: object) -> Program | None:
    """The program whose prefix ``reference`` carries, or None for an ordinary answer."""
    return next((p for p in PROGRAMS if p.claims(reference)), None)
