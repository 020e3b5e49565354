"""``mars launch --executor slurm`` on a real Slurm cluster of three nodes: slurmctld, one slurmd per node,
slurmdbd and MUNGE started on this machine (:mod:`tests.slurm_cluster`), each node a network and UTS
namespace with its own hostname and address on a bridge (:mod:`tests.node_net`), the job container-less
(``--venv``: this test's environment). One cluster for the module: MUNGE serves one socket per machine.

Real submission (no dry run): the sbatch script starts a Ray head on the node, the tiny MarsRL job joins it
as the driver and runs to its end, ``sacct`` records COMPLETED and ``mars launch --wait`` returns the
trainer's exit status; a failing job comes back as FAILED with the trainer's status; a job of three nodes
(its trainer ranks on two, the engine on the third) cancelled with ``scancel`` after its checkpoint of
step 2 is resumed through the launcher (``--resume``) and every step equals the one-node job's. Also what
real Slurm says to NeMo-Run's ``-A=<account>``.

Needs root, the loopback-only namespace of scripts/test.sh and Debian's Slurm packages (scripts/setup.sh
installs them as root); elsewhere the module is skipped, naming what is missing, except under CI, where a
missing piece fails it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mars_megatron.launch import nemo
from mars_megatron.metrics import read_metrics
from mars_megatron.pipeline.agents import trained_ids
from tests import node_net
from tests.node_net import NodeNet
from tests.slurm_cluster import ACCOUNT, PARTITION, LocalSlurm, missing_prerequisites

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny_cpu.yaml"
DATA = REPO / "examples" / "data" / "arith_train.jsonl"
VENV = Path(sys.executable).parent.parent  # this test's environment: Ray and `mars` on every "node"
STEPS = 4
COMPARED = ["reward/solver", "reward/verifier", "reward/corrector", "train/loss", "train/grad_norm", "tokens"]

NODES = 3
_missing = missing_prerequisites() + node_net.missing()
if not nemo.LAUNCH_PYTHON.exists():
    _missing.append(".venv-launch (scripts/setup_launch.sh)")
pytestmark = pytest.mark.skipif(
    bool(_missing) and not os.environ.get("CI"),
    reason=f"no local Slurm cluster: missing {'; '.join(_missing)}",
)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    if _missing:  # under CI (see pytestmark): a missing piece is a failure, not a skip
        pytest.fail(f"the real-Slurm tests cannot run: missing {'; '.join(_missing)}", pytrace=False)
    with (
        NodeNet(NODES, data_network=True) as net,
        LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=net) as cluster,
    ):
        yield cluster


def srun(slurm: LocalSlurm, *args: str) -> str:
    """A job step on the cluster under the test account; its output."""
    return slurm.run("srun", f"--account={ACCOUNT}", f"--partition={PARTITION}", *args).stdout


def test_each_node_has_its_own_hostname_and_address_and_no_route_beyond_the_bridge(slurm: LocalSlurm) -> None:
    assert slurm.net is not None
    out = srun(
        slurm, f"-N{NODES}", "-l", "sh", "-c", "echo $(hostname) $SLURMD_NODENAME $(ip -4 -o addr show eth0)"
    )
    seen = {}
    for line in out.splitlines():
        _, host, slurm_name, *addr = line.split()
        assert host == slurm_name
        seen[host] = next(w.split("/")[0] for w in addr if w.count(".") == 3)
    assert seen == {n.hostname: n.address for n in slurm.net.nodes}
    routes = srun(slurm, "-w", "mars-node2", "ip", "-4", "route").splitlines()
    assert [r.split() for r in routes] == [  # its two networks (the second: a multi-homed cluster's)
        [f"{prefix}.0/24", "dev", eth, "proto", "kernel", "scope", "link", "src", f"{prefix}.2"]
        for eth, prefix in (("eth0", slurm.net.prefix), ("eth1", slurm.net.data_prefix))
    ]


PING = """
import os, socket, sys, time
if os.environ["SLURM_PROCID"] == "0":
    server = socket.create_server((sys.argv[1], 29555))
    conn, peer = server.accept()
    print("from", peer[0], conn.recv(64).decode(), flush=True)
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((sys.argv[1], 29555), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.sendall(socket.gethostname().encode())
"""


def test_a_step_on_one_node_reaches_another_over_the_bridge_and_a_link_down_cuts_it(
    slurm: LocalSlurm,
) -> None:
    net = slurm.net
    assert net is not None
    out = srun(slurm, "-N2", "-w", "mars-node1,mars-node3", sys.executable, "-c", PING, net.node(1).address)
    assert out.split() == ["from", net.node(3).address, "mars-node3"]
    probe = [
        sys.executable,
        "-c",
        f"import socket; socket.create_connection(('{net.node(2).address}', 22), 2)",
    ]
    net.link(2, up=False)
    try:
        cut = subprocess.run(net.on(3, probe), capture_output=True, text=True, timeout=30)
    finally:
        net.link(2, up=True)
    assert "timed out" in cut.stderr or "No route" in cut.stderr, cut.stderr
    back = subprocess.run(net.on(3, probe), capture_output=True, text=True, timeout=30)
    assert "Connection refused" in back.stderr, back.stderr  # node 2 answers again (nothing on port 22)


def mars_launch(
    slurm: LocalSlurm, tmp: Path, *args: str | Path, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """The real ``mars launch`` command of this environment, against the test cluster."""
    env = {**slurm.env, "NEMORUN_HOME": str(tmp / "nemorun")}
    argv = [str(VENV / "bin" / "mars"), "launch", *map(str, args)]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def tiny_job(model: Path, run: Path, job_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        str(TINY), f"model.mcore_dir={model}", f"data.train_file={DATA}", f"logging.run_dir={run}",
        f"checkpoint.save_dir={run}/ckpt", "checkpoint.save_interval=1", f"train.steps={STEPS}",
        "data.problems_per_step=4", "logging.tensorboard=false", "logging.rollouts=true", "--executor",
        "slurm", "--venv", str(VENV), "--account", ACCOUNT, "--partition", PARTITION, "--gpus-per-node", "0",
        "--time", "30",
        "--job-name", name, "--job-dir", str(job_dir), *extra,
    ]  # fmt: skip


def submitted_id(stdout: str) -> str:
    line = next(line for line in stdout.splitlines() if line.startswith("submitted Slurm job "))
    return line.split()[3].rstrip(":")


def explain(r: subprocess.CompletedProcess[str], job_dir: Path, slurm: LocalSlurm) -> str:
    logs = [f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(job_dir.rglob("*.log"))]
    logs += [f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(job_dir.rglob("*.out"))]
    return "\n".join([f"exit {r.returncode}", r.stdout[-3000:], r.stderr[-3000:], *logs, slurm.logs()])


@pytest.fixture(scope="module")
def completed(
    slurm: LocalSlurm, sft_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, str, subprocess.CompletedProcess[str]]:
    """The tiny job submitted for real with ``--wait``, run to its end: (run dir, job dir, id, launch)."""
    tmp = tmp_path_factory.mktemp("complete")
    run, jobs = tmp / "run", tmp / "jobs"
    r = mars_launch(slurm, tmp, *tiny_job(sft_model, run, jobs, "tiny"), "--wait")
    assert r.returncode == 0, explain(r, jobs, slurm)
    return run, jobs, submitted_id(r.stdout), r


def test_the_tiny_job_runs_to_its_end_on_slurm(
    slurm: LocalSlurm, completed: tuple[Path, Path, str, subprocess.CompletedProcess[str]]
) -> None:
    run, jobs, job_id, r = completed
    assert slurm.state(job_id) == ("COMPLETED", "0:0")  # the accounting database's record
    assert f"Slurm job {job_id} COMPLETED, exit status 0" in r.stdout
    steps = slurm.run("sacct", "-j", job_id, "-n", "-P", "-o", "JobID,State").stdout.split()
    assert f"{job_id}.batch|COMPLETED" in steps and any(s.endswith("|COMPLETED") for s in steps[2:])
    # the script: container-less, whole node, the environment activated, the Ray head then the trainer
    script = (jobs / "tiny" / "ray.sub").read_text()
    assert "#SBATCH --exclusive" in script and f"source {VENV}/bin/activate" in script
    assert "--container" not in script and "-A=" not in script
    batch = next((jobs / "tiny" / "logs").glob(f"sbatch_mars-tiny_{job_id}.out")).read_text()
    assert "[mars] all 1 Ray node(s) joined" in batch and "mars train exited with status 0" in batch
    # the trainer's log came back, and its outputs are where the config put them
    trainer = (jobs / "tiny" / "logs" / "ray-job.log").read_text()
    assert [line.split()[1] for line in trainer.splitlines() if line.startswith("step")] == [
        f"{s}/{STEPS}" for s in range(1, STEPS + 1)
    ]
    records = read_metrics(run / "metrics.jsonl")
    assert [rec["step"] for rec in records] == list(range(1, STEPS + 1))
    assert [rec["policy_version"] for rec in records] == list(range(1, STEPS + 1))
    assert 0 < sum(rec["reward/solver"] for rec in records) < STEPS  # real updates from a real warm start


def test_a_failing_job_comes_back_as_a_failure(slurm: LocalSlurm, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    r = mars_launch(slurm, tmp_path, *tiny_job(tmp_path / "absent", tmp_path / "run", jobs, "bad"), "--wait")
    assert r.returncode == 2, explain(r, jobs, slurm)  # mars train's status for bad input, through Slurm
    job_id = submitted_id(r.stdout)
    assert slurm.state(job_id) == ("FAILED", "2:0")
    assert f"Slurm job {job_id} FAILED, exit status 2" in r.stdout
    trainer = (jobs / "bad" / "logs" / "ray-job.log").read_text()
    assert "mars train: error: model.mcore_dir:" in trainer


FAST_HEALTH = ["RAY_health_check_period_ms=1000", "RAY_health_check_timeout_ms=2000",
               "RAY_health_check_failure_threshold=5"]  # fmt: skip
"""Ray's health check of the first job: a node whose link is down counted dead in about 15 s (Ray's
defaults: 65 s, the time a whole test would wait)."""


def wait_for(path: Path, text: str, slurm: LocalSlurm, job_id: str, why: str, timeout_s: float = 600) -> str:
    """``path``'s text once it holds ``text``, while the job runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists() and text in (seen := path.read_text(errors="replace")):
            return seen
        state = slurm.state(job_id)[0]
        assert state in ("", "PENDING", "RUNNING") and time.monotonic() < deadline, f"{why}: {state}"
        time.sleep(0.5)


