"""A node lost under a run: which node, what the run had on it, and whether the nodes left can hold it.

Ray decides that a node is dead when its raylet misses health checks. With Ray 2.60's defaults (a check
every 3 s, 10 s each, 5 missed) that takes about 15 s when the node's processes died with its link up (every
check is refused at once) and about 65 s when its link is down (every check times out); the
``RAY_health_check_period_ms``, ``…_timeout_ms`` and ``…_failure_threshold`` variables of the Ray head's
environment change it (``mars launch --env``). The run's actors on that node die with it, and their calls
fail; a link cut for less than that time is no loss: the calls wait, and go on when it is back.

The run replaces what it lost (a trainer group is rebuilt, an engine or a reward worker restarted), but
a replacement that the nodes left cannot hold would wait for resources that never come: Ray queues an
actor, or a placement group, without a deadline. So before it replaces anything, the run asks
:func:`check`: with a node of its lost, do the nodes left have room for everything on the lost nodes and
for what is being replaced, beside what stays where it is? If not, the run stops at once with
:class:`NodeLost`, naming each lost node, what it held and what is missing, and ``mars launch --resume``
(or Slurm's requeue) continues the run from its last checkpoint on nodes that are there. If they have
room, the run goes on without the node (on a cluster with spares).

The room is judged by first-fit decreasing over the nodes' total resources (Ray's own bookkeeping of what
is free lags a death): a fit it finds is real; one it misses (rare with the few sizes a run's actors have)
stops a run that could have gone on, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mars_megatron.reaper import WorkerProcess

__all__ = [
    "ClusterNode",
    "Holding",
    "NodeLost",
    "NodeWatch",
    "check",
    "cluster_nodes",
    "first_fit",
    "lost_nodes",
]

RESOURCES = ("CPU", "GPU")
"""The resources a run's actors ask Ray for (custom ones, as the launcher's ``mars_node``, are not asked
for)."""


@dataclass(frozen=True)
class ClusterNode:
    """A Ray node as :func:`cluster_nodes` reads it: its id, address, host name, whether Ray counts it
    alive, and its total resources."""

    node_id: str
    address: str
    hostname: str
    alive: bool
    resources: Mapping[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``host (address)``, or the address alone when the host name is the address."""
        return self.address if self.hostname in ("", self.address) else f"{self.hostname} ({self.address})"


@dataclass(frozen=True)
class Holding:
    """Something of the run's that holds resources on a node: its ``kind`` (``rank``, ``engine`` or
    ``reward``) and index, ``what`` it is in words (``trainer rank 1``, ``rollout engine 0 (solver)``),
    its process (None: not known, it never answered) and the resources it asked Ray for."""

    kind: str
    index: int
    what: str
    process: WorkerProcess | None
    resources: Mapping[str, float]


class NodeLost(RuntimeError):
    """Nodes the run had actors on are dead, and the nodes left cannot hold what they held: the run stops
    (``mars launch --resume`` continues it from its last checkpoint)."""

    def __init__(self, message: str, nodes: Sequence[ClusterNode]) -> None:
        super().__init__(message)
        self.nodes = list(nodes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.nodes))


def cluster_nodes() -> list[ClusterNode]:
    """The Ray cluster's nodes, dead ones included (as long as Ray remembers them)."""
    import ray

    return [
        ClusterNode(
            str(n["NodeID"]),
            n.get("NodeManagerAddress", ""),
            n.get("NodeManagerHostname", ""),
            bool(n.get("Alive")),
            {k: float(v) for k, v in (n.get("Resources") or {}).items() if k in RESOURCES},
        )
        for n in ray.nodes()
    ]


def lost_nodes(holdings: Iterable[Holding], nodes: Sequence[ClusterNode]) -> dict[str, list[Holding]]:
    """The run's holdings per dead node (by node id): a node Ray counts dead, or no longer knows."""
    alive = {n.node_id for n in nodes if n.alive}
    lost: dict[str, list[Holding]] = {}
    for h in holdings:
        if h.process is not None and h.process.node_id not in alive:
            lost.setdefault(h.process.node_id, []).append(h)
    return lost


