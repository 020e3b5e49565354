"""Checks of a whole agent graph before anything runs (:func:`validate`): everything that would
otherwise fail mid-run, each a :class:`~mars_megatron.agents.graph.GraphError` naming the file and the
field. :mod:`mars_megatron.agents.graph_file` parses a graph file and then calls it."""

from __future__ import annotations

from collections.abc import Sequence

from mars_megatron.agents.graph import TOOL_VARIABLES, AgentGraph, GraphError, PositionSpec
from mars_megatron.agents.tools import TOOLS


def _available(chain_kinds: Sequence[str], *, served_call: bool = False) -> set[str]:
    """Variables a prompt can be given after outputs of ``chain_kinds`` (oldest first): the latest
    solution, and a report only if one judged that solution (came after it); a distiller serving a tool
    call (``served_call``) is given the call's purpose and the tool's output."""
    if served_call:
        return {"problem", *TOOL_VARIABLES}
    out, report = {"problem"}, False
    for kind in chain_kinds:
        if kind == "solution":
            out.add("solution")
            report = False
        elif kind == "report":
            report = True
    return out | {"report", "bug_report"} if report else out


def validate(graph: AgentGraph, *, max_steps: int | None = None) -> None:
    """Everything that would otherwise fail mid-run, each as a :class:`GraphError` naming the field:
    unknown roles and positions, a role without a reward or with a reward its output cannot earn,
    prompts that use variables the role did not declare or cannot be given, loop cycles that no
    verdict can stop, an outcome-rewarded role whose outputs are not all followed, and a trajectory cut
    (``agents.max_steps``) beyond the trajectory."""
    src = graph.source
    _validate_tools(graph, src)
    for role in graph.roles.values():
        where = f"roles.{role.name}"
        if role.reward == "answer" and role.output != "solution":
            raise GraphError("an answer reward needs output: solution", f"{where}.reward", src)
        if role.reward == "verdict" and role.verdict is None:
            raise GraphError("a verdict reward needs a verdict reader (verdict: ...)", f"{where}.reward", src)
        if role.output == "judgement" and role.verdict is None:
            raise GraphError("a judgement needs a verdict reader (verdict: ...)", f"{where}.verdict", src)
        if role.output in ("solution", "digest") and role.verdict is not None:
            raise GraphError(f"a {role.output} carries no verdict", f"{where}.verdict", src)
        for templates in role.prompts.values():
            for i, template in enumerate(templates):
                try:
                    used = template.fields()
                except ValueError as err:
                    raise GraphError(str(err), f"{where}.messages[{i}]", src) from None
                undeclared = sorted(set(used) - set(role.variables))
                if undeclared:
                    raise GraphError(
                        f"{template.source} uses {{{undeclared[0]}}}, which the role does not declare "
                        f"(variables: {', '.join(role.variables)})",
                        f"{where}.messages[{i}]",
                        src,
                    )
    _validate_trajectory(graph, src)
    _validate_loop(graph, src)
    for policy, roles in graph.policies.items():
        if not isinstance(roles, tuple) or not roles:
            raise GraphError("expected a list of roles", f"policies.{policy}", src)
        for r in roles:
            if r not in graph.roles:
                raise GraphError(f"unknown role {r!r}", f"policies.{policy}", src)
    served = [r for roles in graph.policies.values() for r in roles]
    for r in graph.roles:
        if served.count(r) != 1:
            raise GraphError(
                f"role {r!r} is served by {served.count(r)} policies, expected 1", "policies", src
            )
    for r in graph.balance:
        if r not in graph.roles:
            raise GraphError(f"unknown role {r!r}", "balance", src)
    if max_steps is not None and max_steps > len(graph.positions):
        raise GraphError(
            f"is {max_steps}, beyond the {len(graph.positions)} positions of graph {graph.name!r}",
            "agents.max_steps",
        )
    if max_steps is not None:
        _validate_cut(graph, max_steps)


