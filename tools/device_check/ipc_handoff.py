"""Check 4: the colocated weight hand-off (:mod:`mars_megatron.transfer.ipc`) between two processes on one
GPU, with real CUDA IPC handles (``--cpu``: POSIX shared memory, the same code).

A sender process plays the trainer rank that hosts an engine worker: it holds a model's weights (a random
Qwen3-MoE, perturbed: the "trained" weights) and runs :func:`~mars_megatron.transfer.ipc.colocated_send`
with a :class:`~mars_megatron.transfer.ipc.Publisher` — pack each bucket, publish its handle, wait for the
acknowledgement, free the buffer. A receiver process plays the engine worker: it holds its own copy of the
model (the unperturbed weights) and runs :func:`~mars_megatron.transfer.ipc.colocated_receive` with a
:class:`~mars_megatron.transfer.ipc.Subscriber` — map each handle, copy the bucket's tensors into its
weights, drop the mapping, acknowledge. Both meet through a TCP store this process hosts on 127.0.0.1
only (:func:`~mars_megatron.transfer.group.host_store`).

Rows (each a value the run measured):

- the receiver's weights equal the sender's bit for bit (a SHA-256 per tensor on both sides), and all of
  them differed before the hand-off;
- the memory each side held, as the transfer counts it (:class:`~mars_megatron.transfer.channel.
  MemoryTally`): the sender at most two buckets (one published, the next being packed; the weights are
  its own memory, not copies), the receiver at most one (mapped, never copied);
- the buffers were freed once acknowledged: GPU, the sender's ``torch.cuda.memory_allocated`` is back to
  its value before the hand-off (a buffer a consumer still mapped would sit in torch's IPC "limbo",
  still allocated); ``--cpu``, none of the published shared-memory segments is left in ``/dev/shm``;
- GPU only: the sender's allocator peak during the hand-off exceeds its resting value by at most two
  buckets as the allocator counts them (each rounded to its 512-byte blocks, plus up to 1 MiB a cached
  block is handed out whole; a third of the 3.4 MiB layer buckets would exceed it), the receiver's by nothing
  (it maps the sender's memory); every handle names this GPU by UUID and opened on the receiver's own
  index of it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import queue
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from tools.device_check.common import Context, Row, at_most, is_true

CHECK = "4 ipc_handoff"
TIMEOUT_S = 120.0
ALLOCATOR_BLOCK = 512  # the CUDA caching allocator's size granularity
ALLOCATOR_UNSPLIT = 1 << 20
"""The most a large-pool block can exceed its request: the allocator hands out a cached block whole
when less than 1 MiB (``kSmallSize``) would remain, and counts all of it as allocated."""
CPU_MODEL: dict[str, Any] = {}
GPU_MODEL = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
}
"""tiny-moe overrides on the GPU: 8 M parameters, 16 MiB in bf16, five buckets of 2–3.4 MiB (the
allocator's large pool, as real buckets are) instead of the tiny preset's KiBs."""
BUCKET_BYTES = {"cpu": 256 * 1024, "gpu": 4 * 1024 * 1024}


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else 0)
        torch.cuda.set_device(device)
    return device


def _weights(
    model_dir: str, dtype: torch.dtype, device: torch.device, perturb: bool
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in ``dtype`` on ``device``; ``perturb``: plus seeded noise (the sender's
    trained weights, so that every tensor differs from the receiver's before the hand-off)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    for i, name in enumerate(sorted(out)):
        t = out[name].float()
        if perturb:
            g = torch.Generator().manual_seed(1000 + i)
            t = t + 0.01 + 0.01 * torch.randn(t.shape, generator=g)
        out[name] = t.to(dtype).to(device).contiguous()
    return out


def _digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        for name, t in weights.items()
    }


def _memory() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}


def _send(spec: Any, plan: Any, model_dir: str, device_name: str, dtype: torch.dtype, out: Any) -> None:
    """Spawned: the trainer rank's side."""
    from mars_megatron.transfer.ipc import Publisher, colocated_send

    class Recording(Publisher):
        """The real publisher, keeping what it published (to check later that it was freed)."""

        def __init__(self, spec: Any) -> None:
            super().__init__(spec)
            self.handles: list[dict[str, Any]] = []

        def publish(self, index: int, buffer: torch.Tensor) -> None:
            super().publish(index, buffer)
            self.handles.append(json.loads(self.store.get(f"r{self.round}/b{index}").decode()))

    try:
        torch.set_num_threads(1)
        device = _device(device_name)
        weights = _weights(model_dir, dtype, device, perturb=True)
        publisher = Recording(spec)
        before = _memory()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        stream = ((t.name, weights[t.name]) for t in plan.tensors)
        stats = colocated_send({}, plan, 0, stream, publisher, device, owned=lambda t: True)
        seconds = time.perf_counter() - start
        after = _memory()
        left = [
            name
            for h in publisher.handles
            if h["kind"] == "shm"
            for name in [base64.b64decode(h["name"]).decode()]
            if os.path.exists("/dev/shm" + name)
        ]
        report = {"stats": dataclasses.asdict(stats), "seconds": seconds, "digests": _digests(weights)}
        report |= {"before": before, "after": after, "handles": len(publisher.handles), "shm_left": left}
        out.put(("sender", "ok", report))
    except BaseException:
        out.put(("sender", "error", traceback.format_exc()))


def _receive(spec: Any, plan: Any, model_dir: str, device_name: str, dtype: torch.dtype, out: Any) -> None:
    """Spawned: the engine worker's side."""
    from mars_megatron.transfer.ipc import Subscriber, colocated_receive, gpu_uuid

    class Recording(Subscriber):
        """The real subscriber, keeping each handle and where its mapping opened."""

        def __init__(self, spec: Any) -> None:
            super().__init__(spec)
            self.seen: list[tuple[dict[str, Any], str]] = []

        def take(self, index: int) -> torch.Tensor:
            view = super().take(index)
            text = self.store.get(f"r{self.round}/b{index}").decode()
            self.seen.append((json.loads(text), str(view.device)))
            return view

    try:
        torch.set_num_threads(1)
        device = _device(device_name)
        weights = _weights(model_dir, dtype, device, perturb=False)
        digests_before = _digests(weights)

        def load(named: Any) -> int:
            for name, tensor in named:
                weights[name].copy_(tensor)
            return len(named)

        subscriber = Recording(spec)
        before = _memory()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        stats = colocated_receive(subscriber, plan, load)
        after = _memory()
        uuids = []
        for fields, where in subscriber.seen:
            if fields["kind"] == "cuda":
                uuids.append((fields["uuid"], where, gpu_uuid(device.index), str(device)))
        report = {"stats": dataclasses.asdict(stats), "digests": _digests(weights)}
        report |= {"digests_before": digests_before, "before": before, "after": after, "uuids": uuids}
        out.put(("receiver", "ok", report))
    except BaseException:
        out.put(("receiver", "error", traceback.format_exc()))


def hand_off(ctx: Context, model_dir: Path, plan: Any) -> dict[str, Any]:
    """Run the two sides in spawned processes; their reports by side. Raises with a side's traceback."""
    from mars_megatron.transfer.group import GroupSpec, host_store

    store = host_store("127.0.0.1", TIMEOUT_S)  # listens on loopback only
    spec = GroupSpec("127.0.0.1", store.port, f"device-check/ipc/{time.time_ns()}", 2, "ipc", TIMEOUT_S)
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    args = (spec, plan, str(model_dir), str(ctx.device), ctx.dtype, results)
    procs = [spawn.Process(target=_send, args=args), spawn.Process(target=_receive, args=args)]
    for p in procs:
        p.start()
    got: dict[str, Any] = {}
    deadline = time.monotonic() + TIMEOUT_S + 60
    try:
        while len(got) < 2:
            try:
                side, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"hand-off: a side died or hung (exit codes {dead})") from None
                continue
            if status != "ok":
                raise RuntimeError(f"hand-off: the {side} failed:\n{payload}")
            got[side] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return got


