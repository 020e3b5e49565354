"""Benchmark the packing planner on the TARGETS.md workload against simpler planners, in one run.

Workload (seeded): 1024 samples; prompt lengths uniform in [200, 2000]; response lengths lognormal with
median 15,000 and sigma 0.6, clipped to [500, 65536]; packs of 69,632 tokens over 8 data-parallel ranks.

Planners compared:

- ``ours``: best-fit decreasing, then DP balancing by sample moves/swaps (``plan_packs``);
- ``ffd + LPT``: first-fit decreasing (NeMo-RL's base heuristic), packs given to ranks largest first to
  the least-loaded rank, no sample moves;
- ``ff + LPT``: first fit in arrival order (slime-like), same rank assignment.

Per planner: packs vs the lower bound ceil(total/cap), fill ratio, busiest-rank load / mean, largest pack
vs the cap, padding packs needed for equal micro-batch counts, and planning time (median of ``--repeats``).

With no arguments it runs the default measurement (seed 0, median of 21 plans; the workload is generated)
and prints the table above, our planner first and the simpler planners as baselines, then each target
met or not: a few seconds.

    python tools/bench/packing.py [--seed 0] [--repeats 21] [--seeds 1]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from mars_megatron.training.packing import PackPlan, plan_packs

SAMPLES = 1024
CAPACITY = 69_632
DP = 8
TIME_TARGET_MS = 10.0
BALANCE_TARGET = 1.01

PLANNERS = {
    "ours (bfd + balance)": {"algorithm": "bfd", "rebalance": True},
    "ffd + LPT": {"algorithm": "ffd", "rebalance": False},
    "ff + LPT": {"algorithm": "ff", "rebalance": False},
}


def workload(seed: int) -> list[int]:
    rng = random.Random(seed)
    out = []
    for _ in range(SAMPLES):
        prompt = rng.randint(200, 2000)
        response = round(rng.lognormvariate(math.log(15_000), 0.6))
        out.append(prompt + min(max(response, 500), 65_536))
    return out


def time_plan(lengths: list[int], repeats: int, **kwargs) -> tuple[PackPlan, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_packs(lengths, CAPACITY, DP, pad_ranks=True, **kwargs)
        times.append(time.perf_counter() - start)
    return plan, statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed")
    ap.add_argument("--seeds", type=int, default=1, help="also run seeds seed+1 .. seed+seeds-1")
    ap.add_argument("--repeats", type=int, default=21, help="plans per planner (median time shown)")
    args = ap.parse_args()
    if args.seeds < 1 or args.repeats < 1:
        ap.error("--seeds and --repeats must be >= 1")
    for seed in range(args.seed, args.seed + args.seeds):
        lengths = workload(seed)
        total = sum(lengths)
        lb = -(-total // CAPACITY)
        print(
            f"seed {seed}: {SAMPLES} samples, {total:,} tokens, mean {total / SAMPLES:,.0f}, "
            f"max {max(lengths):,}; cap {CAPACITY:,}, dp {DP}; lower bound {lb} packs"
        )
        print(
            f"  {'planner':<22} {'packs':>5} {'vs LB':>5} {'fill':>7} {'busiest/mean':>12} "
            f"{'max pack/cap':>12} {'pad packs':>9} {'plan ms':>8}"
        )
        results = {}
        for name, kwargs in PLANNERS.items():
            plan, ms = time_plan(lengths, args.repeats, **kwargs)
            results[name] = (plan, ms)
            print(
                f"  {name:<22} {plan.num_packs:>5} {plan.num_packs - lb:>+5} {plan.fill_ratio:>7.2%} "
                f"{plan.balance:>12.4f} {max(plan.pack_loads) / CAPACITY:>12.4f} "
                f"{plan.num_padding_packs:>9} {ms:>8.2f}"
            )
        plan, ms = results["ours (bfd + balance)"]
        checks = {
            f"packs <= lower bound + 1 ({plan.num_packs} <= {lb + 1})": plan.num_packs <= lb + 1,
            f"no pack over the cap (max {max(plan.pack_loads):,} <= {CAPACITY:,})": max(plan.pack_loads)
            <= CAPACITY,
            f"busiest rank <= {BALANCE_TARGET} x mean ({plan.balance:.4f})": plan.balance <= BALANCE_TARGET,
            f"planning < {TIME_TARGET_MS:.0f} ms ({ms:.2f} ms median)": ms < TIME_TARGET_MS,
        }
        for text, ok in checks.items():
            print(f"  target {'MET' if ok else 'NOT MET'}: {text}")


if __name__ == "__main__":
    main()
