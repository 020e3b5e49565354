"""The ``mars`` command: argument parsing only; the work lives in :mod:`mars_megatron.jobs`."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from mars_megatron import runtime_env
from mars_megatron.config import ConfigError, ParallelConfig, describe_config, load_config

_LAYOUT_DEFAULTS = {"tp": 1, "pp": 1, "ep": 1, "etp": None, "nproc": None, "impl": "auto"}


def _positive_int(text: str) -> int:
    """An argparse type for counts such as ``--micro-batch``: 0 or less is refused at the flag (exit 2)
    rather than reaching a rank as a ``ZeroDivisionError``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _add_layout(p: argparse.ArgumentParser) -> None:
    d = _LAYOUT_DEFAULTS
    p.add_argument("--tp", type=int, default=d["tp"], help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=d["pp"], help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=d["ep"], help="expert-parallel size")
    p.add_argument("--etp", type=int, default=d["etp"], help="expert tensor-parallel size (default: tp)")
    p.add_argument(
        "--nproc", type=int, default=d["nproc"], help="local processes (default: the layout's minimum)"
    )
    p.add_argument("--impl", default=d["impl"], choices=["auto", "local", "transformer_engine"])


VIA_MODEL = (
    "convert through a Megatron model on ranks of the layout flags, as before the direct path (which "
    "needs no model and no process group, and is the default where it applies: no dtype cast; for "
    "mcore-to-hf, every tensor present with its shape)"
)


def _unused_layout(args: argparse.Namespace) -> str:
    """A note for the direct path when layout flags were given: they apply only to the model path."""
    given = [f"--{k}" for k, default in _LAYOUT_DEFAULTS.items() if getattr(args, k) != default]
    verb = "applies" if len(given) == 1 else "apply"
    return f"; {' '.join(given)} {verb} only with --via-model" if given else ""


def _layout(args: argparse.Namespace) -> ParallelConfig:
    """The layout flags as a ParallelConfig; errors name the flag (``--tp``), and ``--nproc`` is checked."""
    try:
        layout = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    except ConfigError as e:
        raise ConfigError(
            e.message, f"--{e.path}" if e.path in ("tp", "pp", "ep", "etp") else e.path
        ) from None
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    return layout


def _check_model(model_dir: str, layout: ParallelConfig, hf_only: bool = False) -> None:
    """What the ranks would check first, checked here so bad input is named before any rank starts: the
    model's files (an HF folder's config.json and safetensors, a mars checkpoint's metadata) and that the
    layout divides it."""
    from mars_megatron import jobs
    from mars_megatron.models.layout import LayoutError, check_parallel

    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"{model_dir}: no such model directory")
    if hf_only:
        from mars_megatron.convert import is_mcore_checkpoint

        if is_mcore_checkpoint(model_dir):
            raise ValueError(
                f"{model_dir}: a mars Megatron checkpoint; hf-to-mcore converts an HF model folder"
            )
    arch = jobs.check_model_files(model_dir)
    try:
        check_parallel(arch, layout, 128)
    except LayoutError as e:
        raise ValueError(f"{model_dir}: {e}") from None


