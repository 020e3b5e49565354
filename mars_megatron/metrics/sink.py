"""Where the training driver's per-step numbers go: ``RUN_DIR/metrics.jsonl``, the experiment trackers
(TensorBoard, W&B, MLflow: :mod:`.trackers`), a progress bar and ``RUN_DIR/rewards.png``.

``metrics.jsonl`` holds one JSON object per logged step, ``{"step": N, ...}``, appended, flushed and fsynced
line by line, so a killed run keeps everything it logged. JSON has no NaN or infinity, so a non-finite
value is written as ``null`` (the trackers still receive the float, NaN included, so a diverging run shows
there). Steps must increase, which keeps the file at one line per step.

Resuming from the checkpoint of step ``resume_step`` drops the lines of later steps (a run killed after its
last checkpoint logged steps that the resumed run is about to redo) by rewriting the file atomically, and
opens TensorBoard with ``purge_step=resume_step + 1`` so the viewer discards those steps' old events. The
same rule holds for ``resume_step=0``: a fresh run in a directory with an old ``metrics.jsonl`` starts it
over. Only one process (the driver, or rank 0) should own a sink for a run directory.

Every tracker gets the same names and steps as ``metrics.jsonl``, the resolved config when it opens
(``config=``; ``RUN_DIR/config.yaml`` as a file where the tracker keeps files), each evaluation's files
(``log_eval(files=...)``) and ``rewards.png`` at close. A tracker that fails is warned about once and
dropped (:class:`~.trackers.GuardedTracker`); ``metrics.jsonl`` is written first and never depends on one.

Held-out evaluations (``evaluation.*``) go through :meth:`MetricsSink.log_eval` into ``eval.jsonl`` (one
line per evaluation, step 0 being the model before any update) and TensorBoard; the trainer also puts them
into the ``metrics.jsonl`` line of the step they were taken after, so both files tell the same story and
``metrics.jsonl`` keeps exactly one line per update. ``rewards.png`` draws them in a second panel.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

from mars_megatron.metrics.records import (
    EVAL_FILE,
    EVAL_PREFIX,
    METRICS_FILE,
    REWARDS_PNG,
    parse_line,
)
from mars_megatron.metrics.trackers import (
    GuardedTracker,
    MlflowSpec,
    TensorBoardSpec,
    Tracker,
    TrackerSpec,
    TrackerStart,
    WandbSpec,
    read_state,
    write_state,
)

CONFIG_FILE = "config.yaml"

# Progress-bar postfix: role initial -> metric, e.g. "S 0.41 V 0.80 C 0.33".
_POSTFIX = (("S", "reward/solver"), ("V", "reward/verifier"), ("C", "reward/corrector"))


def _scalar(key: str, value: Any) -> int | float:
    """``value`` as a plain int or float (numpy and 0-d torch scalars included); bools count as 0/1."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        try:
            value = value.item()
        except (ValueError, RuntimeError) as err:
            raise TypeError(f"metric {key!r}: {value!r} is not a scalar") from err
    if isinstance(value, bool | numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r}: {type(value).__name__} {value!r} is not a number")


def open_tracker(spec: TrackerSpec, start: TrackerStart) -> Tracker:
    """The tracker ``spec`` describes, its library imported only now (a run without it never loads it)."""
    if isinstance(spec, TensorBoardSpec):
        from mars_megatron.metrics.tracker_tensorboard import TensorBoardTracker

        return TensorBoardTracker(spec, start)
    if isinstance(spec, WandbSpec):
        from mars_megatron.metrics.tracker_wandb import WandbTracker

        return WandbTracker(spec, start)
    if isinstance(spec, MlflowSpec):
        from mars_megatron.metrics.tracker_mlflow import MlflowTracker

        return MlflowTracker(spec, start)
    raise TypeError(f"not a tracker spec: {spec!r}")


