"""Check 2: the packed MarsRL train step (``PolicyWorker.train``, the call the trainer makes per rollout
batch: plan the packs, score the old log-probs, the clipped objective with TIS weights, megatron's
forward/backward with the block-diagonal mask, the optimizer) on the device, against the same step in
fp32 on the host; 20 steps without a NaN; a checkpoint saved after step 10 and resumed in a new process
repeats steps 11-20.

The objective is TIS (``algorithm.importance=tis``) with behaviour log-probs near the model's: its loss
depends on the weights (the TIS weight is exp(old − behaviour)), whereas under POIS the first step's
loss is −mean(A) whatever the weights, which would make the loss row say nothing.

Bounds (GPU, bf16 against the host's fp32 step of the same batch from the same bf16-stored weights).
The loss is a weighted mean over ~10k tokens of TIS weights exp(old − behaviour): a bf16 log-prob error
of ~1e-2 per token (check 1) enters it mostly with random sign, so its mean error is far smaller; 1e-2
relative leaves room for a systematic offset of that size. The gradient norm sums squares of bf16
gradients (each rounded at 2^-8 relative, accumulated in fp32 buffers: ``grad_reduce_in_fp32``) whose
errors partly average out in the norm; bf16 steps of one model in different layouts agree to 2e-2 on
GPUs (``tests/test_gpu.py``), so 5e-2 is allowed against fp32. The same comparison in bf16 on a CPU
(half this width, 16 samples) measured 1.0e-4 (loss) and 9.2e-3 (grad norm). In ``--cpu`` mode both
sides are the same fp32 computation in two processes: 1e-5.

The resumed steps must equal the uninterrupted run's bit for bit: the checkpoint holds every state a
step reads (weights, Adam moments and step, RNGs), and the GPU processes run with torch's deterministic
algorithms (``CUBLAS_WORKSPACE_CONFIG`` set by the runner), so any difference is lost state. Should the
GPU show differences of rounding size only, some kernel stayed non-deterministic: the figures give
the size.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from tools.device_check.common import Context, Row, at_most, fmt, is_true, rel, spawn

CHECK = "2 train_step"
STEPS, SAVE_AFTER = 20, 10
POLICY = "shared"
POSITIONS = ("solver", "verifier_1", "corrector_1", "verifier_2", "corrector_2")


@dataclass(frozen=True)
class Setup:
    """Model and batch shape of one mode."""

    overrides: dict[str, Any]  # init_model overrides of the tiny-moe preset
    samples: int
    prompt: tuple[int, int]
    response: tuple[int, int]
    pack_length: int
    loss_rel: float
    grad_rel: float


GPU = Setup(
    dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
         intermediate_size=1024, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256),
    samples=32, prompt=(50, 200), response=(20, 300), pack_length=1024, loss_rel=1e-2, grad_rel=5e-2,
)  # fmt: skip
CPU = Setup({}, samples=12, prompt=(3, 12), response=(2, 15), pack_length=64, loss_rel=1e-5, grad_rel=1e-5)


def batch(step: int, setup: Setup, vocab: int) -> list[Any]:
    """Step ``step``'s rollout batch: seeded by the step alone (a resumed run draws the same batches),
    GRPO groups of 4 sharing a prompt, advantages mostly positive (a loss well away from 0) and
    behaviour log-probs within ±0.3 of a uniform model's, so TIS weights stay near 1."""
    from mars_megatron.agents.sample import Sample

    rng = random.Random(1000 + step)
    uniform = -math.log(vocab)
    out = []
    prompt: list[int] = []
    for i in range(setup.samples):
        if i % 4 == 0:
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*setup.prompt))]
        response = [rng.randrange(1, vocab) for _ in range(rng.randint(*setup.response))]
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                position=POSITIONS[(i // 4) % len(POSITIONS)],
                problem_id=f"p{step}-{i // 4}",
                group_id=f"g{step}-{i // 4}",
                reward=float(rng.random() < 0.5),
                advantage=rng.choice([-1.0, 1.0, 1.0, 1.0]) * rng.uniform(0.2, 1.5),
                behaviour_logprobs=[uniform + rng.uniform(-0.3, 0.3) for _ in response],
                sample_id=f"s{step}-{i}",
            )
        )
    return out


def _worker(model_dir: str, dtype: str, setup: Setup, lr: float) -> Any:
    from mars_megatron.config import load_config
    from mars_megatron.rl.worker import PolicyWorker

    cfg = load_config(
        None,
        [
            f"model.hf_dir={model_dir}",
            "model.transformer_impl=local",
            f"model.dtype={dtype}",
            f"train.pack_length={setup.pack_length}",
            f"rollout.max_response_tokens={setup.response[1]}",
            "train.updates_per_batch=1",
            "algorithm.importance=tis",
            f"optimizer.lr={lr}",
            "train.seed=0",
        ],
    )
    return PolicyWorker(cfg, model_dir, [POLICY])


def _steps(worker: Any, first: int, last: int, setup: Setup, save_dir: str | None = None) -> list[dict]:
    vocab = worker.policies[POLICY].megatron.arch.vocab_size
    out = []
    for step in range(first, last + 1):
        samples = batch(step, setup, vocab)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = worker.train(worker.local_shares({POLICY: samples}))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        metrics["seconds"] = time.perf_counter() - start
        out.append(metrics)
        if step == SAVE_AFTER and save_dir is not None:
            worker.save(save_dir)
    return out


