"""``mars launch`` on NeMo-Run: bad input is refused before anything starts; the Slurm job script NeMo-Run
renders (Ray head on the first node, workers on the others, then ``mars train``) for 1, 2 and 16 nodes,
checked as text and executed with stand-ins for srun/scontrol; submission through a stand-in sbatch; the
local executor running the tiny job end to end.

NeMo-Run lives in ``.venv-launch`` (``scripts/setup_launch.sh``; CI creates it): the launcher is run here
as ``python -m mars_megatron.launch.nemo`` in the main environment, which re-runs itself there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mars_megatron.config import ConfigError, load_config
from mars_megatron.launch import nemo
from mars_megatron.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
Q30B = "examples/qwen3_30b_a3b.yaml"  # tp 4, pp 2, cp 4, ep 8: trainer ranks must be a multiple of 32
# The recipe's engines take 32 GPUs of their own (disaggregated); on fewer nodes every GPU is a trainer rank,
# shared with 2 colocated engines of 4 GPUs, in a layout without pipeline and context parallelism (tp 4,
# ep 8: any multiple of 8 ranks)
ALL_TRAINER = ("pipeline.placement=colocated", "pipeline.rollout_workers=2", "parallel.pp=1", "parallel.cp=1")
TINY = REPO / "examples" / "tiny_cpu.yaml"
DATA = REPO / "examples" / "data" / "arith_train.jsonl"
IMAGE = "nvcr.io/acme/mars:26.08"
needs_launch_env = pytest.mark.skipif(
    not nemo.LAUNCH_PYTHON.exists(), reason=".venv-launch is missing: run scripts/setup_launch.sh"
)


def launch(*args: str | Path, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: int = 120):
    return subprocess.run(
        [sys.executable, "-m", "mars_megatron.launch.nemo", *map(str, args)],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def slurm_args(nodes: int, tmp: Path, *extra: str) -> list[str]:
    return [
        Q30B, *ALL_TRAINER, "train.steps=3", "algorithm.role_weights={verifier: 2}", "--executor", "slurm",
        "--nodes", str(nodes), "--gpus-per-node", "8", "--account", "acme_llm", "--partition", "batch",
        "--container-image", IMAGE, "--container-mounts", "/lustre/data:/data", "--env", "HF_HOME=/data/hf",
        "--env", "NOTE=two words", "--env", "RAY_health_check_period_ms=1000", "--cpus-per-node", "96",
        "--job-name", f"q30-{nodes}", "--job-dir", str(tmp / "jobs"), *extra,
    ]  # fmt: skip


# `log LINE`: append one line to $FAKE_LOG under a lock. The script's steps run at once, and a long line
# (a Ray head's command) is written in several writes, which two unlocked steps interleaved on a loaded
# machine.
LOG_LINE = """log() { { flock 9; printf '%s\\n' "$1" >> "$FAKE_LOG"; } 9>> "$FAKE_LOG.lock"; }"""


def fake_tools(tmp: Path, scripts: dict[str, str]) -> str:
    """A PATH whose first folder holds a bash script per name (stand-ins for the Slurm tools)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{LOG_LINE}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


# ------------------------------------------------------------------ bad input: refused before any start


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = nemo.main(list(argv))
    return rc, capsys.readouterr().err


def test_slurm_without_account_or_image_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_main(capsys, Q30B, "--executor", "slurm", "--partition", "batch", "--dry-run")
    assert rc == 2
    assert err.startswith("mars launch: error:") and "--account" in err and "--partition" not in err
    rc, err = run_main(capsys, Q30B, "--executor", "slurm", "--dry-run")
    assert rc == 2 and "--account and --partition" in err
    rc, err = run_main(capsys, Q30B, "--executor", "slurm", "--account", "a", "--partition", "p", "--dry-run")
    assert rc == 2 and "needs either --container-image (every Ray node" in err and "or --venv" in err
    both = ["--container-image", IMAGE, "--venv", str(Path(sys.executable).parent.parent)]
    rc, err = run_main(capsys, Q30B, "--executor", "slurm", "--account", "a", "--partition", "p", *both)
    assert rc == 2 and "or --venv (container-less" in err and err.rstrip().endswith("not both")


