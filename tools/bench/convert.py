"""Benchmark HF ↔ Megatron checkpoint conversion against raw safetensors I/O.

Builds a random Qwen3 checkpoint a few hundred MB large (``init_model`` with larger sizes than the tiny
presets), then times in one run:

- the baseline: read every tensor of every shard (``safetensors.torch.load_file``) and write the same
  tensors into new shard files (``save_file``), in this process; also the same with an fsync per file,
  since Megatron's checkpoint writer fsyncs;
- ``hf_to_mcore`` then ``mcore_to_hf`` in one spawned rank (``parallel.launch`` with a world of one),
  timed inside the worker around each call. Process start and the worker's first, import-heavy round
  trip of a tiny checkpoint are reported on their own and excluded from the throughput;
- the direct converters (``conversion/direct.py``: no model, no process group) in this process, after a
  warm-up round trip of the tiny checkpoint: ``hf_to_mcore_direct``, then ``mcore_to_hf_direct`` of its
  output. The direct checkpoint is also exported by the model path (untimed), and both outputs must be
  bit-identical to the source.

Every converter syncs what it wrote to disk before renaming it into place (an interrupted conversion
leaves nothing half-written), which the first baseline does not: the table gives each step's throughput
relative to both baselines, the raw copy (target >= 0.5x) and the raw copy with an fsync per file
(the same durability as the converters).

Each step runs ``--repeats`` times; the table shows the median and the range. It prints bytes, seconds
and GB/s (1 GB = 1e9 bytes) per step, each step's throughput relative to the baseline (target >= 0.5x),
and the worker's memory next to the checkpoint size: peak RSS from ``getrusage`` plus a sampled split
into anonymous memory (what the process owns) and file-backed pages (memory-mapped source shards, which
the kernel can drop). Everything is written under a temporary directory that is removed at the end.

With no arguments it runs the default measurement (a tiny-moe widened to ~330 MB float32, 3 repeats) and
prints the table above, raw safetensors copy first as the baseline: under a minute on 2 cores. Nothing
has to exist beforehand; ``--workdir``, when given, must be an existing directory.

``--floor`` adds what any direct HF -> ``torch_dist`` copy must at least do, with no model and no record
format (:func:`direct_floor`), one check at a time, in the same run: every tensor's bytes read once from
the page cache and written once, the fused tensors (q/k/v, gate/up) copied once as the interleave and the
concatenation would, the files' digest on a second thread (the manifest's BLAKE3), each file fsynced
while the next is written (``SyncBehind``, as the converters do). How close a converter could come to the
target before its format costs anything.

    python tools/bench/convert.py                      # tiny-moe, ~330 MB float32
    python tools/bench/convert.py --layers 8 --experts 16 --moe-intermediate 512
    python tools/bench/convert.py --preset tiny-dense --layers 8 --intermediate 8192
    python tools/bench/convert.py --floor
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import queue
import resource
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mars_megatron.checkpoint.atomic import SyncBehind
from mars_megatron.checkpoint.manifest import new_digest
from mars_megatron.config import ParallelConfig
from mars_megatron.conversion.direct import hf_to_mcore_direct, mcore_to_hf_direct
from mars_megatron.conversion.hf_io import INDEX
from mars_megatron.convert import hf_to_mcore, mcore_to_hf
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel

GB = 1e9


# ------------------------------------------------------------------------------------------------- memory
def _status_bytes() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process from /proc (Linux), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _trim() -> None:
    """Hand freed heap memory back to the OS, so that the next phase's RSS is its own (glibc only)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemorySampler:
    """Samples RSS every few milliseconds in a thread and keeps the peaks of the current phase."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = _status_bytes()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = _status_bytes()
            with self._lock:
                self.peak = {k: max(v, self.peak.get(k, 0)) for k, v in now.items()}
            time.sleep(self.interval_s)

    def reset(self) -> dict[str, int]:
        """The peaks since the last reset; starts a new phase."""
        now = _status_bytes()
        with self._lock:
            peak = {k: max(v, self.peak.get(k, 0)) for k, v in now.items()}
            self.peak = now
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------------------------------------- worker
def bench_worker(
    warmup_hf: str, hf: str, root: str, repeats: int, out_shard_bytes: int, direct: str
) -> dict[str, Any]:
    """Runs on the spawned rank: a warm-up round trip of a tiny checkpoint (imports, first-call setup),
    then ``repeats`` timed round trips of the large one. Memory peaks are those of the first round trip,
    which starts from a trimmed heap as a one-off conversion does."""
    entered = time.perf_counter()
    pc = ParallelConfig()
    parallel.init_model_parallel(pc, seed=0)
    hf_to_mcore(warmup_hf, f"{root}/warmup.mcore", pc)
    mcore_to_hf(f"{root}/warmup.mcore", f"{root}/warmup.hf", pc, progress=False)
    out: dict[str, Any] = {"warmup_s": time.perf_counter() - entered, "to_mcore_s": [], "to_hf_s": []}
    _trim()
    out["base"], out["max_rss_base"] = _status_bytes(), _max_rss()
    sampler = MemorySampler()
    for i in range(repeats):
        mcore, back = f"{root}/bench{i}.mcore", f"{root}/bench{i}.hf"
        _trim()
        sampler.reset()
        start = time.perf_counter()
        hf_to_mcore(hf, mcore, pc)
        out["to_mcore_s"].append(time.perf_counter() - start)
        peak_to_mcore = sampler.reset()
        out.setdefault("max_rss_after_to_mcore", _max_rss())
        _trim()
        sampler.reset()
        start = time.perf_counter()
        mcore_to_hf(mcore, back, pc, max_shard_bytes=out_shard_bytes, progress=False)
        out["to_hf_s"].append(time.perf_counter() - start)
        peak_to_hf = sampler.reset()
        out.setdefault("peaks", {"to_mcore": peak_to_mcore, "to_hf": peak_to_hf})
        if i + 1 < repeats:  # keep only the last outputs (checked by the parent)
            shutil.rmtree(mcore)
            shutil.rmtree(back)
    sampler.stop()
    out["max_rss"] = _max_rss()
    mcore_to_hf(direct, f"{root}/direct.hf", pc, max_shard_bytes=out_shard_bytes, progress=False)  # untimed
    out["last"] = (f"{root}/bench{repeats - 1}.mcore", f"{root}/bench{repeats - 1}.hf")
    out["worker_s"] = time.perf_counter() - entered
    return out


# ------------------------------------------------------------------------------------------------- parent
def shards(model_dir: Path) -> list[Path]:
    weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
    return [model_dir / f for f in sorted(set(weight_map.values()))]


def tensor_bytes(model_dir: Path) -> int:
    return int(json.loads((model_dir / INDEX).read_text())["metadata"]["total_size"])


def raw_copy(src: Path, dst: Path, fsync: bool) -> float:
    """Seconds to load every shard of ``src`` and save its tensors as new files in ``dst``."""
    dst.mkdir()
    start = time.perf_counter()
    for shard in shards(src):
        tensors = load_file(shard)
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
        del tensors
        if fsync:
            fd = os.open(dst / shard.name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    elapsed = time.perf_counter() - start
    shutil.rmtree(dst)
    return elapsed


FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""HF tensors a Megatron checkpoint holds fused (linear_qkv interleaved, linear_fc1 concatenated)."""

