"""Benchmark the MarsRL train step against a bare Megatron-Core loop on the same packed batch, in one run.

Timed, alternately (ours, bare, bare, ours, ...) on the same engine, model and optimizer:

- ``ours``: ``PolicyWorker.train`` as the trainer calls it once per rollout batch — plan the packs, build
  this rank's packed micro-batches, lay out the loss inputs of every pack (``packed_loss_inputs``), the
  MarsRL objective (``make_loss_fn``, POIS, clip-higher, per-micro-batch stats), ``MegatronEngine.step``
  (zero grads, megatron's forward/backward schedule with the block-diagonal mask built per pack, a
  finite-check all-reduce, ``optimizer.step``, a global loss/token sum) and the metric averaging; the
  samples carry engine log-probs, so it also measures the trainer-vs-engine mismatch as a run does (in
  the update's own forward: per-sequence sums, then their all-reduce);
- ``bare``: the limit — the same packs as pre-built tensors (tokens, positions, targets, the block-diagonal
  mask, advantage × response mask, token count), ``zero_grad_buffer``, ``zero_grad``,
  ``get_forward_backward_func()`` with a minimal forward step (``model(tokens, positions,
  attention_mask=mask)``, ``vocab_parallel_logprobs`` × the precomputed weights, summed) and
  ``optimizer.step``. Nothing is built per step.

With POIS the ratio is exp(lp − lp.detach()) = 1, so both losses have the same gradient; the benchmark checks
that on the first batch (max |Δ grad| printed) before timing, so the two sides do the same work.

Shapes: ``short`` (like the tiny MarsRL run: a few hundred samples of 30–60 prompt + 5–25 response tokens,
packs of 512) and ``long`` (a few samples of 1–4k tokens, packs of 8192, where attention dominates).
Each shape runs in fresh processes (``parallel.launch``); ``--nproc 2`` trains the MoE with EP2 (the
dense model with DP2). Layers are megatron's local implementation (the CPU path; on a GPU with Transformer
Engine the trainer would use THD packs instead of the mask). ``--profile`` adds a cProfile of our steps.
Target: ours <= 1.10x bare.

With no arguments it runs the default measurement (tiny-moe, both shapes, one process, 6 timed steps per
side; the model is built in a temporary directory) and prints per shape the bare loop's and our median
step time, their ratio against the target, the per-step work breakdown and every timed step. It is the
longest benchmark: 13 minutes measured on 2 cores shared with other work, most of it the long shape
(``--shapes short`` alone: 3 minutes there); a line on stderr says which shape is running. ``--quick``
is the smoke run (about 30 s).

    python tools/bench/train_step.py [--model tiny-moe|tiny-dense] [--shapes short,long] [--nproc 1]
    python tools/bench/train_step.py --quick      # tiny sizes, a smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mars_megatron.agents.sample import Sample
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel

TARGET = 1.10
GROUP_SIZE = 8  # samples per GRPO group (same prompt, same position)


@dataclass(frozen=True)
class Shape:
    """A global batch: ``samples`` samples, prompt and response lengths uniform in the given ranges."""

    name: str
    samples: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    pack_length: int

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"Shape.samples must be >= 1, got {self.samples}")
        for name in ("prompt", "response"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"Shape.{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.pack_length < self.prompt[1] + self.response[1]:
            raise ValueError(
                f"Shape.pack_length {self.pack_length} must hold the longest sample "
                f"({self.prompt[1] + self.response[1]} tokens): the trainer never splits a sample"
            )


def make_samples(shape: Shape, vocab: int, seed: int = 0) -> list[Sample]:
    """Seeded random samples with advantages and engine log-probs, in GRPO groups of :data:`GROUP_SIZE`
    sharing a prompt."""
    rng = random.Random(seed)
    positions = list(("solver", "verifier_1", "corrector_1", "verifier_2", "corrector_2"))
    out: list[Sample] = []
    prompt: list[int] = []
    for i in range(shape.samples):
        group = i // GROUP_SIZE
        if i % GROUP_SIZE == 0:
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*shape.prompt))]
        response = [rng.randrange(1, vocab) for _ in range(rng.randint(*shape.response))]
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                position=positions[group % len(positions)],
                problem_id=f"p{group}",
                group_id=f"g{group}",
                reward=float(rng.random() < 0.5),
                advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5),
                behaviour_logprobs=[-rng.uniform(0.05, 4.0) for _ in response],
                sample_id=f"s{i}",
            )
        )
    return out


# ------------------------------------------------------------------------------------------- the bare loop
@dataclass(frozen=True)
class BarePack:
    """One pre-built micro-batch of the bare loop: everything its step reads, on the model's device."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor  # advantage × response mask, [1, T]
    count: torch.Tensor  # trained tokens, int


