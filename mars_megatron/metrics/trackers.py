"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) behind one small interface.

Why an interface: the sink hands every tracker the same thing (the step's metrics under the names and steps
of ``metrics.jsonl``, the resolved config, a few files), so a tracker is one class that knows only its
library (``tracker_tensorboard``, ``tracker_wandb``, ``tracker_mlflow``), imported only when listed.

Why a guard: a tracker is a side channel. ``metrics.jsonl`` is the run's record; a tracker that fails (a
full disk, a library error, a server gone) must not stop training, so :class:`GuardedTracker` warns once,
naming the backend, and drops it for the rest of the run.

Which tracker run a run writes to is kept in ``RUN_DIR/trackers.json`` (W&B run id, MLflow run id and
where it lives), so ``mars train --resume`` goes on in the same tracker run (see each backend for what it
does when the resume redoes steps a killed run had already logged).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

STATE_FILE = "trackers.json"


class Tracker(Protocol):
    """One experiment tracker, driven by the sink in the driver process only."""

    def log(self, step: int, values: Mapping[str, int | float], last: bool) -> None:
        """The metrics of ``step`` (floats may be NaN or infinite: each backend says how it keeps them);
        ``last``: no more values of this step follow (W&B then writes the step's row at once)."""

    def log_file(self, path: Path, folder: str) -> None:
        """Keep a copy of ``path`` under ``folder`` ('' = top level) where the tracker keeps files."""

    def close(self, failed: bool) -> None:
        """Flush and end the tracker run (``failed``: the training run raised)."""


@dataclass(frozen=True)
class TensorBoardSpec:
    """TensorBoard event files under ``RUN_DIR/tensorboard``."""

    name: str = "tensorboard"


@dataclass(frozen=True)
class WandbSpec:
    project: str
    entity: str | None = None
    mode: str = "offline"
    run_name: str | None = None
    dir: str | None = None
    name: str = "wandb"


@dataclass(frozen=True)
class MlflowSpec:
    tracking_uri: str | None = None
    experiment: str = "mars-megatron"
    run_name: str | None = None
    name: str = "mlflow"


TrackerSpec = TensorBoardSpec | WandbSpec | MlflowSpec


@dataclass
class TrackerStart:
    """What every tracker needs to open its run.

    ``resume_step``: the step the run goes on from (0 = a fresh run: new tracker runs); ``redo``: the
    metric files held steps after it (a killed run logged them and the resumed run logs them again);
    ``config``: the resolved config as plain nested data; ``state``: this run directory's
    ``trackers.json`` (each backend reads and updates its own entry)."""

    run_dir: Path
    resume_step: int = 0
    redo: bool = False
    config: Mapping[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def run_name(self) -> str:
        return self.run_dir.resolve().name

    def previous(self, backend: str, **same: Any) -> dict[str, Any] | None:
        """The saved entry of ``backend`` when this start continues it: a resume (``resume_step > 0``)
        with the same settings ``same`` as when it was saved; else None (a fresh tracker run)."""
        entry = self.state.get(backend)
        if self.resume_step <= 0 or not isinstance(entry, dict):
            return None
        return entry if all(entry.get(k) == v for k, v in same.items()) else None


def read_state(run_dir: Path) -> dict[str, Any]:
    """``RUN_DIR/trackers.json``; a missing or unreadable file is an empty state (new tracker runs), with a
    warning for the unreadable one: losing the link to an old tracker run is no reason to stop a run."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        warnings.warn(f"{path}: unreadable ({err}); the trackers start new runs", stacklevel=2)
        return {}
    return state if isinstance(state, dict) else {}


def write_state(run_dir: Path, state: Mapping[str, Any]) -> None:
    """Replace ``RUN_DIR/trackers.json`` atomically (a kill leaves the old or the new file, never half)."""
    path = run_dir / STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: the config as the flat string pairs MLflow's params are
    (lists and null as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value if isinstance(value, str) else json.dumps(value)
    return out


class GuardedTracker:
    """A tracker whose failures are warned about once, naming the backend, and then ignored: after the
    first failure the tracker is closed (best effort) and dropped for the rest of the run."""

    def __init__(self, name: str, tracker: Tracker | None) -> None:
        self.name = name
        self.tracker = tracker
        self.error: str | None = None

    @classmethod
    def start(cls, name: str, opener: Callable[[], Tracker]) -> GuardedTracker:
        guarded = cls(name, None)
        guarded._call("start", lambda: setattr(guarded, "tracker", opener()))
        return guarded

    @property
    def alive(self) -> bool:
        return self.error is None and self.tracker is not None

    def log(self, step: int, values: Mapping[str, int | float], last: bool = True) -> None:
        if self.alive:
            self._call(f"step {step}", lambda: self.tracker.log(step, values, last))  # type: ignore[union-attr]

    def log_file(self, path: Path, folder: str) -> None:
        if self.alive and path.is_file():
            self._call(f"file {path.name}", lambda: self.tracker.log_file(path, folder))  # type: ignore[union-attr]

    def close(self, failed: bool = False) -> None:
        if self.alive:
            tracker, self.tracker = self.tracker, None
            self._call("close", lambda: tracker.close(failed))  # type: ignore[union-attr]

    def _call(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as err:  # any library error: the run goes on without this tracker
            self.error = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"logging.backends: {self.name} failed at {what} ({self.error}); it is dropped for the rest "
                "of the run (metrics.jsonl goes on)",
                RuntimeWarning,
                stacklevel=3,
            )
            tracker, self.tracker = self.tracker, None
            if tracker is not None and what != "close":
                try:
                    tracker.close(True)
                except Exception:  # already failing: its own close may fail too; nothing more to say
                    pass
