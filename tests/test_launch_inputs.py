"""``mars launch --executor slurm``: no argument can put shell text into the sbatch script NeMo-Run renders.

Values pasted into the script unquoted (account, partition, time, container image and mounts, job name,
job directory) are refused unless they match a strict pattern, before anything is written; values that may
hold anything (``--env`` values, overrides, ``--resume``) are shell-quoted, which the script run with the
stand-in Slurm tools of :mod:`tests.test_launch` shows. The ``srun`` lines ask for the account and partition
with long options (NeMo-Run writes ``-A=acct``, the account ``=acct`` to Slurm).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from mars_megatron.launch import nemo
from tests.test_launch import (
    ALL_TRAINER,
    FAKES,
    IMAGE,
    Q30B,
    VENV_FAKES,
    VENV_TOOLS,
    fake_venv,
    launch,
    needs_launch_env,
    run_script,
)

HOSTILE = ["acct;touch X;#", "$(touch X)", "`touch X`", "a b", "acct\ntouch X", "--foo", ""]
# each flag with a legitimate value; a test swaps one of them for a hostile one
GOOD = {
    "--account": "acme_llm",
    "--partition": "batch",
    "--time": "04:00:00",
    "--container-image": IMAGE,
    "--container-mounts": "/lustre/data:/data",
    "--job-name": "q30",
}


def argv(tmp: Path, **values: str) -> list[str]:
    """A Slurm dry-run command line, ``values`` (flag without dashes, '_' for '-') replacing the good ones."""
    flags = {**GOOD, **{f"--{k.replace('_', '-')}": v for k, v in values.items()}}
    return [
        Q30B, *ALL_TRAINER, "--executor", "slurm", "--nodes", "1", "--gpus-per-node", "8",
        *(f"{flag}={value}" for flag, value in flags.items()), "--job-dir", str(tmp / "jobs"), "--dry-run",
    ]  # fmt: skip


def parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    nemo.add_arguments(parser)
    return parser.parse_args(args)


# (--job-dir, "--foo") is left out: a relative "--foo" is the harmless folder <job dir>/--foo
CASES = [(f, v) for f in [*GOOD, "--job-dir"] for v in HOSTILE if (f, v) != ("--job-dir", "--foo")]


@pytest.mark.parametrize(("flag", "value"), CASES, ids=repr)
def test_hostile_values_are_refused_before_anything_is_written(
    flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))  # should a regression launch anything
    if flag == "--job-dir":
        args = [*argv(tmp_path), f"--job-dir={tmp_path / 'jobs'}/{value}" if value else "--job-dir="]
    else:
        args = argv(tmp_path, **{flag[2:].replace("-", "_"): value})
    rc = nemo.main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("mars launch: error:") and flag in err, err
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "nemorun").exists()


def test_hostile_mount_among_good_ones_and_hostile_paths_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for mounts in ("/a:/b,/c:/d;touch X", "/a:/b:ro,rw", "a:/b", "/a:b", "/a", "/a:/b:ro:x", "/a:/b,"):
        rc = nemo.main(argv(tmp_path, container_mounts=mounts))
        assert rc == 2 and f"--container-mounts {mounts!r}" in capsys.readouterr().err, mounts
    for time in ("1:00:00:00", "1-", "-1", "1:00;id", "1h"):
        rc = nemo.main(argv(tmp_path, time=time))
        assert rc == 2 and f"--time {time!r}" in capsys.readouterr().err, time
    for image in ("/img.sqsh;id", "nvcr.io/a b", "-nvcr.io/x", "#x"):
        rc = nemo.main(argv(tmp_path, container_image=image))
        assert rc == 2 and "--container-image" in capsys.readouterr().err, image
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a$(b)").mkdir()
    monkeypatch.chdir(tmp_path / "a$(b)")  # the launch directory is the Slurm workdir and a mount
    args = [str(Path(nemo.REPO) / a) if a == Q30B else a for a in argv(tmp_path)]
    rc = nemo.main(args)
    assert rc == 2 and "the launch directory goes into the Slurm script" in capsys.readouterr().err
    assert not (tmp_path / "jobs").exists()


def test_legitimate_values_are_accepted(tmp_path: Path) -> None:
    for time in ("30", "30:00", "04:00:00", "2-00", "2-12:30", "2-12:30:00", "UNLIMITED"):
        assert nemo.build_spec(parse(argv(tmp_path, time=time))).time == time
    for image in (IMAGE, "nvcr.io#nvidia/pytorch:25.01-py3", "docker://ghcr.io/acme/mars:1.0",
                  "/lustre/images/mars.sqsh", f"nvcr.io/acme/mars@sha256:{'0' * 64}"):  # fmt: skip
        assert nemo.build_spec(parse(argv(tmp_path, container_image=image))).container_image == image
    spec = nemo.build_spec(parse(argv(tmp_path, container_mounts="/a/b:/c:ro,/d-1.x:/e_2+")))
    assert spec.container_mounts == ("/a/b:/c:ro", "/d-1.x:/e_2+")
    assert (
        nemo.build_spec(parse(argv(tmp_path, account="a.b-c_1", partition="gpu-h100"))).account == "a.b-c_1"
    )


# ------------------------------------------------------------------ the script NeMo-Run renders, and runs


def render(tmp: Path, *extra: str) -> Path:
    r = launch(*argv(tmp), *extra, env={"NEMORUN_HOME": str(tmp / "nemorun")})
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return Path(r.stdout.strip().splitlines()[-1])


@needs_launch_env
def test_srun_lines_ask_for_the_account_and_partition_with_long_options(tmp_path: Path) -> None:
    lines = render(tmp_path).read_text().splitlines()
    ray_steps = [line for line in lines if line.lstrip().startswith("srun --container-image=")]
    assert len(ray_steps) == 2  # the head, and the workers' loop
    for line in ray_steps:
        assert line.lstrip().startswith(
            f"srun --container-image={IMAGE} --no-container-mount-home --mpi=pmix --account=acme_llm "
            "--partition=batch --gres=gpu:8 --container-mounts /lustre/data:/data,"
        ), line
    assert not any(" -A=" in line or " -p=" in line for line in lines)
    assert "#SBATCH --account=acme_llm" in lines and "#SBATCH --partition=batch" in lines


# the stand-in srun runs the driver command as the real one would (bash -c on the head node), and a stand-in
# mars records the arguments it gets
RUN_DRIVER = {
    **FAKES,
    "srun": FAKES["srun"].replace('printf \'%s\' "${@: -1}" > "$FAKE_DRIVER"', 'bash -c "${@: -1}"'),
    "mars": 'printf "%s\\n" "$@" > "$FAKE_DRIVER"',
}
VENV_RUN_DRIVER = {
    **VENV_FAKES,
    "srun": VENV_FAKES["srun"].replace('printf \'%s\' "${@: -1}" > "$FAKE_DRIVER"', 'bash -c "${@: -1}"'),
}


@needs_launch_env
@pytest.mark.parametrize("mode", ["container", "venv"])
def test_quoted_values_stay_text_when_the_script_runs(mode: str, tmp_path: Path) -> None:
    assert RUN_DRIVER["srun"] != FAKES["srun"] and VENV_RUN_DRIVER["srun"] != VENV_FAKES["srun"]
    marker = tmp_path / "pwned"
    hostile = f"$(touch {marker}) `touch {marker}`; touch {marker} #'\"\n"
    override = f"logging.run_dir=runs/$(touch {marker})`touch {marker}`;touch {marker}"
    extra = [override, "--env", f"NOTE={hostile}", "--resume", f"$(touch {marker})"]
    if mode == "container":
        script, tools = render(tmp_path, *extra), RUN_DRIVER
    else:  # container-less: the stand-in mars sits in the environment the script activates
        venv = fake_venv(tmp_path, {**VENV_TOOLS, "mars": RUN_DRIVER["mars"]})
        args = [a for a in argv(tmp_path) if not a.startswith(("--container-image=", "--container-mounts="))]
        r = launch(*args, *extra, "--venv", str(venv), env={"NEMORUN_HOME": str(tmp_path / "nemorun")})
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        script, tools = Path(r.stdout.strip().splitlines()[-1]), VENV_RUN_DRIVER
    _, driver = run_script(script, tmp_path, tools, nodes=1, nodelist="node001")
    assert driver.read_text().splitlines() == [
        "train", Q30B, *ALL_TRAINER, override, "--nproc", "8", "--resume", f"$(touch {marker})"
    ]  # fmt: skip
    assert f"export NOTE={shlex.quote(hostile)}" in script.read_text()
    assert not marker.exists()
