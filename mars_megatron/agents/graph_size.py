"""What a run asks for, computed from its graph and config before anything starts, and the caps it must
stay under (:func:`check_run_size`).

Why: every count of a graph file or config is checked alone (``inputs >= 1``, ``group_size >= 1``), yet
their product is what a step holds in memory. A 13-position chain with ``inputs: all`` and G = 4 asks for
4**13 samples per problem; ``data.problems_per_step`` = 10**9 asks for that many problem states. Such a run
started, then ran out of memory or never ended. The figures here are upper bounds of what the scheduler
(``pipeline/scheduler.py``) spawns: a position takes ``min(k, outputs of its input)`` inputs and spawns a
group of G samples for each; a ``tool_call`` position spawns one distiller sample per served call, at most
``max_calls`` per output of its input. Pure functions: integers in, integers out; no overflow in Python,
and the products saturate just above the cap so a 20,000-position chain costs microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars_megatron.agents.graph import AgentGraph, GraphError, LoopBudgets

MAX_SAMPLES_PER_PROBLEM = 65_536
"""Most samples one problem's trajectory may spawn (every position, every tool call). The shipped graphs
at the examples' G = 8 ask for at most 72 (marsrl: 8 + 4 x 16); 65,536 leaves room for G = 64 over a
13-position chain of 2 inputs each, and keeps one problem's sequences within one node's host memory at
32k tokens each."""
MAX_SAMPLES_PER_STEP = 4_194_304
"""Most samples one rollout step may spawn (samples per problem x ``data.problems_per_step``): 4M sequences
are what the scheduler's per-sample state (ids, tokens, rewards) can hold in a driver's memory. MarsRL's
235B run (128 problems x 72) asks for 9,216."""
MAX_LOOP_CALLS = 100_000
"""Most agent calls (segments and distiller digests) the inference loop may make for one problem sample.
The shipped loops: at most 1 + 3 + 2 x 30 steps (imo_refine) = 64 calls, with tools 3 per step."""
MAX_POSITIONS = 256
"""Most positions a graph's trajectory may declare (the shipped ones: at most 7)."""


@dataclass(frozen=True)
class RunSize:
    """What a run asks for: samples per problem, per step, and the inference loop's calls per problem."""

    samples_per_problem: int
    samples_per_step: int
    loop_calls_per_problem: int
    fan_out: int
    """Samples per problem divided by G (the graph's share of the product, for the message)."""


def samples_per_problem(
    graph: AgentGraph, group_size: int, inputs_per_agent: int, max_steps: int | None
) -> int:
    """Upper bound of the samples one problem's trajectory spawns; saturates above
    :data:`MAX_SAMPLES_PER_PROBLEM` (the exact figure is then of no use, and may have 10,000 digits)."""
    cap = MAX_SAMPLES_PER_PROBLEM + 1
    outputs: dict[str, int] = {}
    total = 0
    for p in graph.trajectory(max_steps):
        if p.input is None:
            n = group_size
        elif p.trigger == "tool_call":
            caller = graph.role_of(p.input).tool
            n = outputs.get(p.input, 0) * (caller.max_calls if caller is not None else 0)
        else:
            have = outputs.get(p.input, 0)
            k = have if p.inputs == "all" else min(have, p.inputs or inputs_per_agent)
            n = k * group_size
        outputs[p.name] = min(n, cap)
        total = min(total + n, cap)
    return total


def loop_calls_per_problem(graph: AgentGraph, budgets: LoopBudgets) -> int:
    """Upper bound of the agent calls the inference loop makes for one problem sample: the first step and
    its retries, then at most two steps per verdict (the verdict and a correction); a step of a role with a
    tool makes up to ``max_calls`` more segments and as many distiller calls."""
    tools = [graph.roles[s.role].tool for s in graph.loop.steps.values()]
    per_step = 1 + 2 * max((t.max_calls for t in tools if t is not None), default=0)
    steps = 1 + budgets.start_retries + 2 * budgets.max_iterations
    return steps * per_step


def run_size(
    graph: AgentGraph,
    *,
    group_size: int,
    inputs_per_agent: int,
    max_steps: int | None,
    problems_per_step: int,
    budgets: LoopBudgets,
) -> RunSize:
    per_problem = samples_per_problem(graph, group_size, inputs_per_agent, max_steps)
    return RunSize(
        samples_per_problem=per_problem,
        samples_per_step=per_problem * problems_per_step,
        loop_calls_per_problem=loop_calls_per_problem(graph, budgets),
        fan_out=-(-per_problem // group_size),
    )


def check_loop_calls(calls: int, graph_name: str, field: str, source: str = "") -> None:
    """Refuse an inference loop that may make more than :data:`MAX_LOOP_CALLS` agent calls per problem
    sample, blaming ``field`` (of ``source``, the graph file, when the graph's own loop is at fault)."""
    if calls > MAX_LOOP_CALLS:
        raise GraphError(
            f"the inference loop of graph {graph_name!r} (start_retries, max_iterations, tool max_calls; "
            f"evaluation.* where set) may make {calls:,} agent calls per problem; the most it may make is "
            f"{MAX_LOOP_CALLS:,}",
            field,
            source,
        )


def check_run_size(
    size: RunSize,
    *,
    group_size: int,
    problems_per_step: int,
    graph_name: str,
    loop_field: str = "loop.max_iterations",
) -> None:
    """Refuse a run whose figures exceed the caps, naming the figure, the fields that produced it and the
    cap (a :class:`GraphError`, a ``ValueError`` the ``mars`` command answers with exit 2); ``loop_field``
    is what the loop's figure is blamed on (``evaluation.max_iterations`` where the config sets it)."""
    if size.samples_per_problem > MAX_SAMPLES_PER_PROBLEM:
        raise GraphError(
            f"agents.group_size={group_size} over graph {graph_name!r}'s trajectory (its positions' inputs, "
            "agents.inputs_per_agent, tool max_calls, agents.max_steps) = more than "
            f"{MAX_SAMPLES_PER_PROBLEM:,} samples per problem, the most a run may ask for",
            "agents.group_size",
        )
    if size.samples_per_step > MAX_SAMPLES_PER_STEP:
        raise GraphError(
            f"{size.samples_per_problem:,} samples per problem (agents.group_size={group_size} x graph "
            f"{graph_name!r}'s fan-out {size.fan_out:,}) x data.problems_per_step={problems_per_step:,} = "
            f"{size.samples_per_step:,} samples per step; the most a run may ask for is "
            f"{MAX_SAMPLES_PER_STEP:,}",
            "data.problems_per_step",
        )
    check_loop_calls(size.loop_calls_per_problem, graph_name, loop_field)
