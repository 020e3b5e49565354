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

    from mars_megatron.pipeline.trainer import MarsRLTrainer, prepare

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
        engines = [ray.get(e.actor.resources.remote()) for _, e in trainer.fleet.engines]
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


def test_every_bundle_is_one_device_and_multi_gpu_engines_span_several() -> None:
    """vLLM's Ray executor refuses bundles of more than one GPU, so an engine of rollout.tp GPUs spans
    rollout.tp one-device bundles: after the trainer's (disaggregated) or over them (colocated)."""
    from mars_megatron.pipeline.placement import layout

    assert layout("disaggregated", 2, 2, 2) == (6, [0, 1], [(2, 3), (4, 5)])
    assert layout("disaggregated", 2, 3, 1) == (5, [0, 1], [(2,), (3,), (4,)])
    assert layout("colocated", 4, 2, 2) == (4, [0, 1, 2, 3], [(0, 1), (2, 3)])
    assert layout("colocated", 2, 2, 1) == (2, [0, 1], [(0,), (1,)])
    assert layout("colocated", 1, 1, 4) == (4, [0], [(0, 1, 2, 3)])  # engine GPUs beyond the trainer's
    with pytest.raises(ValueError, match="engines take >= 1 device each"):
        layout("colocated", 2, 2, 0)
    with pytest.raises(ValueError, match=r"pipeline\.placement must be 'colocated' or 'disaggregated'"):
        layout("spread", 2, 2, 1)  # type: ignore[arg-type]


def test_placement_none_gives_vllm_engines_gpus_of_their_own_or_refuses() -> None:
    """An actor asking Ray for no GPU sees every device of its node (Ray leaves CUDA_VISIBLE_DEVICES
    unset: measured on this machine's Ray), so a vLLM engine without GPUs of its own would start on GPU 0
    beside trainer rank 0."""
    from mars_megatron.config import ConfigError
    from mars_megatron.pipeline.placement import unplaced_gpus, unplaced_launch

    assert unplaced_gpus(4, 2, 2, 1, vllm=True) == 1
    assert unplaced_gpus(8, 2, 3, 2, vllm=True) == 2
    assert unplaced_gpus(0, 2, 2, 1, vllm=True) == 0  # a CPU cluster
    assert unplaced_gpus(1, 2, 2, 1, vllm=False) == 0  # transformers engines run on the host
    refusal = (
        r"pipeline.placement: 'none' on a Ray cluster of 4 GPUs: 2 trainer ranks and 2 vLLM engines of "
        r"rollout.tp=2 need 6 GPUs .* pipeline.placement=colocated"
    )
    with pytest.raises(ConfigError, match=refusal):
        unplaced_gpus(4, 2, 2, 2, vllm=True)
    assert unplaced_launch(1, 1).num_gpus == 1.0
    assert unplaced_launch(2, 2).num_gpus == 0.0  # vLLM's Ray executor reserves the 2 GPUs itself
    assert unplaced_launch(1, 0).num_gpus == 0.0


