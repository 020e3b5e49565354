"""The supervised warm start of the tiny run (``mars sft``) and the per-role rewards it leaves.

:func:`sft_job` runs on every rank of a Megatron layout (like ``jobs.train_job``): it loads a model,
builds demonstrations of all three roles with calibrated careless modes (:mod:`mars_megatron.tasks.demos`),
trains on their responses only (prompt tokens carry no loss) with packed sequences in two phases (skills
first, then the careless share), and writes the result as a mars
Megatron checkpoint whose ``hf/`` folder is also a complete HF model, so the same directory starts
``mars train`` (``model.mcore_dir``) and the rollout engine (``jobs.tokenizer_dir`` of it).

:func:`role_accuracy` measures what reinforcement learning starts from: the mean reward of each role
in one step of MarsRL's own rollout.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mars_megatron.agents.graph import Strategy, prompt_set_of
from mars_megatron.agents.graph_file import load_graph
from mars_megatron.config import (
    MAX_TOKENS,
    SEED_MAX,
    AgentsConfig,
    ConfigError,
    ParallelConfig,
    Section,
    _field,
)
from mars_megatron.evaluation.data import Problem
from mars_megatron.rewards import AnswerChecker, CheckerConfig
from mars_megatron.tasks.arith import arith_problems, load_arith_file, operand_pairs
from mars_megatron.tasks.demos import DemoConfig, build_demos, encode_demo


@dataclass
class SFTConfig(Section):
    """The supervised warm start: problems, demos, steps and the optimizer (a config section)."""

    out_dir: str | None = _field(
        None, "Output: a mars Megatron checkpoint; its hf/ folder is a complete HF model. Must not exist."
    )
    steps: int = _field(350, "Optimizer steps, both phases.", min=1)
    skill_steps: int = _field(
        300,
        "Steps of the first phase, on mostly careful demos (share skill_careful for every role): the skills "
        "are learned from clean lessons. The remaining steps use the demos' own shares at mix_lr, which sets "
        "how often each role is careless. Measured: after 150 steps a careful sum sampled at temperature 1 "
        "was right only 56-67% of the time, so the wrong solutions reaching the Corrector were those the "
        "model could not add and its reward barely rose under RL (+10); after 300 steps, 92-97%.",
        min=0,
    )
    skill_careful: float = _field(
        0.8,
        "Careful share of every role in the first phase. Below 1 so that the careless modes are not new in "
        "the second phase (measured: from all-careful demos, the switch to the mix dropped the careful "
        "Solver's accuracy from 77% to 45-54%; from 80% careful it stayed at 72%).",
        min=0,
        max=1,
    )
    task: Literal["arith", "subset_sum"] = _field(
        "arith",
        "The tiny task the demos teach: arith (sums a+b, tasks/arith.py and tasks/demos.py) or subset_sum "
        "(pick numbers of a list that add up to a target, tasks/subset_sum.py and tasks/subset_demos.py). "
        "problems, max_operand, max_sum and problem_seed are arith's.",
    )
    demos_per_step: int = _field(64, "Demonstrations per optimizer step (all roles mixed).", min=1)
    pack_length: int = _field(
        512, "Tokens per packed training sequence (one pack per micro-batch).", min=2, max=MAX_TOKENS
    )
    lr: float = _field(3e-3, "Peak learning rate of the first phase (from random init).", gt=0, max=1)
    min_lr_ratio: float = _field(
        0.1, "The first phase decays linearly to lr * min_lr_ratio after its warm-up.", min=0, max=1
    )
    warmup_steps: int = _field(10, "Linear warm-up steps at the start of the first phase.", min=0)
    mix_lr: float = _field(
        3e-4,
        "Constant learning rate of the second phase: low, so that the new mix moves the shares of the "
        "modes rather than the skills.",
        gt=0,
        max=1,
    )
    weight_decay: float = _field(0.0, "Decoupled weight decay.", min=0, max=1)
    clip_grad: float = _field(1.0, "Global gradient-norm clip; 0 = off; at most 1e6.", min=0, max=1_000_000)
    graph: str = _field(
        "marsrl", "The agent graph whose roles the demos teach (as agents.graph of the RL run)."
    )
    prompts: str = _field(
        "compact", "Prompt set of the graph the demos are written in (as agents.prompts of the RL run)."
    )
    train_file: str | None = _field(
        None,
        "The task's problems the demos are drawn from (the RL run's data.train_file; any format it reads, "
        "with the usual column names), so the "
        "warm start never sees a held-out problem; null = generate them (arith: `problems` from "
        "max_operand/problem_seed; subset_sum: the training split of tasks/subset_sum.py).",
    )
    problems: int = _field(100, "Distinct addition problems the demos are drawn from.", min=1)
    max_operand: int = _field(
        9,
        "Operands range over 0..max_operand; at most 999 (all (max_operand + 1)**2 pairs are listed).",
        min=1,
        max=999,
    )
    max_sum: int | None = _field(None, "Only problems whose answer is at most this; null = no bound.", min=1)
    problem_seed: int = _field(0, "Seed of the problem set (the same set the RL run trains on).", min=0)
    seed: int = _field(1234, "Seed of the data order and of megatron's initialisation.", min=0, max=SEED_MAX)
    demos: DemoConfig = field(default_factory=DemoConfig, metadata={"help": "Noise of the demonstrations."})

    def validate(self) -> None:
        if self.skill_steps > self.steps:
            raise ConfigError(f"{self.skill_steps} is more than steps ({self.steps})", "skill_steps")
        if self.train_file is not None:
            if not Path(self.train_file).exists():
                raise ConfigError(f"{self.train_file}: no such file or folder", "train_file")
            return
        if self.task != "arith":
            return
        available = len(operand_pairs(self.max_operand, self.max_sum))
        if self.problems > available:
            raise ConfigError(
                f"{self.problems} problems, but max_operand={self.max_operand} and max_sum={self.max_sum} "
                f"give only {available} distinct ones",
                "problems",
            )

    def problem_set(self) -> list[Problem]:
        if self.task == "subset_sum":
            from mars_megatron.tasks import subset_sum

            if self.train_file is not None:
                return subset_sum.load_subset_file(self.train_file)
            return subset_sum.train_test_split()[0]
        if self.train_file is not None:
            return load_arith_file(self.train_file)
        return arith_problems(
            self.problems, self.problem_seed, max_operand=self.max_operand, max_sum=self.max_sum
        )

    def lr_at(self, step: int) -> float:
        """Learning rate of 0-based ``step``: in the first phase a linear warm-up to ``lr`` and a linear
        decay to ``lr * min_lr_ratio`` at its last step; ``mix_lr`` in the second phase."""
        if step >= self.skill_steps:
            return self.mix_lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.skill_steps - self.warmup_steps - 1)
        frac = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (1.0 - (1.0 - self.min_lr_ratio) * frac)


def step_batches(sft: SFTConfig, tokenizer_path: str | Path) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Token ids and target masks of the demos of every step: ``skill_steps`` steps of mostly careful
    demos, then the configured mix; every demo is fresh (drawn for its step)."""
    from mars_megatron.rollout.chat import ChatCodec

    codec = ChatCodec.from_pretrained(tokenizer_path)
    from mars_megatron.tasks.tool_demos import build_tool_demos, encode_tool_demo

    graph = load_graph(sft.graph)
    problems, prompts = sft.problem_set(), prompt_set_of(graph, sft.prompts)
    # A graph whose roles call tools learns multi-turn responses (turns, observations masked).
    tools = any(r.tool is not None for r in graph.roles.values())
    build, encode = (build_tool_demos, encode_tool_demo) if tools else (build_demos, encode_demo)
    if sft.task == "subset_sum":
        from mars_megatron.tasks.subset_demos import build_subset_demos

        build, encode = build_subset_demos, encode_demo  # type: ignore[assignment]
    phases = (
        (sft.demos.with_careful(sft.skill_careful), sft.skill_steps),
        (sft.demos, sft.steps - sft.skill_steps),
    )
    batches = []
    for k, (cfg, steps) in enumerate(phases):
        cfg = dataclasses.replace(cfg, seed=cfg.seed + k)
        demos = build(problems, graph, prompts, cfg, steps * sft.demos_per_step)
        pairs = [encode(d, codec) for d in demos]  # type: ignore[arg-type]
        for i in range(0, len(pairs), sft.demos_per_step):
            chunk = pairs[i : i + sft.demos_per_step]
            batches.append(([ids for ids, _ in chunk], [mask for _, mask in chunk]))
    return batches


