"""TensorBoard: event files under ``RUN_DIR/tensorboard``, one scalar per metric name and step.

A resumed run opens the writer with ``purge_step=resume_step + 1``, so the viewer discards the events of
the steps a killed run logged after its checkpoint. NaN and infinity are kept as floats (a diverging run
shows). TensorBoard keeps no files, so :meth:`log_file` does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mars_megatron.metrics.records import TENSORBOARD_DIR
from mars_megatron.metrics.trackers import TensorBoardSpec, TrackerStart


class TensorBoardTracker:
    def __init__(self, spec: TensorBoardSpec, start: TrackerStart) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(start.run_dir / TENSORBOARD_DIR), purge_step=start.resume_step + 1)

    def log(self, step: int, values: Mapping[str, int | float], last: bool) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_file(self, path: Path, folder: str) -> None:
        """TensorBoard keeps no files."""

    def close(self, failed: bool) -> None:
        self._writer.close()
