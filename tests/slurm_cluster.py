"""A real Slurm cluster on this machine, for the launcher's tests: one node, or several (each a network
and UTS namespace of its own on a bridge, :mod:`tests.node_net`).

Debian's Slurm 22.05 (``slurm-wlm``, ``slurmdbd``), MUNGE and MariaDB: ``slurmctld``, one ``slurmd`` and
``slurmdbd`` with its database, so ``sbatch``/``srun``/``squeue``/``scancel`` and ``sacct`` answer as they
do on a cluster. Every file lives under one folder (configs, state, spool, logs, the database); the daemons
run as root (``SlurmUser=root``) and listen on free loopback ports.

What it needs, and why:

* root and a network namespace with only loopback up (``scripts/test.sh`` makes one): the daemons listen on
  127.0.0.1 only, and nothing of them is seen outside the namespace;
* a second loopback address (127.0.0.2, which ``scripts/test.sh`` adds to ``lo``): Slurm resolves every
  address with ``getaddrinfo(AI_ADDRCONFIG)``, and glibc then answers IPv4 only if an address other than
  127.0.0.1 is configured; with loopback alone even ``"127.0.0.1"`` fails to resolve;
* MUNGE's default socket (``/run/munge/munge.socket.2``): Slurm 22.05's persistent connections to slurmdbd
  ignore ``AuthInfo=socket=…``, so a private ``munged`` must serve the default path (and none may run
  there already);
* no cgroups: ``proctrack/linuxproc`` and ``task/none`` track a job's processes by parentage, so
  nothing is confined (a real cluster would use ``proctrack/cgroup``; the launch script does not depend
  on it).

The node declares 8 CPUs (``SlurmdParameters=config_overrides``) whatever the machine has: Ray counts one
CPU per actor, and the tiny run starts more actors than this machine has cores.

With ``nodes=NodeNet(...)`` the cluster has one ``slurmd`` per node, each started inside its node's
namespaces (so a job step on node 2 has node 2's hostname and address, and reaches the others over the
bridge), named ``mars-node1``... with ``NodeAddr`` the node's address. ``slurmctld`` listens on the
bridge's address in the test's namespace (the cluster's controller host), where the client tools run;
``slurmdbd``, MariaDB and MUNGE stay where they are (MUNGE's socket is a file: every node reaches it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.node_net import NodeNet

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
DAEMONS = (
    "munged",
    "mariadbd",
    "mariadb-install-db",
    "slurmdbd",
    "slurmctld",
    "slurmd",
    "sacctmgr",
    "sbatch",
)
ACCOUNT, PARTITION, NODE, CLUSTER = "acme", "batch", "mars-node1", "marstest"
NODE_CPUS = 8


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run the cluster (empty: it can)."""
    missing = [f"{tool} (apt-get install slurm-wlm slurmdbd munge mariadb-server)" for tool in DAEMONS
               if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]  # fmt: skip
    if os.geteuid() != 0:
        missing.append("root (the daemons run as root)")
    if not os.environ.get("MARS_IN_NETNS"):
        missing.append("the loopback-only network namespace of scripts/test.sh")
    elif not _resolves_ipv4():
        missing.append("a second loopback address (ip addr add 127.0.0.2/8 dev lo; scripts/test.sh adds it)")
    if MUNGE_SOCKET.exists() and _munge_alive():
        missing.append(f"a free {MUNGE_SOCKET} (a munged already serves it)")
    return missing


def _resolves_ipv4() -> bool:
    try:
        socket.getaddrinfo("127.0.0.1", None, socket.AF_UNSPEC, 0, 0, socket.AI_ADDRCONFIG)
    except socket.gaierror:
        return False
    return True


