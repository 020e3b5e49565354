"""Sequence packing: variable-length samples into fixed-capacity packs, spread over data-parallel ranks.

Pure: lengths in, a :class:`PackPlan` out (plain Python, no torch); torch only to materialise one pack as
tensors (:func:`build_pack`: an :class:`~mars_megatron.algorithm.tensors.PackedSequence`).

Planning (``plan_packs``):

1. Samples longer than the capacity are truncated to it (their first ``capacity`` tokens are kept) and
   get a pack of their own; ``PackPlan.truncated`` lists them.
2. Best-fit decreasing puts every other sample in the fullest pack it still fits in.
   Then, above ceil(total/capacity) + 1 packs, the least-full pack is emptied into the others' room,
   with sample moves/swaps between packs to make room (``_repack``).
3. Packs go to ``dp`` ranks: largest pack first to the least-loaded rank, then samples are moved or
   swapped between the busiest rank and the others (never over the capacity) until the busiest rank is
   within ``balance_tolerance`` of the mean token load, or nothing improves it.

When the pack count does not divide ``dp``, ranks hold different numbers of packs (they differ by about
one). Megatron needs every DP rank to run the same number of micro-batches: ``pad_ranks=True`` appends
empty packs to the short ranks (``PackPlan.num_padding_packs`` counts them; each is one all-pad micro-batch).

Worked example: lengths ``[5, 3, 9, 2]``, capacity 8 -> sample 2 is truncated to 8 (``truncated == (2,)``)
and packed alone; the others fill packs ``(0, 1)`` (8 tokens) and ``(3,)``: 3 packs, the lower bound.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from mars_megatron.algorithm.tensors import PackedSequence


# ------------------------------------------------------------------------------------------------ planning
@dataclass(frozen=True)
class PackPlan:
    """``packs[k]`` are the sample indices in pack k (in order of placement); ``rank_packs[r]`` are the
    pack indices rank r trains on. ``packed_lengths[i]`` is sample i's length after truncation.
    Padding packs (``pad_ranks``) are the last ``num_padding_packs`` entries of ``packs`` and are empty."""

    capacity: int
    lengths: tuple[int, ...]
    packed_lengths: tuple[int, ...]
    packs: tuple[tuple[int, ...], ...]
    rank_packs: tuple[tuple[int, ...], ...]
    truncated: tuple[int, ...] = ()
    num_padding_packs: int = 0
    sample_multiple: int = 1
    """Every sample's room in a pack is its length rounded up to this (THD under context parallelism)."""
    pack_loads: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.lengths)
        seen = sorted(i for p in self.packs for i in p)
        assert seen == list(range(n)), "every sample must be in exactly one pack"
        loads = tuple(sum(self.packed_lengths[i] for i in p) for p in self.packs)
        assert all(load <= self.capacity for load in loads), "a pack is over the capacity"
        assert self.packed_lengths == _room(self.lengths, self.capacity, self.sample_multiple)
        assert self.truncated == tuple(i for i, x in enumerate(self.lengths) if x > self.capacity)
        for i in self.truncated:
            assert any(p == (i,) for p in self.packs), f"truncated sample {i} must be packed alone"
        ranked = sorted(k for r in self.rank_packs for k in r)
        assert ranked == list(range(len(self.packs))), "every pack must go to exactly one rank"
        empty = sum(1 for p in self.packs[len(self.packs) - self.num_padding_packs :] if not p)
        assert empty == self.num_padding_packs, "padding packs must be the empty last packs"
        object.__setattr__(self, "pack_loads", loads)

    @property
    def dp(self) -> int:
        return len(self.rank_packs)

    @property
    def num_packs(self) -> int:
        """Packs holding samples (padding packs not counted)."""
        return len(self.packs) - self.num_padding_packs

    @property
    def total_tokens(self) -> int:
        return sum(self.packed_lengths)

    @property
    def lower_bound(self) -> int:
        """No plan can use fewer packs: ceil(total tokens / capacity)."""
        return -(-self.total_tokens // self.capacity)

    @property
    def fill_ratio(self) -> float:
        """Tokens over the capacity of the non-padding packs."""
        return self.total_tokens / (self.capacity * max(self.num_packs, 1))

    @property
    def rank_loads(self) -> tuple[int, ...]:
        return tuple(sum(self.pack_loads[k] for k in r) for r in self.rank_packs)

    @property
    def balance(self) -> float:
        """Busiest rank's token load over the mean (1.0 is perfect)."""
        loads = self.rank_loads
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0


def _room(lengths: Sequence[int], capacity: int, multiple: int) -> tuple[int, ...]:
    """Tokens each sample takes in a pack: truncated to the capacity, rounded up to ``multiple``."""
    return tuple(min(-(-x // multiple) * multiple, capacity) for x in lengths)


def bin_pack(lengths: Sequence[int], capacity: int, algorithm: str = "bfd") -> list[list[int]]:
    """Bins of sample indices, each summing to at most ``capacity`` (lengths must already be ≤ capacity).

    ``bfd``: best-fit decreasing (ours); ``ffd``: first-fit decreasing; ``ff``: first fit in arrival order.
    """
    if any(x > capacity or x < 0 for x in lengths):
        raise ValueError("lengths must be in [0, capacity]; truncate first")
    if algorithm == "bfd":
        return _best_fit_decreasing(lengths, capacity)
    if algorithm in ("ffd", "ff"):
        order = range(len(lengths))
        if algorithm == "ffd":
            order = sorted(order, key=lambda i: -lengths[i])
        bins: list[list[int]] = []
        free: list[int] = []
        for i in order:
            for b, f in enumerate(free):
                if lengths[i] <= f:
                    bins[b].append(i)
                    free[b] -= lengths[i]
                    break
            else:
                bins.append([i])
                free.append(capacity - lengths[i])
        return bins
    raise ValueError(f"unknown bin-packing algorithm {algorithm!r}; use bfd, ffd or ff")


def _best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """One pack at a time: open it with the longest sample left, add the longest samples that fit, and
    close it with the pair of samples that best fills the room left once a single sample no longer
    leaves room for another (a light form of minimum-bin-slack packing)."""
    pool = sorted((x, i) for i, x in enumerate(lengths))  # remaining samples, ascending
    bins: list[list[int]] = []
    while pool:
        x, i = pool.pop()
        room = capacity - x
        pack = [i]
        while pool and pool[0][0] <= room:
            j = bisect.bisect_right(pool, (room, len(lengths))) - 1  # longest that fits
            single = pool[j][0]
            if room - single >= pool[0][0] and j > 0:
                x, i = pool.pop(j)
                pack.append(i)
                room -= x
                continue
            pair = _best_pair(pool, room, j)
            if pair is not None and pool[pair[0]][0] + pool[pair[1]][0] > single:
                a, b = pair  # a > b: pop the later index first
                pack += [pool.pop(a)[1], pool.pop(b)[1]]
            else:
                pack.append(pool.pop(j)[1])
            break
        bins.append(pack)
    return bins


def _best_pair(pool: list[tuple[int, int]], room: int, top: int, tries: int = 48) -> tuple[int, int] | None:
    """Indices (a > b) of two samples of ``pool`` (ascending) with the largest sum <= room."""
    best, best_sum = None, 0
    for a in range(top, max(top - tries, 0), -1):
        xa = pool[a][0]
        if 2 * xa < best_sum:
            break
        b = min(bisect.bisect_right(pool, (room - xa, 1 << 62)) - 1, a - 1)
        if b >= 0 and xa + pool[b][0] > best_sum:
            best, best_sum = (a, b), xa + pool[b][0]
            if best_sum == room:
                break
    return best


class Exchange(NamedTuple):
    """A move between two packs: sample ``out`` leaves pack ``source`` for pack ``target`` and, unless
    ``back`` is -1, sample ``back`` of ``target`` returns to ``source``. ``score`` ranks candidates: the room
    left in ``source`` after it takes the pending sample (:meth:`_Room.make_room`, lower is tighter) or the
    room ``source`` has after the exchange (:meth:`_Room.grow_room`, higher is better)."""

    score: int
    out: int
    source: int
    back: int
    target: int


def _exchange(
    packs: list[list[int]], pack_of: list[int], free: list[int], lengths: Sequence[int], move: Exchange
) -> None:
    """Carry out ``move``: its ``out`` sample to the target pack, its ``back`` sample (if any) home."""
    out, source, back, target = move.out, move.source, move.back, move.target
    packs[source].remove(out)
    packs[target].append(out)
    pack_of[out] = target
    free[source] += lengths[out]
    free[target] -= lengths[out]
    if back >= 0:
        packs[target].remove(back)
        packs[source].append(back)
        pack_of[back] = source
        free[target] += lengths[back]
        free[source] -= lengths[back]


def _place_longest_pending(
    pending: list[tuple[int, int]], packs: list[list[int]], pack_of: list[int], free: list[int], k: int
) -> None:
    """Move the longest pending sample into pack ``k``, which has room for it."""
    x, i = pending.pop()
    packs[k].append(i)
    pack_of[i] = k
    free[k] -= x


@dataclass
class _Room:
    """Packs being rearranged while one pack is emptied: their members, their free room, and the pack of
    every sample (-1: the sample is pending, not in any pack)."""

    packs: list[list[int]]
    free: list[int]
    pack_of: list[int]
    lengths: Sequence[int]
    order: list[tuple[int, int]]
    """``(length, index)`` of every sample, ascending."""

    @classmethod
    def without(cls, bins: list[list[int]], victim: int, lengths: Sequence[int], capacity: int) -> _Room:
        """The packs of ``bins`` but ``victim``."""
        loads = [sum(lengths[i] for i in b) for b in bins]
        packs = [list(b) for k, b in enumerate(bins) if k != victim]
        free = [capacity - loads[k] for k in range(len(bins)) if k != victim]
        pack_of = [-1] * len(lengths)
        for k, b in enumerate(packs):
            for i in b:
                pack_of[i] = k
        return cls(packs, free, pack_of, lengths, sorted((lengths[i], i) for i in range(len(lengths))))

    def make_room(self, x: int, by_free: list[int]) -> Exchange | None:
        """An exchange that leaves a pack (its ``source``) room for a sample of length ``x``: a sample of
        it into the room of the ``target`` pack and, optionally, a shorter sample of the target back. The
        tightest fit first (a leftover shorter than the shortest sample is as tight as it gets); its
        ``score`` is the room left after the pending sample goes in."""
        n, order, free = len(self.lengths), self.order, self.free
        good = order[0][0]
        fmax = free[by_free[0]]
        best: Exchange | None = None
        for target in by_free[:16]:
            target_free = free[target]
            if target_free + fmax < x:
                break
            for back_len, back in [(0, -1)] + [(self.lengths[j], j) for j in self.packs[target]]:
                lo = bisect.bisect_left(order, (back_len + x - fmax, -1))
                hi = bisect.bisect_right(order, (back_len + target_free, n))
                for out_len, out in order[lo:hi]:
                    source = self.pack_of[out]
                    if source < 0 or source == target:
                        continue
                    left = free[source] + out_len - back_len - x
                    if left >= 0 and (best is None or left < best.score):
                        best = Exchange(left, out, source, back, target)
                        if left < good:
                            break
                if best is not None and best.score < good:
                    break
            if best is not None and best.score < good:
                break
        return best

    def grow_room(self, anchor: int, by_free: list[int]) -> Exchange | None:
        """Consolidate: the exchange that most grows the free room of one pack (its ``source``: the
        ``anchor``, or one of the emptiest packs), scored by that room after it; None when none grows
        it."""
        order, free, lengths = self.order, self.free, self.lengths
        fmax = free[by_free[0]]
        best: Exchange | None = None
        for source in [anchor] if anchor >= 0 else by_free[:8]:
            for out in self.packs[source]:
                out_len = lengths[out]
                lo = bisect.bisect_left(order, (out_len - fmax, -1))
                hi = bisect.bisect_left(order, (out_len, -1))
                for back_len, back in order[lo:hi]:  # swap out for a shorter sample of another pack
                    target = self.pack_of[back]
                    if target < 0 or target == source:
                        continue
                    d = out_len - back_len
                    if d <= free[target]:
                        gain = free[source] + d
                        if best is None or gain > best.score:
                            best = Exchange(gain, out, source, back, target)
                for target in by_free[:4]:  # plain moves of out
                    if target != source and free[target] >= out_len:
                        gain = free[source] + out_len
                        if best is None or gain > best.score:
                            best = Exchange(gain, out, source, -1, target)
        if best is None or best.score <= free[best.source]:
            return None
        return best

    def displace(self, pending: list[tuple[int, int]], x: int, fmax: int) -> bool:
        """Chain: the longest pending sample (length ``x``) takes the place of the shortest sample of a
        pack whose room then fits it; that sample becomes pending. False when no pack can take it."""
        order, free, lengths = self.order, self.free, self.lengths
        lo = bisect.bisect_left(order, (x - fmax, -1))
        hi = bisect.bisect_left(order, (x, -1))
        best = None
        for a_len, a in order[lo:hi]:
            k = self.pack_of[a]
            if k < 0 or a_len + free[k] < x:
                continue
            if best is None or a_len < lengths[best[0]]:
                best = (a, k)
        if best is None:
            return False
        a, k = best
        _, i = pending.pop()
        self.packs[k].remove(a)
        self.packs[k].append(i)
        self.pack_of[i] = k
        self.pack_of[a] = -1
        free[k] -= x - lengths[a]
        bisect.insort(pending, (lengths[a], a))
        return True


def _empty_pack(room: _Room, pending: list[tuple[int, int]], max_steps: int) -> bool:
    """Place the ``pending`` samples (ascending) into ``room``'s packs in at most ``max_steps`` steps,
    rearranging them as :func:`_repack` describes; True when every sample found a place."""
    steps = 0
    anchor = -1
    free = room.free
    while pending and steps < max_steps:
        steps += 1
        x, _ = pending[-1]
        fit = min(((f, k) for k, f in enumerate(free) if f >= x), default=None)
        if fit is not None:
            _place_longest_pending(pending, room.packs, room.pack_of, free, fit[1])
            anchor = -1
            continue
        by_free = sorted(range(len(free)), key=lambda k: (-free[k], k))
        made = room.make_room(x, by_free) if anchor < 0 else None
        if made is not None:
            _exchange(room.packs, room.pack_of, free, room.lengths, made)
            _place_longest_pending(pending, room.packs, room.pack_of, free, made.source)
            anchor = -1
            continue
        grown = room.grow_room(anchor, by_free)
        if grown is not None:
            _exchange(room.packs, room.pack_of, free, room.lengths, grown)
            anchor = grown.source
            continue
        if not room.displace(pending, x, free[by_free[0]]):
            break
        anchor = -1
    return not pending


def _repack(
    bins: list[list[int]], lengths: Sequence[int], capacity: int, target: int, max_steps: int = 64
) -> list[list[int]]:
    """Empty the least-full pack (at most twice) until at most ``target`` packs remain.

    Its samples, longest first, go to the pack with the least room that fits them; failing that, room is
    made in a pack A by a move or swap with another pack B (a sample of A into B's room, a shorter one
    of B back), the tightest such fit first; failing that, A's room is grown one move/swap at a time;
    failing that, the sample displaces a shorter sample of a pack with enough room, which is placed
    next. At most ``max_steps`` steps per emptied pack; if samples remain, the bins come back unchanged.
    """
    for _ in range(2):
        if len(bins) <= target:
            return bins
        loads = [sum(lengths[i] for i in b) for b in bins]
        victim = min(range(len(bins)), key=lambda k: (loads[k], k))
        room = _Room.without(bins, victim, lengths, capacity)
        pending = sorted((lengths[i], i) for i in bins[victim])
        if not _empty_pack(room, pending, max_steps):
            return bins
        bins = room.packs
    return bins


def plan_packs(
    lengths: Sequence[int],
    capacity: int,
    dp: int = 1,
    *,
    pad_ranks: bool = False,
    balance_tolerance: float = 0.005,
    algorithm: str = "bfd",
    rebalance: bool = True,
    sample_multiple: int = 1,
) -> PackPlan:
    """Pack samples of ``lengths`` tokens into packs of at most ``capacity`` tokens over ``dp`` ranks.

    ``sample_multiple``: each sample takes its length rounded up to this (padding it so that context
    parallelism can cut every sample into 2*cp chunks); the capacity must be a multiple of it.
    ``balance_tolerance``: stop rebalancing once the busiest rank is within this fraction of the mean.
    ``algorithm``/``rebalance`` exist to compare against simpler planners (see ``tools/bench/packing.py``).
    Deterministic: the same arguments give the same plan.
    """
    if capacity <= 0 or dp <= 0:
        raise ValueError(f"capacity ({capacity}) and dp ({dp}) must be positive")
    if any(x <= 0 for x in lengths):
        raise ValueError("every sample needs at least one token")
    if sample_multiple <= 0 or capacity % sample_multiple:
        raise ValueError(f"capacity ({capacity}) must be a multiple of sample_multiple ({sample_multiple})")
    packed = _room(lengths, capacity, sample_multiple)
    truncated = tuple(i for i, x in enumerate(lengths) if x > capacity)
    rest = [i for i, x in enumerate(lengths) if x <= capacity]
    bins = [[i] for i in truncated]
    rest_lengths = [packed[i] for i in rest]
    rest_bins = bin_pack(rest_lengths, capacity, algorithm)
    if algorithm == "bfd" and rest:
        rest_bins = _repack(rest_bins, rest_lengths, capacity, -(-sum(rest_lengths) // capacity) + 1)
    bins += [[rest[j] for j in b] for b in rest_bins]
    ranks = _assign_ranks([sum(packed[i] for i in b) for b in bins], dp)
    if rebalance and dp > 1:
        _rebalance(bins, ranks, packed, capacity, balance_tolerance)
    padding = 0
    if pad_ranks:
        most = max(len(r) for r in ranks)
        for r in ranks:
            while len(r) < most:
                r.append(len(bins))
                bins.append([])
                padding += 1
    return PackPlan(
        capacity=capacity,
        lengths=tuple(lengths),
        packed_lengths=packed,
        packs=tuple(tuple(b) for b in bins),
        rank_packs=tuple(tuple(r) for r in ranks),
        truncated=truncated,
        num_padding_packs=padding,
        sample_multiple=sample_multiple,
    )


def _assign_ranks(loads: Sequence[int], dp: int) -> list[list[int]]:
    """Largest pack first to the least-loaded rank (ties: fewer packs, then lower rank)."""
    heap = [(0, 0, r) for r in range(dp)]
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for k in sorted(range(len(loads)), key=lambda k: (-loads[k], k)):
        load, count, r = heapq.heappop(heap)
        ranks[r].append(k)
        heapq.heappush(heap, (load + loads[k], count + 1, r))
    for r in ranks:
        r.sort()
    return ranks


def _rebalance(
    bins: list[list[int]],
    ranks: list[list[int]],
    lengths: Sequence[int],
    capacity: int,
    tolerance: float,
    max_steps: int = 32,
) -> None:
    """Move tokens off the busiest rank, one sample move or swap at a time, never over the capacity.

    Each step moves ``x`` tokens from the busiest rank B to another rank R (0 < x < load_B - load_R, so
    the pair's maximum drops): a sample of B into a pack of R with room for it, or a sample of B swapped
    with a shorter one of R whose pack has room for the difference. ``x`` is chosen closest to the
    amount that would bring B down to the mean without pushing R above it. Only the two least-loaded
    ranks are tried as R, for at most ``max_steps`` steps (planning time stays in milliseconds).
    """
    pack_load = [sum(lengths[i] for i in b) for b in bins]
    rank_load = [sum(pack_load[k] for k in r) for r in ranks]
    mean = sum(rank_load) / len(ranks)
    for _ in range(max_steps):
        busiest = max(range(len(ranks)), key=lambda r: (rank_load[r], -r))
        if rank_load[busiest] <= mean * (1 + tolerance):
            return
        # B's samples sorted by length: (length, sample, pack)
        mine = sorted((lengths[i], i, k) for k in ranks[busiest] for i in bins[k])
        best: tuple[float, int, int, int, int, int] | None = None  # (score, x, s, p, t, q); t=-1: move
        for other in sorted(range(len(ranks)), key=lambda r: rank_load[r])[:2]:
            gap = rank_load[busiest] - rank_load[other]
            if gap <= 1:
                break
            want = min(rank_load[busiest] - mean, mean - rank_load[other], gap / 2)
            want = max(want, 1.0)
            for q in ranks[other]:
                free = capacity - pack_load[q]
                for t in [-1, *bins[q]]:
                    lt = 0 if t < 0 else lengths[t]
                    hi = lt + min(free, gap - 1)  # s must be in (lt, hi]
                    j = bisect.bisect_left(mine, (lt + want,))
                    for cand in (j - 1, j):
                        if 0 <= cand < len(mine) and lt < mine[cand][0] <= hi:
                            x = mine[cand][0] - lt
                            score = abs(x - want)
                            if best is None or score < best[0]:
                                best = (score, x, mine[cand][1], mine[cand][2], t, q)
            if best is not None and best[0] < 1:
                break
        if best is None:
            return
        _, x, s, p, t, q = best
        bins[p].remove(s)
        bins[q].append(s)
        if t >= 0:
            bins[q].remove(t)
            bins[p].append(t)
        pack_load[p] -= x
        pack_load[q] += x
        owner = next(r for r in range(len(ranks)) if q in ranks[r])
        rank_load[busiest] -= x
        rank_load[owner] += x


# --------------------------------------------------------------------------------------------- tensors
def build_pack(
    seqs: Sequence[Sequence[int]],
    *,
    sample_ids: Sequence[int] | None = None,
    max_len: int | None = None,
    multiple: int = 1,
    restart_positions: bool = True,
    pad_token: int = 0,
    target_masks: Sequence[Sequence[float]] | None = None,
    sample_multiple: int = 1,
) -> PackedSequence:
    """Concatenate ``seqs`` (each truncated to ``max_len`` tokens) into one pack, padded to ``multiple``
    with a masked pad sample. ``restart_positions=False`` lets positions run on across samples.
    ``sample_multiple > 1`` pads every sample's segment with masked pad tokens to a multiple of it (its
    span stays the real tokens; causal attention keeps the pads from touching them).

    ``target_masks[i]`` (``len(seqs[i]) - 1`` entries) narrows sample i's loss mask to the targets that are
    trained on, e.g. 0 on the prompt and 1 on the response; without it every next token counts."""
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    parts = [np.asarray(s, dtype=np.int64)[:max_len] for s in seqs]  # max_len None: the whole of it
    if any(len(p) == 0 for p in parts):
        raise ValueError("every sample needs at least one token")
    if target_masks is not None:
        if len(target_masks) != len(seqs):
            raise ValueError(f"target_masks has {len(target_masks)} entries for {len(seqs)} samples")
        for i, (seq, tm) in enumerate(zip(seqs, target_masks, strict=True)):
            if len(tm) != len(seq) - 1:
                raise ValueError(
                    f"target_masks[{i}] has {len(tm)} entries, sample {i} has {len(seq) - 1} targets"
                )
    if sample_multiple <= 0:
        raise ValueError(f"sample_multiple must be positive, got {sample_multiple}")
    rooms = [-(-len(p) // sample_multiple) * sample_multiple for p in parts]
    real = sum(rooms)
    total = max(-(-real // multiple) * multiple, multiple)
    seg_lens = rooms + ([total - real] if total > real else [])
    tokens = torch.full((total,), pad_token, dtype=torch.long)
    targets = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total, dtype=torch.float32)
    spans = []
    start = 0
    for i, p in enumerate(parts):
        t = torch.as_tensor(p, dtype=torch.long)
        tokens[start : start + len(p)] = t
        targets[start : start + len(p) - 1] = t[1:]
        if target_masks is None:
            mask[start : start + len(p) - 1] = 1.0
        else:
            mask[start : start + len(p) - 1] = torch.as_tensor(list(target_masks[i][: len(p) - 1]))
        spans.append((start, start + len(p)))
        start += rooms[i]
    if restart_positions:
        positions = torch.cat([torch.arange(n) for n in seg_lens])
    else:
        positions = torch.arange(total)
    cu = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(seg_lens, dtype=torch.int32), 0)
    return PackedSequence(
        tokens=tokens[None],
        position_ids=positions[None],
        targets=targets[None],
        loss_mask=mask[None],
        cu_seqlens=cu,
        sample_ids=tuple(sample_ids) if sample_ids is not None else tuple(range(len(parts))),
        sample_spans=tuple(spans),
    )


def build_plan_pack(
    plan: PackPlan,
    seqs: Sequence[Sequence[int]],
    pack: int,
    *,
    multiple: int = 1,
    target_masks: Sequence[Sequence[float]] | None = None,
    **kwargs,
) -> PackedSequence:
    """Pack ``pack`` of ``plan`` from the global batch ``seqs`` (truncated as the plan says). A padding
    pack becomes one all-pad sequence of ``multiple`` tokens with no loss."""
    ids = plan.packs[pack]
    if any(len(seqs[i]) != plan.lengths[i] for i in ids):
        raise ValueError("seqs do not match the lengths the plan was made for")
    if target_masks is not None:
        kwargs["target_masks"] = [target_masks[i] for i in ids]
    return build_pack(
        [seqs[i] for i in ids],
        sample_ids=ids,
        max_len=plan.capacity,
        multiple=multiple,
        sample_multiple=plan.sample_multiple,
        **kwargs,
    )


@dataclass(frozen=True)
class PackSpec:
    """What packing a batch depends on besides its lengths: the trainer's layout. The driver plans each
    batch once with it and sends every data-parallel rank only its packs' samples; a rank's Megatron engine
    gives the same spec (:meth:`~mars_megatron.training.megatron_engine.MegatronEngine.pack_spec`), so a
    plan made on the driver equals the one the rank would make."""

    dp: int
    """Data-parallel ranks: every one gets the same number of packs (short ones get empty packs)."""
    seq_multiple: int
    """A pack's length must be a multiple of this (TP under sequence parallel, 2*cp)."""
    sample_multiple: int = 1
    """Every sample's room in a pack is rounded up to this (THD packs under context parallelism)."""
    why: str = ""
    """What sets ``seq_multiple``, for the error when a pack length is not a multiple of it."""

    def plan(self, lengths: Sequence[int], pack_length: int) -> PackPlan:
        """The packing of one global batch; deterministic, so every caller gets the same plan."""
        if pack_length % self.seq_multiple:
            raise ValueError(
                f"pack_length {pack_length} must be a multiple of {self.seq_multiple}"
                + (f": {self.why}" if self.why else "")
            )
        return plan_packs(lengths, pack_length, self.dp, pad_ranks=True, sample_multiple=self.sample_multiple)


def lower_bound(lengths: Sequence[int], capacity: int) -> int:
    return math.ceil(sum(min(x, capacity) for x in lengths) / capacity)
