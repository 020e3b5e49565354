"""How :func:`~mars_megatron.training.parallel.launch` starts its rank processes: forked from a server that
has already imported torch and Megatron-Core, or each in a fresh interpreter (``spawn``).

Why: a fresh interpreter spends about 5 CPU-seconds importing torch and Megatron-Core before it runs
anything (measured: a 2-rank launch of a function that only imports ``megatron.core.models.gpt`` took
8.6 s on 2 cores), and `mars` and the test suite launch ranks many times per process. Python's
``forkserver`` start method imports :data:`PRELOAD` once, in a server it spawns on first use, and forks each
rank from it: the same launch then takes 0.1 s. Forking is safe there, where forking the caller is not
(``fork`` after torch ran an op can hang in OpenMP): the server only imports, it runs no op and starts no
thread.

What a rank sees is what a spawned rank would see: multiprocessing itself gives it the caller's current
``sys.path``, working directory and main module; :class:`Inherited` carries the caller's current
environment and standard output and error (the server's are those of the moment it started). What a forked
rank cannot take from the caller is what libraries read *while they load*: the numerics variables of
:mod:`mars_megatron.runtime_env`, and any other the preloaded libraries may read then. So a server serves
only while the caller's environment equals the one it started with (but for :data:`CALL_TIME_ENV`); after a
change it is stopped and a new one started, which costs what spawning the ranks would have.

On a machine with CUDA the ranks are spawned: a CUDA query made while Megatron-Core loads would leave every
forked child unable to use the device, and GPU ranks are few and long-lived, so the start-up saved is small.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Mapping
from multiprocessing import forkserver, reduction
from multiprocessing.context import BaseContext
from typing import Any

import torch

PRELOAD = (
    "mars_megatron.jobs",
    "mars_megatron.training.megatron_engine",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
)
"""What the fork server imports: what the ranks of `mars sft`, conversion and training import anyway."""

CALL_TIME_ENV = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables that may differ from the server's start environment without retiring it: pytest sets this one
for every test, and no library reads it while loading."""

START_METHODS = ("forkserver", "spawn")

_server_env: dict[str, str] | None = None
"""The environment the fork server of this process started with (None: not started by us)."""


def _comparable(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in CALL_TIME_ENV}


def choose(requested: str | None = None) -> str:
    """The start method for the next launch: ``requested`` when given, else ``forkserver`` where it is
    available and no CUDA device is visible, else ``spawn``."""
    if requested is not None:
        if requested not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {requested!r}")
        return requested
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return "spawn"
    if _server_env is not None and _comparable(os.environ) != _server_env and not _restartable():
        return "spawn"
    return "forkserver"


def _restartable() -> bool:
    return callable(getattr(forkserver._forkserver, "_stop", None))


def context(method: str) -> BaseContext:
    """The multiprocessing context for ``method``. For ``forkserver``: a server whose environment is this
    process's (a server started with another is stopped first; the new one starts with the first rank
    started through the context)."""
    global _server_env
    ctx = mp.get_context(method)
    if method != "forkserver":
        return ctx
    env = _comparable(os.environ)
    if _server_env is not None and env != _server_env:
        if not _restartable():
            raise RuntimeError(
                "start_method='forkserver': the environment changed since this process's fork server "
                "started, and this Python cannot stop it; use start_method='spawn'"
            )
        forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private; CPython 3.11-3.13 have it
        _server_env = None
    if _server_env is None:
        ctx.set_forkserver_preload(list(PRELOAD))
        _server_env = env
    return ctx


class _Fd:
    """One of the caller's file descriptors, handed to the rank at start (``reduction.DupFd``: passed over
    the fork server's socket, or kept open across spawn)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


class Inherited:
    """What a rank takes from its caller at launch: the environment and standard output and error."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.stdout: Any = _Fd(1)
        self.stderr: Any = _Fd(2)

    def apply(self) -> None:
        """In the rank, first thing: the caller's environment and output streams replace the server's."""
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        for fd, target in ((self.stdout, 1), (self.stderr, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
