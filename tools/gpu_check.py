"""The first thing to run on a GPU node: every ``gpu`` test, then a 10-step tiny MarsRL run on the GPU
(Transformer Engine spec, bf16, a vLLM engine sharing the GPU), and one table of what passed, the step
time, the peak memory of every GPU and the trainer-vs-engine log-prob mismatch.

Usage (from the repository root, after ``scripts/setup_gpu.sh`` or inside the container of
``docker/Dockerfile``; the node needs an NVIDIA driver R580 or newer, since PyPI's torch 2.13 is built for
CUDA 13: :data:`MIN_DRIVER`)::

    scripts/gpu_check.sh                 # everything; the table also goes to runs/gpu_check/summary.md
    scripts/gpu_check.sh --skip-tests    # only the tiny run
    scripts/gpu_check.sh --steps 20 --out runs/gpu_check-2

The ``gpu`` tests run in two pytest processes, as in ``scripts/test.sh``: vLLM's tests apart, because vLLM
sets process-wide state. Peak memory per GPU is what ``nvidia-smi`` reports while the tiny run runs
(every process on the GPU: trainer rank and vLLM engine together), sampled every 0.5 s. The exit status
is 0 only when no test failed and every step of the tiny run updated the policy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = {"gpu tests": "gpu and not vllm", "gpu tests (vLLM)": "gpu and vllm"}
"""pytest phases: name -> marker expression."""


@dataclass
class TestResults:
    """One pytest phase, read from its JUnit XML."""

    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (test, reason)


def read_junit(path: Path) -> TestResults:
    """Outcomes of every test case in a pytest ``--junitxml`` file."""
    results = TestResults()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            results.failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            results.skipped.append((name, (skip.get("message") or "").removeprefix("Skipped: ")))
        else:
            results.passed.append(name)
    return results


def peak_memory(samples: list[tuple[int, float]]) -> dict[int, float]:
    """Highest used MiB per GPU index from ``(index, MiB)`` samples."""
    peaks: dict[int, float] = {}
    for index, mib in samples:
        peaks[index] = max(peaks.get(index, 0.0), mib)
    return dict(sorted(peaks.items()))


def parse_smi(text: str) -> list[tuple[int, float]]:
    """``nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits`` lines."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out.append((int(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return out


def run_summary(records: list[dict], steps: int) -> dict[str, float | int]:
    """What the table shows of the tiny run's metrics.jsonl: steps done and updated, the median step time
    after the first (which pays for start-up and CUDA-graph capture), and the mismatch of every step."""
    times = [r["time/step"] for r in records]
    abs_mean = [r["train/mismatch/all/abs_mean"] for r in records if "train/mismatch/all/abs_mean" in r]
    kl = [r["train/mismatch/all/kl"] for r in records if "train/mismatch/all/kl" in r]
    return {
        "steps": len(records),
        "steps_wanted": steps,
        "updated": sum(1 for r in records if r.get("train/update_ok") == 1.0),
        "first_step_s": times[0] if times else float("nan"),
        "step_s": statistics.median(times[1:]) if len(times) > 1 else float("nan"),
        "mismatch_abs_mean": max(abs_mean) if abs_mean else float("nan"),
        "mismatch_kl": max(kl) if kl else float("nan"),
    }


def table(
    phases: dict[str, TestResults | str],
    run: dict[str, float | int] | str,
    memory: dict[int, float],
    total_mib: dict[int, float],
) -> str:
    """The markdown table of the check (a phase or the run may be a string: why it has no results)."""
    rows = ["| check | result |", "|---|---|"]
    for name, res in phases.items():
        if isinstance(res, str):
            rows.append(f"| {name} | {res} |")
            continue
        rows.append(
            f"| {name} | {len(res.passed)} passed, {len(res.failed)} failed, {len(res.skipped)} skipped |"
        )
        rows += [f"| &nbsp;&nbsp;FAILED | `{t}` |" for t in res.failed]
        rows += [f"| &nbsp;&nbsp;skipped | `{t}`: {why} |" for t, why in res.skipped]
    if isinstance(run, str):
        rows.append(f"| tiny MarsRL run | {run} |")
    else:
        rows.append(
            f"| tiny MarsRL run | {run['steps']}/{run['steps_wanted']} steps, policy updated in "
            f"{run['updated']} |"
        )
        rows.append(
            f"| step time | {run['step_s']:.2f} s median after step 1 (step 1: {run['first_step_s']:.1f} s) |"
        )
        rows.append(
            f"| trainer-vs-engine log-probs | mean abs diff {run['mismatch_abs_mean']:.2e}, k3 KL "
            f"{run['mismatch_kl']:.2e} (worst step) |"
        )
    for index, mib in memory.items():
        total = total_mib.get(index)
        of = f" of {total / 1024:.1f}" if total else ""
        rows.append(f"| peak memory GPU {index} | {mib / 1024:.1f}{of} GiB |")
    return "\n".join(rows)


