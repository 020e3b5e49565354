"""The device check (``scripts/device_check.sh``, ``tools/device_check``) in its ``--cpu`` mode, so it cannot
rot between GPU loans: one run of the whole check (gloo, fp32, tiny shapes) whose rows of checks 1, 2, 3
and 5 must all pass, with the table and the JSON the GPU run writes; the package imports with Ray, vLLM,
Transformer Engine and math-verify unimportable (the GPU machine has none of them); each check's
assertions fail on wrong values; the runner turns a missing check or an exception into a failed row.
The ``network`` test resolves the wheel set (``requirements/device.txt``) for CPython 3.12 manylinux
with the script's own ``pip download``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.utils import canonicalize_name, parse_wheel_filename

from tools.device_check import export as export_check
from tools.device_check import logprobs, roundtrip, train_step
from tools.device_check.__main__ import CHECKS, missing_modules, parse, run_check
from tools.device_check.common import ABSENT, Context

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.sh"
MINE = ("1 logprobs", "2 train_step", "3 export", "5 roundtrip")
"""The checks this file holds to passing; 4 and 6 have tests of their own."""


@dataclass(frozen=True)
class CpuRun:
    returncode: int
    stdout: str
    stderr: str
    out: Path
    report: dict[str, Any]

    def rows(self, check: str) -> list[dict[str, Any]]:
        return [r for c in self.report["checks"] for r in c["rows"] if r["check"] == check]

    def explain(self) -> str:
        return f"{self.stdout[-6000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}"


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> CpuRun:
    out = tmp_path_factory.mktemp("device-check")
    proc = subprocess.run(
        [str(SCRIPT), "--cpu", "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    report_path = out / "device_check.json"
    assert report_path.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return CpuRun(proc.returncode, proc.stdout, proc.stderr, out, json.loads(report_path.read_text()))


# ---------------------------------------------------------------------------------------------- the run
@pytest.mark.parametrize("check", MINE)
def test_cpu_mode_passes_every_row(cpu_run: CpuRun, check: str) -> None:
    rows = cpu_run.rows(check)
    assert rows, f"no rows of {check}\n{cpu_run.explain()}"
    failed = [f"{r['what']}: {r['value']} (bound {r['bound']})" for r in rows if not r["passed"]]
    assert not failed, f"{failed}\n{cpu_run.explain()}"


def test_rows_assert_what_the_issue_asks(cpu_run: CpuRun) -> None:
    """Not "it ran": the rows that hold each check to its promise are there."""
    whats = {c: " / ".join(r["what"] for r in cpu_run.rows(c)) for c in MINE}
    for model in ("dense", "moe"):
        assert f"{model} float32 micro-batches: mean |Δ log p| vs transformers" in whats["1 logprobs"]
        assert f"{model} float32 packed: max |Δ log p| vs transformers" in whats["1 logprobs"]
        assert f"{model} float32: HF → Megatron → HF on cpu" in whats["5 roundtrip"]
        assert f"{model}: after an in-place update of every weight" in whats["3 export"]
    assert "loss, rel |Δ| vs the host fp32 step" in whats["2 train_step"]
    assert "grad norm, rel |Δ| vs the host fp32 step" in whats["2 train_step"]
    assert "20 steps: finite loss and grad norm" in whats["2 train_step"]
    assert "steps 11-20 repeat" in whats["2 train_step"]
    assert "collectives under gloo" in whats["3 export"]
    steps = next(r for r in cpu_run.rows("2 train_step") if r["what"].startswith("20 steps"))["figures"]
    assert len(steps["loss"]) == 20 and len(set(steps["grad_norm"])) > 1  # the policy moved


def test_table_and_json_carry_every_figure(cpu_run: CpuRun) -> None:
    report = cpu_run.report
    env = report["environment"]
    for key in (
        "mode",
        "device",
        "driver",
        "python",
        "torch",
        "cuda",
        "megatron_core",
        "transformers",
        "date",
    ):
        assert key in env, key
    assert env["mode"] == "cpu" and env["unimportable"] == list(ABSENT)
    assert [c["module"] for c in report["checks"]] == [m for _, m in CHECKS]
    all_rows = [r for c in report["checks"] for r in c["rows"]]
    for c in report["checks"]:
        assert c["wall_s"] > 0 and c["passed"] == all(r["passed"] for r in c["rows"])
    for r in all_rows:
        assert set(r) == {"check", "what", "value", "bound", "passed", "figures"}
    assert report["passed"] == all(r["passed"] for r in all_rows)
    assert cpu_run.returncode == (0 if report["passed"] else 1), cpu_run.explain()
    md = (cpu_run.out / "device_check.md").read_text()
    assert md.startswith("Device check (cpu mode): CPU (")
    assert "| check | what | value | bound | ok |" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| check |")]
    assert len(table) == len(all_rows)
    assert "\\|Δ log p\\|" in md  # pipes inside cells are escaped
    printed = cpu_run.stdout.splitlines()
    assert any(re.match(r"check +what +value +bound +ok$", line) for line in printed)
    for c in report["checks"]:  # wall time per check on stderr
        assert re.search(
            rf"\] {c['number']} {c['module']}: \d+\.\d s, \d+ passed, \d+ failed", cpu_run.stderr
        )


# ------------------------------------------------------------------------------- imports, runner, scripts
BLOCKER = """
import importlib, importlib.abc, sys
BLOCKED = {blocked!r}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            # what an absent package raises (megatron catches ModuleNotFoundError, not any ImportError)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Absent())
for name in BLOCKED:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"the blocker let {{name}} through")
for module in {modules!r}:
    importlib.import_module(module)
late = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("imported", len(sys.modules), "modules; blocked ones:", late)
raise SystemExit(1 if late else 0)
"""


def test_package_imports_without_ray_vllm_transformer_engine_math_verify() -> None:
    """Every check module, and what their spawned workers import, loads where those packages are absent."""
    here = ROOT / "tools" / "device_check"
    modules = ["tools.device_check", "tools.device_check.__main__"]
    modules += [f"tools.device_check.{m}" for _, m in CHECKS if (here / f"{m}.py").is_file()]
    modules += [
        "megatron.core.models.gpt",
        "megatron.core.optimizer",
        "megatron.core.dist_checkpointing",
        "mars_megatron.jobs",
        "mars_megatron.rl.worker",
        "mars_megatron.training.weight_sync",
        "mars_megatron.checkpoint.rank_state",
        "mars_megatron.convert",
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
    ]
    code = BLOCKER.format(blocked=sorted(ABSENT), modules=modules)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARS_DEVICE_CHECK")}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "blocked ones: []" in proc.stdout


def test_spawned_processes_of_a_run_cannot_import_what_the_gpu_machine_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runner's block reaches the processes checks spawn (they import the package, which blocks)."""
    from tools.device_check.common import ABSENT_ENV, spawn

    monkeypatch.setenv(ABSENT_ENV, "ray")
    assert spawn(exec, "import json", timeout_s=120) is None
    with pytest.raises(RuntimeError, match=r"ModuleNotFoundError: import of ray halted"):
        spawn(exec, "import ray", timeout_s=120)


def _ctx(tmp_path: Path) -> Context:
    return Context(True, torch.device("cpu"), torch.float32, tmp_path, lambda _: None)


def test_runner_turns_a_missing_check_an_exception_and_no_rows_into_failed_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (row,) = run_check("9", "not_written_yet", _ctx(tmp_path))
    assert not row.passed and row.value == "not implemented" and row.check == "9 not_written_yet"

    boom = types.ModuleType("tools.device_check._boom")

    def explode(ctx: Context) -> list:
        raise ValueError("kernel went sideways")

    boom.run = explode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tools.device_check._boom", boom)
    (row,) = run_check("9", "_boom", _ctx(tmp_path))
    assert not row.passed and row.value == "ValueError: kernel went sideways"
    assert "raise ValueError" in row.figures["traceback"]

    boom.run = lambda ctx: []  # type: ignore[attr-defined]
    (row,) = run_check("9", "_boom", _ctx(tmp_path))
    assert not row.passed and row.what == "rows reported"


def test_only_names_the_valid_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert [m for _, m in parse(["--only", "export,logprobs"]).checks] == ["logprobs", "export"]
    with pytest.raises(SystemExit) as exc:
        parse(["--only", "logprobs,nope"])
    assert exc.value.code == 2
    assert "unknown check(s) nope; choose from logprobs, train_step, export" in capsys.readouterr().err


def test_device_mode_without_wheels_says_how_to_get_them(tmp_path: Path) -> None:
    env = {**os.environ, "MARS_WHEEL_DIR": str(tmp_path / "none")}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Run scripts/device_wheels.sh" in proc.stderr and "carry" in proc.stderr


