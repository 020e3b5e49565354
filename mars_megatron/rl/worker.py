"""One trainer rank of a MarsRL run: the Megatron policies of this rank and what the driver asks of them.

The driver starts one :class:`PolicyWorker` per rank (as Ray actors, or in-process for one rank) and calls
every method on all ranks at once: each call is collective. A run has one policy shared by all roles, or
one per role (``algorithm.policies=per_role``); methods take and return dicts keyed by policy name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.agents.roles import Role
from mars_megatron.algorithm.objective import LossConfig, make_loss_fn, packed_loss_inputs
from mars_megatron.algorithm.sample import Sample
from mars_megatron.config import MarsConfig
from mars_megatron.rollout.engine import WeightUpdatable
from mars_megatron.training import parallel as par
from mars_megatron.training.batches import MicroBatch


def loss_config(cfg: MarsConfig) -> LossConfig:
    a = cfg.algorithm
    return LossConfig(
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_kind,
        importance=a.importance,
        tis_cap=a.tis_cap,
        dmmpt=a.dmmpt,
        dmmpt_prob_threshold=a.dmmpt_prob_threshold,
        dmmpt_entropy_target=a.dmmpt_entropy_target,
        role_weights={Role(k): v for k, v in a.role_weights.items()},
    )


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


@dataclass
class _Policy:
    engine: Any  # MegatronEngine
    reference: Any | None  # frozen initial weights, for the KL penalty
    sync: Any  # WeightSync


class PolicyWorker:
    """Builds this rank's policies (weights from ``model_dir``) with their optimizers."""

    def __init__(self, cfg: MarsConfig, model_dir: str, names: Sequence[str]) -> None:
        from mars_megatron.jobs import load_engine

        par.init_model_parallel(cfg.parallel, cfg.train.seed)
        self.cfg = cfg
        self.model_dir = model_dir
        self.loss = loss_config(cfg)
        self.policies: dict[str, _Policy] = {}
        for name in names:
            engine = load_engine(
                model_dir,
                cfg.parallel,
                dtype=cfg.model.dtype,
                impl=cfg.model.transformer_impl,
                optimizer=cfg.optimizer,
                fp8=cfg.model.fp8,
                recompute=cfg.train.recompute,
            )
            reference = None
            if cfg.algorithm.kl_coef > 0:  # forward only: no recompute
                reference = load_engine(
                    model_dir,
                    cfg.parallel,
                    dtype=cfg.model.dtype,
                    impl=cfg.model.transformer_impl,
                    fp8=cfg.model.fp8,
                )
            self.policies[name] = _Policy(engine, reference, None)

    # ------------------------------------------------------------------------------------------ weights
    def attach_engines(self, engines: Mapping[str, WeightUpdatable]) -> None:
        """Rollout engines per policy; global rank 0 pushes the weights into them."""
        from mars_megatron.training.weight_sync import WeightSync

        for name, policy in self.policies.items():
            engine = engines[name] if dist.get_rank() == 0 else None
            policy.sync = WeightSync(policy.engine.arch, engine)

    def sync_weights(self, versions: Mapping[str, int]) -> dict[str, dict[str, float]]:
        """Push every policy's weights to its engine as policy version ``versions[name]`` (0: the initial
        weights; a resumed run pushes the restored weights under their saved version)."""
        out = {}
        for name, policy in self.policies.items():
            policy.sync.version = versions[name] - 1  # sync() counts one up
            stats = policy.sync.sync(policy.engine.model)
            out[name] = {
                "version": float(stats.version),
                "seconds": stats.seconds,
                "bytes": float(stats.bytes),
            }
        return out

    # --------------------------------------------------------------------------------------------- train
    def train(self, batches: Mapping[str, Sequence[Sample]]) -> dict[str, float]:
        """One rollout batch per policy: ``train.updates_per_batch`` optimizer steps on packed samples.

        Returns metrics prefixed ``train/`` (the last update's loss and grad norm; loss-term statistics
        averaged over this rank's micro-batches, so only rank 0's view of them — enough to watch a run).
        """
        out: dict[str, float] = {}
        for name, samples in batches.items():
            if not samples:
                continue
            prefix = "train/" if len(self.policies) == 1 else f"train/{name}/"
            for key, value in self._train_policy(self.policies[name], samples).items():
                out[prefix + key] = value
        return out

    def _train_policy(self, policy: _Policy, samples: Sequence[Sample]) -> dict[str, float]:
        engine = policy.engine
        pack_length = self.cfg.train.pack_length
        minis = split_groups(samples, self.cfg.train.updates_per_batch)
        packed = []
        for mini in minis:
            plan = engine.plan([len(s.tokens) for s in mini], pack_length)
            packed.append((mini, plan, engine.rank_packs([s.tokens for s in mini], plan)))
        # The "old" policy is the one before this batch's first update: score every mini-batch now.
        need_old = self.loss.importance != "pois"
        old = [engine.forward_logprobs(mbs) if need_old else None for _, _, mbs in packed]
        ref = [
            policy.reference.forward_logprobs(mbs) if policy.reference is not None else None
            for _, _, mbs in packed
        ]
        metrics: dict[str, float] = {}
        stats: list[dict[str, torch.Tensor]] = []
        truncated = 0
        for (mini, plan, mbs), old_lp, ref_lp in zip(packed, old, ref, strict=True):
            truncated += len(plan.truncated)
            # keyed by pack: a context-parallel rank's share of a micro-batch is a new MicroBatch
            index = {id(mb.pack): k for k, mb in enumerate(mbs)}

            def inputs_for(mb: MicroBatch, mini=mini, index=index, old_lp=old_lp, ref_lp=ref_lp):
                k = index[id(mb.pack)]
                assert mb.pack is not None
                return packed_loss_inputs(
                    mini,
                    mb.pack,
                    self.loss,
                    old_logprobs=old_lp[k] if old_lp is not None else None,
                    ref_logprobs=ref_lp[k] if ref_lp is not None else None,
                )

            metrics = engine.step(mbs, make_loss_fn(self.loss, inputs_for, stats))
        for key in stats[0] if stats else ():
            metrics[key] = float(torch.stack([s[key].detach().float() for s in stats]).mean())
        metrics["packs"] = float(sum(len(mbs) for _, _, mbs in packed))
        metrics["truncated_samples"] = float(truncated)
        return metrics

    # ---------------------------------------------------------------------------------------- checkpoint
    def save(self, directory: str) -> None:
        from mars_megatron.checkpoint.rank_state import save_rank_state
        from mars_megatron.jobs import tokenizer_dir

        assets = tokenizer_dir(self.model_dir)
        for name, policy in self.policies.items():
            save_rank_state(Path(directory), name, policy.engine, assets=assets)

    def load(self, directory: str) -> None:
        from mars_megatron.checkpoint.rank_state import load_rank_state

        for name, policy in self.policies.items():
            load_rank_state(Path(directory), name, policy.engine)

    def rank_info(self) -> dict[str, int]:
        from megatron.core import parallel_state as ps

        return {
            "rank": dist.get_rank(),
            "writer": int(
                ps.is_pipeline_last_stage()
                and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0
            ),
        }
