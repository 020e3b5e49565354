"""The device check's runner: every check in order, one table, ``device_check.md`` and ``device_check.json``.

    python -m tools.device_check [--cpu] [--only NAME[,NAME]] [--out DIR] [--budget-s S] [--keep-workdir]

(``scripts/device_check.sh`` installs megatron-core from ``.whl/`` first and runs this.) Each check is a
module of this package with ``run(ctx) -> list[Row]``, each row one assertion on measured values. An
exception in a check becomes a failed row naming it, a check module not written yet a failed row
"not implemented"; the other checks run on. The exit status is 1 when any row failed, 2 when the run
could not start (no usable GPU, bad arguments). Progress and each check's wall time go to stderr; the
table and the JSON are rewritten after every check, so a run cut short leaves what it measured.

Without ``--cpu`` it needs one CUDA GPU: NCCL, bf16, megatron's local layer spec (the machine has no
Transformer Engine). ``--cpu``: gloo, fp32 and tiny shapes, the same assertions where they apply; CI runs
it so the checks cannot rot between GPU loans. In both modes Ray, vLLM, Transformer Engine and
math-verify are unimportable in every process of the run, as on the GPU machine.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from tools.device_check.common import ABSENT, ABSENT_ENV, Context, Row, block_absent, imported_absent

CHECKS: tuple[tuple[str, str], ...] = (
    ("1", "logprobs"),
    ("2", "train_step"),
    ("3", "export"),
    ("4", "ipc_handoff"),
    ("5", "roundtrip"),
    ("6", "speed"),
)
"""(number, module) of every check, in the order they run."""

GPU_BUDGET_S = 540.0
"""The GPU run's wall time (9 minutes): a loan gives 15 minutes, start-up included, one command 10. On
the H100 (2026-11-26) the six checks took 491 s: 247 s for checks 1-5, 244 s for check 6; a budget of 480
had cut check 6 short."""
CPU_BUDGET_S = 1200.0
MIN_CHECK_S = 20.0
"""A check is not started with less time than this left."""

NEEDED = ("megatron.core", "blake3", "transformers", "safetensors", "numpy", "yaml", "psutil", "einops")
"""Modules the checks need beyond torch: megatron-core and blake3 (the checkpoint manifest's digest) from
the carried wheels, the rest from the GPU machine's image. ``psutil``: megatron's checkpoint writer
needs it in a forked process, and without it that process dies while the save waits for it forever, so
its absence is named before anything runs."""


def missing_modules(names: tuple[str, ...] = NEEDED) -> list[str]:
    """Those of ``names`` that cannot be found (without importing them)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            missing.append(name)
    return missing


ENV_DEFAULTS = {
    # torch's deterministic algorithms need a fixed cuBLAS workspace (check 2's resumed steps)
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    # a world of one process on one host: loopback is the only interface it needs
    "NCCL_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    # the GPU machine has no network: never let transformers or the hub try it
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}

NO_CUDA = (
    "device_check: torch sees no usable CUDA GPU (torch {torch}, built for CUDA {cuda}). PyPI's CUDA 13 "
    "torch needs an NVIDIA driver R580 or newer (nvidia-smi shows the driver); run with --cpu for the CI "
    "mode."
)


def _log(start: float) -> Any:
    def log(message: str) -> None:
        print(f"[device_check {time.monotonic() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    return log


def run_check(number: str, module: str, ctx: Context) -> list[Row]:
    """One check's rows; never raises (a missing module, an exception or no rows is a failed row)."""
    label = f"{number} {module}"
    full = f"{__package__}.{module}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name == full:
            return [Row(label, "check module", "not implemented", f"{full} exists", False)]
        return [_failure(label, "import", e)]
    except Exception as e:
        return [_failure(label, "import", e)]
    try:
        rows = list(mod.run(ctx))
    except Exception as e:
        return [_failure(label, "run", e)]
    if not rows:
        rows = [Row(label, "rows reported", "none", "≥ 1", False)]
    late = imported_absent()
    if late:
        rows.append(Row(label, f"imports none of {', '.join(ABSENT)}", f"imported {late}", "none", False))
    return rows


def _failure(label: str, stage: str, e: BaseException) -> Row:
    text = traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    message = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    return Row(label, f"{stage} without an exception", message, "no exception", False, {"traceback": text})


# ------------------------------------------------------------------------------------------ environment
def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _smi() -> dict[str, str]:
    """Name, memory (MiB) and driver of GPU 0 from ``nvidia-smi``; empty when it cannot tell."""
    query = [
        "nvidia-smi",
        "-i",
        "0",
        "--query-gpu=name,memory.total,driver_version",
        "--format=csv,noheader,nounits",
    ]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    parts = [p.strip() for p in out.stdout.strip().split(",")] if out.returncode == 0 else []
    return dict(zip(("name", "memory_mib", "driver"), parts, strict=True)) if len(parts) == 3 else {}


def environment(cpu: bool) -> dict[str, Any]:
    """What runs the check: device, driver, library versions, date. Asked of ``nvidia-smi`` where it can
    be, so the runner holds no CUDA context of its own beside the checks' processes."""
    info: dict[str, Any] = {
        "mode": "cpu" if cpu else "gpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "unimportable": list(ABSENT),
    }
    if cpu:
        info["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
        info["driver"] = "none (cpu mode)"
        return info
    smi = _smi()
    if smi:
        info["device"] = smi["name"]
        info["device_memory_gib"] = round(float(smi["memory_mib"]) / 1024, 1)
        info["driver"] = smi["driver"]
    else:
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        try:
            info["driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
        except (OSError, IndexError):
            info["driver"] = "unknown"
    info["gpus"] = torch.cuda.device_count()
    try:
        info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:
        info["nccl"] = "unknown"
    return info


# ------------------------------------------------------------------------------------------------ output
COLUMNS = ("check", "what", "value", "bound", "ok")


def _cells(row: Row) -> tuple[str, ...]:
    return (row.check, row.what, row.value, row.bound, "ok" if row.passed else "FAIL")


def text_table(rows: list[Row]) -> str:
    """The table as aligned text, for the terminal."""
    cells = [COLUMNS, *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    """The table in markdown (pipes in cells escaped), for device_check.md and the README."""

    def cell(s: str) -> str:
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(c) for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def header(env: dict[str, Any], wall: dict[str, float]) -> str:
    driver = f", driver {env['driver']}" if env["mode"] == "gpu" else ""
    nccl = f", NCCL {env['nccl']}" if "nccl" in env else ""
    timing = ", ".join(f"{name} {s:.0f} s" for name, s in wall.items())
    return (
        f"Device check ({env['mode']} mode): {env['device']}{driver}; Python {env['python']}, torch "
        f"{env['torch']} (CUDA {env['cuda']}{nccl}), megatron-core {env['megatron_core']}, transformers "
        f"{env['transformers']}; {env['date']}. Wall time: {timing}; total {sum(wall.values()):.0f} s."
    )


def _plain(obj: Any) -> Any:
    """JSON-safe: non-finite floats as strings, tuples as lists, anything else unknown as its repr."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    return repr(obj)


def write_outputs(out: Path, env: dict[str, Any], results: list[tuple[str, str, float, list[Row]]]) -> None:
    rows = [r for *_, rs in results for r in rs]
    wall = {f"{n} {m}": s for n, m, s, _ in results}
    (out / "device_check.md").write_text(header(env, wall) + "\n\n" + markdown_table(rows) + "\n")
    doc = {
        "environment": env,
        "passed": all(r.passed for r in rows),
        "wall_s": sum(wall.values()),
        "checks": [
            {
                "number": n,
                "module": m,
                "wall_s": s,
                "passed": all(r.passed for r in rs),
                "rows": [asdict(r) for r in rs],
            }
            for n, m, s, rs in results
        ],
    }
    (out / "device_check.json").write_text(json.dumps(_plain(doc), indent=1, ensure_ascii=False) + "\n")


# -------------------------------------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.device_check", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--cpu", action="store_true", help="gloo, fp32, tiny shapes (CI), no GPU needed")
    names = [m for _, m in CHECKS]
    parser.add_argument("--only", default="", help=f"comma-separated checks to run, of: {', '.join(names)}")
    parser.add_argument(
        "--out", default=os.environ.get("OUT") or None, help="folder for the table (default $OUT)"
    )
    parser.add_argument(
        "--keep-workdir", action="store_true", help="keep the scratch folder (models, checkpoints)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for the whole run (default {GPU_BUDGET_S:.0f} on the GPU, {CPU_BUDGET_S:.0f} with "
        "--cpu): checks not started by then fail as not run, a running one gets what is left as its timeout",
    )
    args = parser.parse_args(argv)
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    args.checks = [(n, m) for n, m in CHECKS if not wanted or m in wanted]
    if args.budget_s is None:
        args.budget_s = CPU_BUDGET_S if args.cpu else GPU_BUDGET_S
    if not args.budget_s > MIN_CHECK_S:
        parser.error(f"--budget-s must be more than {MIN_CHECK_S:.0f} seconds, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if args.cpu:  # the CI mode on a machine with a GPU still runs on the host, with gloo
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ[ABSENT_ENV] = ",".join(ABSENT)  # spawned processes block them when they import the package
    late = block_absent(ABSENT)
    if late:
        print(f"device_check: {late} were imported before the runner could block them", file=sys.stderr)
        return 2
    missing = missing_modules()
    if missing:
        print(
            f"device_check: cannot run without {', '.join(missing)} (megatron.core comes from the wheels of "
            "scripts/device_wheels.sh; the others from the machine's image or the project's environment)",
            file=sys.stderr,
        )
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print(NO_CUDA.format(torch=torch.__version__, cuda=torch.version.cuda), file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.budget_s
    log = _log(start)
    env = environment(args.cpu)
    versions = f"torch {env['torch']}, megatron-core {env['megatron_core']}"
    log(f"{env['device']}, {versions}; budget {args.budget_s:.0f} s")
    workdir = Path(tempfile.mkdtemp(prefix="mars-device-check-"))
    results: list[tuple[str, str, float, list[Row]]] = []
    try:
        for number, module in args.checks:
            label = f"{number} {module}"
            if time.monotonic() > deadline - MIN_CHECK_S:
                why = f"not run: the time budget (--budget-s {args.budget_s:.0f}) is spent"
                results.append((number, module, 0.0, [Row(label, "check ran", why, "ran", False)]))
                continue
            ctx = Context(
                cpu=args.cpu,
                device=torch.device("cpu") if args.cpu else torch.device("cuda", 0),
                dtype=torch.float32 if args.cpu else torch.bfloat16,
                workdir=workdir / module,
                log=lambda m, label=label: log(f"{label}: {m}"),
                deadline=deadline,
            )
            ctx.workdir.mkdir()
            t0 = time.monotonic()
            log(f"{label}: start")
            rows = run_check(number, module, ctx)
            seconds = time.monotonic() - t0
            failed = sum(not r.passed for r in rows)
            log(f"{label}: {seconds:.1f} s, {len(rows) - failed} passed, {failed} failed")
            results.append((number, module, seconds, rows))
            if out is not None:  # after every check: a run cut short still leaves what it measured
                write_outputs(out, env, results)
    finally:
        if args.keep_workdir:
            log(f"scratch kept at {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = [r for *_, rs in results for r in rs]
    wall = {f"{n} {m}": s for n, m, s, _ in results}
    print(header(env, wall) + "\n\n" + text_table(rows), flush=True)
    if out is not None:
        write_outputs(out, env, results)
        log(f"wrote {out / 'device_check.md'} and {out / 'device_check.json'}")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
