"""The tiny MarsRL run, measured: every role's reward at the start and the end, and the ablation.

Runs the README's main job (scripts/demo.sh's recipe: random tiny Qwen3-MoE -> `mars sft` -> `mars train
examples/tiny_cpu.yaml`) with agent-specific rewards, then, from the same warm start, with
``algorithm.reward=shared`` (one trajectory-level reward for every role). Prints each role's mean reward
over the first and last ``--window`` steps of each run (always the agent-specific reward, so the two runs
are on one scale), the rise, the training wall time, and draws both runs into one figure.

With no arguments it builds its warm start under ``--out`` (about 4 min on 2 cores), trains both runs (60
steps each, about 3-7 min each) and prints the table of rises and the plot's path.

Target (issue 4): with agent-specific rewards, every role's mean reward rises by >= 20 points within
10 minutes of training on 2 cores.

Anything here starts Ray: run it inside a loopback-only network namespace, e.g.
    unshare -n sh -c 'ip link set lo up && python tools/bench/tiny_run.py'
"""

from __future__ import annotations

import argparse

from common import mars, warm_start

from mars_megatron.metrics import read_metrics
from mars_megatron.metrics.summary import reward_rise, training_seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/bench_tiny_run")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=["agent", "shared"], choices=["agent", "shared"])
    args = parser.parse_args()
    out, sft_s = warm_start(args.out)
    runs = {}
    for mode in args.modes:
        extra = [f"train.steps={args.steps}"] if args.steps else []
        mars("train", "examples/tiny_cpu.yaml", f"model.mcore_dir={out / 'sft'}", f"algorithm.reward={mode}",
             f"logging.run_dir={out / mode}", *extra)  # fmt: skip
        runs[mode] = read_metrics(out / mode / "metrics.jsonl")

    print(f"\nsft warm start: {sft_s:.0f} s (process wall time, start-up included)")
    print(f"{'run':<8}{'role':<11}{'first':>7}{'last':>7}{'rise':>8}   training ({args.window}-step windows)")
    for mode, records in runs.items():
        for r in reward_rise(records, args.window):
            print(f"{mode:<8}{r.role:<11}{r.start:7.2f}{r.end:7.2f}{100 * r.rise:+7.1f}pt", end="")
            print(f"   {training_seconds(records):.0f} s, {len(records)} steps" if r.role == "solver" else "")
    if len(runs) > 1:
        mars("plot", *(str(out / m) for m in runs), "--labels", *(f"reward={m}" for m in runs),
             "--out", str(out / "rewards_ablation.png"))  # fmt: skip
        print(f"plot: {out / 'rewards_ablation.png'}")


if __name__ == "__main__":
    main()
