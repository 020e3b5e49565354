"""One data row → one :class:`~.records.Problem`, by a field mapping (``data.fields``).

Datasets name their columns differently (DAPO-Math: the problem is a chat list in ``prompt`` and the
answer sits in ``reward_model.ground_truth``; AIME25: ``query``/``ans_box``; BeyondAIME:
``input``/``ans_box``), so a mapping says which column — or which dotted path into a nested one — is the
problem, the answer and the id, and which further columns the reward receives. Without a mapping the first
present of the usual names is taken, as ``mars eval`` always did. Pure: rows in, problems or a
:class:`RowError` with the reason out.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mars_megatron.problems.records import Problem
from mars_megatron.row_filter import MISSING, Condition, lookup, parse_condition, parse_path

PROBLEM_KEYS = ("problem", "query", "input", "question")
ANSWER_KEYS = ("answer", "ans_box", "reference")
ID_KEY = "qid"
MAX_ROW_BYTES = 2**20
"""Most text a row may bring (problem, answer and extra columns together, 1 MiB; AIME-style problems are
about 1 KB): a bigger row is unusable, so a crafted file cannot fill memory row by row."""


class RowError(ValueError):
    """Why one row cannot be used; ``reason`` is the short kind counted in the summary."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class FieldMap:
    """Which path of a row is what. ``None``: the first present of the usual names (:data:`PROBLEM_KEYS`,
    :data:`ANSWER_KEYS`, ``qid``). ``check_answers``: references must be answers math-verify or a task's
    rule can read (a reward function of the user's takes any JSON value, and then the answer may be
    absent)."""

    problem: str | None = None
    answer: str | None = None
    id: str | None = None
    extra: tuple[str, ...] = ()
    filter: tuple[str, ...] = ()
    check_answers: bool = True

    def __post_init__(self) -> None:
        for path in (self.problem, self.answer, self.id, *self.extra):
            if path is not None:
                parse_path(path)  # FilterError (a ValueError) naming the bad path
        self.conditions()

    @classmethod
    def of(cls, section: Any, *, check_answers: bool = True) -> FieldMap:
        """From a config section with ``fields`` (``problem``, ``answer``, ``id``, ``extra``) and
        ``filter`` (``data`` or ``evaluation``)."""
        f = section.fields
        return cls(f.problem, f.answer, f.id, tuple(f.extra), tuple(section.filter), check_answers)

    def conditions(self) -> list[Condition]:
        return [parse_condition(c) for c in self.filter]

    def top_columns(self) -> set[str]:
        """The top-level columns a table is read with (only those: a wide table's other columns are never
        read): each mapped path's first name, and the usual names of every field left to them."""
        paths = [p for p in (self.problem, self.answer, self.id, *self.extra) if p is not None]
        wanted = {str(parse_path(p)[0]) for p in paths} | {str(c.path[0]) for c in self.conditions()}
        if self.problem is None:
            wanted.update(PROBLEM_KEYS)
        if self.answer is None:
            wanted.update(ANSWER_KEYS)
        if self.id is None:
            wanted.add(ID_KEY)
        return wanted

    def named(self) -> dict[str, str]:
        """``{field: path}`` of every path the mapping names (for the schema check's message)."""
        out = {k: v for k, v in (("problem", self.problem), ("answer", self.answer), ("id", self.id)) if v}
        out.update({f"extra[{i}]": p for i, p in enumerate(self.extra)})
        return out


