"""Per-token log-probabilities from vocab-parallel logits, without ever gathering the vocabulary.

Each TP rank holds a slice of the (padded) vocabulary. The padding rows are not real tokens: their logits
are masked to -inf so that the softmax normalises over the HF vocabulary only, which is what makes the
log-probs equal to ``transformers``' for the same checkpoint. One autograd function serves scoring and the
policy-gradient loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.comm import collectives

CHUNK_TOKENS = 1024
"""Tokens whose fp32 logits are materialised at once: bounds the temporaries to a few
``CHUNK_TOKENS x V_local x 4`` bytes whatever the pack length (under 1 GiB for Qwen3's vocabulary at tp 2)."""


class _VocabParallelLogprob(torch.autograd.Function):
    """log p(target) over a vocab-parallel slice, keeping nothing per logit but the logits themselves.

    Why a hand-written backward: autograd through ``log_softmax`` keeps an fp32 copy of the logits, the
    shifted logits and their exponentials, ~14 bytes per logit; at 98k-token packs and Qwen3's 152k
    vocabulary that is tens of GiB per GPU. Here forward works in chunks of :data:`CHUNK_TOKENS` tokens
    and saves only the (bf16) logits and two numbers per token (the global max and sum of exponentials);
    backward recomputes the softmax chunk by chunk: d logp / d z_j = [j = target] − softmax_j, where the
    softmax uses the global statistics, so no collective is needed in backward.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, group: Any
    ) -> torch.Tensor:
        tp = 1 if group is None else dist.get_world_size(group)
        shape = targets.shape
        local = logits.shape[-1]
        flat = logits.reshape(-1, local)
        tgt = targets.reshape(-1) - vocab_start
        in_range = (tgt >= 0) & (tgt < local)
        tgt = tgt.clamp(0, local - 1)
        pad_from = max(0, vocab_size - vocab_start)  # local ids at or above are vocabulary padding
        n = flat.shape[0]
        lmax = torch.empty(n, dtype=torch.float32, device=flat.device)
        for i in range(0, n, CHUNK_TOKENS):
            lmax[i : i + CHUNK_TOKENS] = _masked(flat[i : i + CHUNK_TOKENS], pad_from).max(dim=-1).values
        if tp > 1:
            lmax = collectives.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        sum_exp = torch.empty_like(lmax)
        picked = torch.empty_like(lmax)
        for i in range(0, n, CHUNK_TOKENS):
            z = _masked(flat[i : i + CHUNK_TOKENS], pad_from) - lmax[i : i + CHUNK_TOKENS, None]
            sum_exp[i : i + CHUNK_TOKENS] = z.exp().sum(dim=-1)
            picked[i : i + CHUNK_TOKENS] = z.gather(-1, tgt[i : i + CHUNK_TOKENS, None])[:, 0]
        picked = torch.where(in_range, picked, torch.zeros_like(picked))
        if tp > 1:
            sum_exp = collectives.all_reduce(sum_exp, group=group)
            picked = collectives.all_reduce(picked, group=group)
        log_sum = sum_exp.log()
        ctx.save_for_backward(logits, tgt, in_range, lmax, log_sum)
        ctx.pad_from = pad_from
        return (picked - log_sum).reshape(shape)  # in the shifted domain: exact for large logits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        logits, tgt, in_range, lmax, log_sum = ctx.saved_tensors
        local = logits.shape[-1]
        flat = logits.reshape(-1, local)
        g = grad.reshape(-1).float()
        out = torch.empty_like(flat)
        for i in range(0, flat.shape[0], CHUNK_TOKENS):
            rows = slice(i, i + CHUNK_TOKENS)
            soft = ((_masked(flat[rows], ctx.pad_from) - lmax[rows, None]) - log_sum[rows, None]).exp()
            d = -g[rows, None] * soft
            onehot = torch.where(in_range[rows], g[rows], torch.zeros_like(g[rows]))
            d.scatter_add_(-1, tgt[rows, None], onehot[:, None])
            out[rows] = d.to(out.dtype)
        return out.reshape(logits.shape), None, None, None, None


def _masked(chunk: torch.Tensor, pad_from: int) -> torch.Tensor:
    """fp32 logits with vocabulary padding at -inf (excluded from the softmax)."""
    z = chunk.float()
    if pad_from < z.shape[-1]:
        z[:, pad_from:] = float("-inf")
    return z


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
    group (``None`` or a group of size 1 means the logits hold the whole vocabulary). Float32 results;
    differentiable with respect to ``logits``.
    """
    return _VocabParallelLogprob.apply(logits, targets, vocab_start, vocab_size, group)
