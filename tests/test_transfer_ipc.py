"""Colocated hand-off handles (:mod:`mars_megatron.transfer.ipc`): a CUDA handle names its GPU by UUID and
opens on the opener's own index of that GPU, since a device index means different GPUs in a trainer rank
(``cuda:0``, its one visible GPU) and a vLLM Ray worker (every GPU of the node, by physical index).

The mapping is pure and tested here on CPU; the ``gpu`` tests open real CUDA IPC handles in another
process (one GPU: equal bytes on the producer's GPU; two GPUs: the opener sees them in the other order).
A host with several workers publishes one handle per worker (a CUDA handle's reference counter counts one
opener): on CPU the workers claim distinct handles through a real store; on a GPU two opener processes
leave the host's buffer freeable.
Check 4 of the device check (``tools/device_check/ipc_handoff.py``) runs the whole hand-off between two
processes; its ``--cpu`` mode (shared memory handles) runs here.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mars_megatron.transfer.group import GroupSpec, host_store
from mars_megatron.transfer.ipc import (
    Publisher,
    Subscriber,
    cuda_fields,
    cuda_open_args,
    gpu_uuid,
    handle_key,
    handle_of,
    local_device_index,
    open_handle,
    share_buffer,
)

REPO = Path(__file__).resolve().parents[1]
NODE = ["3f2a9c1e-0b6d-4e57-9a1c-5d8e7f6a4b30", "b71c0d2e-9f4a-4c3b-8e6d-1a2b3c4d5e6f"]
"""Two GPU UUIDs of a node, in the form torch prints them."""


def _share_tuple(producer_index: int) -> tuple:
    """What ``storage._share_cuda_()`` returns (device index, IPC handle, sizes, ref counter, event)."""
    return (producer_index, b"\x01handle\x00bytes", 4096, 512, b"/torch_rc_7", 3, b"\x00event\xff", True)


def test_the_opener_finds_the_gpu_by_uuid_whatever_index_it_has_there() -> None:
    # a trainer rank sees its GPU as cuda:0; a Ray worker of vLLM sees the node's GPUs by physical index
    assert local_device_index(NODE[1], NODE) == 1
    assert local_device_index(NODE[1], [NODE[1]]) == 0
    assert local_device_index("GPU-" + NODE[0].upper(), NODE) == 0  # nvidia-smi's spelling
    with pytest.raises(RuntimeError, match=NODE[1]):
        local_device_index(NODE[1], [NODE[0]])
    with pytest.raises(RuntimeError, match="sees none"):
        local_device_index(NODE[1], [])


def test_a_cuda_handle_carries_the_uuid_and_opens_on_the_local_index() -> None:
    # produced on the producer's cuda:0 (a trainer rank), opened where that GPU is cuda:1 (a worker)
    fields = json.loads(json.dumps(cuda_fields(_share_tuple(0), NODE[1])))
    assert fields["uuid"] == NODE[1] and "device" not in fields  # no index that means another GPU elsewhere
    args = cuda_open_args(fields, NODE)
    assert args == (1, *_share_tuple(0)[1:])  # the rest byte for byte
    assert cuda_open_args(fields, [NODE[1]])[0] == 0  # a process that sees only that GPU


def test_a_cuda_handle_without_uuid_or_for_an_unseen_gpu_is_refused_by_name() -> None:
    old = cuda_fields(_share_tuple(0), NODE[0])
    del old["uuid"]
    old["device"] = 0  # the handle format before the UUID
    with pytest.raises(ValueError, match="uuid"):
        cuda_open_args(old, NODE)
    text = json.dumps({**cuda_fields(_share_tuple(0), NODE[0]), "byte_offset": 0, "nbytes": 16})
    if not torch.cuda.is_available():  # this process sees no GPU at all
        with pytest.raises(RuntimeError, match=NODE[0]):
            open_handle(text)


# ------------------------------------------------------------------------------------ several workers
def _host_spec(store: object, workers: int) -> GroupSpec:
    return GroupSpec("127.0.0.1", store.port, f"ipc-test/{time.time_ns()}", 1 + workers, "ipc", 20.0)


def test_each_worker_of_a_host_opens_a_handle_of_its_own() -> None:
    """Three workers on one host: the host publishes three handles of the bucket (on a GPU three
    ``_share_cuda_`` calls, one reference counter per opener), each worker claims a different one, maps
    the same bytes and acknowledges; once all did, no key is left in the store. (Before, the host
    published one handle, which every worker opened: on a GPU each opener's release decremented its one
    counter, below zero, and the buffer stayed allocated.)"""
    store = host_store("127.0.0.1", 60.0)
    spec = _host_spec(store, 3)
    publisher = Publisher(spec)
    publisher.begin()
    buffer = share_buffer(4096, torch.device("cpu"))
    buffer.copy_(torch.arange(4096) % 251)
    got: dict[int, tuple[int, bytes]] = {}
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            subscriber = Subscriber(spec)
            subscriber.begin()
            view = subscriber.take(0)
            got[n] = (subscriber.slots[0], view.numpy().tobytes())
            del view
            subscriber.done(0)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(3)]
    for t in threads:
        t.start()
    publisher.publish(0, buffer)
    keys = [handle_key(1, 0, slot) for slot in (1, 2, 3)]
    # one handle per worker (deleted only once every worker acknowledged)
    assert [publisher.store.check([k]) for k in keys] == [True, True, True]
    publisher.wait(0)
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert sorted(slot for slot, _ in got.values()) == [1, 2, 3]
    assert all(data == buffer.numpy().tobytes() for _, data in got.values())
    assert not any(publisher.store.check([k]) for k in [*keys, "r1/c0", "r1/a0"])


def test_one_worker_reads_the_buckets_own_key_and_an_extra_worker_is_refused() -> None:
    store = host_store("127.0.0.1", 60.0)
    assert handle_key(3, 7, 1) == "r3/b7" and handle_key(3, 7, 2) == "r3/b7/h2"
    one = Subscriber(_host_spec(store, 1))
    one.begin()
    assert one.claim(0) == 1 and not one.store.check(["r1/c0"])  # one worker: no claim asked
    spec = _host_spec(store, 2)
    workers = [Subscriber(spec) for _ in range(3)]
    for w in workers:
        w.begin()
    assert [workers[0].claim(0), workers[1].claim(0)] == [1, 2]
    with pytest.raises(RuntimeError, match=r"more colocated workers than the 2 .*GroupSpec\.world"):
        workers[2].claim(0)


# ------------------------------------------------------------------------------------------------- GPU
_OPENER = """
import hashlib, json, sys
import torch
from mars_megatron.transfer.ipc import gpu_uuid, open_handle
view = open_handle(sys.stdin.read())
index = view.device.index
print(json.dumps({"index": index, "uuid": gpu_uuid(index), "visible": torch.cuda.device_count(),
                  "sha256": hashlib.sha256(view.cpu().numpy().tobytes()).hexdigest()}))
