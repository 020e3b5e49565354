"""``mars eval``: load problems, resolve which model answers each role, build the engines, run an agent
graph's inference loop over every problem × sample, write ``results.jsonl`` as loops finish and
``summary.json`` at the end (see :mod:`.results`).

What is evaluated is what training made: an HF model or mars checkpoint folder (``--model``, one model
for every role), or a ``mars train`` checkpoint (``--checkpoint``: its shared policy, each role's own, or
the graph's grouping), with the graph, prompt set and agent budgets of the run that trained it
(``--config``, e.g. the ``config.yaml`` a run writes into its run directory, or ``--graph`` and
``--prompts``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from mars_megatron.agents.graph import AgentGraph, prompt_set_of
from mars_megatron.agents.graph_file import load_graph
from mars_megatron.config import AgentsConfig, ConfigError, EvalConfig, RolloutConfig
from mars_megatron.evaluation import sampling
from mars_megatron.rollout.chat import MAX_INPUT_TOKENS

ENGINES = ("transformers", "vllm", "openai")
OPTIONS = {name: name.replace("_", "-") for name in (*sampling.SAMPLING_FIELDS, *sampling.LOOP_FIELDS)}
"""The ``evaluation`` fields ``mars eval`` takes as flags (``--top-p`` sets ``top_p``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mars eval``; unset sampling and loop numbers take the defaults of the config's
    ``evaluation`` section (the response budget: the training config's given with ``--config``)."""
    p.add_argument(
        "--data",
        required=True,
        help="problems: JSONL, Parquet, Arrow, a datasets save_to_disk folder or a folder of Parquet files "
        "(columns: problem|query|input|question, answer|ans_box|reference, qid; or mapped with --field)",
    )
    p.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="NAME=COLUMN",
        help="map a column: problem=, answer=, id= (a name or dotted path: answer=reward_model.ground_truth)",
    )
    p.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="COND",
        help="keep rows where COND holds ('level >= 3')",
    )
    p.add_argument("--split", default=None, help="split of a datasets folder (default: its only one)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--model", default=None, help="one model for every role: an HF directory or a mars checkpoint folder"
    )
    what.add_argument(
        "--checkpoint",
        default=None,
        help="a `mars train` checkpoint (step_N folder, or its checkpoint.save_dir for the newest): each "
        "role is answered by its policy (shared, its own, or its group's in the graph)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="ROLE=DIR",
        help="answer ROLE (a role of the graph) with another model; repeatable",
    )
    p.add_argument(
        "--graph",
        default=None,
        metavar="NAME|PATH",
        help="the agent graph whose inference loop runs: a shipped graph or a graph.yaml (default: "
        f"--config's agents.graph, else {AgentsConfig().graph})",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the training config of the model (e.g. RUN_DIR/config.yaml): its graph and prompt set "
        "(agents.graph, agents.prompts), response and input budgets (rollout.max_response_tokens, "
        "rollout.max_input_tokens) and dtype become the defaults",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="a prompt set of the graph (default: --config's, else the graph's first)",
    )
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--endpoint", default=None, help="server URL for --engine openai")
    p.add_argument(
        "--served-model",
        action="append",
        default=[],
        metavar="[ROLE=]NAME",
        help="--engine openai: the model name at the endpoint, for every role or per role (default: the "
        "policy's name, or --model)",
    )
    p.add_argument("--samples", type=int, required=True, help="samples per problem (K of avg@K, pass@k)")
    p.add_argument("--out", required=True, help="output directory (must be new or empty unless --resume)")
    p.add_argument("--resume", action="store_true", help="continue OUT, skipping finished (problem, sample)")
    p.add_argument("--limit", type=int, default=None, help="use the first N usable problems")
    defaults = EvalConfig(max_tokens=RolloutConfig().max_response_tokens)
    for name, flag in OPTIONS.items():
        default = getattr(defaults, name)
        if name in sampling.LOOP_FIELDS:
            p.add_argument(f"--{flag}", type=int, default=None, help="inference loop; default: the graph's")
        else:
            p.add_argument(f"--{flag}", type=type(default), default=None, help=f"default {default}")
    p.add_argument(
        "--max-input-tokens", type=int, default=None, help=f"agent input cap (default {MAX_INPUT_TOKENS})"
    )
    p.add_argument(
        "--truncate-long-prompts",
        action="store_true",
        help="cut over-long prompts in the middle instead of recording the call as truncated and empty",
    )
    p.add_argument("--max-concurrent", type=int, default=256, help="inference loops in flight at once")
    p.add_argument("--checker-workers", type=int, default=None, help="answer-checker processes")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default float32"
    )


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Everything that shapes the results, resolved from flags over ``--config`` over defaults (so a
    resumed run can be checked against the first, and the summary says what produced it)."""

    graph: AgentGraph
    prompts: str
    """A prompt set of ``graph``."""
    evaluation: EvalConfig
    """Sampling and overrides of the loop's budgets (``max_tokens`` resolved)."""
    max_input_tokens: int
    dtype: str


