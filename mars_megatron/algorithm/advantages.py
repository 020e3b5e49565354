"""GRPO advantages, per group of samples that share role, position and input.

Â_i = (r_i − mean(r)) / (std(r) + ε) over the group. ``std`` is the *population* standard deviation
(divide by G, not G − 1): the statistic describes the group itself rather than estimating a larger
population, for binary rewards it is exactly sqrt(p(1 − p)), and a group of one gives std 0 (so
advantage 0) instead of NaN. Groups whose rewards are all equal carry no signal; they can be dropped
(DAPO-style dynamic sampling). Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from mars_megatron.agents.sample import Sample

G = TypeVar("G", bound=Hashable)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def grpo_advantages(
    rewards_by_group: Mapping[G, Sequence[float]], eps: float = 1e-6, normalize_std: bool = True
) -> dict[G, list[float]]:
    """(r − mean) / (std + eps) per group, in the order given; ``normalize_std=False`` gives r − mean
    (Dr. GRPO style). Every group needs at least one reward."""
    if eps < 0:
        raise ValueError(f"grpo_advantages: eps must be >= 0, got {eps}")
    out: dict[G, list[float]] = {}
    for group, rewards in rewards_by_group.items():
        if len(rewards) == 0:
            raise ValueError(f"grpo_advantages: group {group!r} has no rewards")
        mean, std = _mean_std(rewards)
        scale = (std + eps) if normalize_std else 1.0
        out[group] = [(r - mean) / scale if std > 0 else 0.0 for r in rewards]
    return out


def zero_variance_groups(rewards_by_group: Mapping[G, Sequence[float]]) -> set[G]:
    """Groups whose rewards are all equal (including groups of one): their advantages are all 0."""
    return {g for g, rewards in rewards_by_group.items() if len(set(rewards)) <= 1}


def assign_advantages(
    samples: Sequence[Sample],
    *,
    filter_zero_variance: bool,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> tuple[list[Sample], dict[str, float]]:
    """Annotate ``samples`` in place with their ``advantage``, grouped by ``Sample.group_id``; return the
    records to train on (the same objects: nothing copies a record on its way to the loss).

    GRPO normalises :attr:`Sample.reward_trained_on` (the shared reward where set, else the agent
    reward). Every sample needs one, and a group must hold one position only (a group id shared across
    roles or positions is a bug upstream, so it raises rather than mixing them). With
    ``filter_zero_variance`` the samples of zero-variance groups are left out. Input order is kept.

    Stats: ``groups``, ``filtered_groups``, ``samples``, ``kept_samples``, and ``mean_reward/<role>``
    over all samples of each role present (before filtering).
    """
    rewards: dict[str, list[float]] = {}
    positions: dict[str, object] = {}
    for s in samples:
        reward = s.reward_trained_on
        if reward is None:
            raise ValueError(f"assign_advantages: sample {s.sample_id!r} (group {s.group_id}) has no reward")
        if positions.setdefault(s.group_id, s.position) != s.position:
            raise ValueError(
                f"assign_advantages: group {s.group_id!r} mixes positions "
                f"{positions[s.group_id]} and {s.position}"
            )
        rewards.setdefault(s.group_id, []).append(reward)
    advantages = grpo_advantages(rewards, eps=eps, normalize_std=normalize_std)
    dropped = zero_variance_groups(rewards) if filter_zero_variance else set()

    cursor = dict.fromkeys(rewards, 0)
    kept: list[Sample] = []
    for s in samples:
        index = cursor[s.group_id]
        cursor[s.group_id] += 1
        if s.group_id not in dropped:
            s.advantage = advantages[s.group_id][index]
            s.check_scores()
            kept.append(s)

    stats: dict[str, float] = {
        "groups": float(len(rewards)),
        "filtered_groups": float(len(dropped)),
        "samples": float(len(samples)),
        "kept_samples": float(len(kept)),
    }
    by_role: dict[str, list[float]] = {}
    for s in samples:
        by_role.setdefault(s.role, []).append(s.reward_trained_on)  # type: ignore[arg-type]
    for role, values in by_role.items():
        stats[f"mean_reward/{role}"] = sum(values) / len(values)
    return kept, stats


def balance_roles(samples: Sequence[Sample], roles: Sequence[str]) -> tuple[list[Sample], dict[str, float]]:
    """MARS's balanced sampling between roles (the graph's ``balance``): every role after the first keeps
    at most as many samples as the first has, those with the largest ``|advantage|`` (they carry the
    most signal; ties keep the earlier), so a role that writes many short outputs (a distiller, one per
    tool call) does not outweigh the role it serves in the update. Other roles are untouched; order is
    kept. Stats: ``balance/dropped/<role>``.

    Why the first role is the reference rather than the rarest: a batch in which no tool was called has
    no distiller samples, and balancing down to zero would throw the whole batch away.
    """
    if not roles:
        return list(samples), {}
    reference = sum(s.role == roles[0] for s in samples)
    keep: set[int] = set(range(len(samples)))
    stats: dict[str, float] = {}
    for role in roles[1:]:
        mine = [i for i, s in enumerate(samples) if s.role == role]
        if len(mine) <= reference:
            stats[f"balance/dropped/{role}"] = 0.0
            continue
        if any(samples[i].advantage is None for i in mine):
            raise ValueError(f"balance_roles: {role} samples need advantages (run assign_advantages)")
        ranked = sorted(mine, key=lambda i: -abs(samples[i].advantage or 0.0))
        keep -= set(ranked[reference:])
        stats[f"balance/dropped/{role}"] = float(len(mine) - reference)
    return [s for i, s in enumerate(samples) if i in keep], stats
