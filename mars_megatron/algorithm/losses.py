"""Loss pieces of MarsRL's policy update: pure torch over ``[b, s]`` tensors and a 0/1 mask.

Every tensor argument is ``[b, s]`` (per-token log-probs of the *target* tokens, as the engine returns
them) unless it says otherwise; per-sample values (advantages) may also be ``[b]``. Losses are *sums*
over masked tokens: the engine reports the token count beside the sum and megatron's
``calculate_per_token_loss`` divides by the token count of the whole global batch (token-level
averaging). Stats are detached 0-dim tensors (no host sync inside the loss).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from mars_megatron.agents.sample import Sample

KLKind = Literal["k1", "k2", "k3"]
_MAX_LOG_RATIO = 20.0  # exp() argument bound for k3 and ratios: keeps one wild token finite
KL_CLAMP = 10.0
"""Default bound of the per-token KL value (``algorithm.kl_clamp``): verl's ``kl_penalty`` and NeMo-RL's
KL both clamp it to ±10. The log-ratio bound alone lets k3 reach ``e^20 ≈ 5e8`` with a gradient of the
same size, so one token far from the reference could swamp the whole batch's update."""


def _per_token(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``[b]`` per-sample tensor broadcast to ``[b, s]``; ``[b, s]`` passes through."""
    if values.dim() == 1:
        values = values.unsqueeze(-1)
    return values.to(like.dtype).expand_as(like)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where ``mask`` is 1 (0 when there are none)."""
    return _masked_mean(values, mask.to(values.dtype))


# ---------------------------------------------------------------------------------- clipped surrogate
def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``max(−r·A, −clip(r, 1 − clip_low, 1 + clip_high)·A)`` with
    ``r = exp(logprobs − old_logprobs)``, unmasked. Returns (loss ``[b, s]``, ratio, clipped) where
    ``clipped`` marks tokens whose gradient the clip removed (A > 0 and r > 1 + clip_high, or A < 0
    and r < 1 − clip_low). ``clip_high > clip_low`` is DAPO's clip-higher."""
    adv = _per_token(advantages, logprobs)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped_loss = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))
    return loss, ratio, clipped


def surrogate_stats(
    logprobs: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Clip fraction, approx KL(old ‖ new) (k3 of the ratio) and ratio mean/max over masked tokens."""
    mask = mask.to(logprobs.dtype)
    ratio = ratio.detach()
    log_ratio = (logprobs.detach() - old_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    masked_ratio = torch.where(mask > 0, ratio, torch.zeros_like(ratio))
    return {
        "clip_fraction": _masked_mean(clipped.to(mask.dtype), mask),
        "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),
        "ratio_mean": _masked_mean(ratio, mask),
        "ratio_max": masked_ratio.max(),  # ratios are > 0, so masked zeros never win (0 if no tokens)
    }


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped surrogate summed over masked tokens (the caller divides by the global
    token count). Gradient per unclipped token: ``d/d logprob = −A·r``; clipped tokens: 0."""
    loss, ratio, clipped = clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high)
    mask = mask.to(loss.dtype)
    return (loss * mask).sum(), surrogate_stats(logprobs, ratio, clipped, old_logprobs, mask)


