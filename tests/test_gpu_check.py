"""scripts/gpu_check.sh on a machine without a GPU (it refuses at once, naming why, and writes nothing),
and the pieces of its table: test outcomes read back from a real pytest run, nvidia-smi's lines, the
table itself. What it reads of a real tiny run is tested in tests/test_rl_loop.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_refuses_at_once_and_writes_nothing(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal on a machine without CUDA is what is tested here")
    out = tmp_path / "check"
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert (
        "gpu_check: no CUDA GPU is visible to torch" in done.stderr and "scripts/setup_gpu.sh" in done.stderr
    )
    assert not out.exists()


def test_outcomes_of_a_real_pytest_run(tmp_path: Path) -> None:
    gpu_check = load_gpu_check()
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert 1\n"
        "def test_bad():\n    assert 0\n"
        "def test_later():\n    pytest.skip('needs 2 GPUs, this node has 1')\n"
    )
    junit = tmp_path / "out.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "test_three.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    results = gpu_check.read_junit(junit)
    assert results.passed == ["test_three::test_ok"] and results.failed == ["test_three::test_bad"]
    assert results.skipped == [("test_three::test_later", "needs 2 GPUs, this node has 1")]

    run = {"steps": 10, "steps_wanted": 10, "updated": 10, "first_step_s": 31.0, "step_s": 2.5,
           "mismatch_abs_mean": 3e-3, "mismatch_kl": 2e-5}  # fmt: skip
    text = gpu_check.table(
        {"gpu tests": results, "gpu tests (vLLM)": "not run"}, run, {0: 20480.0}, {0: 81920.0}
    )
    assert "| gpu tests | 1 passed, 1 failed, 1 skipped |" in text
    assert "| &nbsp;&nbsp;FAILED | `test_three::test_bad` |" in text
    assert "| step time | 2.50 s median after step 1 (step 1: 31.0 s) |" in text
    assert "| peak memory GPU 0 | 20.0 of 80.0 GiB |" in text
    assert "mean abs diff 3.00e-03, k3 KL 2.00e-05" in text
    assert not gpu_check.ok({"gpu tests": results}, run)  # a test failed
    results.failed.clear()
    assert gpu_check.ok({"gpu tests": results}, run)
    assert not gpu_check.ok({"gpu tests": results}, {**run, "updated": 9})
    assert not gpu_check.ok({"gpu tests": results}, "FAILED: `mars train` exited 1")


def test_nvidia_smi_lines_and_peaks() -> None:
    gpu_check = load_gpu_check()
    samples = gpu_check.parse_smi("0, 1200\n1, 300\n[N/A], x\n\n0, 5000\n1, 250\n")
    assert samples == [(0, 1200.0), (1, 300.0), (0, 5000.0), (1, 250.0)]
    assert gpu_check.peak_memory(samples) == {0: 5000.0, 1: 300.0}
