"""The tiny run repeats (issue 31, docs/train.md "What repeats"): the same `mars sft` + `mars train`, run
once on an idle machine and once with both cores saturated by other processes and `os.cpu_count()`
claiming twice the cores, gives the same weights byte for byte, the same SFT losses, and the same value of
every metric of metrics.jsonl and eval.jsonl (tools/compare_runs.py).

The second run stands in for "another machine of this kind": load moves the timing of every process, and
the core count was what the thread counts followed (1 and 2 threads per rank give different weights).
The ISA pins cannot be varied the same way (a value the user sets wins), so the last tests show, in fresh
processes, that this host's default code paths differ from the pinned ones and that `mars` takes the
pinned ones: on an AVX2-only host ATen's default *is* the pinned AVX2 path. Elementwise ``exp`` is not
ATen's own kernel where torch has MKL: it calls MKL's VML, whose path follows ``MKL_CBWR`` (on an AVX-512
Xeon, VML's default and COMPATIBLE paths differ; on the host these tests were first written on they did
not), so it belongs to the MKL probe, not the ATen one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from mars_megatron import runtime_env
from mars_megatron.models.presets import init_model

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("compare_runs", REPO / "tools" / "compare_runs.py")
assert _SPEC is not None and _SPEC.loader is not None
compare_runs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(compare_runs)

# `mars sft` from a fresh model, long enough to print two loss lines and move every weight; the RL run starts
# from the session's shared warm start instead (`sft_model`: rewards neither all 0 nor all 1, every role
# gets inputs, so the updates are real). 2 RL steps with a held-out evaluation before and after (1 sample
# each of the 25 held-out sums).
SFT = ["steps=4", "skill_steps=3", "demos_per_step=32"]
TRAIN = [
    "train.steps=2",
    "logging.tensorboard=false",
    "evaluation.test_file=examples/data/arith_test.jsonl",
    "evaluation.interval=2",
    "evaluation.samples=1",
]
# The `mars` command as its script runs it (main() without argv: the numerics environment applied),
# with os.cpu_count() answering argv[1]: a host with another core count.
MARS = (
    "import os, sys; cores = int(sys.argv.pop(1)); os.cpu_count = lambda: cores; "
    "from mars_megatron.cli import main; sys.exit(main())"
)


def _clean_env() -> dict[str, str]:
    """This process's environment without the numerics variables: the runs start from the defaults."""
    return {k: v for k, v in os.environ.items() if k not in runtime_env.NUMERICS_ENV}


def _mars(args: list[str], cores: int, log: Path) -> str:
    cmd = [sys.executable, "-c", MARS, str(cores), *args]
    done = subprocess.run(cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=900)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"mars {args[0]} failed (log: {log}):\n{done.stderr[-3000:]}"
    return done.stdout


