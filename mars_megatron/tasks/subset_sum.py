"""Subset-sum problems: a tiny task where checking an answer is easier than finding one.

A problem gives five distinct numbers 1..9 in ascending order and a target, the sum of two of them:
``Pick from 1,3,4,6,8 to sum 12.`` Any numbers of the list (each at most once) that add up to the target
are right (``4+8``, and ``1+3+8`` too), so the reward is the programmatic checker of
:mod:`mars_megatron.rewards.subset_sum`, and the data line's reference carries the list and the target
(``subset_sum: 1 3 4 6 8 = 12``) instead of one answer.

Why this task: the paper's mechanism needs a Verifier that can check what its Solver cannot reliably find.
Checking a proposed pair is an addition and a look-up of each number in the list; finding a pair is a
search over the list. A two-layer model can learn the first outright, and (from the warm start's
demonstrations, :mod:`mars_megatron.tasks.subset_demos`) a search that tries one candidate per answer.

Why targets from pairs and no target in the list: every answer needs at least two numbers, and one
candidate's check is one subtraction, which keeps responses short (and the task cheap on two cores).

The held-out split is disjoint by *list*: no list of a held-out problem appears in training, with any
target (:func:`train_test_split`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from collections.abc import Sequence
from pathlib import Path

from mars_megatron.evaluation.data import Problem
from mars_megatron.rewards.subset_sum import SubsetSum, parse_reference
from mars_megatron.tasks.arith import write_jsonl

SIZE, LOW, HIGH = 5, 1, 9
"""Numbers per list and their range (the shipped files)."""
TRAIN_FILE, TEST_FILE = "subset_train.jsonl", "subset_test.jsonl"
"""The shipped task files in ``examples/data`` (:func:`write_task_files` writes them)."""
TEST_PROBLEMS = 100
"""Held-out problems of the shipped split: the paper table's minimum."""

_TEXT = "Pick from {numbers} to sum {target}."
_PARSE = re.compile(r"^Pick from (\d+(?:,\d+)*) to sum (\d+)\.$")


def problem_text(numbers: Sequence[int], target: int) -> str:
    """The problem statement (what the Solver sees before its instruction)."""
    return _TEXT.format(numbers=",".join(map(str, numbers)), target=target)


def parse_problem(problem: Problem | str) -> SubsetSum:
    """The list and target of a problem of this task (its record or its text); ValueError for other text."""
    text = problem.text if isinstance(problem, Problem) else problem
    match = _PARSE.match(text.strip())
    if match is None:
        raise ValueError(f"not a subset-sum problem of this task: {text!r}")
    return SubsetSum(tuple(int(n) for n in match.group(1).split(",")), int(match.group(2)))


def make_problem(numbers: Sequence[int], target: int, line: int = 1) -> Problem:
    """The record of one problem: id ``subset-<numbers>-<target>``, the text, the checker's reference."""
    problem = SubsetSum(tuple(numbers), target)
    problem_id = f"subset-{'-'.join(map(str, numbers))}-{target}"
    return Problem(problem_id, problem_text(numbers, target), problem.text, line)


def pair_targets(numbers: Sequence[int]) -> list[int]:
    """The targets of a list: sums of two of its numbers that are not themselves in it, ascending."""
    return sorted({a + b for a, b in itertools.combinations(numbers, 2)} - set(numbers))


def every_list(size: int = SIZE, low: int = LOW, high: int = HIGH) -> list[tuple[int, ...]]:
    """Every list of ``size`` distinct numbers in ``low..high``, ascending, in lexicographic order."""
    if not 1 <= low <= high or not 2 <= size <= high - low + 1:
        raise ValueError(f"need 1 <= low <= high and 2 <= size <= high - low + 1, got {size}, {low}..{high}")
    return list(itertools.combinations(range(low, high + 1), size))


def train_test_split(
    test: int = TEST_PROBLEMS, seed: int = 0, *, size: int = SIZE, low: int = LOW, high: int = HIGH
) -> tuple[list[Problem], list[Problem]]:
    """Training and held-out problems, disjoint by list: the lists are shuffled with ``random.Random(seed)``,
    the first lists go to the held-out set until it has ``test`` problems (the rest of the last one's
    targets are dropped from both sets), and the problems of every other list are the training set; each
    set is shuffled. The same on every machine; ``examples/data/subset_{train,test}.jsonl`` are
    ``train_test_split()``."""
    rng = random.Random(seed)
    lists = every_list(size, low, high)
    rng.shuffle(lists)
    total = sum(len(pair_targets(n)) for n in lists)
    if not 1 <= test < total:
        raise ValueError(f"test must be in 1..{total - 1}, got {test}")
    held_out: list[Problem] = []
    train: list[Problem] = []
    for numbers in lists:
        problems = [make_problem(numbers, t) for t in pair_targets(numbers)]
        if len(held_out) < test:
            held_out += problems[: test - len(held_out)]
        else:
            train += problems
    rng.shuffle(held_out)
    rng.shuffle(train)
    return _numbered(train), _numbered(held_out)


def _numbered(problems: list[Problem]) -> list[Problem]:
    return [dataclasses.replace(p, line=i + 1) for i, p in enumerate(problems)]


def load_subset_file(path: str | Path) -> list[Problem]:
    """The subset-sum problems of a JSONL file (``mars eval --data`` format); a ValueError names the file and
    line of anything that is not a problem of this task or whose reference does not match its text."""
    from mars_megatron.evaluation.data import load_problems

    dataset = load_problems(path)
    if dataset.skipped:
        raise ValueError(f"unusable lines in {path}: {'; '.join(dataset.skipped)}")
    for p in dataset.problems:
        try:
            problem = parse_problem(p)
            if not isinstance(p.reference, str) or parse_reference(p.reference) != problem:
                raise ValueError(f"answer {p.reference!r} is not {problem.text!r}")
        except ValueError as e:
            raise ValueError(f"{path}:{p.line}: {e}") from None
    if not dataset.problems:
        raise ValueError(f"{path}: no problems")
    return dataset.problems


def write_task_files(folder: str | Path, test: int = TEST_PROBLEMS, seed: int = 0) -> list[Path]:
    """Write the task's train and test JSONL files (``examples/data`` holds these, with the defaults)."""
    folder = Path(folder)
    train, held_out = train_test_split(test, seed)
    return [write_jsonl(train, folder / TRAIN_FILE), write_jsonl(held_out, folder / TEST_FILE)]
