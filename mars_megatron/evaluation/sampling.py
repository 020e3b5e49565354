"""What an evaluation's settings (the config's ``evaluation`` section) mean for each agent call, and the
record of them a run writes (kept apart from the runner so the CLI can use it without importing torch).

The settings themselves are declared, defaulted and validated once, in :class:`~mars_megatron.config.
EvalConfig`; ``mars eval``'s flags and held-out evaluation during training both build that section."""

from __future__ import annotations

import dataclasses
from typing import Any

from mars_megatron.agents.graph import AgentGraph, LoopBudgets
from mars_megatron.config import EvalConfig, RolloutConfig

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
"""Fields of the ``evaluation`` section that shape every agent call's sampling."""
LOOP_FIELDS = ("start_retries", "max_iterations", "accept_after", "give_up_after")
"""Fields of the ``evaluation`` section that override the graph's loop budgets (:class:`LoopBudgets`)."""


def with_response_budget(evaluation: EvalConfig, rollout: RolloutConfig | None = None) -> EvalConfig:
    """``evaluation`` with ``max_tokens`` resolved: a null one takes the rollout's response budget
    (``rollout.max_response_tokens``; the default rollout's when none is given)."""
    if evaluation.max_tokens is not None:
        return evaluation
    budget = (rollout or RolloutConfig()).max_response_tokens
    return dataclasses.replace(evaluation, max_tokens=budget)


def record(evaluation: EvalConfig, graph: AgentGraph) -> dict[str, dict[str, Any]]:
    """The settings a run writes beside its results (``sampling``, and in ``system`` the loop budgets
    ``graph``'s loop ran with, under the ``evaluation`` fields' names), so a resumed run can be checked
    against the first one."""
    budgets = LoopBudgets.of(graph, evaluation)
    return {
        "sampling": {name: getattr(evaluation, name) for name in SAMPLING_FIELDS},
        "system": {
            "start_retries": budgets.start_retries,
            "max_iterations": budgets.max_iterations,
            "accept_after": budgets.accept_after,
            "give_up_after": budgets.give_up_after,
        },
    }


def params(evaluation: EvalConfig, seed: int) -> Any:
    """Engine sampling parameters for one call (``evaluation.max_tokens`` resolved, see
    :func:`with_response_budget`)."""
    from mars_megatron.rollout.engine import SamplingParams

    ev = with_response_budget(evaluation)
    return SamplingParams(ev.max_tokens, ev.temperature, ev.top_p, ev.top_k, seed=seed)
