"""What the tiny-task benchmarks share: the `mars` command in a child process and one warm start.

Each run is a child process so that Ray and the gloo groups of one run cannot leak into the next; the
benchmarks compare runs that start from one SFT checkpoint, so what differs between them is the setting
under test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


# ------------------------------------------------------------------------------ jobs side by side
@dataclass(frozen=True)
class Job:
    """One command of a benchmark: its name (a path under the output folder, also its log's name), the
    command line, the jobs it needs finished first, and the folder it writes (removed before a rerun)."""

    name: str
    argv: tuple[str, ...]
    after: tuple[str, ...] = ()
    writes: Path | None = None


def mars_argv(*args: str) -> tuple[str, ...]:
    """The command line of ``mars ARGS`` in a child process (as :func:`mars` runs it)."""
    return (sys.executable, "-m", "mars_megatron.cli", *args)


class JobFailed(RuntimeError):
    """A job exited non-zero; the jobs finished before it (and beside it) kept their results."""


def run_jobs(jobs: Sequence[Job], out: Path, lanes: int, log: Callable[[str], None] = print) -> None:
    """Run ``jobs`` at most ``lanes`` at a time, each once all of its ``after`` jobs have finished, in list
    order among the ready ones; every job's output goes to ``out/logs/<name>.log``.

    Why side by side: every process of a run uses one CPU thread (mars_megatron/runtime_env.py), so a
    `mars sft` or `mars eval` leaves the second core idle, and the figures do not depend on what else runs
    (the same commit gives the same figures idle or loaded: tests/test_repeat.py). A finished job leaves
    ``out/done/<name>``; a rerun skips those and redoes the others from scratch (their ``writes`` folder is
    removed first), so a failure or an interrupt loses nothing already finished. A failed job stops new
    starts; the jobs running beside it finish (keeping their results) and :class:`JobFailed` names the job
    and its log."""
    names = [j.name for j in jobs]
    unknown = sorted({a for j in jobs for a in j.after} - set(names))
    if len(set(names)) != len(names) or unknown:
        raise ValueError(f"jobs: duplicate names or unknown dependencies {unknown}")
    done_dir, logs = out / "done", out / "logs"
    finished = {j.name for j in jobs if (done_dir / j.name).is_file()}
    pending = [j for j in jobs if j.name not in finished]
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    failed: list[str] = []
    start = time.perf_counter()
    if finished:
        log(f"{len(finished)} of {len(jobs)} jobs already done in {out}; running the other {len(pending)}")
    try:
        while pending or running:
            while not failed and len(running) < lanes:
                ready = next((j for j in pending if all(a in finished for a in j.after)), None)
                if ready is None:
                    break
                pending.remove(ready)
                if ready.writes is not None and ready.writes.exists():
                    shutil.rmtree(ready.writes)  # a rerun after a failure starts this job afresh
                (logs / ready.name).parent.mkdir(parents=True, exist_ok=True)
                with open(logs / f"{ready.name}.log", "wb") as sink:
                    process = subprocess.Popen(ready.argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
                running[ready.name] = (process, time.perf_counter())
            if failed and not running:
                break
            if not running:
                raise RuntimeError(f"jobs {[j.name for j in pending]} wait on jobs that never run")
            time.sleep(0.5)
            for name, (process, began) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                took = time.perf_counter() - began
                elapsed = (time.perf_counter() - start) / 60
                if process.returncode:
                    failed.append(name)
                    log(f"[{elapsed:5.1f} min] FAILED {name} (exit {process.returncode}, {took:.0f} s)")
                    continue
                (done_dir / name).parent.mkdir(parents=True, exist_ok=True)
                (done_dir / name).write_text(f"{took:.1f}\n")
                finished.add(name)
                log(f"[{elapsed:5.1f} min] done {name} ({took:.0f} s)")
    finally:
        for process, _ in running.values():  # an interrupt: stop what runs (its job reruns next time)
            process.terminate()
            process.wait()
    if failed:
        tail = (logs / f"{failed[0]}.log").read_text(errors="replace").splitlines()[-15:]
        raise JobFailed(
            f"job {failed[0]} failed; its log {logs / failed[0]}.log ends:\n  " + "\n  ".join(tail) + "\n"
            "the finished jobs' results are kept: the same command with --resume runs the rest"
        )
