"""One trainer rank of a MarsRL run: the Megatron policies of this rank and what the driver asks of them.

The driver starts one :class:`PolicyWorker` per rank (as Ray actors, or in-process for one rank) and calls
every method on all ranks at once: each call is collective. A run has one policy shared by all roles, or
one per role (``algorithm.policies=per_role``); methods take and return dicts keyed by policy name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.agents.sample import Sample, fetch_routing
from mars_megatron.algorithm import losses as L
from mars_megatron.algorithm.mismatch import SUM_KEYS, MismatchTally, mismatch_metrics
from mars_megatron.algorithm.objective import LossInputs, make_loss_fn, packed_loss_inputs
from mars_megatron.algorithm.tensors import MicroBatch
from mars_megatron.config import AlgorithmConfig, MarsConfig
from mars_megatron.rl.shares import BatchShare, MiniBatchShare, shard_batch
from mars_megatron.training import parallel as par
from mars_megatron.training.packing import PackSpec
from mars_megatron.training.weight_sync import SendsWeights, WeightSender


def check_sample_routing(samples: Sequence[Sample], arch: Any) -> None:
    """R3 needs every sample's engine routing, shaped for this model; the error names the samples."""
    from mars_megatron.training.routing_replay import RoutingError, check_routing

    missing = [s.sample_id for s in samples if s.routed_experts is None]
    if missing:
        raise RoutingError(
            f"moe.routing_replay=R3 needs the engine's routing of every sample; missing for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} (the rollout engine must capture it: capture_routing)"
        )
    for s in samples:
        assert s.routed_experts is not None
        check_routing(
            s.sample_id,
            s.routed_experts,
            s.length,
            sum(arch.moe_layers),
            arch.moe_topk,
            arch.num_experts,
        )


@dataclass(frozen=True)
class UpdateForwards:
    """Which forwards a batch's update takes besides the updates themselves."""

    watch: bool
    """Measure the trainer-vs-engine mismatch (needs the engine's log-probs)."""
    need_old: bool
    """Score every mini-batch under the pre-update weights first."""
    in_update: bool
    """The single update's own forward measures the mismatch (and R3's routing changes) on the way."""


def update_forwards(cfg: MarsConfig, engine_logprobs: bool, updates: int) -> UpdateForwards:
    """The "old" policy is the one before this batch's first update: score every mini-batch now when the
    loss needs it (importance other than POIS; R2, which records its routing there for the reference and
    every update to replay), or when the mismatch is watched and the update cannot measure it: MIS must
    know the outliers before the loss, and of several updates per batch only the first runs on the old
    weights. Otherwise the single update's own forward measures the mismatch (and, under R3, the routing
    the trainer would have changed) on the way, for free. DMMPT scores the batch too: its on/off decision
    is taken once, from the whole batch's entropy under the old weights, before any loss sees a pack (one
    pack's or rank's entropy would let the packs and ranks of one update disagree)."""
    algo, replay = cfg.algorithm, cfg.moe.routing_replay
    # mismatch needs the engine's log-probs (samples built without an engine have none): ``engine_logprobs``
    # says whether any sample of the whole batch has them, so every rank plans the same forwards
    watch = (algo.mismatch_metrics or algo.mis) and engine_logprobs
    loss_needs_old = algo.importance != "pois" or replay == "R2" or algo.dmmpt
    in_update = not loss_needs_old and updates == 1 and not algo.mis
    return UpdateForwards(
        watch=watch, need_old=loss_needs_old or (watch and not in_update), in_update=in_update
    )


@dataclass(frozen=True)
class BatchTerms:
    """What a rollout batch decides once, for every update's loss and on every rank alike."""

    entropy: float | None = None
    """DMMPT: the batch's token-mean entropy under the pre-update weights (all ranks' sum)."""
    dmmpt_active: bool | None = None
    """DMMPT: its on/off decision, taken from that entropy."""


