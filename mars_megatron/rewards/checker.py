"""AnswerChecker: math-verify answer checks in a pool of worker processes, with a hard per-check timeout.

A reference that names a task's rule (``subset_sum: 1 3 4 6 8 = 13``, :mod:`.programs`) is checked by that
rule in this process instead: many answers can be right, and the rule is a few integer operations.

math-verify bounds its own work with ``signal.alarm``, which only works on a process's main thread (the
trainer and Ray actors have other threads), and a check stuck in C code ignores the alarm anyway. So the
checks run in spawned worker processes: each worker applies math-verify's timeout itself
(``worker_timeout_s``), and the parent kills and replaces a worker whose current check has run ``timeout_s``.
That check scores 0 with status ``"timeout"``; the rest of its chunk goes on in the replacement.

Work goes to the workers in chunks (one pipe message each way per chunk). Per-item progress and status codes
live in shared memory, so the parent knows which item of a chunk hung and keeps the results before it.

    with AnswerChecker() as checker:
        results = checker.check_many([(response, reference), ...])
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Literal

from mars_megatron.rewards import _worker
from mars_megatron.rewards.answers import extract_boxed, normalize_reference
from mars_megatron.rewards.programs import program_of

Status = Literal["ok", "no_answer", "parse_error", "timeout"]


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check. ``correct`` is only ever True with status ``"ok"``."""

    correct: bool
    status: Status


_RESULT_OF_CODE = {
    _worker.WRONG: CheckResult(False, "ok"),
    _worker.CORRECT: CheckResult(True, "ok"),
    _worker.PARSE_ERROR: CheckResult(False, "parse_error"),
    _worker.TIMEOUT: CheckResult(False, "timeout"),
}
NO_ANSWER = CheckResult(False, "no_answer")
_PROGRAM_RESULT = {
    True: CheckResult(True, "ok"),
    False: CheckResult(False, "ok"),
    None: _RESULT_OF_CODE[_worker.PARSE_ERROR],
}
"""A programmatic check's judgement (:mod:`.programs`): an unreadable answer is a parse error, as a boxed
answer that math-verify cannot parse is."""


