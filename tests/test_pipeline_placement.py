"""Placement of trainer ranks and rollout engines with Ray placement groups, on Ray's logical GPUs (a CPU
machine reserves them exactly as a GPU node would): colocated ranks and engines share bundles and take
turns; disaggregated ones get their own. Real trainer ranks, engines and a real agentic run."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest

from mars_megatron.config import MarsConfig, load_config
from tests.pipeline_workers import RecordingEngine, events

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    import ray

    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _recording_engines(monkeypatch: pytest.MonkeyPatch, logs: Path) -> list[dict[str, Any]]:
    """Make ``mars train`` build :class:`RecordingEngine` (the transformers engine, logging its calls to
    ``logs/engine<i>``) where it would build its engines; returns, per engine, what the run's real recipe
    would have built it with."""
    from mars_megatron.rollout import factory

    real, built = factory.run_engine_recipe, []

    def recipe(cfg: MarsConfig, engine_dir: str) -> partial:
        kwargs = real(cfg, engine_dir).keywords
        built.append(kwargs)
        log = logs / f"engine{len(built) - 1}"
        return partial(RecordingEngine, str(log), engine_dir, dtype=kwargs["dtype"],
                       max_batch=kwargs["max_batch"], seed=kwargs["seed"])  # fmt: skip

    logs.mkdir()
    monkeypatch.setattr(factory, "run_engine_recipe", recipe)
    return built


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_trainer_ranks_and_engines_land_where_the_placement_says(
    cluster: None, sft_model: Path, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also what the engines go through (recorded by each engine): colocated ones sleep before every
    update, wake their weights for the push, then their KV cache, and only then decode again."""
    import ray

    from mars_megatron.rl.trainer import MarsRLTrainer, prepare

    built = _recording_engines(monkeypatch, tmp_path / "engines")

    cfg = load_config(
        REPO / "examples" / "tiny_cpu.yaml",
        [f"model.mcore_dir={sft_model}", f"data.train_file={REPO / 'examples/data/arith_train.jsonl'}",
         f"logging.run_dir={tmp_path / 'run'}", "pipeline.mode=agentic", f"pipeline.placement={mode}",
         "pipeline.rollout_workers=2", "data.problems_per_step=2", "agents.max_steps=3"],
    )  # fmt: skip
    with MarsRLTrainer(cfg, prepare(cfg, nproc=None, resume=None), log=print) as trainer:
        trainer.start()
        ranks = trainer.group.resources()
        engines = [ray.get(e.actor.resources.remote()) for _, e in trainer.workers]
        metrics = [trainer.train_step() for _ in range(2)]
        assert trainer.placement is not None
        bundles = trainer.placement.group.bundle_specs
    rank_gpus = [r["gpu_ids"] for r in ranks]
    engine_gpus = [r["gpu_ids"] for r in engines]
    share = 0.5 if mode == "colocated" else 1.0
    assert all(r["GPU"] == share for r in ranks + engines)  # each holds its share of one device
    assert all(len(g) == 1 for g in rank_gpus + engine_gpus)
    assert len({r["placement_group"] for r in ranks + engines}) == 1
    if mode == "colocated":  # rank i and engine i on the same device; two devices in all
        assert len(bundles) == 2 and rank_gpus == engine_gpus and len({g[0] for g in rank_gpus}) == 2
    else:  # four devices, none shared
        assert len(bundles) == 4 and len({g[0] for g in rank_gpus + engine_gpus}) == 4
    assert all(b == {"CPU": 1.0, "GPU": 1.0} for b in bundles)
    assert [m["policy_version"] for m in metrics] == [1.0, 2.0]
    if mode == "colocated":  # the engines slept through every update: no segment finished during one
        assert metrics[-1]["pipeline/segments_during_update"] == 0
    assert all(m["train/update_ok"] == 1.0 for m in metrics)
    # what the engines were built with: sleep mode and half a device when colocated, vLLM's 0.9 otherwise
    colocated = mode == "colocated"
    assert [(k["enable_sleep_mode"], k["gpu_memory_utilization"]) for k in built] == [
        (colocated, 0.5 if colocated else 0.9)
    ] * 2
    logs = [events(tmp_path / "engines" / f"engine{i}") for i in range(2)]
    update = ["sleep", "wake_weights", "update", "wake"] if colocated else ["update"]
    for log in logs:  # the first push at start, then one per update, in that order
        assert [e for e in log if e != "generate"] == ["update", *update, *update]
        if colocated:  # nothing decoded between a sleep and the wake after the push
            asleep = False
            for e in log:
                asleep = e == "sleep" or (asleep and e != "wake")
                assert not (asleep and e == "generate"), log


