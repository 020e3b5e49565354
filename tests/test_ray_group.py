"""Trainer ranks as Ray actors, and their weight push into rollout engines in actors of their own.

Real Ray (a local instance started here; run inside a loopback-only network namespace), real Megatron on
gloo, real transformers. One trainer group of 2 ranks (EP=2) is shared by the tests in file order.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from mars_megatron.agents.sample import RoutingRef, Sample, fetch_routing  # noqa: E402
from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors  # noqa: E402
from mars_megatron.models.hf_config import load_hf_config  # noqa: E402
from mars_megatron.models.presets import init_model  # noqa: E402
from mars_megatron.rollout.batch import OutputBatch, RequestBatch  # noqa: E402
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams  # noqa: E402
from mars_megatron.rollout.hf_engine import HFEngine  # noqa: E402
from mars_megatron.training import parallel  # noqa: E402
from mars_megatron.training.ray_group import (  # noqa: E402
    LocalWorkerGroup,
    RankError,
    RayWorkerGroup,
    make_worker_group,
)
from tests.ray_workers import PromptEcho, TrainerRank, start_fleet, train_once  # noqa: E402

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


def test_weight_push_through_the_fleet_matches_the_trainer(group: RayWorkerGroup, moe: Path) -> None:
    """The trainer's ranks (actors, EP=2: two senders) broadcast their buckets to two HFEngines in actors
    of their own; both then decode what the trainer computes, and the version moved once for both."""
    factory = functools.partial(HFEngine, str(moe), seed=0)
    fleet = start_fleet(group, [factory, factory], factory)
    one, two = fleet.engines[0][1], fleet.engines[1][1]
    try:
        before = one.generate(REQUESTS)
        group.call("train_step", TRAIN, **STEP)
        report = fleet.push_weights({"policy": 1})["policy"]
        after, after_two = one.generate(REQUESTS), two.generate(REQUESTS)

        full = [p + o.token_ids for p, o in zip(PROMPTS, after, strict=True)]
        trainer = group.call("logprobs", full, 2)[0]
        for p, o, o_two, b, lp in zip(PROMPTS, after, after_two, before, trainer, strict=True):
            assert len(o.token_ids) == 8
            torch.testing.assert_close(
                torch.tensor(o.logprobs), torch.tensor(lp[len(p) - 1 :]), rtol=0, atol=1e-4
            )
            assert (o_two.token_ids, o_two.logprobs) == (o.token_ids, o.logprobs)
            assert max(abs(x - y) for x, y in zip(o.logprobs, b.logprobs, strict=False)) > 1e-3

        shapes = expected_hf_tensors(load_hf_config(moe))
        total = sum(torch.Size(s).numel() * 4 for s in shapes.values())  # fp32
        assert fleet.plans["policy"].senders == (0, 1)  # EP=2: each expert-parallel rank sends its experts
        assert (report.version, report.engines, report.bytes, report.recovered) == (1, 2, total, 0)
        last = one.last_update()
        assert (last.tensors, last.bytes, last.buckets) == (
            len(shapes),
            total,
            len(fleet.plans["policy"].buckets),
        )
        assert last.buckets > 10  # 64 KiB buckets
        assert one.version() == two.version() == 1 and fleet.versions == {"policy": 1}
    finally:
        fleet.close()


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


def test_each_rank_receives_its_own_arguments(group: RayWorkerGroup) -> None:
    """``call_async_each``: rank r gets ``args[r]`` (a data-parallel share), nothing of the others'."""
    shares = [([1, 2],), ([3],)]
    assert group.wait(group.call_async_each("received", shares)) == [(0, [1, 2]), (1, [3])]
    same = ([4, 5],)  # ranks of one replica pass one tuple: stored once, received by both
    assert group.wait(group.call_async_each("received", [same, same])) == [(0, [4, 5]), (1, [4, 5])]
    with pytest.raises(ValueError, match="1 argument tuples for 2 ranks"):
        group.call_async_each("received", [same])


@ray.remote
class _RoutingEngine:
    """Stands in for a rollout actor: its outputs as ``RolloutActor.generate_versioned`` returns them."""

    def output(self) -> GenerationOutput:
        routing = np.arange(16, dtype=np.uint8).reshape(4, 2, 2)  # 3 prompt + 2 new tokens: 4 positions
        out = GenerationOutput("s", [1, 2], [-0.5, 1e-7], "stop", routed_experts=routing)
        (only,) = OutputBatch.of([out], routing_by_reference=True).outputs()
        return only