def _check_finite(model_dir: str) -> None:
    """Every weight of the HF folder is finite (conversion/finite.py), before anything is written."""
    from mars_megatron.conversion.finite import check_finite
    from mars_megatron.conversion.hf_io import HFReader

    reader = HFReader(model_dir)
    try:
        check_finite(reader)
    finally:
        reader.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mars", description="MarsRL multi-agent reasoning trainer")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-model", help="write a random tiny Qwen3 HF checkpoint with its tokenizer")
    p.add_argument("--preset", required=True, choices=["tiny-dense", "tiny-moe"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    p = sub.add_parser("convert", help="HF <-> Megatron distributed checkpoints")
    conv = p.add_subparsers(dest="direction", required=True)
    c = conv.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    c.add_argument("--via-model", action="store_true", help=VIA_MODEL)
    c.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="convert even when a weight holds NaN or inf (refused by default, naming the file and tensor)",
    )
    _add_layout(c)
    c = conv.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--max-shard-gb", type=float, default=5.0)
    c.add_argument("--via-model", action="store_true", help=VIA_MODEL)
    _add_layout(c)

    p = sub.add_parser("score", help="per-token log-probs of token sequences under the Megatron model")
    p.add_argument("--model-dir", required=True, help="HF directory or mars Megatron checkpoint")
    p.add_argument("--input", required=True, help='JSONL, one {"tokens": [ids...]} per line')
    p.add_argument("--output", required=True, help='JSONL, one {"logprobs": [...]} per line')
    p.add_argument(
        "--micro-batch",
        type=_positive_int,
        default=4,
        help="sequences per forward pass (default 4; at least 1)",
    )
    p.add_argument(
        "--routing",
        default=None,
        help="MoE: score under these experts instead of the router's choice: an .npz of one "
        "[len(tokens) - 1, moe_layers, top_k] array per input line (numpy.savez(path, *arrays))",
    )
    _add_layout(p)

    p = sub.add_parser("sft", help="supervised warm start on the tiny task's role demonstrations")
    p.add_argument("config", help="SFT YAML (see examples/tiny_sft.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--model-dir", required=True, help="HF directory or mars checkpoint to start from")
    p.add_argument("--out", required=True, help="output: a mars Megatron checkpoint whose hf/ is an HF model")
    _add_layout(p)

    p = sub.add_parser(
        "train",
        help="train every role of an agent graph jointly with RL (default graph: MarsRL's V–C system)",
    )
    p.add_argument("config", help="YAML config (see examples/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--nproc", type=int, default=None, help="trainer ranks (default: the layout's minimum)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue from the latest checkpoint in checkpoint.save_dir, or from the one given",
    )

    p = sub.add_parser("plot", help="draw the per-role rewards of one or more runs into one figure")
    p.add_argument("run_dirs", nargs="+", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--labels", nargs="+", default=None, help="one label per run (default: directory names)")
    p.add_argument("--out", required=True, help="PNG to write")

    p = sub.add_parser(
        "config",
        help="check and print the resolved config (its agent graph included), or describe every field",
    )
    p.add_argument("config", nargs="?")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--describe", action="store_true", help="every field with type, bounds, default and help")
    p.add_argument(
        "--format", choices=["text", "markdown"], default="text", help="--describe as text or as markdown"
    )

    from mars_megatron.evaluation.command import add_arguments as add_eval_arguments

    p = sub.add_parser("eval", help="evaluate the V–C reasoning system on a set of problems")
    add_eval_arguments(p)

    from mars_megatron.launch.plan_command import add_arguments as add_plan_arguments

    p = sub.add_parser("plan", help="rank parallel layouts of a model on N GPUs by memory per GPU and cost")
    add_plan_arguments(p)

    from mars_megatron.launch.nemo import HELP as LAUNCH_HELP
    from mars_megatron.launch.nemo import add_arguments as add_launch_arguments

    p = sub.add_parser("launch", help=LAUNCH_HELP)
    add_launch_arguments(p)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Overrides may also follow the options (``mars sft CFG --out D steps=10``): argparse's positional
    list ends at the first option, so later ``key=value`` words are added to it here."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [w for w in extra if w.startswith("-") or "=" not in w or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _init_model(args: argparse.Namespace) -> None:
    from mars_megatron.config import check_output_place
    from mars_megatron.models.presets import init_model

    check_output_place(args.out, "--out")
    out = init_model(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset} to {out}")


def _convert(args: argparse.Namespace) -> None:
    from mars_megatron import jobs
    from mars_megatron.conversion import direct
    from mars_megatron.convert import check_output_dir, preflight

    check_output_dir(args.dst)
    layout = _layout(args)
    if args.direction == "hf-to-mcore":
        _check_model(args.src, layout, hf_only=True)
        if not args.allow_nonfinite:
            _check_finite(args.src)
        if not args.via_model and direct.can_convert_directly(args.src, args.dtype):
            direct.hf_to_mcore_direct(args.src, args.dst)
            print(f"wrote {args.dst} (direct: loads into any layout{_unused_layout(args)})")
            return
        jobs.run(
            jobs.hf_to_mcore_job, layout, args.src, args.dst, layout, args.dtype, args.impl, nproc=args.nproc
        )
    else:
        if not (math.isfinite(args.max_shard_gb) and 0 < args.max_shard_gb <= 2**20):
            raise ValueError(f"--max-shard-gb must be in (0, 1048576], got {args.max_shard_gb}")
        if not Path(args.src).is_dir():
            raise FileNotFoundError(f"{args.src}: no such checkpoint directory")
        preflight(args.src)  # a cut, altered or crafted checkpoint is refused before ranks start
        max_bytes = int(args.max_shard_gb * 2**30)
        problem = "--via-model" if args.via_model else direct.export_problem(args.src)
        if problem is None:
            direct.mcore_to_hf_direct(args.src, args.dst, max_shard_bytes=max_bytes)
            print(f"wrote {args.dst} (direct{_unused_layout(args)})")
            return
        print(f"exporting through a model ({problem})")
        _check_model(args.src, layout)
        jobs.run(
            jobs.mcore_to_hf_job, layout, args.src, args.dst, layout, max_bytes, args.impl, nproc=args.nproc
        )
    print(f"wrote {args.dst}")


def _score(args: argparse.Namespace) -> None:
    from mars_megatron import jobs

    arch = jobs.model_arch(args.model_dir)
    seqs = jobs.read_token_lines(args.input, arch.vocab_size, arch.max_position_embeddings)
    routing = jobs.read_routing(args.routing, seqs, arch) if args.routing else None
    if not Path(args.output).parent.exists():
        raise FileNotFoundError(f"{Path(args.output).parent}: output directory does not exist")
    layout = _layout(args)
    jobs.run(
        jobs.score_job,
        layout,
        args.model_dir,
        seqs,
        args.output,
        layout,
        args.micro_batch,
        args.impl,
        routing,
        nproc=args.nproc,
    )
    routed = f" under the routing of {args.routing}" if args.routing else ""
    print(f"scored {len(seqs)} sequences{routed} -> {args.output}")


def _sft(args: argparse.Namespace) -> None:
    from mars_megatron import jobs
    from mars_megatron.convert import check_output_dir
    from mars_megatron.tasks.sft import SFTConfig, sft_job

    sft = load_config(args.config, [*args.overrides, f"out_dir={args.out}"], root=SFTConfig)
    check_output_dir(args.out)
    if not Path(args.model_dir).is_dir():
        raise FileNotFoundError(f"{args.model_dir}: no such model directory")
    layout = _layout(args)
    jobs.run(sft_job, layout, args.model_dir, layout, sft, None, args.impl, nproc=args.nproc)
    print(f"wrote {args.out}")


def _train(args: argparse.Namespace) -> None:
    from mars_megatron.pipeline.trainer import train

    train(load_config(args.config, args.overrides), nproc=args.nproc, resume=args.resume)


def _plot(args: argparse.Namespace) -> None:
    from mars_megatron.metrics import plot_runs

    labels = args.labels or [Path(d).name for d in args.run_dirs]
    print(f"wrote {plot_runs(args.run_dirs, labels, args.out)}")


def _eval(args: argparse.Namespace) -> None:
    from mars_megatron.evaluation.command import run_eval

    run_eval(args)


def _launch(args: argparse.Namespace) -> int:
    from mars_megatron.launch.nemo import run as launch

    return launch(args)


def _plan(args: argparse.Namespace) -> int:
    from mars_megatron.launch.plan_command import run as run_plan

    return run_plan(args)


def _config(args: argparse.Namespace) -> None:
    if args.describe and args.format == "markdown":
        from mars_megatron.config_reference import config_markdown

        print(config_markdown(), end="")
        return
    if args.describe:
        print(describe_config())
        return
    import yaml

    from mars_megatron.agents.graph_file import graph_for
    from mars_megatron.config import config_to_dict
    from mars_megatron.rewards.functions import check_graph_functions

    cfg = load_config(args.config, args.overrides)
    graph = graph_for(cfg)  # the agent graph is part of a valid config: its errors name the field too
    check_graph_functions(graph)  # reward functions import (in a process of their own)
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "init-model": _init_model,
    "convert": _convert,
    "score": _score,
    "sft": _sft,
    "train": _train,
    "plot": _plot,
    "eval": _eval,
    "launch": _launch,
    "plan": _plan,
    "config": _config,
}
"""What each subcommand runs; ``None`` from one means success (exit status 0)."""


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand and turn its errors into one line on stderr and an exit status: 2 for bad input
    (config, values, files), 1 for a failed run (a rank's traceback follows its last line).

    Run as a program (``argv`` None: the ``mars`` script, ``python -m mars_megatron.cli``), it first puts
    the numerics environment into this process, before torch is imported, for every process the command
    starts (:mod:`mars_megatron.runtime_env`); a caller passing ``argv`` keeps its own environment."""
    if argv is None:
        try:
            runtime_env.apply()
        except ValueError as e:
            print(f"mars: error: {e}", file=sys.stderr)
            return 2
    args = _parse(argv)
    try:
        status = COMMANDS[args.command](args)
    except (ConfigError, ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"mars {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        # A failed rank: its traceback ends with the real error; show that line first.
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        said = f"{lines[-1]}\n\n{e}" if len(lines) > 1 else str(e).strip()
        print(f"mars {args.command}: error: {said}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        print(f"mars {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0 if status is None else status


if __name__ == "__main__":
    sys.exit(main())