def prepare_bare(engine: Any, samples: Sequence[Sample], pack_length: int, loss: Any) -> list[BarePack]:
    """This rank's packs of the batch, as the trainer would pack them, turned into plain tensors once."""
    from mars_megatron.algorithm.objective import packed_loss_inputs

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    plan = engine.plan([len(s.tokens) for s in samples], pack_length)
    out = []
    for mb in engine.rank_packs([s.tokens for s in samples], plan):
        inputs = packed_loss_inputs(samples, mb.pack, loss)
        out.append(
            BarePack(
                tokens=mb.tokens.to(device),
                position_ids=mb.position_ids.to(device),
                attention_mask=mb.pack.attention_mask(device),
                targets=mb.targets.to(device),
                weights=(inputs.advantages * inputs.mask).to(device),
                count=inputs.mask.sum().to(torch.int),
            )
        )
    return out


def _bare_forward(vocab_size: int, data: Any, model: Any) -> tuple[torch.Tensor, Any]:
    from megatron.core import parallel_state as ps

    from mars_megatron.training.logprobs import vocab_parallel_logprobs

    b: BarePack = next(data)
    output = model(b.tokens, b.position_ids, attention_mask=b.attention_mask)

    def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        logprobs = vocab_parallel_logprobs(
            logits,
            b.targets,
            vocab_start=ps.get_tensor_model_parallel_rank() * logits.shape[-1],
            vocab_size=vocab_size,
            group=ps.get_tensor_model_parallel_group(),
        )
        loss = -(logprobs * b.weights).sum()
        return loss, b.count, {"loss": loss.detach()}

    return output, loss_func


def bare_forward_backward(engine: Any, packs: list[BarePack]) -> None:
    """Zero the gradients and run megatron's schedule over ``packs`` (no optimizer step)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    engine.model.zero_grad_buffer()
    engine.optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=partial(_bare_forward, engine.arch.vocab_size),
        data_iterator=iter(packs),
        model=[engine.model],
        num_microbatches=len(packs),
        seq_length=packs[0].tokens.shape[1],
        micro_batch_size=1,
        forward_only=False,
    )


def bare_step(engine: Any, packs: list[BarePack]) -> None:
    """The bare Megatron-Core training step: forward/backward over the packs, then the optimizer."""
    bare_forward_backward(engine, packs)
    engine.optimizer.step()


# ---------------------------------------------------------------------------------------------- the worker
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def time_alternately(
    ours: Callable[[], None], bare: Callable[[], None], repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds of each side's steps after ``warmup`` untimed pairs, in ABBA order (drifts, thermal or
    other load, hit both sides alike): wall time under ``ours``/``bare``, process CPU time under
    ``ours_cpu``/``bare_cpu``."""
    for _ in range(warmup):
        ours()
        bare()
    times: dict[str, list[float]] = {"ours": [], "bare": [], "ours_cpu": [], "bare_cpu": []}
    for r in range(repeats):
        order = (("ours", ours), ("bare", bare)) if r % 2 == 0 else (("bare", bare), ("ours", ours))
        for name, fn in order:
            cpu = time.process_time()
            times[name].append(_timed(fn))
            times[f"{name}_cpu"].append(time.process_time() - cpu)
    return times


