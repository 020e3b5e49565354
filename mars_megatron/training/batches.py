"""Turn token sequences into the padded micro-batches Megatron's schedules consume.

Pure: lists of token ids in, tensors out. Every micro-batch of one step shares one sequence length,
because pipeline stages exchange activations of a fixed shape; the length is rounded up to a multiple of
TP when activations are sequence-parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mars_megatron.algorithm.tensors import MicroBatch


def padded_length(seqs: Sequence[Sequence[int]], multiple: int = 1) -> int:
    longest = max(len(s) for s in seqs)
    return -(-longest // multiple) * multiple


def make_micro_batches(
    seqs: Sequence[Sequence[int]], micro_batch: int, *, multiple: int = 1, seq_length: int | None = None
) -> list[MicroBatch]:
    """Split ``seqs`` (in order) into micro-batches of ``micro_batch`` sequences, all padded to one length.

    The last micro-batch may be smaller. Sequences need at least one token; a sequence of length n has
    n-1 targets (the first token is never predicted).
    """
    if not seqs:
        raise ValueError("no sequences to batch")
    for i, s in enumerate(seqs):
        if len(s) == 0:
            raise ValueError(f"sequence {i} is empty")
    length = seq_length if seq_length is not None else padded_length(seqs, multiple)
    if length % multiple or any(len(s) > length for s in seqs):
        raise ValueError(f"seq_length {length} must be a multiple of {multiple} and fit every sequence")
    out = []
    for start in range(0, len(seqs), micro_batch):
        chunk = seqs[start : start + micro_batch]
        tokens = torch.zeros(len(chunk), length, dtype=torch.long)
        targets = torch.zeros(len(chunk), length, dtype=torch.long)
        mask = torch.zeros(len(chunk), length, dtype=torch.float32)
        for row, seq in enumerate(chunk):
            t = torch.as_tensor(list(seq), dtype=torch.long)
            tokens[row, : len(t)] = t
            targets[row, : len(t) - 1] = t[1:]
            mask[row, : len(t) - 1] = 1.0
        positions = torch.arange(length, dtype=torch.long).unsqueeze(0).expand(len(chunk), -1).contiguous()
        out.append(MicroBatch(tokens, positions, targets, mask, tuple(len(s) for s in chunk)))
    return out
