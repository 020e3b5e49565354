"""MarsRL's headline table in miniature: the Solver alone against the V–C system, before and after RL, with
the shared-reward ablation and the spread over seeds.

The paper (MARSRL.md) reports, per model, the accuracy of the Solver alone and of the Verifier–Corrector
system (avg@32 on AIME 2025): untrained Qwen3-30B-A3B-Thinking, Solver 86.5 and system 85.6 (the system is
*worse*: its Verifier and Corrector do not help yet); after MarsRL, Solver 91.1 and system 93.3 (both rose,
and the system now beats its Solver). This benchmark measures the same table for the tiny model on a tiny
task's held-out split (problems never trained on), per seed:

  column ``SFT start``    the `mars sft` warm start of the task, the shared baseline;
  column ``RL agent``     `mars train` with agent-specific rewards (MarsRL);
  column ``RL shared``    the same run with ``algorithm.reward=shared`` (one trajectory-level reward).

One warm start serves every seed, so the spread is RL's (the paper, too, trains one base model);
``--warm-start-per-seed`` builds a random tiny model and a warm start per seed instead. Rows: Solver alone and
system avg@K, their difference, pass@k of both, and what explains them: the Verifier's accuracy on right and
on wrong solutions, the Corrector's fix and break rates, the share of loops the Verifier accepted (``mars
eval``'s ``roles`` summary). Each cell is the mean over seeds and, with several seeds, the range. Evaluation
uses `mars eval --checkpoint` on each run's final checkpoint with the run's prompt set and MarsRL's evaluation
sampling (temperature 0.6, top-p 0.95).

The goal, stated before measuring (issue 31): after RL with agent-specific rewards the system beats its
Solver by ≥ 5 points held-out on every seed, and by more than with the shared reward (mean over seeds).
The last lines say whether it was met.

Tasks (``--task``): ``subset_sum`` (pick numbers from a list that add up to a target: checking is a few
additions, finding is a search; any valid subset is right) and ``sums`` (one-digit sums, where checking is
computing). The RL runs also evaluate the held-out split every ``--eval-interval`` steps; ``heldout.png``
draws the Solver against the system during training, agent and shared, averaged over seeds.

    python tools/bench/paper_table.py --task subset_sum [--seeds 3] [--samples 16] [--out DIR] [--sft DIR]

With no arguments it runs ``--task subset_sum`` over 3 seeds (one warm start and its evaluation, then per
seed two RL runs and their evaluations on the held-out split: 15 commands, 2 side by side, about 30 min on
2 cores) and prints the Markdown table with the goal's verdict; it writes ``table.md``/``table.json``/
``heldout.png`` under ``--out``, each command's output under ``--out``/logs. Every process uses one CPU
thread, so ``--jobs 2`` fills two cores without changing a figure (tests/test_repeat.py: the same figures
idle or loaded). ``--sft`` uses an existing warm start of the task; ``--resume`` finishes an interrupted
``--out``, keeping the commands that had finished.
Anything here starts Ray: run it inside a loopback-only network namespace, e.g.
    unshare -n sh -c 'ip link set lo up && python tools/bench/paper_table.py --task subset_sum'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, Job, JobFailed, mars_argv, run_jobs


@dataclass(frozen=True)
class Task:
    """The files of one tiny task: its warm start, its RL config and its two splits."""

    sft: str
    config: str
    train: str
    test: str
    what: str


TASKS = {
    "subset_sum": Task(
        "examples/subset_sft.yaml",
        "examples/subset_cpu.yaml",
        "examples/data/subset_train.jsonl",
        "examples/data/subset_test.jsonl",
        "subset sums",
    ),
    "sums": Task(
        "examples/tiny_sft.yaml",
        "examples/tiny_cpu.yaml",
        "examples/data/arith_train.jsonl",
        "examples/data/arith_test.jsonl",
        "sums",
    ),
}
PAPER = {  # MARSRL.md: Qwen3-30B-A3B-Thinking-2507 on AIME 2025, avg@32
    "Solver alone": ("86.5", "91.1"),
    "V–C system": ("85.6", "93.3"),
}
RUNS = {"sft": "SFT start", "agent": "RL agent", "shared": "RL shared"}
GOAL_POINTS = 5.0


def eval_argv(
    out: Path,
    samples: int,
    data: str,
    *,
    config: str,
    model: Path | None = None,
    run: Path | None = None,
    limit: int | None = None,
) -> tuple[str, ...]:
    """`mars eval` of a warm start (``model``) or of a run's final checkpoint (``run``) on ``data``."""
    target = ["--model", str(model)] if model is not None else ["--checkpoint", str(run / "ckpt")]  # type: ignore[operator]
    config = str(run / "config.yaml") if run is not None else config
    first = ["--limit", str(limit)] if limit else []
    return mars_argv(
        "eval",
        "--data",
        data,
        *first,
        *target,
        "--config",
        config,
        "--engine",
        "transformers",
        "--samples",
        str(samples),
        "--out",
        str(out),
        "--checker-workers",
        "1",
    )