# ------------------------------------------------------------------------------------------------ KL
def kl_per_token(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3", clamp: float = KL_CLAMP
) -> torch.Tensor:
    """Schulman's estimators of KL(π ‖ π_ref) from tokens sampled by π (http://joschu.net/blog/kl-approx.html).

    With ``log ρ = ref_logprobs − logprobs`` (ρ = π_ref/π):
    - ``k1 = −log ρ``: unbiased, high variance, can be negative;
    - ``k2 = ½ (log ρ)²``: biased, low variance, always ≥ 0;
    - ``k3 = (ρ − 1) − log ρ``: unbiased, low variance, always ≥ 0 (GRPO's choice).

    The value is clamped to ``[−clamp, clamp]`` (:data:`KL_CLAMP`, as verl and NeMo-RL do), so a token far
    from the reference adds at most ``clamp`` to the loss and, outside the band, no gradient (that of
    ``torch.clamp``); inside the band the estimators are exact.
    """
    if not clamp > 0:
        raise ValueError(f"kl_per_token: clamp must be > 0, got {clamp}")
    log_rho = (ref_logprobs.detach() - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if kind == "k1":
        kl = -log_rho
    elif kind == "k2":
        kl = 0.5 * log_rho**2
    elif kind == "k3":
        kl = torch.exp(log_rho) - 1.0 - log_rho
    else:
        raise ValueError(f"kl_per_token: kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    return kl.clamp(-clamp, clamp)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: KLKind = "k3",
    clamp: float = KL_CLAMP,
) -> torch.Tensor:
    """Sum of :func:`kl_per_token` over masked tokens."""
    kl = kl_per_token(logprobs, ref_logprobs, kind, clamp)
    return (kl * mask.to(kl.dtype)).sum()


# ------------------------------------------------------------------------------ importance sampling
def tis_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: ``min(exp(old − behaviour), cap)``, detached.

    ``old_logprobs`` are the trainer's, ``behaviour_logprobs`` the rollout engine's for the same
    tokens; the weight corrects for the two computing different probabilities (kernels, precision,
    stale segments) and the cap bounds its variance."""
    if cap <= 0:
        raise ValueError(f"tis_weights: cap must be > 0, got {cap}")
    log_w = (old_logprobs - behaviour_logprobs).detach().clamp(max=_MAX_LOG_RATIO)
    return torch.exp(log_w).clamp(max=cap)


def pois_old_logprobs(current_logprobs: torch.Tensor) -> torch.Tensor:
    """POIS (pseudo on-policy importance sampling, UloRL; used by MarsRL): the "old" log-probs are the
    latest model's own, detached, so every ratio is exactly 1 at the first update and the gradient is
    the plain policy gradient ``−A·∇log π``.

    Why: with segment rollout one response is written by several policy versions, so its true
    behaviour policy is a patchwork; the exact ratio against it is a product over stale segments
    whose variance grows with the lag, and clipping would silently drop the gradient of the stalest
    tokens. POIS treats every sample as on-policy for the latest weights, trading a bias bounded by
    the staleness limit for low variance, and needs no copy of old weights. Computing it inside the
    loss is exact when each batch gets one optimizer step (MarsRL); for several steps per batch, take
    the log-probs from the trainer before the first step and pass them as ``old_logprobs`` instead: here
    every mini-batch's ratio would be 1 and the clip would never act, so the config refuses
    ``importance=pois`` with ``train.updates_per_batch > 1``.
    """
    return current_logprobs.detach()


# --------------------------------------------------------------------------------- DMMPT and entropy
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Exact per-position entropy ``−Σ_v p_v log p_v`` of ``[..., vocab]`` logits (full vocab)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def entropy_estimate(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Monte-Carlo estimate of the mean per-token entropy from the sampled tokens' log-probs:
    ``H = E_{y∼π}[−log π(y)] ≈ mean(−logprob)`` over masked tokens, detached.

    The engine only has the target tokens' log-probs (vocab-parallel logits are not gathered), so this
    is what the loss can see. It is unbiased when the tokens were sampled from the current policy at
    temperature 1; rollouts at temperature < 1 (MarsRL: 0.85) pick likelier tokens, so it reads low.
    Use :func:`entropy_from_logits` where logits are at hand."""
    return masked_mean(-logprobs.detach(), mask)


def entropy_sums(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ −logprob, token count)`` over masked tokens, detached: the parts of
    :func:`entropy_estimate` that add up across packs and ranks, so a token-weighted batch mean is one
    all-reduce of two numbers away."""
    mask = mask.to(logprobs.dtype)
    return (-logprobs.detach() * mask).sum(), mask.sum()


def dmmpt_active(entropy: float | torch.Tensor, entropy_target: float) -> bool:
    """DMMPT's on/off decision: the policy entropy is below ``entropy_target``. Taken once per update
    from the whole batch's entropy (see :class:`~mars_megatron.algorithm.objective.LossInputs`), so
    every pack and rank of that update masks alike."""
    return float(entropy) < entropy_target


def dmmpt_drop(
    logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *, prob_threshold: float
) -> torch.Tensor:
    """``mask`` without the well-mastered tokens of positively-rewarded responses (advantage > 0; with
    binary rewards exactly the correct answers of a mixed group): those the model already predicts with
    ``p > prob_threshold``. Unconditional: the entropy decision is the caller's (:func:`dmmpt_active`)."""
    adv = _per_token(advantages, logprobs)
    mastered = (adv > 0) & (logprobs.detach() > math.log(prob_threshold))
    return mask * (~mastered).to(mask.dtype)


def dmmpt_mask(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    entropy: float | torch.Tensor,
    *,
    prob_threshold: float,
    entropy_target: float,
) -> torch.Tensor:
    """DMMPT (dynamic masking of well-mastered positive tokens, UloRL): while the policy entropy is
    below ``entropy_target`` (:func:`dmmpt_active`), :func:`dmmpt_drop`; at or above the target the mask
    is returned as is. ``entropy`` is the batch's (a scalar); both thresholds are configuration
    (unpublished)."""
    if not dmmpt_active(entropy, entropy_target):
        return mask
    return dmmpt_drop(logprobs, mask, advantages, prob_threshold=prob_threshold)


# --------------------------------------------------------------------------------------- role weights
def role_weights(samples: Sequence[Sample], weights: Mapping[str, float], seq_len: int) -> torch.Tensor:
    """Per-token loss weights ``[len(samples), seq_len]``: each row is its sample's role weight
    (``weights[sample.role]``, keyed by the role names of the agent graph as in ``algorithm.role_weights``;
    1.0 for roles not listed)."""
    row = torch.tensor([float(weights.get(s.role, 1.0)) for s in samples], dtype=torch.float32)
    return row.unsqueeze(-1).expand(len(samples), seq_len).contiguous()
