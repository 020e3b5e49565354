"""Every listener a run starts binds loopback unless the run spans nodes.

The sockets are read from /proc (``/proc/net/tcp{,6}`` rows in LISTEN whose inode is one of the
process's file descriptors), so what is checked is what the kernel has, not what was asked for: torch's
own TCPStore is asked for 127.0.0.1 and listens on every interface.
"""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mars_megatron.comm.tcp_store import listening_store
from mars_megatron.transfer.group import GroupSpec, TransferGroup, host_store

pytestmark = pytest.mark.multiproc
LISTEN = "0A"


def listening(pid: int | str = "self") -> list[str]:
    """``host:port`` of every TCP socket process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] != LISTEN or cols[9] not in inodes:
                continue
            hex_ip, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            ip = ipaddress.ip_address(words)
            ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is 127.0.0.1
            found.append(f"{ip}:{int(hex_port, 16)}")
    return found


def loopback_only(addresses: list[str]) -> bool:
    return bool(addresses) and all(a.rsplit(":", 1)[0] == "127.0.0.1" for a in addresses)


def test_torch_own_store_listens_everywhere() -> None:
    """The premise (torch 2.13, both backends): the host argument does not pin the master's socket. If
    this starts failing, torch binds the host itself and tcp_store.listening_store could go."""
    for libuv in (True, False):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=libuv)
        mine = [a for a in listening() if a.endswith(f":{store.port}")]
        assert mine and not loopback_only(mine), mine
        del store


def test_listening_store_listens_on_loopback_only() -> None:
    before = set(listening())
    store = listening_store("127.0.0.1")
    assert set(listening()) - before == {f"127.0.0.1:{store.port}"}
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    del client, store
    assert set(listening()) == before  # the store closed the socket it was handed


def test_listening_store_refuses_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            listening_store("127.0.0.1", taken.getsockname()[1])


def test_transfer_store_listens_on_loopback_only() -> None:
    before = set(listening())
    store = host_store("127.0.0.1", 30)
    assert set(listening()) - before == {f"127.0.0.1:{store.port}"}


def _member(spec: GroupSpec, rank: int, out: Any) -> None:
    group = TransferGroup(spec, rank)
    group.broadcast(torch.zeros(4)).wait()  # every pair connected
    out.put((rank, listening()))
    group.broadcast(torch.zeros(4)).wait()  # hold the group until both have looked
    group.close()


def test_gloo_transfer_group_listens_on_loopback_only() -> None:
    """A gloo group's members listen too (for their pairs): on the store's route, loopback here."""
    store = host_store("127.0.0.1", 60)
    spec = GroupSpec("127.0.0.1", store.port, "listeners/g0", 2, "gloo", 60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(spec, rank, out)) for rank in range(2)]
    for p in procs:
        p.start()
    seen = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank, addresses in seen.items():
        assert loopback_only(addresses), (rank, addresses)


# ------------------------------------------------------------------------------------------------- Ray
class ListenerWorker:
    """A trainer-rank stand-in: reports its process's listening sockets once the group is up."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()

    def sockets(self) -> tuple[int, int, list[str]]:
        dist.barrier()
        return self.rank, os.getpid(), listening()


@pytest.fixture(scope="module")
def ray_local() -> Any:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_worker_group_store_and_gloo_listen_on_loopback_only(ray_local: Any) -> None:
    """RayWorkerGroup's rendezvous (rank 0 hosts the store) and the gloo pairs of every rank; and the
    address the trainer gives its weight-transfer store on a one-node cluster."""
    from mars_megatron.training.ray_group import RayWorkerGroup, rendezvous_host

    assert rendezvous_host() == "127.0.0.1"
    with RayWorkerGroup(ListenerWorker, 2, threads_per_rank=1) as group:
        for rank, _, addresses in group.call("sockets"):
            assert loopback_only(addresses), (rank, addresses)
