"""Experiment trackers (``logging.backends``) against the real libraries, read back from what they wrote:
W&B's offline transaction log (``run-<id>.wandb``, decoded with W&B's own record schema) and its ``files/``
folder, MLflow's store through ``MlflowClient``. Offline throughout: the runner has no network."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from mars_megatron.config import ConfigError, load_config
from mars_megatron.metrics import METRICS_FILE, MetricsSink, read_metrics
from mars_megatron.metrics.tracker_mlflow import mlflow_client, mlflow_name
from mars_megatron.metrics.trackers import STATE_FILE, MlflowSpec, TensorBoardSpec, WandbSpec, flatten
from mars_megatron.pipeline.tracking import check_trackers, tracker_specs

CONFIG = {
    "train": {"steps": 4, "lr": 1e-5},
    "agents": {"roles": ["solver", "verifier"]},
    "model": {"fp8": None},
}


def metrics(step: int) -> dict[str, float]:
    return {
        "reward/solver": 0.1 * step,
        "reward/verifier": 0.5,
        "train/loss": float("nan") if step == 2 else -0.01 * step,
        "samples": 8,
        "samples/solver": 4,  # a name that is also the folder of another: MLflow's file store needs care
    }


def run_sink(run: Path, steps: range, *, resume_step: int = 0, **trackers: Any) -> MetricsSink:
    """A sink over ``run`` with W&B and MLflow (offline), the config file the trainer writes, an
    evaluation before step 1 with its summary file, and ``steps`` logged."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("train:\n  steps: 4\n")
    specs = trackers.get("specs", [WandbSpec("mars-test"), MlflowSpec()])
    with MetricsSink(
        run, trackers=specs, config=CONFIG, total_steps=4, resume_step=resume_step, progress=False
    ) as sink:
        if resume_step == 0:
            summary = run / "eval" / "step_000000" / "summary.json"
            summary.parent.mkdir(parents=True, exist_ok=True)
            summary.write_text('{"solver_acc": 0.25}\n')
            sink.log_eval(0, {"eval/solver_acc": 0.25, "eval/solver_pass@4": 0.5}, files=[summary])
        for step in steps:
            values = metrics(step)
            if step == 2:  # an evaluation after step 2: its values are in step 2's line as well
                evaluated = {"eval/solver_acc": 0.5, "eval/solver_pass@4": 0.75}
                sink.log_eval(step, evaluated)
                values |= evaluated
            sink.log(step, values)
    return sink


