"""MarsRL's headline table in miniature: the Solver alone against the whole V–C system, before and after RL.

The paper (MARSRL.md) reports, per model, the accuracy of the Solver alone and of the Verifier–Corrector
system (avg@32 on AIME 2025): untrained Qwen3-30B-A3B-Thinking, Solver 86.5 and system 85.6 (the system is
*worse*: its Verifier and Corrector do not help yet); after MarsRL, Solver 91.1 and system 93.3 (both rose,
and the system now beats its Solver). This benchmark measures the same table for the tiny model on the
held-out split of the tiny task (``examples/data/arith_test.jsonl``: 25 sums never trained on), from one
warm start:

  column ``SFT start``    the `mars sft` warm start (examples/tiny_sft.yaml), the shared baseline;
  column ``RL agent``     `mars train examples/tiny_cpu.yaml`, agent-specific rewards (MarsRL);
  column ``RL shared``    the same run with ``algorithm.reward=shared`` (one trajectory-level reward).

Rows: Solver-alone and system avg@K, their difference, pass@k of both, and why the difference is what it
is: the Verifier's accuracy on right and on wrong solutions and the Corrector's fix rate (mars eval's
``roles`` summary). A second table evaluates the same three models on 25 problems they were trained on
(``--train-limit``), which separates what the system adds where the model has the skill from what it
cannot add where it lacks it. Evaluation uses `mars eval --checkpoint` on each run's final checkpoint,
with the run's prompt set (``--config``) and MarsRL's evaluation sampling (temperature 0.6, top-p 0.95).
The RL runs also evaluate the held-out split every ``--eval-interval`` updates, so their ``rewards.png``
shows the system against its Solver step by step.

With no arguments it builds its warm start (about 4 min on 2 cores), trains both runs (about 4 min each)
and evaluates the three models on both splits (about 1-2 min each), about 20 minutes in all; it prints
the Markdown table and writes ``table.md``/``table.json`` under ``--out``.

Anything here starts Ray: run it inside a loopback-only network namespace, e.g.
    unshare -n sh -c 'ip link set lo up && python tools/bench/paper_table.py'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from common import REPO, mars, warm_start

TEST = "examples/data/arith_test.jsonl"
TRAIN = "examples/data/arith_train.jsonl"
CONFIG = "examples/tiny_cpu.yaml"
PAPER = {  # MARSRL.md: Qwen3-30B-A3B-Thinking-2507 on AIME 2025, avg@32
    "Solver alone": ("86.5", "91.1"),
    "V–C system": ("85.6", "93.3"),
}
RUNS = {"sft": "SFT start", "agent": "RL agent", "shared": "RL shared"}


def evaluate(
    out: Path,
    name: str,
    samples: int,
    data: str,
    limit: int | None,
    *,
    model: Path | None = None,
    run: Path | None = None,
) -> dict:
    """`mars eval` of a warm start (``model``) or of a run's final checkpoint (``run``) on ``data``."""
    target = ["--model", str(model)] if model is not None else ["--checkpoint", str(run / "ckpt")]
    config = str(run / "config.yaml") if run is not None else CONFIG
    folder = out / f"eval_{name}"
    first = ["--limit", str(limit)] if limit else []
    mars("eval", "--data", data, *first, *target, "--config", config, "--engine", "transformers",
         "--samples", str(samples), "--out", str(folder), "--checker-workers", "1")  # fmt: skip
    return json.loads((folder / "summary.json").read_text())


