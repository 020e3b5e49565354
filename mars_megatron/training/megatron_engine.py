"""One rank's Megatron model with its optimizer: load weights, score sequences, take training steps.

This is the only place that drives megatron's schedules. Every call is collective: all ranks of the world
call it with the same arguments (the global batch); the engine takes its data-parallel share itself.
Losses are token-level: each micro-batch returns (sum of token losses, token count), and
``calculate_per_token_loss`` makes megatron divide gradients by the token count of the whole global batch,
so any TP/PP/EP/DP layout computes the same update as one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from mars_megatron.algorithm.tensors import MicroBatch
from mars_megatron.comm import collectives
from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.models.hf_config import Qwen3Arch
from mars_megatron.training.batches import make_micro_batches
from mars_megatron.training.logprobs import vocab_parallel_logprobs
from mars_megatron.training.model_provider import build_model, resolve_impl
from mars_megatron.training.packing import PackPlan, PackSpec, build_pack

# (per-token log-probs [b, s], micro-batch) -> (sum of token losses, number of tokens)
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor]]


def lm_loss(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy, summed over the masked tokens."""
    return -(logprobs * mb.loss_mask).sum(), mb.loss_mask.sum()


class MegatronEngine:
    """Model chunk + (optionally) DDP and a distributed optimizer for this rank."""

    def __init__(
        self,
        arch: Qwen3Arch,
        parallel: ParallelConfig,
        *,
        dtype: str | None = None,
        transformer_impl: str = "auto",
        vocab_pad_multiple: int = 128,
        optimizer: OptimizerConfig | None = None,
        fp8: str | None = None,
        recompute: str = "none",
        routing_replay: bool = False,
    ) -> None:
        """``routing_replay``: put a replay hook on every MoE router (``training/routing_replay.py``), so
        :meth:`forward_logprobs` and :meth:`step` can record or replay routing."""
        from megatron.core import parallel_state as ps

        self.arch = arch
        self.parallel = parallel
        self.dtype = dtype or arch.dtype
        self.vocab_pad_multiple = vocab_pad_multiple
        self.padded_vocab = arch.padded_vocab_size(vocab_pad_multiple)
        self.impl = resolve_impl(transformer_impl)
        self.model = build_model(
            arch,
            parallel,
            dtype=dtype,
            transformer_impl=transformer_impl,
            vocab_pad_multiple=vocab_pad_multiple,
            fp8=fp8,
            recompute=recompute,
        )
        self.config = self.model.config
        self.config.calculate_per_token_loss = True
        self.recompute = recompute
        self.replay = None
        if routing_replay:
            from mars_megatron.training.routing_replay import ReplayControl, RoutingError, install

            if not arch.is_moe:
                raise RoutingError(f"moe.routing_replay needs a MoE model; {arch.architecture} has no router")
            self.replay = ReplayControl(install(self.model, arch.moe_layers))
        self._routing_record: Any = None  # RoutingStore being recorded by forward_logprobs
        self._routing_source: Any = None  # RoutingStore replayed by forward_logprobs / step
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.cp = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.optimizer: Any = None
        self.skipped_steps = 0  # steps dropped for a non-finite loss or gradient
        if optimizer is not None:
            self._setup_training(optimizer)

    def _setup_training(self, opt: OptimizerConfig) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.parallel.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=self.model)
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                bf16=self.config.bf16,
                fp16=self.config.fp16,
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=self.parallel.use_distributed_optimizer,
            ),
            [self.model],
        )
        for group in self.optimizer.param_groups:
            group["lr"] = opt.lr
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model.no_sync

    # ------------------------------------------------------------------------------------------ schedules
    def _seq_multiple(self) -> int:
        return self.parallel.seq_multiple

    def _sample_multiple(self) -> int:
        """THD packs under context parallelism split every sample into 2*cp chunks (TE's ring attention
        works per sample), so each sample is padded to the micro-batch multiple; elsewhere 1."""
        return self._seq_multiple() if self.cp > 1 and self.impl == "transformer_engine" else 1

    def _model_inputs(self, mb: MicroBatch) -> tuple[MicroBatch, dict[str, Any]]:
        """What this rank feeds the model for ``mb``: its context-parallel share of the tokens (all of
        them without CP) and the attention arguments (THD params with TE, a mask with local attention)."""
        te = self.impl == "transformer_engine"
        thd = mb.pack is not None and te
        kwargs: dict[str, Any] = {"attention_mask": None}
        if thd:
            # TE's attention reads sample boundaries from cu_seqlens (whole samples, CP included)
            kwargs["packed_seq_params"] = _thd(mb)
        if self.cp == 1:
            if mb.pack is not None and not te:
                # Local attention: the same pack as sbhd with a block-diagonal causal mask.
                kwargs["attention_mask"] = mb.pack.attention_mask(mb.tokens.device)
            return mb, kwargs
        from mars_megatron.training.context_parallel import local_mask

        indices = self._cp_indices(mb)
        local = mb.select(indices[self.cp_rank].to(mb.tokens.device))
        if not te:
            length = mb.tokens.shape[1]
            device = mb.tokens.device
            full = (
                mb.pack.attention_mask(device)
                if mb.pack is not None
                else ~torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
            )
            kwargs["attention_mask"] = local_mask(full, [i.to(device) for i in indices], self.cp_rank)
        return local, kwargs

    def _cp_indices(self, mb: MicroBatch) -> list[torch.Tensor]:
        from mars_megatron.training.context_parallel import rank_indices

        thd = mb.pack is not None and self.impl == "transformer_engine"
        cu = mb.pack.cu_seqlens if thd else None  # type: ignore[union-attr]
        return rank_indices(mb.tokens.shape[1], self.cp, cu_seqlens=cu)

    def _full_logprobs(self, sink: list[tuple[torch.Tensor, MicroBatch]]) -> list[torch.Tensor]:
        """Log-probs of every micro-batch in its full layout ``[b, s]``: under CP each rank scored its
        share, so the shares are all-gathered over the CP group and put back in place."""
        if self.cp == 1:
            return [lp for lp, _ in sink]
        from megatron.core import parallel_state as ps

        from mars_megatron.training.context_parallel import gather_positions

        group = ps.get_context_parallel_group()
        return [gather_positions(lp, self._cp_indices(mb), mb.tokens.shape[1], group) for lp, mb in sink]

    def _route(self, mb: MicroBatch, local: MicroBatch) -> None:
        """What the routers do for this micro-batch: replay a recorded store (R2) or the micro-batch's own
        routing (R3), or choose freely; what they used is recorded when a store is being recorded."""
        if self.replay is None:
            return
        if self._routing_source is not None:
            if id(mb.pack) not in self._routing_source:
                raise RuntimeError("routing replay: pack not recorded (record it with forward_logprobs)")
            self.replay.replay(self._routing_source[id(mb.pack)])
        elif local.routing is not None:
            from megatron.core import parallel_state as ps

            from mars_megatron.training.routing_replay import local_routing

            flat = local_routing(
                local.routing,
                ps.get_tensor_model_parallel_rank(),
                self.parallel.tp,
                bool(self.config.sequence_parallel),
            )
            self.replay.replay({m: flat[:, m] for m in range(flat.shape[1])})
        else:
            self.replay.free()

    def _token_logprobs(self, output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        local = output.shape[-1]
        return vocab_parallel_logprobs(
            output,
            mb.targets,
            vocab_start=tp_rank * local,
            vocab_size=self.arch.vocab_size,
            group=ps.get_tensor_model_parallel_group(),
        )

    def _forward_step(
        self,
        loss_fn: LossFn,
        sink: list[tuple[torch.Tensor, MicroBatch]] | None,
        data: Iterator[MicroBatch],
        model: Any,
    ):
        mb = _on_device(next(data))
        local, kwargs = self._model_inputs(mb)
        self._route(mb, local)
        output = model(local.tokens, local.position_ids, **kwargs)
        if self._routing_record is not None:
            self._routing_record[id(mb.pack)] = self.replay.used()  # type: ignore[union-attr]

        def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            logprobs = self._token_logprobs(output_tensor, local)
            if sink is not None:
                sink.append((logprobs.detach(), mb))
            loss, tokens = loss_fn(logprobs, local)
            tokens = tokens.to(torch.int)
            return loss, tokens, {"loss_sum": loss.detach().clone(), "tokens": tokens.detach().clone()}

        return output, loss_func

    def _run(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        *,
        forward_only: bool,
        sink: list | None = None,
    ) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn, sink),
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=micro_batches[0].tokens.shape[1],
            micro_batch_size=micro_batches[0].tokens.shape[0],
            forward_only=forward_only,
        )

    def _on_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage()

    def sum_over_replicas(
        self, values: list[float], contribute: bool, extra: Sequence[float] = ()
    ) -> list[float]:
        """Sum over data-parallel replicas, counted once per replica (last stage, TP rank 0); ``extra``
        values ride along in the same all-reduce, summed over every rank."""
        from megatron.core import parallel_state as ps

        own = contribute and self._on_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        return collectives.all_reduce_values([*(values if own else [0.0] * len(values)), *extra])

    # ------------------------------------------------------------------------------------------- public
    @torch.no_grad()
    def logprobs(
        self, seqs: Sequence[Sequence[int]], micro_batch: int = 1, *, routing: Sequence[Any] | None = None
    ) -> list[list[float]] | None:
        """Log-prob of every token given its prefix (the first token has none). Every rank scores every
        sequence; ranks on the last pipeline stage return the values, the others ``None``.
        ``routing[i]``: the experts to route sequence i's positions to (``[len - 1, moe_layers, k]``;
        engine built with ``routing_replay``), e.g. an engine's, to score its tokens deterministically."""
        self.model.eval()
        # Pipeline stages exchange activations of one shape, so the last micro-batch is padded with
        # one-token dummy sequences (no targets) and their outputs are dropped.
        dummies = -len(seqs) % micro_batch
        mbs = make_micro_batches([*seqs, *([[0]] * dummies)], micro_batch, multiple=self._seq_multiple())
        if routing is not None:
            from mars_megatron.training.routing_replay import batch_routing

            rows = [*routing, *([None] * dummies)]
            layers, k = sum(self.arch.moe_layers), self.arch.moe_topk
            size = micro_batch
            mbs = [
                dataclasses.replace(
                    mb,
                    routing=batch_routing(rows[i * size : (i + 1) * size], mb.tokens.shape[1], layers, k),
                )
                for i, mb in enumerate(mbs)
            ]
        sink: list[tuple[torch.Tensor, MicroBatch]] = []
        with self._routing(None, None, recompute=False, measure=True):
            self._run(mbs, lm_loss, forward_only=True, sink=sink)
        if not self._on_last_stage():
            return None
        out = []
        for mb, lp in zip(mbs, self._full_logprobs(sink), strict=True):
            out += [lp[row, : n - 1].tolist() for row, n in enumerate(mb.lengths)]
        return out[: len(seqs)]

    def pack_spec(self) -> PackSpec:
        """What this engine's packs depend on besides the batch: its data-parallel size and the multiples
        its layout asks of pack and sample lengths."""
        why = f"tp={self.parallel.tp} under sequence parallel" if self.config.sequence_parallel else ""
        if self.cp > 1:
            why = f"{why + ' times ' if why else ''}2*cp = {2 * self.cp} (context parallel)"
        return PackSpec(self.dp, self._seq_multiple(), self._sample_multiple(), why)

    def plan(self, lengths: Sequence[int], pack_length: int) -> PackPlan:
        """The packing of a global batch: every rank computes the same plan (it is deterministic), and
        every DP rank gets the same number of packs (short ranks get empty ones) so the schedules agree."""
        return self.pack_spec().plan(lengths, pack_length)

    def rank_packs(
        self,
        seqs: Sequence[Sequence[int]],
        plan: PackPlan,
        target_masks: Sequence[Sequence[float]] | None = None,
        routing: Sequence[Any] | None = None,
    ) -> list[MicroBatch]:
        """This DP rank's packs of ``plan`` (made from the whole batch ``seqs``) as micro-batches: see
        :meth:`pack_micro_batches`."""
        ids = [plan.packs[k] for k in plan.rank_packs[self.dp_rank]]
        if any(len(seqs[i]) != plan.lengths[i] for pack in ids for i in pack):
            raise ValueError("seqs do not match the lengths the plan was made for")
        return self.pack_micro_batches(
            ids, seqs, plan.capacity, plan.sample_multiple, target_masks=target_masks, routing=routing
        )

    def pack_micro_batches(
        self,
        packs: Sequence[Sequence[int]],
        seqs: Sequence[Sequence[int]] | Mapping[int, Sequence[int]],
        capacity: int,
        sample_multiple: int = 1,
        *,
        target_masks: Sequence[Sequence[float]] | Mapping[int, Sequence[float]] | None = None,
        routing: Sequence[Any] | Mapping[int, Any] | None = None,
    ) -> list[MicroBatch]:
        """``packs`` (each the indices of its samples, in order; empty: a padding pack) as micro-batches,
        each padded to exactly ``capacity`` tokens (pipeline stages exchange activations of one fixed
        shape); samples longer than it are cut to it. ``seqs``, ``target_masks`` and ``routing`` are
        looked up by those indices: the whole batch, or only this rank's samples by index.
        ``routing[i]``: sample i's experts to replay (``[len(seqs[i]) - 1, moe_layers, k]``, or None),
        mapped through the packing."""
        out = []
        for ids in packs:
            mb = MicroBatch.from_pack(
                build_pack(
                    [seqs[i] for i in ids],
                    sample_ids=tuple(ids),
                    max_len=capacity,
                    multiple=capacity,
                    sample_multiple=sample_multiple,
                    target_masks=None if target_masks is None else [target_masks[i] for i in ids],
                )
            )
            if routing is not None:
                from mars_megatron.training.routing_replay import pack_routing

                assert mb.pack is not None
                rows = pack_routing(
                    [routing[i] for i in mb.pack.sample_ids],
                    mb.pack.sample_spans,
                    mb.pack.length,
                    sum(self.arch.moe_layers),
                    self.arch.moe_topk,
                )
                mb = dataclasses.replace(mb, routing=rows)
            out.append(mb)
        return out

    @torch.no_grad()
    def forward_logprobs(
        self,
        micro_batches: list[MicroBatch],
        *,
        record_routing: dict | None = None,
        replay_routing: dict | None = None,
    ) -> list[torch.Tensor] | None:
        """Per-token log-probs ``[1, T]`` of each micro-batch under the current weights (e.g. the old
        policy before an update); on the last pipeline stage, ``None`` elsewhere.

        Routing (MoE, engine built with ``routing_replay``): ``replay_routing`` replays a store recorded
        earlier (R2); otherwise a micro-batch's ``routing`` is replayed (R3), or the routers choose.
        ``record_routing`` collects the routing this rank used, per pack, into the given store."""
        self.model.eval()
        sink: list[tuple[torch.Tensor, MicroBatch]] = []
        with self._routing(record_routing, replay_routing, recompute=False, measure=True):
            self._run(micro_batches, lm_loss, forward_only=True, sink=sink)
        return self._full_logprobs(sink) if self._on_last_stage() else None

    @contextlib.contextmanager
    def _routing(
        self, record: dict | None, source: dict | None, *, recompute: bool, measure: bool = False
    ) -> Iterator[None]:
        if (record is not None or source is not None) and self.replay is None:
            raise RuntimeError("routing record/replay needs an engine built with routing_replay=True")
        self._routing_record, self._routing_source = record, source
        if self.replay is not None:
            self.replay.set_recompute(recompute)
            self.replay.set_measure(measure)
        try:
            yield
        finally:
            self._routing_record = self._routing_source = None
            if self.replay is not None:
                self.replay.free()
                self.replay.set_recompute(False)
                self.replay.set_measure(False)

    def routing_changes(self) -> tuple[int, int]:
        """Replayed routing decisions in this rank's scoring forwards (``logprobs``,
        ``forward_logprobs``, and ``step`` when asked to measure) since the last call, and how many of
        them the routers, left free, would have sent to other experts; (0, 0) without routing replay."""
        return self.replay.changes() if self.replay is not None else (0, 0)

    def train_step(
        self,
        seqs: Sequence[Sequence[int]],
        loss_fn: LossFn = lm_loss,
        *,
        pack_length: int,
        target_masks: Sequence[Sequence[float]] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the global batch ``seqs``, packed into sequences of ``pack_length``.

        ``target_masks[i]`` (``len(seqs[i]) - 1`` entries) selects the targets trained on (e.g. only the
        response); ``loss_fn`` sees each pack as a :class:`MicroBatch` whose ``pack`` says where each
        sample sits. Returns the token-mean loss over the whole global batch and the gradient norm, on
        every rank.
        """
        plan = self.plan([len(s) for s in seqs], pack_length)
        return self.step(self.rank_packs(seqs, plan, target_masks), loss_fn)

    def step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn = lm_loss,
        *,
        replay_routing: dict | None = None,
        measure_routing: bool = False,
    ) -> dict[str, float]:
        """Forward/backward over this rank's micro-batches and one optimizer step (collective).
        ``replay_routing``: a store recorded by :meth:`forward_logprobs` (R2); micro-batches that carry
        ``routing`` replay it (R3). ``measure_routing``: count replayed decisions the routers would have
        changed in this forward (:meth:`routing_changes`), as the scoring forwards do."""
        if self.optimizer is None:
            raise RuntimeError("engine was built without an optimizer config")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self._routing(None, replay_routing, recompute=self.recompute == "full", measure=measure_routing):
            reduced = self._run(micro_batches, loss_fn, forward_only=False)
        loss_sum = sum(float(r["loss_sum"]) for r in reduced) if reduced else 0.0
        tokens = sum(float(r["tokens"]) for r in reduced) if reduced else 0.0
        # one all-reduce: the global loss and token sums for the log, and how many ranks saw a NaN/inf
        loss_sum, tokens, bad_ranks = self.sum_over_replicas(
            [loss_sum, tokens], contribute=True, extra=[float(self._nonfinite_here(loss_sum))]
        )
        if bad_ranks == 0:
            ok, grad_norm, _ = self.optimizer.step()
            skipped = 0.0
        else:
            # A NaN/inf loss or gradient on any rank: drop this step rather than poison the weights and
            # the optimizer state; the run goes on with the next batch.
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.skipped_steps += 1
            ok, grad_norm, skipped = False, None, 1.0
        return {
            "loss": loss_sum / max(tokens, 1.0),
            "tokens": tokens,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_ok": float(bool(ok)),
            "skipped": skipped,
            "skipped_steps": float(self.skipped_steps),
        }

    def _nonfinite_here(self, local_loss_sum: float) -> bool:
        """Whether this rank's loss or any of its gradients is NaN/inf."""
        if not math.isfinite(local_loss_sum):
            return True
        buffers = [*self.model.buffers, *self.model.expert_parallel_buffers]
        return any(not bool(torch.isfinite(b.grad_data).all()) for b in buffers)


def _on_device(mb: MicroBatch) -> MicroBatch:
    """The micro-batch's tensors on this rank's GPU (a no-op on CPU)."""
    if not torch.cuda.is_available():
        return mb
    device = torch.device("cuda", torch.cuda.current_device())
    return MicroBatch(
        mb.tokens.to(device),
        mb.position_ids.to(device),
        mb.targets.to(device),
        mb.loss_mask.to(device),
        mb.lengths,
        mb.pack,
        None if mb.cp_index is None else mb.cp_index.to(device),
        None if mb.routing is None else mb.routing.to(device),
    )


def _thd(mb: MicroBatch) -> Any:
    params = mb.pack.packed_seq_params()  # type: ignore[union-attr]
    if torch.cuda.is_available():
        params.cu_seqlens_q = params.cu_seqlens_q.cuda()
        params.cu_seqlens_kv = params.cu_seqlens_kv.cuda()
    return params