# ----------------------------------------------------------------------------------------- W&B read-back
def wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` transaction log: W&B's LevelDB-style log (a 7-byte ``:W&B`` header,
    32 KiB blocks of chunks with a 7-byte header: CRC, length, type full/first/middle/last), each record
    a ``wandb_internal_pb2.Record``. wandb 0.31 moved its own reader into the Go core, so the framing is
    read here and the records by W&B's protobuf schema."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and data[4:6] == b"\xe1\xbe", data[:7]
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts += chunk
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_history(path: Path) -> dict[int, dict[str, Any]]:
    """step -> {metric: value} of one offline run (W&B's own ``_``-keys left out)."""
    out: dict[int, dict[str, Any]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step")
            out.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return out


def wandb_of(path: Path, kind: str) -> list[Any]:
    return [getattr(r, kind) for r in wandb_records(path) if r.WhichOneof("record_type") == kind]


def same(a: float | None, b: float) -> bool:
    """A metrics.jsonl value (null for NaN) and the float a tracker kept."""
    return math.isnan(b) if a is None else math.isclose(a, b)


def assert_trackers_hold_the_run(run: Path, files: set[str]) -> None:
    """Every step of ``run``'s metrics.jsonl (and the evaluation before step 1 of its eval.jsonl) is in its
    one W&B offline run and its MLflow run with the same values, and both keep ``files``."""
    want = {r["step"]: r for r in read_metrics(run / METRICS_FILE)}
    if (run / "eval.jsonl").exists():
        want.setdefault(0, read_metrics(run / "eval.jsonl")[0])
    [log] = wandb_runs(run)
    history = wandb_history(log)
    assert sorted(history) == sorted(want)
    for step, record in want.items():
        assert set(history[step]) == set(record) - {"step"}, step
        assert all(same(record[k], v) for k, v in history[step].items()), (step, history[step], record)
    saved = {f.path for record in wandb_of(log, "files") for f in record.files}
    assert files <= saved, saved
    assert all((log.parent / "files" / f).is_file() for f in files)

    state = json.loads((run / STATE_FILE).read_text())
    client = mlflow_client(state["mlflow"]["tracking_uri"])
    run_id = state["mlflow"]["run_id"]
    for key in {k for r in want.values() for k in r} - {"step"}:
        got = {m.step: m.value for m in client.get_metric_history(run_id, mlflow_name(key, file_store=True))}
        assert got.keys() == {s for s, r in want.items() if key in r}, key
        assert all(same(want[s][key], v) for s, v in got.items()), (key, got)
    kept = {a.path for a in client.list_artifacts(run_id)}
    for file in files:
        folder = str(Path(file).parent)
        assert file in ({a.path for a in client.list_artifacts(run_id, folder)} if folder != "." else kept), (
            file
        )


# ------------------------------------------------------------------------------------------------- tests
def test_wandb_and_mlflow_get_the_steps_config_and_files_of_metrics_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")  # exported by a user: the run is still offline
    run = tmp_path / "run"
    run_sink(run, range(1, 5))
    assert_trackers_hold_the_run(run, {"config.yaml", "rewards.png", "eval/step_000000/summary.json"})
    history = wandb_history(wandb_runs(run)[0])
    assert history[0] == {"eval/solver_acc": 0.25, "eval/solver_pass@4": 0.5}
    assert math.isnan(history[2]["train/loss"]) and history[2]["eval/solver_pass@4"] == 0.75

    # W&B: the run's name, config, a copy (not a link) of each file, a clean exit
    [log] = wandb_runs(run)
    [start] = wandb_of(log, "run")
    assert start.project == "mars-test" and start.display_name == "run"
    config = {u.key: json.loads(u.value_json) for u in start.config.update}
    assert config["train"] == {"steps": 4, "lr": 1e-5} and config["model"] == {"fp8": None}
    files = log.parent / "files"
    assert (files / "eval/step_000000/summary.json").read_text() == '{"solver_acc": 0.25}\n'
    assert not (files / "rewards.png").is_symlink() and (files / "rewards.png").read_bytes()[:4] == b"\x89PNG"
    assert [e.exit.exit_code for e in wandb_records(log) if e.WhichOneof("record_type") == "exit"] == [0]

    # MLflow: the local file store under the run directory; '@' is no MLflow name character, '/' makes folders
    state = json.loads((run / STATE_FILE).read_text())
    assert state["mlflow"]["tracking_uri"] == (run / "mlruns").as_uri()
    assert state["wandb"]["id"] == log.stem.removeprefix("run-")
    client = mlflow_client(state["mlflow"]["tracking_uri"])
    run_id = state["mlflow"]["run_id"]
    pass_at = client.get_metric_history(run_id, "eval.solver_pass_at_4")
    assert [(m.step, m.value) for m in pass_at] == [(0, 0.5), (2, 0.75)]
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED" and info.info.run_name == "run"
    assert info.data.params["train.steps"] == "4" and info.data.params["model.fp8"] == "null"
    assert info.data.params["agents.roles"] == '["solver", "verifier"]'


def test_resume_goes_on_in_the_same_tracker_runs_and_a_redo_never_holds_a_step_twice(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_sink(run, range(1, 3))
    first = json.loads((run / STATE_FILE).read_text())
    # resumed at its last step: nothing redone, the same W&B id (resume allowed) and the same MLflow run
    run_sink(run, range(3, 5), resume_step=2)
    second = json.loads((run / STATE_FILE).read_text())
    assert second == first
    logs = wandb_runs(run)
    assert len(logs) == 2 and {p.stem for p in logs} == {f"run-{first['wandb']['id']}"}
    assert sorted(wandb_history(logs[1])) == [3, 4]
    client = mlflow_client(first["mlflow"]["tracking_uri"])
    run_id = first["mlflow"]["run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "reward.solver")] == [1, 2, 3, 4]
    assert client.get_run(run_id).info.status == "FINISHED"

    # resumed from step 3's checkpoint after a kill: step 4 is redone. W&B rewinds the same run to step 3;
    # MLflow cannot drop a logged value, so the redo goes to a new run that names the old one
    run_sink(run, range(4, 5), resume_step=3)
    third = json.loads((run / STATE_FILE).read_text())
    assert third["wandb"] == first["wandb"]
    rewind = wandb_of(wandb_runs(run)[-1], "run")[0].branch_point
    assert (rewind.run, rewind.value) == (first["wandb"]["id"], 3.0) and rewind.metric == "_step"
    new_id = third["mlflow"]["run_id"]
    assert new_id != run_id
    tags = client.get_run(new_id).data.tags
    assert tags["mars.resumed_from_run"] == run_id and tags["mars.resume_step"] == "3"
    assert [m.step for m in client.get_metric_history(new_id, "reward.solver")] == [4]
    assert [m.step for m in client.get_metric_history(run_id, "reward.solver")] == [1, 2, 3, 4]


KILLED_DRIVER = """
import os, signal, sys, time
from pathlib import Path
from mars_megatron.metrics import MetricsSink
from mars_megatron.metrics.tracker_wandb import FLUSH_S
from mars_megatron.metrics.trackers import MlflowSpec, WandbSpec
from tests.test_trackers import metrics
run = Path(sys.argv[1])
run.mkdir()
sink = MetricsSink(run, trackers=[WandbSpec("mars-test"), MlflowSpec()], total_steps=4, progress=False)
for step in (1, 2, 3):
    sink.log(step, metrics(step))
time.sleep(FLUSH_S + 0.5)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_driver_keeps_every_logged_step_and_the_resume_goes_on(tmp_path: Path) -> None:
    """SIGKILL a driver (no close, no flush) a moment after its third step; every step is in both trackers,
    and the run resumed from step 3 goes on in the same tracker runs."""
    import subprocess

    run_sink(tmp_path / "earlier", range(1, 2))  # this process's own W&B service, whatever ran before
    assert "WANDB_SERVICE" in os.environ
    # the child inherits it: the driver must start its own, or this service keeps the killed run open and
    # refuses the resume ("run ID is in use")
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", KILLED_DRIVER, str(run)], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr[-2000:]
    [killed] = wandb_runs(run)
    assert sorted(wandb_history(killed)) == [1, 2, 3]
    state = json.loads((run / STATE_FILE).read_text())
    client = mlflow_client(state["mlflow"]["tracking_uri"])
    assert [m.step for m in client.get_metric_history(state["mlflow"]["run_id"], "reward.solver")] == [
        1,
        2,
        3,
    ]

    run_sink(run, range(4, 5), resume_step=3)
    assert json.loads((run / STATE_FILE).read_text()) == state
    logs = wandb_runs(run)
    assert [sorted(wandb_history(log)) for log in logs] == [[1, 2, 3], [4]]
    assert {log.stem for log in logs} == {f"run-{state['wandb']['id']}"}
    history = client.get_metric_history(state["mlflow"]["run_id"], "reward.solver")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert client.get_run(state["mlflow"]["run_id"]).info.status == "FINISHED"


def test_a_tracker_that_fails_is_warned_about_once_and_the_run_goes_on(tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    (tmp_path / "a_file").write_text("")
    broken = MlflowSpec(tracking_uri=(tmp_path / "a_file" / "mlruns").as_uri())  # cannot be a folder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with MetricsSink(run, trackers=[broken, MlflowSpec()], total_steps=4, progress=False) as sink:
            sink.log(1, metrics(1))
            # mid-run, the store loses the run (a disk wiped, a server reset): the next steps fail there
            shutil.rmtree(run / "mlruns")
            for step in (2, 3, 4):
                sink.log(step, metrics(step))
            assert [t.alive for t in sink.trackers] == [False, False]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    assert messages[0].startswith("logging.backends: mlflow failed at start (")
    assert messages[1].startswith("logging.backends: mlflow failed at step 2 (")
    assert all("metrics.jsonl goes on" in m for m in messages)
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == [1, 2, 3, 4]


def test_logging_config_lists_the_trackers_and_checks_their_libraries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = load_config(
        None,
        [
            "logging.tensorboard=true",
            "logging.backends=[mlflow, wandb]",
            "logging.wandb.project=p",
            "logging.wandb.mode=online",
            "logging.mlflow.tracking_uri=http://127.0.0.1:5000",
        ],
    )
    assert cfg.logging.trackers == ["tensorboard", "mlflow", "wandb"]
    assert tracker_specs(cfg.logging) == [
        TensorBoardSpec(),
        MlflowSpec("http://127.0.0.1:5000", "mars-megatron", None),
        WandbSpec("p", None, "online", None, None),
    ]
    assert load_config(None, ["logging.backends=[tensorboard]"]).logging.trackers == ["tensorboard"]
    assert load_config(None, []).logging.trackers == []
    check_trackers(cfg.logging)
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python blocks an import: as if not installed
    with pytest.raises(ConfigError, match=r"^logging\.backends: 'wandb' needs the wandb package"):
        check_trackers(cfg.logging)


def test_config_flattens_into_mlflow_params_and_names_become_mlflow_names() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2], "d": None, "e": "x", "f": {}}}) == {
        "a.b": "1",
        "a.c": "[1, 2]",
        "a.d": "null",
        "a.e": "x",
        "a.f": "{}",
    }
    assert mlflow_name("eval/system_pass@8") == "eval/system_pass_at_8"
    assert mlflow_name("eval/system_pass@8", file_store=True) == "eval.system_pass_at_8"
    assert mlflow_name("reward/solver-mean:1.5 x_y") == "reward/solver-mean:1.5 x_y"
    assert mlflow_name("reward/solver (mean)") == "reward/solver _mean_"
    assert mlflow_name("a+b") == "a_b"


def test_an_mlflow_experiment_in_the_trash_is_restored_rather_than_the_run_lost(tmp_path: Path) -> None:
    store = MlflowSpec((tmp_path / "store").as_uri())
    with MetricsSink(tmp_path / "a", trackers=[store], total_steps=1, progress=False) as sink:
        sink.log(1, metrics(1))
    client = mlflow_client(store.tracking_uri or "")
    client.delete_experiment(client.get_experiment_by_name("mars-megatron").experiment_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tracker dropped
        with MetricsSink(tmp_path / "b", trackers=[store], total_steps=1, progress=False) as sink:
            sink.log(1, metrics(1))
    experiment = client.get_experiment_by_name("mars-megatron")
    assert experiment.lifecycle_stage == "active"
    assert len(client.search_runs([experiment.experiment_id])) == 2