def _start(cluster_cfg: list[str], sft_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Start `mars train`'s actors for ``cluster_cfg`` (no step), and report where each landed: Ray's
    resources, GPU ids and CUDA_VISIBLE_DEVICES of every trainer rank and engine, each engine's vLLM
    variables, and for multi-GPU engines the bundles vLLM's own executor code accepts and picks."""
    import ray

    from mars_megatron.pipeline.trainer import MarsRLTrainer, prepare

    _recording_engines(monkeypatch, tmp_path / "engines")
    cfg = load_config(
        REPO / "examples" / "tiny_cpu.yaml",
        [f"model.mcore_dir={sft_model}", f"data.train_file={REPO / 'examples/data/arith_train.jsonl'}",
         f"logging.run_dir={tmp_path / 'run'}", "rollout.engine=vllm", *cluster_cfg],
    )  # fmt: skip
    with MarsRLTrainer(cfg, prepare(cfg, nproc=None, resume=None), log=print) as trainer:
        ranks = trainer.group.resources()
        engines = [ray.get(e.actor.resources.remote()) for _, e in trainer.fleet.engines]
        free = ray.available_resources().get("GPU", 0.0)
        probes = []
        if cfg.rollout.tp > 1:
            from tests.pipeline_workers import VllmBundleProbe

            for i, engine in enumerate(engines):  # a probe placed and set up like engine i
                options: dict = {"num_cpus": 0, "runtime_env": {"env_vars": engine["vllm_env"]}}
                if trainer.placement is not None:
                    bundle = trainer.placement.engine_bundles[i][0]
                    options["scheduling_strategy"] = trainer.placement.strategy(bundle)
                probe = ray.remote(VllmBundleProbe).options(**options).remote()
                probes.append(ray.get(probe.bundles.remote(cfg.rollout.tp), timeout=120))
                ray.kill(probe)
        worker_gpus = []
        if trainer.placement is not None and cfg.rollout.tp > 1:  # vLLM's workers, placed as vLLM does
            gpu_ids = ray.remote(lambda: ray.get_gpu_ids())
            for engine in engines:
                share = float(engine["vllm_env"]["VLLM_RAY_PER_WORKER_GPUS"])
                bundles = [int(b) for b in engine["vllm_env"]["VLLM_RAY_BUNDLE_INDICES"].split(",")]
                worker_gpus.append([ray.get(gpu_ids.options(num_cpus=0, num_gpus=share,
                                                            scheduling_strategy=trainer.placement.strategy(b))
                                            .remote())[0] for b in bundles])  # fmt: skip
    return {"ranks": ranks, "engines": engines, "free": free, "probes": probes, "worker_gpus": worker_gpus}


def _visible(actors: list[dict]) -> list[str | None]:
    return [a["cuda_visible_devices"] for a in actors]


@pytest.mark.parametrize("mode", ["none", "colocated", "disaggregated"])
def test_one_gpu_engines_see_their_own_device(
    cluster: None, sft_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """rollout.tp = 1 on 4 logical GPUs, 2 trainer ranks and 2 vLLM engines: every actor sees exactly the
    device Ray gave it; colocated engine i shares rank i's, otherwise no two actors share one."""
    got = _start(
        [f"pipeline.placement={mode}", "pipeline.rollout_workers=2"], sft_model, tmp_path, monkeypatch
    )
    ranks, engines = got["ranks"], got["engines"]
    assert all(len(a["gpu_ids"]) == 1 for a in ranks + engines)
    assert _visible(ranks + engines) == [str(a["gpu_ids"][0]) for a in ranks + engines]
    share = 0.5 if mode == "colocated" else 1.0
    assert all(a["GPU"] == share for a in ranks + engines)
    if mode == "colocated":
        assert _visible(engines) == _visible(ranks) and len(set(_visible(ranks))) == 2
    else:
        assert len(set(_visible(ranks + engines))) == 4
    assert all(a["vllm_env"] == {} for a in engines)


@pytest.mark.parametrize("mode", ["none", "colocated", "disaggregated"])
def test_two_gpu_engines_take_one_bundle_per_vllm_worker(
    cluster: None, sft_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """rollout.tp = 2: the engine actor holds no GPU, and vLLM's own executor code accepts the placement
    and puts its 2 workers on the engine's bundles: the trainer ranks' devices when colocated, 2 others
    when disaggregated; without a placement group vLLM reserves 2 free GPUs itself (the 2 ranks hold 2)."""
    got = _start([f"pipeline.placement={mode}", "pipeline.rollout_workers=1", "rollout.tp=2"],
                 sft_model, tmp_path, monkeypatch)  # fmt: skip
    ranks, (engine,) = got["ranks"], got["engines"]
    assert engine.get("GPU", 0.0) == 0.0 and engine["gpu_ids"] == []
    rank_gpus = sorted(r["gpu_ids"][0] for r in ranks)
    if mode == "none":
        assert engine["vllm_env"] == {} and got["free"] == 2.0
        assert len(got["probes"][0]) == 2  # vLLM's own placement group of 2 one-GPU bundles
        return
    bundles = {"colocated": [0, 1], "disaggregated": [2, 3]}[mode]
    share = {"colocated": "0.5", "disaggregated": "1.0"}[mode]
    assert engine["vllm_env"] == {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles)),
                                  "VLLM_RAY_PER_WORKER_GPUS": share}  # fmt: skip
    assert got["probes"] == [bundles]
    workers = sorted(got["worker_gpus"][0])
    assert workers == rank_gpus if mode == "colocated" else not set(workers) & set(rank_gpus)


def test_vllm_refuses_the_old_multi_gpu_bundle(cluster: None) -> None:
    """What the executor code of the probe says of one bundle holding both of an engine's GPUs (the
    layout before engines had one bundle per worker): the refusal `mars train` met on GPUs."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tests.pipeline_workers import VllmBundleProbe

    group = placement_group([{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 2.0}])
    ray.get(group.ready(), timeout=60)
    try:
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=1)
        probe = ray.remote(VllmBundleProbe).options(num_cpus=0, scheduling_strategy=strategy).remote()
        assert ray.get(probe.bundles.remote(2), timeout=120) == (
            "refused: Placement group bundle cannot have more than 1 GPU."
        )
    finally:
        remove_placement_group(group)


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