def test_nodes_that_do_not_divide_the_layout_name_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    # pp 2 makes the layout need a multiple of 16 ranks (pp * lcm(tp, ep * etp) = 2 * 8); 3 x 8 = 24
    argv = [Q30B, *ALL_TRAINER, "parallel.pp=2", "--executor", "slurm", "--account", "a", "--partition", "p",
            "--container-image", IMAGE]  # fmt: skip
    rc, err = run_main(capsys, *argv, "--nodes", "3", "--gpus-per-node", "8", "--dry-run")
    assert rc == 2
    assert "parallel: --nodes 3 x --gpus-per-node 8: 24 trainer ranks" in err
    assert "not divisible by etp*ep = 1*8 = 8" in err
    rc, err = run_main(capsys, *argv, "--nodes", "2", "--gpus-per-node", "6", "--dry-run")
    assert rc == 2 and "12 trainer ranks" in err


def test_unknown_executor_and_local_misuse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        nemo.main([Q30B, "--executor", "kubernetes"])
    assert exc.value.code == 2
    assert "argument --executor: invalid choice: 'kubernetes'" in capsys.readouterr().err
    rc, err = run_main(capsys, Q30B, "--executor", "local", "--nodes", "2")
    assert rc == 2 and "--nodes 2: the local executor" in err
    rc, err = run_main(capsys, Q30B, "--executor", "local", "--account", "a")
    assert rc == 2 and "--account: only for --executor slurm" in err
    rc, err = run_main(capsys, Q30B, "--executor", "local", "--env", "1X=2")
    assert rc == 2 and "--env '1X=2'" in err
    rc, err = run_main(capsys, Q30B, "parallel.tp=0", "--executor", "local")
    assert rc == 2 and "parallel.tp: expected a positive int, got 0" in err


