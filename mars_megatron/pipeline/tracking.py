"""``logging.backends`` -> the trackers the driver's metrics sink opens, and the check, before anything
starts, that each listed tracker's library is installed.

Why here: the sink (``metrics``) sits below the config, so it takes plain tracker specs; this module is
the one place that reads ``logging.*`` for them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from mars_megatron.config import ConfigError, LoggingConfig
from mars_megatron.metrics.trackers import MlflowSpec, TensorBoardSpec, TrackerSpec, WandbSpec

_LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
"""tracker -> (module it imports, the pip package that provides it)."""


def tracker_specs(logging: LoggingConfig) -> list[TrackerSpec]:
    """The trackers ``logging`` lists (``logging.tensorboard: true`` counts as listing TensorBoard)."""
    specs: list[TrackerSpec] = []
    for name in logging.trackers:
        if name == "tensorboard":
            specs.append(TensorBoardSpec())
        elif name == "wandb":
            w = logging.wandb
            specs.append(WandbSpec(w.project, w.entity, w.mode, w.name, w.dir))
        elif name == "mlflow":
            m = logging.mlflow
            specs.append(MlflowSpec(m.tracking_uri, m.experiment, m.run_name))
    return specs


def check_trackers(logging: LoggingConfig) -> None:
    """Refuse, naming the field, a listed tracker whose library is not installed, a W&B folder or MLflow
    file store that is a file, and an MLflow ``sqlite:`` store without SQLAlchemy: before models load or
    Ray starts (a tracker failing later only warns)."""
    for name in logging.trackers:
        module, package = _LIBRARIES[name]
        if importlib.util.find_spec(module) is None:
            field = (
                "logging.tensorboard"
                if name == "tensorboard" and name not in logging.backends
                else "logging.backends"
            )
            raise ConfigError(
                f"{name!r} needs the {package} package, which is not installed (pip install {package})", field
            )
    folders = {
        "logging.wandb.dir": logging.wandb.dir if "wandb" in logging.trackers else None,
        "logging.mlflow.tracking_uri": _file_store_path(logging.mlflow.tracking_uri)
        if "mlflow" in logging.trackers
        else None,
    }
    for field, folder in folders.items():
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ConfigError(f"{folder} exists and is not a folder", field)
    uri = logging.mlflow.tracking_uri
    if (
        "mlflow" in logging.trackers
        and uri
        and uri.startswith("sqlite:")
        and importlib.util.find_spec("sqlalchemy") is None
    ):
        raise ConfigError(
            f"{uri}: MLflow's database store needs SQLAlchemy (the full mlflow package, not mlflow-skinny); "
            "use a file:/// store or leave it null for file://RUN_DIR/mlruns",
            "logging.mlflow.tracking_uri",
        )


def _file_store_path(uri: str | None) -> str | None:
    """The folder of a ``file://`` tracking URI (None for any other store)."""
    if uri is None or not uri.startswith("file://"):
        return None
    return url2pathname(urlparse(uri).path)
