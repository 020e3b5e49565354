"""Evaluation problems from JSONL: one object per line with a problem text and a reference answer.

Field names differ between datasets (AIME25 has ``query``/``ans_box`` with a string answer, BeyondAIME
``input``/``query``/``ans_box`` with an integer), so the first present key of :data:`PROBLEM_KEYS` and
:data:`ANSWER_KEYS` is used. A line that cannot be used (not UTF-8, not a JSON object, no problem text, a
reference answer math-verify cannot read, over 1 MiB, a duplicate id) is skipped with a warning naming
``file:line`` and the reason; what is kept is clean text.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars_megatron.json_file import parse_json
from mars_megatron.rewards.answers import check_reference

MAX_LINE_BYTES = 2**20
"""Longest line read (1 MiB; AIME-style problems are about 1 KB): a longer one is skipped unread, so a
file without newlines cannot fill memory."""
PROBLEM_KEYS = ("problem", "query", "input", "question")
ANSWER_KEYS = ("answer", "ans_box", "reference")


@dataclass(frozen=True)
class Problem:
    problem_id: str
    """``qid`` of the record when it has one, else ``line<N>``; keys results for --resume."""
    text: str
    reference: str | int | float
    line: int
    """1-based line number in the data file (the row, 1-based, of a table)."""
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    """Further columns of the row that the data mapping hands to the reward (``data.fields.extra``), as
    JSON values; empty for most tasks."""


@dataclass(frozen=True)
class Dataset:
    problems: list[Problem]
    skipped: list[str]
    """One ``file:line: reason`` per unusable line of the whole file."""


def _parse_line(data: bytes, line: int) -> Problem:
    """One problem, or ValueError with the reason."""
    record = parse_json(data)  # not UTF-8, bad JSON, huge ints, deep nesting: a ValueError saying which
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
        check_reference(record[key])
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad reference answer in '{key}': {e}") from None
    qid = record.get("qid")
    problem_id = str(qid) if isinstance(qid, int | str) and not isinstance(qid, bool) else f"line{line}"
    for name, value in (("problem text", text), ("reference answer", record[key]), ("qid", problem_id)):
        try:
            str(value).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800": no text can hold it
            raise ValueError(f"{name} holds a lone surrogate (\\ud800-\\udfff), which is not text") from None
    return Problem(problem_id, text, record[key], line)


def load_problems(path: str | Path, limit: int | None = None) -> Dataset:
    """Every usable problem of ``path`` (the first ``limit`` of them); bad lines of the whole file are
    reported in ``skipped`` and warned about. Blank lines are ignored."""
    path = Path(path)
    problems: list[Problem] = []
    skipped: list[str] = []
    seen: set[str] = set()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with path.open("rb") as f:
        for line, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if not raw.strip():
                continue
            if line == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as some editors write
            try:
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    while raw and not raw.endswith(b"\n"):  # skip the rest of the line unread
                        raw = f.readline(MAX_LINE_BYTES)
                    raise ValueError(f"line longer than {MAX_LINE_BYTES // 2**20} MiB")
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
