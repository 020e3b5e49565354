"""Row filters of data files (``data.filter``): conditions written as text, read by a small grammar.

A filter is a list of conditions that must all hold, each ``PATH OP VALUE``: ``PATH`` a column or a dotted
path into nested columns (``reward_model.style``), ``OP`` one of ``==``, ``!=``, ``<``, ``<=``, ``>``,
``>=``, ``in``, ``not in``, and ``VALUE`` a JSON literal (``"rule"``, ``3``, ``true``, ``null``,
``["aime", "amc"]``). Why a grammar and not a Python expression: the text comes from a config file or a
command line, and nothing read from those may run as code; a grammar this small is also easy to document
and to check before the data is opened. A leaf module: the config checks the syntax, the data loader
(:mod:`mars_megatron.problems`) applies it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mars_megatron.json_file import parse_json

__all__ = ["Condition", "FilterError", "lookup", "parse_condition", "parse_path"]

_PATH = r"[A-Za-z_][A-Za-z0-9_-]*(?:\.(?:[A-Za-z_][A-Za-z0-9_-]*|\d{1,6}))*"
_PATH_RE = re.compile(rf"^{_PATH}$")
_CONDITION = re.compile(rf"^\s*({_PATH})\s*(==|!=|<=|>=|<|>|not\s+in|in)\s*(.+?)\s*$", re.DOTALL)
MAX_CONDITION_CHARS = 4096
"""Longest condition read: a filter is a few words, a longer one is a mistake (or an attack on the parser)."""
MISSING = object()
"""What :func:`lookup` gives for a path the row does not have."""


class FilterError(ValueError):
    """A condition that cannot be read; the message says why (the caller names the field)."""


def parse_path(text: str) -> tuple[str | int, ...]:
    """``reward_model.ground_truth`` → ``("reward_model", "ground_truth")``; a number is a list index
    (``prompt.0.content``). FilterError for anything else."""
    if not isinstance(text, str) or not _PATH_RE.match(text):
        raise FilterError(
            f"{str(text)[:100]!r} is not a column path (a column name, or names and list indices joined "
            "by dots: reward_model.ground_truth, prompt.0.content)"
        )
    return tuple(int(p) if p.isdigit() else p for p in text.split("."))


def lookup(row: Any, path: Sequence[str | int]) -> Any:
    """The value at ``path`` in a row of nested mappings and lists; :data:`MISSING` where there is none."""
    value = row
    for part in path:
        if isinstance(part, int):
            if not isinstance(value, list | tuple) or part >= len(value):
                return MISSING
            value = value[part]
        elif isinstance(value, Mapping) and part in value:
            value = value[part]
        else:
            return MISSING
    return value


def _ordered(a: Any, b: Any) -> bool:
    numbers = (int, float)
    both_numbers = isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool | type(None))
    return both_numbers or (isinstance(a, str) and isinstance(b, str))


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: _ordered(a, b) and a < b,
    "<=": lambda a, b: _ordered(a, b) and a <= b,
    ">": lambda a, b: _ordered(a, b) and a > b,
    ">=": lambda a, b: _ordered(a, b) and a >= b,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
}


@dataclass(frozen=True)
class Condition:
    """One parsed condition. A row without the path fails every condition but ``!=`` and ``not in``
    (the value is absent, so it is not equal to or among anything); values of different kinds never
    compare as ordered (``"3" < 4`` is false, not an error)."""

    text: str
    path: tuple[str | int, ...]
    op: str
    value: Any

    def holds(self, row: Any) -> bool:
        got = lookup(row, self.path)
        if got is MISSING:
            return self.op in ("!=", "not in")
        try:
            return bool(_OPS[self.op](got, self.value))
        except TypeError:  # e.g. a dict value compared with a list: the row does not match
            return False


def parse_condition(text: str) -> Condition:
    """One condition of ``data.filter``; FilterError naming what is wrong."""
    if not isinstance(text, str):
        raise FilterError(f"expected a condition string, got {type(text).__name__}")
    if len(text) > MAX_CONDITION_CHARS:
        raise FilterError(f"condition of {len(text)} characters; at most {MAX_CONDITION_CHARS}")
    match = _CONDITION.match(text)
    if match is None:
        raise FilterError(
            f"{text[:100]!r} is not 'PATH OP VALUE' (OP one of ==, !=, <, <=, >, >=, in, not in; VALUE a "
            'JSON literal: "text", 3, true, null, ["a", "b"])'
        )
    path, op, raw = match.group(1), " ".join(match.group(2).split()), match.group(3)
    try:
        value = parse_json(raw)
    except ValueError as e:
        raise FilterError(f"{text[:100]!r}: the value {raw[:60]!r} is not a JSON literal ({e})") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise FilterError(f"{text[:100]!r}: the value must be finite")
    if op in ("in", "not in") and not isinstance(value, list):
        raise FilterError(f"{text[:100]!r}: '{op}' needs a JSON list, got {raw[:60]!r}")
    if op in ("<", "<=", ">", ">=") and (isinstance(value, bool) or not isinstance(value, int | float | str)):
        raise FilterError(f"{text[:100]!r}: '{op}' needs a number or a string, got {raw[:60]!r}")
    return Condition(text, parse_path(path), op, value)