def sft_job(
    model_dir: str,
    parallel: ParallelConfig,
    sft: SFTConfig,
    dtype: str | None = None,
    impl: str = "auto",
    log: bool = True,
) -> list[dict[str, float]]:
    """Run the warm start on this rank (collective over the world); returns the metrics of every step
    (the last one also carries ``train_s``, the seconds of the training loop).

    ``model_dir`` is an HF directory or a mars Megatron checkpoint; ``dtype``/``impl`` as in
    ``jobs.load_engine``. Arguments are positional-friendly for ``jobs.run(sft_job, parallel, ...)``. The
    output directory is staged and renamed into place when every rank has finished, so a failed run
    leaves nothing at ``sft.out_dir``; an existing one is refused before any training.
    """
    import torch.distributed as dist

    from mars_megatron.config import OptimizerConfig
    from mars_megatron.convert import check_output_dir
    from mars_megatron.jobs import load_engine, tokenizer_dir
    from mars_megatron.training import parallel as par
    from mars_megatron.training.megatron_engine import lm_loss

    if sft.out_dir is None:
        raise ConfigError("must be set", "sft.out_dir")
    check_output_dir(sft.out_dir)
    par.init_model_parallel(parallel, sft.seed)
    optimizer = OptimizerConfig(lr=sft.lr, weight_decay=sft.weight_decay, clip_grad=sft.clip_grad)
    engine = load_engine(model_dir, parallel, dtype=dtype, impl=impl, optimizer=optimizer)
    history = []
    started = time.perf_counter()
    for step, (seqs, masks) in enumerate(step_batches(sft, tokenizer_dir(model_dir))):
        for group in engine.optimizer.param_groups:
            group["lr"] = sft.lr_at(step)
        t0 = time.perf_counter()
        metrics = engine.train_step(seqs, lm_loss, pack_length=sft.pack_length, target_masks=masks)
        metrics.update(step=step + 1, lr=sft.lr_at(step), step_s=time.perf_counter() - t0)
        history.append(metrics)
        if log and dist.get_rank() == 0 and (step % 10 == 0 or step + 1 == sft.steps):
            print(
                f"sft step {step + 1:4d}  loss {metrics['loss']:.4f}  tokens {int(metrics['tokens'])}  "
                f"{metrics['step_s']:.2f}s",
                flush=True,
            )
    train_s = time.perf_counter() - started
    save_sft_checkpoint(engine, model_dir, sft.out_dir, parallel)
    if history:
        history[-1]["train_s"] = train_s
    return history


