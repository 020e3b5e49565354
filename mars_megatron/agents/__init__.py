"""The V–C reasoning system's logic (Solver, Verifier, Corrector) over plain data.

Nothing here talks to an engine: prompts are built as chat messages, verdicts are parsed from text,
and the inference loop and training expansion are pure state machines/functions driven by the caller.
"""

from mars_megatron.agents.loop import (
    InferenceLoop,
    LoopResult,
    LoopStep,
    Request,
    choose_fallback,
)
from mars_megatron.agents.prompts import (
    corrector_messages,
    solver_messages,
    strip_thinking,
    verifier_messages,
)
from mars_megatron.agents.roles import Message, Role
from mars_megatron.agents.sample import Sample, Segment
from mars_megatron.agents.selection import eligible_inputs, select_inputs
from mars_megatron.agents.trajectory import Position, group_id
from mars_megatron.agents.verdict import bug_report, parse_verdict

__all__ = [
    "InferenceLoop",
    "LoopResult",
    "LoopStep",
    "Message",
    "Position",
    "Request",
    "Role",
    "Sample",
    "Segment",
    "bug_report",
    "choose_fallback",
    "corrector_messages",
    "eligible_inputs",
    "group_id",
    "parse_verdict",
    "select_inputs",
    "solver_messages",
    "strip_thinking",
    "verifier_messages",
]
