"""The chat message type agents exchange. Roles themselves are names from the agent graph
(:mod:`mars_megatron.agents.graph`), not a type: a graph file declares them."""

Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""
