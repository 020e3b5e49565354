"""Reward functions of the user's: what one receives (:class:`RewardRequest`), what it may return
(:class:`RewardResult`, or a number), and the processes it runs in (:class:`FunctionPool`).

A function named by a role's ``reward: {function: ...}`` (or ``algorithm.reward_functions``) is user code,
so it is run the way math-verify is (:mod:`.checker`): in a spawned process of its own, one output at a
time, with a hard per-output timeout enforced from outside — a function that hangs, even in C code, is
killed with its process and the process is replaced. Whatever goes wrong scores that output 0, is counted
by reason (``error``: it raised; ``timeout``; ``crashed``: its process died; ``nan``: a score that is not
finite; ``bad_type``: something else than a number or a RewardResult; ``load_error``: the function could
not be imported) and never stops the run.

Trust: the function runs with the rights of the user who runs ``mars`` (the same as their config). Its
name comes only from the config or the graph file, never from a checkpoint or a data file, and only plain
values cross back from its process (a float, a bool, a dict of floats, a reason): nothing the function
returns is unpickled in the trainer.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

REASONS = ("error", "timeout", "crashed", "nan", "bad_type", "load_error")
"""Why an output scored 0 without its function's say (counted in ``reward_fn/<role>/<reason>``)."""
START_TIMEOUT_S = 120.0
"""Longest wait for a function's process to start (spawn, import mars_megatron's leaf, import the
function's module)."""
MAX_DETAILS = 16
"""Most detail values a result may carry into the metrics."""


@dataclass(frozen=True)
class RewardRequest:
    """What a reward function receives for one output."""

    problem: str
    """The problem text."""
    reference: Any
    """The data row's reference answer (any JSON value; None when the data has no answer column)."""
    response: str
    """The role's output: its visible text (thinking included, as the model wrote it)."""
    role: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The data row's further columns (``data.fields.extra``), keyed by the path as written there."""
    judged_solution: str | None = None
    """For a role that takes an input (a Verifier, a Corrector): the solution it judged or revised."""
    judged_right: bool | None = None
    """Whether that solution's own reward was positive (None: no input)."""
    problem_id: str = ""
    sample_id: str = ""


@dataclass(frozen=True)
class RewardResult:
    """A reward function's answer beyond a bare number: ``verdict`` (a judging role's pass/fail, used
    instead of reading it from the text) and ``details`` (numbers averaged per role into the metrics as
    ``reward_fn/<role>/<key>``)."""

    score: float
    verdict: bool | None = None
    details: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """One output's scoring as it comes back from the function's process: plain values only."""

    score: float
    verdict: bool | None = None
    details: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    """None: the function answered; else why the output scored 0 (:data:`REASONS`)."""
    message: str = ""


