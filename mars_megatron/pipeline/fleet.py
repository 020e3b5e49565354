"""The trainer ↔ engine boundary of a run: every rollout engine, and the weight pushes into them.

:class:`EngineFleet` is the one object the pipeline driver and the trainer talk to about engines: which
engines serve which policy, pushing a policy's weights into all of them (:meth:`EngineFleet.push_weights`),
the version they hold, sleep/wake for colocated engines, and replacing a dead engine
(:meth:`EngineFleet.replace`).

A push is one collective transfer per policy (:mod:`mars_megatron.transfer`): the trainer's senders
broadcast each bucket once over a group that spans every worker of every engine of the policy (NCCL's
pipelined broadcast takes the bytes into each node once, however many engines it holds). The driver hosts
the store the groups meet through, asks the engines to receive (asynchronously), then the trainer ranks to
send, and waits for both.

Versions and faults: a policy's version advances only when every engine confirmed the whole transfer. An
engine that dies during a transfer breaks the group: the senders and the other engines fail out of it —
on gloo at once, on the closed connections; on NCCL, which tells nobody, when each member's wait reaches
the groups' ``timeout_s`` and aborts its communicator (:mod:`mars_megatron.transfer.group`: bounded
host-side waits, so no NCCL watchdog takes a trainer rank down). An engine that stops answering (wedged,
not dead) is given the groups' backstop time after the first failure, then replaced like a dead one. A
join that fails (a member missing or silent at the warm-up broadcast) fails the push the same way,
before any byte moved. The engines that did not finish keep reporting the old version and refuse to
generate
(:class:`~mars_megatron.rollout.ray_engine.TornWeightsError`): with at most two buckets of staging an engine
cannot keep its old weights while it loads new ones, so the old version is what it *reports*, never what it
serves half-loaded. The dead engine is replaced, and the new engine and the torn ones are pushed to again
over a group of their own (the trainer still holds the weights); if that fails too, the run stops with a
:class:`TransferError`. A push that failed because a trainer rank died is not tried again (it cannot
succeed): the :class:`TransferError` names the rank, and the trainer rebuilds its group
(:meth:`~mars_megatron.pipeline.trainer.MarsRLTrainer.recover`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mars_megatron import deadline
from mars_megatron.transfer.group import BACKSTOP, GroupSpec, host_store
from mars_megatron.transfer.plan import TransferPlan


class TransferError(RuntimeError):
    """A weight push failed and could not be recovered; the message names the policy and the engines."""


@dataclass(frozen=True)
class PushReport:
    """One policy's push: the version every engine now holds, and what it cost."""

    policy: str
    version: int
    engines: int
    seconds: float
    bytes: int
    buckets: int
    sender_peak_bytes: int  # the most any trainer rank held for the push, beyond its model
    receiver_peak_bytes: int  # the most any engine worker held, beyond its weights
    recovered: int  # engines replaced or pushed to again after a failure in this push


_CALLS = "pipeline.rollout_timeout_s"
"""The setting that bounds an engine call other than a transfer (:attr:`EngineFleet.call_timeout_s`)."""


