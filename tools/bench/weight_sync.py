"""Benchmark trainer → engine weight sync against a raw copy of the same bytes, in the same run.

One trainer rank (Megatron, CPU) and a transformers engine in the same process, as on rank 0 of a run.
Timed:
- baseline: copy every engine parameter from a same-shaped source tensor (``dst.copy_(src)``), i.e. the
  bytes that must move, with no gathering, renaming or re-layout;
- ``WeightSync.sync``: export from Megatron (HF names, fused q/k/v and gate/up split, experts unfused) and
  ``HFEngine.update_weights`` (experts fused back).
Target: sync <= 1.5x the raw copy.

    python tools/bench/weight_sync.py [--layers 8 --hidden 512 --experts 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mars_megatron.config import ParallelConfig
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel


def worker(model_dir: str, repeats: int) -> dict[str, Any]:
    from mars_megatron.jobs import load_engine
    from mars_megatron.rollout.hf_engine import HFEngine
    from mars_megatron.training.weight_sync import WeightSync

    pc = ParallelConfig()
    parallel.init_model_parallel(pc, seed=0)
    trainer = load_engine(model_dir, pc, dtype=None, impl="local")
    engine = HFEngine(model_dir)
    params = list(engine.model.parameters())
    sources = [p.detach().clone() for p in params]
    raw, synced = [], []
    sync = WeightSync(trainer.arch, engine)
    stats = None
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(params, sources, strict=True):
                dst.copy_(src)
        raw.append(time.perf_counter() - start)
        stats = sync.sync(trainer.model)
        synced.append(stats.seconds)
    assert stats is not None
    return {"raw": raw, "sync": synced, "bytes": stats.bytes, "tensors": stats.tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = dict(
            num_hidden_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=3 * args.hidden,
            num_experts=args.experts,
            moe_intermediate_size=args.hidden,
        )
        model_dir = init_model("tiny-moe", Path(tmp) / "hf", overrides=overrides, max_shard_size="200MB")
        r = parallel.launch(worker, 1, str(model_dir), args.repeats)[0]
    raw, sync = statistics.median(r["raw"]), statistics.median(r["sync"])
    gb = r["bytes"] / 1e9
    print(
        f"model: tiny-moe widened ({args.layers} layers, hidden {args.hidden}, {args.experts} experts), "
        f"{r['tensors']} HF tensors, {r['bytes']:,} bytes fp32; median of {args.repeats}"
    )
    print(f"{'path':<44}{'seconds':>10}{'GB/s':>9}{'vs raw':>9}")
    print(f"{'raw copy of the same bytes (baseline)':<44}{raw:>10.4f}{gb / raw:>9.2f}{1.0:>8.2f}x")
    print(
        f"{'WeightSync.sync -> HFEngine.update_weights':<44}{sync:>10.4f}{gb / sync:>9.2f}{sync / raw:>8.2f}x"
    )
    verdict = "met" if sync <= 1.5 * raw else "NOT met"
    print(f"target sync <= 1.5x raw copy: {verdict} ({sync / raw:.2f}x)")


if __name__ == "__main__":
    main()
