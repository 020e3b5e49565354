"""Held-out evaluation during training (``evaluation.*``): the run's agent graph (its inference loop) and
its start role alone on problems the run never trains on, on the run's own rollout engines right after a
weight push.

Why on the training engines: they already hold the newest weights (no conversion, no second copy of the
model), and between updates they are idle in the synchronous loop. In the agentic pipeline the calls queue
behind the rollouts in flight on the same actors, which lengthens that step's wall time (``eval/time``
says by how much) but changes no weights: pushes happen only inside an update.

Each evaluation also writes its ``results.jsonl`` and ``summary.json`` (the ``mars eval`` format) under
``run_dir/eval/step_NNNNNN/``, so a number on the curve can be traced to the outputs that made it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mars_megatron.agents.graph import AgentGraph, prompt_set_of
from mars_megatron.agents.graph_file import graph_for
from mars_megatron.config import EvalConfig, MarsConfig
from mars_megatron.evaluation import sampling
from mars_megatron.evaluation.data import Problem
from mars_megatron.evaluation.metrics import deciding_roles, revising_roles
from mars_megatron.evaluation.runner import generate_shares
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, RolloutEngine

EVAL_DIR = "eval"


class EnginePool:
    """Several engines of one policy behind one ``generate``: the requests are split into contiguous
    shares, one per engine, decoded side by side, and returned in request order."""

    def __init__(self, engines: Sequence[RolloutEngine]) -> None:
        if not engines:
            raise ValueError("EnginePool: no engines")
        self.engines = list(engines)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        n = min(len(self.engines), len(requests))
        if n <= 1:
            return self.engines[0].generate(requests)
        bounds = [len(requests) * i // n for i in range(n + 1)]
        shares = [(self.engines[i], range(bounds[i], bounds[i + 1])) for i in range(n)]
        with ThreadPoolExecutor(max_workers=n) as pool:
            return generate_shares(pool, shares, requests)


def settings(cfg: MarsConfig) -> EvalConfig:
    """The ``evaluation`` section a held-out evaluation runs with: a null ``max_tokens`` makes the
    responses as long as training's (``rollout.max_response_tokens``)."""
    return sampling.with_response_budget(cfg.evaluation, cfg.rollout)


def eval_metrics(summary: Mapping[str, Any], seconds: float, graph: AgentGraph) -> dict[str, float]:
    """The scalars a summary puts on the training curve (``eval/*``, named after the graph's roles:
    MarsRL's ``eval/solver_acc``, ``eval/verifier_acc_on_right``, ``eval/corrector_fix_rate``, …);
    unmeasured ones are left out."""
    k = str(summary["samples"])
    first = graph.start_role
    roles = summary["roles"]
    values = {
        f"eval/{first}_acc": summary[f"{first}_acc"],
        "eval/system_acc": summary["system_acc"],
        f"eval/{first}_pass@{k}": summary["pass@k"][first].get(k),
        f"eval/system_pass@{k}": summary["pass@k"]["system"].get(k),
        "eval/accepted_rate": summary["accepted_rate"],
    }
    deciding, revising = set(deciding_roles(graph)), set(revising_roles(graph))
    for role in graph.roles:  # graph order
        if role in deciding:
            values[f"eval/{role}_acc_on_right"] = roles[role]["acc_on_right"]
            values[f"eval/{role}_acc_on_wrong"] = roles[role]["acc_on_wrong"]
        elif role in revising:
            values[f"eval/{role}_fix_rate"] = roles[role]["fix_rate"]
    values["eval/time"] = seconds
    return {key: float(v) for key, v in values.items() if v is not None}


class HeldOutEval:
    """Evaluates the current policies on ``problems``; :meth:`run` takes the engines of each role."""

    def __init__(self, cfg: MarsConfig, problems: Sequence[Problem], tokenizer_dir: str) -> None:
        from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
        from mars_megatron.rollout.chat import ChatCodec

        self.cfg, self.problems = cfg, list(problems)
        self.graph = graph_for(cfg)
        self.prompts = prompt_set_of(self.graph, cfg.agents.prompts)
        self.settings = settings(cfg)
        self.codec = ChatCodec.from_pretrained(tokenizer_dir, max_input_tokens=cfg.rollout.max_input_tokens)
        self.checker = AnswerChecker(CheckerConfig(num_workers=1))
        self.root = Path(cfg.logging.run_dir) / EVAL_DIR

    def due(self, step: int) -> bool:
        """Before the first update, every ``evaluation.interval`` updates, and after the last."""
        interval = self.cfg.evaluation.interval
        return bool(interval) and (step % interval == 0 or step == self.cfg.train.steps)

    def summary_path(self, step: int) -> Path:
        """The ``summary.json`` the evaluation after ``step`` updates writes."""
        from mars_megatron.checkpoint.store import checkpoint_name
        from mars_megatron.evaluation.results import SUMMARY

        return self.root / checkpoint_name(step) / SUMMARY

    def run(self, engines: Mapping[str, RolloutEngine], step: int) -> dict[str, float]:
        """Evaluate with ``engines`` (graph role name -> the engine answering it) after ``step`` updates."""
        from mars_megatron.checkpoint.store import checkpoint_name
        from mars_megatron.evaluation.metrics import summarize
        from mars_megatron.evaluation.results import OutputDir
        from mars_megatron.evaluation.runner import EvalRunner

        started = time.perf_counter()
        folder = self.root / checkpoint_name(step)
        if folder.exists():  # left by a run killed after this step; the same seeds redo it exactly
            shutil.rmtree(folder)
        config = {
            "step": step,
            "problems": len(self.problems),
            "samples": self.cfg.evaluation.samples,
            "graph": self.graph.name,
            "prompts": self.cfg.agents.prompts,
            **sampling.record(self.settings, self.graph),
        }
        out = OutputDir(folder, config, resume=False)
        runner = EvalRunner(
            dict(engines),
            self.codec,
            self.checker,
            graph=self.graph,
            config=self.settings,
            prompts=self.prompts,
            on_result=out.append,
        )
        try:
            runner.run([(p, s) for p in self.problems for s in range(self.cfg.evaluation.samples)])
        finally:
            out.close()
            runner.close()
        summary = summarize(
            out.records, [p.problem_id for p in self.problems], self.cfg.evaluation.samples, self.graph
        )
        out.write_summary({**summary, "config": config})
        return eval_metrics(summary, time.perf_counter() - started, self.graph)

    def close(self) -> None:
        self.checker.close()
