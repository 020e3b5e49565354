"""Trainer ranks as Ray actors, and weight sync into a rollout engine in its own actor.

Real Ray (a local instance started here; run inside a loopback-only network namespace), real Megatron on
gloo, real transformers. One trainer group of 2 ranks (EP=2) is shared by the tests in file order.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from checkpoints_conversion.qwen3_mapping import expected_hf_tensors  # noqa: E402
from mars_megatron.models.presets import init_model  # noqa: E402
from mars_megatron.rollout.engine import GenerationRequest, SamplingParams  # noqa: E402
from mars_megatron.rollout.hf_engine import HFEngine  # noqa: E402
from mars_megatron.rollout.ray_engine import RemoteEngine, _portable, start_rollout_actor  # noqa: E402
from mars_megatron.training import parallel  # noqa: E402
from mars_megatron.training.hf_config import load_hf_config  # noqa: E402
from mars_megatron.training.ray_group import (  # noqa: E402
    LocalWorkerGroup,
    RankError,
    RayWorkerGroup,
    make_worker_group,
)
from tests.ray_workers import TrainerRank, train_once  # noqa: E402

pytestmark = pytest.mark.multiproc

TRAIN = [[(7 * i + j) % 1000 for j in range(24)] for i in range(4)]
STEP = {"pack_length": 48}  # two samples per pack: one pack per DP rank
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 12, 13, 14, 15, 16]]
REQUESTS = [
    GenerationRequest(f"p{i}", tuple(p), SamplingParams(max_tokens=8, temperature=0))
    for i, p in enumerate(PROMPTS)
]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("raygroup") / "moe")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def group(cluster: None, moe: Path) -> Iterator[RayWorkerGroup]:
    g = RayWorkerGroup(TrainerRank, 2, str(moe), {"ep": 2}, threads_per_rank=1)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def reference_step(moe: Path) -> list[dict]:
    """The first step's metrics on 2 processes spawned by ``parallel.launch`` (same layout)."""
    return parallel.launch(train_once, 2, str(moe), {"ep": 2}, TRAIN, STEP, timeout_s=300)


