"""Ending a replaced worker's process for sure.

``ray.kill`` asks the actor's own process to exit. A process that is stopped (``SIGSTOP``, a debugger) or
wedged in native code never does, and lives on after the run has replaced it, holding its memory (a GPU's,
for an engine or a trainer rank): measured, an engine stopped with ``SIGSTOP`` and killed with
``ray.kill`` by the driver was still there, stopped, two steps later. So a worker's node and pid are asked
when it starts (:func:`whereabouts`, called in the worker), and a worker that is given up on is sent
``SIGKILL`` on its own node by a zero-CPU Ray task pinned there (:func:`reap`): the driver of a multi-node
run cannot signal another node's processes itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

__all__ = ["WorkerProcess", "reap", "whereabouts"]


@dataclass(frozen=True)
class WorkerProcess:
    """Where a worker's process runs: its Ray node (id and address), its pid and the title Ray gave it
    (``ray::<class>``), checked before the kill so that a pid reused by another process is never
    signalled."""

    node_id: str
    address: str
    pid: int
    title: str


def whereabouts(title: str) -> WorkerProcess:
    """This process, as a worker whose Ray title starts with ``title`` (call it inside the actor)."""
    import ray

    return WorkerProcess(
        ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid(), title
    )


def _sigkill(pid: int, title: str) -> bool:
    """``SIGKILL`` to ``pid`` if it is still the worker (its title starts with ``title``); whether sent."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(title.encode()):
                return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (FileNotFoundError, ProcessLookupError):
        return False


def reap(process: WorkerProcess | None, timeout_s: float = 60.0) -> None:
    """Make sure ``process`` is gone (after ``ray.kill`` of its actor): ``SIGKILL`` on its node. A node
    Ray counts as dead, or one that does not answer within ``timeout_s``, is left (its processes went
    with it, or Ray's own node failure handling ends them)."""
    if process is None:
        return
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not any(node["NodeID"] == process.node_id and node["Alive"] for node in ray.nodes()):
        return  # the node is gone, and its processes with it: a task pinned there would never run

    task = ray.remote(_sigkill).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(process.node_id, soft=False)
    )
    with contextlib.suppress(Exception):
        ray.get(task.remote(process.pid, process.title), timeout=timeout_s)
