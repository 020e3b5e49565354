"""Waits with a deadline that says what they waited for.

A run spans processes that can hang without dying: a stopped process (``SIGSTOP``, a debugger), a wedged
library call, a collective whose peer is gone, a node whose link is down. Ray reports a dead actor, but a
hung one only by never answering, so a wait without a deadline turns any of these into a run that hangs
with no message. Every wait of the driver, the engine fleet and the trainer group goes through
:func:`get` (or takes a timeout of its own), and a wait that runs out raises :class:`DeadlineError`
naming the call, who held it and the setting that bounds it, so that the caller can replace what hung
or stop with that message.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeadlineError", "get"]


class DeadlineError(TimeoutError):
    """A call that did not answer within its deadline; the message names it."""


def get(refs: Any, what: str, timeout_s: float, setting: str = "") -> Any:
    """``ray.get(refs)`` within ``timeout_s`` seconds; past it :class:`DeadlineError` saying ``what`` was
    waited for and the ``setting`` that bounds it (when one does)."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        bound = f" ({setting})" if setting else ""
        raise DeadlineError(f"{what}: no answer within {timeout_s:g} s{bound}") from None
