"""``mars eval``: load problems, build the engine, run the V–C system over every problem × sample,
write ``results.jsonl`` as loops finish and ``summary.json`` at the end (see :mod:`.results`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from mars_megatron.agents.loop import SystemConfig
from mars_megatron.evaluation.sampling import SamplingConfig
from mars_megatron.rollout.chat import MAX_INPUT_TOKENS

ENGINES = ("transformers", "vllm", "openai")
SYSTEM_OPTIONS = {f.name: f.name.replace("_", "-") for f in dataclasses.fields(SystemConfig)}
SAMPLING_OPTIONS = {f.name: f.name.replace("_", "-") for f in dataclasses.fields(SamplingConfig)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mars eval``; unset numbers take the defaults of SamplingConfig / SystemConfig."""
    p.add_argument("--data", required=True, help="JSONL of problems (problem|query|input, answer|ans_box)")
    p.add_argument("--model", required=True, help="HF model directory (weights and tokenizer)")
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--endpoint", default=None, help="server URL for --engine openai")
    p.add_argument("--served-model", default=None, help="model name at the endpoint (default: --model)")
    p.add_argument("--samples", type=int, required=True, help="samples per problem (K of avg@K, pass@k)")
    p.add_argument("--out", required=True, help="output directory (must be new or empty unless --resume)")
    p.add_argument("--resume", action="store_true", help="continue OUT, skipping finished (problem, sample)")
    p.add_argument("--limit", type=int, default=None, help="use the first N usable problems")
    types = {"max_tokens": int, "top_k": int, "seed": int}
    for name, flag in SAMPLING_OPTIONS.items():
        default = getattr(SamplingConfig(), name)
        p.add_argument(f"--{flag}", type=types.get(name, float), default=None, help=f"default {default}")
    for name, flag in SYSTEM_OPTIONS.items():
        default = getattr(SystemConfig(), name)
        p.add_argument(f"--{flag}", type=int, default=None, help=f"V–C loop; default {default}")
    p.add_argument("--max-input-tokens", type=int, default=MAX_INPUT_TOKENS, help="agent input cap")
    p.add_argument(
        "--truncate-long-prompts",
        action="store_true",
        help="cut over-long prompts in the middle instead of recording the call as truncated and empty",
    )
    p.add_argument("--max-concurrent", type=int, default=256, help="inference loops in flight at once")
    p.add_argument("--checker-workers", type=int, default=None, help="answer-checker processes")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _chosen(args: argparse.Namespace, options: dict[str, str], cls: type) -> Any:
    return cls(**{name: getattr(args, name) for name in options if getattr(args, name) is not None})


def _engine(args: argparse.Namespace, max_model_len: int) -> Any:
    if args.engine == "transformers":
        from mars_megatron.rollout.hf_engine import HFEngine

        return HFEngine(args.model, dtype=args.dtype, max_batch=max(1, min(args.max_concurrent, 64)))
    if args.engine == "vllm":
        from mars_megatron.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(args.model, dtype=args.dtype, max_model_len=max_model_len)
    from mars_megatron.rollout.openai_engine import OpenAIEngine

    return OpenAIEngine(
        args.endpoint, args.served_model or args.model, max_concurrency=max(1, min(args.max_concurrent, 64))
    )


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """The ``mars eval`` job; returns the summary it wrote."""
    from mars_megatron.evaluation.data import load_problems
    from mars_megatron.evaluation.metrics import summarize
    from mars_megatron.evaluation.results import OutputDir
    from mars_megatron.evaluation.runner import EvalRunner
    from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
    from mars_megatron.rollout.chat import ChatCodec

    started = time.monotonic()
    if args.engine == "openai" and not args.endpoint:
        raise ValueError("--engine openai needs --endpoint URL (an OpenAI-compatible completions server)")
    if args.samples < 1 or (args.limit is not None and args.limit < 0):
        raise ValueError(f"--samples must be >= 1 and --limit >= 0, got {args.samples} and {args.limit}")
    if not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data}: no such file")
    sampling = _chosen(args, SAMPLING_OPTIONS, SamplingConfig)
    system = _chosen(args, SYSTEM_OPTIONS, SystemConfig)
    config = {
        "data": str(Path(args.data).resolve()),
        "model": str(args.served_model or args.model),
        "engine": args.engine,
        "samples": args.samples,
        "max_input_tokens": args.max_input_tokens,
        "truncate_long_prompts": args.truncate_long_prompts,
        "sampling": dataclasses.asdict(sampling),
        "system": dataclasses.asdict(system),
    }
    dataset = load_problems(args.data, args.limit)
    out = OutputDir(args.out, config, resume=args.resume)
    done = out.finished
    jobs = [(p, s) for p in dataset.problems for s in range(args.samples) if (p.problem_id, s) not in done]
    resumed = args.samples * len(dataset.problems) - len(jobs)
    try:
        if jobs:
            codec = ChatCodec.from_pretrained(
                args.model, max_input_tokens=args.max_input_tokens, truncate=args.truncate_long_prompts
            )
            engine = _engine(args, args.max_input_tokens + sampling.max_tokens)
            checker = AnswerChecker(CheckerConfig(num_workers=args.checker_workers))
            _run_jobs(
                EvalRunner(
                    engine,
                    codec,
                    checker,
                    sampling=sampling,
                    system=system,
                    max_concurrent=args.max_concurrent,
                ),
                jobs,
                out,
                checker,
            )
    finally:
        out.close()
    summary = {
        **summarize(out.records, [p.problem_id for p in dataset.problems], args.samples),
        "skipped_lines": len(dataset.skipped),
        "skipped": dataset.skipped,
        "config": config,
        "run": {  # how this run went; the only part that differs between a resumed and a whole run
            "wall_s": round(time.monotonic() - started, 3),
            "results_resumed": resumed,
            "results_new": len(jobs),
            "dropped_result_lines": out.dropped_lines,
        },
    }
    path = out.write_summary(summary)
    print(
        f"solver_acc={summary['solver_acc']} system_acc={summary['system_acc']} "
        f"({summary['results']} results, {len(dataset.skipped)} skipped lines) -> {path}",
        file=sys.stderr,
    )
    return summary


def _run_jobs(runner: Any, jobs: list, out: Any, checker: Any) -> None:
    """Run ``jobs`` with a progress bar, appending each result to ``out`` as its loop finishes."""
    from tqdm import tqdm

    with checker, tqdm(total=len(jobs), desc="eval", unit="loop", disable=None) as bar:

        def on_result(record: dict[str, Any]) -> None:
            out.append(record)
            bar.update(1)

        runner.on_result = on_result
        try:
            runner.run(jobs)
        except RuntimeError as e:
            kept = len(out.records)
            raise RuntimeError(
                f"{e} ({kept} finished results kept in {out.path}; rerun with --resume to continue)"
            ) from e
