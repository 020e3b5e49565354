"""What a run asks for (agents/graph_size.py), the machine's worker bound, and the fixes of issue 34's
sizes part that are not bad-input cases: the shipped examples and graphs stay within every cap, the
figures are the scheduler's, and no command prints Megatron's "Could not import flask"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mars_megatron.agents.graph import LoopBudgets
from mars_megatron.agents.graph_file import graph_for, load_graph, shipped_graphs
from mars_megatron.agents.graph_size import (
    MAX_SAMPLES_PER_PROBLEM,
    loop_calls_per_problem,
    run_size,
    samples_per_problem,
)
from mars_megatron.config import ConfigError, load_config
from mars_megatron.pipeline.trainer import WORKERS_PER_CORE, check_workers_fit

REPO = Path(__file__).resolve().parents[1]
RUN_EXAMPLES = [
    "tiny_cpu",
    "subset_cpu",
    "imo_refine_cpu",
    "tool_pair_cpu",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
]


@pytest.mark.parametrize("name", RUN_EXAMPLES)
def test_every_run_example_is_within_the_caps(name: str) -> None:
    cfg = load_config(REPO / "examples" / f"{name}.yaml", [])
    graph_for(cfg)  # raises above a cap


def test_marsrl_figures_are_the_schedulers() -> None:
    """marsrl at G = 8, 2 inputs: solver 8, then four positions of 2 inputs x 8 = 72 per problem; the
    235B example's 128 problems ask for 9,216 samples a step; the loop makes 1 + 3 + 2 x 10 calls."""
    graph = load_graph("marsrl")
    assert samples_per_problem(graph, 8, 2, None) == 8 + 4 * 16
    assert samples_per_problem(graph, 8, 2, 3) == 8 + 2 * 16
    assert samples_per_problem(graph, 1, 2, None) == 1 + 4 * 1  # fewer outputs than inputs_per_agent
    size = run_size(graph, group_size=8, inputs_per_agent=2, max_steps=None, problems_per_step=128,
                    budgets=LoopBudgets.of(graph))  # fmt: skip
    assert (size.samples_per_step, size.loop_calls_per_problem, size.fan_out) == (9216, 24, 9)
    tools = load_graph("tool_pair")
    assert loop_calls_per_problem(tools, LoopBudgets.of(tools)) == (1 + 3 + 2 * 10) * 3


def test_every_shipped_graph_is_far_below_the_cap() -> None:
    for name in shipped_graphs():
        assert samples_per_problem(load_graph(name), 8, 2, None) * 64 < MAX_SAMPLES_PER_PROBLEM, name


def test_workers_over_the_cores_of_one_machine_are_refused_with_the_figure() -> None:
    cfg = load_config(None, ["pipeline.rollout_workers=3", "pipeline.reward_workers=2"])
    check_workers_fit(cfg, 2, 2)  # 8 = 4 per core on 2 cores
    with pytest.raises(ConfigError, match=r"pipeline.rollout_workers: .*= 8 worker processes .* 1 CPU cores"):
        check_workers_fit(cfg, 2, 1)
    assert WORKERS_PER_CORE == 4


@pytest.mark.parametrize("args", [["--help"], ["config"]])
def test_commands_do_not_print_could_not_import_flask(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "mars_megatron.cli", *args], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "flask" not in (run.stdout + run.stderr).lower()


def test_a_cpu_rank_does_not_print_could_not_import_flask() -> None:
    """Every CPU rank (mars score, convert --via-model, train's trainer ranks) runs cpu_compat.install(),
    which imported Megatron's Flask text server and printed the warning; a real import error would still
    show (the eager import skips failures silently, as before, only for modules never used)."""
    code = "from mars_megatron.training import cpu_compat; cpu_compat.install()"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "flask" not in run.stderr.lower()
