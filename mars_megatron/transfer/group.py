"""Standalone collective groups between trainer senders and engine workers, outside the training world.

An engine is not a member of the trainer's ``torch.distributed`` world (it starts, dies and is replaced on
its own), so each transfer group is built directly on a store: one ``TCPStore`` hosted by the process that
orchestrates the transfer (the driver), a key prefix per group, and a process group of the backend the
devices need: NCCL between GPUs, gloo between hosts. Same code, so the CPU tests run the GPU path's logic.

Rank 0 of every group is the sending trainer rank; engine workers follow in a fixed order.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mars_megatron.comm.collectives import device_for_backend
from mars_megatron.comm.tcp_store import listening_store

STORE_PREFIX = "mars-weight-transfer"


@dataclass(frozen=True)
class GroupSpec:
    """How to join one transfer group: the store, the group's key and size, its backend."""

    host: str
    port: int
    key: str  # unique per group and generation, e.g. "policy/sender0/g3"
    world: int
    backend: str  # "gloo" | "nccl" | "ipc" (handles through the store: mars_megatron.transfer.ipc)
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl", "ipc"):
            raise ValueError(f"transfer backend must be 'gloo', 'nccl' or 'ipc', got {self.backend!r}")
        if self.world < 2:
            raise ValueError(
                f"a transfer group needs a sender and at least one receiver, got world={self.world}"
            )


def host_store(host: str, timeout_s: float = 300.0) -> Any:
    """The store every member of this run's transfer groups meets through (kept alive by the caller),
    listening on ``host`` only: loopback when every member runs on this node."""
    return listening_store(host, 0, timeout_s=timeout_s)


def local_address(peer_host: str, peer_port: int) -> str:
    """This process's address on the route to ``peer_host`` (the store): the interface gloo must bind so
    the other members can reach it, on a multi-homed node too."""
    if peer_host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, peer_port))  # no packet is sent: only the route is looked up
        return str(s.getsockname()[0])


class TransferGroup:
    """This process's membership in one transfer group."""

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        if spec.backend == "ipc":
            raise ValueError(f"{spec.key}: an 'ipc' channel is not a process group (transfer.ipc)")
        if not 0 <= rank < spec.world:
            raise ValueError(f"rank {rank} outside transfer group {spec.key!r} of {spec.world}")
        self.spec, self.rank = spec, rank
        timeout = timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{spec.key}", store)
        if spec.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [
                dist.ProcessGroupGloo.create_device(hostname=local_address(spec.host, spec.port))
            ]
            self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, spec.world, opts)
            self.device = device_for_backend("gloo")
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.device = device_for_backend("nccl", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world, opts)
        self._store = store  # the prefix store does not keep its base alive

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start broadcasting ``tensor`` (on :attr:`device`) from group rank ``src``; returns the work
        handle (``.wait()`` raises if a member died)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # a peer already gone: nothing left to release cleanly
                pass
