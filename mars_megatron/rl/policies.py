"""Which policy (model) serves which role: one shared policy (MarsRL) or one per role. Kept free of torch
so the launcher, which counts rollout engines, can use it in its own environment."""

from __future__ import annotations

from collections.abc import Sequence

from mars_megatron.agents.roles import Role
from mars_megatron.config import MarsConfig

SHARED = "shared"


def policy_names(cfg: MarsConfig) -> list[str]:
    """``["shared"]``, or one policy per role."""
    return [SHARED] if cfg.algorithm.policies == "shared" else [role.value for role in Role]


def policy_of(role: Role, names: Sequence[str]) -> str:
    return SHARED if SHARED in names else role.value