def _munge_alive() -> bool:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(str(MUNGE_SOCKET))
    except OSError:
        return False
    finally:
        s.close()
    return True


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """Start with :meth:`start`, use :attr:`env` for the client tools, end with :meth:`stop`."""

    def __init__(self, root: Path, nodes: NodeNet | None = None) -> None:
        self.root = root.resolve()
        self.net = nodes
        self.node_names = [n.hostname for n in nodes.nodes] if nodes else [NODE]
        self.conf = self.root / "etc" / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pid_files: list[Path] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    # ------------------------------------------------------------------ life cycle

    def start(self, timeout_s: float = 60.0) -> LocalSlurm:
        for name in ("etc", "state", "spool", "log", "run", "db"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        ctld, slurmd, dbd, sql = _free_ports(4)
        self._write_configs(ctld, slurmd, dbd, sql)
        try:
            self._start_munge()
            self._start_database(sql, timeout_s)
            self._run([_tool("slurmdbd")])
            self._wait("slurmdbd", lambda: self._ok(["sacctmgr", "-n", "show", "cluster"]), timeout_s)
            for what in (["cluster", CLUSTER], ["account", ACCOUNT], ["user", "root", f"Account={ACCOUNT}"]):
                self._run(["sacctmgr", "-i", "add", *what])
            self._run([_tool("slurmctld"), "-f", str(self.conf)])
            for i, name in enumerate(self.node_names, start=1):
                slurmd = [_tool("slurmd"), "-f", str(self.conf), "-N", name]
                self._run(self.net.on(i, slurmd) if self.net else slurmd)
            self._wait("the nodes" if self.net else "the node", self._nodes_idle, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def node_up(self, i: int) -> bool:
        """Whether node ``i``'s ``slurmd`` runs."""
        pid_file = self.root / "run" / f"slurmd-{self.node_names[i - 1]}.pid"
        try:
            return _alive(int(pid_file.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            return False

    def start_nodes(self, nodes: list[int], timeout_s: float = 60.0) -> None:
        """Start the ``slurmd`` of each of ``nodes`` again where it is not running (after
        :meth:`~tests.node_net.NodeNet.crash`), and wait until every node is idle (their jobs cleaned
        up)."""
        assert self.net is not None
        for i in nodes:
            if not self.node_up(i):
                slurmd = [_tool("slurmd"), "-f", str(self.conf), "-N", self.node_names[i - 1]]
                self._run(self.net.on(i, slurmd))
        self._wait(f"nodes {nodes}", self._nodes_idle, timeout_s)

    def stop(self) -> None:
        """Stop every daemon and wait for them to go: the slurmds first (their job steps end with them),
        then the rest together (one after another took 12 s)."""
        slurmds = [f for f in self._pid_files if f.name.startswith("slurmd-") or f.name == "slurmd.pid"]
        others = [f for f in reversed(self._pid_files) if f not in slurmds]
        for wave in (slurmds, others):
            pids = []
            for pid_file in wave:
                try:
                    pid = int(pid_file.read_text().split()[0])
                    os.kill(pid, signal.SIGTERM)
                except (OSError, ValueError, IndexError):
                    continue
                pids.append(pid)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                time.sleep(0.1)
            for pid in pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self._pid_files.clear()
        self._procs.clear()

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ client helpers

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        r = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def state(self, job_id: str) -> tuple[str, str]:
        """``(State, ExitCode)`` of the job's allocation in ``sacct`` (the accounting database)."""
        out = self.run("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode").stdout.splitlines()
        if not out:
            return "", ""
        state, code = out[0].split("|")
        return state.split()[0], code  # "CANCELLED by 0" -> CANCELLED

    def wait_done(self, job_id: str, timeout_s: float) -> tuple[str, str]:
        """Wait until the job has left the queue and sacct records its end; its ``(State, ExitCode)``."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state[0] in ended:
                return state
            time.sleep(1)
        raise TimeoutError(f"Slurm job {job_id} still {self.state(job_id)} after {timeout_s:.0f} s")

    def logs(self) -> str:
        """The daemons' log tails, for a failing test's message."""
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            parts.append(f"== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    # ------------------------------------------------------------------ internals

    def _write_configs(self, ctld: int, slurmd: int, dbd: int, sql: int) -> None:
        r = self.root
        if self.net:  # one slurmd per node namespace: pid, spool and log files per node name (%n)
            ctld_host = f"localhost({self.net.controller})"  # Slurm takes "localhost" as this host
            slurmd_files = f"SlurmdSpoolDir={r}/spool/%n\nSlurmdPidFile={r}/run/slurmd-%n.pid\n"
            slurmd_files += f"SlurmdLogFile={r}/log/slurmd-%n.log"
            node_lines = "\n".join(
                f"NodeName={n.hostname} NodeAddr={n.address} CPUs={NODE_CPUS} RealMemory=16000 State=UNKNOWN"
                for n in self.net.nodes
            )
        else:
            ctld_host = "localhost(127.0.0.1)"
            slurmd_files = f"SlurmdSpoolDir={r}/spool\nSlurmdPidFile={r}/run/slurmd.pid\n"
            slurmd_files += f"SlurmdLogFile={r}/log/slurmd.log"
            node_lines = f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory=16000 State=UNKNOWN"
        self.conf.write_text(
            f"""ClusterName={CLUSTER}
SlurmctldHost={ctld_host}
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={r}/state
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmctldLogFile={r}/log/slurmctld.log
{slurmd_files}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={dbd}
AccountingStorageEnforce=associations,limits
PlugStackConfig={r}/etc/plugstack.conf
{node_lines}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        (r / "etc" / "plugstack.conf").write_text("")  # no SPANK plugins (no pyxis here)
        dbd_conf = r / "etc" / "slurmdbd.conf"  # slurmdbd reads it beside $SLURM_CONF
        dbd_conf.write_text(
            f"""AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd}
SlurmUser=root
LogFile={r}/log/slurmdbd.log
PidFile={r}/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={sql}
StorageUser=root
StorageLoc=slurm_acct_db
"""
        )
        dbd_conf.chmod(0o600)  # slurmdbd refuses a config others can read
        slurmds = [f"slurmd-{n}" for n in self.node_names] if self.net else ["slurmd"]
        self._pid_files += [r / "run" / f"{name}.pid" for name in ("slurmdbd", "slurmctld", *slurmds)]

    def _start_munge(self) -> None:
        r = self.root
        key = r / "etc" / "munge.key"
        self._run([_tool("mungekey"), "-c", "-k", str(key)])
        MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        pid = r / "run" / "munged.pid"
        log, seed = r / "log" / "munged.log", r / "run" / "munge.seed"
        self._run([_tool("munged"), "-f", f"--key-file={key}", f"--socket={MUNGE_SOCKET}",
                   f"--pid-file={pid}", f"--log-file={log}", f"--seed-file={seed}"])  # fmt: skip
        self._pid_files.insert(0, pid)

    def _start_database(self, port: int, timeout_s: float) -> None:
        r = self.root
        self._run([_tool("mariadb-install-db"), "--user=root", f"--datadir={r}/db",
                   "--auth-root-authentication-method=normal"])  # fmt: skip
        sock = r / "run" / "mysql.sock"
        argv = [_tool("mariadbd"), "--no-defaults", "--user=root", f"--datadir={r}/db", f"--socket={sock}",
                f"--port={port}", "--bind-address=127.0.0.1", f"--pid-file={r}/run/mysqld.pid",
                "--innodb-buffer-pool-size=32M", "--skip-log-bin"]  # fmt: skip
        with open(r / "log" / "mysqld.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(proc)
        probe = [_tool("mariadb"), "--no-defaults", f"--socket={sock}", "-uroot", "-e", "select 1"]
        self._wait("MariaDB", lambda: self._ok(probe), timeout_s)

    def _run(self, argv: list[str]) -> None:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}\n{self.logs()}")

    def _ok(self, argv: list[str]) -> bool:
        return subprocess.run(argv, env=self.env, capture_output=True, timeout=30).returncode == 0

    def _nodes_idle(self) -> bool:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
        return r.returncode == 0 and all(states.get(name) == "idle" for name in self.node_names)

    def _wait(self, what: str, ready: object, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.5)
        raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s\n{self.logs()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