"""


def _open_elsewhere(text: str, visible: list[str] | None) -> dict:
    """Open handle ``text`` in a fresh process that sees the GPUs ``visible`` (UUIDs, in that order)."""
    env = dict(os.environ)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join("GPU-" + u.removeprefix("GPU-") for u in visible)
    done = subprocess.run(
        [sys.executable, "-c", _OPENER], input=text, env=env, cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _filled(device: torch.device, nbytes: int = 3 << 20) -> tuple[torch.Tensor, str]:
    buffer = share_buffer(nbytes, device)
    g = torch.Generator().manual_seed(7)
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    torch.cuda.synchronize(device)
    return buffer, hashlib.sha256(buffer.cpu().numpy().tobytes()).hexdigest()


@pytest.mark.gpu
def test_a_cuda_handle_opens_in_another_process_on_the_producers_gpu() -> None:
    """One GPU: the other process maps the very bytes, on the GPU the handle names."""
    device = torch.device("cuda", torch.cuda.current_device())
    buffer, digest = _filled(device)
    got = _open_elsewhere(handle_of(buffer[1024:]), None)
    assert got["sha256"] == hashlib.sha256(buffer[1024:].cpu().numpy().tobytes()).hexdigest() != digest
    assert got["uuid"] == gpu_uuid(device.index)


@pytest.mark.gpu
def test_a_cuda_handle_opens_on_the_same_physical_gpu_where_indices_differ() -> None:
    """Two GPUs: produced on this process's cuda:1, opened by a process that sees the two GPUs in the
    other order (a Ray worker's physical indices against a trainer rank's): there it is cuda:0. The
    handle of the old format opened it on the opener's cuda:1, the other GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    uuids = [gpu_uuid(0), gpu_uuid(1)]
    buffer, digest = _filled(torch.device("cuda", 1))
    got = _open_elsewhere(handle_of(buffer), [uuids[1], uuids[0]])
    assert got == {"index": 0, "uuid": uuids[1], "visible": 2, "sha256": digest}


