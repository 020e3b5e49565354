"""Every usable problem of a data file, with what could not be used counted and named.

One entry point for every reader of problems (training's ``data.train_file``, ``evaluation.test_file``,
``mars eval --data``, ``mars sft``'s file): the file's rows (:mod:`.sources`) go through the filter and the
mapping (:mod:`.mapping`); a row that cannot be used is skipped with a warning naming ``file:row``, the
column and the reason, and counted by reason in the :class:`~.records.Dataset`, so nothing is dropped
silently. What is wrong with the file as a whole (it cannot be read, a mapped column does not exist) is a
ValueError naming the file and the field instead.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

from mars_megatron.problems.mapping import FieldMap, RowError, row_problem
from mars_megatron.problems.records import Dataset, Problem
from mars_megatron.problems.sources import is_saved_dataset, read_rows

MAX_SKIPPED_SHOWN = 20
"""Unusable rows warned about one by one; the rest are counted in one closing warning (a file of a
million bad rows must not print a million lines)."""


def load_problems(
    path: str | Path,
    limit: int | None = None,
    fields: FieldMap | None = None,
    *,
    split: str | None = None,
    key: str = "data",
) -> Dataset:
    """Every usable problem of ``path`` (the first ``limit`` of them), by the mapping ``fields`` (the
    usual column names when None); unusable rows of the whole file are counted. ``key``: the config
    section the mapping came from, for messages (``data``, ``evaluation``, ``--data``)."""
    path = Path(path)
    fields = fields or FieldMap()
    conditions = fields.conditions()
    problems: list[Problem] = []
    skipped: list[str] = []
    reasons: Counter[str] = Counter()
    seen: set[str] = set()
    rows = filtered = 0
    default = "line" if not path.is_dir() and path.suffix.lower() not in (".parquet", ".arrow") else "row"
    several = path.is_dir() and not is_saved_dataset(path)  # a folder of Parquet files: ids name the file
    for where, line, row in read_rows(
        path, split=split, wanted=fields.top_columns(), named=fields.named(), key=key
    ):
        rows += 1
        try:
            if isinstance(row, RowError):
                raise row
            if not all(c.holds(row) for c in conditions):
                filtered += 1
                continue
            stem = f"{Path(where).stem}/" if several else ""
            problem = row_problem(row, fields, line, f"{stem}{default}{line}")
            if problem.problem_id in seen:
                raise RowError("duplicate id", f"duplicate problem id {problem.problem_id!r}")
        except RowError as e:
            reasons[e.reason] += 1
            if len(skipped) < MAX_SKIPPED_SHOWN:
                skipped.append(f"{where}:{line}: {e}")
                warnings.warn(f"skipping {skipped[-1]}", stacklevel=2)
            continue
        seen.add(problem.problem_id)
        problems.append(problem)
    unusable = sum(reasons.values())
    if unusable > len(skipped):
        why = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
        warnings.warn(f"{path}: {unusable - len(skipped)} more unusable rows not shown ({why})", stacklevel=2)
    if limit is not None:
        problems = problems[:limit]
    return Dataset(problems, skipped, unusable, reasons, filtered, rows)