def test_disaggregated_engines_take_their_gpus_from_the_trainer(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = load_config(REPO / Q30B)  # 8 engines x rollout.tp 4, disaggregated
    assert nemo.trainer_world_size(recipe, 64) == 32
    assert nemo.trainer_world_size(load_config(REPO / Q30B, list(ALL_TRAINER)), 64) == 64
    per_role = load_config(REPO / Q30B, ["algorithm.policies=per_role"])  # 3 x 8 engines x 4 GPUs
    with pytest.raises(ConfigError, match=r"24 rollout engines x rollout\.tp 4 = 96 GPUs leave no trainer"):
        nemo.trainer_world_size(per_role, 64)
    argv = [Q30B, "--executor", "slurm", "--account", "a", "--partition", "p", "--container-image", IMAGE]
    rc, err = run_main(capsys, *argv, "--nodes", "4", "--dry-run")  # 32 GPUs: all taken by the engines
    assert rc == 2 and "--nodes 4 x --gpus-per-node 8: 8 rollout engines x rollout.tp 4" in err


def test_arguments_survive_the_rerun_in_the_launch_env(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    nemo.add_arguments(parser)
    args = parser.parse_args(slurm_args(2, tmp_path, "--resume", "--time", "1:00:00", "--dry-run"))
    assert parser.parse_args(nemo._argv(args)) == args
    venv = [a for a in slurm_args(1, tmp_path) if a not in ("--container-image", IMAGE)]
    args = parser.parse_args([*venv, "--venv", "/shared/venv", "--wait", "--gpus-per-node", "0"])
    assert parser.parse_args(nemo._argv(args)) == args


def test_missing_launch_env_names_the_setup_script(tmp_path: Path) -> None:
    if nemo.importlib.util.find_spec("nemo_run") is not None:
        pytest.skip("NeMo-Run is importable here: nothing is re-run")
    r = launch(*slurm_args(1, tmp_path, "--dry-run"), env={"MARS_LAUNCH_PYTHON": str(tmp_path / "none")})
    assert r.returncode == 2
    assert "run scripts/setup_launch.sh" in r.stderr and "MARS_LAUNCH_PYTHON" in r.stderr


# ------------------------------------------------------------------ the Slurm script, rendered by NeMo-Run


def render(nodes: int, tmp: Path) -> str:
    r = launch(*slurm_args(nodes, tmp, "--dry-run"), env={"NEMORUN_HOME": str(tmp / "nemorun")})
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path == tmp / "jobs" / f"q30-{nodes}" / "ray.sub"
    return path.read_text()


def train_line(nodes: int) -> list[str]:
    return ["mars", "train", Q30B, *ALL_TRAINER, "train.steps=3", "algorithm.role_weights={verifier: 2}",
            "--nproc", str(8 * nodes)]  # fmt: skip


@needs_launch_env
@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_slurm_script_contents(nodes: int, tmp_path: Path) -> None:
    script = render(nodes, tmp_path)
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for flag in (f"--nodes={nodes}", "--gpus-per-node=8", "--ntasks-per-node=1", "--account=acme_llm",
                 "--partition=batch", f"--job-name=mars-q30-{nodes}", "--time=04:00:00"):  # fmt: skip
        assert f"#SBATCH {flag}" in sbatch, (flag, sbatch)
    assert "export HF_HOME=/data/hf" in script and "export NOTE='two words'" in script
    # a name keeps its case (NeMo-Run upper-cases its own; Ray reads its settings by exact name)
    assert "export RAY_health_check_period_ms=1000" in script and "RAY_HEALTH" not in script
    assert "export CPUS_PER_WORKER=96" in script
    assert "export RAY_AUTH_MODE=token" in script and "export RAY_AUTH_TOKEN" in script
    # the node list: the head is the allocation's first node, a worker starts on each of the others
    assert 'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script
    assert "head_node=${nodes_array[0]}" in script
    assert "ray start --head" in script and 'ray start --address "$ip_head"' in script
    assert "for ((i = 1; i < SLURM_JOB_NUM_NODES; i++)); do" in script
    # every Ray node runs in the pyxis container with the GPUs, the mounts and the launch directory
    srun = next(line for line in script.splitlines() if line.startswith("srun") and "ray-head" in line)
    assert f"--container-image={IMAGE}" in srun and "--gres=gpu:8" in srun
    mounts = re.search(r"--container-mounts (\S+)", srun).group(1).split(",")
    assert mounts[:2] == ["/lustre/data:/data", f"{REPO}:{REPO}"]
    assert f"--container-workdir={REPO}" in srun
    # the trainer: mars train as the Ray driver on the head node, pointed at the cluster
    command = next(line for line in script.splitlines() if line.startswith('COMMAND="${COMMAND:-'))
    assert "export RAY_ADDRESS=$ip_head && mars train examples/qwen3_30b_a3b.yaml" in command
    assert f"--nproc {8 * nodes}" in command


# Stand-ins for the Slurm tools the script calls: each logs its arguments; srun keeps the Ray head/worker
# steps alive (the script checks they are) and records the driver command it is given.
FAKES = {
    "scontrol": """if [ "$1 $2" = "show hostnames" ]; then for i in $(seq 1 "$SLURM_JOB_NUM_NODES"); do
  printf 'node%03d\\n' "$i"; done; else echo '{"jobs": [{"current_working_directory": "/w"}]}'; fi""",
    "host": """echo "$1 has address 10.0.0.$((10#${1#node}))\"""",
    "jq": """if [ "$1" = -r ]; then cat >/dev/null; echo /w; fi""",  # reads its pipe: no SIGPIPE upstream
    "sleep": "true",
    "srun": """log "auth=$RAY_AUTH_MODE:$RAY_AUTH_TOKEN $(printf '%q ' "$@")"  # a line a call
case "$*" in
  *"ray status"*) echo " 0.0/$((8 * SLURM_JOB_NUM_NODES)).0 worker_units" ;;
  *"bash -x -c"*) exec /bin/sleep 30 ;;
  *"bash -c"*) printf '%s' "${@: -1}" > "$FAKE_DRIVER" ;;
esac""",
}


def run_script(
    script: Path, tmp_path: Path, tools: dict[str, str], nodes: int, nodelist: str | None = None
) -> tuple[Path, Path]:
    """Run the sbatch script ``script`` with the stand-in Slurm ``tools`` as a job of ``nodes`` nodes and
    assert it exits 0; returns the srun log and the file the driver command is recorded in."""
    log, driver = tmp_path / "srun.log", tmp_path / "driver.txt"
    nodelist = nodelist or f"node[001-{nodes:03d}]"
    env = {"PATH": fake_tools(tmp_path, tools), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": nodelist, "SLURM_CPUS_ON_NODE": "16", "FAKE_LOG": str(log),
           "FAKE_DRIVER": str(driver),
           "HOME": str(tmp_path)}  # fmt: skip
    with open(tmp_path / "out.txt", "w") as out:  # a file: the background steps keep a pipe open
        proc = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            proc.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the stand-in Ray steps may still sleep
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (tmp_path / "out.txt").read_text()[-3000:]
    return log, driver


@needs_launch_env
@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_slurm_script_starts_head_then_workers_then_the_trainer(nodes: int, tmp_path: Path) -> None:
    script = tmp_path / "ray.sub"
    script.write_text(render(nodes, tmp_path))
    log, driver = run_script(script, tmp_path, FAKES, nodes)
    steps = log.read_text().splitlines()
    head = [s for s in steps if "--container-name=ray-head" in s and "bash -x -c" in s]
    workers = [s for s in steps if "--container-name=ray-worker-" in s]
    assert len(head) == 1 and "-w node001" in head[0]
    worker_nodes = sorted(re.search(r"-w (\S+)", s).group(1) for s in workers)  # logged as they start
    assert worker_nodes == [f"node{i:03d}" for i in range(2, nodes + 1)]
    for step in head + workers:
        assert (
            f"--container-image={IMAGE}" in step and "--gres=gpu:8" in step and "--cpus-per-task=96" in step
        )
    # the driver: on the head node, in the head's container, after every worker joined
    run_step = [s for s in steps if "bash -c" in s and "bash -x -c" not in s]
    assert len(run_step) == 1 and "-w node001" in run_step[0] and "--container-name=ray-head" in run_step[0]
    # one Ray token for every step of the job, drawn when it starts and kept out of its trace
    tokens = {s.split()[0] for s in steps}
    assert len(tokens) == 1 and re.fullmatch(r"auth=token:[0-9a-f]{64}", tokens.pop())
    trace = (tmp_path / "out.txt").read_text()
    assert steps[0].split()[0].split(":")[1] not in trace
    ready = trace.index(f"Number of actors online: {8 * nodes}/{8 * nodes}")
    assert trace.index("All workers connected!") > ready
    assert trace.index("--gpus=0 --overlap --container-name=ray-head") > ready
    assert shlex.split(driver.read_text()) == [
        "export", "RAY_ADDRESS=10.0.0.1:6379", "&&", *train_line(nodes)
    ]  # fmt: skip


def fake_venv(tmp: Path, tools: dict[str, str]) -> Path:
    """A stand-in virtual environment: ``bin/activate`` puts its ``bin`` first on PATH, which holds a bash
    script per name of ``tools``."""
    venv = tmp / "venv"
    (venv / "bin").mkdir(parents=True)
    activate = f'export VIRTUAL_ENV={venv}\nexport PATH="$VIRTUAL_ENV/bin:$PATH"\n'
    (venv / "bin" / "activate").write_text(activate)
    for name, body in tools.items():
        (venv / "bin" / name).write_text(f"#!/bin/bash\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    return venv


# Container-less (--venv): the script asks Slurm for each node's address and Ray (from the environment)
# for the nodes that joined; srun runs `ray start` on the nodes and the driver command on the head.
VENV_FAKES = {
    "scontrol": """case "$1 $2" in
  "show hostnames") for i in $(seq 1 "$SLURM_JOB_NUM_NODES"); do printf 'node%03d\\n' "$i"; done ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.$((10#${3#node})) NodeHostName=$3" ;;
esac""",
    "sleep": "true",
    "srun": """log "auth=$RAY_AUTH_MODE:$RAY_AUTH_TOKEN v=$VIRTUAL_ENV $(printf '%q ' "$@")"
case "$*" in
  *"ray start"*) exec /bin/sleep 30 ;;
  *"bash -c"*) printf '%s' "${@: -1}" > "$FAKE_DRIVER" ;;
esac""",
}
# a node has joined once its `ray start` step has started
VENV_TOOLS = {"ray": 'echo " 0.0/$(grep -c \'ray start\' "$FAKE_LOG").0 mars_node"', "mars": "true"}


@needs_launch_env
@pytest.mark.parametrize("nodes", [1, 3])
def test_venv_script_starts_head_then_workers_then_the_trainer(nodes: int, tmp_path: Path) -> None:
    venv = fake_venv(tmp_path, VENV_TOOLS)
    argv = [Q30B, *ALL_TRAINER, "train.steps=3", "--executor", "slurm", "--nodes", str(nodes),
            "--gpus-per-node", "8", "--account", "acme_llm", "--partition", "batch", "--venv", str(venv),
            "--job-name", "q30v", "--job-dir", str(tmp_path / "jobs"), "--dry-run"]  # fmt: skip
    r = launch(*argv, env={"NEMORUN_HOME": str(tmp_path / "nemorun")})
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    script = Path(r.stdout.strip().splitlines()[-1])
    text = script.read_text()
    for flag in ("--exclusive", f"--nodes={nodes}", "--gpus-per-node=8", "--account=acme_llm"):
        assert f"#SBATCH {flag}" in text.splitlines(), flag
    assert "--container" not in text and "-A=" not in text and "export GPUS_PER_NODE=8" in text
    log, driver = run_script(script, tmp_path, VENV_FAKES, nodes)
    steps = log.read_text().splitlines()
    assert len({s.split()[0] for s in steps}) == 1  # one Ray token for every step
    assert all(f" v={venv} " in s for s in steps)  # the environment, activated in the batch script
    head = [s for s in steps if "ray start --head" in s]
    assert len(head) == 1 and "-w node001" in head[0] and "--node-ip-address=10.0.0.1" in head[0]
    assert "--cpus-per-task=16 --gres=gpu:8" in head[0] and "--num-gpus=8" in head[0]
    workers = [s for s in steps if "ray start --address=10.0.0.1:6379" in s]
    assert sorted(re.search(r"-w (\S+)", s).group(1) for s in workers) == [
        f"node{i:03d}" for i in range(2, nodes + 1)
    ]
    for i, s in enumerate(sorted(workers), 2):
        assert f"--node-ip-address=10.0.0.{i}" in s
    run_step = [s for s in steps if "bash -c" in s]
    assert len(run_step) == 1 and "-w node001" in run_step[0] and "--overlap" in run_step[0]
    assert f"--chdir={REPO}" in run_step[0] and "--gpus=0" in run_step[0]
    trace = (tmp_path / "out.txt").read_text()
    assert trace.index(f"[mars] all {nodes} Ray node(s) joined") < trace.index(
        "mars train exited with status 0"
    )
    assert shlex.split(driver.read_text())[:4] == ["export", "RAY_ADDRESS=10.0.0.1:6379", "&&", "mars"]


def test_venv_must_be_an_environment_at_a_safe_absolute_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    venv = fake_venv(tmp_path, VENV_TOOLS)
    base = [
        Q30B,
        "--executor",
        "slurm",
        "--account",
        "a",
        "--partition",
        "p",
        "--job-dir",
        str(tmp_path / "j"),
    ]
    for value in ("venv", f"{venv};touch X", f"{tmp_path}/$(id)", f"{venv} x", str(tmp_path / "none")):
        rc, err = run_main(capsys, *base, "--venv", value, "--dry-run")
        assert rc == 2 and f"--venv {value!r}" in err, (value, err)
    rc, err = run_main(capsys, *base, "--venv", str(tmp_path / "none"), "--dry-run")
    assert "missing bin/activate, bin/ray, bin/mars" in err
    rc, err = run_main(capsys, *base, "--venv", str(venv), "--container-mounts", "/a:/b", "--dry-run")
    assert rc == 2 and "--container-mounts: only with --container-image" in err
    assert not (tmp_path / "j").exists()


@needs_launch_env
def test_slurm_submission_through_sbatch(tmp_path: Path) -> None:
    fakes = {"sbatch": f'echo "$*" > {tmp_path}/sbatch.args; echo 4242', "squeue": "true"}  # none queued
    env = {"PATH": fake_tools(tmp_path, fakes), "NEMORUN_HOME": str(tmp_path / "nemorun")}
    r = launch(*slurm_args(2, tmp_path), env=env)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    script = tmp_path / "jobs" / "q30-2" / "ray.sub"
    assert f"submitted Slurm job 4242: script {script}" in r.stdout
    assert (tmp_path / "sbatch.args").read_text().split() == ["--parsable", str(script)]
    assert "#SBATCH --nodes=2" in script.read_text()


@needs_launch_env
def test_slurm_submission_failure_is_reported(tmp_path: Path) -> None:
    fakes = {"sbatch": "echo 'sbatch: error: Invalid account' >&2; exit 1", "squeue": "true"}
    env = {"PATH": fake_tools(tmp_path, fakes), "NEMORUN_HOME": str(tmp_path / "nemorun")}
    r = launch(*slurm_args(1, tmp_path), env=env)
    assert r.returncode == 1
    assert "mars launch: error: sbatch --parsable" in r.stderr and "Invalid account" in r.stderr
    env["PATH"] = str(tmp_path / "empty")  # no Slurm tools at all
    r = launch(*slurm_args(1, tmp_path), env=env)
    assert r.returncode == 2 and "sbatch and squeue not found" in r.stderr and "--dry-run" in r.stderr


# ------------------------------------------------------------------ the local executor, end to end


@needs_launch_env
def test_local_executor_runs_the_tiny_job(sft_model: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = launch(
        TINY, f"model.mcore_dir={sft_model}", f"data.train_file={DATA}", f"logging.run_dir={run_dir}",
        "train.steps=2", "data.problems_per_step=4", "logging.tensorboard=false", "--executor", "local",
        "--job-dir", tmp_path / "jobs", env={"NEMORUN_HOME": str(tmp_path / "nemorun")}, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert [rec["step"] for rec in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    steps = [line.split()[2] for line in r.stdout.splitlines() if re.match(r"tiny_cpu/0 step ", line)]
    assert steps == ["1/2", "2/2"], r.stdout  # the trainer's progress lines, streamed through NeMo-Run


@needs_launch_env
def test_local_executor_reports_a_failed_run(tmp_path: Path) -> None:
    r = launch(TINY, f"model.mcore_dir={tmp_path / 'absent'}", "--executor", "local", "--job-dir",
               tmp_path / "jobs", env={"NEMORUN_HOME": str(tmp_path / "nemorun")})  # fmt: skip
    assert r.returncode == 2, f"{r.stdout}\n{r.stderr}"  # mars train's own exit status for bad input
    assert "mars train: error: model.mcore_dir:" in r.stdout and "no such directory" in r.stdout


def test_the_trainer_joins_the_cluster_that_ray_address_names() -> None:
    """In a Slurm job the Ray cluster is up before `mars train` starts: the trainer joins it as the driver
    (RAY_ADDRESS) instead of starting its own, and refuses one too small for its actors."""
    import contextlib
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray_cli is not None
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0123456789abcdef" * 2}
    # --block: the head lives in this process group, so stopping it stops only this cluster (`ray stop`
    # would stop every Ray on the machine)
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--port=6391", "--num-cpus=4", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        probe = (
            "import time\nfrom mars_megatron.pipeline.trainer import _start_ray\nimport ray\n"
            "for attempt in range(60):\n    try:\n        own = _start_ray(2, 3, 3.0); break\n"
            "    except ConnectionError:\n        time.sleep(1)\n"
            "print('own', own, ray.cluster_resources()['CPU'])\n"
            "try:\n    ray.shutdown(); _start_ray(2, 5, 5.0)\n"
            "except RuntimeError as e:\n    print('refused', e)\n"
        )
        out = subprocess.run([sys.executable, "-c", probe], env={**env, "RAY_ADDRESS": "127.0.0.1:6391"},
                             capture_output=True, text=True, timeout=180)  # fmt: skip
        assert "own False 4.0" in out.stdout, out.stdout + out.stderr
        assert "refused the Ray cluster this process is connected to has 4 CPUs" in out.stdout
    finally:
        # SIGKILL, not SIGTERM: the head's orderly stop took 33 of this test's 38 s. Its session is this
        # cluster alone (Ray's workers take process groups of their own, not sessions).
        for pid in [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]:
            with contextlib.suppress(OSError):
                if os.getsid(pid) == head.pid:
                    os.kill(pid, signal.SIGKILL)
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