MIN_DRIVER = {13: 580}
"""Lowest NVIDIA driver branch per CUDA major version of torch's build: PyPI's torch 2.13 is built for
CUDA 13, which needs an R580 driver or newer (580.65.06+ on Linux); an older driver leaves
``torch.cuda.is_available()`` False with no other sign."""


def driver_problem(torch_cuda: str | None, driver: str | None) -> str | None:
    """Why this torch cannot use this driver (``torch.version.cuda``, ``nvidia-smi``'s
    ``driver_version``), or None when the driver is new enough or either version is unknown."""
    if not torch_cuda or not driver:
        return None
    try:
        cuda_major, driver_major = int(torch_cuda.split(".")[0]), int(driver.split(".")[0])
    except ValueError:
        return None
    need = MIN_DRIVER.get(cuda_major)
    if need is None or driver_major >= need:
        return None
    return (
        f"torch built for CUDA {torch_cuda} needs an NVIDIA driver R{need} or newer; this node's driver "
        f"is {driver}: upgrade the driver (or use a torch built for an older CUDA)"
    )


def ok(phases: dict[str, TestResults | str], run: dict[str, float | int] | str) -> bool:
    if isinstance(run, str) or run["updated"] != run["steps_wanted"]:
        return False
    return all(not isinstance(r, str) and not r.failed for r in phases.values())


# ------------------------------------------------------------------------------------------- side effects
def _smi(query: str) -> str:
    return subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


class MemorySampler:
    """Polls ``nvidia-smi`` every ``interval`` seconds in a thread until stopped."""

    def __init__(self, interval: float = 0.5) -> None:
        self.samples: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True)

    def _loop(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.samples += parse_smi(_smi("index,memory.used"))
            except (OSError, subprocess.CalledProcessError):
                pass
            self._stop.wait(interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _driver_version() -> str | None:
    """``nvidia-smi``'s driver version of the first GPU, None without nvidia-smi or GPUs."""
    try:
        lines = _smi("driver_version").split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return lines[0] if lines else None


def _pytest(marker: str, junit: Path) -> TestResults | str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-m", marker, f"--junitxml={junit}", "tests"],
        cwd=REPO,
    )
    if not junit.exists():
        return f"pytest exited {done.returncode} without results"
    return read_junit(junit)


def _mars(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "mars_megatron.cli", *args], cwd=REPO, check=True)


def tiny_run(out: Path, steps: int, gpus: int) -> tuple[dict[str, float | int] | str, dict[int, float]]:
    """A random tiny Qwen3-MoE in bf16, ``steps`` MarsRL steps with the TE spec and a vLLM engine sharing
    the trainer's GPUs (two GPUs: EP2 and a tensor-parallel engine over both)."""
    model = out / "hf"
    _mars("init-model", "--preset", "tiny-moe", "--out", str(model), "--dtype", "bfloat16")
    layout = ["parallel.ep=2", "rollout.tp=2"] if gpus >= 2 else ["parallel.ep=1"]
    run = out / "run"
    with MemorySampler() as sampler:
        try:
            _mars(
                "train", "examples/tiny_cpu.yaml", f"model.hf_dir={model}", f"logging.run_dir={run}",
                "model.transformer_impl=transformer_engine", "model.dtype=bfloat16", "rollout.engine=vllm",
                "rollout.dtype=bfloat16", "pipeline.placement=colocated", f"train.steps={steps}", *layout,
            )  # fmt: skip
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            summary: dict[str, float | int] | str = run_summary(records, steps)
        except subprocess.CalledProcessError as e:
            summary = f"FAILED: `mars train` exited {e.returncode} (log above)"
    return summary, peak_memory(sampler.samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu_check", help="output folder (must not exist)")
    parser.add_argument("--steps", type=int, default=10, help="steps of the tiny MarsRL run")
    parser.add_argument("--skip-tests", action="store_true", help="only the tiny run")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        driver = _driver_version()
        print(
            "gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}; NVIDIA driver "
            f"{driver or 'not found (no nvidia-smi)'}). "
            + (driver_problem(torch.version.cuda, driver) or "")
            + " Run it on a GPU node (CUDA 13 torch: driver R580+), in the environment of "
            "scripts/setup_gpu.sh or the container of docker/Dockerfile.",
            file=sys.stderr,
        )
        return 2
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the step time leaves out step 1)")
    out = (REPO / args.out).resolve()
    if out.exists():
        parser.error(f"{out} exists; remove it or pass another --out")
    out.mkdir(parents=True)
    gpus = torch.cuda.device_count()
    phases: dict[str, TestResults | str] = {}
    for name, marker in PHASES.items():
        phases[name] = "not run (--skip-tests)" if args.skip_tests else _pytest(marker, out / f"{marker}.xml")
    run, memory = tiny_run(out, args.steps, gpus)
    total = dict(parse_smi(_smi("index,memory.total")))
    device = _smi("name").splitlines()[0].strip()
    text = (
        f"GPU check: {gpus} x {device}, driver {_driver_version()}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), {time.strftime('%Y-%m-%d')}\n\n"
    )
    text += table(phases, run, memory, total)
    (out / "summary.md").write_text(text + "\n")
    print("\n" + text)
    return 0 if ok(phases, run) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
