"""Trainer ranks as a group of workers: Ray actors that each hold one torch.distributed rank, or the
current process alone.

A *worker class* is plain Python: its constructor runs on every rank after torch.distributed is up, and its
methods are called on every rank at once (collectives) by name. The same class runs under
:class:`RayWorkerGroup` (one Ray actor per rank, NCCL on GPUs, gloo on CPU) and :class:`LocalWorkerGroup`
(this process, world size 1), so anything a trainer does through Ray can be stepped through in a debugger.

Why the rendezvous is TCP on loopback when it can be: Ray starts the actors, so there is no torchrun
environment to read, and a group that fits on one node needs no network address at all (CI here runs in a
loopback-only namespace). Rank 0's actor hosts the store, listening on that address only (torch's own
would listen on every interface: :mod:`mars_megatron.comm.tcp_store`), and the others are told its port.

Errors: a method that raises on any rank raises :class:`RankError` (a RuntimeError) in the caller, whose
message starts with the remote exception's last line and names the rank and method, followed by the
remote traceback. The first failing rank is reported at once: other ranks may be blocked in a collective
the failed rank never joined, so after a failure inside a collective call :meth:`shutdown` the group.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
import torch.distributed as dist

from mars_megatron import deadline
from mars_megatron.comm.tcp_store import (
    LOOPBACK,
    check_interface,
    interface_of,
    listening_store,
    local_address,
)
from mars_megatron.reaper import WorkerProcess, reap, whereabouts

if TYPE_CHECKING:
    from ray import ObjectRef

_LOOPBACK = LOOPBACK


def rendezvous_host() -> str:
    """The address this run's stores listen on and its members dial: loopback while the Ray cluster this
    process is connected to is one node (every trainer rank and engine runs here, the stores take no
    connection from outside), else this node's address as Ray knows it (a multi-node Slurm job). A node
    joining later cannot reach a loopback store: its members time out naming the store."""
    import ray

    alive = [node for node in ray.nodes() if node.get("Alive")]
    return _LOOPBACK if len(alive) <= 1 else ray.util.get_node_ip_address()


PLACEMENT_POLL_S = 5.0
"""How often a group waiting for its resources asks its ``while_waiting`` (a lost node's check)."""


class RanksHung(deadline.DeadlineError):
    """Trainer ranks did not answer a call within the group's deadline (a hung collective or a stopped
    rank); ``ranks`` names them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self) -> tuple[Any, ...]:
        return (RanksHung, (self.args[0], self.ranks))


class RankError(RuntimeError):
    """A worker method failed on one rank (or its actor died)."""

    def __init__(self, message: str, rank: int = -1, method: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.method = method

    def __reduce__(self) -> tuple[Any, ...]:  # keep rank and method through pickling (Ray ships it)
        return (RankError, (self.args[0], self.rank, self.method))


def _rank_error(rank: int, world_size: int, method: str, tb: str) -> RankError:
    last = next((line for line in reversed(tb.strip().splitlines()) if line.strip()), "unknown error")
    return RankError(
        f"{last.strip()} [rank {rank} of {world_size}, in {method}]\n--- remote traceback ---\n{tb}",
        rank,
        method,
    )


class WorkerGroup(Protocol):
    """What a trainer needs from its ranks; see :class:`RayWorkerGroup` and :class:`LocalWorkerGroup`."""

    world_size: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``worker.method(*args, **kwargs)`` on every rank at once; results in rank order."""
        ...

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """The method on one rank only (must not enter a collective)."""
        ...

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Start the call on every rank; returns per-rank handles for :meth:`wait`."""
        ...

    def call_async_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Start the call on every rank, rank ``r`` with its own positional ``args[r]``; handles for
        :meth:`wait`."""
        ...

    def wait(self, handles: Sequence[Any]) -> list[Any]:
        """Results of the handles from :meth:`call_async` (in that rank order)."""
        ...

    def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """The ranks whose process has died (after a failure: a lost rank, or an error in the code?)."""
        ...

    def shutdown(self) -> None: ...


# ------------------------------------------------------------------------------------------- in each rank
def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _destroy_groups() -> None:
    """Tear down megatron's parallel state (if this process built one) and torch.distributed."""
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class _RankActor:
    """The body of one Ray actor: one torch.distributed rank and the worker object built on it."""

    def __init__(self, rank: int, world_size: int, threads: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = None
        self.worker_name = "worker"
        self._store: Any = None
        torch.set_num_threads(threads)

    def process(self) -> WorkerProcess:
        """This rank's process: where it runs (its node's id and address), and for
        :func:`~mars_megatron.reaper.reap` if it must be given up on."""
        return whereabouts("ray::_RankActor")

    def resources(self) -> dict[str, Any]:
        """The Ray resources this rank holds, its (logical) GPU ids and placement group."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            **ctx.get_assigned_resources(),
            "gpu_ids": [int(i) for i in ray.get_gpu_ids()],
            "placement_group": ctx.get_placement_group_id(),
            # what CUDA will see in this process (None: unset, i.e. every device of the node)
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_RAY_")},
        }

    def host_store(self, addr: str) -> int:
        """Rank 0: start the group's store listening on ``addr`` alone; returns its port."""
        self._store = listening_store(addr, 0, world_size=self.world_size)
        return int(self._store.port)

    def init_group(self, addr: str, port: int, local_rank: int, ifname: str | None = None) -> None:
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
        )
        # gloo binds the interface its name says; without one it resolves this host's name, which may
        # answer loopback (it did on the test cluster's nodes: every rank then advertised 127.0.0.1). So
        # the interface asked for (a multi-homed cluster's), else the one on the route to rank 0's
        # store, which the other ranks reach too.
        if ifname is not None:
            check_interface(ifname)
            os.environ["NCCL_SOCKET_IFNAME"] = ifname
        here = ifname or ("lo" if addr == _LOOPBACK else interface_of(local_address(addr, port)))
        os.environ["GLOO_SOCKET_IFNAME"] = here
        if torch.cuda.is_available():
            # Ray gives each rank its own GPU via CUDA_VISIBLE_DEVICES, so it is device 0 of this process.
            count = torch.cuda.device_count()
            torch.cuda.set_device(0 if count == 1 else local_rank % count)
            from mars_megatron.training.parallel import trainer_nccl_env

            trainer_nccl_env()  # before its NCCL world: a weight-transfer failure must not end this rank
        try:
            store = self._store
            if store is None:  # not rank 0: dial rank 0's store
                store = dist.TCPStore(addr, port, self.world_size, is_master=False)
            dist.init_process_group(_backend(), store=store, rank=self.rank, world_size=self.world_size)
        except BaseException:
            raise _rank_error(
                self.rank, self.world_size, "init_process_group", traceback.format_exc()
            ) from None

    def construct(self, spec: tuple[type, tuple, dict]) -> None:
        worker_cls, args, kwargs = spec
        self.worker_name = getattr(worker_cls, "__qualname__", str(worker_cls))
        try:
            self.worker = worker_cls(*args, **kwargs)
        except BaseException:
            raise _rank_error(
                self.rank, self.world_size, f"{self.worker_name}.__init__", traceback.format_exc()
            ) from None

    def run(self, method: str, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except BaseException:
            raise _rank_error(
                self.rank, self.world_size, f"{self.worker_name}.{method}", traceback.format_exc()
            ) from None

    def destroy(self) -> None:
        self.worker = None
        _destroy_groups()
        self._store = None


# ------------------------------------------------------------------------------------------------- Ray
class RayWorkerGroup:
    """``world_size`` Ray actors, one torch.distributed rank each, each holding
    ``worker_cls(*init_args, **init_kwargs)`` built after the process group is up.

    Placement: one bundle per rank in a placement group, STRICT_PACK when one node has the resources for
    all ranks (a single-node group rendezvouses on loopback), PACK otherwise. Each rank gets one GPU when
    this process sees CUDA (override with ``num_gpus_per_rank``). ``env`` goes into every actor's
    environment before it starts (Ray ``runtime_env``), for variables read at import (NCCL_*, OMP_*).
    ``socket_ifname``: the network interface gloo and NCCL bind on every rank (checked on each node);
    None: the one on the route to rank 0's store. ``while_waiting``: called every few seconds while the
    cluster has not granted the ranks' resources; it may raise to stop the wait (a run whose node was
    lost during the wait checks that the nodes left have room: measured, a group rebuilt after a link
    cut waited out the whole ``ready_timeout_s`` for a node Ray counted dead meanwhile).
    Starts a local Ray instance if none is running, as Ray itself does on first use.
    """

    def __init__(
        self,
        worker_cls: type,
        world_size: int,
        *init_args: Any,
        num_cpus_per_rank: float = 1,
        num_gpus_per_rank: float | None = None,
        threads_per_rank: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 300.0,
        call_timeout_s: float = 7200.0,
        placement: tuple[Any, list[int]] | None = None,
        socket_ifname: str | None = None,
        while_waiting: Callable[[], None] | None = None,
        **init_kwargs: Any,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if num_cpus_per_rank <= 0:
            raise ValueError(f"num_cpus_per_rank must be > 0, got {num_cpus_per_rank}")
        if threads_per_rank is not None and threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
        gpus = (1.0 if torch.cuda.is_available() else 0.0) if num_gpus_per_rank is None else num_gpus_per_rank
        if gpus < 0:
            raise ValueError(f"num_gpus_per_rank must be >= 0, got {num_gpus_per_rank}")
        if not ray.is_initialized():
            ray.init()
        self.world_size = world_size
        self.call_timeout_s = call_timeout_s
        """Deadline of every wait on the ranks (``pipeline.train_timeout_s`` in a run): a rank that has not
        answered by then is hung (the others wait for it in a collective), and :meth:`wait` says which."""
        self._actors: list[Any] = []
        self._processes: list[WorkerProcess] = []
        self.addresses: list[str] = []
        self._remove_pg = remove_placement_group
        bundle = {"CPU": float(num_cpus_per_rank), **({"GPU": float(gpus)} if gpus else {})}
        strategy = "STRICT_PACK" if _fits_one_node(bundle, world_size) else "PACK"
        self._own_pg = placement is None
        if placement is None:
            self._pg, bundles = (
                placement_group([dict(bundle)] * world_size, strategy=strategy),
                list(range(world_size)),
            )
        else:  # bundles of a placement group shared with the rollout engines (pipeline/placement.py)
            self._pg, bundles = placement
            if len(bundles) != world_size:
                raise ValueError(f"placement gives {len(bundles)} bundles for {world_size} ranks")
        try:
            self._wait_placed(ready_timeout_s, while_waiting, f"{world_size} x {bundle} ({strategy})")
            threads = threads_per_rank or max(1, int(num_cpus_per_rank))
            actor_cls = ray.remote(_RankActor)
            runtime_env = {"env_vars": {k: str(v) for k, v in env.items()}} if env else None
            self._actors = [
                actor_cls.options(
                    num_cpus=num_cpus_per_rank,
                    num_gpus=gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=bundles[rank]
                    ),
                    runtime_env=runtime_env,
                ).remote(rank, world_size, threads)
                for rank in range(world_size)
            ]
            self._processes = self._gather([a.process.remote() for a in self._actors], "process")
            nodes = [p.node_id for p in self._processes]
            self.addresses = [p.address for p in self._processes]
            """Each rank's node address, as Ray knows it."""
            addr = _LOOPBACK if len(set(nodes)) == 1 else self.addresses[0]
            port = self._gather([self._actors[0].host_store.remote(addr)], "host_store")[0]
            local = [nodes[:r].count(nodes[r]) for r in range(world_size)]
            self._gather(
                [
                    a.init_group.remote(addr, port, local[r], socket_ifname)
                    for r, a in enumerate(self._actors)
                ],
                "init_group",
            )
            spec = ray.put((worker_cls, init_args, init_kwargs))
            self._gather([a.construct.remote(spec) for a in self._actors], f"{worker_cls.__qualname__}()")
        except BaseException:
            self.shutdown()
            raise

    def _wait_placed(self, timeout_s: float, while_waiting: Callable[[], None] | None, what: str) -> None:
        import ray

        give_up_at = time.monotonic() + timeout_s
        while True:
            left = give_up_at - time.monotonic()
            try:
                ray.get(self._pg.ready(), timeout=max(0.0, min(left, PLACEMENT_POLL_S)))
                return
            except ray.exceptions.GetTimeoutError:
                if left <= PLACEMENT_POLL_S:
                    raise RuntimeError(
                        f"RayWorkerGroup: the cluster did not grant {what} within {timeout_s:.0f}s; "
                        f"available: {ray.available_resources()}"
                    ) from None
            if while_waiting is not None:
                while_waiting()

    @property
    def processes(self) -> list[WorkerProcess]:
        """Each rank's process and node, as it said at its start."""
        return list(self._processes)

    def resources(self) -> list[dict[str, Any]]:
        """The Ray resources each rank holds, its (logical) GPU ids and placement group."""
        return deadline.get(
            [a.resources.remote() for a in self._actors], "the trainer ranks' resources", self.call_timeout_s
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._gather(self.call_async(method, *args, **kwargs), method)

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        ref = self._live()[rank].run.remote(method, (args, kwargs))
        return self._gather([ref], method, ranks=[rank])[0]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[ObjectRef]:
        """Per-rank ObjectRefs (``ray.get`` gives the values, or :meth:`wait` with rank-named errors).
        The arguments are serialised into the object store once and shared by every rank."""
        import ray

        payload = ray.put((args, kwargs))
        return [a.run.remote(method, payload) for a in self._live()]

    def call_async_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[ObjectRef]:
        """Like :meth:`call_async`, with rank ``r``'s own positional ``args[r]`` (a rank's share of a
        batch). Each distinct tuple (by identity: ranks that hold the same share pass the same one) is
        serialised into the object store once, so a rank receives only what it was given."""
        import ray

        if len(args) != self.world_size:
            raise ValueError(
                f"call_async_each({method!r}): {len(args)} argument tuples for {self.world_size} ranks"
            )
        refs: dict[int, ObjectRef] = {}
        for a in args:
            if id(a) not in refs:
                refs[id(a)] = ray.put((a, {}))
        return [actor.run.remote(method, refs[id(a)]) for actor, a in zip(self._live(), args, strict=True)]

    def wait(self, handles: Sequence[ObjectRef]) -> list[Any]:
        return self._gather(list(handles), "call")

    def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """The ranks whose actor has died (its process killed, crashed, or its node gone), asked after a
        failure to tell a lost rank from an error in the code. A rank still busy (blocked in a collective
        with the dead one, as on NCCL, which tells nobody) does not answer within ``timeout_s`` and counts
        as alive: only Ray's word that an actor (or its node) is dead makes a rank dead."""
        import ray

        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        gone = [rank for rank, p in enumerate(self._processes) if p.node_id not in alive]
        if gone:  # their node is dead (Ray says so): no need to wait for the others' answers
            return gone
        refs = [a.process.remote() for a in self._live()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for rank, ref in enumerate(refs):
            if ref not in done:
                continue
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                dead.append(rank)
        return dead

    def shutdown(self) -> None:
        """Destroy the process groups where the actors still answer, then kill the actors and free the
        placement group. Safe to call twice."""
        import ray

        actors, self._actors = self._actors, []
        if actors:
            refs = [a.destroy.remote() for a in actors]
            done: list[Any] = []
            with contextlib.suppress(Exception):
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a)
            # a rank that did not answer (stopped, wedged) outlives ray.kill: its process is ended for sure
            for rank, process in enumerate(self._processes):
                if refs[rank] not in done:
                    reap(process)
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and getattr(self, "_own_pg", True):  # a shared one belongs to its creator
            with contextlib.suppress(Exception):
                self._remove_pg(pg)

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -------------------------------------------------------------------------------------------- private
    def _live(self) -> list[Any]:
        if not self._actors:
            raise RuntimeError("RayWorkerGroup: the group was shut down")
        return self._actors

    def _gather(self, refs: list[Any], what: str, ranks: list[int] | None = None) -> list[Any]:
        """Values of ``refs`` (rank i's at index i); raises at the first failure to arrive, because ranks
        that wait in a collective for the failed one would never return."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        index = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending = list(refs)
        give_up_at = time.monotonic() + self.call_timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, give_up_at - time.monotonic()))
            if not ready:
                late = sorted(ranks[index[ref]] for ref in pending)
                _drain(pending)
                raise RanksHung(
                    f"{what}: trainer rank(s) {late} of {self.world_size} did not answer within "
                    f"{self.call_timeout_s:g} s (pipeline.train_timeout_s): a hung collective or a stopped "
                    "rank",
                    late,
                )
            for ref in ready:
                i = index[ref]
                try:
                    out[i] = ray.get(ref)
                except ray.exceptions.ActorUnavailableError as e:  # not dead: cut off (a link, a stall)
                    _drain(pending)
                    raise RanksHung(
                        f"{what}: {unreachable(ranks[i], self.world_size, e)}", [ranks[i]]
                    ) from None
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                    _drain(pending)
                    raise self._error(e, ranks[i], what) from None
        return out

    def _error(self, e: Exception, rank: int, what: str) -> RankError:
        import ray

        cause = getattr(e, "cause", None)
        if isinstance(cause, RankError):  # raised by _RankActor with the clean remote traceback
            return RankError(str(cause), cause.rank, cause.method)
        if isinstance(e, ray.exceptions.RayActorError):
            return _rank_error(rank, self.world_size, what, f"the rank's actor died: {e}")
        return _rank_error(rank, self.world_size, what, str(e))


def unreachable(rank: int, world_size: int, error: Exception) -> str:
    """What Ray's ``ActorUnavailableError`` for a rank's call means: the connection to a living actor
    broke (measured: a node's link down for 30 s, the connection reset when it came back), and the call
    may or may not have run, so the update cannot be trusted or sent again; the group is rebuilt."""
    said = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return f"trainer rank {rank} of {world_size} unreachable, its call may or may not have run ({said})"


def _drain(refs: list[Any]) -> None:
    """Collect the results that arrive within moments of a failure (often the same error on the other
    ranks), so that Ray does not log them as unhandled errors; ranks stuck in a collective are left."""
    import ray

    if not refs:
        return
    with contextlib.suppress(Exception):
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
        for ref in done:
            with contextlib.suppress(Exception):
                ray.get(ref)


def _fits_one_node(bundle: dict[str, float], world_size: int) -> bool:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and all(
            node.get("Resources", {}).get(k, 0.0) >= v * world_size for k, v in bundle.items()
        ):
            return True
    return False


# ----------------------------------------------------------------------------------------------- local
class _Done:
    """A finished local call: its value, or the error to raise when waited on."""

    def __init__(self, value: Any = None, error: RankError | None = None) -> None:
        self.value, self.error = value, error


class LocalWorkerGroup:
    """The same API in this process, world size 1: for tests and stepping through a trainer in a debugger.

    If torch.distributed is not running yet, a 1-rank group is started (gloo; NCCL when CUDA is present)
    through a FileStore in a temporary directory, and :meth:`shutdown` tears it down again together with
    megatron's parallel state. ``threads_per_rank`` and ``env`` apply to this process until shutdown;
    the Ray resource options are accepted and ignored so that callers can switch kinds freely.
    """

    def __init__(
        self,
        worker_cls: type,
        world_size: int = 1,
        *init_args: Any,
        num_cpus_per_rank: float = 1,
        num_gpus_per_rank: float | None = None,
        threads_per_rank: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 300.0,
        call_timeout_s: float = 7200.0,
        placement: tuple[Any, list[int]] | None = None,
        **init_kwargs: Any,
    ) -> None:
        del num_cpus_per_rank, num_gpus_per_rank, ready_timeout_s  # placement options: nothing to place
        if world_size != 1:
            raise ValueError(f"world_size must be 1 for a LocalWorkerGroup, got {world_size}")
        self.world_size = 1
        self._saved_env: dict[str, str | None] = {}
        self._saved_threads = torch.get_num_threads()
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._owns_group = False
        self._worker: Any = None
        self._closed = False
        if threads_per_rank is not None:
            if threads_per_rank < 1:
                raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
            torch.set_num_threads(threads_per_rank)
        self._set_env(dict(env or {}))
        try:
            if not dist.is_initialized():
                self._set_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
                self._tmp = tempfile.TemporaryDirectory(prefix="mars-local-group-")
                if torch.cuda.is_available():
                    torch.cuda.set_device(0)
                store = dist.FileStore(os.path.join(self._tmp.name, "store"), 1)
                dist.init_process_group(_backend(), store=store, rank=0, world_size=1)
                self._owns_group = True
            elif dist.get_world_size() != 1:
                raise RuntimeError(
                    f"LocalWorkerGroup: torch.distributed already runs with {dist.get_world_size()} ranks"
                )
            self._name = getattr(worker_cls, "__qualname__", str(worker_cls))
            try:
                self._worker = worker_cls(*init_args, **init_kwargs)
            except Exception:
                raise _rank_error(0, 1, f"{self._name}.__init__", traceback.format_exc()) from None
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.wait(self.call_async(method, *args, **kwargs))

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        if rank != 0:
            raise ValueError(f"rank must be in [0, 1), got {rank}")
        return self.call(method, *args, **kwargs)[0]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[_Done]:
        """Runs the call now (there is one rank); errors are kept for :meth:`wait`, as with Ray."""
        if self._closed:
            raise RuntimeError("LocalWorkerGroup: the group was shut down")
        try:
            return [_Done(getattr(self._worker, method)(*args, **kwargs))]
        except Exception:
            return [_Done(error=_rank_error(0, 1, f"{self._name}.{method}", traceback.format_exc()))]

    def call_async_each(self, method: str, args: Sequence[tuple[Any, ...]]) -> list[_Done]:
        """Rank 0's own positional ``args[0]`` (the one rank)."""
        if len(args) != 1:
            raise ValueError(f"call_async_each({method!r}): {len(args)} argument tuples for 1 rank")
        return self.call_async(method, *args[0])

    def wait(self, handles: Sequence[_Done]) -> list[Any]:
        for h in handles:
            if h.error is not None:
                raise h.error
        return [h.value for h in handles]

    def dead_ranks(self, timeout_s: float = 10.0) -> list[int]:
        """None: the one rank is this process."""
        del timeout_s
        return []

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._worker = None
        if self._owns_group:
            _destroy_groups()
        if self._tmp is not None:
            self._tmp.cleanup()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(self._saved_threads)

    def __enter__(self) -> LocalWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _set_env(self, env: dict[str, str]) -> None:
        for key, value in env.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = str(value)


def make_worker_group(
    kind: Literal["ray", "local"], worker_cls: type, world_size: int, *init_args: Any, **kwargs: Any
) -> WorkerGroup:
    """A :class:`RayWorkerGroup` or :class:`LocalWorkerGroup` with the same arguments."""
    groups: dict[str, Callable[..., WorkerGroup]] = {"ray": RayWorkerGroup, "local": LocalWorkerGroup}
    if kind not in groups:
        raise ValueError(f"kind must be one of {sorted(groups)}, got {kind!r}")
    return groups[kind](worker_cls, world_size, *init_args, **kwargs)