@dataclass
class MiniBatchUpdate:
    """One optimizer step of a batch on this rank: its share of the mini-batch, its micro-batches, and
    what the loss reads besides the log-probs, each piece added by the variant that needs it before the
    batch's first update."""

    share: MiniBatchShare
    micro_batches: list[MicroBatch]
    routing: dict | None = None
    """R2: the routing the scoring forward recorded, replayed by the reference's forward and the update."""
    old: list[torch.Tensor] | None = None
    """The policy's log-probs of each pack before the batch's first update (on the last pipeline stage)."""
    ref: list[torch.Tensor] | None = None
    """The reference's log-probs of each pack (``algorithm.kl_coef > 0``)."""
    excluded: set[int] = field(default_factory=set)
    """MIS: the mini-batch's sequences left out of the loss (indices into the mini-batch)."""
    _by_pack: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # a context-parallel rank's share of a pack is a new MicroBatch of the same pack: the pack
        # identifies a micro-batch's log-probs
        self._by_pack = {id(mb.pack): k for k, mb in enumerate(self.micro_batches)}

    def loss_inputs(self, mb: MicroBatch, *, algo: AlgorithmConfig, terms: BatchTerms) -> LossInputs:
        """The loss inputs of one of this update's micro-batches."""
        assert mb.pack is not None
        k = self._by_pack[id(mb.pack)]
        return packed_loss_inputs(
            self.share,
            mb.pack,
            algo,
            old_logprobs=self.old[k] if self.old is not None and algo.importance != "pois" else None,
            ref_logprobs=self.ref[k] if self.ref is not None else None,
            excluded=self.excluded,
            entropy=terms.entropy,
            dmmpt_active=terms.dmmpt_active,
        )


@dataclass
class _Policy:
    megatron: Any  # MegatronEngine
    reference: Any | None  # frozen initial weights, for the KL penalty
    sender: WeightSender


