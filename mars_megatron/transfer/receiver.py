"""The receiving end of weight transfers in one engine worker process: its group memberships and the loop
that loads every bucket (:func:`~mars_megatron.transfer.channel.receive_buckets`).

Engines compose it: the transformers engine holds one in its own process, every vLLM worker holds one
through the worker extension (:mod:`mars_megatron.rollout.vllm_transfer`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from mars_megatron.transfer.channel import TransferStats, receive_buckets
from mars_megatron.transfer.group import GroupSpec, TransferGroup
from mars_megatron.transfer.ipc import Subscriber, colocated_receive
from mars_megatron.transfer.plan import TransferPlan

Load = Callable[[Sequence[tuple[str, torch.Tensor]]], int]


class ReceivingEnd:
    """This worker's transfer groups (one per sender) and what it received last."""

    def __init__(self) -> None:
        self.groups: dict[int, TransferGroup] = {}
        self.subscriber: Subscriber | None = None

    def join(self, groups: Mapping[int, GroupSpec], rank: int) -> None:
        """Join every sender's group as ``rank``, leaving older ones: one group at a time, in sender
        order, each connected and warmed up before the next (:class:`~mars_megatron.transfer.group.
        TransferGroup`), so every member meets the groups in the same order, at most one communicator is
        being set up at a time, and a missing member fails the join within the group's ``timeout_s``
        (:class:`~mars_megatron.transfer.group.TransferAborted`) rather than the first push.
        Colocated (backend ``ipc``): ``groups`` holds, by transfer rank, the handle channel of each
        worker's host; this worker subscribes to ``groups[rank]``."""
        self.leave()
        if any(spec.backend == "ipc" for spec in groups.values()):
            self.subscriber = Subscriber(groups[rank])
            return
        try:
            for sender in sorted(groups):
                self.groups[sender] = TransferGroup(groups[sender], rank)
        except BaseException:
            self.leave()
            raise

    def receive(self, plan: TransferPlan, load: Load) -> TransferStats:
        if self.subscriber is not None:
            return colocated_receive(self.subscriber, plan, load)
        missing = [s for s in plan.senders if s not in self.groups]
        if missing:
            raise RuntimeError(f"weight transfer: no group joined for sender rank(s) {missing} (join first)")
        try:
            return receive_buckets(self.groups, plan, load)
        except BaseException:
            self.leave()  # a broken group cannot carry the next transfer; the fleet builds new ones
            raise

    def leave(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups = {}
        self.subscriber = None