class EngineFleet:
    """Rollout engines of a run (``engines``: ``(policy, RemoteEngine)``), the trainer ranks that send
    them weights (``trainer``: a worker group whose workers have ``transfer_plans``/``join_transfer``/
    ``send_weights``/``leave_transfer``), and ``start_engine(index)`` to build a replacement."""

    def __init__(
        self,
        trainer: Any,
        engines: Sequence[tuple[str, Any]],
        start_engine: Callable[[int], Any],
        *,
        host: str,
        backend: str,
        timeout_s: float = 300.0,
        call_timeout_s: float = 3600.0,
        log: Callable[[str], None] = print,
        colocation: Sequence[Sequence[int]] | None = None,
        channels: int | None = None,
    ) -> None:
        """``backend``: of the broadcast groups (``nccl`` on GPUs, ``gloo`` on hosts). ``timeout_s``: the
        deadline of every wait on them, joins included (:mod:`mars_megatron.transfer.group`).
        ``colocation``: for engines that share devices with trainer ranks, per engine the trainer rank
        hosting each of its workers; the push then hands buffers over by handle
        (:mod:`mars_megatron.transfer.ipc`). ``channels``: the most NCCL channels of each group, which
        bounds the memory every engine worker holds per sender (None: NCCL's choice;
        :func:`~mars_megatron.transfer.group.communicator_bytes`). ``call_timeout_s``: the deadline of
        every other call on an engine (``pipeline.rollout_timeout_s``: a call may queue behind a
        generation): one past it is hung, and is replaced where the fleet can (before a push) or named
        in a :class:`~mars_megatron.deadline.DeadlineError`."""
        import ray

        if not engines:
            raise ValueError("EngineFleet: no engines")
        self.trainer = trainer
        self.engines: list[tuple[str, Any]] = list(engines)
        self.start_engine = start_engine
        self.host, self.backend, self.timeout_s, self.log = host, backend, timeout_s, log
        self.call_timeout_s = call_timeout_s
        self.channels = channels
        self._store = host_store(host, timeout_s)
        self._ranks = deadline.get(
            [e.actor.transfer_ranks.remote() for _, e in self.engines],
            "the rollout engines' transfer_ranks at start",
            call_timeout_s,
            _CALLS,
        )
        self.colocation = [list(c) for c in colocation] if colocation is not None else None
        if self.colocation is not None and any(
            len(c) < n for c, n in zip(self.colocation, self._ranks, strict=True)
        ):
            raise ValueError(
                f"colocation names {[len(c) for c in self.colocation]} host ranks per engine, the engines "
                f"have {self._ranks} workers"
            )
        plans: dict[str, TransferPlan] = trainer.call("transfer_plans")[0]
        self.plans = plans
        self._plan_refs = {name: ray.put(plan) for name, plan in plans.items()}
        self._members: dict[str, tuple[int, ...]] = {}
        self._generation = 0
        self.versions: dict[str, int] = {}
        self.stale: set[int] = set(range(len(self.engines)))
        """Engines that do not hold their policy's current version (new, or torn by a failed push): the
        driver sends them no work until a push reaches them."""

    @property
    def policies(self) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self.engines))

    def indices(self, policy: str) -> tuple[int, ...]:
        return tuple(i for i, (name, _) in enumerate(self.engines) if name == policy)

    # ------------------------------------------------------------------------------------------ push
    def push_weights(self, versions: Mapping[str, int], *, recover: bool = True) -> dict[str, PushReport]:
        """Push every policy's weights into all of its engines as ``versions[policy]``. ``recover``: after
        a failure, push again to the engines that did not complete (dead ones replaced); without it the
        failure raises :class:`TransferError` at once (dead engines are still replaced)."""
        return {p: self._push_recovering(p, self.indices(p), versions[p], recover) for p in self.policies}

    def _push_recovering(
        self, policy: str, members: tuple[int, ...], version: int, recover: bool = True
    ) -> PushReport:
        report, failed = self._push(policy, members, version)
        if not failed:
            return report
        if not recover:
            raise TransferError(
                f"weight push of policy {policy!r} version {version} failed at engine(s) {sorted(failed)}; "
                "they report their old version and refuse to generate until a push completes"
            )
        dead = self.trainer.dead_ranks()
        if dead:  # the group broke at a sender: no push to the engines can succeed without a new trainer
            raise TransferError(
                f"weight push of policy {policy!r} version {version}: trainer rank(s) {dead} died during it"
            )
        retry = tuple(sorted(failed))
        self.log(
            f"weight push of {policy} v{version} failed at engine(s) {retry}: pushing to them again "
            f"({len(members) - len(retry)} other engine(s) completed it)"
        )
        again, still = self._push(policy, retry, version)
        if still:
            raise TransferError(
                f"weight push of policy {policy!r} version {version} failed twice at engine(s) "
                f"{sorted(still)}; they report their old version and refuse to generate"
            )
        return PushReport(
            policy,
            version,
            len(members),
            report.seconds + again.seconds,
            report.bytes,
            report.buckets,
            max(report.sender_peak_bytes, again.sender_peak_bytes),
            max(report.receiver_peak_bytes, again.receiver_peak_bytes),
            len(retry),
        )

    def _push(self, policy: str, members: tuple[int, ...], version: int) -> tuple[PushReport, set[int]]:
        """One transfer to ``members``; returns its report and the engines that did not complete it
        (dead ones already replaced by new, empty engines)."""
        start = time.perf_counter()
        self._wait_idle(members)
        unjoined = self._join(policy, members)
        if unjoined is not None:  # nothing moved: every member keeps its weights, none holds `version`
            self.stale |= set(members)
            for i in sorted(unjoined):
                self._restart(i)
            seconds = time.perf_counter() - start
            return PushReport(policy, version, len(members), seconds, 0, 0, 0, 0, 0), set(members)
        plan_ref = self._plan_refs[policy]
        recv = {i: self.engines[i][1].actor.receive_weights.remote(plan_ref, version) for i in members}
        send = self.trainer.call_async("send_weights", policy)
        failed: set[int] = set()
        dead: list[int] = []
        peaks = [0]
        for i, outcome in self._outcomes(recv, send).items():
            if _gone(outcome):
                failed.add(i)
                dead.append(i)  # a silent engine is replaced as a dead one is
                if isinstance(outcome, _Silent):
                    self.log(f"engine {i} ({policy}) stopped answering during the v{version} push: replaced")
            elif isinstance(outcome, Exception):  # a torn engine: alive, reports its old version
                failed.add(i)
                self.log(f"engine {i} ({policy}) failed to load v{version}: {_last_line(outcome)}")
            else:
                peaks.append(outcome.peak_bytes)
        sent = self._sender_results(send, failed)
        if failed:
            self._members.pop(policy, None)  # the group lost a member: the next push builds new ones
            self.stale |= failed
            for i in dead:
                self._restart(i)
        else:
            self.versions[policy] = version
            self.stale -= set(members)
        report = PushReport(
            policy,
            version,
            len(members),
            time.perf_counter() - start,
            int(sum(s["bytes"] for s in sent)),
            int(sum(s["buckets"] for s in sent)),
            int(max((s["peak_bytes"] for s in sent), default=0)),
            int(max(peaks)),
            0,
        )
        return report, failed

    def _outcomes(self, calls: Mapping[int, Any], watch: Sequence[Any] = ()) -> dict[int, Any]:
        """Each engine's result of a transfer call (``calls``: Ray refs by engine), or the exception it
        raised, or :class:`_Silent` for one that had not answered :data:`~mars_megatron.transfer.group.
        BACKSTOP` × ``timeout_s`` after the first failure — of an engine, or of a trainer rank's call in
        ``watch`` (its handles; only Ray refs are watched): every member's waits end within
        ``timeout_s`` once the group broke, so an engine still silent then is wedged. No deadline while
        all goes well (a large push may take long)."""
        import ray

        pending = {ref: i for i, ref in calls.items()}
        watched = [h for h in watch if isinstance(h, ray.ObjectRef)]
        out: dict[int, Any] = {}
        give_up_at: float | None = None
        while pending:
            left = None if give_up_at is None else max(0.0, give_up_at - time.monotonic())
            ready, _ = ray.wait([*pending, *watched], num_returns=1, timeout=left)
            if not ready:
                break
            for ref in ready:
                i = pending.pop(ref, None)
                if i is None:
                    watched.remove(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:
                    result = e
                    if give_up_at is None:
                        give_up_at = time.monotonic() + BACKSTOP * self.timeout_s
                if i is not None:
                    out[i] = result
        for i in pending.values():
            out[i] = _Silent()
        return out

    def _wait_idle(self, members: tuple[int, ...]) -> None:
        """Wait until every engine has finished the calls queued before the push (an agentic run's
        engines may still be decoding a segment), so that the groups' timeout counts only the transfer.
        The driver dispatches nothing during a push, so the receive is the next call each engine runs.
        An engine found dead here is replaced first."""
        import ray

        for i in members:
            try:
                deadline.get(
                    self.engines[i][1].actor.version.remote(), f"engine {i}", self.call_timeout_s, _CALLS
                )
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
                self.log(f"engine {i} was dead before the weight push: replaced")
                self._restart(i)
            except deadline.DeadlineError as e:
                self.log(f"{e} before the weight push: hung, replaced")
                self._restart(i)

    def _sender_results(self, handles: list[Any], failed: set[int]) -> list[dict[str, float]]:
        """Each sending rank's stats (a policy's); a sender failing while every engine completed is a
        trainer-side fault no retry can fix."""
        results = []
        for h in handles:
            try:
                r = self.trainer.wait([h])[0]
            except Exception as e:
                if failed:  # the senders fail with the group the failing engine broke
                    self.log(f"a trainer rank's send failed with the engines: {_last_line(e)}")
                    continue
                raise TransferError(f"a trainer rank failed to send weights: {e}") from e
            if r is not None:
                results.append(r)
        return results

    def _join(self, policy: str, members: tuple[int, ...]) -> set[int] | None:
        """Build the policy's groups for exactly ``members`` (reusing them when unchanged). None when
        every member joined; otherwise the engines to replace (dead or silent; empty when the others only
        failed with them), and the policy has no groups."""
        if self._members.get(policy) == members:
            return None
        self._generation += 1
        self._members.pop(policy, None)
        if self.colocation is not None:
            return self._join_colocated(policy, members)
        world = 1 + sum(self._ranks[i] for i in members)
        specs = {
            sender: GroupSpec(
                self.host,
                self._store.port,
                f"{policy}/g{self._generation}/s{sender}",
                world,
                self.backend,
                self.timeout_s,
                self.channels,
            )
            for sender in self.plans[policy].senders
        }
        joins, first = {}, 1
        for i in members:
            joins[i] = self.engines[i][1].actor.join_transfer.remote(specs, first)
            first += self._ranks[i]
        handles = self.trainer.call_async("join_transfer", policy, specs)
        return self._joined(policy, members, joins, handles)

    def _joined(
        self, policy: str, members: tuple[int, ...], joins: Mapping[int, Any], handles: list[Any]
    ) -> set[int] | None:
        """Wait for the engines' and the trainer ranks' joins (:meth:`_join`'s result). Every join ends
        within the groups' ``timeout_s`` per group (:class:`~mars_megatron.transfer.group.TransferGroup`)
        unless its process is wedged."""
        outcomes = self._outcomes(joins, handles)
        replace = set()
        for i, outcome in outcomes.items():
            if _gone(outcome):
                replace.add(i)
                self.log(f"engine {i} ({policy}) is dead or silent at the join of its transfer groups")
            elif isinstance(outcome, Exception):
                self.log(f"engine {i} ({policy}) failed to join its transfer groups: {_last_line(outcome)}")
        failed = any(isinstance(o, (Exception, _Silent)) for o in outcomes.values())
        try:
            self.trainer.wait(handles)
        except Exception as e:
            if not failed:
                raise TransferError(
                    f"a trainer rank failed to join policy {policy!r}'s transfer groups: {e}"
                ) from e
            self.log(f"a trainer rank's join failed with the engines': {_last_line(e)}")
        if failed:
            return replace
        self._members[policy] = members
        return None

    def _join_colocated(self, policy: str, members: tuple[int, ...]) -> set[int] | None:
        """Groups over each sender and the hosting ranks, and one handle channel per host."""
        from mars_megatron.transfer.ipc import ColocatedSpec

        assert self.colocation is not None
        prefix = f"{policy}/g{self._generation}"
        workers: dict[int, list[int]] = {}  # hosting rank -> transfer ranks of the workers it hosts
        first: dict[int, int] = {}
        rank = 1
        for i in members:
            first[i] = rank
            for host in self.colocation[i][: self._ranks[i]]:  # worker w sits on the engine's bundle w
                workers.setdefault(host, []).append(rank)
                rank += 1

        def spec(key: str, world: int, backend: str) -> GroupSpec:
            return GroupSpec(self.host, self._store.port, key, world, backend, self.timeout_s, self.channels)

        publishers = {h: spec(f"{prefix}/ipc/h{h}", 1 + len(w), "ipc") for h, w in workers.items()}
        groups, order = {}, {}
        for sender in self.plans[policy].senders:
            others = tuple(sorted(set(workers) - {sender}))
            if others:
                groups[sender] = spec(f"{prefix}/s{sender}", 1 + len(others), self.backend)
                order[sender] = (sender, *others)
        by_rank = {t: publishers[h] for h, ranks in workers.items() for t in ranks}
        joins = {i: self.engines[i][1].actor.join_transfer.remote(by_rank, first[i]) for i in members}
        handles = self.trainer.call_async("join_transfer", policy, ColocatedSpec(groups, order, publishers))
        return self._joined(policy, members, joins, handles)

    def measure_wire(self, policy: str) -> float:
        """Seconds to broadcast ``policy``'s buckets to all of its engines with nothing exported or
        loaded (engines keep their weights and version): the baseline a push is measured against. Every
        end returns once its last broadcast completed on the device (:meth:`~mars_megatron.transfer.
        group.TransferGroup.wait`), so on NCCL too this is the wire's time, not the host's queueing."""

        members = self.indices(policy)
        if self._join(policy, members) is not None:
            raise TransferError(f"measure_wire: the engines of policy {policy!r} could not join their groups")
        start = time.perf_counter()
        recv = [self.engines[i][1].actor.receive_discard.remote(self._plan_refs[policy]) for i in members]
        send = self.trainer.call_async("send_weights", policy, raw=True)
        deadline.get(recv, f"measure_wire: the engines of policy {policy!r}", BACKSTOP * self.timeout_s)
        self.trainer.wait(send)
        return time.perf_counter() - start

    def rebind(self, trainer: Any) -> None:
        """``trainer`` (a new group of trainer ranks, the old one lost) sends from now on: the transfer
        groups are built anew at the next push, and until it every engine counts as stale (it holds
        weights newer than the checkpoint the new ranks load). The transfer plans are the same (the
        same model in the same layout); a group that plans otherwise is refused."""
        plans = trainer.call("transfer_plans")[0]
        if plans != self.plans:
            raise TransferError("the rebuilt trainer group plans another weight transfer than the first one")
        self.trainer = trainer
        self._members.clear()
        self.stale = set(range(len(self.engines)))

    # -------------------------------------------------------------------------------------- engines
    def replace(self, index: int, *, push: bool) -> Any:
        """A new engine in place of engine ``index`` (dead or unwanted). ``push``: give it the current
        weights now, over a group of its own (the trainer must be idle); otherwise it waits, stale, for
        the next push."""
        policy = self.engines[index][0]
        self._restart(index)
        if push and policy in self.versions:
            self._push_recovering(policy, (index,), self.versions[policy])
        return self.engines[index][1]

    def _restart(self, index: int) -> None:
        policy, old = self.engines[index]
        old.kill(grace_s=0)  # dead, hung or unwanted: its process ended for sure (a stopped one lingers)
        self._make_room(index)
        engine = self.start_engine(index)
        self.engines[index] = (policy, engine)
        self._members.pop(policy, None)  # the policy's groups had the old engine in them
        self._ranks[index] = deadline.get(
            engine.actor.transfer_ranks.remote(), f"engine {index}'s replacement", self.call_timeout_s, _CALLS
        )
        self.stale.add(index)

    def _make_room(self, index: int) -> None:
        """Before a colocated engine's replacement starts: the trainer ranks sharing its GPUs give back
        the memory their allocators cache but do not use (they are idle now), since the replacement
        sizes itself by what is free (vLLM checks ``gpu_memory_utilization`` × total against the free
        memory at start; :func:`~mars_megatron.rollout.vllm_engine.startup_memory_share`). The first
        engines started on empty GPUs; a replacement starts beside a trainer rank that may hold more than
        the rest of the GPU."""
        if self.colocation is None:
            return
        gib = 2**30
        for host in sorted(set(self.colocation[index][: self._ranks[index]])):
            memory = self.trainer.call_rank(host, "release_device_memory")
            where = (
                "no CUDA device"
                if memory is None
                else f"{memory[0] / gib:.1f} of {memory[1] / gib:.1f} GiB free"
            )
            self.log(
                f"trainer rank {host} released its cached memory for engine {index}'s replacement ({where})"
            )

    def _each(self, method: str) -> None:
        """Call ``method`` (``sleep``, ``wake_weights``, ``wake``) on every engine and wait."""
        refs = [getattr(engine.actor, method).remote() for _, engine in self.engines]
        deadline.get(refs, f"the rollout engines' {method}", self.call_timeout_s, _CALLS)

    def sleep(self) -> None:
        self._each("sleep")

    def wake_weights(self) -> None:
        self._each("wake_weights")

    def wake(self) -> None:
        self._each("wake")

    def close(self) -> None:
        for _, engine in self.engines:
            engine.kill()


class _Silent:
    """The outcome of an engine call that never answered (:meth:`EngineFleet._outcomes`)."""


def _gone(outcome: Any) -> bool:
    """Whether an engine call's outcome says the engine is dead or wedged (to replace), not torn."""
    import ray

    return isinstance(outcome, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, _Silent))


def _last_line(error: BaseException) -> str:
    """The exception itself out of a remote traceback (Ray puts the traceback first)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__
