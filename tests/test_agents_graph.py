"""Agent graphs as data (agents/graph.py): the shipped graphs load, render their prompts, and every graph
that cannot run is refused before anything starts, the error naming the field."""

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from mars_megatron.agents.graph import SHIPPED, GraphError, LoopBudgets
from mars_megatron.agents.graph_file import graph_for, load_graph, shipped_graphs
from mars_megatron.config import EvalConfig, MarsConfig


def test_marsrl_graph_is_the_default_and_declares_the_vc_system() -> None:
    graph = graph_for(MarsConfig())
    assert graph.name == "marsrl" and "marsrl" in shipped_graphs()
    assert list(graph.roles) == ["solver", "verifier", "corrector"]
    assert [(p.name, p.role, p.input, p.when) for p in graph.positions] == [
        ("solver", "solver", None, "any"),
        ("verifier_1", "verifier", "solver", "any"),
        ("corrector_1", "corrector", "verifier_1", "rejected"),
        ("verifier_2", "verifier", "corrector_1", "any"),
        ("corrector_2", "corrector", "verifier_2", "rejected"),
    ]
    assert [(r.output, r.reward, r.verdict) for r in graph.roles.values()] == [
        ("solution", "answer", None),
        ("report", "verdict", "correctness"),
        ("solution", "answer", None),
    ]
    assert graph.prompt_sets == ("marsrl", "compact")
    assert graph.policy_names("shared") == ["shared"] and graph.policy_names("per_role") == list(graph.roles)
    assert LoopBudgets.of(graph) == LoopBudgets(3, 10, 4, 10)
    assert LoopBudgets.of(graph, EvalConfig(accept_after=2, max_iterations=7)) == LoopBudgets(3, 7, 2, 10)
    assert [p.name for p in graph.trajectory(3)] == ["solver", "verifier_1", "corrector_1"]


def test_compact_prompts_render_the_tiny_runs_texts() -> None:
    """The texts the tiny run was trained with, pinned: a change shows here before it changes a run."""
    graph = load_graph("marsrl")
    v = {"problem": " 3+4 ", "solution": "\\boxed{8}", "bug_report": "3+4=7."}
    v["problem"] = v["problem"].strip()
    assert graph.roles["solver"].messages("compact", v) == [
        {"role": "user", "content": "3+4\n\nAnswer in \\boxed{}."}
    ]
    assert graph.roles["verifier"].messages("compact", v) == [
        {"role": "user", "content": "3+4\nSolution: \\boxed{8}\nEnd with Correctness: Correct or Wrong."}
    ]
    assert graph.roles["corrector"].messages("compact", v) == [
        {"role": "user", "content": "3+4\n\nAnswer in \\boxed{}."},
        {"role": "assistant", "content": "\\boxed{8}"},
        {"role": "user", "content": "Findings: 3+4=7.\nCorrect the solution. Answer in \\boxed{}."},
    ]
    full = graph.roles["verifier"].messages("marsrl", v)
    assert [m["role"] for m in full] == ["system", "user"]
    assert full[0]["content"].rstrip().endswith("its final answer is right.")
    assert full[1]["content"] == "## Problem\n\n3+4\n\n## Solution\n\n\\boxed{8}\n"


# ------------------------------------------------------------------------------------------ validation
def _copy(tmp_path: Path, name: str = "marsrl") -> tuple[Path, dict[str, Any]]:
    folder = tmp_path / name
    shutil.copytree(SHIPPED / name, folder)
    path = folder / "graph.yaml"
    return path, yaml.safe_load(path.read_text())


