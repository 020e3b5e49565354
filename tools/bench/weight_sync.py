"""Benchmark the trainer → engines weight push against a raw broadcast of the same bytes, in the same run.

A widened tiny MoE (default about 1.6 GB in fp32), one Megatron trainer rank (CPU, gloo) and 1, 2 and 4
transformers engines, each a Ray actor, as `mars train` runs them. For each engine count, on the same
transfer groups (:class:`~mars_megatron.pipeline.fleet.EngineFleet`):

- baseline: the same buckets broadcast with nothing exported into them and nothing loaded from them
  (``EngineFleet.measure_wire``): what the link alone costs;
- push: ``EngineFleet.push_weights``: export from Megatron (HF names, fused q/k/v and gate/up split,
  experts unfused), pack, broadcast, load into every engine (experts fused back);
- peak extra memory: the most bytes the sender and any receiver held for the push, counted by the
  transfer code (buffers and gathered copies), beside the bucket size.

Targets (issue 18): push <= 1.5x the raw broadcast; 4 engines <= 1.2x the time of 1; peak extra <= 2
buckets per process.

With no arguments it runs the default measurement (the ~1.7 GB model built in a temporary directory,
1, 2 and 4 engines, 128 MiB buckets, median of 3) and prints per engine count the raw broadcast (the
baseline), the push, their ratio, the ratio to one engine and the peak extra memory in buckets, then
each target met or not: about 3 minutes on 2 cores (175 s measured).

Ray starts here: run it inside a loopback-only network namespace, e.g.
    unshare -n sh -c 'ip link set lo up && python tools/bench/weight_sync.py'
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path
from typing import Any

from mars_megatron.models.presets import init_model
from mars_megatron.training.weight_sync import SendsWeights


class BenchRank(SendsWeights):
    """One trainer rank holding the model (no optimizer: the push reads the weights only)."""

    def __init__(self, model_dir: str, bucket_bytes: int) -> None:
        from mars_megatron.config import ParallelConfig
        from mars_megatron.jobs import load_engine
        from mars_megatron.training import parallel
        from mars_megatron.training.weight_sync import WeightSender

        parallel.init_model_parallel(ParallelConfig(), seed=0)
        self.engine = load_engine(model_dir, ParallelConfig(), dtype=None, impl="local")
        self.sender = WeightSender(self.engine.arch, bucket_bytes)

    def weight_senders(self) -> dict[str, tuple[Any, Any]]:
        return {"policy": (self.engine.model, self.sender)}


def measure(model_dir: str, engines: list[int], bucket_bytes: int, repeats: int) -> list[dict[str, Any]]:
    import ray

    from mars_megatron.pipeline.fleet import EngineFleet
    from mars_megatron.rollout.hf_engine import HFEngine
    from mars_megatron.rollout.ray_engine import start_rollout_actor
    from mars_megatron.training.ray_group import RayWorkerGroup

    ray.init(num_cpus=max(engines) + 2, include_dashboard=False, log_to_driver=False)
    factory = functools.partial(HFEngine, model_dir, seed=0)
    try:
        group = RayWorkerGroup(BenchRank, 1, model_dir, bucket_bytes, threads_per_rank=1)
        actors = [("policy", start_rollout_actor(factory, threads=1)) for _ in range(max(engines))]
        rows = []
        for n in engines:
            fleet = EngineFleet(
                group, actors[:n], lambda i: None, host="127.0.0.1", backend="gloo", log=lambda _: None
            )
            raw, push, sender_peak, receiver_peak = [], [], 0, 0
            for r in range(repeats):
                raw.append(fleet.measure_wire("policy"))
                report = fleet.push_weights({"policy": r + 1})["policy"]
                push.append(report.seconds)
                sender_peak = max(sender_peak, report.sender_peak_bytes)
                receiver_peak = max(receiver_peak, report.receiver_peak_bytes)
            plan = fleet.plans["policy"]
            rows.append(
                {
                    "engines": n,
                    "raw": statistics.median(raw),
                    "push": statistics.median(push),
                    "bytes": plan.nbytes,
                    "buckets": len(plan.buckets),
                    "bucket": plan.largest_bucket,
                    "sender_peak": sender_peak,
                    "receiver_peak": receiver_peak,
                }
            )
        group.shutdown()
        for _, engine in actors:
            engine.kill()
    finally:
        ray.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--bucket-mb", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if min(args.engines) < 1 or args.repeats < 1 or args.bucket_mb < 1:
        ap.error("--engines, --repeats and --bucket-mb must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        overrides = dict(
            num_hidden_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=3 * args.hidden,
            num_experts=args.experts,
            moe_intermediate_size=args.hidden,
        )
        model_dir = init_model("tiny-moe", Path(tmp) / "hf", overrides=overrides, max_shard_size="500MB")
        rows = measure(str(model_dir), args.engines, args.bucket_mb * 2**20, args.repeats)
    first = rows[0]
    mib = 2**20
    print(
        f"model: tiny-moe widened ({args.layers} layers, hidden {args.hidden}, {args.experts} experts), "
        f"{first['bytes'] / 1e9:.2f} GB fp32 in {first['buckets']} buckets of <= {first['bucket'] / mib:.0f} "
        f"MiB; one trainer rank, transformers engines, gloo; median of {args.repeats}"
    )
    print(
        f"{'engines':>8}{'raw s':>9}{'push s':>9}{'vs raw':>8}{'vs 1 eng':>10}{'GB/s':>7}"
        f"{'sender peak':>13}{'receiver peak':>15}"
    )
    for r in rows:
        print(
            f"{r['engines']:>8}{r['raw']:>9.2f}{r['push']:>9.2f}{r['push'] / r['raw']:>7.2f}x"
            f"{r['push'] / first['push']:>9.2f}x{r['bytes'] / 1e9 / r['push']:>7.2f}"
            f"{r['sender_peak'] / r['bucket']:>10.2f} bk{r['receiver_peak'] / r['bucket']:>12.2f} bk"
        )
    worst_raw = max(r["push"] / r["raw"] for r in rows)
    scale = rows[-1]["push"] / first["push"]
    worst_peak = max(max(r["sender_peak"], r["receiver_peak"]) / r["bucket"] for r in rows)
    print(f"target push <= 1.5x raw broadcast: {'met' if worst_raw <= 1.5 else 'NOT met'} ({worst_raw:.2f}x)")
    print(
        f"target {rows[-1]['engines']} engines <= 1.2x the time of {first['engines']}: "
        f"{'met' if scale <= 1.2 else 'NOT met'} ({scale:.2f}x)"
    )
    print(f"target peak extra <= 2 buckets: {'met' if worst_peak <= 2 else 'NOT met'} ({worst_peak:.2f})")


if __name__ == "__main__":
    main()
