"""Training trajectories: the chain of outputs a prompt is built from.

The positions of a trajectory, their order and which earlier position feeds each are the agent graph's
(:class:`~mars_megatron.agents.graph.AgentGraph`, ``trajectory``); the first position samples a group of G
per problem, each later one selects some outputs of its input position (:mod:`.selection`) and samples a
group of G per selected input.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mars_megatron.agents.graph import AgentGraph
    from mars_megatron.agents.sample import Sample


def chain(parent: Sample | None, samples: Mapping[str, Sample]) -> list[Sample]:
    """The outputs a new output is built from, oldest first: ``parent`` and its ancestors."""
    out: list[Sample] = []
    while parent is not None:
        out.append(parent)
        parent = samples[parent.parent_id] if parent.parent_id is not None else None
    return out[::-1]


@dataclass(frozen=True)
class PromptInputs:
    """What a later position's prompt is built from: its parent output, the latest solution on the way
    (the one a report judges or a revision revises) and the report that judged that solution, if one did."""

    parent: Sample | None = None
    solution: Sample | None = None
    report: Sample | None = None
    call: tuple[str, str] | None = None
    """A distiller serving a tool call: the call's purpose and the tool's output."""

    @classmethod
    def of(cls, parent: Sample | None, samples: Mapping[str, Sample], graph: AgentGraph) -> PromptInputs:
        solution = report = None
        for sample in chain(parent, samples):
            kind = graph.roles[sample.role].output
            if kind == "solution":
                solution, report = sample, None
            elif kind == "report":
                report = sample
        return cls(parent, solution, report)