def test_routing_stays_in_the_engines_store_until_a_rank_fetches_it(cluster: None) -> None:
    """R3 routing (98 % of a Qwen3-MoE batch) never passes through the driver: the engine's actor puts it
    in its object store, the record holds the reference (checked by shape), and the trainer rank that
    trains the sample fetches it; if the engine died first, the loss is named."""
    engine = _RoutingEngine.remote()  # type: ignore[attr-defined]
    out = ray.get(engine.output.remote())
    assert isinstance(out.routed_experts, RoutingRef) and out.routed_experts.shape == (4, 2, 2)
    # the record's types on the wire; an engine's float32 log-probs keep every bit
    assert out.token_ids.dtype == np.int32 and out.logprobs.dtype == np.float32
    assert out.logprobs.tolist() == [-0.5, float(np.float32(1e-7))]
    s = Sample([7, 8, 9], [], "solver", "p", sample_id="s")
    s.add_segment(out.token_ids, out.logprobs, 0, out.routed_experts)
    with pytest.raises(ValueError, match="fetch_routing before saving"):
        s.state()
    assert fetch_routing([s]) == 16 and isinstance(s.routed_experts, np.ndarray)
    assert s.routed_experts.tolist() == np.arange(16).reshape(4, 2, 2).tolist()
    assert fetch_routing([s]) == 0 and s.state()["routing"] is s.routed_experts  # fetched once
    with pytest.raises(ValueError, match=r"routed_experts has shape \(4, 2, 2\), expected \(5,"):
        Sample([7, 8, 9, 10], [], "solver", "p", sample_id="x").add_segment(
            [1, 2], [0.0, 0.0], 0, out.routed_experts
        )

    out = ray.get(engine.output.remote())
    ray.kill(engine, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):  # returns once the actor is known dead
        ray.get(engine.output.remote(), timeout=60)
    # Ray frees the dead owner's objects once its death reaches the object store (about a second here):
    # until then a fetch still finds them
    deadline = time.monotonic() + 60
    while True:
        lost = Sample([7, 8, 9], [], "solver", "p", sample_id="lost")
        lost.add_segment(out.token_ids, out.logprobs, 0, out.routed_experts)
        try:
            fetch_routing([lost], timeout_s=30)
        except RuntimeError as e:
            assert re.search(r"routing of 1 samples \(\['lost'\]\) is lost: the rollout engine", str(e))
            break
        del lost  # the fetched array pins the object
        assert time.monotonic() < deadline, "the dead engine's routing was never released"
        time.sleep(0.5)


def test_continuing_segments_name_their_context_in_the_store(cluster: None) -> None:
    """A sequence's later segments are sent as references to what the object store already holds (the
    latest result carries each cut output's next context): the engine sees every token of each context,
    and the driver sends each prompt once and no decoded token back. A context whose object is gone is
    named, and the same requests then go inline."""
    from mars_megatron.agents.graph_file import load_graph
    from mars_megatron.config import AgentsConfig
    from mars_megatron.evaluation.data import Problem
    from mars_megatron.pipeline.contexts import ContextIndex
    from mars_megatron.pipeline.scheduler import Limits, Scheduler, SeqState
    from mars_megatron.pipeline.simulate import Lengths, simple_prompts
    from mars_megatron.rollout.batch import ContextLostError
    from mars_megatron.rollout.ray_engine import RolloutActor

    graph = load_graph("marsrl")
    lengths = Lengths(dict.fromkeys(graph.roles, 8), sigma=0.5, prompt_tokens=4)
    limits = Limits(12, 3, dict.fromkeys(graph.roles, 1), 2, 4, False)  # 12-token outputs, 3 a segment
    agents = AgentsConfig(group_size=2, inputs_per_agent=1, max_steps=3)
    s = Scheduler(agents, limits, simple_prompts(lengths), graph, seed=0)
    s.add_problems(Problem(f"p{i}", f"q{i}", "1", i + 1) for i in range(2))
    engine = ray.remote(RolloutActor).remote(PromptEcho)  # type: ignore[attr-defined]
    index, sampling = ContextIndex(), SamplingParams(max_tokens=3)

    def call(jobs: list) -> tuple:
        batch = index.request_batch(jobs, sampling)
        return batch, engine.generate_versioned.remote(batch)

    inline = first_prompts = continued = 0
    for _ in range(40):
        jobs = s.take_segments(4)
        assert jobs, f"the schedule ran dry: {s.stats()}"
        if continued >= 8 and any(len(j.prefix) for j in jobs):
            break  # these go to the second part
        batch, result = call(jobs)
        outputs, _ = ray.get(result)
        for i, (job, out) in enumerate(zip(jobs, outputs.outputs(), strict=True)):
            assert out.extra["prompt"] == job.context().tolist()  # every token, in order
            sent_inline = batch.offsets[i + 1] - batch.offsets[i]
            first_prompts += 0 if len(job.prefix) else len(job.prompt_ids)
            continued += bool(len(job.prefix))
            assert sent_inline == (0 if len(job.prefix) else len(job.prompt_ids))
            inline += sent_inline
            if s.on_segment(job.sample_id, out.token_ids, out.logprobs, stopped=len(job.prefix) >= 6):
                s.on_scored(job.sample_id, 1.0, True if job.role == "verifier" else None)
        index.received(outputs, result, s)
        carried = {sid for sid, q in s.samples.items() if s.state(sid) is SeqState.READY and q.response_len}
        assert carried <= {sid for sid in s.samples if sid in index}  # each one's next call names it
    assert continued >= 8 and inline == first_prompts

    # objects a call's requests name are lost (here: their owner dies; on a cluster, their node): the call
    # fails naming them, and the same jobs then go inline (the driver forgets, requeues, sends again)
    s.requeue([j.sample_id for j in jobs if not len(j.prefix)])
    jobs = [j for j in jobs if len(j.prefix)]
    owner = _Owner.remote()  # type: ignore[attr-defined]
    held, spans, contexts = ray.get(owner.relay.remote(engine, ContextIndex().request_batch(jobs, sampling)))
    named = RequestBatch.of(
        [j.sample_id for j in jobs], [()] * len(jobs), [3] * len(jobs), [None] * len(jobs), sampling,
        sources=(held,), spans=[(0, a, b) for a, b in spans],
    )  # fmt: skip
    outputs, _ = ray.get(engine.generate_versioned.remote(named))
    assert [o.extra["prompt"] for o in outputs.outputs()] == contexts
    ray.kill(owner, no_restart=True)
    deadline = time.monotonic() + 60
    while True:  # the owner's death reaches the object directory within a second or so
        try:
            ray.get(engine.generate_versioned.remote(named), timeout=120)
        except ContextLostError as e:
            assert re.search(rf"context of requests {jobs[0].sample_id}.* is not in the object store", str(e))
            break
        assert time.monotonic() < deadline, "the dead owner's object was never reported lost"
        time.sleep(0.5)
    index.forget([j.sample_id for j in jobs])
    batch, result = call(jobs)
    assert not batch.sources and len(batch.tokens) == sum(len(j.context()) for j in jobs)
    outputs, _ = ray.get(result)
    assert [o.extra["prompt"] for o in outputs.outputs()] == [j.context().tolist() for j in jobs]


