"""Graphs with tools: the shipped tool pair, the ``tool:`` key of a role, positions spawned per tool call,
a loop that ends after one step, and the errors of each, naming the field."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mars_megatron.agents.graph import SHIPPED, GraphError, ToolSpec
from mars_megatron.agents.graph_file import load_graph, shipped_graphs


def test_tool_pair_loads_and_says_what_the_scheduler_needs() -> None:
    graph = load_graph("tool_pair", max_steps=2)
    assert "tool_pair" in shipped_graphs()
    reasoner, distiller = graph.roles["reasoner"], graph.roles["distiller"]
    assert reasoner.tool == ToolSpec("calc", "distiller", 1)
    assert (reasoner.output, reasoner.reward) == ("solution", "answer")
    assert (distiller.output, distiller.reward, distiller.tool) == ("digest", "outcome", None)
    assert graph.distiller_roles() == {"distiller"}
    assert [(p.name, p.trigger) for p in graph.positions] == [
        ("reasoner", "output"),
        ("distiller", "tool_call"),
    ]
    assert graph.next_positions("reasoner", None) == []  # the distiller is no follow-up group
    assert [p.name for p in graph.tool_positions("reasoner", None)] == ["distiller"]
    assert graph.tool_positions("reasoner", 1) == []  # cut: calls are served, digests not trained
    assert graph.balance == ("reasoner", "distiller")
    assert graph.start_role == "reasoner" and graph.loop.steps["reason"].next is None
    assert graph.prompt_sets == ("tool_pair", "compact")


def test_tool_pair_prompts_render() -> None:
    graph = load_graph("tool_pair")
    assert graph.roles["reasoner"].messages("compact", {"problem": "Find 37+45."}) == [
        {"role": "user", "content": "Find 37+45.\n\nuse calc for the sum, or answer in \\boxed{}."}
    ]
    assert graph.roles["distiller"].messages(
        "compact", {"purpose": "the sum", "tool_output": "37+45 = 82"}
    ) == [{"role": "user", "content": "37+45 = 82\nWrite the sum."}]
    full = graph.roles["reasoner"].messages("tool_pair", {"problem": "Find 37+45."})
    assert [m["role"] for m in full] == ["system", "user"]
    assert "use calc <expression> for <purpose>" in full[0]["content"] and "RESULT" in full[0]["content"]
    digest = graph.roles["distiller"].messages(
        "tool_pair", {"purpose": "the sum", "tool_output": "37+45 = 82"}
    )
    assert "the sum" in digest[1]["content"] and "37+45 = 82" in digest[1]["content"]


def test_marsrl_is_unchanged() -> None:
    graph = load_graph("marsrl", max_steps=5)
    assert all(r.tool is None for r in graph.roles.values())
    assert all(p.trigger == "output" for p in graph.positions)
    assert [p.name for p in graph.next_positions("solver", None)] == ["verifier_1"]


# ------------------------------------------------------------------------------------------- the errors
Edit = Callable[[dict[str, Any]], None]


def _variant(tmp_path: Path, edit: Edit) -> Path:
    folder = tmp_path / "g"
    shutil.copytree(SHIPPED / "tool_pair", folder)
    data = yaml.safe_load((folder / "graph.yaml").read_text())
    edit(data)
    (folder / "graph.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "graph.yaml"


def _set(path: str, value: Any) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


_DELETE = object()


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        (_set("roles.reasoner.tool.name", "shell"), "roles.reasoner.tool.name", "unknown tool 'shell'"),
        (_set("roles.reasoner.tool.distiller", "nobody"), "roles.reasoner.tool.distiller", "unknown role"),
        (_set("roles.reasoner.tool.distiller", "reasoner"), "roles.reasoner.tool.distiller", "its own tool"),
        (_set("roles.reasoner.tool.max_calls", 0), "roles.reasoner.tool.max_calls", "integer >= 1"),
        (_set("roles.reasoner.tool.max_calls", True), "roles.reasoner.tool.max_calls", "integer >= 1"),
        (_set("roles.reasoner.tool.budget", 3), "roles.reasoner.tool.budget", "unknown key"),
        (_set("roles.reasoner.tool", "calc"), "roles.reasoner.tool", "expected a mapping"),
        (_set("roles.reasoner.tool.name", _DELETE), "roles.reasoner.tool.name", "expected a name"),
        # the tool's caller must write solutions
        (
            lambda d: d["roles"]["reasoner"].update(output="report", reward="outcome", verdict="yes_no"),
            "roles.reasoner.tool",
            "only a role that writes solutions calls tools",
        ),
        # the distiller must write digests, and only a distiller may
        (
            _set("roles.distiller.output", "report"),
            "roles.reasoner.tool.distiller",
            "must have output: digest",
        ),
        (_set("roles.reasoner.tool", _DELETE), "roles.distiller.output", "only by a tool's distiller"),
        (_set("roles.distiller.verdict", "yes_no"), "roles.distiller.verdict", "a digest carries no verdict"),
        (_set("roles.distiller.reward", "answer"), "roles.distiller.reward", "needs output: solution"),
        (
            _set("roles.distiller.tool", {"name": "calc", "distiller": "reasoner"}),
            "roles.distiller.tool",
            "only a role that writes solutions calls tools",
        ),
        # purpose and tool_output are a distiller's only
        (_set("roles.reasoner.variables", ["problem", "purpose"]), "roles.reasoner.variables", "{purpose}"),
        (_set("roles.reasoner.variables", ["problem", "tool"]), "roles.reasoner.variables", "not one of"),
        # positions spawned per tool call
        (_set("trajectory.1.trigger", "output"), "trajectory[1].trigger", "its position takes trigger"),
        (_set("trajectory.1.trigger", "always"), "trajectory[1].trigger", "not one of"),
        (_set("trajectory.1.inputs", 2), "trajectory[1].inputs", "it selects nothing"),
        (_set("trajectory.1.strategy", "random"), "trajectory[1].strategy", "it selects nothing"),
        (_set("trajectory.1.when", "any"), "trajectory[1].when", "it selects nothing"),
        (
            lambda d: d["trajectory"].append({"name": "again", "role": "reasoner", "input": "distiller"}),
            "trajectory[2].input",
            "feeds no position",
        ),
        (
            _set("trajectory.1.role", "reasoner"),
            "trajectory[1].role",
            "needs the distiller of 'reasoner''s tool, not 'reasoner'",
        ),
        # a distiller is no loop step: it is not given what it needs there
        (
            _set(
                "loop.steps",
                {"reason": {"role": "reasoner", "next": "digest"}, "digest": {"role": "distiller"}},
            ),
            "loop.steps.digest",
            "{purpose} is not available",
        ),
        # a single-step loop must end: a step that points to itself never does
        (_set("loop.steps.reason.next", "reason"), "loop.steps", "neither accept nor stop"),
        (_set("loop.steps.reason.next", "nowhere"), "loop.steps.reason.next", "unknown step"),
    ],
)
def test_tool_errors_name_the_field(tmp_path: Path, edit: Edit, field: str, message: str) -> None:
    path = _variant(tmp_path, edit)
    with pytest.raises(GraphError) as err:
        load_graph(str(path))
    assert err.value.field == field
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_a_bare_on_key_is_explained(tmp_path: Path) -> None:
    # YAML 1.1 reads `on:` as the boolean true: say so instead of failing on a non-string key
    path = _variant(tmp_path, lambda d: d["trajectory"][1].update({True: "tool_call"}))
    with pytest.raises(GraphError, match="read as a boolean") as err:
        load_graph(str(path))
    assert err.value.field == "trajectory[1].True"


def test_a_loop_may_end_after_one_solution_step_of_any_graph(tmp_path: Path) -> None:
    """The single-step loop is not special to tools: a lone solver without a tool is a valid system."""

    def solo(d: dict[str, Any]) -> None:
        del d["roles"]["distiller"], d["roles"]["reasoner"]["tool"], d["balance"]
        d["trajectory"] = d["trajectory"][:1]
        d["policies"] = {"shared": ["reasoner"]}

    graph = load_graph(str(_variant(tmp_path, solo)))
    assert list(graph.loop.steps) == ["reason"] and graph.loop.steps["reason"].next is None
    assert graph.distiller_roles() == set()


def test_more_calls_and_no_distiller_position_are_valid(tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["roles"]["reasoner"]["tool"]["max_calls"] = 3
        d["roles"]["reasoner"]["tool"]["name"] = "lookup"  # any tool of agents.tools.TOOLS
        d["trajectory"] = d["trajectory"][:1]  # digests served but never trained

    graph = load_graph(str(_variant(tmp_path, edit)))
    assert graph.roles["reasoner"].tool == ToolSpec("lookup", "distiller", 3)
    assert graph.tool_positions("reasoner", None) == []
