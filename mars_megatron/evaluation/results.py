"""The output directory: ``results.jsonl`` (one line per finished problem × sample, appended and flushed
as each finishes), ``config.json`` (what produced them) and ``summary.json``.

Resuming reads the finished lines back. A line that does not parse (the last one, when a run was killed
mid-write) is dropped from the file, counted and warned about; --resume refuses a directory whose
config.json differs from this run's, so results of different settings are never mixed.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, TextIO

from mars_megatron.json_file import parse_json, read_json

RESULTS = "results.jsonl"
CONFIG = "config.json"
SUMMARY = "summary.json"


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read_results(path: Path) -> tuple[list[dict], int]:
    """Finished records of ``path`` and how many lines were dropped; rewrites the file without them."""
    records: list[dict] = []
    kept: list[str] = []
    dropped = 0
    seen: set[tuple[str, int]] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
            key = (record["problem_id"], record["sample"])
        except (ValueError, KeyError, TypeError):  # parse_json: every bad line (deep nesting too)
            dropped += 1
            warnings.warn(
                f"{path}:{number}: dropping an unreadable result line (a killed run?)", stacklevel=2
            )
            continue
        if key not in seen:
            seen.add(key)
            records.append(record)
            kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return records, dropped


class OutputDir:
    """Owns OUT: prepares it (fresh or resumed), appends results, writes the summary."""

    def __init__(self, path: str | Path, config: dict[str, Any], *, resume: bool) -> None:
        from mars_megatron.config import check_output_place

        self.path = Path(path)
        check_output_place(self.path, "--out")  # the root, a system folder, the home folder itself
        self.records: list[dict] = []
        self.dropped_lines = 0
        if self.path.exists() and not self.path.is_dir():
            raise FileExistsError(f"--out {self.path} exists and is not a directory")
        if self.path.exists() and any(self.path.iterdir()):
            if not resume:
                raise FileExistsError(
                    f"--out {self.path} exists and is not empty; pass --resume to continue it, or choose "
                    "another --out"
                )
            self._check_config(config)
            if (self.path / RESULTS).exists():
                self.records, self.dropped_lines = _read_results(self.path / RESULTS)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a parent is a file, or not writable
            raise ValueError(f"--out {self.path}: cannot create it ({e.strerror or e})") from None
        _write_json(self.path / CONFIG, config)
        self._file: TextIO = (self.path / RESULTS).open("a", encoding="utf-8")

    def _check_config(self, config: dict[str, Any]) -> None:
        saved_path = self.path / CONFIG
        if not saved_path.exists():
            if (self.path / RESULTS).exists():
                raise ValueError(
                    f"--resume: {self.path / RESULTS} has no {CONFIG} beside it, so the settings that "
                    "produced its results are unknown; evaluate into a new --out"
                )
            return
        saved = read_json(saved_path, lambda msg: ValueError(f"--resume: {msg}; evaluate into a new --out"))
        if not isinstance(saved, dict):
            raise ValueError(f"--resume: {saved_path} is not a JSON object; evaluate into a new --out")
        changed = sorted(k for k in saved.keys() | config.keys() if saved.get(k) != config.get(k))
        if changed:
            details = ", ".join(f"{k}: {saved.get(k)!r} -> {config.get(k)!r}" for k in changed)
            raise ValueError(f"--resume: {saved_path} was written with other settings ({details})")

    @property
    def finished(self) -> set[tuple[str, int]]:
        return {(r["problem_id"], r["sample"]) for r in self.records}

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.records.append(record)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        _write_json(self.path / SUMMARY, summary)
        return self.path / SUMMARY

    def close(self) -> None:
        self._file.close()
