"""Per-token log-probabilities from vocab-parallel logits, without ever gathering the vocabulary.

Each TP rank holds a slice of the (padded) vocabulary. The padding rows are not real tokens: their logits
are masked to -inf so that the softmax normalises over the HF vocabulary only, which is what makes the
log-probs equal to ``transformers``' for the same checkpoint. The all-reduces are autograd-aware, so the
same function serves scoring and the policy-gradient loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in forward; the gradient of a sum w.r.t. each term is the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Any = None,
) -> torch.Tensor:
    """log p(targets) from logits ``[..., V_local]`` holding ids ``[vocab_start, vocab_start+V_local)``.

    ``vocab_size`` is the true (unpadded) vocabulary; ids at or above it are excluded. ``group`` is the TP
    group (``None`` or a group of size 1 means the logits hold the whole vocabulary).
    """
    tp = 1 if group is None else dist.get_world_size(group)
    logits = logits.float()
    local = logits.shape[-1]
    if vocab_start + local > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + local, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    # The max only stabilises exp(); log-softmax is invariant to it, so it carries no gradient.
    lmax = logits.detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - lmax.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    local_targets = targets - vocab_start
    in_range = (local_targets >= 0) & (local_targets < local)
    picked = shifted.gather(-1, local_targets.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(in_range, picked, torch.zeros_like(picked))
    if tp > 1:
        sum_exp = _AllReduceSum.apply(sum_exp, group)
        picked = _AllReduceSum.apply(picked, group)
    return picked - sum_exp.log()
