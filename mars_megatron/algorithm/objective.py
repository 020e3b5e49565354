"""MarsRL's policy objective: the pieces of :mod:`losses` composed under the ``algorithm`` config section
(:class:`~mars_megatron.config.AlgorithmConfig`, which declares, defaults and validates every setting).

Order of :func:`compute_loss` (each step named in the stats it reports):

1. **masks** — the response loss mask; DMMPT then drops well-mastered positive tokens (if on, and if the
   update's entropy decision, :attr:`LossInputs.dmmpt_active`, says so);
2. **importance weights** — the "old" log-probs: the trainer's (``none``/``tis``) or POIS's detached
   current ones; ``tis`` multiplies each token by ``min(exp(old − behaviour), tis_cap)``;
3. **clipped surrogate** — token-level PPO loss with clip-higher, times the importance weight;
4. **KL** — ``+ kl_coef · KL_k(π ‖ π_ref)`` per token, each token's KL clamped to ``±kl_clamp``
   (skipped when ``kl_coef == 0``);
5. **role weights** — each token's loss times its sample's role weight.

The loss is the sum over the final mask and the token count is that mask's sum (tokens DMMPT drops
leave the denominator too; role weights do not change it). Megatron divides by the global count.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mars_megatron.agents.sample import Sample, SampleLookup
from mars_megatron.algorithm import losses as L
from mars_megatron.algorithm.tensors import MicroBatch, PackedSequence
from mars_megatron.config import AlgorithmConfig


@dataclass(frozen=True)
class LossInputs:
    """Per-micro-batch fields beside the log-probs, aligned with them (``[b, s]``: position t holds the
    value for the token predicted there, i.e. ``MicroBatch.targets[:, t]``)."""

    advantages: torch.Tensor
    """``[b]`` per sample or ``[b, s]`` per token."""
    mask: torch.Tensor
    """1 on the response tokens to train on."""
    old_logprobs: torch.Tensor | None = None
    """Trainer's log-probs before the update (needed unless importance is ``pois``)."""
    behaviour_logprobs: torch.Tensor | None = None
    """Rollout engine's log-probs (needed for ``tis``)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference policy's log-probs (needed when ``kl_coef > 0``)."""
    token_weights: torch.Tensor | None = None
    """Role weights per token (:func:`losses.role_weights`); None weighs all 1."""
    entropy: float | torch.Tensor | None = None
    """The batch's policy entropy for DMMPT (reported as the ``entropy`` stat); None estimates it from
    this micro-batch's log-probs (under context parallelism: from this rank's share of them)."""
    dmmpt_active: bool | None = None
    """DMMPT's on/off decision for this update, taken once from the whole batch's entropy (the trainer
    all-reduces it over ranks before the update), so that every pack and rank masks alike; it overrides
    ``entropy`` for the decision. None decides from ``entropy`` (or the micro-batch's estimate): per
    micro-batch and rank, which only a single-pack, single-rank caller should rely on."""

    def select(self, index: torch.Tensor) -> LossInputs:
        """The columns ``index`` of every per-token field: a context-parallel rank's share of a pack."""
        if self.advantages.dim() != 2:
            raise ValueError("LossInputs.select needs per-token advantages [b, s] (packed inputs)")

        def take(value: object) -> object:
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                return value[:, index.to(value.device)]
            return value

        return LossInputs(**{name: take(value) for name, value in vars(self).items()})


def _need(value: torch.Tensor | None, name: str, why: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"compute_loss: LossInputs.{name} is required {why}")
    return value


def _on_device(inputs: LossInputs, device: torch.device) -> LossInputs:
    moved = {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in vars(inputs).items()
    }
    return LossInputs(**moved)


