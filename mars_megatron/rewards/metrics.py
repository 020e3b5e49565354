"""Per-role metrics of scored outputs: the agent-specific rewards by role and position, sample counts,
lengths and truncation, and the rewards of input-taking roles split by whether their input was right. One
definition for the in-process rollout and the agentic pipeline's updates."""

from __future__ import annotations

from collections.abc import Sequence

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.sample import Sample


def role_metrics(outputs: Sequence[Sample], graph: AgentGraph) -> dict[str, float]:
    """Agent-specific rewards per role and position (also under ``algorithm.reward=shared``, so runs
    compare on the same scale), sample counts, lengths and truncation, of scored samples. One definition
    for the synchronous rollout and the agentic pipeline's updates."""
    out: dict[str, float] = {}
    by_role: dict[str, list[Sample]] = {}
    by_position: dict[str, list[Sample]] = {}
    for o in outputs:
        by_role.setdefault(o.role, []).append(o)
        by_position.setdefault(o.position, []).append(o)
    for position, members in by_position.items():
        out[f"position_reward/{position}"] = _mean([o.reward or 0.0 for o in members])
        out[f"position_samples/{position}"] = float(len(members))
    for role in graph.roles:
        members = by_role.get(role, [])
        out[f"samples/{role}"] = float(len(members))
        if not members:  # e.g. no verdict failed, so nothing was revised: logged as null, plotted as a gap
            out[f"reward/{role}"] = float("nan")
            continue
        out[f"reward/{role}"] = _mean([o.reward or 0.0 for o in members])
        if all(o.training_reward is not None for o in members):
            out[f"train_reward/{role}"] = _mean([o.training_reward or 0.0 for o in members])
        out[f"response_len/{role}"] = _mean([float(o.response_len) for o in members])
        out[f"truncated/{role}"] = _mean([float(o.truncated) for o in members])
    for role, members in by_role.items():  # a reward function's failures (counted) and details (averaged)
        keys = sorted({k for o in members for k in o.reward_info})
        for key in keys:
            values = [o.reward_info[key] for o in members if key in o.reward_info]
            if key.startswith("fail/"):
                out[f"reward_fn/{role}/{key.removeprefix('fail/')}"] = float(len(values))
            else:
                out[f"reward_fn/{role}/{key}"] = _mean(values)
    out["rollout/prompt_tokens"] = float(sum(len(o.prompt_ids) for o in outputs))
    out["rollout/response_tokens"] = float(sum(o.response_len for o in outputs))
    for role in (r for r in graph.roles.values() if r.decides):
        if by_role.get(role.name):
            out[f"{role.name}/unparsed"] = _mean([float(o.verdict is None) for o in by_role[role.name]])
    # The rewards of roles that take an input depend on what they were given: split by whether the
    # solution they judged or revised was right, so a shift in the input mix is not mistaken for learning.
    fed = [r for r in graph.roles if any(p.role == r and p.input is not None for p in graph.positions)]
    for role in fed:
        for truth, name in ((True, "on_right"), (False, "on_wrong")):
            members = [o for o in by_role.get(role, []) if o.judged_right is truth]
            rewards = [o.reward or 0.0 for o in members]
            out[f"{role}/{name}"] = _mean(rewards) if members else float("nan")
            out[f"{role}/{name}_samples"] = float(len(members))
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