def _deterministic() -> None:
    """torch's deterministic kernels (where one exists; a warning where not), without its NaN-filling of
    fresh allocations, so memory behaves as in a training run."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def train(model_dir: str, dtype: str, setup: Setup, lr: float, save_dir: str) -> list[dict]:
    """Spawned (device): :data:`STEPS` steps, saving after :data:`SAVE_AFTER`."""
    _deterministic()
    return _steps(_worker(model_dir, dtype, setup, lr), 1, STEPS, setup, save_dir)


def resume(model_dir: str, dtype: str, setup: Setup, lr: float, load_dir: str) -> list[dict]:
    """Spawned (device), a new process: load the checkpoint, take steps SAVE_AFTER+1 .. STEPS."""
    _deterministic()
    worker = _worker(model_dir, dtype, setup, lr)
    worker.load(load_dir)
    return _steps(worker, SAVE_AFTER + 1, STEPS, setup)


def reference(model_dir: str, setup: Setup, lr: float) -> dict:
    """Spawned on the host (no GPU visible, gloo): the first step in fp32."""
    return _steps(_worker(model_dir, "float32", setup, lr), 1, 1, setup)[0]


def run(ctx: Context) -> list[Row]:
    from mars_megatron.models.presets import init_model

    setup = CPU if ctx.cpu else GPU
    lr = 1e-4
    model_dir = init_model(
        "tiny-moe", ctx.workdir / "train-moe", dtype=ctx.dtype_name, overrides=setup.overrides
    )
    ckpt = ctx.workdir / "train-ckpt"
    ckpt.mkdir()
    ctx.log(
        f"{STEPS} steps on the {'host' if ctx.cpu else 'GPU'} ({ctx.dtype_name}), saving after {SAVE_AFTER}"
    )
    steps = spawn(train, str(model_dir), ctx.dtype_name, setup, lr, str(ckpt), timeout_s=ctx.timeout(240))
    ctx.log("the first step in fp32 on the host")
    ref = spawn(reference, str(model_dir), setup, lr, host=True, timeout_s=ctx.timeout(240))
    ctx.log(f"resuming from step {SAVE_AFTER} in a new process")
    resumed = spawn(resume, str(model_dir), ctx.dtype_name, setup, lr, str(ckpt), timeout_s=ctx.timeout(180))
    return rows(ctx, setup, steps, ref, resumed)


def rows(ctx: Context, setup: Setup, steps: list[dict], ref: dict, resumed: list[dict]) -> list[Row]:
    first = steps[0]
    where = "host fp32" if ctx.cpu else f"GPU {ctx.dtype_name}"
    out = [
        is_true(
            CHECK,
            "first step: trained tokens equal the host fp32 step's",
            first["train/tokens"] == ref["train/tokens"],
            f"{first['train/tokens']:.0f} / {ref['train/tokens']:.0f}",
        ),
        at_most(
            CHECK,
            f"first step ({where}): loss, rel |Δ| vs the host fp32 step",
            rel(first["train/loss"], ref["train/loss"]),
            setup.loss_rel,
            loss=first["train/loss"],
            reference=ref["train/loss"],
        ),
        at_most(
            CHECK,
            f"first step ({where}): grad norm, rel |Δ| vs the host fp32 step",
            rel(first["train/grad_norm"], ref["train/grad_norm"]),
            setup.grad_rel,
            grad_norm=first["train/grad_norm"],
            reference=ref["train/grad_norm"],
        ),
    ]
    good = [
        math.isfinite(s["train/loss"]) and math.isfinite(s["train/grad_norm"]) and s["train/update_ok"] == 1.0
        for s in steps
    ]
    out.append(
        is_true(
            CHECK,
            f"{STEPS} steps: finite loss and grad norm, every update applied",
            len(steps) == STEPS and all(good),
            f"{sum(good)}/{STEPS}",
            loss=[s["train/loss"] for s in steps],
            grad_norm=[s["train/grad_norm"] for s in steps],
            seconds=[s["seconds"] for s in steps],
            tokens=[s["train/tokens"] for s in steps],
        )
    )
    again = steps[SAVE_AFTER:]
    d_loss = max(
        (abs(a["train/loss"] - b["train/loss"]) for a, b in zip(again, resumed, strict=True)), default=0
    )
    d_grad = max(
        (abs(a["train/grad_norm"] - b["train/grad_norm"]) for a, b in zip(again, resumed, strict=True)),
        default=0,
    )
    same = len(resumed) == len(again) and all(
        a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
        for a, b in zip(again, resumed, strict=True)
    )
    out.append(
        Row(
            CHECK,
            f"resumed after step {SAVE_AFTER}: steps {SAVE_AFTER + 1}-{STEPS} repeat "
            "(max |Δ loss|, |Δ grad norm|)",
            f"{fmt(d_loss)}, {fmt(d_grad)}",
            "= 0 (bit for bit)",
            bool(same),
            {
                "loss": [s["train/loss"] for s in resumed],
                "grad_norm": [s["train/grad_norm"] for s in resumed],
                "max_abs_loss": d_loss,
                "max_abs_grad_norm": d_grad,
            },
        )
    )
    return out