@contextmanager
def _busy_cores(n: int) -> Iterator[None]:
    """``n`` busy-loop processes at niceness 19 for the duration: every core saturated (see :func:`runs`)."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))
        for _ in range(n)
    ]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


@dataclass
class Run:
    sft: Path  # `mars sft`'s checkpoint
    train: Path  # the RL run's directory: metrics.jsonl, eval.jsonl
    losses: list[str]  # the SFT loss lines `mars sft` printed


def _run(root: Path, hf: Path, warm: Path, cores: int, load: int = 0) -> Run:
    """`mars sft` from ``hf``, and `mars train` from the warm start ``warm``; ``load``: busy loops beside
    them (see :func:`runs`)."""
    root.mkdir()
    with _busy_cores(load):
        sft_out = _mars(
            ["sft", "examples/tiny_sft.yaml", *SFT, "--model-dir", str(hf), "--out", str(root / "sft")],
            cores,
            root / "sft.log",
        )
    train = ["train", "examples/tiny_cpu.yaml", f"model.mcore_dir={warm}"]
    with _busy_cores(load):
        _mars([*train, f"logging.run_dir={root / 'train'}", *TRAIN], cores, root / "train.log")
    losses = re.findall(r"^sft step +\d+ +loss \S+", sft_out, flags=re.M)
    return Run(root / "sft", root / "train", losses)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, sft_model: Path) -> dict[str, Run]:
    """The same short run twice: idle on this host's cores, then loaded and 'on' a host with twice as many.

    The load is one busy loop per core at niceness 19: every core stays saturated (the loops take every
    moment the runs leave, so the timing of every process moves), while the runs keep their share. At equal
    priority the ranks' gloo collectives and Ray's calls waited a time slice at every hop (2 RL steps took
    512 s instead of 26 s, measured), and under pytest-xdist the loops took the other worker's core from the
    tests it was running."""
    root = tmp_path_factory.mktemp("repeat")
    hf = init_model("tiny-moe", root / "hf")
    cores = os.cpu_count() or 1
    idle = _run(root / "idle", hf, sft_model, cores)
    loaded = _run(root / "loaded", hf, sft_model, 2 * cores, load=cores)
    return {"idle": idle, "loaded": loaded}


def test_sft_repeats_loaded_and_on_more_cores(runs: dict[str, Run]) -> None:
    idle, loaded = runs["idle"], runs["loaded"]
    diffs, files = compare_runs.compare_weights(idle.sft, loaded.sft)
    assert files > 0 and diffs == [], diffs
    assert len(idle.losses) == 2 and idle.losses == loaded.losses  # steps 1 and 4


def test_train_repeats_every_metric(runs: dict[str, Run]) -> None:
    idle, loaded = runs["idle"].train, runs["loaded"].train
    diffs = []
    for name in ("metrics.jsonl", "eval.jsonl"):
        diffs += compare_runs.compare(idle / name, loaded / name)
    assert diffs == [], "\n".join(diffs[:50])
    rows = compare_runs._rows(idle / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # the comparison is not vacuous: the run learned something and evaluated twice
    assert any(r["train/loss"] != 0 for r in rows)
    assert len(compare_runs._rows(idle / "eval.jsonl")) == 2
    assert compare_runs.main([str(idle), str(loaded)]) == 0


# ---------------------------------------------------------------------------------------- the pins matter
PROBE = """
import contextlib, hashlib, io, json, sys
if sys.argv[1] == "mars":  # the `mars` command's process: main() as its script calls it, a command run
    from mars_megatron.cli import main
    sys.argv = ["mars", "config", "--describe"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main() == 0
import torch
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 257, generator=g)
w = torch.randn(257, 131, generator=g)
digest = lambda t: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]
print(json.dumps({
    "isa": torch.backends.cpu.get_cpu_capability(),
    "threads": torch.get_num_threads(),
    # ATen's own vectorised kernels: they follow ATEN_CPU_CAPABILITY and nothing else
    "aten": digest(torch.stack([torch.softmax(x, -1).sum(-1), x.norm(dim=-1)])),
    # MKL: BLAS (the GEMM) and VML (torch's float exp calls vsExp), both following MKL_CBWR
    "mkl": digest(torch.cat([(x @ w).flatten(), x.exp().mean(-1)])),
}))
"""


def _probe(mode: str, env: Mapping[str, str]) -> dict[str, object]:
    import json

    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**_clean_env(), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes() -> dict[str, dict[str, object]]:
    return {
        "host": _probe("torch", {}),  # this host's own choices
        "avx2_host": _probe("torch", {"ATEN_CPU_CAPABILITY": "avx2"}),  # ATen as on an AVX2-only host
        "compatible": _probe("torch", {"MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}),
        "mars": _probe("mars", {}),  # a process the `mars` command starts
    }


def test_mars_processes_take_the_pinned_paths(probes: dict[str, dict[str, object]]) -> None:
    mars = probes["mars"]
    assert mars["isa"] == "AVX2" and mars["threads"] == 1
    assert mars["aten"] == probes["avx2_host"]["aten"]
    assert mars["mkl"] == probes["compatible"]["mkl"]


def test_this_hosts_default_paths_give_other_figures(probes: dict[str, dict[str, object]]) -> None:
    """Why the pins exist: unpinned, an AVX-512 host sums differently from an AVX2 one, and MKL's own
    path (here, with this host's thread count) differs from the one every x86 CPU shares."""
    host = probes["host"]
    if host["isa"] != "AVX512":
        pytest.skip(f"this host's ATen default is {host['isa']}: nothing wider than the pin to compare")
    assert host["aten"] != probes["avx2_host"]["aten"]
    assert host["mkl"] != probes["compatible"]["mkl"]


def test_an_explicit_setting_wins() -> None:
    env = {"OMP_NUM_THREADS": "3", "MKL_CBWR": "AVX2"}
    applied = runtime_env.apply(env)
    assert applied["OMP_NUM_THREADS"] == "3" and applied["MKL_CBWR"] == "AVX2"
    assert env["MKL_DYNAMIC"] == "FALSE" and runtime_env.cpu_threads(env) == 3
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        runtime_env.apply({"OMP_NUM_THREADS": "all"})
