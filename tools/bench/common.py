"""What the tiny-task benchmarks share: the `mars` command in a child process and one warm start.

Each run is a child process so that Ray and the gloo groups of one run cannot leak into the next; the
benchmarks compare runs that start from one SFT checkpoint, so what differs between them is the setting
under test.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def mars(*args: str) -> float:
    """Run ``mars ARGS`` from the repository root; the wall time in seconds (start-up included)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mars_megatron.cli", *args], cwd=REPO, check=True)
    return time.perf_counter() - start


def warm_start(out: str) -> tuple[Path, float]:
    """A new output folder ``out`` (relative to the repository) holding a random tiny-moe (``hf``) and its
    `mars sft` warm start (``sft``): the folder and the SFT wall time. An existing folder is refused, so a
    benchmark never mixes runs."""
    folder = (REPO / out).resolve()
    if folder.exists():
        raise SystemExit(f"{folder} exists; remove it or pass another --out")
    folder.mkdir(parents=True)
    mars("init-model", "--preset", "tiny-moe", "--out", str(folder / "hf"))
    seconds = mars(
        "sft", "examples/tiny_sft.yaml", "--model-dir", str(folder / "hf"), "--out", str(folder / "sft")
    )
    return folder, seconds
