"""Run megatron-core on a machine without CUDA.

megatron-core (0.16 – 0.19) assumes a CUDA device in a few dozen places: tensor factories with
``device="cuda"`` or ``device=torch.cuda.current_device()``, CUDA streams around gradient buckets and the
MoE all-to-all, ``torch.cuda.synchronize()``, and dtype checks against ``'torch.cuda.FloatTensor'``.
None of that is needed for correctness on CPU, so rather than forking megatron we redirect those calls
to the CPU while this process has no GPU. The alternative, a global ``TorchFunctionMode``, was measured at
30–50 % per step; patching only the entry points megatron uses costs a dict lookup per factory call.

Tensor factories are redirected only inside megatron's modules (their ``torch`` global becomes a proxy,
see :class:`_TorchForMegatron`), because replacing ``torch.tensor`` itself breaks other libraries in the
same process (transformers). Streams, events, ``synchronize`` and the ``Tensor`` methods are patched on
torch, where a CPU-only process cannot use them anyway.

The layer is process-wide and deliberately one-way: it is installed once, before megatron builds a
model, and only when ``torch.cuda.is_available()`` is False. On a GPU machine ``install()`` does
nothing except the version fixes listed in ``_patch_megatron_bugs``, which apply everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_INSTALLED = False
_LOCK = threading.Lock()

_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
)

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def is_active() -> bool:
    """True once the CPU redirection is installed in this process."""
    return _INSTALLED


def to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, ``0``, ``torch.device("cuda")``) to the CPU.

    Integers count as CUDA ordinals because that is what ``torch.cuda.current_device()`` returns and
    megatron passes it straight to ``device=``. Anything else is returned unchanged.
    """
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU ops are already ordered, so every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``; timing falls back to wall clock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._t = 0.0

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _CpuEvent) -> float:
        return (end._t - self._t) * 1000.0


_DEFAULT_STREAM = _CpuStream()


def _wrap_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = to_cpu_device(device)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    factory.__mars_cpu_compat__ = True  # type: ignore[attr-defined]
    return factory


def _patch_tensor_methods() -> None:
    orig_to = torch.Tensor.to
    orig_type = torch.Tensor.type

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            args = tuple(
                to_cpu_device(a) if not isinstance(a, torch.dtype | torch.Tensor) else a for a in args
            )
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        return orig_to(self, *args, **kwargs)

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # megatron's optimizers accept parameters only if ``param.type()`` names a CUDA type.
        if not args and not kwargs:
            return _CUDA_TYPE_NAMES.get(self.dtype, orig_type(self))
        return orig_type(self, *args, **kwargs)

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        return None

    torch.Tensor.to = to  # type: ignore[method-assign]
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    torch.Tensor.type = tensor_type  # type: ignore[method-assign,assignment]
    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0  # type: ignore[assignment]
    cuda.set_device = lambda device: None  # type: ignore[assignment]
    cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]
    cuda.Stream = _CpuStream  # type: ignore[assignment,misc]
    cuda.Event = _CpuEvent  # type: ignore[assignment,misc]
    cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    cuda.default_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.memory_allocated = lambda device=None: 0  # type: ignore[assignment]
    cuda.max_memory_allocated = lambda device=None: 0  # type: ignore[assignment]


def _patch_megatron_for_cpu() -> None:
    """CPU-only fixes inside megatron modules that copied names at import time."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # On CUDA this helper turns split sizes into numpy for all_to_all; on CPU it leaves tensors,
        # which gloo's all_to_all_single rejects as split sizes.
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and as_numpy:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=False)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_megatron_bugs() -> None:
    """Version fixes that apply with or without a GPU.

    megatron-core 0.16.1 references ``te_general_gemm`` in the MoE router even when Transformer Engine
    failed to import (its ``try`` block never defines the name), so a MoE model without TE raises
    ``NameError``. Defining it as ``None`` selects the torch fallback that the code already has.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _TorchForMegatron(types.ModuleType):
    """What megatron's modules see as ``torch``: the real module, except that tensor factories map CUDA
    devices to the CPU. Patching the factories on ``torch`` itself would reach every library in the
    process: any Python-level ``torch.tensor`` breaks transformers' meta-device initialisation (measured:
    its rotary ``inv_freq`` buffer comes out zero or garbage), so a transformers rollout engine living
    beside a megatron trainer would compute a different model."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _wrap_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_PROXY: _TorchForMegatron | None = None


_NEVER_IMPORTED = ("megatron.core.inference.text_generation_server",)
"""megatron-core packages this project never runs, left out of the eager import: Megatron's own Flask text
server (mars serves through rollout/openai_server.py) logs "Could not import flask" when imported without
Flask, which every CPU rank printed on start."""


def _megatron_modules_using_cuda_factories() -> list[str]:
    """megatron-core modules whose source creates tensors on a CUDA device (imported and patched eagerly,
    so a module first imported later, e.g. a checkpoint strategy, is covered too); the packages of
    :data:`_NEVER_IMPORTED` are left out."""
    import megatron.core

    root = Path(megatron.core.__file__).parent
    needles = ('device="cuda"', "device='cuda'", "current_device()", ".cuda()")
    names = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="ignore")
        if any(n in text for n in needles):
            rel = path.relative_to(root.parent.parent).with_suffix("")
            name = ".".join(rel.parts).removesuffix(".__init__")
            if not name.startswith(_NEVER_IMPORTED):
                names.append(name)
    return names


def _redirect_megatron_factories() -> int:
    """Point the ``torch`` global of every loaded megatron module at the proxy; returns how many."""
    global _PROXY
    if _PROXY is None:
        _PROXY = _TorchForMegatron()
    for name in _megatron_modules_using_cuda_factories():
        try:
            importlib.import_module(name)
        except Exception:  # optional pieces (TE, triton, …) that cannot import here are never used
            continue
    patched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "torch", None) is torch:
            module.torch = _PROXY  # type: ignore[attr-defined]
            patched += 1
    return patched


def install() -> bool:
    """Install the redirection if this process has no CUDA device. Returns True if it is active.

    Idempotent and thread-safe; call it before building megatron models (``mars_megatron.training``
    entry points do). The global ``torch`` factories are left untouched (see :class:`_TorchForMegatron`).
    """
    global _INSTALLED
    with _LOCK:
        _patch_megatron_bugs()
        if _INSTALLED:
            return True
        if torch.cuda.is_available():
            return False
        _patch_tensor_methods()
        _patch_torch_cuda()
        _patch_megatron_for_cpu()
        _redirect_megatron_factories()
        _INSTALLED = True
        return True


def enable_recompute() -> None:
    """Activation recomputation (``train.recompute``) on CPU: megatron saves and restores the CUDA RNG
    state around each checkpointed chunk so dropout repeats; here the CPU generator, saved beside it, is
    the only one. Installed only for runs that recompute: measured, redirecting these two functions for
    every run made `mars sft` differ between two runs of the same seed from step ~70 on."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
