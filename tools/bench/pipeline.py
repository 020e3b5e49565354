"""The agentic pipeline against the synchronous loop: (a) the real tiny run, (b) the same scheduler simulated
at paper scale.

(a) ``--real``: from one warm start, ``mars train examples/tiny_cpu.yaml`` twice, ``pipeline.mode=sync``
then ``pipeline.mode=agentic``, same config, same machine, one after the other. The warm start is ``--sft
DIR`` (a `mars sft` checkpoint, e.g. scripts/demo.sh's ``runs/demo/sft``) or, without ``--sft``, one built
under ``--out`` first (``init-model`` + ``mars sft``, as the other tiny-task benchmarks do), so that a
fresh clone can run it. Prints trained samples per second of training wall time (the sum of
``time/step``), the trainer's idle fraction (1 - time/train / time/step), and each role's reward rise,
with the sync run as the baseline (its row is 1.00x).

(b) ``--sim``: :mod:`mars_megatron.pipeline.simulate` runs the real scheduler on a virtual clock at MarsRL's
scale — G = 8, 128 problems per update, 5 positions, 64k-token responses decoded in 4 segments of 16k,
long-tail lengths (log-normal, most 5k-30k, capped at 64k) — with per-token costs measured here: one
decode step of the tiny MoE's transformers engine at batch 1 and 64, and the trainer's seconds per token
from run (a)'s synchronous metrics (or ``--train-s-per-token``). Sync is the same scheduler with staleness
0 and whole responses, the baseline of each row. One simulated token stands for ``--block`` real ones (the
schedule is unchanged up to rounding; it keeps the simulation to seconds). The decode steps run on
``--sft``'s model, else on the warm start of (a), else on a random tiny MoE (a decode step's cost does not
depend on the weights: every request decodes a fixed number of tokens).

Targets (issue 5): >= 1.3x samples/s on the tiny CPU run, >= 2.0x in the paper-scale simulation, trainer
idle <= 10%.

With no arguments it prints its usage and the modes to choose from on stderr and exits 2: the two modes
answer different questions and (a) takes about ten minutes on 2 cores (``--real --sim``, warm start
included: 587 s measured), so neither is run unasked.
``--sim`` alone needs ``--train-s-per-token`` (it has no run (a) to measure the trainer in) and takes
about a minute (72 s on 2 cores, mostly the decode measurement).

Anything here starts Ray: run it inside a loopback-only network namespace, e.g.
    unshare -n sh -c 'ip link set lo up && python tools/bench/pipeline.py --real --sim'
    unshare -n sh -c 'ip link set lo up && python tools/bench/pipeline.py --real --sft runs/demo/sft --sim'
    python tools/bench/pipeline.py --sim --train-s-per-token 8.5e-5   # the README's measured trainer cost
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import REPO, mars, warm_start

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.config import AgentsConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.metrics import read_metrics
from mars_megatron.metrics.summary import reward_rise
from mars_megatron.pipeline.scheduler import Limits, Scheduler
from mars_megatron.pipeline.simulate import Costs, Lengths, SimResult, Simulation, simple_prompts


def real_runs(sft: Path, out: Path, extra: list[str]) -> dict[str, list[dict]]:
    runs = {}
    for mode in ("sync", "agentic"):
        args = [
            "train",
            "examples/tiny_cpu.yaml",
            f"model.mcore_dir={sft}",
            f"logging.run_dir={out / mode}",
            f"pipeline.mode={mode}",
            *extra,
        ]
        mars(*args)
        runs[mode] = read_metrics(out / mode / "metrics.jsonl")
    return runs


def summarize(records: list[dict]) -> tuple[float, float, float, float]:
    """(samples/s, trainer idle, training seconds, samples)."""
    wall = sum(r["time/step"] for r in records)
    train = sum(r["time/train"] for r in records)
    samples = sum(r["samples/trained"] for r in records)
    return samples / wall, 1 - train / wall, wall, samples


def measure_decode(model_dir: Path) -> tuple[float, float]:
    """Seconds per decode step of the tiny MoE (transformers engine, 1 thread) at batch 1 and 64."""
    import torch

    from mars_megatron.rollout.engine import GenerationRequest, SamplingParams
    from mars_megatron.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    engine = HFEngine(model_dir, max_batch=64, seed=0)
    out = []
    for batch in (1, 64):
        steps = 32
        reqs = [
            GenerationRequest(
                f"{batch}/{i}",
                (1, 2, 3, 4, 5, 6, 7, 8),
                SamplingParams(max_tokens=steps, temperature=1.0, seed=i, stop_token_ids=()),
            )
            for i in range(batch)
        ]
        engine.generate(reqs[:1])  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            outs = engine.generate(reqs)
            n = max(len(o.token_ids) for o in outs)
            best = min(best, (time.perf_counter() - t0) / max(1, n))
        out.append(best)
    return out[0], out[1]


def paper_sim(
    bound: int,
    segment: int,
    costs: Costs,
    *,
    workers: int,
    block: int,
    updates: int,
    placement: str = "disaggregated",
) -> SimResult:
    """MarsRL's shape: G = 8, 128 problems/update, 5 positions, 64k responses; tokens in ``block`` units."""
    graph = load_graph("marsrl")
    lengths = Lengths(
        {"solver": 14000 / block, "verifier": 8000 / block, "corrector": 14000 / block},  # MarsRL's graph
        sigma=0.6,
        prompt_tokens=max(1, 1024 // block),
        max_input_tokens=32768 // block,
    )
    limits = Limits(
        65536 // block,
        segment // block,
        dict.fromkeys(graph.roles, bound),
        problems_per_step=128,
        batch_groups=128 * 4,
    )
    s = Scheduler(AgentsConfig(group_size=8), limits, simple_prompts(lengths), graph, seed=0)
    s.add_problems([Problem(f"p{i}", "", "1", i + 1) for i in range(128 * (updates + 2))])
    scaled = Costs(
        costs.decode_step_s * block,
        costs.decode_step_per_seq_s * block,
        costs.train_s_per_token * block,
        costs.sync_s,
    )
    sim = Simulation(
        s,
        workers=workers,
        worker_batch=64,
        costs=scaled,
        lengths=lengths,
        accuracy={"solver": 0.7, "verifier": 0.8, "corrector": 0.5},
        placement=placement,
    )  # type: ignore[arg-type]
    return sim.run(updates)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked before anything runs: a mode must be chosen (usage and exit 2 otherwise,
    never a silent exit 0), and a missing input is named by its flag instead of failing minutes later."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--real", action="store_true", help="(a): the real tiny run, sync vs agentic")
    parser.add_argument(
        "--sft",
        type=Path,
        default=None,
        help="warm start for (a) and the model (b) decodes with: a `mars sft` checkpoint such as "
        "runs/demo/sft (default: (a) builds one under --out; --sim alone uses a random tiny MoE)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs/bench_pipeline", help="(a)'s new run folder")
    parser.add_argument("--sim", action="store_true", help="(b): the paper-scale simulation")
    parser.add_argument(
        "--train-s-per-token",
        type=float,
        default=None,
        help="(b)'s trainer cost in seconds per token (default: measured by --real)",
    )
    parser.add_argument("--block", type=int, default=256, help="(b): real tokens per simulated token")
    parser.add_argument("--updates", type=int, default=6, help="(b): simulated updates per run")
    parser.add_argument("overrides", nargs="*", help="extra mars train overrides for (a)")
    args = parser.parse_args(argv)
    if not (args.real or args.sim):
        parser.error(
            "choose a mode: --real (the tiny run, sync vs agentic; minutes), --sim --train-s-per-token S "
            "(the paper-scale simulation; about a minute), or --real --sim (both: the simulation costed "
            "by the run)"
        )
    if args.sim and not args.real and args.train_s_per_token is None:
        parser.error("--sim needs --real (to measure the trainer) or --train-s-per-token")
    if args.overrides and not args.real:
        parser.error(f"mars train overrides {args.overrides} apply to --real only")
    if args.block < 1 or args.updates < 1:
        parser.error("--block and --updates must be >= 1")
    if args.sft is not None:
        from mars_megatron.convert import is_mcore_checkpoint

        if not args.sft.is_dir():
            parser.error(
                f"--sft {args.sft}: no such directory (make one with scripts/demo.sh, or leave --sft out)"
            )
        if not is_mcore_checkpoint(args.sft) or not (args.sft / "hf").is_dir():
            parser.error(f"--sft {args.sft}: not a `mars sft` checkpoint (one with an hf/ folder)")
    if args.real and args.out.exists():
        parser.error(f"--out {args.out} exists; remove it or pass another --out")
    return args