def save_sft_checkpoint(engine: Any, source_dir: str, out_dir: str | Path, parallel: ParallelConfig) -> None:
    """Write ``engine``'s weights as a mars Megatron checkpoint whose ``hf/`` is a complete HF model.

    Layout: ``mars_checkpoint.json`` + ``model/`` (megatron dist checkpoint, loadable in any layout) as
    ``mars_megatron.convert.hf_to_mcore`` writes them, and ``hf/`` with the HF safetensors,
    config and tokenizer of ``source_dir``. Collective; staged and renamed like the converter's outputs.
    """
    import torch.distributed as dist

    from mars_megatron.checkpoint.model_meta import copy_assets, write_meta
    from mars_megatron.conversion.hf_io import HFWriter
    from mars_megatron.conversion.model_io import export_weights
    from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors
    from mars_megatron.convert import save_mcore, staged_output
    from mars_megatron.dtypes import torch_dtype
    from mars_megatron.jobs import tokenizer_dir

    arch = engine.arch
    out = Path(out_dir)
    with staged_output(out) as tmp:
        save_mcore(engine.model, tmp / "model")
        writer = None
        if dist.get_rank() == 0:
            (tmp / "hf").mkdir()
            dtype = torch_dtype(engine.dtype)
            layout = {n: (shape, dtype) for n, shape in expected_hf_tensors(arch).items()}
            writer = HFWriter(tmp / "hf", layout, 5 * 2**30)
        for name, tensor in export_weights(engine.model, arch):
            assert writer is not None
            writer.add(name, tensor)
        if writer is not None:
            writer.close()
            copy_assets(tokenizer_dir(source_dir), tmp / "hf")
            write_meta(tmp, arch, engine.dtype, engine.vocab_pad_multiple, parallel)


def role_accuracy(
    model_dir: str | Path,
    problems: Sequence[Problem],
    *,
    prompts: str = "compact",
    graph: str = "marsrl",
    group_size: int = 4,
    inputs_per_agent: int = 2,
    max_steps: int | None = None,
    strategy: Strategy = "adaptive",
    temperature: float = 1.0,
    max_tokens: int = 32,
    seed: int = 0,
    engine: Any = None,
    max_batch: int = 64,
) -> dict[str, float]:
    """Each role's mean reward where reinforcement learning starts: one synchronous round of the training
    schedule of ``graph`` (:func:`~mars_megatron.pipeline.local.run_round`: positions, input selection,
    real answer checker and verdict parser) on ``problems``, so the figure is on the scale of
    ``mars train``'s ``reward/<role>``.

    Returns the rollout's metrics: ``reward/<role>``, ``samples/<role>``, ``position_reward/<position>``,
    ``<role>/on_right|on_wrong`` for roles with an input (NaN where a role got none), ``<role>/unparsed``
    for roles that read a verdict, …. ``engine`` may be a rollout engine already holding the weights
    (default: an ``HFEngine`` on ``model_dir`` decoding ``max_batch`` requests at once).
    """
    from mars_megatron.pipeline.local import run_round
    from mars_megatron.rollout.chat import ChatCodec
    from mars_megatron.rollout.engine import SamplingParams
    from mars_megatron.rollout.hf_engine import HFEngine

    if not problems:
        raise ValueError("role_accuracy: no problems")
    agent_graph = load_graph(graph, max_steps=max_steps)
    codec = ChatCodec.from_pretrained(model_dir)
    engine = engine if engine is not None else HFEngine(model_dir, seed=seed, max_batch=max_batch)
    with AnswerChecker(CheckerConfig(num_workers=1)) as checker:
        return run_round(
            problems,
            engines=dict.fromkeys(agent_graph.roles, engine),
            codec=codec,
            checker=checker,
            graph=agent_graph,
            agents=AgentsConfig(
                graph=graph,
                prompts=prompts,
                group_size=group_size,
                inputs_per_agent=inputs_per_agent,
                max_steps=max_steps,
                strategy=strategy,
            ),
            sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature),
            seed=seed,
            max_batch=max_batch,
        ).metrics
