"""The transfer groups' one wait primitive and their join, on gloo (the NCCL branch runs the same code):
a member that stops taking part fails every wait within the group's deadline, with
``TransferTimeout``, and the group is aborted; a member that joins but never takes part fails the join
(the warm-up broadcast), not the first push; a push's time covers the last bucket's completion.

In-process threads are the members (cheap): each builds its group on its own store connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mars_megatron.transfer.channel import receive_buckets, send_buckets
from mars_megatron.transfer.group import (
    BACKSTOP,
    STORE_PREFIX,
    GroupSpec,
    TransferAborted,
    TransferGroup,
    TransferTimeout,
    communicator_bytes,
    host_store,
)
from mars_megatron.transfer.plan import TensorSpec, plan_buckets

pytestmark = pytest.mark.multiproc  # gloo over loopback: run in the network namespace
TIMEOUT_S = 3.0
SLACK_S = 1.5  # scheduling on a loaded 2-core machine


@pytest.fixture(scope="module")
def store() -> Iterator[Any]:
    yield host_store("127.0.0.1", 60)


def _spec(store: Any, world: int) -> GroupSpec:
    return GroupSpec("127.0.0.1", store.port, f"wait/{time.time_ns()}", world, "gloo", TIMEOUT_S)


def _in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` in a thread; the returned callable joins it and returns (or raises) its outcome."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result() -> Any:
        thread.join(60)
        assert not thread.is_alive(), "member thread still running"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def _silent_member(spec: GroupSpec, rank: int) -> tuple[Any, Any]:
    """A member that connects to the group (its process group is built) and then takes part in
    nothing: a wedged engine worker. Its own gloo timeout is long, so only the others' deadline acts."""
    base = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=30))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=30)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{STORE_PREFIX}/{spec.key}", base), rank, spec.world, opts)
    return pg, base


def test_a_member_that_connects_but_never_takes_part_fails_the_join(store: Any) -> None:
    """The join ends with a warm-up broadcast, so the sender learns at join, within its deadline, that
    a member is not there: before, it joined and met the silent member at the first push."""
    spec = _spec(store, 2)
    silent = _in_thread(lambda: _silent_member(spec, 1))
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"warm-up broadcast of the join did not complete within 3 s"):
        TransferGroup(spec, 0)
    took = time.monotonic() - start
    assert TIMEOUT_S <= took < TIMEOUT_S + SLACK_S, took
    silent()  # it was built: the failure is the missing participation, not the connection


def test_a_stalled_member_fails_the_wait_within_its_deadline_and_aborts_the_group(store: Any) -> None:
    """What a dead member is on NCCL (its peers' kernels spin, no error): the sender's wait raises
    TransferTimeout at its deadline, before gloo's own (backstop) timeout, and the group takes nothing
    more."""
    spec = _spec(store, 2)
    receiver = _in_thread(lambda: TransferGroup(spec, 1))
    sender = TransferGroup(spec, 0)
    stalled = receiver()  # joined (warm-up done), then never posts its receive
    work = sender.broadcast(torch.ones(16), src=0)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"rank 0 of 2\): broadcast 2 from rank 0 did not complete"):
        work.wait()
    took = time.monotonic() - start
    assert TIMEOUT_S <= took < min(TIMEOUT_S + SLACK_S, BACKSTOP * TIMEOUT_S), took
    assert sender.broken
    with pytest.raises(TransferAborted, match="closed or aborted"):
        sender.broadcast(torch.ones(16))
    sender.close()
    stalled.close()


def test_a_member_that_aborts_ends_the_others_waits_at_once(store: Any) -> None:
    """A sender that gives up (its export failed, or it timed out on another member) says so in the
    store: the receivers' waits end within the signal's poll, not at their deadline — on NCCL nothing
    else would tell them, and on gloo the sender's connections stay open while its process holds them
    (here: the work it issued)."""
    spec = _spec(store, 3)
    receivers = [_in_thread(lambda r=r: TransferGroup(spec, r)) for r in (1, 2)]
    sender = TransferGroup(spec, 0)
    groups = [r() for r in receivers]
    posted = [_in_thread(lambda g=g: g.broadcast(torch.zeros(16), src=0).wait()) for g in groups]
    held = sender.broadcast(torch.ones(16), src=1)  # a work of the sender's that never completes
    time.sleep(0.2)
    start = time.monotonic()
    sender.close()  # unfinished work: aborted, and signalled
    for wait in posted:
        with pytest.raises(TransferAborted, match=r"rank 0 aborted the group: left the group unfinished"):
            wait()
    assert time.monotonic() - start < 1.0
    del held
    for g in groups:
        g.close()


def test_a_push_is_timed_to_the_completion_of_its_last_bucket(store: Any) -> None:
    """The sender's time includes the wire: a receiver that posts its third bucket's receive a second
    late makes the sender's transfer last at least that second."""
    delay = 1.0
    specs = [TensorSpec(f"model.layers.{i}.w", (64,), "float32", 0) for i in range(4)]
    plan = plan_buckets(specs, 256)
    assert len(plan.buckets) == 4
    spec = _spec(store, 2)

    def receive() -> Any:
        group = TransferGroup(spec, 1)
        loads = [0]

        def load(named: Any) -> int:
            if loads[0] == 0:
                time.sleep(delay)  # the receive of bucket 2 is posted after this load
            loads[0] += 1
            return len(named)

        try:
            return receive_buckets({0: group}, plan, load)
        finally:
            group.close()

    receiver = _in_thread(receive)
    group = TransferGroup(spec, 0)
    try:
        stream = ((t.name, torch.zeros(t.shape)) for t in plan.tensors)
        sent = send_buckets(group, plan, 0, stream)
    finally:
        group.close()
    got = receiver()
    assert sent.buckets == got.buckets == 4 and got.tensors == 4
    assert sent.seconds >= delay, sent.seconds


def test_group_spec_and_communicator_memory() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        GroupSpec("127.0.0.1", 1, "k", 2, "nccl", 0.0)
    with pytest.raises(ValueError, match=r"channels must be in \[1, 32\]"):
        GroupSpec("127.0.0.1", 1, "k", 2, "nccl", channels=64)
    per_channel = 4 * 2**20 + 4_915_200 + 524_288  # NCCL's simple, LL128 and LL buffers
    assert communicator_bytes(8, {}) == 8 * per_channel
    assert communicator_bytes(4, {"NCCL_BUFFSIZE": str(2**20), "NCCL_PROTO": "Simple"}) == 4 * 2**20
