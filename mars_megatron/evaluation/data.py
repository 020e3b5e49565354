"""Evaluation problems from JSONL: one object per line with a problem text and a reference answer.

Field names differ between datasets (AIME25 has ``query``/``ans_box`` with a string answer, BeyondAIME
``input``/``query``/``ans_box`` with an integer), so the first present key of :data:`PROBLEM_KEYS` and
:data:`ANSWER_KEYS` is used. A line that cannot be used is skipped with a warning naming ``file:line``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from mars_megatron.rewards.answers import normalize_reference

PROBLEM_KEYS = ("problem", "query", "input", "question")
ANSWER_KEYS = ("answer", "ans_box", "reference")


@dataclass(frozen=True)
class Problem:
    problem_id: str
    """``qid`` of the record when it has one, else ``line<N>``; keys results for --resume."""
    text: str
    reference: str | int | float
    line: int
    """1-based line number in the data file."""


@dataclass(frozen=True)
class Dataset:
    problems: list[Problem]
    skipped: list[str]
    """One ``file:line: reason`` per unusable line of the whole file."""


def _parse_line(raw: str, line: int) -> Problem:
    """One problem, or ValueError with the reason."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    text = next(
        (record[k] for k in PROBLEM_KEYS if isinstance(record.get(k), str) and record[k].strip()), None
    )
    if text is None:
        raise ValueError(f"no problem text (one of {', '.join(PROBLEM_KEYS)})")
    key = next((k for k in ANSWER_KEYS if record.get(k) is not None), None)
    if key is None:
        raise ValueError(f"no reference answer (one of {', '.join(ANSWER_KEYS)})")
    try:
        normalize_reference(record[key])
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad reference answer in '{key}': {e}") from None
    qid = record.get("qid")
    problem_id = str(qid) if isinstance(qid, int | str) and not isinstance(qid, bool) else f"line{line}"
    return Problem(problem_id, text, record[key], line)


def load_problems(path: str | Path, limit: int | None = None) -> Dataset:
    """Every usable problem of ``path`` (the first ``limit`` of them); bad lines of the whole file are
    reported in ``skipped`` and warned about. Blank lines are ignored."""
    path = Path(path)
    problems: list[Problem] = []
    skipped: list[str] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8", errors="replace") as f:
        for line, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                problem = _parse_line(raw, line)
                if problem.problem_id in seen:
                    raise ValueError(f"duplicate problem id {problem.problem_id!r}")
            except ValueError as e:
                skipped.append(f"{path}:{line}: {e}")
                warnings.warn(f"skipping {skipped[-1]}", stacklevel=2)
                continue
            seen.add(problem.problem_id)
            problems.append(problem)
    if limit is not None:
        problems = problems[:limit]
    return Dataset(problems, skipped)
