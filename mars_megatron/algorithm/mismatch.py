"""Trainer-vs-engine log-prob mismatch: how far the policy the trainer computes is from the one that
sampled the tokens, per role, and which sequences are too far to train on (MIS).

The rollout engine and the trainer run the same weights through different kernels (and, for MoE models,
possibly different experts), so ``log p_trainer - log p_engine`` of a sampled token is not 0. Per token,
with ``d = log p_trainer - log p_engine``:

* ``abs_mean``: mean |d| over the response tokens.
* ``kl``: Schulman's k3 estimate of KL(engine || trainer) on the engine's samples, mean of
  ``exp(d) - 1 - d`` (non-negative, unbiased; d is log of the ratio r = p_trainer / p_engine).
* ``token_outliers``: the fraction of tokens with r outside ``[1/t, t]`` (``|d| > log t``).
* ``seq_outliers``: the fraction of sequences whose geometric-mean ratio ``exp(mean d)`` is outside
  ``[1/t, t]``. These are what masked importance sampling (``algorithm.mis``) leaves out of the loss:
  a sequence the trainer would score that differently was, in effect, not sampled from its policy.

Everything starts as a per-sequence sum over its tokens (:data:`SEQUENCE_KEYS`, :func:`token_sums`), so
a sequence's tokens may be scored anywhere (split between context-parallel ranks, on any data-parallel
rank) and the ranks' sums add up to the sequence's exactly. :func:`role_sums` then decides the outlier
sequences on the whole sums, and :func:`mismatch_metrics` turns role sums into means.

:class:`MismatchTally` collects those sums from whichever forward first scores a batch under the weights
before its update: a scoring forward (the old log-probs), or the update's own forward when the batch
has one update and nothing else needs a scoring forward, which makes the metrics free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from mars_megatron.agents.sample import SampleLookup
from mars_megatron.algorithm.objective import response_span
from mars_megatron.algorithm.tensors import MicroBatch, PackedSequence

SEQUENCE_KEYS = ("tokens", "abs", "k3", "tokens_over", "d")
"""Per-sequence sums over its compared tokens: count, |d|, k3 term, tokens with |d| > log t, and d."""
SUM_KEYS = ("tokens", "abs", "k3", "tokens_over", "seqs", "seqs_over")
"""Per-group sums (a role, or ``all``) that :func:`mismatch_metrics` turns into means."""

LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor]]


def _log_bound(threshold: float) -> float:
    if not threshold > 1:
        raise ValueError(f"threshold must be > 1, got {threshold}")
    return math.log(threshold)


def token_sums(d: torch.Tensor, owner: torch.Tensor, sequences: int, threshold: float) -> torch.Tensor:
    """Per-sequence sums (:data:`SEQUENCE_KEYS`) of the tokens' ``d``: ``[sequences, 5]`` float64 on
    ``d``'s device. ``owner`` (``d``'s shape): each token's sequence, ``-1`` where nothing is compared."""
    if d.shape != owner.shape:
        raise ValueError(f"d {tuple(d.shape)} vs owner {tuple(owner.shape)}")
    bound = _log_bound(threshold)
    keep = owner >= 0
    d = d[keep].double()
    terms = torch.stack(
        [torch.ones_like(d), d.abs(), torch.expm1(d) - d, (d.abs() > bound).double(), d], dim=1
    )
    out = torch.zeros(sequences, len(SEQUENCE_KEYS), dtype=torch.float64, device=d.device)
    return out.index_add_(0, owner[keep].to(d.device), terms)


def role_sums(
    per_sequence: torch.Tensor, roles: Sequence[str], threshold: float
) -> tuple[dict[str, list[float]], set[int]]:
    """:data:`SUM_KEYS` per role and for ``all`` from whole sequences' sums (``[len(roles), 5]``), and the
    outlier sequences (indices). Sequences without a compared token count for nothing."""
    if tuple(per_sequence.shape) != (len(roles), len(SEQUENCE_KEYS)):
        raise ValueError(
            f"per-sequence sums {tuple(per_sequence.shape)}, expected ({len(roles)}, {len(SEQUENCE_KEYS)})"
        )
    bound = _log_bound(threshold)
    sums: dict[str, list[float]] = {}
    outliers: set[int] = set()
    for i, (role, (tokens, abs_sum, k3_sum, over, d_sum)) in enumerate(
        zip(roles, per_sequence.tolist(), strict=True)
    ):
        if tokens <= 0:
            continue
        outlier = abs(d_sum / tokens) > bound
        if outlier:
            outliers.add(i)
        for group in ("all", role):
            s = sums.setdefault(group, [0.0] * len(SUM_KEYS))
            for k, v in enumerate((tokens, abs_sum, k3_sum, over, 1.0, float(outlier))):
                s[k] += v
    return sums, outliers