def warm_start_jobs(task: Task, folder: Path, seed: int, args: argparse.Namespace) -> list[Job]:
    """A random tiny-moe of ``seed``, its `mars sft` warm start (SFT seed shifted by ``seed``) and the
    warm start's evaluation (the ``SFT start`` column)."""
    name = folder.name
    sft_seed = [f"seed={1234 + seed}"] if seed else []  # seed 0: the task's own warm start, as the demo's
    return [
        Job(
            f"{name}/init",
            mars_argv("init-model", "--preset", "tiny-moe", "--seed", str(seed), "--out", str(folder / "hf")),
            writes=folder / "hf",
        ),
        Job(
            f"{name}/sft",
            mars_argv(
                "sft", task.sft, "--model-dir", str(folder / "hf"), "--out", str(folder / "sft"), *sft_seed
            ),
            (f"{name}/init",),
            folder / "sft",
        ),
        Job(
            f"{name}/eval_sft",
            eval_argv(
                folder / "eval_sft",
                args.samples,
                task.test,
                config=task.config,
                model=folder / "sft",
                limit=args.limit,
            ),
            (f"{name}/sft",),
            folder / "eval_sft",
        ),
    ]


def train_argv(
    task: Task, run: Path, sft: Path, reward: str, seed: int, args: argparse.Namespace
) -> tuple[str, ...]:
    """`mars train` of the task's RL config from ``sft`` with one reward kind, seeded by ``seed``."""
    extra = [f"train.steps={args.steps}"] if args.steps else []
    train_seed = [f"train.seed={1234 + seed}"] if seed else []
    return mars_argv(
        "train",
        task.config,
        f"model.mcore_dir={sft}",
        f"algorithm.reward={reward}",
        f"logging.run_dir={run}",
        f"checkpoint.save_dir={run / 'ckpt'}",
        f"evaluation.test_file={task.test}",
        f"evaluation.interval={args.eval_interval}",
        f"evaluation.samples={args.eval_samples}",
        *train_seed,
        *extra,
    )


def plan(task: Task, out: Path, args: argparse.Namespace) -> tuple[list[Job], list[dict[str, Path]]]:
    """Every job of the table, and per seed the evaluation folder (``summary.json``) of each column.

    One warm start serves every seed (the spread is RL's: the paper too reports RL from one base model)
    unless ``--warm-start-per-seed``; ``--sft`` gives that one warm start. Jobs are listed so that a
    free lane takes an evaluation as soon as its run is finished, before the next seed's runs."""
    jobs: list[Job] = []
    warm: dict[int, tuple[Path, Path, tuple[str, ...]]] = {}  # seed -> (sft, its summary, its job)
    per_seed: list[dict[str, Path]] = []
    for seed in range(args.seeds):
        folder = out / f"seed{seed}"
        if seed == 0 or args.warm_start_per_seed:
            if args.sft is not None:
                sft = Path(args.sft).resolve()
                jobs.append(
                    Job(
                        "seed0/eval_sft",
                        eval_argv(
                            folder / "eval_sft",
                            args.samples,
                            task.test,
                            config=task.config,
                            model=sft,
                            limit=args.limit,
                        ),
                        writes=folder / "eval_sft",
                    )
                )
                warm[seed] = (sft, folder / "eval_sft", ())
            else:
                jobs += warm_start_jobs(task, folder, seed, args)
                warm[seed] = (folder / "sft", folder / "eval_sft", (f"seed{seed}/sft",))
        sft, sft_eval, after = warm[seed] if seed in warm else warm[0]
        runs = []
        for reward in ("agent", "shared"):
            run = folder / reward
            runs.append(
                Job(f"seed{seed}/{reward}", train_argv(task, run, sft, reward, seed, args), after, run)
            )
            runs.append(
                Job(
                    f"seed{seed}/eval_{reward}",
                    eval_argv(
                        folder / f"eval_{reward}",
                        args.samples,
                        task.test,
                        config=task.config,
                        run=run,
                        limit=args.limit,
                    ),
                    (f"seed{seed}/{reward}",),
                    folder / f"eval_{reward}",
                )
            )
        jobs += runs[0::2] + runs[1::2]
        per_seed.append({"sft": sft_eval, "agent": folder / "eval_agent", "shared": folder / "eval_shared"})
    return jobs, per_seed


