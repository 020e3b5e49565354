"""Which policy (model) serves which role: one shared policy (MarsRL), one per role, or the agent graph's
grouping (``algorithm.policies``). Kept free of torch so the launcher, which counts rollout engines, can use
it in its own environment."""

from __future__ import annotations

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.graph_file import graph_for
from mars_megatron.config import MarsConfig

SHARED = "shared"


def policy_names(cfg: MarsConfig, graph: AgentGraph | None = None) -> list[str]:
    """``["shared"]``, one policy per role, or the graph's policies."""
    return (graph or graph_for(cfg)).policy_names(cfg.algorithm.policies)
