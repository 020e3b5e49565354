"""What every rollout of MarsRL shares, wherever it runs: seeds derived from names, and the per-role
metrics of scored outputs.

The rollout itself — positions Solver → Verifier1 → Corrector1 → Verifier2 → Corrector2, input
selection, groups, segments — is the schedule of :mod:`mars_megatron.pipeline`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

from mars_megatron.agents.roles import Role
from mars_megatron.agents.sample import Sample
from mars_megatron.agents.trajectory import Position

RewardMode = Literal["agent", "shared"]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes and Python versions, unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def role_metrics(outputs: Sequence[Sample]) -> dict[str, float]:
    """Agent-specific rewards per role and position (also under ``algorithm.reward=shared``, so runs
    compare on the same scale), sample counts, lengths and truncation, of scored samples. One definition
    for the synchronous rollout and the agentic pipeline's updates."""
    out: dict[str, float] = {}
    by_role: dict[Role, list[Sample]] = {}
    by_position: dict[Position, list[Sample]] = {}
    for o in outputs:
        by_role.setdefault(o.position.role, []).append(o)
        by_position.setdefault(o.position, []).append(o)
    for position, members in by_position.items():
        out[f"position_reward/{position.value}"] = _mean([o.reward or 0.0 for o in members])
        out[f"position_samples/{position.value}"] = float(len(members))
    for role in Role:
        members = by_role.get(role, [])
        out[f"samples/{role.value}"] = float(len(members))
        if not members:  # e.g. no Verifier found an error: logged as null, plotted as a gap
            out[f"reward/{role.value}"] = float("nan")
            continue
        out[f"reward/{role.value}"] = _mean([o.reward or 0.0 for o in members])
        if all(o.training_reward is not None for o in members):
            out[f"train_reward/{role.value}"] = _mean([o.training_reward or 0.0 for o in members])
        out[f"response_len/{role.value}"] = _mean([float(o.response_len) for o in members])
        out[f"truncated/{role.value}"] = _mean([float(o.truncated) for o in members])
    out["rollout/prompt_tokens"] = float(sum(len(o.prompt_ids) for o in outputs))
    out["rollout/response_tokens"] = float(sum(o.response_len for o in outputs))
    verifiers = by_role.get(Role.VERIFIER, [])
    if verifiers:
        out["verifier/unparsed"] = _mean([float(o.verdict is None) for o in verifiers])
    # Verifier and Corrector rewards depend on what they were given: split by whether the judged solution
    # was right, so a shift in the input mix is not mistaken for learning (or forgetting).
    for role in (Role.VERIFIER, Role.CORRECTOR):
        for truth, name in ((True, "on_right"), (False, "on_wrong")):
            members = [o for o in by_role.get(role, []) if o.judged_right is truth]
            rewards = [o.reward or 0.0 for o in members]
            out[f"{role.value}/{name}"] = _mean(rewards) if members else float("nan")
            out[f"{role.value}/{name}_samples"] = float(len(members))
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
