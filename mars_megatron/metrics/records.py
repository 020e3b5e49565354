"""A run's metric files on disk: their names, the key prefixes, and the one strict reader of
``metrics.jsonl``.

Why a module of its own: the sink writes these files and the plots read them, and the sink draws plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
EVAL_PREFIX = "eval/"
TENSORBOARD_DIR = "tensorboard"
REWARDS_PNG = "rewards.png"
REWARD_PREFIX = "reward/"


def parse_line(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}): {line[:80]!r}") from err
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"{path}:{number}: no integer 'step' in {line[:80]!r}")
    return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (blank lines skipped); ``null`` stays ``None``.

    A line that is not a JSON object with an integer ``step`` raises ``ValueError`` naming file and line.
    """
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                records.append(parse_line(path, number, line))
    return records
