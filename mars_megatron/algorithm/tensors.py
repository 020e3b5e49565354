"""The tensors the loss reads: a pack of samples as one sequence (:class:`PackedSequence`) and a
micro-batch (:class:`MicroBatch`).

Plain containers, made from samples in one direction by the trainer (:mod:`mars_megatron.training.packing`,
:mod:`mars_megatron.training.batches`); they live here, below the trainer, so the loss and the mismatch
metrics (pure maths over these tensors) need nothing from ``training/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch


@dataclass(frozen=True)
class PackedSequence:
    """One pack as a single sequence of length T (a multiple of the requested ``multiple``).

    ``tokens[0, t]`` is fed at position ``position_ids[0, t]`` and ``targets[0, t]`` is the next token of
    the same sample; ``loss_mask`` is 0 on each sample's last token and on the pad sample, so no target
    crosses a sample boundary. ``cu_seqlens`` are the segment boundaries (the pad sample, if any, is the
    last segment); ``sample_spans[j] = (start, end)`` locate sample ``sample_ids[j]`` in the pack.
    """

    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    targets: torch.Tensor  # [1, T] int64
    loss_mask: torch.Tensor  # [1, T] float32
    cu_seqlens: torch.Tensor  # [segments + 1] int32
    sample_ids: tuple[int, ...]
    sample_spans: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def attention_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """sbhd form (local attention): block-diagonal causal mask [1, 1, T, T], True = masked out
        (megatron's convention), made on ``device`` (default: the CPU).

        Built where it is used: a host-built mask is T*T booleans (64 MiB at 8k) that the CPU makes and
        copies from pageable memory once per micro-batch, a copy that waits for the stream to drain. On
        the H100 (2026-11-26) our step took 1.18x the bare loop's, which builds its masks once on the
        device; this per-pack work is the likely cause (not yet re-measured on a GPU). The pack is a
        host object, so the boundaries are read here without a device sync; the mask is one fill, one
        triangle and a block per segment (43 ms at 8k on 2 CPU cores, against 89 for the old host build).
        """
        mask = torch.ones(self.length, self.length, dtype=torch.bool, device=device).triu_(1)  # the future
        for start, end in pairwise(self.cu_seqlens.tolist()):
            mask[start:end, :start] = True  # earlier segments
        return mask[None, None]

    def packed_seq_params(self):
        """THD form (GPU, ``TEDotProductAttention``): megatron ``PackedSeqParams`` for this pack."""
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int(self.cu_seqlens.diff().max())
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )

    def unpack(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token output ``[1, T, ...]`` (or ``[T, ...]``) back into one tensor per sample."""
        rows = per_token[0] if per_token.dim() > 1 and per_token.shape[0] == 1 else per_token
        return [rows[a:b] for a, b in self.sample_spans]


@dataclass(frozen=True)
class MicroBatch:
    """``tokens[b, t]`` is fed at position t and ``targets[b, t]`` is the token that follows it;
    ``loss_mask`` marks the positions whose target is a real next token."""

    tokens: torch.Tensor  # [b, s] int64, right-padded with 0
    position_ids: torch.Tensor  # [b, s] int64
    targets: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s] float32
    lengths: tuple[int, ...]  # real lengths of the sequences in this micro-batch
    pack: PackedSequence | None = None
    """Set when the one row is a pack of several samples: where each sample sits, and its boundaries
    (the attention mask on CPU, ``PackedSeqParams`` on GPU)."""
    cp_index: torch.Tensor | None = None
    """Set on a context-parallel rank's share (:meth:`select`): the positions of the full micro-batch its
    columns are. ``lengths`` and ``pack`` still describe the full micro-batch."""
    routing: torch.Tensor | None = None
    """Experts to replay per position, ``[b, s, moe_layers, k]`` (``moe.routing_replay=R3``; see
    ``training/routing_replay.py``); None: the router chooses."""

    def select(self, index: torch.Tensor) -> MicroBatch:
        """This CP rank's columns of the micro-batch (see ``training/context_parallel.py``)."""
        if self.cp_index is not None:
            raise ValueError("micro-batch is already one context-parallel rank's share")
        return MicroBatch(
            self.tokens[:, index],
            self.position_ids[:, index],
            self.targets[:, index],
            self.loss_mask[:, index],
            self.lengths,
            self.pack,
            index,
            None if self.routing is None else self.routing[:, index],
        )

    @classmethod
    def from_pack(cls, pack: PackedSequence) -> MicroBatch:
        return cls(pack.tokens, pack.position_ids, pack.targets, pack.loss_mask, (pack.length,), pack)