def _json_value(value: int | float) -> int | float | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _truncate_metrics(path: Path, keep_through: int) -> tuple[list[dict[str, Any]], int]:
    """Keep the lines of steps ``<= keep_through``; returns (kept records, dropped line count).

    An unparsable *last* line without a newline is a write cut short by a kill: dropped with a warning.
    Any other bad line is an error, since silently losing logged steps is worse than stopping.
    """
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    kept_records: list[dict[str, Any]] = []
    kept_lines: list[str] = []
    dropped = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = parse_line(path, number, line)
        except ValueError:
            if number == len(lines) and not text.endswith("\n"):
                warnings.warn(f"{path}:{number}: dropping a cut-off last line (a killed run?)", stacklevel=3)
                dropped += 1
                continue
            raise
        if record["step"] <= keep_through:
            kept_records.append(record)
            kept_lines.append(line)
        else:
            dropped += 1
    if dropped or kept_lines != lines:
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in kept_lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return kept_records, dropped


class MetricsSink:
    """Writes each logged step to ``metrics.jsonl``, the trackers, the progress bar and ``rewards.png``.

    ``total_steps`` and ``resume_step`` size and start the bar; ``plot_every`` re-draws the plot once at
    least that many steps have passed since the last drawing (0: only at ``close()``). The plot needs
    ``reward/*`` metrics; a run without them gets no plot. ``tensorboard=True`` is the same as a
    :class:`~.trackers.TensorBoardSpec` in ``trackers``; ``config`` (the resolved config as nested plain
    data) goes to every tracker. Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        trackers: Sequence[TrackerSpec] = (),
        config: Mapping[str, Any] | None = None,
        total_steps: int,
        resume_step: int = 0,
        progress: bool = True,
        plot_every: int = 1,
    ) -> None:
        for name, value in (("total_steps", total_steps), ("resume_step", resume_step)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if plot_every < 0:
            raise ValueError(f"plot_every must be >= 0 (0: plot only at close), got {plot_every}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.plot_path = self.run_dir / REWARDS_PNG
        self.plot_every = plot_every
        self.records: list[dict[str, Any]] = []
        self.dropped_lines = 0
        if self.metrics_path.exists():
            self.records, self.dropped_lines = _truncate_metrics(self.metrics_path, resume_step)
        self.eval_path = self.run_dir / EVAL_FILE
        self.eval_records: list[dict[str, Any]] = []
        dropped_evals = 0
        if self.eval_path.exists():
            self.eval_records, dropped_evals = _truncate_metrics(self.eval_path, resume_step)
        self._eval_file: Any = None  # opened by the first log_eval: runs that evaluate nothing get no file
        self._last_step = max([resume_step, *(r["step"] for r in self.records)])
        self._plotted_step = self._last_step
        self._file = self.metrics_path.open("a", encoding="utf-8")
        specs = list(trackers)
        if tensorboard and not any(isinstance(spec, TensorBoardSpec) for spec in specs):
            specs.insert(0, TensorBoardSpec())
        self.trackers = self._open_trackers(
            specs, resume_step, bool(self.dropped_lines or dropped_evals), config
        )
        self._bar = tqdm(
            total=total_steps,
            initial=resume_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=None if progress else True,  # None: tqdm turns itself off when stderr is not a TTY
        )
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (numbers; the keys are what every tracker shows) for ``step``."""
        if self._closed:
            raise RuntimeError("MetricsSink.log() after close()")
        if step <= self._last_step:
            raise ValueError(f"step {step} is not after the last logged step {self._last_step}")
        if "step" in metrics:
            raise ValueError("metrics must not contain 'step'; it is the log() argument")
        values = {key: _scalar(key, value) for key, value in metrics.items()}
        self.records.append(self._append(self._file, step, values))
        self._last_step = step
        # eval/* reached the trackers through log_eval (which also has the evaluation before step 1)
        self._scalars(step, {k: v for k, v in values.items() if not k.startswith(EVAL_PREFIX)})
        self._advance_bar(step, self.records[-1])
        if self.plot_every and step - self._plotted_step >= self.plot_every:
            self._plot()

    def _open_trackers(
        self, specs: Sequence[TrackerSpec], resume_step: int, redo: bool, config: Mapping[str, Any] | None
    ) -> list[GuardedTracker]:
        """Start every tracker (one that fails to start is warned about and dropped), save which tracker
        runs this run writes to, and give them the resolved config file."""
        if not specs:
            return []
        state = read_state(self.run_dir)
        start = TrackerStart(self.run_dir, resume_step, redo, dict(config or {}), state)
        started = [
            GuardedTracker.start(spec.name, lambda spec=spec: open_tracker(spec, start)) for spec in specs
        ]
        if any(not isinstance(spec, TensorBoardSpec) for spec in specs):
            write_state(self.run_dir, state)
        for tracker in started:
            tracker.log_file(self.run_dir / CONFIG_FILE, "")
        return started

    def log_eval(self, step: int, metrics: Mapping[str, Any], files: Sequence[str | Path] = ()) -> None:
        """Record a held-out evaluation taken after ``step`` updates (0: before the first) in
        ``eval.jsonl`` and the trackers; ``files`` (its summary) go where the trackers keep files, under
        their folder relative to the run directory."""
        if self._closed:
            raise RuntimeError("MetricsSink.log_eval() after close()")
        last = self.eval_records[-1]["step"] if self.eval_records else -1
        if step <= last:
            raise ValueError(f"evaluation of step {step} is not after the last one logged ({last})")
        values = {key: _scalar(key, value) for key, value in metrics.items()}
        if self._eval_file is None:
            self._eval_file = self.eval_path.open("a", encoding="utf-8")
        self.eval_records.append(self._append(self._eval_file, step, values))
        # the step's own line follows unless it was logged already or never comes (the evaluation before
        # step 1): until then W&B keeps the row open, so both land in one row
        self._scalars(step, values, last=step <= self._last_step)
        for file in map(Path, files):
            self._log_file(file)

    def _log_file(self, path: Path) -> None:
        try:
            folder = str(path.resolve().parent.relative_to(self.run_dir.resolve()))
        except ValueError:  # outside the run directory: at the top level
            folder = ""
        for tracker in self.trackers:
            tracker.log_file(path, "" if folder == "." else folder)

    @staticmethod
    def _append(file: Any, step: int, values: Mapping[str, int | float]) -> dict[str, Any]:
        record = {"step": step, **{key: _json_value(value) for key, value in values.items()}}
        file.write(json.dumps(record, allow_nan=False) + "\n")
        file.flush()
        os.fsync(file.fileno())
        return record

    def _scalars(self, step: int, values: Mapping[str, int | float], last: bool = True) -> None:
        for tracker in self.trackers:
            tracker.log(step, values, last)

    def _advance_bar(self, step: int, record: Mapping[str, Any]) -> None:
        parts = [
            f"{short} {record[key]:.2f}" if record[key] is not None else f"{short} nan"
            for short, key in _POSTFIX
            if key in record
        ]
        if parts:
            self._bar.set_postfix_str(" ".join(parts), refresh=False)
        self._bar.update(step - self._bar.n)

    def _plot(self) -> None:
        from mars_megatron.metrics.plot import plot_rewards, reward_keys

        self._plotted_step = self._last_step
        if reward_keys(self.records):
            plot_rewards(self.records, self.plot_path, title=self.run_dir.name, evals=self.eval_records)

    def close(self, failed: bool = False) -> None:
        """Draw the final plot, hand it to the trackers and close the files, the trackers (``failed``: the
        run raised, which W&B and MLflow record) and the bar; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._plotted_step != self._last_step or (self.records and not self.plot_path.exists()):
                self._plot()
        finally:
            self._file.close()
            if self._eval_file is not None:
                self._eval_file.close()
            for tracker in self.trackers:
                if self.plot_path.exists():
                    tracker.log_file(self.plot_path, "")
                tracker.close(failed)
            self._bar.close()

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(failed=exc_type is not None)