def mismatch_metrics(sums: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``mismatch/<group>/{abs_mean,kl,token_outliers,seq_outliers,tokens}`` from per-group sums (groups
    are roles, and ``all``); groups without tokens are left out."""
    out: dict[str, float] = {}
    for group, values in sums.items():
        s = dict(zip(SUM_KEYS, values, strict=True))
        if s["tokens"] <= 0:
            continue
        prefix = f"mismatch/{group}/"
        out[prefix + "abs_mean"] = s["abs"] / s["tokens"]
        out[prefix + "kl"] = s["k3"] / s["tokens"]
        out[prefix + "token_outliers"] = s["tokens_over"] / s["tokens"]
        out[prefix + "seq_outliers"] = s["seqs_over"] / s["seqs"]
        out[prefix + "tokens"] = s["tokens"]
    return out


def engine_layout(samples: SampleLookup, pack: PackedSequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's log-probs laid out like the trainer's log-probs of ``pack`` (``[1, T]`` float64), and
    each position's sequence (its index into ``samples``), ``-1`` where nothing is compared: prompts,
    padding, tokens cut off by truncation, samples without engine log-probs, and tokens the policy did not
    write (``loss_mask`` 0: a tool's observation has no engine log-prob)."""
    engine = torch.zeros(1, pack.length, dtype=torch.float64)
    owner = torch.full((1, pack.length), -1, dtype=torch.long)
    for index, (start, end) in zip(pack.sample_ids, pack.sample_spans, strict=True):
        sample = samples[index]
        if sample.behaviour_logprobs is None:
            continue
        first, count = response_span(sample, start, end)
        if count <= 0:
            continue
        # float32, as the loss sees them (the record keeps float32: LOGPROB_DTYPE)
        engine[0, first : first + count] = torch.as_tensor(
            sample.behaviour_logprobs[:count], dtype=torch.float32
        )
        written = torch.as_tensor(sample.loss_mask[:count] if sample.loss_mask is not None else [1] * count)
        owner[0, first : first + count] = torch.where(written.bool(), index, -1)
    return engine, owner


class MismatchTally:
    """Per-sequence sums of a batch as the trainer scores its packs.

    :meth:`add_batch` registers each mini-batch's samples and packs. Then each forward that scores a pack
    :meth:`add` s the trainer's log-probs: the whole pack's, or a context-parallel rank's columns (the
    micro-batch's ``cp_index``). :meth:`watching` wraps a loss function so that the update's forward does
    this on the way. :meth:`flat` and :meth:`finish` are the two ends of the cross-rank sum."""

    def __init__(self, threshold: float) -> None:
        _log_bound(threshold)
        self.threshold = threshold
        self._roles: list[list[str]] = []
        self._sums: list[torch.Tensor] = []
        self._packs: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def add_batch(
        self,
        samples: SampleLookup,
        micro_batches: Sequence[MicroBatch],
        roles: Sequence[str] | None = None,
    ) -> None:
        """A mini-batch: its samples (a rank's share of them: then ``roles``, every sample's role, by
        index) and this rank's packs of them."""
        k = len(self._sums)
        if roles is None:
            roles = [samples[i].role for i in range(len(samples))]
        if len(roles) != len(samples):
            raise ValueError(f"{len(roles)} roles for a mini-batch of {len(samples)} samples")
        self._roles.append(list(roles))
        self._sums.append(torch.zeros(len(samples), len(SEQUENCE_KEYS), dtype=torch.float64))
        for mb in micro_batches:
            if mb.pack is None:
                raise ValueError("MismatchTally reads packed micro-batches (MicroBatch.pack is None)")
            self._packs[id(mb.pack)] = (k, *engine_layout(samples, mb.pack))

    def add(self, logprobs: torch.Tensor, mb: MicroBatch) -> None:
        """``logprobs``: the trainer's log-probs of ``mb`` (``[1, T]``, or this CP rank's columns)."""
        k, engine, owner = self._packs[id(mb.pack)]
        if mb.cp_index is not None:
            index = mb.cp_index.cpu()
            engine, owner = engine[:, index], owner[:, index]
        device = logprobs.device
        d = logprobs.detach().double() - engine.to(device)
        sums = token_sums(d, owner.to(device), self._sums[k].shape[0], self.threshold)
        self._sums[k] = self._sums[k].to(device) + sums

    def watching(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` that first adds the log-probs it is given."""

        def watched(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
            self.add(logprobs, mb)
            return loss_fn(logprobs, mb)

        return watched

    def flat(self) -> list[float]:
        """This rank's sums of every mini-batch, flattened for an all-reduce."""
        return [v for sums in self._sums for v in sums.flatten().tolist()]

    def finish(self, flat: Sequence[float]) -> tuple[dict[str, list[float]], list[set[int]]]:
        """From the all-reduced :meth:`flat`: the role sums of the whole batch, and each mini-batch's
        outlier sequences (indices into its samples)."""
        roles = [role for mini in self._roles for role in mini]
        if len(flat) != len(roles) * len(SEQUENCE_KEYS):
            raise ValueError(f"{len(flat)} sums for {len(roles) * len(SEQUENCE_KEYS)} per-sequence values")
        whole = torch.tensor(list(flat), dtype=torch.float64).view(len(roles), len(SEQUENCE_KEYS))
        sums, outliers = role_sums(whole, roles, self.threshold)
        per_mini: list[set[int]] = []
        start = 0
        for mini in self._roles:
            per_mini.append({i - start for i in outliers if start <= i < start + len(mini)})
            start += len(mini)
        return sums, per_mini