def main() -> None:
    args = parse_args()
    train_s_per_token = args.train_s_per_token
    sft: Path | None = args.sft.resolve() if args.sft is not None else None
    if args.real:
        out = args.out.resolve()
        if sft is None:
            folder, _ = warm_start(str(out))
            sft = folder / "sft"
        runs = real_runs(sft, out, args.overrides)
        print(f"\n(a) tiny run on this machine, same config and warm start ({sft})")
        header = f"{'mode':<9}{'samples/s':>10}{'trainer idle':>14}{'train s':>9}{'samples':>9}"
        print(header + "   reward rise S / V / C")
        base = None
        for mode, records in runs.items():
            rate, idle, wall, samples = summarize(records)
            base = base or rate
            rises = " / ".join(f"{100 * (r.end - r.start):+.0f}" for r in reward_rise(records))
            row = f"{mode:<9}{rate:>10.1f}{idle:>13.0%}{wall:>9.0f}{samples:>9.0f}"
            print(f"{row}   {rises}   ({rate / base:.2f}x)")
        sync = runs["sync"]
        train_s_per_token = train_s_per_token or sum(r["time/train"] for r in sync) / sum(
            r["tokens"] for r in sync
        )
    if args.sim:
        assert train_s_per_token is not None  # parse_args asks for --real or --train-s-per-token
        if sft is not None:
            step1, step64 = measure_decode(sft / "hf")
        else:
            from mars_megatron.models.presets import init_model

            with tempfile.TemporaryDirectory(prefix="mars-bench-pipeline-") as tmp:
                step1, step64 = measure_decode(init_model("tiny-moe", Path(tmp) / "hf", seed=0))
        costs = Costs(step1, (step64 - step1) / 63, train_s_per_token, sync_s=0.0)
        print(
            f"\n(b) paper-scale simulation; measured here: decode step {step1 * 1e3:.2f} ms at batch 1, "
            f"{step64 * 1e3:.2f} ms at 64; training {train_s_per_token * 1e6:.1f} us/token"
        )
        print(
            f"{'rollout workers':<16}{'sync samples/s':>15}{'agentic':>10}{'speedup':>9}"
            f"{'idle sync':>11}{'idle agentic':>14}{'max staleness':>15}"
        )
        for workers in (1, 2, 4, 8, 16, 32):
            _row(str(workers), costs, workers, args)
        # Sensitivity, not a measurement: the same schedule with training cheaper per token relative to
        # decoding (on GPUs long-tail decoding, not the update, usually dominates a synchronous step).
        print("\ntraining cost x (16 rollout workers; decode costs as measured)")
        for scale in (0.3, 0.1, 0.03):
            scaled = Costs(costs.decode_step_s, costs.decode_step_per_seq_s, costs.train_s_per_token * scale)
            _row(f"x{scale}", scaled, 16, args)


def _row(label: str, costs: Costs, workers: int, args: argparse.Namespace) -> None:
    sync = paper_sim(0, 65536, costs, workers=workers, block=args.block, updates=args.updates)
    agentic = paper_sim(1, 16384, costs, workers=workers, block=args.block, updates=args.updates)
    print(
        f"{label:<16}{sync.samples_per_s:>15.3f}{agentic.samples_per_s:>10.3f}"
        f"{agentic.samples_per_s / sync.samples_per_s:>8.2f}x{sync.trainer_idle:>11.0%}"
        f"{agentic.trainer_idle:>14.0%}{max(agentic.staleness):>15}"
    )


if __name__ == "__main__":
    main()
