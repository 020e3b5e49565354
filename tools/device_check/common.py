"""The device check's shared types: what a check is given (:class:`Context`) and what it reports
(:class:`Row`, one assertion on values each), and the helpers every check uses.

Every check is a module of this package with ``run(ctx) -> list[Row]``; the runner
(``tools/device_check/__main__.py``) calls them in order, turns an exception into a failed row naming it,
prints one table and writes it, with every figure, to ``$OUT`` when that is set. The same checks run in
``--cpu`` mode (gloo, fp32, tiny shapes) in CI, so they cannot rot between GPU loans.

Why checks run their distributed work in spawned processes (:func:`spawn`): megatron's parallel state and
torch.distributed are process-global, and on a first GPU contact a CUDA error (an illegal address, a
hung NCCL call) poisons the process that hit it. One fresh process per piece of work keeps one failure
in one check's rows.

The GPU machine has no Ray, vLLM, Transformer Engine or math-verify. :func:`block_absent` makes the same
packages unimportable in every process of a run (``--cpu`` in CI included), so a path that imports one of
them fails here first, not on the rare GPU loan.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ABSENT = ("ray", "vllm", "transformer_engine", "math_verify")
"""Top-level packages the bare GPU machine lacks; never importable during a device check."""
ABSENT_ENV = "MARS_DEVICE_CHECK_ABSENT"
"""Comma-separated packages to block; the runner sets it, so spawned processes block them too."""


@dataclass(frozen=True)
class Row:
    """One assertion of one check, on measured values."""

    check: str
    """The check's number and short name, e.g. ``"1 logprobs"``."""
    what: str
    """What is asserted, in words: ``"dense bf16: max |Δ log p| vs transformers"``."""
    value: str
    """The measured figure as printed (``"3.1e-03"``)."""
    bound: str
    """The bound it is held to (``"≤ 2e-02"``); ``"—"`` for a figure only reported."""
    passed: bool
    figures: dict[str, Any] = field(default_factory=dict)
    """Every figure behind the row, for the JSON."""


@dataclass(frozen=True)
class Context:
    """What every check is given."""

    cpu: bool
    """``--cpu``: gloo, fp32, tiny shapes (CI); otherwise one CUDA GPU, NCCL, bf16."""
    device: torch.device
    dtype: torch.dtype
    """bf16 on the GPU, fp32 in ``--cpu`` mode."""
    workdir: Path
    """Scratch space of this run (models, checkpoints), removed afterwards."""
    log: Callable[[str], None]
    """Progress lines (stderr), so a 10-minute run shows where it is."""
    deadline: float = math.inf
    """``time.monotonic()`` by which the whole run must be done (``--budget-s``)."""

    def timeout(self, want: float) -> float:
        """Seconds a piece of work may take: ``want``, or less when the run's budget ends sooner (at
        least 10, so a check that starts late fails with a timeout rather than at once)."""
        return max(10.0, min(want, self.deadline - time.monotonic()))

    @property
    def backend(self) -> str:
        return "gloo" if self.cpu else "nccl"

    @property
    def dtype_name(self) -> str:
        """``"bfloat16"`` / ``"float32"``: how configs and checkpoints spell :attr:`dtype`."""
        return str(self.dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------- rows
def fmt(x: float) -> str:
    """A figure as the table prints it: 3 significant digits, exponent form for small values."""
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) < 1e-2 or abs(x) >= 1e5:
        return f"{x:.2e}"
    return f"{x:.4g}"


def at_most(check: str, what: str, value: float, bound: float, **figures: Any) -> Row:
    """A row asserting ``value <= bound`` (a NaN fails)."""
    return Row(check, what, fmt(value), f"≤ {fmt(bound)}", bool(value <= bound), {"value": value, **figures})


def is_true(check: str, what: str, ok: bool, value: str, **figures: Any) -> Row:
    """A row asserting a condition; ``value`` says what was found."""
    return Row(check, what, value, "holds", bool(ok), figures)