def first_fit(needs: Sequence[Mapping[str, float]], free: Sequence[Mapping[str, float]]) -> list[int] | None:
    """Each need's node index (first-fit decreasing: the largest needs first, GPUs before CPUs, each on
    the first node with room), or None when one finds no room."""
    room = [dict(f) for f in free]
    order = sorted(range(len(needs)), key=lambda i: tuple(-needs[i].get(k, 0.0) for k in ("GPU", "CPU")))
    where: list[int] = [-1] * len(needs)
    for i in order:
        need = needs[i]
        for n, r in enumerate(room):
            if all(r.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0):
                for k, v in need.items():
                    r[k] = r.get(k, 0.0) - v
                where[i] = n
                break
        else:
            return None
    return where


def check(
    holdings: Sequence[Holding], replacing: Sequence[Holding], nodes: Sequence[ClusterNode]
) -> list[ClusterNode]:
    """The run's lost nodes, once it is known that the nodes left can hold ``replacing`` (what is about
    to be started again: a whole trainer group, an engine, a reward worker) and everything of the run's
    that was on a lost node; raises :class:`NodeLost` when they cannot. ``holdings``: everything the run
    has started (``replacing`` among them or not). Nothing is checked when no node of the run's is lost
    (a lone process died: its replacement takes its place)."""
    lost = lost_nodes(holdings, nodes)
    if not lost:
        return []
    by_id = {n.node_id: n for n in nodes}
    gone = []
    for node_id, held in lost.items():
        process = held[0].process
        assert process is not None  # lost_nodes keeps only holdings whose node is known
        # a node Ray no longer remembers: the address its actors gave at their start
        gone.append(by_id.get(node_id) or ClusterNode(node_id, process.address, "", False))
    again = {id(h) for h in replacing}
    moving = [*replacing, *(h for held in lost.values() for h in held if id(h) not in again)]
    left = [n for n in nodes if n.alive]
    free = [dict(n.resources) for n in left]
    index = {n.node_id: i for i, n in enumerate(left)}
    for h in holdings:  # what stays holds its resources where it is
        if id(h) in again or h.process is None or h.process.node_id not in index:
            continue
        room = free[index[h.process.node_id]]
        for k, v in h.resources.items():
            room[k] = room.get(k, 0.0) - v
    if first_fit([h.resources for h in moving], free) is not None:
        return gone
    raise NodeLost(_message(gone, lost, moving, left, free), gone)


def _message(
    gone: Sequence[ClusterNode],
    lost: Mapping[str, Sequence[Holding]],
    moving: Sequence[Holding],
    left: Sequence[ClusterNode],
    free: Sequence[Mapping[str, float]],
) -> str:
    said = "; ".join(
        f"node {n.name} is lost (Ray counts it dead): it held {', '.join(h.what for h in lost[n.node_id])}"
        for n in gone
    )
    need = _sum(h.resources for h in moving)
    room = ", ".join(f"{n.name} {_amount(f)}" for n, f in zip(left, free, strict=True)) or "none"
    return (
        f"{said}. The nodes left cannot hold what must start again ({len(moving)} actor(s), {_amount(need)} "
        f"in all: {', '.join(h.what for h in moving)}); free on the nodes left: {room}. The run stops; "
        "`mars launch --resume` (or `mars train --resume`) continues it from its last checkpoint on nodes "
        "that are there"
    )


def _sum(resources: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for r in resources:
        for k, v in r.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _amount(resources: Mapping[str, float]) -> str:
    parts = [f"{max(resources.get(k, 0.0), 0.0):g} {k}" for k in RESOURCES if k == "CPU" or resources.get(k)]
    return " + ".join(parts)


class NodeWatch:
    """The run's side of :func:`check`: ``holdings`` says what the run holds now (the trainer's ranks,
    engines and reward workers), and :meth:`before_replacing` is asked before anything is started again.
    A lost node the run goes on without is said once in ``log``."""

    def __init__(self, holdings: Callable[[], list[Holding]], log: Callable[[str], None]) -> None:
        self.holdings = holdings
        self.log = log
        self.said: set[str] = set()

    def before_replacing(self, kind: str, index: int | None = None) -> None:
        """Before the ``kind`` holding ``index`` (every one of the kind: None) is started again: raises
        :class:`NodeLost` when a node of the run's is lost and the nodes left cannot hold the run."""
        held = self.holdings()
        replacing = [h for h in held if h.kind == kind and index in (None, h.index)]
        for node in check(held, replacing, cluster_nodes()):
            if node.node_id not in self.said:
                self.said.add(node.node_id)
                self.log(f"node {node.name} is lost (Ray counts it dead): the nodes left have room, the run "
                         "goes on without it")  # fmt: skip
