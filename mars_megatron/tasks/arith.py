"""Addition problems with integer answers: a task a tiny model can learn on two CPU cores.

Why addition: the answer is one verifiable integer (``\\boxed{19}``, checked by the real math-verify
reward), the tiny tokenizer splits numbers into single digits, and a two-layer model can learn the
sums of a few hundred operand pairs in a minute of supervised training, so reinforcement learning has
a skill to sharpen rather than one to discover.

Problems are :class:`mars_megatron.evaluation.data.Problem` records, the type ``mars eval`` reads, and
:func:`write_jsonl` writes them in the JSONL format :func:`~mars_megatron.evaluation.data.load_problems`
parses, so a generated set can be evaluated with ``mars eval --data``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

from mars_megatron.evaluation.data import Problem

_TEXT = "Find {a}+{b}."
_PARSE = re.compile(r"^Find (\d+)\+(\d+)\.$")


def problem_text(a: int, b: int) -> str:
    """The problem statement for ``a + b`` (what the first role sees before its instruction)."""
    return _TEXT.format(a=a, b=b)


def operands(problem: Problem | str) -> tuple[int, int]:
    """``(a, b)`` of an addition problem (its record or its text); ValueError for any other text."""
    text = problem.text if isinstance(problem, Problem) else problem
    match = _PARSE.match(text.strip())
    if match is None:
        raise ValueError(f"not an addition problem of this task: {text!r}")
    return int(match.group(1)), int(match.group(2))


def operand_pairs(max_operand: int, max_sum: int | None = None) -> list[tuple[int, int]]:
    """Every ``(a, b)`` with ``0 <= a, b <= max_operand`` (and ``a + b <= max_sum`` when given)."""
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if max_sum is not None and max_sum < 1:
        raise ValueError(f"max_sum must be >= 1, got {max_sum}")
    limit = 2 * max_operand if max_sum is None else max_sum
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if a + b <= limit]


def arith_problems(
    n: int, seed: int = 0, *, max_operand: int = 9, max_sum: int | None = None
) -> list[Problem]:
    """``n`` distinct problems ``a + b`` with ``0 <= a, b <= max_operand`` (and ``a + b <= max_sum``), in
    a seeded random order.

    Deterministic: the same arguments give the same list on every machine (``random.Random(seed)``).
    Problem ids are ``add-<a>-<b>``, so ids stay unique and meaningful across seeds; ``line`` is the
    1-based line each problem gets from :func:`write_jsonl`.

    Raises:
        ValueError: ``n`` is more than the distinct pairs there are, or a bound is below 1.
    """
    pairs = operand_pairs(max_operand, max_sum)
    if not 1 <= n <= len(pairs):
        raise ValueError(
            f"n must be in 1..{len(pairs)} (the distinct pairs with max_operand={max_operand}, "
            f"max_sum={max_sum}), got {n}"
        )
    chosen = random.Random(seed).sample(pairs, n)
    return [Problem(f"add-{a}-{b}", problem_text(a, b), a + b, i + 1) for i, (a, b) in enumerate(chosen)]


def train_test_split(
    test: int, seed: int = 0, *, max_operand: int = 9, max_sum: int | None = None
) -> tuple[list[Problem], list[Problem]]:
    """Every problem of the operand range, in :func:`arith_problems`' seeded order, split into a training
    set and a held-out test set of the last ``test`` problems: disjoint by construction, and the same on
    every machine. ``examples/data/arith_{train,test}.jsonl`` are ``train_test_split(25)``."""
    every = arith_problems(
        len(operand_pairs(max_operand, max_sum)), seed, max_operand=max_operand, max_sum=max_sum
    )
    if not 1 <= test < len(every):
        raise ValueError(f"test must be in 1..{len(every) - 1}, got {test}")
    train, held_out = every[: len(every) - test], every[len(every) - test :]
    return train, [dataclasses.replace(p, line=i + 1) for i, p in enumerate(held_out)]


def load_arith_file(path: str | Path) -> list[Problem]:
    """The addition problems of a JSONL file (``mars eval --data`` format); a ValueError names the file and
    line of anything that is not a problem of this task."""
    from mars_megatron.evaluation.data import load_problems

    dataset = load_problems(path)
    if dataset.skipped:
        raise ValueError(f"unusable lines in {path}: {'; '.join(dataset.skipped)}")
    for p in dataset.problems:
        try:
            a, b = operands(p)
        except ValueError as e:
            raise ValueError(f"{path}:{p.line}: {e}") from None
        if str(p.reference) != str(a + b):
            raise ValueError(f"{path}:{p.line}: answer {p.reference!r} is not {a}+{b}")
    if not dataset.problems:
        raise ValueError(f"{path}: no problems")
    return dataset.problems


def write_jsonl(problems: Sequence[Problem], path: str | Path) -> Path:
    """Write ``{"qid", "problem", "answer"}`` lines that ``load_problems`` (``mars eval --data``) reads."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"qid": p.problem_id, "problem": p.text, "answer": p.reference}) + "\n")
    return path
