"""MoE routing replay on the tiny task: ``moe.routing_replay=off`` against ``R3`` (or ``R2``), one warm start.

The trainer runs in float32 and the rollout engine in bfloat16 (``rollout.dtype``): the train-rollout
mismatch of GPU runs (other kernels and precision in vLLM than in Megatron), reproduced on CPU. Both runs
start from one `mars sft` checkpoint with one seed. Prints, per run and role, the mean trainer-vs-engine
mismatch (mean |log p_trainer - log p_engine|, k3 KL, fraction of tokens beyond the ratio bound) over
all steps, the reward over the first and last ``--window`` steps and, for R3, the share of routing
decisions where the trainer's routers would have chosen other experts than the engine; then draws
the reward and the mismatch curves of the runs side by side.

With no arguments it runs the default measurement on a fresh clone: it builds its own warm start (a random
tiny-moe and `mars sft`) under ``runs/bench_routing_replay`` (``--out``, which must not exist yet), trains
40 steps with ``off`` (the baseline) and ``R3``, prints the table described above with ``off`` first,
and writes the figure to ``OUT/routing_replay.png``: about 8 minutes on 2 idle cores (10 minutes measured
on 2 cores shared with other work); the training runs print their steps as they go.

Anything here starts Ray: run it inside a loopback-only network namespace, e.g.
    unshare -n sh -c 'ip link set lo up && python tools/bench/routing_replay.py'
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from statistics import fmean

from common import REPO, mars, warm_start

from mars_megatron.metrics import read_metrics
from mars_megatron.metrics.plot import moving_average
from mars_megatron.metrics.summary import reward_rise, training_seconds

ROLES = ("solver", "verifier", "corrector")


def mismatch(records: list[dict], role: str, key: str) -> float:
    values = [r[f"train/mismatch/{role}/{key}"] for r in records if f"train/mismatch/{role}/{key}" in r]
    return fmean(values) if values else float("nan")


def draw(runs: dict[str, list[dict]], out_png: Path, window: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    rewards, gaps = fig.subplots(1, 2)
    styles = ["-", "--", ":"]
    for (name, records), style in zip(runs.items(), styles, strict=False):
        steps = [r["step"] for r in records]
        for i, role in enumerate(ROLES):
            reward = [r.get(f"reward/{role}", float("nan")) for r in records]
            rewards.plot(
                steps, moving_average(reward, window), style, color=f"C{i}", label=f"{role} ({name})"
            )
            gap = [r.get(f"train/mismatch/{role}/abs_mean", float("nan")) for r in records]
            gaps.plot(steps, gap, style, color=f"C{i}", label=f"{role} ({name})")
    rewards.set_title(f"reward ({window}-step moving average)")
    gaps.set_title("mean |log p_trainer - log p_engine| per token")
    gaps.set_yscale("log")
    for ax in (rewards, gaps):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out_png)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/bench_routing_replay", help="a new folder for the runs")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=["off", "R3"], choices=["off", "R2", "R3"])
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--plot", default=None, help="figure path (default: OUT/routing_replay.png)")
    args = parser.parse_args()
    # Checked before the warm start, so that a bad flag fails in a second, not after minutes of training.
    if (REPO / args.out).exists():
        parser.error(f"--out {args.out} exists; remove it or pass another --out")
    if args.plot is not None and not Path(args.plot).resolve().parent.is_dir():
        parser.error(f"--plot {args.plot}: its directory does not exist")
    if args.steps < 1 or args.window < 1:
        parser.error("--steps and --window must be >= 1")
    out, _ = warm_start(args.out)
    runs = {}
    for mode in args.modes:
        mars("train", "examples/tiny_cpu.yaml", f"model.mcore_dir={out / 'sft'}",
             f"moe.routing_replay={mode}", f"rollout.dtype={args.rollout_dtype}", f"train.steps={args.steps}",
             f"logging.run_dir={out / mode}", "logging.tensorboard=false")  # fmt: skip
        runs[mode] = read_metrics(out / mode / "metrics.jsonl")

    print(f"\ntrainer float32, rollout engine {args.rollout_dtype}, {args.steps} steps per run")
    print(f"{'run':<5}{'role':<11}{'|dlogp|':>9}{'kl':>10}{'tok>2x':>8}{'first':>7}{'last':>7}{'rise':>8}")
    for mode, records in runs.items():
        rises = {r.role: r for r in reward_rise(records, args.window)}
        for role in ROLES:
            r = rises[role]
            print(f"{mode:<5}{role:<11}{mismatch(records, role, 'abs_mean'):9.5f}"
                  f"{mismatch(records, role, 'kl'):10.2e}{mismatch(records, role, 'token_outliers'):8.4f}"
                  f"{r.start:7.2f}{r.end:7.2f}{100 * r.rise:+7.1f}pt")  # fmt: skip
        changed = [r["train/routing_changed"] for r in records if "train/routing_changed" in r]
        overrode = f", replay overrode {100 * fmean(changed):.2f}% of routing decisions" if changed else ""
        print(f"{mode:<5}training {training_seconds(records):.0f} s{overrode}")
    png = Path(args.plot) if args.plot else out / "routing_replay.png"
    draw(runs, png, args.window)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
