"""The benchmarks' command lines, run as a user runs them (a subprocess, no arguments or a bad one).

A benchmark run with no arguments either runs its default measurement (every input built by itself) or
prints its usage and exits 2; it never exits 0 having done nothing, which is what ``pipeline.py`` used to
do. A flag naming a missing input fails at once with the flag's name, not with a traceback minutes into
a run. The measurements themselves take minutes and are not run here: only ``--help`` and the argument
checks, which come before any work.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench"

# Benchmarks that run their default measurement with no arguments, and options their --help must list.
RUNS_BY_DEFAULT = {
    "convert.py": ["--preset", "--layers", "--repeats", "--workdir", "--floor"],
    "packing.py": ["--seed", "--seeds", "--repeats"],
    "rewards.py": ["--checks", "--repeats"],
    "routing_replay.py": ["--out", "--steps", "--window", "--modes", "--plot"],
    "train_step.py": ["--model", "--shapes", "--nproc", "--repeats", "--quick"],
    "weight_sync.py": ["--layers", "--engines", "--bucket-mb", "--repeats"],
    "tiny_run.py": ["--out", "--steps"],
    "control_plane.py": ["--scales", "--ranks", "--steps", "--problems"],
    "chaos.py": ["--out", "--model", "--steps", "--faults", "--seed", "--kinds"],
    "paper_table.py": ["--task", "--out", "--resume", "--sft", "--seeds", "--warm-start-per-seed", "--jobs"],
}
# Benchmarks whose modes are a choice: no arguments prints the usage and exits 2.
ASKS_FOR_A_MODE = {"pipeline.py": ["--real", "--sim", "--sft", "--out", "--train-s-per-token"]}
NOT_BENCHMARKS = {"common.py"}  # the library the tiny-task benchmarks share


def run(script: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused(result: subprocess.CompletedProcess[str], flag: str) -> None:
    """An argparse refusal: exit 2, the usage and an error naming ``flag`` on stderr, no traceback."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "usage:" in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert errors and flag in errors[-1], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_every_script_is_classified() -> None:
    scripts = {p.name for p in BENCH.glob("*.py")}
    known = set(RUNS_BY_DEFAULT) | set(ASKS_FOR_A_MODE)
    assert scripts - NOT_BENCHMARKS <= known, f"unclassified benchmarks: {sorted(scripts - known)}"
    assert known <= scripts, f"benchmarks gone: {sorted(known - scripts)}"


@pytest.mark.parametrize("script", sorted(set(RUNS_BY_DEFAULT) | set(ASKS_FOR_A_MODE)))
def test_docstring_says_what_no_arguments_does(script: str) -> None:
    doc = ast.get_docstring(ast.parse((BENCH / script).read_text())) or ""
    text = " ".join(doc.split())
    assert "With no arguments it" in text, f"{script}: the docstring does not say what a bare run does"
    if script in ASKS_FOR_A_MODE:
        assert "exits 2" in text, script
    else:
        assert "prints" in text.split("With no arguments it", 1)[1], script


@pytest.mark.parametrize("script", sorted(ASKS_FOR_A_MODE))
def test_no_arguments_prints_usage_and_exits_2(script: str) -> None:
    result = run(script)
    refused(result, "choose a mode")
    assert result.stdout == "", result.stdout
    for option in ASKS_FOR_A_MODE[script]:
        assert option in result.stderr, (option, result.stderr)


@pytest.mark.parametrize("script", sorted(RUNS_BY_DEFAULT | ASKS_FOR_A_MODE))
def test_help_lists_the_options(script: str) -> None:
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {script}"), result.stdout
    for option in {**RUNS_BY_DEFAULT, **ASKS_FOR_A_MODE}[script]:
        assert option in result.stdout, (option, result.stdout)


def test_convert_names_a_missing_workdir(tmp_path: Path) -> None:
    refused(run("convert.py", "--workdir", tmp_path / "missing"), "--workdir")


def test_routing_replay_checks_its_paths_before_the_warm_start(tmp_path: Path) -> None:
    out = tmp_path / "run"
    refused(run("routing_replay.py", "--out", out, "--plot", tmp_path / "missing" / "x.png"), "--plot")
    assert not out.exists()  # refused before the warm start made anything
    out.mkdir()
    refused(run("routing_replay.py", "--out", out), "--out")
    assert list(out.iterdir()) == []


def test_paper_table_names_a_missing_sft(tmp_path: Path) -> None:
    out = tmp_path / "run"
    refused(run("paper_table.py", "--sft", tmp_path / "missing", "--out", out), "--sft")
    assert not out.exists()


def test_paper_table_finishes_an_out_only_with_the_same_options(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    refused(run("paper_table.py", "--out", out), "--out")  # a folder that exists is never mixed into
    (out / "bench_args.json").write_text('{"seeds": 5}\n')
    refused(run("paper_table.py", "--out", out, "--resume"), "--resume")
    assert [p.name for p in out.iterdir()] == ["bench_args.json"]  # nothing ran


def test_pipeline_names_a_missing_or_wrong_sft(tmp_path: Path) -> None:
    out = tmp_path / "run"
    refused(run("pipeline.py", "--real", "--sft", tmp_path / "missing", "--out", out), "--sft")
    refused(run("pipeline.py", "--sim", "--train-s-per-token", "1e-4", "--sft", tmp_path), "--sft")
    assert not out.exists()


def test_pipeline_sim_alone_needs_the_trainer_cost() -> None:
    refused(run("pipeline.py", "--sim"), "--train-s-per-token")


def test_pipeline_refuses_an_existing_out(tmp_path: Path) -> None:
    refused(run("pipeline.py", "--real", "--out", tmp_path), "--out")


def test_chaos_checks_its_arguments_before_any_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    refused(run("chaos.py", "--faults", "8", "--steps", "8", "--out", out), "--faults")
    refused(run("chaos.py", "--model", tmp_path / "missing", "--out", out), "--model")
    out.mkdir()
    refused(run("chaos.py", "--out", out), "--out")
    assert list(out.iterdir()) == []
