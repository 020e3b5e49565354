"""Agent roles of the V–C reasoning system and the chat message type they exchange.

All three roles may share one policy model; the role only decides which prompt is built and which
reward applies, so it is a plain ``Enum`` rather than a class hierarchy.
"""

from enum import StrEnum

Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""


class Role(StrEnum):
    """Which agent wrote (or will write) an output; a ``StrEnum`` so values serialise as plain text."""

    SOLVER = "solver"
    VERIFIER = "verifier"
    CORRECTOR = "corrector"