@ray.remote
class _Owner:
    def relay(self, engine: Any, batch: RequestBatch) -> tuple:
        """An engine call's result, put in the store by this actor, which then owns it: the reference
        comes back (in a tuple, so it stays one) with where each output's next context is and its tokens,
        not the result itself."""
        result = ray.get(engine.generate_versioned.remote(batch))
        spans = [result[0].next_context(i) for i in range(len(batch))]
        return ray.put(result), spans, [result[0].carried[a:b].tolist() for a, b in spans]


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


def test_group_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        make_worker_group("slurm", TrainerRank, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        LocalWorkerGroup(TrainerRank, 2)


class _Sleeper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_a_wait_past_its_deadline_names_what_it_waited_for(cluster: None) -> None:
    from mars_megatron import deadline

    sleeper = ray.remote(_Sleeper).options(num_cpus=0).remote()
    assert deadline.get(sleeper.nap.remote(0.0), "a quick nap", 60) == 0.0
    started = time.monotonic()
    with pytest.raises(deadline.DeadlineError) as err:
        deadline.get(sleeper.nap.remote(30.0), "the sleeper's nap", 0.5, "pipeline.rollout_timeout_s")
    assert time.monotonic() - started < 10
    assert str(err.value) == "the sleeper's nap: no answer within 0.5 s (pipeline.rollout_timeout_s)"
    ray.kill(sleeper)


def test_the_network_interface_asked_for_is_bound_and_a_missing_one_is_named(cluster: None) -> None:
    """``pipeline.network_interface`` reaches every rank's gloo and NCCL; a node without the interface
    fails the group's start, naming the setting and what the node has."""
    from tests.ray_workers import SocketsRank

    with RayWorkerGroup(SocketsRank, 2, threads_per_rank=1, socket_ifname="lo") as g:
        assert g.call("sockets") == [("lo", "lo", 2.0), ("lo", "lo", 2.0)]
    with RayWorkerGroup(SocketsRank, 2, threads_per_rank=1) as g:  # loopback: one node
        assert g.call("sockets") == [("lo", None, 2.0), ("lo", None, 2.0)]
    with pytest.raises(RankError, match=r"pipeline\.network_interface: \S+ has no interface 'nosuch0' "
                       r"with an IPv4 address \(it has: .*lo.*\)"):  # fmt: skip
        RayWorkerGroup(SocketsRank, 2, threads_per_rank=1, socket_ifname="nosuch0")


def test_a_group_waiting_for_resources_asks_while_waiting_and_stops_when_it_raises(cluster: None) -> None:
    """A run rebuilding its trainer after a link cut waited out the whole placement timeout for a node Ray
    counted dead meanwhile; now the wait asks the run every few seconds (it checks its lost nodes)."""
    from tests.ray_workers import SocketsRank

    asked = []

    def lost() -> None:
        asked.append(time.monotonic())
        raise RuntimeError("node mars-node2 is lost")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="node mars-node2 is lost"):
        RayWorkerGroup(SocketsRank, 2, num_cpus_per_rank=3, ready_timeout_s=300, while_waiting=lost)
    assert len(asked) == 1 and asked[0] - started < 15
    with RayWorkerGroup(SocketsRank, 2, threads_per_rank=1) as g:  # the resources were given back
        assert [total for _, _, total in g.call("sockets")] == [2.0, 2.0]
