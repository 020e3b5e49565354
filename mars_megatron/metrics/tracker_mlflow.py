"""MLflow: one MLflow run per training run, in a local file store unless ``logging.mlflow.tracking_uri``
names another store.

The default store is ``file://RUN_DIR/mlruns``: no server, no network, and it works with mlflow-skinny.
MLflow 3.17 keeps the file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE`` is
set (its database store needs SQLAlchemy, which mlflow-skinny lacks), so this tracker sets that variable
for a ``file://`` store. An ``http(s)://`` server gets bounded requests (``MLFLOW_HTTP_REQUEST_TIMEOUT``
30 s, 2 retries, unless already set), so a server gone mid-run costs a step seconds, not minutes, before
the tracker is dropped. MLflow's own usage telemetry (it posts to ``config.mlflow-telemetry.io``, seen
with a socket hook) is turned off (``MLFLOW_DISABLE_TELEMETRY``: always for a local store, by default for
a server); with that, strace shows no ``AF_INET`` connect for a file store.

Metrics go under the names and steps of ``metrics.jsonl``, except that MLflow accepts only letters,
digits and ``_ - . : / space`` in a name: ``@`` becomes ``_at_`` (``eval/solver_pass@4`` ->
``eval/solver_pass_at_4``), any other character ``_``; and in a file store ``/`` becomes ``.``
(``reward.solver``): the file store keeps a metric as a file named after it, so ``samples`` and
``samples/solver`` (both logged by every run) cannot both live there (a real run failed on it). NaN
and infinity are logged as they are (MLflow stores them). The resolved config goes in twice: flattened
into params (``train.steps``; a value cut to MLflow's 6000 characters) and whole as the ``config.yaml``
artefact. Files are logged as artefacts.

Resume: the run id is kept in ``RUN_DIR/trackers.json``. A resume that redoes no step continues the same
MLflow run (params it lacks are added; a changed value stays as first logged, the new ``config.yaml``
replaces the old). MLflow cannot delete logged metric values, so a resume that redoes steps a killed run
had logged starts a new run in the same experiment, tagged ``mars.resumed_from_run`` and
``mars.resume_step``, rather than hold two values for one step.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mars_megatron.metrics.trackers import MlflowSpec, TrackerStart, flatten

MAX_KEY = 250
MAX_VALUE = 6000
BATCH = 100  # params per request (MLflow's limit); metrics go 1000 at a time


def mlflow_name(name: str, file_store: bool = False) -> str:
    """``name`` as MLflow accepts a metric or param name (``@`` -> ``_at_``, other odd characters ``_``);
    in a file store also ``/`` -> ``.``: it keeps each metric in a file named after it, so ``samples`` (a
    file) and ``samples/solver`` (a file in a folder of the same name) cannot both be kept."""
    name = re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))
    return (name.replace("/", ".") if file_store else name)[:MAX_KEY]


def store_uri(spec: MlflowSpec, run_dir: Path) -> str:
    """The tracking URI the run writes to: the configured one, or ``file://RUN_DIR/mlruns``."""
    return spec.tracking_uri or (run_dir.resolve() / "mlruns").as_uri()


def mlflow_client(uri: str) -> Any:
    """An ``MlflowClient`` of the store at ``uri``, with the process environment it needs (set before
    MLflow is imported): a file store allowed, telemetry off, bounded requests to a server."""
    if uri.startswith(("http:", "https:")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    else:  # a local store: nothing may reach the network
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        if uri.startswith("file:"):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


class MlflowTracker:
    def __init__(self, spec: MlflowSpec, start: TrackerStart) -> None:
        uri = store_uri(spec, start.run_dir)
        self._client = client = mlflow_client(uri)
        self._file_store = uri.startswith("file:")
        experiment = client.get_experiment_by_name(spec.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(spec.experiment)
        if experiment is not None and experiment.lifecycle_stage == "deleted":  # in the store's trash
            client.restore_experiment(experiment_id)  # a name stays taken there: no new one can be made
        previous = start.previous("mlflow", tracking_uri=uri, experiment=spec.experiment)
        params = {mlflow_name(k, self._file_store): v[:MAX_VALUE] for k, v in flatten(start.config).items()}
        if previous is not None and not start.redo:
            self.run_id = previous["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            params = {k: v for k, v in params.items() if k not in client.get_run(self.run_id).data.params}
        else:
            tags = {"mars.run_dir": str(start.run_dir.resolve())}
            if previous is not None:
                tags |= {
                    "mars.resumed_from_run": previous["run_id"],
                    "mars.resume_step": str(start.resume_step),
                }
            run = client.create_run(experiment_id, run_name=spec.run_name or start.run_name, tags=tags)
            self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), BATCH):
            client.log_batch(self.run_id, params=items[i : i + BATCH])
        start.state["mlflow"] = {"run_id": self.run_id, "tracking_uri": uri, "experiment": spec.experiment}

    def log(self, step: int, values: Mapping[str, int | float], last: bool) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k, self._file_store), float(v), now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_file(self, path: Path, folder: str) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path=folder or None)

    def close(self, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