def train(out: Path, sft: Path, reward: str, steps: int | None, interval: int, eval_samples: int) -> Path:
    run = out / reward
    extra = [f"train.steps={steps}"] if steps else []
    mars("train", CONFIG, f"model.mcore_dir={sft}", f"algorithm.reward={reward}", f"logging.run_dir={run}",
         f"checkpoint.save_dir={run / 'ckpt'}", f"evaluation.test_file={TEST}",
         f"evaluation.interval={interval}", f"evaluation.samples={eval_samples}", *extra)  # fmt: skip
    return run


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def rows(summaries: dict[str, dict]) -> list[tuple[str, list[str]]]:
    """The table's rows, one value per run (percent)."""

    def get(path: str) -> list[float | None]:
        values = []
        for s in summaries.values():
            node: Any = s
            for part in path.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            values.append(node)
        return values

    k = str(next(iter(summaries.values()))["samples"])
    solver, system = get("solver_acc"), get("system_acc")
    gap = [None if a is None or b is None else b - a for a, b in zip(solver, system, strict=True)]
    out = [
        ("Solver alone, avg@" + k, [pct(v) for v in solver]),
        ("V–C system, avg@" + k, [pct(v) for v in system]),
        ("system − Solver (points)", ["–" if g is None else f"{100 * g:+.1f}" for g in gap]),
    ]
    for kk in ("1", "2", "4", k):
        if kk in next(iter(summaries.values()))["pass@k"]["system"] and kk != "1":
            out.append(
                (f"Solver pass@{kk}", [pct(s["pass@k"]["solver"].get(kk)) for s in summaries.values()])
            )
            out.append(
                (f"system pass@{kk}", [pct(s["pass@k"]["system"].get(kk)) for s in summaries.values()])
            )
    out += [
        ("Verifier: Correct on right solutions", [pct(v) for v in get("roles.verifier.acc_on_right")]),
        ("Verifier: Wrong on wrong solutions", [pct(v) for v in get("roles.verifier.acc_on_wrong")]),
        ("Corrector: fixes a wrong solution", [pct(v) for v in get("roles.corrector.fix_rate")]),
        ("Corrector: breaks a right one", [pct(v) for v in get("roles.corrector.break_rate")]),
        ("loops accepted by the Verifier", [pct(v) for v in get("accepted_rate")]),
    ]
    return out


def markdown(tables: dict[str, dict[str, dict]]) -> str:
    lines: list[str] = []
    for title, summaries in tables.items():
        names = [RUNS[n] for n in summaries]
        lines += [f"| {title} | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {label} | {' | '.join(values)} |" for label, values in rows(summaries)]
        lines.append("")
    lines += ["| paper: AIME 2025, avg@32 | Qwen3-30B-A3B-Thinking | after MarsRL |", "|---|---|---|"]
    lines += [f"| {label} | {before} | {after} |" for label, (before, after) in PAPER.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="runs/bench_paper_table", help="new output folder (refused if it exists)"
    )
    parser.add_argument(
        "--sft", default=None, help="an existing warm start (mars sft output) instead of a new one"
    )
    parser.add_argument("--samples", type=int, default=16, help="K of avg@K (>= 8)")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps of the RL runs")
    parser.add_argument("--eval-interval", type=int, default=15, help="held-out curve during training")
    parser.add_argument("--eval-samples", type=int, default=4, help="K of the curve during training")
    parser.add_argument(
        "--train-limit", type=int, default=25, help="trained-on problems in the second table (0 = no table)"
    )
    args = parser.parse_args()
    if args.samples < 8:
        parser.error(f"--samples must be >= 8 (avg@K with K >= 8), got {args.samples}")
    if args.sft is not None and not (Path(args.sft) / "mars_checkpoint.json").is_file():
        parser.error(f"--sft {args.sft}: not a mars sft output (no mars_checkpoint.json)")
    if args.sft is None:
        out, _ = warm_start(args.out)
        sft = out / "sft"
    else:
        out = (REPO / args.out).resolve()
        if out.exists():
            parser.error(f"--out {out} exists; remove it or pass another --out")
        out.mkdir(parents=True)
        sft = Path(args.sft).resolve()
    held_out = {"sft": evaluate(out, "sft", args.samples, TEST, None, model=sft)}
    trained = {}
    if args.train_limit:
        trained["sft"] = evaluate(out, "sft_train", args.samples, TRAIN, args.train_limit, model=sft)
    for reward in ("agent", "shared"):
        run = train(out, sft, reward, args.steps, args.eval_interval, args.eval_samples)
        held_out[reward] = evaluate(out, reward, args.samples, TEST, None, run=run)
        if args.train_limit:
            trained[reward] = evaluate(out, f"{reward}_train", args.samples, TRAIN, args.train_limit, run=run)
    tables = {"held-out (25 sums never trained on)": held_out}
    if trained:
        tables[f"trained on ({args.train_limit} of the training sums)"] = trained
    table = markdown(tables)
    (out / "table.md").write_text(table + "\n")
    (out / "table.json").write_text(
        json.dumps({t: {RUNS[n]: s for n, s in ss.items()} for t, ss in tables.items()}, indent=1) + "\n"
    )
    print(table)
    print(
        "\ntraining curves with the held-out panel: "
        + ", ".join(str(out / reward / "rewards.png") for reward in ("agent", "shared"))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