def crash(slurm: LocalSlurm, node: int, job_id: str, log: Path, said: str, why: str) -> float:
    """Node ``node`` crashes (link down, its processes killed) while job ``job_id`` runs; the seconds until
    ``log`` holds ``said`` (another line than before: a later mention counts)."""
    assert slurm.net is not None
    before = log.read_text(errors="replace").count(said)
    crashed = time.monotonic()
    assert slurm.net.crash(node)
    deadline = time.monotonic() + 120
    while log.read_text(errors="replace").count(said) == before:
        state = slurm.state(job_id)[0]
        assert state in ("", "PENDING", "RUNNING") and time.monotonic() < deadline, f"{why}: {state}"
        time.sleep(0.5)
    return time.monotonic() - crashed


def test_a_three_node_job_goes_on_without_a_lost_node_stops_when_none_is_left_and_resumes_exactly(
    slurm: LocalSlurm,
    sft_model: Path,
    completed: tuple[Path, Path, str, subprocess.CompletedProcess[str]],
    tmp_path: Path,
) -> None:
    """``--nodes 3``: the Ray head on the first node, workers joining from the other two over the bridge,
    the trainer as the driver; nodes crash for real (link down, every process on them killed).

    1. On the nodes' second network (``pipeline.network_interface=eth1``: Ray's addresses, so the stores
       and gloo, there; Slurm's on the first). Each node offers Ray 4 CPUs, a trainer rank takes 2: both
       ranks on one node, the engine and the reward worker on the head's, the third node spare. After
       the step-2 checkpoint the ranks' node crashes; once Ray counts it dead, the group is rebuilt on
       the spare node inside the job, which says it goes on without the lost node. That node then
       crashes too: the nodes left cannot hold a group, and the run stops naming it and what it held
       (``sacct`` FAILED).
    2. The nodes come back; the job is resumed through the launcher with 2 CPUs a node, so its two ranks
       run on two nodes (gloo across the bridge) and the engine on the third (the weight push crosses
       nodes). A rank's node has its link cut for 30 s: the run goes on when it is back, or Ray counts
       the node dead and the run stops naming it (Ray 2.60's health check, measured: both happen); then
       ``--resume`` once more. No wait hangs.
    Every step equals the one-node job's."""
    net = slurm.net
    assert net is not None
    run, jobs = tmp_path / "run", tmp_path / "jobs"
    log = jobs / "cut" / "logs" / "ray-job.log"
    fast = [arg for env in FAST_HEALTH for arg in ("--env", env)]
    data = "pipeline.network_interface=eth1"  # Ray, the stores and gloo on the nodes' second network
    spare = ["pipeline.cpus_per_rank=2", data, "--env", "CPUS_PER_WORKER=4", "--nodes", str(NODES), *fast]
    r = mars_launch(slurm, tmp_path, *tiny_job(sft_model, run, jobs, "cut", *spare))
    assert r.returncode == 0, explain(r, jobs, slurm)
    first = submitted_id(r.stdout)
    wait_for(run / "ckpt" / "step_000002" / "trainer_state.json", "", slurm, first, explain(r, jobs, slurm))
    batch = next((jobs / "cut" / "logs").glob(f"sbatch_mars-cut_{first}.out")).read_text()
    assert "[mars] Ray head on mars-node1 (10.214.0.1:6379)" in batch, batch[-3000:]
    placement = next(line for line in log.read_text().splitlines() if line.startswith("placement: "))
    ranks, engines = (part.split(" on ")[1].split(", ") for part in placement[11:].split("; "))
    assert len(set(ranks)) == 1 and engines == ["10.214.0.1"], placement
    packed = int(ranks[0].rsplit(".", 1)[1])
    other = 5 - packed  # the spare node: 2 or 3
    try:
        said = f"node mars-node{packed} (10.214.0.{packed}) is lost (Ray counts it dead): the nodes left"
        went_on = crash(slurm, packed, first, log, said, explain(r, jobs, slurm))
        wait_for(log, "trainer group rebuilt in", slurm, first, explain(r, jobs, slurm))
        said = f"mars train: error: node mars-node{other} (10.214.0.{other}) is lost (Ray counts it dead)"
        stopped = crash(slurm, other, first, log, said, explain(r, jobs, slurm))
        assert slurm.wait_done(first, 120) == ("FAILED", "1:0"), explain(r, jobs, slurm)
    finally:
        for node in (packed, other):
            net.link(node, up=True)
        slurm.start_nodes([packed, other])
    trainer = log.read_text()
    assert (
        "it held trainer rank 0, trainer rank 1. The nodes left cannot hold what must start again" in trainer
    )
    print(f"node {packed} crashed: the run went on without it after {went_on:.1f} s; node {other} crashed: "
          f"the run stopped naming it after {stopped:.1f} s")  # fmt: skip
    assert went_on < 60 and stopped < 60, (went_on, stopped)  # Ray's verdict (15-20 s here), then at once

    spread = ["pipeline.cpus_per_rank=2", "--env", "CPUS_PER_WORKER=2", "--nodes", str(NODES)]
    r = mars_launch(slurm, tmp_path, *tiny_job(sft_model, run, jobs, "cut", *spread), "--resume")
    assert r.returncode == 0, explain(r, jobs, slurm)
    second = submitted_id(r.stdout)
    wait_for(log, "resumed from", slurm, second, explain(r, jobs, slurm))
    placement = [line for line in log.read_text().splitlines() if line.startswith("placement: ")][-1]
    ranks, engines = (part.split(" on ")[1].split(", ") for part in placement[11:].split("; "))
    assert len(set(ranks)) == 2 and not set(ranks) & set(engines), placement
    cut = int(ranks[0].rsplit(".", 1)[1])
    started = time.monotonic()
    net.link(cut, up=False)
    try:
        time.sleep(30)
    finally:
        net.link(cut, up=True)
    state = slurm.wait_done(second, 600)
    took = time.monotonic() - started
    print(f"node {cut}'s link down for 30 s: the job ended {state[0]} {took:.1f} s after the cut")
    if state != ("COMPLETED", "0:0"):  # Ray counted the node dead: the run stopped naming it
        assert state == ("FAILED", "1:0"), explain(r, jobs, slurm)
        assert f"mars train: error: node mars-node{cut} (10.213.0.{cut}) is lost" in log.read_text()
        r = mars_launch(
            slurm, tmp_path, *tiny_job(sft_model, run, jobs, "cut", *spread), "--resume", "--wait"
        )
        assert r.returncode == 0, explain(r, jobs, slurm)
        second = submitted_id(r.stdout)
    assert slurm.state(second) == ("COMPLETED", "0:0")
    allocated = slurm.run("sacct", "-j", second, "-X", "-n", "-P", "-o", "NodeList").stdout.strip()
    assert allocated == f"mars-node[1-{NODES}]"
    batch = next((jobs / "cut" / "logs").glob(f"sbatch_mars-cut_{second}.out")).read_text()
    assert f"[mars] all {NODES} Ray node(s) joined" in batch, batch[-3000:]
    got, want = read_metrics(run / "metrics.jsonl"), read_metrics(completed[0] / "metrics.jsonl")
    assert [rec["step"] for rec in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want, strict=True):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}, a["step"]
    # every step trained the samples the one-node job's did: none lost, none trained twice
    assert trained_ids(run / "rollouts") == trained_ids(completed[0] / "rollouts")


def test_slurm_refuses_an_unknown_account_at_submission(slurm: LocalSlurm, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    args = tiny_job(tmp_path / "m", tmp_path / "run", jobs, "acct")
    args[args.index("--account") + 1] = "nobody"
    r = mars_launch(slurm, tmp_path, *args)
    assert r.returncode == 1
    assert "mars launch: error: sbatch --parsable" in r.stderr
    assert "Invalid account or account/partition combination specified" in r.stderr


def test_short_options_glued_to_equals_name_another_account(slurm: LocalSlurm) -> None:
    """Why mars launch rewrites NeMo-Run's ``-A=<account> -p=<partition>`` into long options: Slurm reads
    a short option's value as the rest of its word, so ``-A=acme`` asks for the account ``=acme``."""
    glued = slurm.run("srun", f"-A={ACCOUNT}", "true", check=False)
    assert glued.returncode != 0 and "Invalid account" in glued.stderr
    long = slurm.run("srun", f"--account={ACCOUNT}", f"--partition={PARTITION}", "true", check=False)
    assert long.returncode == 0, long.stderr