def _problem_text(row: Mapping[str, Any], path: str | None) -> str:
    if path is None:
        text = next((row[k] for k in PROBLEM_KEYS if isinstance(row.get(k), str) and row[k].strip()), None)
        if text is None:
            raise RowError("no problem text", f"no problem text (one of {', '.join(PROBLEM_KEYS)})")
        return text
    value = lookup(row, parse_path(path))
    if value is MISSING or value is None:
        raise RowError("no problem text", f"no problem text in column '{path}'")
    if isinstance(value, list):  # a chat: the last user message is the problem
        users = [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users or not isinstance(users[-1].get("content"), str):
            raise RowError(
                "no problem text", f"no problem text in column '{path}': a list without a user message"
            )
        value = users[-1]["content"]
    if not isinstance(value, str):
        raise RowError("no problem text", f"no problem text in column '{path}': a {type(value).__name__}")
    if not value.strip():
        raise RowError("no problem text", f"no problem text in column '{path}': empty")
    return value


def _reference(row: Mapping[str, Any], fields: FieldMap) -> Any:
    from mars_megatron.rewards.answers import check_reference

    if fields.answer is None:
        key = next((k for k in ANSWER_KEYS if row.get(k) is not None), None)
        if key is None:
            if not fields.check_answers:
                return None
            raise RowError("no reference answer", f"no reference answer (one of {', '.join(ANSWER_KEYS)})")
        path, value = key, row[key]
    else:
        path, value = fields.answer, lookup(row, parse_path(fields.answer))
        if value is MISSING or (value is None and fields.check_answers):
            raise RowError("no reference answer", f"no reference answer in column '{path}'")
    if not fields.check_answers:
        return _json_value(value, path)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise RowError(
            "bad reference answer",
            f"bad reference answer in '{path}': a {type(value).__name__}, not a string or number",
        )
    try:
        check_reference(value)
    except (TypeError, ValueError) as e:
        raise RowError("bad reference answer", f"bad reference answer in '{path}': {e}") from None
    return value


def _json_value(value: Any, path: str, depth: int = 0) -> Any:
    """``value`` as JSON data (what checkpoints and reward workers carry); Arrow's dates and decimals
    become text, bytes are refused (a reward gets text, not blobs)."""
    if depth > 32:
        raise RowError("bad column value", f"column '{path}' is nested more than 32 deep")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal | datetime.date | datetime.time | datetime.timedelta):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_value(v, path, depth + 1) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return [_json_value(v, path, depth + 1) for v in value]
    raise RowError("bad column value", f"column '{path}' holds {type(value).__name__}, not JSON data")


def _problem_id(row: Mapping[str, Any], fields: FieldMap, default: str) -> str:
    value = row.get(ID_KEY) if fields.id is None else lookup(row, parse_path(fields.id))
    if isinstance(value, int | str) and not isinstance(value, bool) and str(value).strip():
        return str(value)
    if fields.id is not None:
        got = "nothing" if value is None or value is MISSING else repr(value)[:40]
        raise RowError("no id", f"no problem id in column '{fields.id}' (got {got})")
    return default


def row_problem(row: Any, fields: FieldMap, line: int, default_id: str) -> Problem:
    """The problem of one row (a mapping of column → value); RowError saying why it cannot be used."""
    if not isinstance(row, Mapping):
        raise RowError("not an object", f"expected a JSON object, got {type(row).__name__}")
    text = _problem_text(row, fields.problem)
    reference = _reference(row, fields)
    extra = {}
    for path in fields.extra:
        value = lookup(row, parse_path(path))
        if value is MISSING:
            raise RowError("no extra value", f"no value in column '{path}' (fields.extra)")
        extra[path] = _json_value(value, path)
    problem_id = _problem_id(row, fields, default_id)
    size = len(text.encode("utf-8", "surrogatepass")) + len(json.dumps([reference, extra], default=str))
    if size > MAX_ROW_BYTES:
        raise RowError("row too large", f"row of {size} bytes of text; at most {MAX_ROW_BYTES // 2**20} MiB")
    for name, value in (("problem text", text), ("reference answer", reference), ("id", problem_id)):
        try:
            str(value).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800": no text can hold it
            raise RowError(
                "not text", f"{name} holds a lone surrogate (\\ud800-\\udfff), which is not text"
            ) from None
    return Problem(problem_id, text, reference, line, extra)