def _validate_cut(graph: AgentGraph, max_steps: int) -> None:
    """A cut trajectory keeps what its kept positions need: the position that digests a kept position's
    tool calls, and the position that follows a kept position whose role is rewarded by its outcome."""
    kept = {p.name for p in graph.trajectory(max_steps)}
    for p in graph.positions:
        if p.name in kept or p.input not in kept:
            continue
        source = graph.roles[graph.position(p.input).role]
        needed = p.trigger == "tool_call" or source.reward == "outcome"
        if needed:
            what = (
                f"the digests of {p.input!r}'s tool calls"
                if p.trigger == "tool_call"
                else f"what follows {p.input!r} and makes its outcome reward"
            )
            raise GraphError(
                f"is {max_steps}, which cuts position {p.name!r}, {what} "
                f"(keep at least {graph.positions.index(p) + 1} positions)",
                "agents.max_steps",
            )


def _validate_tools(graph: AgentGraph, src: str) -> None:
    """A tool must exist, be called by a role that writes solutions and be served by another role that
    writes digests (so a distiller calls no tool); only a distiller writes digests or may use
    ``purpose`` and ``tool_output``."""

    distillers = graph.distiller_roles()
    for role in graph.roles.values():
        where = f"roles.{role.name}"
        if role.tool is not None:
            tool = role.tool
            if tool.name not in TOOLS:
                raise GraphError(
                    f"unknown tool {tool.name!r} (tools: {', '.join(sorted(TOOLS))})",
                    f"{where}.tool.name",
                    src,
                )
            if role.output != "solution":
                raise GraphError("only a role that writes solutions calls tools", f"{where}.tool", src)
            if tool.distiller not in graph.roles:
                raise GraphError(f"unknown role {tool.distiller!r}", f"{where}.tool.distiller", src)
            if tool.distiller == role.name:
                raise GraphError("a role cannot distil its own tool's output", f"{where}.tool.distiller", src)
            if graph.roles[tool.distiller].output != "digest":
                raise GraphError(
                    f"the distiller {tool.distiller!r} must have output: digest",
                    f"{where}.tool.distiller",
                    src,
                )
        if role.output == "digest" and role.name not in distillers:
            raise GraphError(
                "a digest is written only by a tool's distiller (roles.<role>.tool.distiller)",
                f"{where}.output",
                src,
            )
        used = sorted(set(role.variables) & set(TOOL_VARIABLES))
        if used and role.name not in distillers:
            raise GraphError(
                f"{{{used[0]}}} is given only to a tool's distiller, and {role.name!r} distils no tool",
                f"{where}.variables",
                src,
            )


def _validate_trajectory(graph: AgentGraph, src: str) -> None:
    seen: dict[str, PositionSpec] = {}
    kinds: dict[str, list[str]] = {}
    for i, p in enumerate(graph.positions):
        where = f"trajectory[{i}]"
        if p.name in seen:
            raise GraphError(f"position {p.name!r} is declared twice", f"{where}.name", src)
        if p.role not in graph.roles:
            raise GraphError(f"unknown role {p.role!r}", f"{where}.role", src)
        role = graph.roles[p.role]
        if i == 0 and p.input is not None:
            raise GraphError("the first position takes no input", f"{where}.input", src)
        if i > 0:
            if p.input is None:
                raise GraphError("every later position needs an input position", f"{where}.input", src)
            if p.input not in seen:
                later = p.input == p.name or any(q.name == p.input for q in graph.positions[i:])
                what = "a cycle: inputs must come from earlier positions" if later else "unknown position"
                raise GraphError(f"{what} ({p.input!r})", f"{where}.input", src)
            if seen[p.input].trigger == "tool_call":
                raise GraphError(
                    f"{p.input!r} is spawned per tool call and feeds no position", f"{where}.input", src
                )
            source = graph.roles[seen[p.input].role]
            if p.trigger == "tool_call" and (source.tool is None or source.tool.distiller != p.role):
                raise GraphError(
                    f"trigger: tool_call needs the distiller of {p.input!r}'s tool, not {p.role!r}",
                    f"{where}.role",
                    src,
                )
            if p.trigger == "output" and p.role in graph.distiller_roles():
                raise GraphError(
                    f"role {p.role!r} is a tool's distiller: its position takes trigger: tool_call",
                    f"{where}.trigger",
                    src,
                )
            if p.when != "any" and not source.decides:
                raise GraphError(
                    f"{p.input!r} reads no verdict, so 'when: {p.when}' never holds", f"{where}.when", src
                )
            if source.reward == "outcome" and (p.inputs != "all" or p.when != "any"):
                raise GraphError(
                    f"{p.input!r} is rewarded by the outcome of what follows it, so every one of its outputs "
                    "must be followed: take inputs: all (and when: any)",
                    f"{where}.inputs",
                    src,
                )
        chain = [*kinds.get(p.input, []), graph.roles[seen[p.input].role].output] if p.input else []
        missing = sorted(set(role.variables) - _available(chain, served_call=p.trigger == "tool_call"))
        if missing:
            raise GraphError(
                f"role {p.role!r} declares {{{missing[0]}}}, which nothing before this position provides",
                f"{where}.role",
                src,
            )
        kinds[p.name] = chain
        seen[p.name] = p
    distillers = graph.distiller_roles()
    for role in graph.roles.values():
        # a distiller's outcome is the reward of the response it served, not of a later position
        if (
            role.reward == "outcome"
            and role.name not in distillers
            and not any(
                q.input is not None and graph.position(q.input).role == role.name for q in graph.positions
            )
        ):
            raise GraphError(
                "an outcome reward needs a position that takes this role's outputs",
                f"roles.{role.name}.reward",
                src,
            )
    start = graph.loop.steps.get(graph.loop.start)
    if start is not None and graph.positions[0].role != start.role:
        raise GraphError(
            "the trajectory and the loop must start with the same role", "trajectory[0].role", src
        )


