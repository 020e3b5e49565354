"""The transfer channel on its own: bucket plans (pure), and real gloo groups between spawned processes:
every receiver gets every tensor bit for bit, each end holds at most two buckets, and a receiver that
dies mid-transfer makes the sender and the other receivers fail at once instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

from mars_megatron.transfer.group import GroupSpec, host_store
from mars_megatron.transfer.plan import ALIGN, TensorSpec, plan_buckets, unpack
from tests.transfer_workers import receive, send


def _specs(layers: int = 4, senders: tuple[int, ...] = (0,)) -> list[TensorSpec]:
    """A little model in export order: embedding, per layer attention + MLP (MLP split over senders as
    expert-parallel ranks would), head."""
    out = [TensorSpec("model.embed_tokens.weight", (64, 16), "float32", 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            TensorSpec(p + "self_attn.q_proj.weight", (16, 16), "float32", 0),
            TensorSpec(p + "input_layernorm.weight", (16,), "float32", 0),
        ]
        for k, s in enumerate(senders):
            out.append(TensorSpec(p + f"mlp.experts.{k}.up_proj.weight", (32, 16), "bfloat16", s))
    out.append(TensorSpec("lm_head.weight", (64, 16), "float32", 0))
    return out


def test_buckets_keep_layers_whole_and_fit() -> None:
    specs = _specs(layers=6)
    layer_bytes = 16 * 16 * 4 + ALIGN + 32 * 16 * 2  # q_proj + padded norm + expert
    plan = plan_buckets(specs, 2 * layer_bytes + 100)
    assert [t.name for t in plan.tensors] == [t.name for t in specs]
    assert sum(len(b.tensors) for b in plan.buckets) == len(specs)
    for b in plan.buckets:
        assert b.nbytes <= plan.bucket_bytes or len(b.tensors) == 1
        layers = {t.layer for t in b.tensors} - {None}
        for layer in layers:  # a layer in a bucket is the whole layer
            assert sum(t.layer == layer for t in b.tensors) == 3
        assert all(off % ALIGN == 0 for off in b.offsets)
    assert [b.due for b in plan.buckets] == sorted(b.due for b in plan.buckets)


def test_a_tensor_larger_than_a_bucket_travels_alone() -> None:
    specs = [TensorSpec("a", (10,), "float32", 0), TensorSpec("b", (1000,), "float32", 0)]
    specs.append(TensorSpec("c", (10,), "float32", 0))
    plan = plan_buckets(specs, 256)
    assert [[t.name for t in b.tensors] for b in plan.buckets] == [["a"], ["b"], ["c"]]
    assert plan.largest_bucket == 4000 + 32  # aligned up to 64 bytes


def test_each_sender_fills_its_own_buckets_in_export_order() -> None:
    plan = plan_buckets(_specs(layers=3, senders=(0, 5)), 4096)
    assert plan.senders == (0, 5)
    for b in plan.buckets:
        assert {t.sender for t in b.tensors} == {b.sender}
    order = {t.name: i for i, t in enumerate(plan.tensors)}
    for s in plan.senders:  # a sender's tensors go out in export order, each bucket after all of its tensors
        names = [t.name for b in plan.buckets_of(s) for t in b.tensors]
        assert names == sorted(names, key=order.__getitem__)
        for b in plan.buckets_of(s):
            assert b.due > max(order[t.name] for t in b.tensors)


def test_unpack_views_the_buffer_without_copies() -> None:
    plan = plan_buckets(_specs(layers=1), 1 << 20)
    (bucket,) = plan.buckets
    buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    named = dict(unpack(bucket, buf))
    named["model.layers.0.mlp.experts.0.up_proj.weight"].fill_(1.0)
    assert named["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert int(buf.count_nonzero()) > 0 and named["lm_head.weight"].shape == (64, 16)


def test_plan_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(_specs(), 8)
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets(_specs()[:2] * 2, 4096)
    with pytest.raises(ValueError, match="world"):
        GroupSpec("127.0.0.1", 1, "k", 1, "gloo")
    with pytest.raises(ValueError, match="backend"):
        GroupSpec("127.0.0.1", 1, "k", 2, "mpi")


def _run(plan, receivers: int, die: int = -1, die_at_bucket: int = -1, timeout_s: float = 60.0):
    store = host_store("127.0.0.1", timeout_s)
    groups = {
        s: GroupSpec("127.0.0.1", store.port, f"test/{time.time_ns()}/s{s}", 1 + receivers, "gloo", timeout_s)
        for s in plan.senders
    }
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=send, args=(groups, plan, s, out)) for s in plan.senders]
    procs += [
        ctx.Process(target=receive, args=(groups, plan, 1 + r, out, die_at_bucket if r == die else -1))
        for r in range(receivers)
    ]
    for p in procs:
        p.start()
    results = []
    expected = len(procs) - (1 if die >= 0 else 0)
    try:
        while len(results) < expected:
            results.append(out.get(timeout=timeout_s + 30))
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results, store


@pytest.mark.multiproc
@pytest.mark.parametrize("senders", [(0,), (0, 1)])
def test_every_receiver_gets_every_tensor_within_two_buckets(senders: tuple[int, ...]) -> None:
    plan = plan_buckets(_specs(layers=8, senders=senders), 4 * 1024)
    assert len(plan.buckets) > 4
    results, _ = _run(plan, receivers=3)
    assert len(results) == len(senders) + 3, results
    errors = [r for r in results if r[0] != "ok"]
    assert not errors, errors[0][1]
    sent = [r[1] for r in results if len(r) == 2]
    got = [(r[1], r[2]) for r in results if len(r) == 3]
    assert sum(s.tensors for s in sent) == len(plan.tensors)
    for stats, mismatches in got:
        assert mismatches == 0 and stats.tensors == len(plan.tensors) and stats.bytes == plan.nbytes
        assert stats.peak_bytes <= 2 * plan.largest_bucket  # the next bucket on the wire, this one loading
    for s in sent:
        assert s.peak_bytes <= 2 * plan.largest_bucket


@pytest.mark.multiproc
def test_a_receiver_dying_mid_transfer_fails_everyone_at_once() -> None:
    plan = plan_buckets(_specs(layers=8), 4 * 1024)
    start = time.perf_counter()
    results, _ = _run(plan, receivers=3, die=1, die_at_bucket=2, timeout_s=120.0)
    took = time.perf_counter() - start
    assert len(results) == 3 and all(r[0] == "error" for r in results), results
    assert all("TransferAborted" in r[1] for r in results), results  # what the fleet handles
    assert took < 60, f"the others waited {took:.0f} s: they should fail on the broken connection"