def _grad_buffers(engine: Any) -> list[torch.Tensor]:
    buffers = [*engine.model.buffers, *engine.model.expert_parallel_buffers]
    return [b.grad_data.detach().clone() for b in buffers]


def _check_same_gradient(
    worker: Any, engine: Any, samples: list[Sample], packs: list[BarePack], rtol: float = 1e-5
) -> tuple[float, float]:
    """(max |grad(ours) − grad(bare)|, max |grad|) on the current weights (no optimizer step on either
    side): the two loops must do the same work for the comparison to mean anything. ``rtol``: the
    difference allowed, relative to max |grad| (1e-5 in fp32; bf16 rounds each side differently)."""
    from mars_megatron.algorithm.objective import make_loss_fn, packed_loss_inputs

    engine.model.train()
    # A fresh engine's first backward differs from later ones at the 1e-5 level (dense model, fp32):
    # compare steady-state passes.
    bare_forward_backward(engine, packs)
    bare_forward_backward(engine, packs)
    bare = _grad_buffers(engine)
    plan = engine.plan([len(s.tokens) for s in samples], worker.cfg.train.pack_length)
    mbs = engine.rank_packs([s.tokens for s in samples], plan)
    engine.model.zero_grad_buffer()
    engine.optimizer.zero_grad()
    loss_fn = make_loss_fn(worker.loss, lambda mb: packed_loss_inputs(samples, mb.pack, worker.loss))
    engine._run(mbs, loss_fn, forward_only=False)
    ours = _grad_buffers(engine)
    engine.model.zero_grad_buffer()
    engine.optimizer.zero_grad()
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, bare, strict=True))
    scale = max(float(a.abs().max()) for a in ours)
    if not diff <= rtol * scale:
        raise RuntimeError(f"bare loop and trainer disagree: max |dgrad| {diff:.3e} (max |grad| {scale:.3e})")
    return diff, scale


def _breakdown(worker: Any, engine: Any, samples: list[Sample], repeats: int) -> dict[str, float]:
    """Median seconds of the per-step work the bare loop does not do: planning, building packs, the loss
    inputs of every pack, the attention masks (where the engine makes them: on its device) and the
    mismatch tally of every pack (each timed on its own, outside the timed steps)."""
    from mars_megatron.algorithm.mismatch import MismatchTally
    from mars_megatron.algorithm.objective import packed_loss_inputs

    pack_length = worker.cfg.train.pack_length
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    lengths = [len(s.tokens) for s in samples]
    seqs = [s.tokens for s in samples]
    plan = engine.plan(lengths, pack_length)
    mbs = engine.rank_packs(seqs, plan)
    parts: dict[str, list[float]] = {
        "plan": [],
        "rank_packs": [],
        "loss_inputs": [],
        "masks": [],
        "mismatch": [],
    }

    def tally() -> None:
        t = MismatchTally(worker.cfg.algorithm.mismatch_threshold)
        t.add_batch(samples, mbs)
        for mb in mbs:
            t.add(torch.zeros(mb.tokens.shape), mb)
        t.finish(t.flat())

    for _ in range(repeats):
        parts["plan"].append(_timed(lambda: engine.plan(lengths, pack_length)))
        parts["rank_packs"].append(_timed(lambda: engine.rank_packs(seqs, plan)))
        parts["loss_inputs"].append(
            _timed(lambda: [packed_loss_inputs(samples, mb.pack, worker.loss) for mb in mbs])
        )
        parts["masks"].append(_timed(lambda: [mb.pack.attention_mask(device) for mb in mbs]))
        parts["mismatch"].append(_timed(tally))
    return {k: statistics.median(v) for k, v in parts.items()}