def test_a_placement_the_cluster_cannot_grant_names_what_is_missing(cluster: None) -> None:
    from mars_megatron.pipeline.placement import place

    with pytest.raises(
        RuntimeError, match=r"pipeline.placement=disaggregated: the cluster did not grant 6 x"
    ):
        place("disaggregated", 4, 2, timeout_s=2)


def test_disaggregated_engines_of_two_gpus(cluster: None) -> None:
    """rollout.tp = 2: each engine's bundle holds 2 of the 4 logical GPUs, trainer ranks keep 1 each."""
    import ray

    from mars_megatron.pipeline.placement import place

    placement = place("disaggregated", 2, 1, engine_gpus=2, timeout_s=30)
    try:
        assert placement.group.bundle_specs == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 2.0}]
        assert placement.resources() == {"num_cpus": 1.0, "num_gpus": 1.0}
        assert placement.engine_resources() == {"num_cpus": 1.0, "num_gpus": 2.0}
        gpu_ids = ray.remote(lambda: ray.get_gpu_ids())
        res = placement.engine_resources()
        ids = gpu_ids.options(**res, scheduling_strategy=placement.strategy(placement.engine_bundles[0]))
        assert len(ray.get(ids.remote())) == 2
    finally:
        placement.remove()
    with pytest.raises(ValueError, match="colocated engines take 1 device each"):
        place("colocated", 2, 2, engine_gpus=2)


def test_unplaced_engines_take_rollout_tp_gpus_when_the_cluster_has_room(cluster: None) -> None:
    """pipeline.placement=none: rollout.tp GPUs per engine beside the trainer ranks' (none here: this
    process has no CUDA), else 0 (the engines share the devices they see)."""
    from types import SimpleNamespace

    from mars_megatron.rl.trainer import MarsRLTrainer

    def gpus(tp: int, workers: int) -> int:
        cfg = load_config(
            None, ["rollout.engine=vllm", f"rollout.tp={tp}", f"pipeline.rollout_workers={workers}"]
        )
        trainer = SimpleNamespace(cfg=cfg, plan=SimpleNamespace(world_size=2), names=["shared"])
        return MarsRLTrainer._unplaced_engine_gpus(trainer)  # type: ignore[arg-type]

    assert (gpus(1, 1), gpus(2, 2), gpus(4, 1)) == (1, 2, 4)  # the cluster has 4 logical GPUs
    assert gpus(2, 3) == 0  # 6 > 4


def test_rollout_tp_reaches_vllm_as_tensor_parallel_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from mars_megatron.rollout import factory, vllm_engine

    seen: dict = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda model_dir, **kwargs: seen.update(kwargs))
    recipe = factory.engine_recipe(
        "vllm", "ckpt", dtype="bfloat16", seed=1, max_batch=8, tensor_parallel_size=4
    )
    recipe()
    assert seen["tensor_parallel_size"] == 4 and seen["quantization"] is None
    with pytest.raises(ValueError, match="the hf engine runs on one device"):
        factory.build_engine("hf", "ckpt", dtype="float32", seed=1, max_batch=8, tensor_parallel_size=2)