# ------------------------------------------------------------------------------------ absent packages
def block_absent(names: Sequence[str] = ABSENT) -> list[str]:
    """Make ``names`` unimportable in this process, as on the GPU machine: ``sys.modules[name] = None``
    makes ``import name`` raise ModuleNotFoundError and ``importlib.util.find_spec(name)`` return None,
    exactly what an absent package does (a finder that raises would break libraries that probe with
    ``find_spec``). Returns the names that were imported already (too late to block): a violation."""
    late = []
    for name in names:
        if sys.modules.get(name) is not None:
            late.append(name)
        else:
            sys.modules[name] = None  # type: ignore[assignment]
    return late


def blocked() -> list[str]:
    """The packages this run blocks (:data:`ABSENT_ENV`; empty outside a device check run)."""
    return [n for n in os.environ.get(ABSENT_ENV, "").split(",") if n]


def imported_absent() -> list[str]:
    """The blocked packages this process imported anyway (empty when the block held)."""
    return [n for n in blocked() if sys.modules.get(n) is not None]


def block_from_env() -> list[str]:
    """:func:`block_absent` for the packages :data:`ABSENT_ENV` names (nothing when it is unset)."""
    names = blocked()
    return block_absent(names) if names else []


# ---------------------------------------------------------------------------------------- processes
@contextlib.contextmanager
def environ(changes: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block (spawned processes inherit them), then restore them."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _guarded(fn: Callable[..., Any], args: tuple) -> Any:
    """Run ``fn(*args)`` in the spawned process, failing if a package absent on the GPU machine got
    imported (before or during the work)."""
    late = block_from_env()
    if late:
        raise RuntimeError(f"imported before the device check could block them: {late}")
    out = fn(*args)
    if imported_absent():
        raise RuntimeError(f"the check imported {imported_absent()}, which the GPU machine does not have")
    return out


def spawn(fn: Callable[..., Any], *args: Any, host: bool = False, timeout_s: float = 480.0) -> Any:
    """``fn(*args)`` in a fresh process that forms a torch.distributed world of 1 (NCCL on the GPU,
    gloo without one; ``mars_megatron.training.parallel.launch``), and its return value.

    ``host``: hide the GPU from that process (``CUDA_VISIBLE_DEVICES=""``), so it runs the CPU path with
    gloo: the fp32 reference of a GPU result. ``fn`` must be a module-level function (it is pickled by
    name) and return plain data (numbers, lists, numpy arrays: a tensor would come back as shared memory
    of a process that is gone, and an object that does not pickle is lost until the timeout)."""
    from mars_megatron.training import parallel

    changes = {"CUDA_VISIBLE_DEVICES": ""} if host else {}
    with environ(changes):
        (out,) = parallel.launch(_guarded, 1, fn, args, timeout_s=timeout_s)
    return out


# ------------------------------------------------------------------------------------------- models
def write_qwen3(out: Path, model_type: str, config: dict[str, Any], dtype: str, seed: int = 0) -> Path:
    """A random Qwen3 (``model_type`` ``qwen3`` or ``qwen3_moe``) HF checkpoint of any size at ``out``,
    weights seeded by ``seed`` and stored in ``dtype``, without a tokenizer. ``init_model`` builds the
    tiny presets with a trained tokenizer, which caps their vocabulary near 1100; the checks that only
    score tokens want Qwen3's own 152k."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mars_megatron.dtypes import torch_dtype

    cfg = AutoConfig.for_model(model_type, **config, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model = model.to(torch_dtype(dtype))
    model.config.dtype = dtype
    model.save_pretrained(out)
    return out


def shared_qwen3(ctx: Context, name: str, model_type: str, config: dict[str, Any], seed: int = 0) -> Path:
    """:func:`write_qwen3` in the check's dtype, written once per run and shared between checks (the
    models of checks 1 and 3 take a GPU loan's seconds to write): a folder beside the checks' own."""
    key = json.dumps([model_type, config, ctx.dtype_name, seed], sort_keys=True).encode()
    out = ctx.workdir.parent / "models" / f"{name}-{hashlib.sha256(key).hexdigest()[:12]}"
    if not out.is_dir():
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        write_qwen3(partial, model_type, config, ctx.dtype_name, seed=seed)
        partial.rename(out)
    return out


def rel(a: float, b: float) -> float:
    """|a − b| / |b| (the reference is ``b``); inf when only b is 0."""
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b != 0 else math.inf
