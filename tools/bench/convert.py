"""Benchmark HF ↔ Megatron checkpoint conversion against raw safetensors I/O.

Builds a random Qwen3 checkpoint a few hundred MB large (``init_model`` with larger sizes than the tiny
presets), then times in one run:

- the baseline: read every tensor of every shard (``safetensors.torch.load_file``) and write the same
  tensors into new shard files (``save_file``), in this process;
- ``hf_to_mcore`` then ``mcore_to_hf`` in one spawned rank (``parallel.launch`` with a world of one),
  timed inside the worker around each call. Process start and the worker's first, import-heavy
  conversion of a tiny checkpoint are reported on their own lines and excluded from the throughput.

It prints bytes, seconds and GB/s (1 GB = 1e9 bytes) per step, each step's throughput relative to the
baseline (target >= 0.5x), and the worker's peak RSS next to the checkpoint size. Everything is written
under a temporary directory that is removed at the end.

    python tools/bench/convert.py                      # tiny-moe, ~330 MB float32
    python tools/bench/convert.py --layers 8 --experts 16 --moe-intermediate 512
    python tools/bench/convert.py --preset tiny-dense --layers 8 --intermediate 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file, save_file

from checkpoints_conversion.convert import hf_to_mcore, mcore_to_hf
from checkpoints_conversion.hf_io import INDEX
from mars_megatron.config import ParallelConfig
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel

GB = 1e9


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def bench_worker(warmup_hf: str, hf: str, root: str) -> dict[str, Any]:
    """Runs on the spawned rank: a warm-up round trip of a tiny checkpoint (imports, first-call setup),
    then the timed round trip of the large one."""
    entered = time.perf_counter()
    pc = ParallelConfig()
    parallel.init_model_parallel(pc, seed=0)
    hf_to_mcore(warmup_hf, f"{root}/warmup.mcore", pc)
    mcore_to_hf(f"{root}/warmup.mcore", f"{root}/warmup.hf", pc, progress=False)
    out: dict[str, Any] = {"warmup_s": time.perf_counter() - entered}
    out["rss_before"], out["peak_before"] = _rss(), _peak_rss()
    start = time.perf_counter()
    hf_to_mcore(hf, f"{root}/bench.mcore", pc)
    out["to_mcore_s"] = time.perf_counter() - start
    out["peak_after_to_mcore"] = _peak_rss()
    start = time.perf_counter()
    mcore_to_hf(f"{root}/bench.mcore", f"{root}/bench.hf", pc, progress=False)
    out["to_hf_s"] = time.perf_counter() - start
    out["peak_after_to_hf"] = _peak_rss()
    out["worker_s"] = time.perf_counter() - entered
    return out


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
    return time.perf_counter() - start


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
    p.add_argument(
        "--vocab", type=int, default=1024, help="vocabulary (the tiny tokenizer supports ~300-1100)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shard-size", default="100MB", help="max shard size of the source checkpoint")
    p.add_argument("--workdir", default=None, help="where to make the temporary directory")
    return p.parse_args()


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
        described = ", ".join(f"{k}={v}" for k, v in overrides.items())
        print(f"checkpoint: {args.preset} {args.dtype}, {described}")
        print(f"            {size / 1e6:.1f} MB of tensors in {n_shards} shards (built in {init_s:.1f} s)")

        raw_s = raw_copy(hf, root / "raw.hf", fsync=False)
        raw_fsync_s = raw_copy(hf, root / "raw-fsync.hf", fsync=True)

        start = time.perf_counter()
        result = parallel.launch(bench_worker, 1, str(warmup), str(hf), str(root))[0]
        launch_s = time.perf_counter() - start
        identical = bit_identical(hf, root / "bench.hf")
        mcore_bytes = sum(p.stat().st_size for p in (root / "bench.mcore").rglob("*") if p.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    raw_gbs = size / raw_s / GB
    rows = [
        ("raw read+write (baseline)", raw_s),
        ("raw read+write+fsync", raw_fsync_s),
        ("hf_to_mcore", result["to_mcore_s"]),
        ("mcore_to_hf", result["to_hf_s"]),
    ]
    print()
    print(f"{'step':<28}{'bytes':>14}{'seconds':>10}{'GB/s':>8}{'vs raw':>9}")
    for name, seconds in rows:
        gbs = size / seconds / GB
        print(f"{name:<28}{size:>14,}{seconds:>10.3f}{gbs:>8.3f}{gbs / raw_gbs:>8.2f}x")
    print()
    start_s = launch_s - result["worker_s"]
    print(
        f"not in the table: process start + join {start_s:.1f} s; worker warm-up {result['warmup_s']:.1f} s"
    )
    print("  (imports, first tiny round trip)")
    print(f"Megatron checkpoint on disk: {mcore_bytes:,} bytes")
    print(f"round trip bit-identical: {'yes' if identical else 'NO'}")
    print()
    before, peak_before = result["rss_before"], result["peak_before"]
    print(f"worker memory (checkpoint = {size / GB:.3f} GB):")
    print(f"  RSS after warm-up              {before / GB:7.3f} GB (peak so far {peak_before / GB:.3f} GB)")
    for label, key in (("hf_to_mcore", "peak_after_to_mcore"), ("mcore_to_hf", "peak_after_to_hf")):
        peak = result[key]
        growth = peak - before
        print(
            f"  peak RSS through {label:<13}{peak / GB:7.3f} GB "
            f"= warm-up RSS + {growth / GB:.3f} GB ({growth / size:.2f}x checkpoint)"
        )


if __name__ == "__main__":
    main()
