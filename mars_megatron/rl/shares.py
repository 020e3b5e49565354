"""A rollout batch cut into each data-parallel rank's share on the driver, before anything is sent.

Why: at MarsRL's scale a batch is thousands of samples of tens of thousands of tokens, with R3's routing
arrays beside them (gigabytes). When every trainer rank received the whole batch and planned the same
packs before keeping its part, each rank paid DP times its share in transfer, deserialisation and
memory, and the plan was made DP times. Here the driver splits the batch into the updates' mini-batches
(whole GRPO groups), plans each mini-batch's packs once with the trainer's :class:`PackSpec`, and
sends data-parallel rank ``r`` only the samples of its packs (the TP/PP/CP ranks of one replica get the
same share). What a rank still learns about the whole batch is small and fixed per sample: each sample's
role (the mismatch metrics are summed per role over all ranks, and MIS decides on whole sequences), how
many samples were truncated, and whether any sample carries the engine's log-probs.

Indices stay the mini-batch's: a share's packs name samples by their index in the mini-batch, and
``share[i]`` is that sample, so the per-sequence sums the ranks all-reduce line up as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from mars_megatron.agents.sample import Sample
from mars_megatron.training.packing import PackSpec


def split_groups(samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
    """``parts`` mini-batches of whole GRPO groups, in order, with about equal sample counts."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    target = len(samples) / parts
    out: list[list[Sample]] = [[]]
    for members in groups.values():
        if out[-1] and len(out) < parts and len(out[-1]) + len(members) / 2 > target:
            out.append([])
        out[-1].extend(members)
    return [mb for mb in out if mb]


@dataclass(frozen=True)
class MiniBatchShare:
    """One update's mini-batch as one data-parallel rank holds it: its packs and their samples."""

    roles: tuple[str, ...]
    """Every sample's role, by index in the mini-batch (the mismatch metrics sum per role over ranks)."""
    samples: Mapping[int, Sample]
    """This rank's samples, by index in the mini-batch."""
    packs: tuple[tuple[int, ...], ...]
    """This rank's packs, each the indices of its samples in placement order; empty: a padding pack."""
    capacity: int
    """The pack length: every pack is padded to it, and longer samples are cut to it."""
    sample_multiple: int = 1
    truncated: int = 0
    """Samples of the whole mini-batch cut to the capacity (for the metrics)."""

    def __post_init__(self) -> None:
        placed = sorted(i for pack in self.packs for i in pack)
        if placed != sorted(self.samples):
            raise ValueError(
                f"a share's packs place samples {placed[:8]}, it holds {sorted(self.samples)[:8]}"
            )
        if placed and not 0 <= placed[0] <= placed[-1] < len(self.roles):
            raise ValueError(f"a share's packs name samples outside its mini-batch of {len(self.roles)}")

    def __len__(self) -> int:
        """Samples in the whole mini-batch (the per-sequence sums are this long on every rank)."""
        return len(self.roles)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]

    def own(self) -> Iterator[Sample]:
        """This rank's samples, in index order."""
        return (self.samples[i] for i in sorted(self.samples))


@dataclass(frozen=True)
class BatchShare:
    """One policy's rollout batch as one data-parallel rank holds it: a share per update."""

    minis: tuple[MiniBatchShare, ...]
    engine_logprobs: bool
    """Some sample of the whole batch carries the engine's log-probs (the mismatch can be measured)."""

    def own(self) -> list[Sample]:
        """This rank's samples of every mini-batch."""
        return [s for mini in self.minis for s in mini.own()]


def shard_batch(
    samples: Sequence[Sample], spec: PackSpec, pack_length: int, updates: int
) -> list[BatchShare]:
    """``samples`` (one policy's batch) as ``spec.dp`` shares, one per data-parallel rank: ``updates``
    mini-batches of whole groups, each planned once (:meth:`PackSpec.plan`)."""
    if not samples:
        raise ValueError("shard_batch: an empty batch has no shares (leave the policy out of the update)")
    per_rank: list[list[MiniBatchShare]] = [[] for _ in range(spec.dp)]
    for mini in split_groups(samples, updates):
        plan = spec.plan([s.length for s in mini], pack_length)
        roles = tuple(s.role for s in mini)
        for rank, pack_ids in enumerate(plan.rank_packs):
            packs = tuple(plan.packs[k] for k in pack_ids)
            per_rank[rank].append(
                MiniBatchShare(
                    roles=roles,
                    samples={i: mini[i] for pack in packs for i in pack},
                    packs=packs,
                    capacity=plan.capacity,
                    sample_multiple=plan.sample_multiple,
                    truncated=len(plan.truncated),
                )
            )
    engine_logprobs = any(s.behaviour_logprobs is not None for s in samples)
    return [BatchShare(tuple(minis), engine_logprobs) for minis in per_rank]