# ------------------------------------------------------------------------------------------- the table
def _get(summary: dict, path: str) -> float | None:
    node: Any = summary
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, int | float) else None


def row_values(summary: dict, k: str) -> dict[str, float | None]:
    """One run's rows (fractions; the gap in fractions too)."""
    solver, system = _get(summary, "solver_acc"), _get(summary, "system_acc")
    out: dict[str, float | None] = {
        f"Solver alone, avg@{k}": solver,
        f"V–C system, avg@{k}": system,
        "system − Solver (points)": None if solver is None or system is None else system - solver,
    }
    for kk in ("2", "4", k):
        if kk != "1" and kk in summary.get("pass@k", {}).get("system", {}):
            out[f"Solver pass@{kk}"] = summary["pass@k"]["solver"].get(kk)
            out[f"system pass@{kk}"] = summary["pass@k"]["system"].get(kk)
    out |= {
        "Verifier: Correct on right solutions": _get(summary, "roles.verifier.acc_on_right"),
        "Verifier: Wrong on wrong solutions": _get(summary, "roles.verifier.acc_on_wrong"),
        "Corrector: fixes a wrong solution": _get(summary, "roles.corrector.fix_rate"),
        "Corrector: breaks a right one": _get(summary, "roles.corrector.break_rate"),
        "loops accepted by the Verifier": _get(summary, "accepted_rate"),
    }
    return out


def cell(values: list[float | None], signed: bool) -> str:
    """Mean over seeds in percent (points), with the range when there are several."""
    present = [100 * v for v in values if v is not None]
    if not present:
        return "–"
    fmt = "{:+.1f}" if signed else "{:.1f}"
    mean = fmt.format(statistics.fmean(present))
    if len(present) == 1:
        return mean
    return f"{mean} ({fmt.format(min(present))} to {fmt.format(max(present))})"


def markdown(title: str, per_seed: list[dict[str, dict]]) -> str:
    """The table: one column per run kind, each cell the mean (and range) over seeds."""
    k = str(per_seed[0]["sft"]["samples"])
    columns = [name for name in RUNS if all(name in seed for seed in per_seed)]
    rows = list(row_values(per_seed[0][columns[0]], k))
    lines = [f"| {title} | {' | '.join(RUNS[c] for c in columns)} |", "|---" * (len(columns) + 1) + "|"]
    for label in rows:
        cells = [
            cell([row_values(seed[c], k).get(label) for seed in per_seed], "points" in label) for c in columns
        ]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += ["", "| paper: AIME 2025, avg@32 | Qwen3-30B-A3B-Thinking | after MarsRL |", "|---|---|---|"]
    lines += [f"| {label} | {before} | {after} |" for label, (before, after) in PAPER.items()]
    return "\n".join(lines)


def gaps(per_seed: list[dict[str, dict]], run: str) -> list[float]:
    """System − Solver in points, per seed, of one run kind."""
    return [100 * (s[run]["system_acc"] - s[run]["solver_acc"]) for s in per_seed if run in s]


def verdict(per_seed: list[dict[str, dict]]) -> list[str]:
    """The goal, line by line: met or not, with the figures."""
    agent, shared = gaps(per_seed, "agent"), gaps(per_seed, "shared")
    every = all(g >= GOAL_POINTS for g in agent)
    mean_agent, mean_shared = statistics.fmean(agent), statistics.fmean(shared)
    listed = {name: ", ".join(f"{g:+.1f}" for g in values) for name, values in (("a", agent), ("s", shared))}
    return [
        f"goal {'MET' if every else 'NOT MET'}: system − Solver ≥ {GOAL_POINTS:.0f} points with agent "
        f"rewards on every seed ({listed['a']})",
        f"goal {'MET' if mean_agent > mean_shared else 'NOT MET'}: more than with the shared reward (mean "
        f"{mean_agent:+.1f} against {mean_shared:+.1f}; per seed {listed['s']})",
    ]