def _validate_loop(graph: AgentGraph, src: str) -> None:
    loop = graph.loop
    if loop.start not in loop.steps:
        raise GraphError(f"unknown step {loop.start!r}", "loop.start", src)
    for step in loop.steps.values():
        where = f"loop.steps.{step.name}"
        if step.role not in graph.roles:
            raise GraphError(f"unknown role {step.role!r}", f"{where}.role", src)
        decides = graph.roles[step.role].decides
        targets = {"next": step.next, "on_pass": step.on_pass, "on_fail": step.on_fail}
        if decides and (step.next is not None or step.on_pass is None or step.on_fail is None):
            raise GraphError("a role that decides goes on_pass and on_fail, not next", where, src)
        if not decides and (step.on_pass or step.on_fail):
            raise GraphError(
                "a role that reads no verdict goes to one next step (or none: the end)", where, src
            )
        for key, target in targets.items():
            if target is not None and target not in loop.steps:
                raise GraphError(f"unknown step {target!r}", f"{where}.{key}", src)
    # A step without ``next`` (and no verdict) ends the loop: its solution is the answer.
    if not any(graph.roles[s.role].decides or s.next is None for s in loop.steps.values()):
        raise GraphError(
            "no step reads a verdict or ends the loop (no next), so the loop can neither accept nor stop",
            "loop.steps",
            src,
        )
    # A cycle that passes no deciding step never meets a stop rule (they all count verdicts).
    plain = {s.name: s.next for s in loop.steps.values() if not graph.roles[s.role].decides}
    for first in plain:
        seen, step = [first], plain[first]
        while step in plain:
            if step in seen:
                cycle = " -> ".join([*seen[seen.index(step) :], step])
                raise GraphError(
                    f"the cycle {cycle} passes no step that reads a verdict, so nothing stops it",
                    f"loop.steps.{step}.next",
                    src,
                )
            seen.append(step)
            step = plain[step]
    if graph.roles[loop.steps[loop.start].role].output != "solution":
        raise GraphError("the first step must write a solution", "loop.start", src)
    writes_report = any(graph.roles[s.role].output == "report" for s in loop.steps.values())
    for step in loop.steps.values():
        given = {"problem"} if step.name == loop.start else {"problem", "solution"}
        if writes_report and step.name != loop.start:
            given |= {"report", "bug_report"}
        missing = sorted(set(graph.roles[step.role].variables) - given)
        if missing:
            raise GraphError(
                f"{{{missing[0]}}} is not available to step {step.name!r}", f"loop.steps.{step.name}", src
            )