@dataclass(frozen=True)
class CheckerConfig:
    num_workers: int | None = None
    """Worker processes; None: one per CPU this process may run on."""
    timeout_s: float = 5.0
    """Hard limit per check, enforced by the parent: a worker still on one check after this long is killed."""
    worker_timeout_s: int | None = None
    """math-verify's own timeout inside the worker (whole seconds, per parse/verify call); None:
    ``max(1, ceil(timeout_s) - 1)``, so that math-verify usually gives up before the worker must be killed."""
    chunk_size: int = 64
    """Most checks sent to a worker in one message."""
    start_timeout_s: float = 120.0
    """Longest wait for a worker to start (spawn + importing math-verify) before check_many raises."""

    def __post_init__(self):
        if self.num_workers is not None and self.num_workers < 1:
            raise ValueError(f"CheckerConfig.num_workers must be >= 1, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"CheckerConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.worker_timeout_s is not None and self.worker_timeout_s < 1:
            raise ValueError(f"CheckerConfig.worker_timeout_s must be >= 1, got {self.worker_timeout_s}")
        if not 1 <= self.chunk_size <= 127 * 1024:
            raise ValueError(f"CheckerConfig.chunk_size must be in [1, 130048], got {self.chunk_size}")


@dataclass
class CheckerCounters:
    checks: int = 0
    """Checks answered (all statuses)."""
    timeouts: int = 0
    """Checks with status "timeout" (math-verify's timeout in the worker, or the worker killed)."""
    errors: int = 0
    """Checks with status "parse_error" (math-verify could not parse, or a worker crashed on the check)."""
    workers_replaced: int = 0
    """Workers killed (hung) or found dead, and started again."""


class _WorkerHandle:
    """Parent side of one worker process: its pipe, shared progress/codes and the chunk it is working on."""

    def __init__(self, ctx, chunk_size: int, worker_timeout_s: int):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.progress = ctx.RawArray("d", 2)  # [index of the current item, its start time (monotonic)]
        self.codes = ctx.RawArray("b", chunk_size)
        self.process = ctx.Process(
            target=_worker.worker_main,
            args=(child_conn, self.progress, self.codes, worker_timeout_s, os.getpid()),
            daemon=True,
            name="answer-checker",
        )
        self.process.start()
        child_conn.close()
        self.started_at = time.monotonic()
        self.ready = False
        self.job: list[tuple[int, tuple[str, str]]] | None = None  # (index into the batch, (answer, ref))

    def submit(self, job: list[tuple[int, tuple[str, str]]]) -> None:
        self.progress[0], self.progress[1] = 0.0, time.monotonic()  # the worker is idle: safe to write
        self.job = job
        self.conn.send([item for _, item in job])

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


def _shutdown(workers: list[_WorkerHandle]) -> None:
    for worker in workers:
        try:
            worker.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        worker.kill()
    workers.clear()


class AnswerChecker:
    """Checks boxed final answers against references with math-verify, in worker processes.

    Not thread-safe across concurrent ``check_many`` calls (they are serialised by a lock). Close it (or use
    it as a context manager); workers also exit on their own within about a second of the parent dying.
    """

    def __init__(self, config: CheckerConfig | None = None):
        self.config = config or CheckerConfig()
        self.counters = CheckerCounters()
        self._worker_timeout_s = self.config.worker_timeout_s or max(1, math.ceil(self.config.timeout_s) - 1)
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        num_workers = self.config.num_workers or len(os.sched_getaffinity(0))
        self._workers = [self._new_worker() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def _new_worker(self) -> _WorkerHandle:
        return _WorkerHandle(self._ctx, self.config.chunk_size, self._worker_timeout_s)

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> AnswerChecker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check(self, response: str, reference: str | int | float) -> CheckResult:
        return self.check_many([(response, reference)])[0]

    def check_many(self, pairs: list[tuple[str, str | int | float]]) -> list[CheckResult]:
        """Check each (response, reference); results in input order. Returns within about ``timeout_s``
        after the slowest check's start, whatever the inputs."""
        if not self._finalizer.alive:
            raise RuntimeError("AnswerChecker is closed")
        results: list[CheckResult | None] = [None] * len(pairs)
        todo = []
        for index, (response, reference) in enumerate(pairs):
            answer = extract_boxed(response)
            program = program_of(reference)
            if answer is None:
                results[index] = NO_ANSWER
            elif program is not None:  # a task's rule decides, here (no math-verify)
                results[index] = _PROGRAM_RESULT[program.check(answer, str(reference))]
            else:
                todo.append((index, (answer, normalize_reference(reference))))
        # Several chunks per worker, so that the workers finish close together.
        size = max(1, min(self.config.chunk_size, math.ceil(len(todo) / (4 * len(self._workers)))))
        pending = deque(todo[start : start + size] for start in range(0, len(todo), size))
        with self._lock:
            self._run(pending, results)
        self._count(results)
        return results  # type: ignore[return-value]

    def _count(self, results: list[CheckResult | None]) -> None:
        self.counters.checks += len(results)
        self.counters.timeouts += sum(r.status == "timeout" for r in results)  # type: ignore[union-attr]
        self.counters.errors += sum(r.status == "parse_error" for r in results)  # type: ignore[union-attr]

    def _run(self, pending: deque, results: list) -> None:
        while pending or any(w.job is not None for w in self._workers):
            for worker in list(self._workers):
                if worker.ready and worker.job is None and pending:
                    if worker.process.is_alive():
                        worker.submit(pending.popleft())
                    else:  # died while idle
                        self._replace(worker, pending, results, blamed=NO_ANSWER)
            waiting = [w for w in self._workers if w.job is not None or (not w.ready and pending)]
            ready = wait(
                [w.conn for w in waiting] + [w.process.sentinel for w in waiting],
                timeout=self._time_to_next_deadline(waiting),
            )
            for worker in list(waiting):
                if worker.conn in ready or worker.process.sentinel in ready:
                    self._receive(worker, pending, results)
            for worker in list(self._workers):
                self._enforce_deadline(worker, pending, results)

    def _time_to_next_deadline(self, waiting: list[_WorkerHandle]) -> float:
        now = time.monotonic()
        deadlines = [
            w.progress[1] + self.config.timeout_s
            if w.job is not None
            else w.started_at + self.config.start_timeout_s
            for w in waiting
        ]
        return max(0.0, min(deadlines, default=now) - now) + 0.005

    def _receive(self, worker: _WorkerHandle, pending: deque, results: list) -> None:
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = None
        if message == "ready":
            worker.ready = True
        elif isinstance(message, int) and worker.job is not None:
            for position, (index, _) in enumerate(worker.job):
                results[index] = _RESULT_OF_CODE[worker.codes[position]]
            worker.job = None
        elif not worker.process.is_alive():
            if not worker.ready:
                raise RuntimeError(
                    f"answer-checker worker exited while starting (exit code {worker.process.exitcode})"
                )
            self._replace(worker, pending, results, blamed=_RESULT_OF_CODE[_worker.PARSE_ERROR])

    def _enforce_deadline(self, worker: _WorkerHandle, pending: deque, results: list) -> None:
        now = time.monotonic()
        if worker.job is None:
            if not worker.ready and now - worker.started_at > self.config.start_timeout_s:
                raise RuntimeError(f"answer-checker worker did not start in {self.config.start_timeout_s} s")
            return
        if int(worker.progress[0]) < len(worker.job) and now - worker.progress[1] > self.config.timeout_s:
            self._replace(worker, pending, results, blamed=_RESULT_OF_CODE[_worker.TIMEOUT])

    def _replace(self, worker: _WorkerHandle, pending: deque, results: list, blamed: CheckResult) -> None:
        """Kill ``worker``; keep its finished results, blame its current item, requeue the rest."""
        worker.kill()
        job = worker.job or []
        done = min(int(worker.progress[0]), len(job))
        for position in range(done):
            results[job[position][0]] = _RESULT_OF_CODE[worker.codes[position]]
        if done < len(job):
            results[job[done][0]] = blamed
            if job[done + 1 :]:
                pending.appendleft(job[done + 1 :])
        self._workers[self._workers.index(worker)] = self._new_worker()
        self.counters.workers_replaced += 1
