"""The subset-sum reference and its programmatic checker: many answers can be right, so an answer is checked
against the rule, not compared with one stored answer.

A subset-sum problem gives a list of numbers and a target; an answer is some of the numbers (each used at
most as often as the list holds it, at least one) whose sum is the target. Its reference, the ``answer``
field of a data line, carries the list and the target behind an unambiguous task prefix::

    subset_sum: 1 3 4 6 8 = 13

:func:`parse_reference` reads it (a malformed one, or one whose target no subset reaches, is a ValueError
saying what is wrong), and :func:`check_answer` judges the content of a solution's last ``\\boxed{}``:
the chosen numbers separated by ``+``, ``,`` or spaces (``4+9``, ``9 + 4``, ``4, 9``). Anything else in
the box (``4+9=13``, ``x``) is unreadable and scores 0. Pure string and integer work: nothing is evaluated
or executed, and a check is a few microseconds, so it runs in the checking process itself rather than in
math-verify's workers (:mod:`~mars_megatron.rewards.programs` dispatches to it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "subset_sum:"
"""What a reference starts with (:mod:`~mars_megatron.rewards.programs` dispatches on it)."""
MAX_NUMBERS = 64
"""Most numbers in a list (and in an answer)."""
MAX_VALUE = 10**6
"""Largest number or target: bounds the reachability check of a reference (a bitset of target+1 bits)."""

_NUMBER = r"\d{1,7}"
_REFERENCE = re.compile(rf"^{re.escape(PREFIX)}\s*((?:{_NUMBER}\s+)*{_NUMBER})\s*=\s*({_NUMBER})\s*$")
_ANSWER = re.compile(rf"^\s*{_NUMBER}(?:(?:\s*[+,]\s*|\s+){_NUMBER})*\s*$")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class SubsetSum:
    """A subset-sum problem's list and target (what its reference carries)."""

    numbers: tuple[int, ...]
    target: int

    def __post_init__(self) -> None:
        if not 1 <= len(self.numbers) <= MAX_NUMBERS:
            raise ValueError(f"subset_sum: expected 1..{MAX_NUMBERS} numbers, got {len(self.numbers)}")
        for value in (*self.numbers, self.target):
            if not 0 <= value <= MAX_VALUE:
                raise ValueError(f"subset_sum: numbers and target must be in 0..{MAX_VALUE}, got {value}")
        if not reachable(self.numbers, self.target):
            raise ValueError(
                f"subset_sum: no non-empty subset of {' '.join(map(str, self.numbers))} sums to "
                f"{self.target}, so no answer could be right"
            )

    @property
    def text(self) -> str:
        """The reference string (:func:`parse_reference` reads it back)."""
        return f"{PREFIX} {' '.join(map(str, self.numbers))} = {self.target}"

    def is_solution(self, chosen: Sequence[int]) -> bool:
        """Whether ``chosen`` is a right answer: non-empty, every number from the list (no more often than
        the list holds it), summing to the target."""
        if not chosen:
            return False
        available = Counter(self.numbers)
        used = Counter(chosen)
        return all(used[n] <= available[n] for n in used) and sum(chosen) == self.target


def reachable(numbers: Sequence[int], target: int) -> bool:
    """Whether some non-empty sub-multiset of ``numbers`` sums to ``target`` (a bitset of reachable sums)."""
    sums = 0  # bit s set: some non-empty subset sums to s
    mask = (1 << (target + 1)) - 1
    for n in numbers:
        sums |= ((sums << n) | (1 << n)) & mask
    return bool(sums >> target & 1)


def is_reference(reference: object) -> bool:
    """Whether ``reference`` claims to be a subset-sum reference (a string with the task prefix)."""
    return isinstance(reference, str) and reference.lstrip().startswith(PREFIX)


def parse_reference(reference: str) -> SubsetSum:
    """The list and target of ``subset_sum: n1 n2 ... = target``; ValueError naming what is wrong."""
    match = _REFERENCE.match(reference.strip())
    if match is None:
        raise ValueError(
            f"malformed subset_sum reference {reference[:200]!r}: expected 'subset_sum: N N ... = TARGET' "
            "with non-negative integers"
        )
    return SubsetSum(tuple(int(n) for n in match.group(1).split()), int(match.group(2)))


def parse_answer(answer: str) -> tuple[int, ...] | None:
    """The numbers of a boxed answer (``4+9``, ``4, 9``, ``4 9``), or None when the box holds anything
    else (or more than :data:`MAX_NUMBERS` numbers)."""
    if _ANSWER.match(answer) is None:
        return None
    chosen = tuple(int(n) for n in _DIGITS.findall(answer))
    return chosen if len(chosen) <= MAX_NUMBERS else None


def check_answer(answer: str, problem: SubsetSum) -> bool | None:
    """True/False for a readable answer (right or wrong), None for an unreadable one."""
    chosen = parse_answer(answer)
    return None if chosen is None else problem.is_solution(chosen)
