"""Several "nodes" on one machine, for tests of what spans nodes: each node a network and UTS namespace of
its own, with its own hostname and its own address on a bridge this module creates.

Layout (``NodeNet(3)``)::

    the test's namespace (scripts/test.sh's, loopback only, or any other the caller is in)
      bridge marsbr<k>  10.213.<k>.254/24   <- the controller's address (slurmctld, the test itself)
        veth -> node 1: eth0 10.213.<k>.1/24, hostname mars-node1
        veth -> node 2: eth0 10.213.<k>.2/24, hostname mars-node2
        veth -> node 3: eth0 10.213.<k>.3/24, hostname mars-node3
      bridge marsbr<k+1> (``data_network=True``: a second network, as on a multi-homed cluster)
        veth -> node i: eth1 10.<k+1>.0.i/24

The addresses belong to this project's own test hosts, inside namespaces it made: no node has a route
beyond its bridge, and the bridge is in a namespace with no other link, so nothing reaches another machine.
Each node namespace is held by a ``sleep`` process; a program runs "on" a node through ``nsenter`` into
that process's network and UTS namespaces (:meth:`NodeNet.on`). Mounts and process ids are shared with the
test, so the nodes see one filesystem (the "shared filesystem" of a cluster) and the test can signal any
process on any node. :meth:`NodeNet.link` takes a node's link down and up again (a cut cable or a
switch port that fails).

Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux), and a network namespace of the
test's own: :func:`missing` names what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

HOSTNAME = "mars-node{}"
CONTROLLER_HOST = 254  # the bridge's own address, last of the /24


def missing() -> list[str]:
    """What this machine lacks to build nodes (empty: it can)."""
    out = [
        f"{tool} (iproute2, util-linux)"
        for tool in ("ip", "unshare", "nsenter")
        if shutil.which(tool) is None
    ]
    if os.geteuid() != 0:
        out.append("root (network namespaces and links)")
    if not os.environ.get("MARS_IN_NETNS"):
        out.append("a network namespace of the tests' own (scripts/test.sh makes one)")
    return out


@dataclass(frozen=True)
class Node:
    index: int  # 1-based
    hostname: str
    address: str
    holder: int  # pid of the process that holds the node's namespaces

    def nsenter(self) -> list[str]:
        """The argv prefix that runs a program on this node."""
        return ["nsenter", f"--net=/proc/{self.holder}/ns/net", f"--uts=/proc/{self.holder}/ns/uts", "--"]


class NodeNet:
    """``count`` nodes on a bridge: create with :meth:`start`, end with :meth:`stop` (or ``with``)."""

    def __init__(self, count: int, subnet: int = 213, *, data_network: bool = False) -> None:
        """``data_network``: a second network (a multi-homed cluster's: bridge ``marsbr<k+1>``, each node's
        ``eth1`` at ``10.<k+1>.0.<i>``) beside the first, which Slurm's ``NodeAddr`` stays on."""
        if not 1 <= count <= 200:
            raise ValueError(f"count: 1..200 nodes, got {count}")
        self.count = count
        self.subnet = subnet
        self.bridge = f"marsbr{subnet}"
        self.prefix = f"10.{subnet}.0"
        self.controller = f"{self.prefix}.{CONTROLLER_HOST}"
        self.data_prefix = f"10.{subnet + 1}.0" if data_network else None
        self.bridges = [self.bridge, *([f"marsbr{subnet + 1}"] if data_network else [])]
        self.nodes: list[Node] = []
        self._holders: list[subprocess.Popen[bytes]] = []

    def start(self) -> NodeNet:
        try:
            for k, bridge in enumerate(self.bridges):
                _ip("link", "add", bridge, "type", "bridge")
                _ip("addr", "add", f"10.{self.subnet + k}.0.{CONTROLLER_HOST}/24", "dev", bridge)
                _ip("link", "set", bridge, "up")
            _ip("link", "set", "lo", "up")
            for i in range(1, self.count + 1):
                self.nodes.append(self._add_node(i))
        except BaseException:
            self.stop()
            raise
        return self

    def _add_node(self, i: int) -> Node:
        hostname = HOSTNAME.format(i)
        # the holder sets the hostname in its new UTS namespace, then says so and sleeps
        holder = subprocess.Popen(
            [
                "unshare",
                "--net",
                "--uts",
                "sh",
                "-c",
                f"hostname {hostname} && echo up && exec sleep infinity",
            ],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._holders.append(holder)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"up":
            raise RuntimeError(f"node {i}: its namespace holder exited ({holder.wait()})")
        node = Node(i, hostname, f"{self.prefix}.{i}", holder.pid)
        on = node.nsenter()
        _run([*on, "ip", "link", "set", "lo", "up"])
        for k, bridge in enumerate(self.bridges):
            veth, eth = f"{bridge}n{i}", f"eth{k}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", eth, "netns", str(holder.pid))
            _ip("link", "set", veth, "master", bridge, "up")
            _run([*on, "ip", "addr", "add", f"10.{self.subnet + k}.0.{i}/24", "dev", eth])
            _run([*on, "ip", "link", "set", eth, "up"])
        return node

    def stop(self) -> None:
        """Kill every node's holder (its namespaces go with the last process in them) and the bridge."""
        for holder in self._holders:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
        self._holders.clear()
        self.nodes.clear()
        for bridge in self.bridges:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)

    def __enter__(self) -> NodeNet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ use

    def node(self, i: int) -> Node:
        return self.nodes[i - 1]

    def on(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``i`` (1-based)."""
        return [*self.node(i).nsenter(), *argv]

    def link(self, i: int, up: bool) -> None:
        """Node ``i``'s links to the bridges down (nothing in or out; its processes live on) or up again."""
        for bridge in self.bridges:
            _ip("link", "set", f"{bridge}n{i}", "up" if up else "down")

    def crash(self, i: int) -> list[int]:
        """Node ``i`` fails as a machine does: its link goes down, then every process on it (every one in
        its network namespace but the namespace's holder) is killed with ``SIGKILL``; their pids. Bring it
        back with :meth:`link` and by starting its daemons again."""
        self.link(i, up=False)
        node = self.node(i)
        target = _netns(node.holder)
        killed = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != node.holder and _netns(int(entry)) == target:
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(int(entry))
        return killed


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a kernel thread
        return None


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")


__all__ = ["CONTROLLER_HOST", "HOSTNAME", "Node", "NodeNet", "missing"]