def plot_held_out(runs: dict[str, list[Path]], out_png: Path, samples: int) -> Path | None:
    """Held-out Solver alone and system per evaluated step (avg@``samples``, the evaluation during
    training), each run kind averaged over its seeds."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=100)
    ax = fig.add_subplot()
    drawn = False
    for (name, folders), color in zip(runs.items(), ("tab:blue", "tab:orange"), strict=False):
        records = [[json.loads(x) for x in (f / "eval.jsonl").read_text().splitlines() if x.strip()]
                   for f in folders if (f / "eval.jsonl").is_file()]  # fmt: skip
        if not records:
            continue
        steps = sorted(set.intersection(*[{r["step"] for r in rs} for rs in records]))
        for key, style, label in (
            ("eval/system_acc", "-o", "system"),
            ("eval/solver_acc", "--s", "Solver alone"),
        ):
            means = [statistics.fmean(r[key] for rs in records for r in rs if r["step"] == s) for s in steps]
            ax.plot(steps, means, style, color=color, markersize=4, label=f"{RUNS[name]}: {label}")
            drawn = True
    if not drawn:
        return None
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"held-out accuracy (avg@{samples}, mean over seeds)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(out_png, format="png")
    return out_png


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="subset_sum")
    parser.add_argument(
        "--out", default=None, help="new output folder (default runs/bench_paper_table_<task>)"
    )
    parser.add_argument("--resume", action="store_true", help="finish an interrupted or failed --out")
    parser.add_argument("--seeds", type=int, default=3, help="RL seeds 0..N-1 (mean and range over them)")
    parser.add_argument(
        "--warm-start-per-seed", action="store_true", help="a warm start per seed (default: one for all)"
    )
    parser.add_argument("--sft", default=None, help="an existing warm start of the task (mars sft output)")
    parser.add_argument("--samples", type=int, default=16, help="K of avg@K (>= 8)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N held-out problems only")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps of the RL runs")
    parser.add_argument("--eval-interval", type=int, default=15, help="held-out curve during training")
    parser.add_argument("--eval-samples", type=int, default=4, help="K of the curve during training")
    parser.add_argument("--jobs", type=int, default=2, help="commands run side by side (one CPU thread each)")
    args = parser.parse_args()
    if args.samples < 8:
        parser.error(f"--samples must be >= 8 (avg@K with K >= 8), got {args.samples}")
    for flag in ("seeds", "jobs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.sft is not None and not (Path(args.sft) / "mars_checkpoint.json").is_file():
        parser.error(f"--sft {args.sft}: not a mars sft output (no mars_checkpoint.json)")
    if args.sft is not None and args.warm_start_per_seed:
        parser.error("--sft gives one warm start for every seed; drop --warm-start-per-seed")
    task = TASKS[args.task]
    out = (REPO / (args.out or f"runs/bench_paper_table_{args.task}")).resolve()
    if out.exists() and not args.resume:
        parser.error(f"--out {out} exists; remove it, pass another --out, or --resume to finish it")
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in ("resume", "jobs", "out")}
    recorded = out / "bench_args.json"
    if recorded.is_file() and json.loads(recorded.read_text()) != settings:
        parser.error(
            f"--resume: {out} was started with {recorded.read_text().strip()}; give the same options"
        )
    recorded.write_text(json.dumps(settings) + "\n")
    start = time.perf_counter()
    jobs, summaries = plan(task, out, args)
    print(f"{len(jobs)} jobs, {args.jobs} at a time; logs in {out / 'logs'}", file=sys.stderr, flush=True)
    try:
        run_jobs(jobs, out, args.jobs, log=lambda line: print(line, file=sys.stderr, flush=True))
    except JobFailed as e:
        print(f"paper_table: {e}", file=sys.stderr)
        return 1
    per_seed = [
        {column: json.loads((folder / "summary.json").read_text()) for column, folder in seed.items()}
        for seed in summaries
    ]
    runs = {
        reward: [out / f"seed{seed}" / reward for seed in range(args.seeds)] for reward in ("agent", "shared")
    }
    problems = per_seed[0]["sft"].get("problems", "?")
    spread = "a warm start per seed" if args.warm_start_per_seed else "one warm start"
    title = f"held-out ({problems} {task.what} never trained on), {args.seeds} RL seed(s), {spread}"
    table = markdown(title, per_seed)
    lines = verdict(per_seed)
    png = plot_held_out(runs, out / "heldout.png", args.eval_samples)
    minutes = (time.perf_counter() - start) / 60
    (out / "table.md").write_text(table + "\n\n" + "\n".join(lines) + f"\n\nwall time: {minutes:.1f} min\n")
    (out / "table.json").write_text(
        json.dumps({"task": args.task, "seeds": per_seed, "verdict": lines, "minutes": minutes}, indent=1)
        + "\n"
    )
    print(table)
    print()
    print("\n".join(lines))
    print(f"wall time: {minutes:.1f} min; held-out curves: {png or 'none (no evaluation during training)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
