"""Standalone collective groups between trainer senders and engine workers, outside the training world.

An engine is not a member of the trainer's ``torch.distributed`` world (it starts, dies and is replaced on
its own), so each transfer group is built directly on a store: one ``TCPStore`` hosted by the process that
orchestrates the transfer (the driver), a key prefix per group, and a process group of the backend the
devices need: NCCL between GPUs, gloo between hosts. Same code, so the CPU tests run the GPU path's logic.

Rank 0 of every group is the sending trainer rank; engine workers follow in a fixed order.

**Waiting, one primitive for both backends** (:meth:`TransferGroup.wait`). NCCL's ``Work.wait()`` blocks
neither the host nor raises: it only orders the caller's CUDA stream after the collective, and a member
that died leaves the others' kernels spinning until the NCCL watchdog's timeout, whose default handling
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) takes the whole process down, a trainer rank included. So every
wait on transfer work is host-side and bounded: poll ``work.is_completed()`` (on NCCL a query of the
collective's end event, or its asynchronous error) until the group's ``timeout_s`` has passed since the
wait began; past it, abort the group (``ProcessGroupNCCL.abort()``: ``ncclCommAbort``, which stops the
spinning kernels; ``shutdown()`` would wait for them) and raise :class:`TransferTimeout`. A member's
error (gloo's closed connection, NCCL's asynchronous error) raises :class:`TransferAborted` the same way.
A member that aborts also says so in the store, and every wait looks for that signal every
:data:`SIGNAL_POLL_S`: one member's failure ends the others' waits at once, on NCCL too (where nothing
else tells them), and on gloo even while this process still holds the group's connections.
Both are what the fleet already handles: a receiver's error tears its engine
(:class:`~mars_megatron.rollout.ray_engine.TornWeightsError`), a sender's is logged, and the push
recovers or stops with :class:`~mars_megatron.pipeline.fleet.TransferError`. The gloo branch runs this
code, so the CPU tests cover it: a stalled gloo member (a frozen process, or one that never posts its
receive) behaves as a dead NCCL member does.

A wait returns once the work *completed*, on the device too: on NCCL the end event has fired (and the
caller's stream is ordered after it), so timings taken after it (:func:`~mars_megatron.transfer.channel.
send_buckets`, :meth:`~mars_megatron.pipeline.fleet.EngineFleet.measure_wire`) measure the wire, not the
host's queueing; :meth:`TransferGroup.synchronize` also waits for what the caller queued after it (the
loads). On gloo the host already waits; both are then no-ops beyond the poll.

**The NCCL watchdog of a transfer group.** ``ProcessGroupNCCL`` reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
when it is constructed, so a transfer group is built with ``2`` (CleanUpOnly: on an error the watchdog
aborts the group's communicators, and throws nothing), and with a timeout of :data:`BACKSTOP` times
``timeout_s``: the host-side deadline aborts first, and an aborted group's work is neither checked for
errors nor timed out by the watchdog. What remains is the process-wide flight-recorder signal: a
watchdog that *does* see an error (NCCL reports a remote error when a peer on another node dies) calls
``broadcastDumpSignal``, which sets a process-wide flag, and the heartbeat monitor of the process's
first NCCL group (a trainer rank's training world) then terminates the process after
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` unless that group was built with ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``.
A trainer rank that joins transfer groups therefore starts its world with :data:`TRAINER_NCCL_ENV`
(:func:`mars_megatron.training.parallel.init_distributed`, the Ray trainer ranks); engine workers are
replaceable and keep torch's defaults.

**Communicators at join.** NCCL creates a group's communicator lazily, at its first collective: in an
engine worker that is the first push, after vLLM took its share of the GPU and while Megatron gathers on
the trainer side. A :class:`TransferGroup` is instead made whole when it is constructed: the group, its
communicator (``eager_connect_single_device``) and one warm-up broadcast of a single element, which sets
up the broadcast's connections and their buffers, all within the group's deadline — so a missing or
silent member fails the join, not the first push, and the memory is taken before any push. A worker
joins its senders' groups one at a time, in sender order (:class:`~mars_megatron.transfer.receiver.
ReceivingEnd`), so every member reaches the groups in the same order and at most one communicator is
being set up at a time.

Memory of one communicator, per member: NCCL keeps, for every channel, buffers for the connection of the
broadcast's ring — ``NCCL_BUFFSIZE`` (4 MiB) for the simple protocol, about 4.7 MiB for LL128 and
0.5 MiB for LL (NCCL's defaults) — so about 9.2 MiB per channel, and NCCL picks 2 to 32 channels from the
topology (:func:`communicator_bytes`). An engine worker holds one communicator per sender (16 for
Qwen3-30B-A3B over 64 GPUs, 64 for 235B-A22B): up to 4.7 GB (16 × 32 channels) outside vLLM's
``gpu_memory_utilization``. :attr:`GroupSpec.channels` bounds the channels of a group
(``ncclConfig.maxCTAs``); ``NCCL_BUFFSIZE`` and ``NCCL_PROTO`` (e.g. ``Simple``) shrink the buffers
process-wide; NCCL ≥ 2.22 connects an algorithm's buffers at its first use (``NCCL_RUNTIME_CONNECT=1``,
the default), which the warm-up does.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.comm.collectives import device_for_backend
from mars_megatron.comm.tcp_store import listening_store, local_address

STORE_PREFIX = "mars-weight-transfer"
BACKSTOP = 2.0
"""The backend's own timeout (gloo's, NCCL's watchdog) as a multiple of a group's ``timeout_s``: only a
backstop, the host-side deadline of :meth:`TransferGroup.wait` fires first."""
NCCL_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` of transfer groups: CleanUpOnly (abort the group's
communicators on an error, never take the process down)."""
TRAINER_NCCL_ENV = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""Set (unless already set) before a trainer rank creates its NCCL world: a transfer group's error must
not make that world's heartbeat monitor terminate the rank (module docstring)."""
POLL_S = (5e-5, 2e-3)
"""First and longest pause between two polls of a transfer work (doubling in between): a bucket's
completion is seen within 2 ms, and a long wait costs the host little."""
SIGNAL_POLL_S = 0.05
"""How often a wait looks for another member's abort signal in the store (:meth:`TransferGroup.abort`)."""
CHANNEL_BYTES = 4 * 2**20 + 4_915_200 + 524_288
"""NCCL's buffers per channel and connection at its defaults: simple (``NCCL_BUFFSIZE``), LL128, LL."""
MAX_CHANNELS = 32


