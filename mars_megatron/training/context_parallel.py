"""Context parallelism (``parallel.cp``): which tokens of a sequence each CP rank holds, putting per-token
outputs back together, and attention across CP ranks for the local (CPU) layer spec.

Why split a sequence at all: MarsRL packs run to 98k tokens, and one rank's activations for that do not
fit next to a 30B model; CP gives each rank ``1/cp`` of every pack (the weights are replicated, like DP).

Load balancing (Megatron's layout): a sequence of length ``L`` (a multiple of ``2*cp``) is cut into
``2*cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2*cp-1-r``. Under causal attention early
chunks are cheap and late ones dear, so every rank gets the same work. Two forms of one rule:

* **rows** (``zigzag_index``): chunks of the whole row. Used for sbhd batches and for packs on CPU, where
  megatron's RoPE slices its position table exactly this way (``get_pos_emb_on_this_cp_rank``).
* **samples** (``thd_index``): chunks of every sample of a THD pack, each sample padded to a multiple of
  ``2*cp``. Transformer Engine's ring attention and megatron's THD RoPE work per sample
  (``thd_get_partitioned_indices`` in TE computes the same indices).

The local spec's ``DotProductAttention`` refuses CP (megatron leaves CP to TE), so
:class:`AllGatherCPAttention` adds it: every rank all-gathers the keys and values of its CP group (TE's
``cp_comm_type="all_gather"``) and attends its own queries to them under a mask whose columns follow the
gathered order. Memory is the full sequence's K/V per rank; that is the CPU path, meant for correctness
and tests, while GPUs run TE's ring (p2p) attention.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.comm import collectives


def zigzag_index(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions ``[L/cp]`` of a row of ``length`` tokens that CP ``rank`` holds: chunks ``rank`` and
    ``2*cp-1-rank`` of ``2*cp``."""
    _check(cp, rank)
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2*cp = {2 * cp} chunks")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def thd_index(cu_seqlens: Sequence[int] | torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions of a THD pack that CP ``rank`` holds: :func:`zigzag_index` of every sample (segment
    ``[cu[i], cu[i+1])``), in pack order. Every segment must be a multiple of ``2*cp`` long."""
    _check(cp, rank)
    bounds = [int(x) for x in cu_seqlens]
    parts = []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        if (end - start) % (2 * cp):
            raise ValueError(
                f"segment {i} of the pack is {end - start} tokens, not a multiple of 2*cp = {2 * cp}"
            )
        parts.append(start + zigzag_index(end - start, cp, rank))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _check(cp: int, rank: int) -> None:
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} out of range for cp = {cp}")


def rank_indices(
    length: int, cp: int, *, cu_seqlens: Sequence[int] | torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Every CP rank's positions: per sample when ``cu_seqlens`` is given (THD), else per row."""
    if cu_seqlens is not None:
        return [thd_index(cu_seqlens, cp, r) for r in range(cp)]
    return [zigzag_index(length, cp, r) for r in range(cp)]


def local_mask(mask: torch.Tensor, indices: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """Rows of a full ``[b, 1, L, L]`` attention mask for this rank's queries, with its columns in the
    order :class:`AllGatherCPAttention` gathers keys (rank 0's positions, then rank 1's, ...)."""
    keys = torch.cat(list(indices))
    return mask[:, :, indices[rank]][:, :, :, keys]


def gather_positions(
    local: torch.Tensor, indices: Sequence[torch.Tensor], length: int, group: Any
) -> torch.Tensor:
    """Per-token outputs ``[b, L/cp]`` of every CP rank put back in sequence order ``[b, L]`` (no grad:
    for log-probs that are only read, such as the old policy's)."""
    parts = collectives.all_gather(local, group)
    full = local.new_zeros(local.shape[0], length, *local.shape[2:])
    for idx, part in zip(indices, parts, strict=True):
        full[:, idx.to(local.device)] = part
    return full


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward sums every rank's gradient of the gathered
    tensor and keeps this rank's slice (all-reduce then slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.n = x.shape[0]
        return torch.cat(collectives.all_gather(x, group), dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = collectives.all_reduce(grad.contiguous(), group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _GatherSequence.apply(x, group)


def _attention_base() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def cp_attention_class() -> type:
    """:class:`AllGatherCPAttention` (built lazily: it subclasses a megatron class)."""
    global _CP_ATTENTION
    if _CP_ATTENTION is None:
        base = _attention_base()

        class AllGatherCPAttention(base):  # type: ignore[misc, valid-type]
            """Megatron's local ``DotProductAttention`` over keys/values all-gathered from the CP group.

            The mask must already be this rank's rows with gathered columns (:func:`local_mask`): the
            engine knows where every rank's tokens sit (rows or samples), the attention does not."""

            def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
                import copy

                self.cp_size = config.context_parallel_size
                # The parent refuses cp > 1 (it leaves CP to TE); it computes one rank's attention
                # correctly once keys and values are gathered, so it is built as if cp were 1.
                single = copy.copy(config)
                single.context_parallel_size = 1
                super().__init__(single, *args, **kwargs)
                self.config = config

            def forward(  # type: ignore[override]
                self,
                query: torch.Tensor,
                key: torch.Tensor,
                value: torch.Tensor,
                attention_mask: torch.Tensor | None,
                attn_mask_type: Any = None,
                attention_bias: Any = None,
                packed_seq_params: Any = None,
            ) -> torch.Tensor:
                from megatron.core import parallel_state as ps

                if self.cp_size > 1:
                    if attention_mask is None:
                        raise ValueError(
                            "context parallelism on the local spec needs an explicit attention mask "
                            "(this rank's rows, gathered key order)"
                        )
                    group = ps.get_context_parallel_group()
                    key = gather_sequence(key, group)
                    value = gather_sequence(value, group)
                return super().forward(
                    query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
                )

        _CP_ATTENTION = AllGatherCPAttention
    return _CP_ATTENTION


_CP_ATTENTION: type | None = None