def run(ctx: Context) -> list[Row]:
    from safetensors import safe_open

    from mars_megatron.models.presets import init_model
    from mars_megatron.transfer.plan import TensorSpec, plan_buckets

    mode = "cpu" if ctx.cpu else "gpu"
    model_dir = init_model(
        "tiny-moe",
        ctx.workdir / "ipc_handoff",
        overrides=CPU_MODEL if ctx.cpu else GPU_MODEL,
        max_shard_size="1GB",
    )

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as reader:
            for name in reader.keys():
                shapes[name] = tuple(reader.get_slice(name).get_shape())
    specs = [TensorSpec(name, shapes[name], ctx.dtype_name, 0) for name in sorted(shapes)]
    plan = plan_buckets(specs, BUCKET_BYTES[mode])
    ctx.log(
        f"check 4: {len(specs)} tensors in {len(plan.buckets)} buckets, {plan.nbytes / 2**20:.1f} MiB ..."
    )
    got = hand_off(ctx, model_dir, plan)
    sender, receiver = got["sender"], got["receiver"]
    names = sorted(shapes)
    differ_after = sum(receiver["digests"][n] != sender["digests"][n] for n in names)
    differed_before = sum(receiver["digests_before"][n] != sender["digests"][n] for n in names)
    largest = plan.largest_bucket
    rows = [
        is_true(
            CHECK,
            f"receiver's weights = sender's, bit for bit ({len(names)} tensors, {len(plan.buckets)} buckets)",
            differ_after == 0 and differed_before == len(names) == receiver["stats"]["tensors"],
            f"{differ_after} differ (before: {differed_before})",
            differ_after=differ_after,
            differed_before=differed_before,
            loaded=receiver["stats"]["tensors"],
            sent=sender["stats"]["tensors"],
            seconds=sender["seconds"],
        ),
        at_most(CHECK, "sender: bytes held (MemoryTally peak) / largest bucket", sender["stats"]["peak_bytes"]
                / largest, 2.0, peak_bytes=sender["stats"]["peak_bytes"], largest_bucket=largest),
        at_most(CHECK, "receiver: bytes held (MemoryTally peak) / largest bucket",
                receiver["stats"]["peak_bytes"] / largest, 1.0, peak_bytes=receiver["stats"]["peak_bytes"],
                largest_bucket=largest),
    ]  # fmt: skip
    if ctx.cpu:
        left = sender["shm_left"]
        rows.append(
            is_true(CHECK, "buffers freed once acknowledged: published shm segments left in /dev/shm",
                    not left and sender["handles"] == len(plan.buckets),
                    f"{len(left)} of {sender['handles']}", left=left, published=sender["handles"])
        )  # fmt: skip
        return rows
    s_before, s_after = sender["before"], sender["after"]
    r_before, r_after = receiver["before"], receiver["after"]
    rounded = 2 * (-(-largest // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK + ALLOCATOR_UNSPLIT)
    rows += [
        at_most(CHECK, "buffers freed once acknowledged: sender's memory_allocated after − before (B)",
                s_after["allocated"] - s_before["allocated"], 0, before=s_before, after=s_after),
        at_most(CHECK, "sender: max_memory_allocated during − before (B), bound 2 buckets + 2 MiB",
                s_after["peak"] - s_before["allocated"], rounded, before=s_before, after=s_after),
        at_most(CHECK, "receiver: max_memory_allocated during − before (B): maps, never copies",
                r_after["peak"] - r_before["allocated"], 0, before=r_before, after=r_after),
    ]  # fmt: skip
    uuids = receiver["uuids"]
    wrong = [u for u in uuids if u[0] != u[2] or u[1] != u[3]]
    rows.append(
        is_true(CHECK, "handles name the GPU by UUID and open on the receiver's index of it",
                not wrong and len(uuids) == len(plan.buckets),
                f"{len(uuids) - len(wrong)} of {len(plan.buckets)}", uuids=uuids)
    )  # fmt: skip
    return rows