class TransferAborted(RuntimeError):
    """This end's transfer group failed (a member died, erred or stalled) and was aborted: nothing more
    can travel on it; the fleet builds new groups for the next transfer."""


class TransferTimeout(TransferAborted):
    """A transfer collective did not complete within its group's ``timeout_s`` (a member stopped taking
    part: on NCCL, how a dead member shows)."""


@dataclass(frozen=True)
class GroupSpec:
    """How to join one transfer group: the store, the group's key and size, its backend, the deadline of
    every wait on it (join included), and for NCCL the most channels its communicator may use (None:
    NCCL's choice; :func:`communicator_bytes`)."""

    host: str
    port: int
    key: str  # unique per group and generation, e.g. "policy/sender0/g3"
    world: int
    backend: str  # "gloo" | "nccl" | "ipc" (handles through the store: mars_megatron.transfer.ipc)
    timeout_s: float = 300.0
    channels: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl", "ipc"):
            raise ValueError(f"transfer backend must be 'gloo', 'nccl' or 'ipc', got {self.backend!r}")
        if self.world < 2:
            raise ValueError(
                f"a transfer group needs a sender and at least one receiver, got world={self.world}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"transfer timeout_s must be > 0, got {self.timeout_s}")
        if self.channels is not None and not 1 <= self.channels <= MAX_CHANNELS:
            raise ValueError(f"transfer channels must be in [1, {MAX_CHANNELS}] or None, got {self.channels}")


def communicator_bytes(channels: int = MAX_CHANNELS, env: Mapping[str, str] | None = None) -> int:
    """Device memory one member of one NCCL transfer group holds for it, at most: ``channels`` times the
    buffers of one connection (the broadcast's ring: one connection in per channel). ``env``: the
    process's environment (``NCCL_BUFFSIZE``, ``NCCL_PROTO`` change the buffers). An estimate from
    NCCL's defaults, to be checked against the GPU (``nvidia-smi`` before and after a join)."""
    env = os.environ if env is None else env
    simple = int(env.get("NCCL_BUFFSIZE", 4 * 2**20))
    protocols = {p.strip().lower() for p in env.get("NCCL_PROTO", "simple,ll,ll128").split(",")}
    per_channel = simple * ("simple" in protocols)
    per_channel += 4_915_200 * ("ll128" in protocols) + 524_288 * ("ll" in protocols)
    return channels * per_channel


def host_store(host: str, timeout_s: float = 300.0) -> Any:
    """The store every member of this run's transfer groups meets through (kept alive by the caller),
    listening on ``host`` only: loopback when every member runs on this node."""
    return listening_store(host, 0, timeout_s=timeout_s)


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in the environment while a process group reads them at construction, then restored."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class TransferWork:
    """One collective of a transfer group in flight; :meth:`wait` is the group's bounded wait."""

    def __init__(self, group: TransferGroup, work: Any, what: str) -> None:
        self.group, self.work, self.what = group, work, what

    def wait(self) -> None:
        self.group.wait(self.work, self.what)


class TransferGroup:
    """This process's membership in one transfer group: joined, connected and warmed up when constructed
    (module docstring), or :class:`TransferAborted`/:class:`TransferTimeout` within ``spec.timeout_s``."""

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        if spec.backend == "ipc":
            raise ValueError(f"{spec.key}: an 'ipc' channel is not a process group (transfer.ipc)")
        if not 0 <= rank < spec.world:
            raise ValueError(f"rank {rank} outside transfer group {spec.key!r} of {spec.world}")
        self.spec, self.rank = spec, rank
        self.pg: Any = None
        self.broken = False
        self._store: Any = None
        self._issued = 0
        self._pending: list[Any] = []  # issued, not yet waited for: close() aborts if any is unfinished
        self._signal_base: Any = None
        self._signals: Any = None
        if spec.backend == "gloo":
            self.device = device_for_backend("gloo")
        else:
            self.device = device_for_backend("nccl", torch.cuda.current_device())
        self._join()

    # ------------------------------------------------------------------------------------------ join
    def _join(self) -> None:
        """Build the group, its communicator and a warm-up broadcast in a helper thread (each can block
        in the backend until every member arrived), bounded here by the group's deadline."""
        started = time.monotonic()
        done: dict[str, Any] = {}

        def connect() -> None:
            try:
                if self.device.type == "cuda":  # the current device is per thread
                    torch.cuda.set_device(self.device)
                self._connect()
                if self.broken:  # the joining thread gave up while this one was connecting
                    self.abort()
                done["work"] = self._issue(torch.zeros(1, dtype=torch.uint8, device=self.device), 0)
            except BaseException as e:  # handed to the joining thread
                done["error"] = e

        helper = threading.Thread(target=connect, name=f"mars-transfer-join:{self.spec.key}", daemon=True)
        helper.start()
        helper.join(self.spec.timeout_s)
        if helper.is_alive():
            # marks the group broken, so the helper aborts what it may still build
            self.abort(f"could not join within {self.spec.timeout_s:g} s")
            self.close()
            raise TransferTimeout(
                f"weight transfer group {self.spec.key!r}: rank {self.rank} of {self.spec.world} could not "
                f"join within {self.spec.timeout_s:g} s (a member missing or not taking part)"
            )
        if "error" in done:
            self.abort("failed to join")
            self.close()
            raise TransferAborted(
                f"weight transfer group {self.spec.key!r}: rank {self.rank} failed to join: {done['error']}"
            ) from done["error"]
        try:
            self.wait(done["work"], "the warm-up broadcast of the join", started=started)
        except TransferAborted:
            self.close()
            raise

    def _connect(self) -> None:
        spec = self.spec
        backstop = timedelta(seconds=spec.timeout_s * BACKSTOP)
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
        self._store = store  # the prefix store does not keep its base alive
        # a connection of its own for the abort signal: the backend may use the other from its threads
        self._signal_base = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
        self._signals = dist.PrefixStore(f"{STORE_PREFIX}-signal/{spec.key}", self._signal_base)
        prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{spec.key}", store)
        if spec.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = backstop
            opts._devices = [
                dist.ProcessGroupGloo.create_device(hostname=local_address(spec.host, spec.port))
            ]
            self.pg = dist.ProcessGroupGloo(prefixed, self.rank, spec.world, opts)
            return
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = backstop
        if spec.channels is not None:
            opts.config.max_ctas = spec.channels
        with _scoped_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ERROR_HANDLING}):
            self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, spec.world, opts)
        self.pg.eager_connect_single_device(self.device)  # the communicator now, not at the first push

    # ------------------------------------------------------------------------------------ collectives
    def _issue(self, tensor: torch.Tensor, src: int) -> Any:
        pg = self.pg
        if pg is None or self.broken:
            raise TransferAborted(f"weight transfer group {self.spec.key!r} is closed or aborted")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._issued += 1
        work = pg.broadcast([tensor], opts)
        self._pending.append(work)
        return work

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> TransferWork:
        """Start broadcasting ``tensor`` (on :attr:`device`) from group rank ``src``; ``.wait()`` on the
        returned work is :meth:`wait`."""
        return TransferWork(self, self._issue(tensor, src), f"broadcast {self._issued} from rank {src}")

    def wait(self, work: Any, what: str = "a broadcast", *, started: float | None = None) -> None:
        """Return once ``work`` completed (on the device too), within ``timeout_s`` of ``started`` (now by
        default); otherwise abort the group and raise :class:`TransferTimeout`, or
        :class:`TransferAborted` if the work failed. The same code for NCCL and gloo (module docstring)."""
        now = time.monotonic()
        deadline = (now if started is None else started) + self.spec.timeout_s
        look = now + SIGNAL_POLL_S
        pause = POLL_S[0]
        while not work.is_completed():
            if self.broken:
                raise TransferAborted(f"weight transfer group {self.spec.key!r} was aborted during {what}")
            now = time.monotonic()
            if now >= look:
                look = now + SIGNAL_POLL_S
                signal = self._signal()
                if signal is not None:
                    self.abort(signal=False)
                    raise TransferAborted(
                        f"weight transfer group {self.spec.key!r} (rank {self.rank} of {self.spec.world}): "
                        f"{what} ended: {signal}"
                    )
            if now >= deadline:
                self.abort(f"{what} did not complete within {self.spec.timeout_s:g} s")
                raise TransferTimeout(
                    f"weight transfer group {self.spec.key!r} (rank {self.rank} of {self.spec.world}): "
                    f"{what} did not complete within {self.spec.timeout_s:g} s; group aborted"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        error = self._failure(work)
        if error is not None:
            self.abort(f"{what} failed")
            raise TransferAborted(
                f"weight transfer group {self.spec.key!r} (rank {self.rank} of {self.spec.world}): {what} "
                f"failed: {error}"
            ) from error
        self._pending = [w for w in self._pending if w is not work]  # drops its buffer with it

    def _failure(self, work: Any) -> BaseException | None:
        """The completed ``work``'s error, if any. gloo's ``wait()`` raises it; NCCL's does not under
        CleanUpOnly (and orders the current stream after the collective), so its exception is read."""
        try:
            work.wait()
        except Exception as e:
            return e
        if self.spec.backend == "nccl":
            error = work.exception()
            if error is not None:
                return error if isinstance(error, BaseException) else RuntimeError(str(error))
        return None

    def synchronize(self) -> None:
        """Wait for everything this process queued on the group's device (the loads after the last
        bucket): no-op on the host, where nothing runs behind the caller's back."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------------------------------- end
    def abort(self, reason: str = "left the group unfinished", *, signal: bool = True) -> None:
        """Stop this member's part of the group now (NCCL: ``ncclCommAbort``, so kernels waiting for a
        dead member stop spinning); the group cannot be used again. ``signal``: tell the other members
        through the store, so that their waits end within :data:`SIGNAL_POLL_S` instead of at their
        deadline (NCCL tells them nothing; gloo only once this process drops every reference to the
        group's connections)."""
        first = not self.broken
        self.broken = True
        if first and signal and self._signals is not None:
            with contextlib.suppress(Exception):  # the store gone with the driver: the deadline remains
                self._signals.set("aborted", f"rank {self.rank} aborted the group: {reason}")
        pg = self.pg
        if pg is not None:
            with contextlib.suppress(Exception):  # aborting what already failed
                pg.abort()

    def _signal(self) -> str | None:
        """Another member's abort signal, if one was given."""
        if self._signals is None:
            return None
        try:
            if self._signals.check(["aborted"]):
                return bytes(self._signals.get("aborted")).decode(errors="replace")
        except Exception:  # the store unreachable: the deadline still bounds the wait
            return None
        return None

    def close(self) -> None:
        """Leave the group: gracefully when every collective completed, by :meth:`abort` otherwise
        (NCCL's ``shutdown()`` waits for pending kernels, which a dead member never lets finish)."""
        if self.pg is None:
            return
        unfinished = self.broken or any(not w.is_completed() for w in self._pending)
        if unfinished:
            self.abort()
        else:
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to release cleanly
                self.pg.shutdown()
        refs: list[Any] = [self.pg, self._pending]
        self.pg, self._pending = None, []
        if unfinished:
            # gloo cannot interrupt a receive: the group's threads end at its backstop timeout, and its
            # destructor waits for them, so the last references go in a thread of its own
            _drop_in_background(refs)


def _drop_in_background(refs: list[Any]) -> None:
    """Release the last references in ``refs`` from a daemon thread (a destructor that may block)."""
    threading.Thread(target=refs.clear, name="mars-transfer-release", daemon=True).start()
