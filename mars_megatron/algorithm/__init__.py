"""MarsRL's algorithm core: the sample record, GRPO advantages and the policy loss (pure; torch only)."""

from mars_megatron.agents.sample import Sample, Segment
from mars_megatron.algorithm.advantages import assign_advantages, grpo_advantages, zero_variance_groups
from mars_megatron.algorithm.losses import (
    KL_CLAMP,
    clipped_surrogate,
    dmmpt_active,
    dmmpt_drop,
    dmmpt_mask,
    entropy_estimate,
    entropy_from_logits,
    entropy_sums,
    kl_penalty,
    kl_per_token,
    pois_old_logprobs,
    policy_loss,
    role_weights,
    tis_weights,
)
from mars_megatron.algorithm.objective import (
    LossInputs,
    compute_loss,
    loss_inputs,
    make_loss_fn,
    packed_loss_inputs,
    response_tensor,
)

__all__ = [
    "KL_CLAMP",
    "LossInputs",
    "Sample",
    "Segment",
    "assign_advantages",
    "clipped_surrogate",
    "compute_loss",
    "dmmpt_active",
    "dmmpt_drop",
    "dmmpt_mask",
    "entropy_estimate",
    "entropy_from_logits",
    "entropy_sums",
    "grpo_advantages",
    "kl_penalty",
    "kl_per_token",
    "loss_inputs",
    "make_loss_fn",
    "packed_loss_inputs",
    "pois_old_logprobs",
    "policy_loss",
    "response_tensor",
    "role_weights",
    "tis_weights",
    "zero_variance_groups",
]