def compute_loss(
    logprobs: torch.Tensor, inputs: LossInputs, config: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss sum, token count, stats) for one micro-batch, in the order of the module docstring."""
    inputs = _on_device(inputs, logprobs.device)
    stats: dict[str, torch.Tensor] = {}
    mask = inputs.mask.to(logprobs.dtype)
    if config.dmmpt:  # 1. masks
        entropy = inputs.entropy if inputs.entropy is not None else L.entropy_estimate(logprobs, mask)
        active = inputs.dmmpt_active
        if active is None:
            active = L.dmmpt_active(entropy, config.dmmpt_entropy_target)
        kept = (
            L.dmmpt_drop(logprobs, mask, inputs.advantages, prob_threshold=config.dmmpt_prob_threshold)
            if active
            else mask
        )
        stats["dmmpt_masked_fraction"] = 1.0 - kept.sum() / mask.sum().clamp(min=1)
        # on the log-probs' device: the trainer stacks each stat across micro-batches
        dtype, device = logprobs.dtype, logprobs.device
        stats["dmmpt_active"] = torch.tensor(float(active), dtype=dtype, device=device)
        stats["entropy"] = torch.as_tensor(entropy, dtype=dtype, device=device).detach()
        mask = kept

    if config.importance == "pois":  # 2. importance weights
        old = L.pois_old_logprobs(logprobs)
    else:
        old = _need(inputs.old_logprobs, "old_logprobs", f"for importance={config.importance!r}")
    weight = torch.ones_like(logprobs)
    if config.importance == "tis":
        behaviour = _need(inputs.behaviour_logprobs, "behaviour_logprobs", "for importance='tis'")
        weight = L.tis_weights(old, behaviour, config.tis_cap)
        stats["tis_weight_mean"] = L.masked_mean(weight, mask)

    surrogate, ratio, clipped = L.clipped_surrogate(  # 3. clipped surrogate
        logprobs, old, inputs.advantages, config.clip_low, config.clip_high
    )
    stats.update(L.surrogate_stats(logprobs, ratio, clipped, old, mask))
    per_token = surrogate * weight
    stats["pg_loss"] = L.masked_mean(per_token.detach(), mask)

    if config.kl_coef > 0:  # 4. KL
        ref = _need(inputs.ref_logprobs, "ref_logprobs", "when kl_coef > 0")
        kl = L.kl_per_token(logprobs, ref, config.kl_kind, config.kl_clamp)
        stats["kl"] = L.masked_mean(kl.detach(), mask)
        per_token = per_token + config.kl_coef * kl

    if inputs.token_weights is not None:  # 5. role weights
        per_token = per_token * inputs.token_weights.to(per_token.dtype)
    return (per_token * mask).sum(), mask.sum(), stats


# ------------------------------------------------------------------------------- samples -> tensors
def response_tensor(
    samples: Sequence[Sample], values: Sequence[Sequence[float]], seq_len: int
) -> torch.Tensor:
    """``[b, seq_len]`` with ``values[i][j]`` (response token j of sample i) at position
    ``len(prompt) − 1 + j``, where the engine puts that token's log-prob; 0 elsewhere."""
    out = torch.zeros(len(samples), seq_len, dtype=torch.float32)
    for i, (sample, row) in enumerate(zip(samples, values, strict=True)):
        if len(row) != sample.response_len:
            raise ValueError(
                f"response_tensor: row {i} has {len(row)} values, response {sample.response_len}"
            )
        start = len(sample.prompt_ids) - 1
        if start + len(row) > seq_len:
            raise ValueError(f"response_tensor: sample {i} needs {start + len(row)} positions > {seq_len}")
        values = row if isinstance(row, torch.Tensor) else np.asarray(row, dtype=np.float64)
        out[i, start : start + len(row)] = torch.as_tensor(values, dtype=torch.float32)
    return out


def loss_inputs(
    samples: Sequence[Sample],
    seq_len: int,
    config: AlgorithmConfig,
    *,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    entropy: float | None = None,
) -> LossInputs:
    """Tensors for ``samples`` batched in order (as ``make_micro_batches([s.tokens ...])`` lays them
    out). ``old_logprobs``/``ref_logprobs`` are per response token, from the trainer/reference."""
    for s in samples:
        if s.advantage is None:
            raise ValueError(f"loss_inputs: sample {s.sample_id!r} has no advantage (run assign_advantages)")
    behaviour = None
    if config.importance == "tis":
        missing = [s.sample_id for s in samples if s.behaviour_logprobs is None]
        if missing:
            raise ValueError(
                f"loss_inputs: importance='tis' needs Sample.behaviour_logprobs; missing {missing}"
            )
        behaviour = response_tensor(samples, [s.behaviour_logprobs for s in samples], seq_len)  # type: ignore[misc]
    return LossInputs(
        advantages=torch.tensor([float(s.advantage) for s in samples]),  # type: ignore[arg-type]
        mask=response_tensor(samples, [s.loss_mask for s in samples], seq_len),  # type: ignore[misc]
        old_logprobs=None if old_logprobs is None else response_tensor(samples, old_logprobs, seq_len),
        behaviour_logprobs=behaviour,
        ref_logprobs=None if ref_logprobs is None else response_tensor(samples, ref_logprobs, seq_len),
        token_weights=L.role_weights(samples, config.role_weights, seq_len) if config.role_weights else None,
        entropy=entropy,
    )


