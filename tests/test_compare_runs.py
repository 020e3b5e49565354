"""tools/compare_runs.py: the proof that a refactor left the tiny run unchanged must see every real difference
and ignore only wall-clock fields."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "compare_runs", Path(__file__).resolve().parents[1] / "tools" / "compare_runs.py"
)
assert _SPEC is not None and _SPEC.loader is not None
compare_runs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(compare_runs)

ROWS = [
    {"step": 1, "train/loss": -0.17, "reward/solver": 0.25, "verifier/on_right": None, "time/step": 2.0},
    {"step": 2, "train/loss": -0.05, "reward/solver": 0.5, "eval/time": 3.3, "pipeline/trainer_busy": 0.6},
]


def _run(tmp_path: Path, name: str, rows: list[dict[str, object]]) -> Path:
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_identical_runs_and_wall_clock_fields_pass(tmp_path: Path, capsys) -> None:
    timed = [dict(r) for r in ROWS]
    timed[0]["time/step"] = 9.0
    timed[1]["eval/time"] = 1.0
    timed[1]["pipeline/trainer_busy"] = 0.1
    assert compare_runs.main([str(_run(tmp_path, "a", ROWS)), str(_run(tmp_path, "b", timed))]) == 0
    assert "0 differences" in capsys.readouterr().out


def test_a_changed_metric_a_missing_key_and_a_missing_row_are_reported(tmp_path: Path, capsys) -> None:
    changed = [dict(r) for r in ROWS]
    changed[1]["train/loss"] = -0.0500001
    del changed[0]["reward/solver"]
    assert compare_runs.main([str(_run(tmp_path, "a", ROWS)), str(_run(tmp_path, "b", changed))]) == 1
    out = capsys.readouterr().out
    assert "row 2: train/loss -0.05 -> -0.0500001" in out
    assert "row 1: reward/solver only before" in out
    assert compare_runs.main([str(tmp_path / "a"), str(_run(tmp_path, "c", ROWS[:1]))]) == 1
    assert "1 rows, metrics.jsonl before had 2" in capsys.readouterr().out


def test_no_metrics_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    assert compare_runs.main([str(tmp_path / "x"), str(tmp_path / "y")]) == 2


def _checkpoint(tmp_path: Path, name: str, manifest: str, weights: bytes) -> Path:
    """A checkpoint directory as `mars sft --out` leaves it, as far as the comparison reads it: weight
    files listed in a manifest of either version (the digests in it are not what is compared)."""
    ckpt = tmp_path / name
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "__0_0.distcp").write_bytes(weights)
    (ckpt / "model" / ".metadata").write_bytes(name.encode())  # names the run: not compared
    files = {"model/__0_0.distcp": {"size": len(weights)}, "model/.metadata": {"size": len(name)}}
    (ckpt / manifest).write_text(json.dumps({"files": files}))
    return ckpt


def test_checkpoints_compare_by_their_weight_files_across_manifest_versions(tmp_path: Path, capsys) -> None:
    old = _checkpoint(tmp_path, "old", "MANIFEST.sha256.json", b"w" * 64)
    new = _checkpoint(tmp_path, "new", "MANIFEST.json", b"w" * 64)
    assert compare_runs.main([str(old), str(new)]) == 0
    changed = _checkpoint(tmp_path, "changed", "MANIFEST.json", b"w" * 63 + b"x")
    assert compare_runs.main([str(old), str(changed)]) == 1
    assert "MANIFEST.json: model/__0_0.distcp differs" in capsys.readouterr().out