FLOOR_STEPS = (
    ("floor: write once", {}),
    ("floor: + fused copies", {"fused": True}),
    ("floor: + digest thread", {"fused": True, "digest": True}),
    ("floor: + fsync (all)", {"fused": True, "digest": True, "fsync": True}),
)


def _tensor_spans(shard: Path) -> tuple[mmap.mmap, dict[str, tuple[int, int]]]:
    """The shard mapped read-only, and each tensor's byte range in it (the safetensors header)."""
    with shard.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    start = 8 + n
    return mapped, {
        k: (start + v["data_offsets"][0], start + v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__"
    }


def direct_floor(
    src: Path, dst: Path, *, fused: bool = False, digest: bool = False, fsync: bool = False
) -> float:
    """Seconds to copy every tensor of ``src`` into one new file per shard with the steps asked for (see
    the module docstring): the least a direct converter does, no format written."""
    dst.mkdir()
    start = time.perf_counter()
    chunks: queue.Queue[Any] = queue.Queue()

    def hash_chunks() -> None:  # the digest releases the GIL: this runs on the second core
        h = new_digest()  # the manifest's (BLAKE3)
        while (chunk := chunks.get()) is not None:
            h.update(chunk)

    hasher = threading.Thread(target=hash_chunks)
    if digest:
        hasher.start()
    fds = []
    with SyncBehind("floor-sync") as sync:
        for i, shard in enumerate(shards(src)):
            mapped, spans = _tensor_spans(shard)
            view = memoryview(mapped)
            fd = os.open(dst / f"__0_{i}.distcp", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fds.append(fd)
            for name in sorted(spans):
                a, b = spans[name]
                data = view[a:b]
                if fused and any(part in name for part in FUSED):
                    data = memoryview(bytearray(data))
                os.write(fd, data)
                if digest:
                    chunks.put(data)
            if fsync:  # synced while the next file is written
                sync.fsync(fd)
        sync.wait()
    for fd in fds:
        os.close(fd)
    if digest:
        chunks.put(None)
        hasher.join()
    elapsed = time.perf_counter() - start
    shutil.rmtree(dst)
    return elapsed


def bit_identical(a: Path, b: Path) -> bool:
    left: dict[str, torch.Tensor] = {}
    for shard in shards(a):
        left.update(load_file(shard))
    seen = 0
    for shard in shards(b):
        for name, t in load_file(shard).items():
            ref = left.get(name)
            if ref is None or ref.dtype != t.dtype or ref.shape != t.shape or not torch.equal(ref, t):
                return False
            seen += 1
    return seen == len(left)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-moe", choices=["tiny-moe", "tiny-dense"])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16, help="MoE experts per layer (tiny-moe)")
    p.add_argument("--moe-intermediate", type=int, default=512, help="expert FFN size (tiny-moe)")
    p.add_argument("--intermediate", type=int, default=1536, help="dense FFN size")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (the tiny tokenizer allows ~300-1100)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shard-size", default="100MB", help="max shard size of the source checkpoint")
    p.add_argument(
        "--out-shard-mb",
        type=float,
        default=100.0,
        help="max shard size mcore_to_hf writes, in MB. Its default, 5 GiB, is more than this whole "
        "checkpoint; in a real model a shard is a small part of it, so the bench keeps it that way",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each step; the median is shown")
    p.add_argument("--workdir", default=None, help="an existing directory to make the temporary one in")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also time what any direct HF -> torch_dist copy must do, one check at a time (no format)",
    )
    args = p.parse_args()
    # Checked here, not by mkdtemp's traceback: the flag named before any work is done.
    if args.workdir is not None and not Path(args.workdir).is_dir():
        p.error(f"--workdir {args.workdir}: no such directory")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main() -> None:
    args = parse_args()
    overrides: dict[str, Any] = {
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate,
        "vocab_size": args.vocab,
    }
    if args.preset == "tiny-moe":
        overrides |= {"num_experts": args.experts, "moe_intermediate_size": args.moe_intermediate}
    root = Path(tempfile.mkdtemp(prefix="mars-bench-convert-", dir=args.workdir))
    try:
        start = time.perf_counter()
        hf = init_model(
            args.preset,
            root / "src.hf",
            seed=0,
            dtype=args.dtype,
            overrides=overrides,
            max_shard_size=args.shard_size,
        )
        init_s = time.perf_counter() - start
        warmup = init_model(args.preset, root / "warmup-src.hf", seed=1)
        size, n_shards = tensor_bytes(hf), len(shards(hf))
        print(
            f"checkpoint: {args.preset} {args.dtype}, " + ", ".join(f"{k}={v}" for k, v in overrides.items())
        )
        print(f"  {size / 1e6:.1f} MB of tensors in {n_shards} shards (built in {init_s:.1f} s)")

        raw = [raw_copy(hf, root / f"raw{i}.hf", fsync=False) for i in range(args.repeats)]
        raw_fsync = [raw_copy(hf, root / f"raw-fsync{i}.hf", fsync=True) for i in range(args.repeats)]
        floor = [
            (name, [direct_floor(hf, root / f"floor{i}", **steps) for i in range(args.repeats)])
            for name, steps in (FLOOR_STEPS if args.floor else ())
        ]
        out_shard = int(args.out_shard_mb * 1e6)
        hf_to_mcore_direct(warmup, root / "warmup-direct.mcore")  # imports, first-call setup
        direct = []
        for i in range(args.repeats):
            _trim()
            start = time.perf_counter()
            hf_to_mcore_direct(hf, root / f"direct{i}.mcore")
            direct.append(time.perf_counter() - start)
            if i + 1 < args.repeats:
                shutil.rmtree(root / f"direct{i}.mcore")
        last_direct = root / f"direct{args.repeats - 1}.mcore"
        mcore_to_hf_direct(root / "warmup-direct.mcore", root / "warmup-direct.hf")
        direct_back = []
        for i in range(args.repeats):
            _trim()
            start = time.perf_counter()
            mcore_to_hf_direct(last_direct, root / f"direct-back{i}.hf", max_shard_bytes=out_shard)
            direct_back.append(time.perf_counter() - start)
        direct_back_identical = bit_identical(hf, root / f"direct-back{args.repeats - 1}.hf")
        start = time.perf_counter()
        result = parallel.launch(
            bench_worker,
            1,
            str(warmup),
            str(hf),
            str(root),
            args.repeats,
            out_shard,
            str(last_direct),
        )[0]
        launch_s = time.perf_counter() - start
        last_mcore, last_hf = (Path(p) for p in result["last"])
        identical = bit_identical(hf, last_hf)
        direct_identical = bit_identical(hf, root / "direct.hf")
        mcore_bytes = sum(p.stat().st_size for p in last_mcore.rglob("*") if p.is_file())
        out_shards = len(shards(last_hf))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    raw_s, synced_s = statistics.median(raw), statistics.median(raw_fsync)
    rows = [
        ("raw read+write (baseline)", raw),
        ("raw read+write+fsync", raw_fsync),
        *floor,
        ("hf_to_mcore", result["to_mcore_s"]),
        ("hf_to_mcore, direct", direct),
        ("mcore_to_hf", result["to_hf_s"]),
        ("mcore_to_hf, direct", direct_back),
    ]
    print()
    print(f"{'step':<27}{'bytes':>13}{'seconds':>9}{'range':>13}{'GB/s':>8}{'vs raw':>8}{'vs raw+fsync':>14}")
    for name, runs in rows:
        median = statistics.median(runs)
        gbs = size / median / GB
        spread = f"{min(runs):.2f}-{max(runs):.2f}"
        print(
            f"{name:<27}{size:>13,}{median:>9.3f}{spread:>13}{gbs:>8.3f}"
            f"{raw_s / median:>7.2f}x{synced_s / median:>13.2f}x"
        )
    print(f"(median of {args.repeats} runs each; GB = 1e9 bytes)")
    print()
    print(
        f"not in the table: process start + join {launch_s - result['worker_s']:.1f} s, "
        f"worker warm-up (imports, tiny round trip) {result['warmup_s']:.1f} s"
    )
    print(f"Megatron checkpoint on disk: {mcore_bytes:,} bytes; HF output: {out_shards} shards")
    print(f"round trip bit-identical: {'yes' if identical else 'NO'}")
    print(
        f"direct round trip bit-identical: {'yes' if direct_back_identical else 'NO'}; the direct "
        f"checkpoint through the model path (mcore_to_hf): {'yes' if direct_identical else 'NO'}"
    )

    base = result["base"]
    print()
    print(
        f"worker memory, first round trip (checkpoint {size / GB:.3f} GB, "
        f"mcore_to_hf shards <= {args.out_shard_mb:g} MB)"
    )
    print(
        f"  after warm-up: RSS {base['VmRSS'] / GB:.3f} GB = anonymous {base['RssAnon'] / GB:.3f} "
        f"+ file-backed {base['RssFile'] / GB:.3f}"
    )
    print(f"  {'step':<13}{'peak RSS':>10}{'anonymous growth':>27}{'file-backed growth':>27}")
    for label, key in (("hf_to_mcore", "to_mcore"), ("mcore_to_hf", "to_hf")):
        peak = result["peaks"][key]
        anon, file = peak["RssAnon"] - base["RssAnon"], peak["RssFile"] - base["RssFile"]
        print(
            f"  {label:<13}{peak['VmRSS'] / GB:>7.3f} GB"
            f"{f'+{anon / GB:.3f} GB = {anon / size:.2f}x ckpt':>27}"
            f"{f'+{file / GB:.3f} GB = {file / size:.2f}x ckpt':>27}"
        )
    print(
        f"  getrusage peak RSS: {result['max_rss_base'] / GB:.3f} GB before the timed runs (warm-up), "
        f"{result['max_rss_after_to_mcore'] / GB:.3f} GB after the first hf_to_mcore, "
        f"{result['max_rss'] / GB:.3f} GB at the end"
    )
    print("  (anonymous = memory the process owns; file-backed = memory-mapped source shards, droppable)")


if __name__ == "__main__":
    main()