def worker(
    model_dir: str, overrides: list[str], shape: Shape, repeats: int, warmup: int, profile: bool
) -> dict[str, Any]:
    """One rank: build the trainer's PolicyWorker, time its train step and the bare loop alternately."""
    from mars_megatron.agents.graph import SHARED
    from mars_megatron.config import load_config
    from mars_megatron.rl.worker import PolicyWorker

    cfg = load_config(
        None,
        [
            f"model.hf_dir={model_dir}",
            "model.transformer_impl=local",
            f"train.pack_length={shape.pack_length}",
            f"rollout.max_response_tokens={min(shape.response[1], shape.pack_length)}",
            "train.updates_per_batch=1",
            "optimizer.lr=1e-5",
            "train.seed=0",
            *overrides,
        ],
    )
    trainer = PolicyWorker(cfg, model_dir, [SHARED])
    engine = trainer.policies[SHARED].megatron
    samples = make_samples(shape, engine.arch.vocab_size)
    packs = prepare_bare(engine, samples, shape.pack_length, trainer.loss)
    grad_diff, grad_scale = _check_same_gradient(trainer, engine, samples, packs)

    def ours() -> None:
        trainer.train(trainer.local_shares({SHARED: samples}))

    def bare() -> None:
        bare_step(engine, packs)

    times = time_alternately(ours, bare, repeats, warmup)
    out: dict[str, Any] = {
        "times": times,
        "grad_diff": grad_diff / grad_scale,
        "threads": torch.get_num_threads(),
        "packs": len(packs),
        "tokens": sum(len(s.tokens) for s in samples),
        "pack_tokens": sum(p.tokens.shape[1] for p in packs),
        "breakdown": _breakdown(trainer, engine, samples, max(3, repeats // 2)),
    }
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(max(1, repeats // 2)):
            ours()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        out["profile"] = text.getvalue()
    return out


# ------------------------------------------------------------------------------------------------- driver
def _shapes(args: argparse.Namespace) -> dict[str, Shape]:
    if args.quick:
        return {
            "short": Shape("short", 24, (6, 12), (2, 6), 64),
            "long": Shape("long", 3, (20, 60), (60, 180), 256),
        }
    return {
        "short": Shape(
            "short", args.samples, (args.prompt_min, args.prompt_max), (5, args.response_max), args.pack
        ),
        "long": Shape(
            "long",
            args.long_samples,
            (args.long_prompt_min, args.long_prompt_max),
            (args.long_response_min, args.long_response_max),
            args.long_pack,
        ),
    }


def _overrides(model: str, nproc: int) -> tuple[list[str], str]:
    if nproc == 1:
        return [], "1 process"
    if model == "tiny-moe":
        return [f"parallel.ep={nproc}", "parallel.etp=1"], f"{nproc} processes, EP{nproc}"
    return [], f"{nproc} processes, DP{nproc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny-moe", "tiny-dense"], default="tiny-moe")
    ap.add_argument("--shapes", default="short,long", help="comma-separated: short, long")
    ap.add_argument("--nproc", type=int, default=1, help="ranks; >1 trains the MoE with EP=nproc")
    ap.add_argument("--repeats", type=int, default=6, help="timed steps per side (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--samples", type=int, default=256, help="short shape: samples per batch")
    ap.add_argument("--prompt-min", type=int, default=30)
    ap.add_argument("--prompt-max", type=int, default=60)
    ap.add_argument("--response-max", type=int, default=25, help="short shape: responses 5..this tokens")
    ap.add_argument("--pack", type=int, default=512, help="short shape: tokens per pack")
    ap.add_argument("--long-samples", type=int, default=6)
    ap.add_argument("--long-prompt-min", type=int, default=200)
    ap.add_argument("--long-prompt-max", type=int, default=600)
    ap.add_argument("--long-response-min", type=int, default=800)
    ap.add_argument("--long-response-max", type=int, default=3400)
    ap.add_argument("--long-pack", type=int, default=8192, help="long shape: tokens per pack")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of our steps (rank 0)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and 2 repeats: a smoke run")
    args = ap.parse_args()
    if args.nproc < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--nproc and --repeats must be >= 1, --warmup >= 0")
    if args.quick:
        args.repeats, args.warmup = 2, 1
    shapes = _shapes(args)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in shapes]
    if unknown or not names:
        ap.error(f"--shapes: unknown {unknown}; choose from {sorted(shapes)}")
    overrides, layout = _overrides(args.model, args.nproc)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(init_model(args.model, Path(tmp) / "hf"))
        for name in names:
            shape = shapes[name]
            # The table comes at the end, minutes later: say on stderr what runs, so that it is not silent.
            print(
                f"{name} shape: {shape.samples} samples in packs of {shape.pack_length}, "
                f"{args.warmup} + {args.repeats} steps per side ...",
                file=sys.stderr,
                flush=True,
            )
            run = (model_dir, overrides, shape, args.repeats, args.warmup, args.profile)
            r = parallel.launch(worker, args.nproc, *run)[0]
            rows.append((shapes[name], r))
    print(
        f"model: {args.model}, {layout} ({rows[0][1]['threads']} threads each), megatron local layers, fp32; "
        f"{args.repeats} steps per side after {args.warmup} warm-up, interleaved ours/bare/bare/ours"
    )
    print(
        f"{'shape':<7}{'samples':>8}{'tokens':>8}{'packs':>6}{'pack len':>9}{'bare ms':>10}{'ours ms':>10}"
        f"{'ours/bare':>10}{'min/min':>9}{'cpu s/s':>9}{'dgrad':>9}"
    )
    ratios = []
    for shape, r in rows:
        t = r["times"]
        ours, bare = statistics.median(t["ours"]), statistics.median(t["bare"])
        ratios.append(ours / bare)
        print(
            f"{shape.name:<7}{shape.samples:>8}{r['tokens']:>8}{r['packs']:>6}{shape.pack_length:>9}"
            f"{bare * 1e3:>10.1f}{ours * 1e3:>10.1f}{ours / bare:>9.3f}x"
            f"{min(t['ours']) / min(t['bare']):>8.3f}x"
            f"{statistics.median(t['ours_cpu']) / statistics.median(t['bare_cpu']):>8.3f}x"
            f"{r['grad_diff']:>9.0e}"
        )
    print(
        "(ms: median wall time per step on rank 0; ours/bare: their ratio, the figure judged; min/min:\n"
        " the fastest steps' ratio and cpu s/s: the median CPU-time ratio of this process, both less hit by\n"
        " other load on a shared machine; dgrad: max |grad ours - grad bare| / max |grad| before timing)"
    )
    print("per-step work of ours that the bare loop does not do (rank 0, each timed apart, median ms):")
    for shape, r in rows:
        t, b = r["times"], r["breakdown"]
        extra = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b.items())
        delta = statistics.median(t["ours"]) - statistics.median(t["bare"])
        print(f"  {shape.name}: {extra}; sum {sum(b.values()) * 1e3:.1f} (ours - bare: {delta * 1e3:.1f})")
    print("every timed step (ms, in run order):")
    for shape, r in rows:
        for side in ("bare", "ours"):
            print(f"  {shape.name} {side}: {' '.join(f'{x * 1e3:.0f}' for x in r['times'][side])}")
    if args.quick:
        print("quick run: tiny sizes and 2 steps per side show that the benchmark runs; do not judge by them")
    for (shape, _), ratio in zip(rows, ratios, strict=True):
        verdict = "MET" if ratio <= TARGET else "NOT MET"
        print(f"target {verdict}: {shape.name}: ours <= {TARGET:.2f}x bare ({ratio:.3f}x)")
    for shape, r in rows:
        if "profile" in r:
            print(f"--- cProfile of our steps, {shape.name} shape (rank 0), by cumulative time ---")
            print(r["profile"])


if __name__ == "__main__":
    main()
