"""Agent systems over plain data: the graph that declares one (:mod:`.graph`), the record of one agent
output (:mod:`.sample`), input selection, the inference loop, prompts and verdicts.

Nothing here talks to an engine: prompts are built as chat messages, verdicts are parsed from text,
and the inference loop and the trajectory are pure state machines/functions driven by the caller.

:mod:`.sample` (numpy arrays) is imported on first use of its names: the launcher reads graphs in its own
environment (NeMo-Run's), which has no numpy.
"""

from typing import TYPE_CHECKING, Any

from mars_megatron.agents.graph import AgentGraph, GraphError
from mars_megatron.agents.graph_file import graph_for, load_graph
from mars_megatron.agents.loop import (
    InferenceLoop,
    LoopResult,
    LoopStep,
    Request,
    choose_fallback,
)
from mars_megatron.agents.roles import Message
from mars_megatron.agents.selection import eligible_inputs, select_inputs
from mars_megatron.agents.thinking import strip_thinking
from mars_megatron.agents.trajectory import PromptInputs
from mars_megatron.agents.verdict import bug_report, parse_verdict

if TYPE_CHECKING:
    from mars_megatron.agents.sample import Sample, Segment, group_id

_FROM_SAMPLE = ("Sample", "Segment", "group_id")


def __getattr__(name: str) -> Any:
    if name in _FROM_SAMPLE:
        from mars_megatron.agents import sample

        return getattr(sample, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AgentGraph",
    "GraphError",
    "InferenceLoop",
    "LoopResult",
    "LoopStep",
    "Message",
    "PromptInputs",
    "Request",
    "Sample",
    "Segment",
    "bug_report",
    "choose_fallback",
    "eligible_inputs",
    "graph_for",
    "group_id",
    "load_graph",
    "parse_verdict",
    "select_inputs",
    "strip_thinking",
]