_WORKER = """
import hashlib, json, sys
import torch
from mars_megatron.transfer.group import GroupSpec
from mars_megatron.transfer.ipc import Subscriber
subscriber = Subscriber(GroupSpec(**json.loads(sys.stdin.read())))
subscriber.begin()
view = subscriber.take(0)
digest = hashlib.sha256(view.cpu().numpy().tobytes()).hexdigest()
del view  # the mapping's release decrements its handle's reference counter
torch.cuda.synchronize()
subscriber.done(0)
print(json.dumps({"slot": subscriber.slots[0], "sha256": digest}))
"""


@pytest.mark.gpu
def test_two_workers_of_one_host_leave_its_cuda_buffer_freeable() -> None:
    """Two worker processes map one bucket of this process's GPU, then release it; the host frees its
    buffer and it is gone (``memory_allocated`` back where it was after ``ipc_collect``). With one handle
    for both, the second release took the handle's counter below zero and the buffer stayed held."""
    device = torch.device("cuda", torch.cuda.current_device())
    store = host_store("127.0.0.1", 120.0)
    spec = _host_spec(store, 2)
    publisher = Publisher(spec)
    publisher.begin()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    buffer, digest = _filled(device)
    fields = {f: getattr(spec, f) for f in ("host", "port", "key", "world", "backend", "timeout_s")}
    workers = [
        subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=REPO, text=True)
        for _ in range(2)
    ]  # fmt: skip
    for w in workers:
        assert w.stdin is not None
        w.stdin.write(json.dumps(fields))
        w.stdin.close()
    publisher.publish(0, buffer)
    publisher.wait(0)
    outs = [w.communicate(timeout=120) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-3000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(g["slot"] for g in got) == [1, 2] and {g["sha256"] for g in got} == {digest}
    del buffer
    torch.cuda.ipc_collect()
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_allocated(device) == before


# ------------------------------------------------------------------------------------- device check 4
@pytest.mark.multiproc
def test_device_check_4_hands_a_model_over_between_two_processes(tmp_path: Path) -> None:
    """``--cpu`` mode of check 4: a sender process publishes a tiny MoE's buckets (shared memory), a
    receiver maps, loads and acknowledges each; every row holds on the values measured."""
    from tools.device_check import ipc_handoff
    from tools.device_check.common import Context

    ctx = Context(cpu=True, device=torch.device("cpu"), dtype=torch.float32, workdir=tmp_path, log=print)
    rows = ipc_handoff.run(ctx)
    assert [r.passed for r in rows] == [True] * 4, rows
    exact, sender, receiver, freed = rows
    assert exact.figures["differ_after"] == 0 and exact.figures["differed_before"] == exact.figures["loaded"]
    assert exact.figures["loaded"] == exact.figures["sent"] > 10
    assert 0 < receiver.figures["peak_bytes"] <= sender.figures["peak_bytes"]
    assert freed.figures["published"] > 4 and freed.figures["left"] == []