def _key_values(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def settings(args: argparse.Namespace) -> EvalSettings:
    """Flags first, then the training config's (``--config``), then the evaluation defaults."""
    trained: dict[str, Any] = {}
    if args.config is not None:
        from mars_megatron.config import load_config

        if not Path(args.config).is_file():
            raise FileNotFoundError(f"--config {args.config}: no such file")
        cfg = load_config(args.config)
        trained = {
            "graph": cfg.agents.graph,
            "prompts": cfg.agents.prompts,
            "rollout": cfg.rollout,
            "max_input_tokens": cfg.rollout.max_input_tokens,
            "dtype": cfg.model.dtype,
        }
    try:
        graph = load_graph(args.graph or trained.get("graph") or AgentsConfig().graph)
    except ValueError as e:  # a GraphError names the file and field; say which flag chose the graph
        raise ValueError(f"{'--graph' if args.graph else '--config'}: {e}") from None
    # the trained prompt set belongs to the trained graph; another --graph starts from its own first set
    prompts = args.prompts or (trained.get("prompts") if args.graph is None else None)
    try:
        prompts = prompt_set_of(graph, prompts)
    except ValueError as e:
        raise ValueError(f"--prompts: {e}") from None
    return EvalSettings(
        graph=graph,
        prompts=prompts,
        evaluation=evaluation_section(args, trained.get("rollout")),
        max_input_tokens=args.max_input_tokens or trained.get("max_input_tokens", MAX_INPUT_TOKENS),
        dtype=args.dtype or trained.get("dtype", "float32"),
    )


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a data file, or of a dataset folder's files (names and contents, in name order)."""
    import hashlib

    path = Path(path)
    if not path.is_dir():
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def data_fields(args: argparse.Namespace) -> Any:
    """The column mapping of ``--field``/``--filter``; ValueError naming the flag."""
    from mars_megatron.problems import FieldMap

    named: dict[str, str] = {}
    for item in args.field:
        name, sep, column = item.partition("=")
        if not sep or name not in ("problem", "answer", "id") or not column:
            raise ValueError(f"--field {item!r}: expected problem=COLUMN, answer=COLUMN or id=COLUMN")
        if name in named:
            raise ValueError(f"--field {name}= is given twice")
        named[name] = column
    try:
        return FieldMap(named.get("problem"), named.get("answer"), named.get("id"), filter=tuple(args.filter))
    except ValueError as e:
        raise ValueError(f"--field/--filter: {e}") from None


def evaluation_section(args: argparse.Namespace, rollout: RolloutConfig | None) -> EvalConfig:
    """The ``evaluation`` section with the flags given as overrides, checked by the config (so a flag has
    the field's bounds); an error names the flag typed. ``max_tokens`` unset is ``rollout``'s response
    budget (the training config's, else the default)."""
    flags = {name: getattr(args, name) for name in OPTIONS if getattr(args, name) is not None}
    try:
        evaluation = EvalConfig(**flags)
    except ConfigError as e:
        raise ValueError(f"--{OPTIONS.get(e.path, e.path)}: {e.message}") from None
    return sampling.with_response_budget(evaluation, rollout)


def _sources(args: argparse.Namespace, graph: AgentGraph) -> dict[str, Any]:
    from mars_megatron.evaluation.policies import checkpoint_policies, model_policies, override_roles

    if args.checkpoint is not None:
        sources = checkpoint_policies(args.checkpoint, graph)[1]
    else:
        sources = model_policies(args.model, graph)
    return override_roles(sources, _key_values(args.policy, "--policy"))


def _served_names(args: argparse.Namespace, sources: dict[str, Any]) -> dict[str, str]:
    """``--served-model``: one NAME for every role and/or ``ROLE=NAME`` per role; else the policy's name
    (``--model``'s path when one model answers every role)."""
    plain = [n for n in args.served_model if "=" not in n]
    per = _key_values([n for n in args.served_model if "=" in n], "--served-model")
    unknown = sorted(set(per) - set(sources))
    if len(plain) > 1 or unknown:
        raise ValueError(f"--served-model: give one NAME and/or ROLE=NAME per role, got {args.served_model}")
    default = {r: args.model if args.model and s.name == "model" else s.name for r, s in sources.items()}
    return {r: per.get(r, plain[0] if plain else default[r]) for r in sources}


def _engines(
    args: argparse.Namespace, hf: dict[str, Path], served: dict[str, str], max_model_len: int, dtype: str
) -> dict[str, Any]:
    """One engine per distinct model (roles sharing a policy share its engine)."""
    batch = max(1, min(args.max_concurrent, 64))
    key = {r: (str(hf[r]), served[r]) for r in hf}
    distinct = list(dict.fromkeys(key.values()))
    built: dict[tuple[str, str], Any] = {}
    for model_dir, name in distinct:
        if args.engine == "transformers":
            from mars_megatron.rollout.hf_engine import HFEngine

            built[(model_dir, name)] = HFEngine(model_dir, dtype=dtype, max_batch=batch)
        elif args.engine == "vllm":
            from mars_megatron.rollout.vllm_engine import VLLMEngine

            built[(model_dir, name)] = VLLMEngine(  # the models share the GPU(s)
                model_dir,
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=0.9 / len(distinct),
            )
        else:
            from mars_megatron.rollout.openai_engine import OpenAIEngine

            built[(model_dir, name)] = OpenAIEngine(args.endpoint, name, max_concurrency=batch)
    return {r: built[key[r]] for r in hf}


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    """The ``mars eval`` job; returns the summary it wrote."""
    from mars_megatron.evaluation.data import load_problems
    from mars_megatron.evaluation.metrics import summarize
    from mars_megatron.evaluation.policies import convert_with_mars, describe, hf_dirs
    from mars_megatron.evaluation.results import OutputDir
    from mars_megatron.evaluation.runner import EvalRunner
    from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
    from mars_megatron.rewards.functions import check_graph_functions
    from mars_megatron.rollout.chat import ChatCodec

    started = time.monotonic()
    if args.engine == "openai" and not args.endpoint:
        raise ValueError("--engine openai needs --endpoint URL (an OpenAI-compatible completions server)")
    for flag, value, low, high in (("--samples", args.samples, 1, 2**16), ("--limit", args.limit, 0, None),
                                   ("--max-concurrent", args.max_concurrent, 1, 2**16),
                                   ("--max-input-tokens", args.max_input_tokens, 2, 2**24),
                                   ("--checker-workers", args.checker_workers, 1, 256)):  # fmt: skip
        if value is not None and not (low <= value and (high is None or value <= high)):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ValueError(f"{flag} must be {bounds}, got {value}")
    if args.endpoint is not None:
        from mars_megatron.rollout.openai_engine import check_endpoint

        check_endpoint(args.endpoint, "--endpoint")
    if not Path(args.data).exists():
        raise FileNotFoundError(f"--data {args.data}: no such file or folder")
    fields = data_fields(args)
    chosen = settings(args)  # every flag checked before OUT is touched
    graph = chosen.graph
    check_graph_functions(graph)
    if graph.roles[graph.start_role].reward == "function":  # judged by it: any JSON answer will do
        fields = dataclasses.replace(fields, check_answers=False)
    sources = _sources(args, graph)
    served = _served_names(args, sources) if args.engine == "openai" else {}
    config = {
        "data": str(Path(args.data).resolve()),
        "data_sha256": file_sha256(args.data),  # --resume against changed data is refused
        "model": describe(sources),
        "engine": args.engine,
        "served_model": served,
        "samples": args.samples,
        "graph": graph.name,
        "prompts": chosen.prompts,
        "max_input_tokens": chosen.max_input_tokens,
        "truncate_long_prompts": args.truncate_long_prompts,
        **sampling.record(chosen.evaluation, graph),
        # only when given, so that the outputs of runs before the mapping resume as they were
        **(
            {"fields": fields.named(), "filter": list(fields.filter)}
            if fields.named() or fields.filter
            else {}
        ),
        **({"split": args.split} if args.split else {}),
    }
    dataset = load_problems(args.data, args.limit, fields, split=args.split, key="--data")
    print(dataset.summary(f"--data {args.data}"), file=sys.stderr, flush=True)
    if not dataset.problems and args.limit != 0:
        raise ValueError(
            f"--data {args.data}: no usable problems ({dataset.unusable} unusable rows, named in the "
            "warnings above)"
        )
    out = OutputDir(args.out, config, resume=args.resume)
    done = out.finished
    jobs = [(p, s) for p in dataset.problems for s in range(args.samples) if (p.problem_id, s) not in done]
    resumed = args.samples * len(dataset.problems) - len(jobs)
    try:
        if jobs:
            hf = hf_dirs(sources, out.path, convert_with_mars)
            loaded = {  # one tokenizer per distinct model, like the engines
                path: ChatCodec.from_pretrained(
                    path, max_input_tokens=chosen.max_input_tokens, truncate=args.truncate_long_prompts
                )
                for path in set(hf.values())
            }
            codecs = {role: loaded[path] for role, path in hf.items()}
            max_len = chosen.max_input_tokens + chosen.evaluation.max_tokens
            engines = _engines(args, hf, served or dict.fromkeys(hf, ""), max_len, chosen.dtype)
            checker = AnswerChecker(CheckerConfig(num_workers=args.checker_workers))
            _run_jobs(
                EvalRunner(
                    engines,
                    codecs,
                    checker,
                    graph=graph,
                    config=chosen.evaluation,
                    prompts=chosen.prompts,
                    max_concurrent=args.max_concurrent,
                ),
                jobs,
                out,
                checker,
            )
    finally:
        out.close()
    summary = {
        **summarize(out.records, [p.problem_id for p in dataset.problems], args.samples, graph),
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
    first = f"{graph.start_role}_acc"
    print(
        f"{first}={summary[first]} system_acc={summary['system_acc']} "
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
        finally:
            runner.close()
