"""A torch ``TCPStore`` master that listens on one address only.

torch's TCPStore master listens on every interface whatever host it is given (measured with torch 2.13,
both backends: ``TCPStore("127.0.0.1", 0, is_master=True)`` listens on ``[::]:port``), so a run's
rendezvous store took connections from anywhere its port could be reached. Handed a socket that is
already bound and listening (``master_listen_fd``) it serves that socket instead (measured: then it
listens on ``127.0.0.1:port`` only), so the master here binds ``host`` itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def listening_store(
    host: str, port: int = 0, *, world_size: int | None = None, timeout_s: float = 300.0
) -> dist.TCPStore:
    """A master store listening on ``host``:``port`` alone (port 0: a free one, read back from
    ``store.port``). It does not wait for workers: callers start them once they know the port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns it from here (it closes it when destroyed)
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def local_address(peer_host: str, peer_port: int) -> str:
    """This process's address on the route to ``peer_host`` (the store): the interface gloo must bind so
    the other members can reach it, on a multi-homed node too."""
    if peer_host in (LOOPBACK, "localhost"):
        return LOOPBACK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, peer_port))  # no packet is sent: only the route is looked up
        return str(s.getsockname()[0])


def interface_of(address: str) -> str:
    """The name of the network interface that holds ``address`` (gloo's ``GLOO_SOCKET_IFNAME`` names
    interfaces, not addresses)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    raise RuntimeError(f"no network interface of this host holds {address}")


def check_interface(name: str) -> None:
    """Raise naming ``name`` (``pipeline.network_interface``) and this host unless it has an interface of
    that name with an IPv4 address: gloo and NCCL would otherwise fail later, with less to go on."""
    import psutil

    addresses = psutil.net_if_addrs().get(name, [])
    if not any(a.family == socket.AF_INET for a in addresses):
        have = ", ".join(
            sorted(n for n, a in psutil.net_if_addrs().items() if any(x.family == socket.AF_INET for x in a))
        )
        raise RuntimeError(
            f"pipeline.network_interface: {socket.gethostname()} has no interface {name!r} with an IPv4 "
            f"address (it has: {have})"
        )