def load_function(target: str) -> Any:
    """The callable ``target`` names (``package.module:name`` or ``/path/file.py:name``). Raises with the
    reason (ImportError, AttributeError, TypeError) — in the function's process, or in the pre-flight."""
    import importlib
    import importlib.util
    import inspect

    module_name, _, name = target.rpartition(":")
    if module_name.endswith(".py"):
        stem = "".join(c if c.isalnum() else "_" for c in module_name.rsplit("/", 1)[-1][:-3])
        spec = importlib.util.spec_from_file_location(f"mars_reward_{stem}", module_name)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {module_name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise AttributeError(f"{module_name} has no attribute {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise TypeError(f"{name} must take one argument (the RewardRequest)") from None
    except ValueError:  # a builtin without a signature: it is called and judged then
        pass
    return fn


def outcome_of(value: Any) -> Outcome:
    """What the function returned, as plain values; ``bad_type``/``nan`` when it cannot be a reward."""
    verdict, details = None, {}
    if isinstance(value, RewardResult):
        score, verdict, details = value.score, value.verdict, value.details
        if verdict is not None and not isinstance(verdict, bool):
            return Outcome(
                0.0, reason="bad_type", message=f"verdict is a {type(verdict).__name__}, not a bool"
            )
        if not isinstance(details, Mapping) or len(details) > MAX_DETAILS:
            return Outcome(
                0.0, reason="bad_type", message=f"details must be a mapping of at most {MAX_DETAILS}"
            )
        clean = {}
        for key, v in details.items():
            if (
                not isinstance(key, str)
                or isinstance(v, bool)
                or not isinstance(v, Real)
                or not math.isfinite(v)
            ):
                return Outcome(
                    0.0, reason="bad_type", message=f"detail {str(key)[:40]!r} is not a finite number"
                )
            clean[key[:64]] = float(v)
        details = clean
    else:
        score = value
    if isinstance(score, bool):
        score = float(score)
    if not isinstance(score, Real):
        return Outcome(0.0, reason="bad_type", message=f"returned a {type(score).__name__}, not a number")
    score = float(score)
    if not math.isfinite(score):
        return Outcome(0.0, reason="nan", message=f"returned {score}")
    return Outcome(score, verdict, details)


def worker_main(conn: Any, target: str, parent_pid: int) -> None:
    """Body of a reward function's process. Over its end of a duplex pipe: → ``("ready", "")`` once the
    function is imported (or ``("load_error", why)``, then exit); then ← one RewardRequest, → one
    :class:`Outcome` (plain values), and so on; ← ``None``: exit. The parent enforces the time limit by
    killing this process; a worker whose parent is gone exits within a second."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        fn = load_function(target)
    except BaseException as e:  # whatever the user's module does while importing
        conn.send(("load_error", f"{type(e).__name__}: {e}"[:500]))
        return
    conn.send(("ready", ""))
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        try:
            outcome = outcome_of(fn(request))
        except BaseException as e:  # SystemExit and KeyboardInterrupt of user code too
            outcome = Outcome(0.0, reason="error", message=f"{type(e).__name__}: {e}"[:500])
        try:
            conn.send(outcome)
        except (BrokenPipeError, OSError):
            return


class _Process:
    """Parent side of one function process."""

    def __init__(self, ctx: Any, target: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=worker_main, args=(child, target, os.getpid()), daemon=True,
            name="reward-function",
        )  # fmt: skip
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.load_error = ""

    def wait_ready(self) -> None:
        if self.ready or self.load_error:
            return
        if not self.conn.poll(START_TIMEOUT_S):
            self.load_error = f"its process did not start in {START_TIMEOUT_S:g} s"
            self.kill()
            return
        try:
            kind, message = self.conn.recv()
        except (EOFError, OSError):
            kind, message = (
                "load_error",
                f"its process exited while starting (exit code {self.process.exitcode})",
            )
        self.ready = kind == "ready"
        self.load_error = "" if self.ready else message

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class FunctionPool:
    """One reward function's process (started on first use), fed one request at a time; a request past
    ``timeout_s`` kills and replaces the process. ``counts``: outputs scored 0 by reason since start."""

    def __init__(self, target: str, timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._held: list[_Process] = []
        """The live process (at most one), in a list the finalizer shares without holding the pool."""
        self._warned: set[str] = set()
        self._finalizer = weakref.finalize(self, _close, self._held)

    def score(self, requests: Sequence[RewardRequest]) -> list[Outcome]:
        with self._lock:
            return [self._one(r) for r in requests]

    def _one(self, request: RewardRequest) -> Outcome:
        if not self._held:
            self._held.append(_Process(self._ctx, self.target))
        proc = self._held[0]
        proc.wait_ready()
        if proc.load_error:  # the same answer for every output until the run is fixed: no retry storm
            return self._failed(Outcome(0.0, reason="load_error", message=proc.load_error))
        try:
            proc.conn.send(request)
        except (OSError, ValueError):
            return self._replace(Outcome(0.0, reason="crashed", message="its process was gone"))
        if not proc.conn.poll(self.timeout_s):
            return self._replace(Outcome(0.0, reason="timeout", message=f"no answer in {self.timeout_s:g} s"))
        try:
            outcome: Outcome = proc.conn.recv()
        except (EOFError, OSError):
            return self._replace(
                Outcome(
                    0.0, reason="crashed", message=f"its process died (exit code {proc.process.exitcode})"
                )
            )
        return self._failed(outcome) if outcome.reason else outcome

    def _replace(self, outcome: Outcome) -> Outcome:
        for proc in self._held:
            proc.kill()
        self._held.clear()
        return self._failed(outcome)

    def _failed(self, outcome: Outcome) -> Outcome:
        assert outcome.reason is not None
        self.counts[outcome.reason] += 1
        if outcome.reason not in self._warned:  # once per reason: a broken function must not flood the log
            self._warned.add(outcome.reason)
            print(
                f"reward function {self.target}: {outcome.reason}: {outcome.message} (the output scores 0; "
                "counted in reward_fn/<role>/" + outcome.reason + ")",
                file=sys.stderr,
                flush=True,
            )
        return outcome

    def close(self) -> None:
        self._finalizer()


def _close(held: list[_Process]) -> None:
    for proc in held:
        try:
            proc.conn.send(None)
        except (OSError, ValueError):
            pass
        proc.process.join(timeout=2.0)
        proc.kill()
    held.clear()


class FunctionPools:
    """The pools of every function a reward worker has been asked to run, by target and time limit."""

    def __init__(self) -> None:
        self.pools: dict[tuple[str, float], FunctionPool] = {}

    def get(self, target: str, timeout_s: float) -> FunctionPool:
        pool = self.pools.get((target, timeout_s))
        if pool is None:
            pool = self.pools[(target, timeout_s)] = FunctionPool(target, timeout_s)
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def check_function(target: str, timeout_s: float = 60.0) -> str | None:
    """Import ``target`` in a fresh Python process, as a reward worker will: None when it loads, else the
    error (its last line). A separate process, so that a module that hangs or exits while importing cannot
    take the caller with it, and its import-time side effects stay out of the driver."""
    code = "import sys; from mars_megatron.rewards.functions import load_function; load_function(sys.argv[1])"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, target], capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"importing it took more than {timeout_s:g} s"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit code {done.returncode}")[:500]


def check_graph_functions(graph: Any) -> None:
    """Every reward function ``graph``'s roles name, imported as a worker will (:func:`check_function`):
    a ValueError naming where it was declared, the function and why, before anything starts."""
    checked: dict[str, str | None] = {}  # one import per function, however many roles it judges
    for role in graph.roles.values():
        spec = role.function
        if role.reward != "function" or spec is None:
            continue
        if spec.target not in checked:
            checked[spec.target] = check_function(spec.target)
        error = checked[spec.target]
        if error is not None:
            raise ValueError(
                f"{spec.source}: reward function {spec.target} of role {role.name!r} cannot be loaded: "
                f"{error}"
            )
