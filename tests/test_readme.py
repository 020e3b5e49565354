"""Every command in README.md runs as written.

The commands are the lines of README.md's ```bash blocks (a trailing backslash joins a line to the next;
comment lines are skipped; bash itself ignores a trailing comment). Each one is either run here, in order,
in a scratch directory that holds ``examples/`` like the repository root, and must exit 0, or it is listed
in ``NOT_RUN`` with the reason it is too expensive or needs what this machine lacks. A command that is
neither fails the test, so the README cannot gain an example nobody has run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Cheap commands, run as written (prefixes of the README's command lines).
RUN = (
    "mars --help",
    "mars init-model --preset tiny-moe",
    "mars convert hf-to-mcore",
    "mars convert mcore-to-hf",
    "echo ",
    "mars plan",
    "mars launch ",  # only --dry-run examples: the script is rendered, nothing is submitted
    "mars config",
    "python examples/byot/make_data.py",  # the sums as Parquet (a second)
)

# Commands not run here, each with the reason and where it is tested instead.
NOT_RUN = {
    "scripts/demo.sh": "the whole tiny MarsRL run: 7-12 min on 2 cores (tools/bench/tiny_run.py measures it)",
    "scripts/test.sh": "the whole test suite, this test included",
    "TASK=byot scripts/demo.sh": "the tiny run as a user's task, minutes (its parts: tests/test_rl_loop.py)",
    "scripts/device_wheels.sh": "downloads from PyPI (tests/test_device_check.py, network phase)",
    "scripts/device_check.sh": "needs the GPU machine; its --cpu mode runs in tests/test_device_check.py",
    "mars score": "two gloo ranks, ~10-35 s here (tests/test_cli.py)",
    "mars sft": "350 SFT steps, about 3.5 min on 2 cores (tests/test_sft.py)",
    "mars train": "Ray trainer ranks and engines for 60 steps: minutes (tests/test_rl_loop.py)",
    "mars plot": "needs the run of `mars train` (tests/test_metrics.py)",
    "mars eval": "needs the checkpoint of `mars train` (tests/test_eval.py)",
}

_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks of a markdown text, continuation lines joined."""
    commands: list[str] = []
    for block in _BLOCK.findall(text):
        logical = re.sub(r"\\\n\s*", "", block)  # a trailing backslash continues the command
        commands += [
            line.strip()
            for line in logical.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
    return commands


def classify(command: str) -> str:
    """``run``, ``not run`` or ``unlisted`` for one README command."""
    if command.startswith(RUN):
        return "run"
    if command.startswith(tuple(NOT_RUN)):
        return "not run"
    return "unlisted"


COMMANDS = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))


def test_every_command_is_run_or_listed_with_a_reason() -> None:
    unlisted = [c for c in COMMANDS if classify(c) == "unlisted"]
    assert not unlisted, (
        f"README.md commands neither run by tests/test_readme.py nor listed in its NOT_RUN: {unlisted}"
    )
    used = [p for p in (*RUN, *NOT_RUN) if not any(c.startswith(p) for c in COMMANDS)]
    assert not used, f"RUN/NOT_RUN entries that match no README command (remove them): {used}"
    assert sum(classify(c) == "run" for c in COMMANDS) >= 6


def test_the_command_lists_can_fail() -> None:
    text = "```bash\nmars config --describe   # ok\nrm -rf / \\\n  --no-preserve-root\n# a comment\n```\n"
    assert readme_commands(text) == ["mars config --describe   # ok", "rm -rf / --no-preserve-root"]
    assert [classify(c) for c in readme_commands(text)] == ["run", "unlisted"]


def test_the_readme_commands_run_as_written(tmp_path: Path) -> None:
    """The cheap commands, in README order, in one scratch directory (later ones use earlier outputs)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bin_dir = str(Path(sys.executable).parent)  # the environment's bin: where `mars` is
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
    ran = []
    for command in COMMANDS:
        if classify(command) != "run":
            continue
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (
            f"README command failed (exit {done.returncode}): {command}\n{done.stderr[-3000:]}"
        )
        ran.append(command)
    assert (tmp_path / "ckpt" / "tiny-moe" / "config.json").exists()
    assert (tmp_path / "ckpt" / "tiny-moe-mcore").is_dir()
    assert (tmp_path / "ckpt" / "tiny-moe-hf" / "model.safetensors.index.json").is_file()
    assert any(c.startswith("mars plan") for c in ran)
    assert (tmp_path / "data" / "sums" / "train.parquet").is_file()


@pytest.mark.parametrize("prefix", sorted(NOT_RUN))
def test_not_run_reasons_are_given(prefix: str) -> None:
    assert len(NOT_RUN[prefix]) > 10
