"""Experiment tracker settings (``logging.backends``, ``logging.wandb.*``, ``logging.mlflow.*``): unknown
or repeated trackers, modes that are not offline/online, W&B names holding a path, MLflow stores that are
no local store or server, a tracker whose library is missing or whose folder is a file (refused by
``mars train``'s checks before anything starts), and an unreadable ``trackers.json`` on resume (a
warning: new tracker runs)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

from tests.bad_inputs.configs import _load, _override, _prepare
from tests.bad_inputs.harness import Case, Workspace

CATEGORY = "trackers"
B, W, M = "logging.backends", "logging.wandb", "logging.mlflow"
OVERRIDES: list[tuple[str, str, str]] = [
    ("backends-unknown", f"{B}=[neptune]", f"{B}[0]"),
    ("backends-repeated", f"{B}=[wandb, mlflow, wandb]", f"{B}[2]"),
    ("backends-tensorboard-twice", f"{B}=[tensorboard, tensorboard]", f"{B}[1]"),
    ("backends-string", f"{B}=wandb", B),
    ("backends-comma-string", f"{B}='wandb,mlflow'", B),
    ("backends-int", f"{B}=[1]", f"{B}[0]"),
    ("backends-null-item", f"{B}=[null]", f"{B}[0]"),
    ("backends-map", f"{B}={{wandb: true}}", B),
    ("backends-case", f"{B}=[WandB]", f"{B}[0]"),
    ("wandb-mode-shared", f"{W}.mode=shared", f"{W}.mode"),
    ("wandb-mode-disabled", f"{W}.mode=disabled", f"{W}.mode"),
    ("wandb-mode-bool", f"{W}.mode=true", f"{W}.mode"),
    ("wandb-mode-null", f"{W}.mode=null", f"{W}.mode"),
    ("wandb-project-path", f"{W}.project=team/proj", f"{W}.project"),
    ("wandb-project-up", f"{W}.project=../../etc", f"{W}.project"),
    ("wandb-project-backslash", f"{W}.project='a\\b'", f"{W}.project"),
    ("wandb-project-hash", f"{W}.project='a#b'", f"{W}.project"),
    ("wandb-project-query", f"{W}.project='a?b=1'", f"{W}.project"),
    ("wandb-project-colon", f"{W}.project='a:b'", f"{W}.project"),
    ("wandb-project-empty", f"{W}.project=''", f"{W}.project"),
    ("wandb-project-blank", f"{W}.project='   '", f"{W}.project"),
    ("wandb-project-long", f"{W}.project={'p' * 129}", f"{W}.project"),
    ("wandb-project-null", f"{W}.project=null", f"{W}.project"),
    ("wandb-project-int", f"{W}.project=5", f"{W}.project"),
    ("wandb-project-tab", f'{W}.project="a\\tb"', f"{W}.project"),
    ("wandb-entity-path", f"{W}.entity=me/team", f"{W}.entity"),
    ("wandb-entity-empty", f"{W}.entity=''", f"{W}.entity"),
    ("wandb-name-empty", f"{W}.name=''", f"{W}.name"),
    ("wandb-name-newline", f'{W}.name="a\\nb"', f"{W}.name"),
    ("wandb-dir-empty", f"{W}.dir=''", f"{W}.dir"),
    ("wandb-dir-list", f"{W}.dir=[a]", f"{W}.dir"),
    ("wandb-unknown-key", f"{W}.projct=p", f"{W}.projct"),
    ("wandb-not-a-section", f"{W}=offline", W),
    ("mlflow-uri-ftp", f"{M}.tracking_uri=ftp://host/x", f"{M}.tracking_uri"),
    ("mlflow-uri-s3", f"{M}.tracking_uri=s3://bucket/mlruns", f"{M}.tracking_uri"),
    ("mlflow-uri-databricks", f"{M}.tracking_uri=databricks", f"{M}.tracking_uri"),
    ("mlflow-uri-plain-path", f"{M}.tracking_uri=/tmp/mlruns", f"{M}.tracking_uri"),
    ("mlflow-uri-relative-file", f"{M}.tracking_uri=file://mlruns", f"{M}.tracking_uri"),
    ("mlflow-uri-no-host", f"{M}.tracking_uri=http:///x", f"{M}.tracking_uri"),
    ("mlflow-uri-space", f"{M}.tracking_uri='file:///tmp/a b'", f"{M}.tracking_uri"),
    ("mlflow-uri-empty", f"{M}.tracking_uri=''", f"{M}.tracking_uri"),
    ("mlflow-uri-artifacts", f"{M}.tracking_uri=mlflow-artifacts://host/x", f"{M}.tracking_uri"),
    ("mlflow-uri-int", f"{M}.tracking_uri=5000", f"{M}.tracking_uri"),
    ("mlflow-experiment-empty", f"{M}.experiment=''", f"{M}.experiment"),
    ("mlflow-experiment-long", f"{M}.experiment={'e' * 501}", f"{M}.experiment"),
    ("mlflow-run-name-blank", f"{M}.run_name=' '", f"{M}.run_name"),
    ("mlflow-unknown-key", f"{M}.uri=file:///tmp/x", f"{M}.uri"),
]
FILES: list[tuple[str, str, str]] = [
    ("wandb-list", "logging:\n  wandb: [offline]\n", W),
    ("mlflow-scalar", "logging:\n  backends: [mlflow]\n  mlflow: 3\n", M),
    ("backends-repeated", "logging:\n  backends:\n  - mlflow\n  - mlflow\n", f"{B}[1]"),
]


@contextlib.contextmanager
def _not_installed(module: str) -> Iterator[None]:
    """``import module`` fails in this process, as when the package is not installed (Python's own way
    to block an import: ``sys.modules[name] = None``)."""
    saved = sys.modules.get(module, ...)
    sys.modules[module] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is ...:
            del sys.modules[module]
        else:
            sys.modules[module] = saved


def _prepare_without(ws: Workspace, module: str, *overrides: str) -> Any:
    with _not_installed(module):
        return _prepare(ws, *overrides)


def _corrupt_state(ws: Workspace) -> Any:
    """A resume whose ``trackers.json`` is garbage: the sink warns naming it and starts new tracker runs."""
    from mars_megatron.metrics import MetricsSink
    from mars_megatron.metrics.trackers import TensorBoardSpec

    run = ws.path("run")
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "trackers.json").write_bytes(b"\xff{not json")
    with MetricsSink(run, trackers=[TensorBoardSpec()], total_steps=2, resume_step=1, progress=False) as sink:
        pass
    return sink


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case(CATEGORY, name, feed, names, **kw))

    for name, text, field in OVERRIDES:
        add(f"override/{name}", functools.partial(_override, text=text), field)
    for name, text, field in FILES:
        add(f"file/{name}", lambda ws, t=text: _load(ws, t), "{ws}/c.yaml", field)
    add("train/wandb-not-installed", lambda ws: _prepare_without(ws, "wandb", f"{B}=[wandb]"), B, "wandb")
    add(
        "train/mlflow-not-installed",
        lambda ws: _prepare_without(ws, "mlflow", f"{B}=[tensorboard, mlflow]"),
        B,
        "mlflow-skinny",
    )
    add(
        "train/sqlite-store-without-sqlalchemy",
        lambda ws: _prepare_without(
            ws, "sqlalchemy", f"{B}=[mlflow]", f"{M}.tracking_uri=sqlite:///{ws.root}/m.db"
        ),
        f"{M}.tracking_uri",
        "SQLAlchemy",
    )
    add(
        "train/wandb-dir-is-a-file",
        lambda ws: _prepare(ws, f"{B}=[wandb]", f"{W}.dir={ws.write('f', '')}"),
        f"{W}.dir",
        "{ws}/f",
    )
    add(
        "train/mlflow-store-is-a-file",
        lambda ws: _prepare(ws, f"{B}=[mlflow]", f"{M}.tracking_uri=file://{ws.write('f', '')}"),
        f"{M}.tracking_uri",
        "{ws}/f",
    )
    add("resume/trackers-json-garbage", _corrupt_state, "{ws}/run/trackers.json", warning=True)
    return out