def response_span(sample: Sample, start: int, end: int) -> tuple[int, int]:
    """``(first, count)``: where in a pack the log-probs of ``sample``'s response tokens sit, the sample
    occupying ``[start, end)``; ``count`` is cut by truncation (the last token of a span predicts
    nothing) and is <= 0 when the response was cut off entirely."""
    first = start + len(sample.prompt_ids) - 1
    return first, min(sample.response_len, end - 1 - first)


def packed_loss_inputs(
    samples: SampleLookup,
    pack: PackedSequence,
    config: AlgorithmConfig,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    excluded: Collection[int] = (),
    entropy: float | None = None,
    dmmpt_active: bool | None = None,
) -> LossInputs:
    """Tensors ``[1, T]`` for one pack: sample ``pack.sample_ids[j]`` (an index into ``samples``) sits at
    ``pack.sample_spans[j]``; its response token i is predicted at ``start + len(prompt) − 1 + i``.
    Tokens cut off by truncation are left out, and so are the samples ``excluded`` (indices into
    ``samples``: masked importance sampling). ``old_logprobs``/``ref_logprobs`` are the trainer's and the
    reference's log-probs of this very pack (already laid out like the pack). ``entropy`` and
    ``dmmpt_active``: the update's batch entropy and DMMPT decision (:class:`LossInputs`)."""
    length = pack.length
    advantages = torch.zeros(1, length)
    mask = torch.zeros(1, length)
    behaviour = torch.zeros(1, length) if config.importance == "tis" else None
    weights = torch.ones(1, length) if config.role_weights else None
    for index, (start, end) in zip(pack.sample_ids, pack.sample_spans, strict=True):
        sample = samples[index]
        if sample.advantage is None:
            raise ValueError(f"packed_loss_inputs: sample {sample.sample_id!r} has no advantage")
        first, count = response_span(sample, start, end)
        if count <= 0 or index in excluded:
            continue  # truncated inside the prompt, or masked: nothing of the response is trained on
        span = slice(first, first + count)
        advantages[0, span] = float(sample.advantage)
        mask[0, span] = torch.as_tensor(sample.loss_mask[:count], dtype=torch.float32)  # type: ignore[index]
        if behaviour is not None:
            if sample.behaviour_logprobs is None:
                raise ValueError(
                    f"packed_loss_inputs: importance='tis' needs behaviour_logprobs; sample "
                    f"{sample.sample_id!r} has none"
                )
            behaviour[0, span] = torch.as_tensor(sample.behaviour_logprobs[:count], dtype=torch.float32)
        if weights is not None:
            weights[0, span] = float(config.role_weights.get(sample.role, 1.0))
    return LossInputs(
        advantages=advantages,
        mask=mask,
        old_logprobs=old_logprobs,
        behaviour_logprobs=behaviour,
        ref_logprobs=ref_logprobs,
        token_weights=weights,
        entropy=entropy,
        dmmpt_active=dmmpt_active,
    )


def make_loss_fn(
    config: AlgorithmConfig,
    inputs_for: Callable[[MicroBatch], LossInputs],
    stats_sink: list[dict[str, torch.Tensor]] | None = None,
) -> Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor]]:
    """An engine ``LossFn``: looks up the micro-batch's :class:`LossInputs` with ``inputs_for`` and
    applies :func:`compute_loss`; each micro-batch's stats go to ``stats_sink`` if given."""

    def loss_fn(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs_for(mb)
        if mb.cp_index is not None:  # this context-parallel rank scored only these positions
            inputs = inputs.select(mb.cp_index)
        loss, count, stats = compute_loss(logprobs, inputs, config)
        if stats_sink is not None:
            stats_sink.append(stats)
        return loss, count

    return loss_fn