def test_a_machine_without_a_needed_module_is_refused_naming_it(tmp_path: Path) -> None:
    """psutil hidden (a sitecustomize that blocks it): megatron's checkpoint writer would die in its forked
    process and the save wait forever, so the runner refuses to start and names it."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['psutil'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.device_check", "--cpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 2 and "cannot run without psutil" in proc.stderr, proc.stderr[-2000:]
    assert missing_modules(("json", "no_such_module_here", "no_such.child")) == [
        "no_such_module_here",
        "no_such.child",
    ]


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out[canonicalize_name(name.split("[")[0])] = ver
    return out


def test_device_wheels_are_pinned_as_in_the_cpu_environment() -> None:
    device = _pins(ROOT / "requirements" / "device.txt")
    cpu = _pins(ROOT / "requirements" / "cpu.txt")
    assert "megatron-core" in device
    assert {n: cpu.get(n) for n in device} == device


def test_device_wheels_leaves_a_folder_with_other_files_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    cmd = [str(ROOT / "scripts" / "device_wheels.sh"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "holds files other than wheels" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.network
def test_the_wheel_set_resolves_for_cp312_manylinux(tmp_path: Path) -> None:
    """scripts/device_wheels.sh itself, into a temporary folder: one wheel per pin of device.txt, each
    installable by CPython 3.12 on manylinux x86_64, within the 20 MB budget."""
    dest = tmp_path / "whl"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "device_wheels.sh"), str(dest)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = sorted(dest.glob("*.whl"))
    pins = _pins(ROOT / "requirements" / "device.txt")
    got = {}
    for w in wheels:
        name, ver, _, tags = parse_wheel_filename(w.name)
        got[name] = str(ver)
        assert any(
            t.interpreter in ("cp312", "py3")
            and t.abi in ("cp312", "abi3", "none")
            and (t.platform == "any" or re.fullmatch(r"manylinux(2014|_2_\d+)_x86_64", t.platform))
            for t in tags
        ), w.name
    assert got == pins
    total = sum(w.stat().st_size for w in wheels)
    assert total <= 20_000_000
    assert f"{total:10d}  total" in proc.stdout


# ------------------------------------------------------------------- the assertions can fail (no spawns)
def _scorings(n: int, shift: float = 0.0, at: int | None = None) -> dict[str, list[list[float]]]:
    base = [[-math.log(7) + 0.01 * i for i in range(n)]]
    moved = [[x + (shift if at is None or i == at else 0.0) for i, x in enumerate(base[0])]]
    return {"megatron": moved, "megatron_packed": base, "transformers": base, "fp32": base}


def test_logprob_rows_fail_past_their_bounds() -> None:
    bounds = logprobs.GPU_BOUNDS["dense"]
    assert all(r.passed for r in logprobs.compare("dense", "bfloat16", _scorings(100, 1e-3), bounds))
    rows = logprobs.compare("dense", "bfloat16", _scorings(100, 0.3, at=5), bounds)  # one token off
    assert [r.passed for r in rows] == [True, False, True, True, False]  # mean ok; max and truth not


def _metrics(loss: float, grad: float, ok: float = 1.0) -> dict[str, float]:
    return {
        "train/loss": loss,
        "train/grad_norm": grad,
        "train/tokens": 90.0,
        "train/update_ok": ok,
        "seconds": 0,
    }


def test_train_step_rows_fail_on_drift_nan_and_a_changed_resume(tmp_path: Path) -> None:
    steps = [_metrics(-0.4 + 0.01 * i, 3.0 + 0.1 * i) for i in range(train_step.STEPS)]
    resumed = [dict(s) for s in steps[train_step.SAVE_AFTER :]]
    ctx = _ctx(tmp_path)
    setup = train_step.GPU
    assert all(r.passed for r in train_step.rows(ctx, setup, steps, steps[0], resumed))
    drifted = _metrics(-0.4 * 1.05, 3.0)
    assert [r.passed for r in train_step.rows(ctx, setup, steps, drifted, resumed)][:3] == [True, False, True]
    nan = [*steps[:3], _metrics(float("nan"), 3.0), *steps[4:]]
    assert not train_step.rows(ctx, setup, nan, steps[0], resumed)[3].passed
    resumed[-1]["train/grad_norm"] = math.nextafter(resumed[-1]["train/grad_norm"], math.inf)  # one ulp
    last = train_step.rows(ctx, setup, steps, steps[0], resumed)[-1]
    assert not last.passed and last.figures["max_abs_grad_norm"] > 0


def test_roundtrip_compare_sees_one_flipped_bit(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(4, 4, dtype=torch.bfloat16), "b": torch.randn(3)}
    for name in ("src", "same", "flipped"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"x": 1}')
    save_file(tensors, tmp_path / "src" / "model.safetensors")
    save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / "same" / "model.safetensors")
    flipped = tensors["a"].clone()
    flipped.view(torch.int16)[0, 0] ^= 1
    save_file({"a": flipped, "b": tensors["b"]}, tmp_path / "flipped" / "model.safetensors")
    same = roundtrip.compare(tmp_path / "src", tmp_path / "same")
    assert same["identical"] == same["tensors"] == 2 and same["config_equal"]
    assert roundtrip.compare(tmp_path / "src", tmp_path / "flipped")["differ"] == ["a"]


def test_export_compare_needs_every_tensor_equal_and_on_the_collectives_device() -> None:
    expected = {"x": torch.ones(2, 3), "y": torch.zeros(4)}
    cpu = torch.device("cpu")
    good = export_check._compare([("x", torch.ones(2, 3)), ("y", torch.zeros(4))], expected, cpu)
    assert good["equal"] == good["expected"] == 2 and good["same_names"] and not good["off_device"]
    off = export_check._compare(
        [("x", torch.ones(2, 3)), ("y", torch.zeros(4))], expected, torch.device("meta")
    )
    assert len(off["off_device"]) == 2
    changed = export_check._compare([("x", torch.ones(2, 3) + 1), ("y", torch.zeros(4))], expected, cpu)
    assert changed["unequal"] == ["x"]
    missing = export_check._compare([("x", torch.ones(2, 3))], expected, cpu)
    assert not missing["same_names"]
