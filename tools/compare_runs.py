"""Compare two runs' ``metrics.jsonl`` (and ``eval.jsonl``) step for step.

Why: the tiny run is deterministic, so a refactor proves it changed no behaviour when every metric of
every step matches the run before it. Wall-clock figures (``time/*``, the trainer's busy fraction) are
the only fields allowed to differ.

    python tools/compare_runs.py BEFORE_DIR AFTER_DIR   # exit 0: identical; 1: the differences, listed
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

WALL_CLOCK_PREFIXES = ("time/", "pipeline/trainer_busy")
WALL_CLOCK_SUFFIXES = ("/time",)
"""Fields that measure elapsed time (``time/step``, ``eval/time``, …), so differ between identical runs."""


def _wall_clock(key: str) -> bool:
    return key.startswith(WALL_CLOCK_PREFIXES) or key.endswith(WALL_CLOCK_SUFFIXES)


def _rows(path: Path) -> list[dict[str, object]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(before: Path, after: Path) -> list[str]:
    """Every difference between the two files' rows, as readable lines (empty when identical)."""
    rows_a, rows_b = _rows(before), _rows(after)
    out: list[str] = []
    if len(rows_a) != len(rows_b):
        out.append(f"{after.name}: {len(rows_b)} rows, {before.name} before had {len(rows_a)}")
    for i, (a, b) in enumerate(zip(rows_a, rows_b, strict=False)):
        keys = {k for k in a.keys() | b.keys() if not _wall_clock(k)}
        for key in sorted(keys):
            if key not in a or key not in b:
                out.append(f"{after.name} row {i + 1}: {key} only {'before' if key in a else 'after'}")
            elif not _same(a[key], b[key]):
                out.append(f"{after.name} row {i + 1}: {key} {a[key]!r} -> {b[key]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="run directory (holding metrics.jsonl) before the change")
    parser.add_argument("after", type=Path, help="run directory after the change")
    args = parser.parse_args(argv)
    diffs: list[str] = []
    compared = 0
    for name in ("metrics.jsonl", "eval.jsonl"):
        a, b = args.before / name, args.after / name
        if not a.is_file() and not b.is_file():
            continue
        if not a.is_file() or not b.is_file():
            diffs.append(f"{name}: present in only one run")
            continue
        diffs += compare(a, b)
        compared += len(_rows(a))
    if compared == 0:
        print("no metrics.jsonl or eval.jsonl in either directory", file=sys.stderr)
        return 2
    for line in diffs[:200]:
        print(line)
    ignored = ", ".join([f"{p}*" for p in WALL_CLOCK_PREFIXES] + [f"*{s}" for s in WALL_CLOCK_SUFFIXES])
    print(f"{compared} rows compared, {len(diffs)} differences (wall-clock fields ignored: {ignored})")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