class PolicyWorker(SendsWeights):
    """Builds this rank's policies (weights from ``model_dir``) with their optimizers."""

    def __init__(self, cfg: MarsConfig, model_dir: str, names: Sequence[str]) -> None:
        from mars_megatron.jobs import load_engine

        par.init_model_parallel(cfg.parallel, cfg.train.seed)
        self.cfg = cfg
        self.model_dir = model_dir
        self.loss = cfg.algorithm
        self.policies: dict[str, _Policy] = {}
        for name in names:
            megatron = load_engine(
                model_dir,
                cfg.parallel,
                dtype=cfg.model.dtype,
                impl=cfg.model.transformer_impl,
                optimizer=cfg.optimizer,
                fp8=cfg.model.fp8,
                recompute=cfg.train.recompute,
                routing_replay=cfg.moe.routing_replay != "off",
            )
            reference = None
            if cfg.algorithm.kl_coef > 0:  # forward only: no recompute
                reference = load_engine(
                    model_dir,
                    cfg.parallel,
                    dtype=cfg.model.dtype,
                    impl=cfg.model.transformer_impl,
                    fp8=cfg.model.fp8,
                    routing_replay=cfg.moe.routing_replay != "off",
                )
            sender = WeightSender(megatron.arch, cfg.pipeline.bucket_mb * 1024**2)
            self.policies[name] = _Policy(megatron, reference, sender)

    # ------------------------------------------------------------------------------------------ weights
    def weight_senders(self) -> dict[str, tuple[Any, WeightSender]]:
        """What the fleet's pushes send from (:class:`~mars_megatron.training.weight_sync.SendsWeights`)."""
        return {name: (p.megatron.model, p.sender) for name, p in self.policies.items()}

    # --------------------------------------------------------------------------------------------- train
    def pack_spec(self) -> PackSpec:
        """How this trainer packs a batch (the same for every policy: one layout), for the driver to cut
        batches into data-parallel shares (:func:`~mars_megatron.rl.shares.shard_batch`)."""
        return next(iter(self.policies.values())).megatron.pack_spec()

    def local_shares(self, batches: Mapping[str, Sequence[Sample]]) -> dict[str, BatchShare]:
        """This rank's shares of whole batches it holds itself: for tools and tests that run ranks without
        a driver (the driver sends each rank only its share)."""
        spec = self.pack_spec()
        rank = next(iter(self.policies.values())).megatron.dp_rank
        train = self.cfg.train
        return {
            name: shard_batch(samples, spec, train.pack_length, train.updates_per_batch)[rank]
            for name, samples in batches.items()
            if samples
        }

    def train(self, batches: Mapping[str, BatchShare]) -> dict[str, float]:
        """One rollout batch per policy, as this rank's share of it (:mod:`~mars_megatron.rl.shares`):
        ``train.updates_per_batch`` optimizer steps on packed samples.

        Returns metrics prefixed ``train/`` (the last update's loss and grad norm; loss-term statistics
        averaged over this rank's micro-batches, so only rank 0's view of them — enough to watch a run).
        """
        out: dict[str, float] = {}
        for name, share in batches.items():
            prefix = "train/" if len(self.policies) == 1 else f"train/{name}/"
            for key, value in self._train_policy(self.policies[name], share).items():
                out[prefix + key] = value
        return out

    def _train_policy(self, policy: _Policy, share: BatchShare) -> dict[str, float]:
        """One rollout batch of one policy: pack this rank's share, take the forwards the loss and the
        metrics need under the pre-update weights (:func:`update_forwards`), run the updates, and report.

        Each variant of the objective adds its piece to the mini-batches' :class:`MiniBatchUpdate` before
        the updates: R2 the routing to replay, the scoring forward the old log-probs, the reference its
        log-probs (KL), MIS the sequences to leave out, DMMPT the batch's one on/off decision
        (:class:`BatchTerms`); the updates then read them through :meth:`MiniBatchUpdate.loss_inputs`."""
        megatron, replay, algo = policy.megatron, self.cfg.moe.routing_replay, self.cfg.algorithm
        if replay == "R3":
            fetch_routing(share.own())  # from the engines' object stores, this rank's samples only
            check_sample_routing(share.own(), megatron.arch)
        updates = self._pack(megatron, share)
        forwards = update_forwards(self.cfg, share.engine_logprobs, len(updates))
        tally = MismatchTally(algo.mismatch_threshold) if forwards.watch else None
        if tally is not None:
            for u in updates:
                tally.add_batch(u.share, u.micro_batches, roles=u.share.roles)
        for u in updates:
            u.routing = {} if replay == "R2" else None
            if forwards.need_old:
                u.old = megatron.forward_logprobs(u.micro_batches, record_routing=u.routing)
        if policy.reference is not None:
            for u in updates:
                u.ref = policy.reference.forward_logprobs(u.micro_batches, replay_routing=u.routing)
        measure = tally is not None or replay == "R3"
        sums: dict[str, list[float]] = {}
        routing_changed = None
        if forwards.need_old and measure:
            sums, outliers, routing_changed = self._measure_old(megatron, tally, updates)
            if tally is not None and algo.mis:
                for u, out in zip(updates, outliers, strict=True):
                    u.excluded = out
        terms = self._batch_terms(megatron, updates)
        stats: list[dict[str, torch.Tensor]] = []
        metrics = self._update(
            megatron,
            updates,
            terms,
            stats,
            tally if forwards.in_update else None,
            in_update=forwards.in_update,
        )
        if forwards.in_update and measure:
            # each rank scored its own columns of the packs in the update
            sums, _, routing_changed = self._first_forward_sums(
                megatron, tally, replay == "R3", whole_packs=False
            )
        for key in stats[0] if stats else ():
            metrics[key] = float(torch.stack([s[key].detach().float() for s in stats]).mean())
        if policy.reference is not None:
            policy.reference.routing_changes()  # its scoring forwards replay too: not what is reported
        if routing_changed is not None:
            metrics["routing_changed"] = routing_changed
        if terms.entropy is not None and terms.dmmpt_active is not None:  # the same on every rank
            metrics["dmmpt_active"] = float(terms.dmmpt_active)
            metrics["dmmpt_batch_entropy"] = terms.entropy
        metrics["packs"] = float(sum(len(u.micro_batches) for u in updates))
        metrics["truncated_samples"] = float(sum(u.share.truncated for u in updates))
        metrics.update(mismatch_metrics(sums))
        if algo.mis and sums:
            metrics["mis_masked_samples"] = sums["all"][SUM_KEYS.index("seqs_over")]
        return metrics

    def _measure_old(
        self, megatron: Any, tally: MismatchTally | None, updates: Sequence[MiniBatchUpdate]
    ) -> tuple[dict[str, list[float]], list[set[int]], float | None]:
        """:meth:`_first_forward_sums` of the scoring forward under the pre-update weights."""
        if tally is not None:
            for u in updates:
                if u.old is None:
                    continue  # not the last pipeline stage
                for mb, lp in zip(u.micro_batches, u.old, strict=True):
                    tally.add(lp, mb)
        # the old log-probs are whole packs on every CP rank: count them once
        return self._first_forward_sums(
            megatron, tally, self.cfg.moe.routing_replay == "R3", whole_packs=True
        )

    def _pack(self, megatron: Any, share: BatchShare) -> list[MiniBatchUpdate]:
        """One update per mini-batch of this rank's share, with its micro-batches."""
        r3 = self.cfg.moe.routing_replay == "R3"
        return [
            MiniBatchUpdate(
                mini,
                megatron.pack_micro_batches(
                    mini.packs,
                    {i: s.tokens for i, s in mini.samples.items()},
                    mini.capacity,
                    mini.sample_multiple,
                    routing={i: s.routed_experts for i, s in mini.samples.items()} if r3 else None,
                ),
            )
            for mini in share.minis
        ]

    def _batch_terms(self, megatron: Any, updates: Sequence[MiniBatchUpdate]) -> BatchTerms:
        """What the whole batch decides once for every update's loss: DMMPT's on/off from its entropy."""
        if not self.loss.dmmpt:
            return BatchTerms()
        entropy = self._batch_entropy(megatron, updates)
        return BatchTerms(entropy, L.dmmpt_active(entropy, self.loss.dmmpt_entropy_target))

    def _update(
        self,
        megatron: Any,
        updates: Sequence[MiniBatchUpdate],
        terms: BatchTerms,
        stats: list[dict[str, torch.Tensor]],
        watching: MismatchTally | None,
        *,
        in_update: bool,
    ) -> dict[str, float]:
        """One optimizer step per mini-batch; the last step's metrics. ``watching``: a tally the update's
        own forward fills (the mismatch measured on the way, when no scoring forward was taken);
        ``in_update``: the update's forward is the batch's first under the pre-update weights (R3 then
        measures its routing changes there)."""
        r3 = self.cfg.moe.routing_replay == "R3"
        metrics: dict[str, float] = {}
        for u in updates:
            loss_fn = make_loss_fn(self.loss, partial(u.loss_inputs, algo=self.loss, terms=terms), stats)
            if watching is not None:
                loss_fn = watching.watching(loss_fn)
            metrics = megatron.step(
                u.micro_batches, loss_fn, replay_routing=u.routing, measure_routing=r3 and in_update
            )
        return metrics

    def _batch_entropy(self, megatron: Any, updates: Sequence[MiniBatchUpdate]) -> float:
        """Token-mean entropy estimate (:func:`~mars_megatron.algorithm.losses.entropy_estimate`) of the
        whole rollout batch under the pre-update weights: every mini-batch's response tokens (MIS outliers
        included: they are known only later), summed on each rank, then one all-reduce over the
        data-parallel replicas, so every rank (all TP/PP/CP ranks too) gets the same number and DMMPT one
        decision per update. The old log-probs are whole packs on every CP rank: CP rank 0 counts them."""
        from megatron.core import parallel_state as ps

        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for u in updates:
            if u.old is None:
                continue  # not the last pipeline stage: contributes nothing, receives the sum
            for mb, lp in zip(u.micro_batches, u.old, strict=True):
                assert mb.pack is not None
                mask = packed_loss_inputs(u.share, mb.pack, self.loss).mask
                parts.append(L.entropy_sums(lp, mask.to(lp.device)))
        # one host copy for the whole batch, then one all-reduce of two numbers
        local = torch.stack([torch.stack(p).double() for p in parts]).sum(0).tolist() if parts else [0.0, 0.0]
        total, count = megatron.sum_over_replicas(local, ps.get_context_parallel_rank() == 0)
        return total / max(count, 1.0)

    def _first_forward_sums(
        self, megatron: Any, tally: MismatchTally | None, routing: bool, *, whole_packs: bool
    ) -> tuple[dict[str, list[float]], list[set[int]], float | None]:
        """What the batch's first forward under the pre-update weights measured, over all ranks in one
        all-reduce: with a ``tally``, the trainer-vs-engine mismatch sums per role and each mini-batch's
        outlier sequences; with ``routing`` (R3), the share of replayed routing decisions the routers
        would have changed (counted on every rank: each routes its own tokens).
        ``whole_packs``: every context-parallel rank holds whole packs' log-probs (count rank 0's only)."""
        from megatron.core import parallel_state as ps

        flat = tally.flat() if tally is not None else []
        counts = megatron.routing_changes() if routing else ()
        contribute = not whole_packs or ps.get_context_parallel_rank() == 0
        reduced = megatron.sum_over_replicas(flat, contribute, extra=counts)
        sums, outliers = tally.finish(reduced[: len(flat)]) if tally is not None else ({}, [])
        routing_changed = None
        if routing:
            replayed, changed = reduced[len(flat) :]
            routing_changed = changed / max(replayed, 1.0)
        return sums, outliers, routing_changed

    # ---------------------------------------------------------------------------------------- checkpoint
    def save(self, directory: str) -> None:
        from mars_megatron.checkpoint.rank_state import save_rank_state
        from mars_megatron.jobs import tokenizer_dir

        assets = tokenizer_dir(self.model_dir)
        for name, policy in self.policies.items():
            save_rank_state(Path(directory), name, policy.megatron, assets=assets)

    def load(self, directory: str) -> None:
        from mars_megatron.checkpoint.rank_state import load_rank_state

        for name, policy in self.policies.items():
            load_rank_state(Path(directory), name, policy.megatron)

    def rank_info(self) -> dict[str, Any]:
        from megatron.core import parallel_state as ps

        return {
            "backend": str(dist.get_backend()),
            "rank": dist.get_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "writer": int(
                ps.is_pipeline_last_stage()
                and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0
            ),
        }