def _write(path: Path, data: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _rejects(path: Path, data: dict[str, Any], field: str, match: str, **kwargs: Any) -> None:
    with pytest.raises(GraphError, match=match) as error:
        load_graph(_write(path, data), **kwargs)
    assert error.value.field == field, str(error.value)
    assert str(path) in str(error.value) or field.startswith("agents.")


def test_a_copy_of_a_shipped_graph_loads_from_its_path(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    assert load_graph(_write(path, data)).roles.keys() == load_graph("marsrl").roles.keys()
    assert load_graph(str(path.parent)).name == "marsrl"  # a folder finds its graph.yaml


def test_unknown_role_is_named(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    data["trajectory"][1]["role"] = "critic"
    _rejects(path, data, "trajectory[1].role", "unknown role 'critic'")
    path, data = _copy(tmp_path / "b")
    data["loop"]["steps"]["correct"]["role"] = "critic"
    _rejects(path, data, "loop.steps.correct.role", "unknown role 'critic'")
    path, data = _copy(tmp_path / "c")
    data["policies"] = {"shared": ["solver", "verifier", "critic"]}
    _rejects(path, data, "policies.shared", "unknown role 'critic'")


def test_a_role_without_a_reward_is_named(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    del data["roles"]["verifier"]["reward"]
    _rejects(path, data, "roles.verifier.reward", "every role needs a reward")


def test_a_reward_the_output_cannot_earn_is_named(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    data["roles"]["verifier"]["reward"] = "answer"
    _rejects(path, data, "roles.verifier.reward", "answer reward needs output: solution")
    path, data = _copy(tmp_path / "b")
    data["roles"]["solver"]["reward"] = "outcome"  # the verifier follows it, but takes only 2 solutions
    _rejects(path, data, "trajectory[1].inputs", "every one of its outputs must be followed")
    data["trajectory"][1]["inputs"] = "all"  # all are taken: no selection by a reward not known yet
    assert load_graph(_write(path, data)).position("verifier_1").inputs == "all"
    data["trajectory"] = data["trajectory"][:1]
    _rejects(path, data, "roles.solver.reward", "outcome reward needs a position that takes")


def test_a_trajectory_cycle_is_named(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    data["trajectory"][1]["input"] = "corrector_1"
    _rejects(path, data, "trajectory[1].input", "a cycle")
    data["trajectory"][1]["input"] = "verifier_1"
    _rejects(path, data, "trajectory[1].input", "a cycle")


def test_a_loop_cycle_without_a_stop_rule_is_named(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    data["loop"]["steps"]["correct"]["next"] = "solve"  # solve -> verify, but correct <-> solve never stops
    data["loop"]["steps"]["solve"]["next"] = "correct"
    _rejects(path, data, "loop.steps.solve.next", "passes no step that reads a verdict")


def test_a_position_beyond_the_trajectory_cap_is_named(tmp_path: Path) -> None:
    _rejects(*_copy(tmp_path), "agents.max_steps", "beyond the 5 positions", max_steps=6)
    with pytest.raises(GraphError, match=r"agents\.max_steps: is 9"):
        graph_for(MarsConfig(agents={"max_steps": 9}))  # type: ignore[arg-type]


def test_a_cut_that_drops_what_a_kept_position_needs_is_named() -> None:
    """agents.max_steps may not cut the position that makes a kept one's outcome reward, nor the digests
    of a kept one's tool calls."""
    with pytest.raises(GraphError, match=r"cuts position 'judge_1', what follows 'verifier_1'") as error:
        load_graph("imo_refine", max_steps=2)
    assert error.value.field == "agents.max_steps" and "keep at least 3 positions" in str(error.value)
    with pytest.raises(GraphError, match=r"cuts position 'distiller', the digests of 'reasoner'"):
        load_graph("tool_pair", max_steps=1)
    assert [p.name for p in load_graph("imo_refine", max_steps=3).trajectory(3)][-1] == "judge_1"
    assert load_graph("marsrl", max_steps=1)  # a solver alone needs nothing after it


def test_prompt_variables_are_checked(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    data["roles"]["verifier"]["variables"] = ["problem"]
    _rejects(path, data, "roles.verifier.messages[1]", r"uses \{solution\}, which the role does not declare")
    path, data = _copy(tmp_path / "b")
    data["roles"]["verifier"]["variables"] = ["problem", "solution", "bug_report"]
    _rejects(path, data, "trajectory[1].role", r"declares \{bug_report\}, which nothing before")
    path, data = _copy(tmp_path / "c")
    (path.parent / "prompts" / "compact" / "verifier.txt").write_text("{solution.__class__}\n")
    _rejects(path, data, "roles.verifier.messages[1]", "not a plain variable name")
    (path.parent / "prompts" / "compact" / "verifier.txt").write_text("{solution!r}\n")
    _rejects(path, data, "roles.verifier.messages[1]", "not a plain variable name")


def test_files_and_keys_are_checked(tmp_path: Path) -> None:
    path, data = _copy(tmp_path)
    (path.parent / "prompts" / "compact" / "corrector.txt").unlink()
    _rejects(path, data, "roles.corrector.messages[2]", "prompt file .* not found")
    path, data = _copy(tmp_path / "b")
    data["roles"]["solver"]["messages"] = [{"user": "../../secret.txt"}]
    _rejects(path, data, "roles.solver.messages[0]", "a file name in the prompt folder")
    data["roles"]["solver"]["messages"] = [{"user": "solver.txt"}]
    data["roles"]["solver"]["temperature"] = 2
    _rejects(path, data, "roles.solver.temperature", "unknown key")
    with pytest.raises(GraphError, match=r"agents\.graph: no shipped graph 'nope'"):
        load_graph("nope")
    with pytest.raises(GraphError, match=r"agents\.graph: file .* not found"):
        load_graph(str(tmp_path / "missing.yaml"))
    path.write_text("roles: [unclosed\n")
    with pytest.raises(GraphError, match="invalid YAML"):
        load_graph(str(path))


def test_config_keys_by_role_are_checked_against_the_graph() -> None:
    with pytest.raises(GraphError, match=r"pipeline\.staleness_per_role\.critic: graph 'marsrl' has no role"):
        graph_for(MarsConfig(pipeline={"staleness_per_role": {"critic": 0}}))  # type: ignore[arg-type]
    with pytest.raises(GraphError, match=r"algorithm\.role_weights\.critic"):
        graph_for(MarsConfig(algorithm={"role_weights": {"critic": 2.0}}))  # type: ignore[arg-type]
    with pytest.raises(GraphError, match=r"agents\.prompts: graph 'marsrl' has no prompt set 'tiny'"):
        graph_for(MarsConfig(agents={"prompts": "tiny"}))  # type: ignore[arg-type]