def test_ray_ranks_train_like_spawned_processes(group: RayWorkerGroup, reference_step: list[dict]) -> None:
    info = group.call("describe")
    assert [i["rank"] for i in info] == [0, 1] and {i["world"] for i in info} == {2}
    assert {i["backend"] for i in info} == {"gloo"} and len({i["pid"] for i in info}) == 2
    assert [i["env"] for i in info] == [
        {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r)} for r in range(2)
    ]
    assert {i["threads"] for i in info} == {1}
    steps = group.call("train_step", TRAIN, **STEP)
    for got, want in zip(steps, reference_step, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-6 and abs(got["grad_norm"] - want["grad_norm"]) <= 1e-6
    assert steps[0]["loss"] == steps[1]["loss"]


def test_weight_sync_through_ray_matches_the_trainer(group: RayWorkerGroup, moe: Path) -> None:
    """Trainer rank 0 (an actor) pushes its weights into an HFEngine in another actor through the proxy;
    a second engine gets the same weights in many small buckets and must end up identical."""
    factory = functools.partial(HFEngine, str(moe), seed=0)
    one = start_rollout_actor(factory, threads=1)
    many_actor = start_rollout_actor(factory, threads=1).actor
    many = RemoteEngine(many_actor, bucket_bytes=16 * 1024)
    try:
        before = one.generate(REQUESTS)
        group.call("train_step", TRAIN, **STEP)
        stats = group.call("push_weights", one)
        group.call("push_weights", many)
        after, after_many = one.generate(REQUESTS), many.generate(REQUESTS)

        full = [p + o.token_ids for p, o in zip(PROMPTS, after, strict=True)]
        trainer = group.call("logprobs", full, 2)[0]
        for p, o, o_many, b, lp in zip(PROMPTS, after, after_many, before, trainer, strict=True):
            assert len(o.token_ids) == 8
            torch.testing.assert_close(
                torch.tensor(o.logprobs), torch.tensor(lp[len(p) - 1 :]), rtol=0, atol=1e-4
            )
            assert (o_many.token_ids, o_many.logprobs) == (o.token_ids, o.logprobs)
            assert max(abs(x - y) for x, y in zip(o.logprobs, b.logprobs, strict=False)) > 1e-3

        shapes = expected_hf_tensors(load_hf_config(moe))
        total = sum(torch.Size(s).numel() * 4 for s in shapes.values())  # fp32
        assert stats[0].tensors == len(shapes) and stats[0].bytes == total
        last_one, last_many = one.last_update(), many.last_update()
        assert (last_one.buckets, last_one.tensors, last_one.bytes) == (1, len(shapes), total)
        assert last_many.tensors == len(shapes) and last_many.bytes == total
        largest_tensor = max(torch.Size(s).numel() * 4 for s in shapes.values())
        assert last_many.buckets > 20 and last_many.largest_bucket <= max(16 * 1024, largest_tensor)
        assert one.version() == many.version() == 1
    finally:
        one.kill()
        many.kill()


def test_a_failing_rank_is_named_with_its_method(group: RayWorkerGroup) -> None:
    where = r"\[rank 1 of 2, in TrainerRank\.fail_on\]"
    with pytest.raises(RankError, match=rf"^ValueError: bad batch {where}") as e:
        group.call("fail_on", 1, "bad batch")
    assert isinstance(e.value, RuntimeError) and (e.value.rank, e.value.method) == (1, "TrainerRank.fail_on")
    assert "remote traceback" in str(e.value) and "raise ValueError(message)" in str(e.value)
    # nothing was left waiting in a collective, so the group still answers, one rank or all
    assert group.call_rank(0, "fail_on", 1, "x") == 0
    assert group.wait(group.call_async("fail_on", 5, "x")) == [0, 1]
    with pytest.raises(RankError, match=r"\[rank 0 of 2, in TrainerRank\.no_such_method\]"):
        group.call_rank(0, "no_such_method")


def test_local_group_runs_the_same_worker_in_process(moe: Path, reference_step: list[dict]) -> None:
    with make_worker_group("local", TrainerRank, 1, str(moe), {}, threads_per_rank=1) as g:
        assert isinstance(g, LocalWorkerGroup)
        info = g.call("describe")[0]
        assert (info["rank"], info["world"], info["env"]["RANK"]) == (0, 1, "0")
        step = g.call("train_step", TRAIN, **STEP)[0]
        # one process without expert parallelism trains the same model as the 2-rank EP=2 layout
        assert abs(step["loss"] - reference_step[0]["loss"]) <= 1e-5
        with pytest.raises(RankError, match=r"^ValueError: here \[rank 0 of 1, in TrainerRank\.fail_on\]"):
            g.call("fail_on", 0, "here")
    assert not torch.distributed.is_initialized()


def test_weights_travel_as_compact_cpu_tensors() -> None:
    """A view (e.g. into megatron's contiguous parameter buffer) would pickle its whole storage."""
    buffer = torch.arange(1000.0)
    view = buffer[10:20]
    sent = _portable(view)
    assert sent.untyped_storage().nbytes() == 40 and torch.equal(sent, view)
    transposed = _portable(buffer[:12].view(3, 4).t())
    assert transposed.is_contiguous() and transposed.untyped_storage().nbytes() == 48
    owned = torch.ones(3)
    assert _portable(owned).data_ptr() == owned.data_ptr()  # no copy when nothing needs compacting


def test_group_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        make_worker_group("slurm", TrainerRank, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        LocalWorkerGroup(TrainerRank, 2)
    with pytest.raises(ValueError, match="bucket_bytes"):
        RemoteEngine(None, bucket_bytes=0)
