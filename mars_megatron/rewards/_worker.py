"""Body of an AnswerChecker worker process (the only place math-verify is imported).

Protocol over the worker's end of a duplex pipe:

- worker → parent ``"ready"`` once math-verify is imported;
- parent → worker ``list[tuple[answer, reference]]`` (one chunk), worker → parent ``len(chunk)`` when done;
- parent → worker ``None``: exit.

Results and progress go through shared memory so that the parent can recover them from a worker it had to
kill: before item ``i`` the worker stores ``progress = [i, start time]``; after it, the item's status code
goes into ``codes[i]``; after the whole chunk ``progress[0] = len(chunk)``. Items ``< progress[0]`` are done.
"""

from __future__ import annotations

import os
import signal
import time
from itertools import product

# Status codes shared with the parent (checker.py).
WRONG, CORRECT, PARSE_ERROR, TIMEOUT = 0, 1, 2, 3

_GOLD_CACHE_SIZE = 4096


class _Grader:
    """math-verify parse + verify of one boxed answer against one reference, with the timeout inside."""

    def __init__(self, timeout_s: int):
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException

        self._parse, self._verify, self._timeout_error = parse, verify, TimeoutException
        self._timeout_s = timeout_s
        self._gold_cache: dict[str, list] = {}

    def _parse_gold(self, reference: str) -> list:
        gold = self._gold_cache.get(reference)
        if gold is None:
            gold = self._parse(reference, parsing_timeout=self._timeout_s, raise_on_error=True)
            if len(self._gold_cache) >= _GOLD_CACHE_SIZE:
                self._gold_cache.clear()
            self._gold_cache[reference] = gold
        return gold

    def grade(self, answer: str, reference: str) -> int:
        try:
            gold = self._parse_gold(reference)
            pred = self._parse(
                "\\boxed{" + answer + "}", parsing_timeout=self._timeout_s, raise_on_error=True
            )
        except self._timeout_error:
            return TIMEOUT
        except Exception:
            return PARSE_ERROR
        if not gold or not pred:
            return PARSE_ERROR
        # Same any-match semantics as ``verify(gold, pred)``, but a timeout is told apart from a mismatch.
        timed_out = False
        for g, t in product(gold, pred):
            try:
                if self._verify(g, t, timeout_seconds=self._timeout_s, raise_on_error=True):
                    return CORRECT
            except self._timeout_error:
                timed_out = True
            except Exception:
                pass
        return TIMEOUT if timed_out else WRONG


def worker_main(conn, progress, codes, timeout_s: int, parent_pid: int) -> None:
    """Entry point of a worker process; returns when told to, or when the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    grader = _Grader(timeout_s)
    conn.send("ready")
    while True:
        # Poll so that a worker whose parent was killed (no clean close) exits on its own.
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for i, (answer, reference) in enumerate(chunk):
            progress[1] = time.monotonic()
            progress[0] = i
            codes[i] = grader.grade(answer, reference)
        progress[0] = len(chunk)
        try:
            conn.send(len(chunk))
        except (BrokenPipeError, OSError):
            return
