"""megatron-core's fused functions compiled when first called, not when megatron-core is imported.

Why: megatron-core decorates its fusions (bias-GeLU, bias-SwiGLU, bias-dropout-add, … about a dozen
functions) with ``torch.compile`` as its modules load (``megatron.core.jit.jit_fuser``). The decoration alone
imports ``torch._dynamo`` and ``torch._inductor``: measured, ``import megatron.core.models.gpt`` took
5.7 s with them and 2.4 s without (2 cores, loaded). Every process that imports megatron-core pays it:
each trainer rank, each conversion, each `mars` command that builds a model, and each of the test suite's
subprocesses. Yet ``torch.compile`` compiles nothing at decoration: it compiles on the first call, and on a
CPU run (bias-activation fusion off) these functions are never called.

So while the ``megatron.core`` package itself loads, and only then, ``torch.compile`` applied to a plain
function returns a wrapper that makes the same ``torch.compile`` call on its first call and calls the
compiled function from then on. A GPU run compiles the same functions with the same arguments, at the same
moment (their first call); an ``nn.Module`` or a call outside that import goes to ``torch.compile``
unchanged. :func:`install` (called by ``mars_megatron/__init__``) adds a one-shot import hook and imports
nothing itself; a process that imported megatron-core before ``mars_megatron`` keeps megatron's own
decoration.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib.machinery
    from collections.abc import Sequence
    from types import ModuleType

TARGET = "megatron.core"
"""The package during whose import ``torch.compile`` is deferred (its ``jit`` module keeps the deferred
decorator as ``jit_fuser``, so megatron modules loaded later defer too)."""


def deferred(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``compile_fn`` (``torch.compile``) made lazy for plain functions: same signature, same arguments."""
    import torch

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # decorator with arguments: @torch.compile(dynamic=True)
            return lambda fn: compile_later(fn, **kwargs)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return compile_fn(model, **kwargs)
        compiled: Callable[..., Any] | None = None
        lock = threading.Lock()

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                with lock:
                    if compiled is None:
                        compiled = compile_fn(model, **kwargs)
            return compiled(*args, **kw)

        call.__mars_deferred_compile__ = True  # type: ignore[attr-defined]
        return call

    return compile_later


class _Loader:
    """The package's own loader, with ``torch.compile`` deferred while its ``__init__`` runs. (Duck-typed,
    as the import system allows: ``importlib.abc`` would cost every `mars` process 20 ms to import.)"""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        real = torch.compile
        torch.compile = deferred(real)  # type: ignore[assignment]
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, … for inspect and tracebacks
        return getattr(self._loader, name)


class _Finder:
    """One-shot: wraps the loader of :data:`TARGET`, then leaves ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        import importlib.util  # only now: megatron-core is being imported

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # what the import system finds without this hook
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)  # type: ignore[assignment]
        return spec


def install() -> None:
    """Defer megatron-core's ``torch.compile`` decorations, unless megatron-core is already loaded."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
