"""Compare two runs' ``metrics.jsonl`` (and ``eval.jsonl``) step for step, and two checkpoints' weights.

Why: the tiny run is deterministic (docs/train.md, "What repeats"), so a refactor proves it changed no
behaviour when every metric of every step matches the run before it. Wall-clock figures (``time/*``, the
trainer's busy fraction) are the only fields allowed to differ. A directory holding a mars checkpoint
(``mars sft --out``: its ``MANIFEST.json``, or ``MANIFEST.sha256.json`` from before BLAKE3) is compared by
the digests of the weight files its manifest lists (``*.safetensors``, ``*.distcp``), hashed here, so a
checkpoint of either manifest version compares with one of the other; its metadata files name the run and
are not compared.

    python tools/compare_runs.py BEFORE_DIR AFTER_DIR   # exit 0: identical; 1: the differences, listed
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

WALL_CLOCK_PREFIXES = ("time/", "pipeline/trainer_busy")
WALL_CLOCK_SUFFIXES = ("/time",)
"""Fields that measure elapsed time (``time/step``, ``eval/time``, …), so differ between identical runs."""


MANIFESTS = ("MANIFEST.json", "MANIFEST.sha256.json")  # mars_megatron/checkpoint/manifest.py: new, first
MANIFEST = MANIFESTS[0]
WEIGHT_SUFFIXES = (".safetensors", ".distcp")
"""Files of a checkpoint that hold its tensors (the rest, e.g. ``model/.metadata``, differ between runs)."""


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


def _manifest(run: Path) -> Path | None:
    return next((run / m for m in MANIFESTS if (run / m).is_file()), None)


def _weights(run: Path) -> dict[str, str]:
    manifest = _manifest(run)
    assert manifest is not None
    with manifest.open(encoding="utf-8") as f:
        files = json.load(f)["files"]
    out = {}
    for name in files:
        if name.endswith(WEIGHT_SUFFIXES):
            with (run / name).open("rb") as w:
                out[name] = hashlib.file_digest(w, "sha256").hexdigest()
    return out


def compare_weights(before: Path, after: Path) -> tuple[list[str], int]:
    """Every weight file of two checkpoint directories whose digest differs or that only one holds, and
    how many files were compared."""
    a, b = _weights(before), _weights(after)
    out = [
        f"{MANIFEST}: {name} only {'before' if name in a else 'after'}"
        for name in sorted(a.keys() ^ b.keys())
    ]
    out += [f"{MANIFEST}: {name} differs" for name in sorted(a.keys() & b.keys()) if a[name] != b[name]]
    return out, len(a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "before",
        type=Path,
        help="run directory (metrics.jsonl) or checkpoint (mars sft --out) before the change",
    )
    parser.add_argument("after", type=Path, help="the same after the change")
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
    weights = 0
    if _manifest(args.before) or _manifest(args.after):
        if not _manifest(args.before) or not _manifest(args.after):
            diffs.append(f"{MANIFEST}: present in only one run")
        else:
            found, weights = compare_weights(args.before, args.after)
            diffs += found
    if compared == 0 and weights == 0 and not diffs:
        print(f"no metrics.jsonl, eval.jsonl or {MANIFEST} in either directory", file=sys.stderr)
        return 2
    for line in diffs[:200]:
        print(line)
    ignored = ", ".join([f"{p}*" for p in WALL_CLOCK_PREFIXES] + [f"*{s}" for s in WALL_CLOCK_SUFFIXES])
    print(
        f"{compared} rows and {weights} weight files compared, {len(diffs)} differences "
        f"(wall-clock fields ignored: {ignored})"
    )
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
