"""The record of one problem, from the data file to the reward, and what reading a file gave."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    problem_id: str
    """The id column's value (``qid`` by default) when the row has one, else ``line<N>`` (JSONL) or
    ``row<N>`` (tables); keys results for --resume."""
    text: str
    reference: Any
    """The reference answer (a string or number for math-verify and the built-in rules; anything JSON for
    a reward function of the user's); None when the task has no answer column."""
    line: int
    """1-based line number in the data file (the row, 1-based, of a table)."""
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    """Further columns of the row that the data mapping hands to the reward (``data.fields.extra``), as
    JSON values; empty for most tasks."""


@dataclass(frozen=True)
class Dataset:
    problems: list[Problem]
    skipped: list[str]
    """One ``file:row: reason`` per unusable row, the first :data:`~.load.MAX_SKIPPED_SHOWN` of them."""
    unusable: int = 0
    """Rows that could not be used (all of them, also those past the shown ones)."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Unusable rows by reason (``no problem text``, ``bad reference answer``...)."""
    filtered: int = 0
    """Rows the filter left out (usable or not: the filter is applied first)."""
    rows: int = 0
    """Rows read (blank JSONL lines not counted)."""

    def summary(self, name: str) -> str:
        """One line for the log: what was read, kept, filtered and why rows were unusable."""
        text = f"{name}: {len(self.problems)} problems of {self.rows} rows"
        if self.filtered:
            text += f", {self.filtered} left out by the filter"
        if self.unusable:
            why = ", ".join(f"{n} {reason}" for reason, n in self.reasons.most_common())
            text += f", {self.unusable} unusable ({why})"
        return text
