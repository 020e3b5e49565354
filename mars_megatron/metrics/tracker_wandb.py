"""Weights & Biases: one W&B run per training run, offline unless ``logging.wandb.mode`` says online.

Offline, W&B writes ``DIR/wandb/offline-run-<time>-<id>/`` (its ``run-<id>.wandb`` transaction log and a
``files/`` folder) and touches no network; ``wandb sync`` uploads it later. The W&B service process starts
and stops with the run (measured offline on this machine: about 0.4 s to start, under 0.1 s to finish);
``init_timeout`` and ``finish_timeout`` bound both, so an unreachable server in online mode cannot hang the
run at its start or its end (what did not upload stays on disk for ``wandb sync``). System metrics, console
capture, git and code saving are off: the run logs what ``metrics.jsonl`` holds. Offline, the driver's
environment gets ``WANDB_MODE=offline`` and ``WANDB_ERROR_REPORTING=false`` (an exported
``WANDB_MODE=online`` made W&B's error reporting look up its server; with these, strace shows no
``AF_INET`` connect at all).

A killed driver (SIGKILL: no close) keeps every step it logged more than ``FLUSH_S`` before: each step's
row is committed when its last values arrive, and the transaction log is written every second (W&B's
default, 15 s, lost a killed run's last steps).

Metrics go under the names and steps of ``metrics.jsonl``; NaN and infinity are logged as they are (W&B
keeps them as NaN/Infinity). The resolved config is the W&B run's config; files are copied into the run's
``files/`` folder and saved from there (a copy, not a link, so the offline run is complete on its own).

Resume: the run id is kept in ``RUN_DIR/trackers.json``. A resume that redoes no step continues the same
W&B run (``resume='allow'``); one that redoes steps a killed run had logged rewinds it to the checkpoint's
step (``resume_from='<id>?_step=<step>'``), so the history holds each step once. A fresh run, or other
project/entity, gets a new run id.
"""

from __future__ import annotations

import os
import secrets
import shutil
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mars_megatron.metrics.trackers import TrackerStart, WandbSpec

INIT_TIMEOUT_S = 60.0
FINISH_TIMEOUT_S = 60.0
FLUSH_S = 1.0
"""How often W&B writes its transaction log to disk (its default, 15 s, lost the last steps of a killed
driver: a SIGKILL 5 s after two steps left a file with no step in it)."""


_own_service: str | None = None
"""The ``WANDB_SERVICE`` token of this process's own W&B service, once it has one."""


def _own_service_only() -> None:
    """Drop a W&B service token inherited from a parent process (W&B puts its service's address in
    ``WANDB_SERVICE`` for children to share): this run must own its service, or a parent's would keep the
    run open after this driver is killed, and the resumed run is refused ("run ID is in use": seen when
    the tests' process had a service of its own)."""
    token = os.environ.get("WANDB_SERVICE")
    if token is not None and token != _own_service:
        del os.environ["WANDB_SERVICE"]


def new_run_id() -> str:
    """A fresh W&B run id: 8 characters of lowercase letters and digits, as W&B makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbTracker:
    def __init__(self, spec: WandbSpec, start: TrackerStart) -> None:
        if spec.mode == "offline":
            # Set before wandb is imported: with WANDB_MODE=online in the environment, its error reporting
            # (Sentry) resolved its server's name even for a run started offline (seen with strace).
            os.environ["WANDB_MODE"] = "offline"
            os.environ["WANDB_ERROR_REPORTING"] = "false"
        import wandb

        global _own_service
        _own_service_only()
        root = Path(spec.dir) if spec.dir is not None else start.run_dir
        root.mkdir(parents=True, exist_ok=True)
        previous = start.previous("wandb", project=spec.project, entity=spec.entity)
        run_id = previous["id"] if previous is not None else new_run_id()
        which: dict[str, Any] = {"id": run_id}  # a new run, or the same run going on
        rewind: dict[str, Any] = {}
        if previous is not None and start.redo:  # back to the checkpoint's step, same run id
            which, rewind = {}, {"resume_from": f"{run_id}?_step={start.resume_step}"}
        elif previous is not None:
            which["resume"] = "allow"
        settings = wandb.Settings(
            console="off",
            x_disable_stats=True,
            x_disable_machine_info=True,
            disable_git=True,
            save_code=False,
            silent=True,
            init_timeout=INIT_TIMEOUT_S,
            finish_timeout=FINISH_TIMEOUT_S,
            x_transaction_log_flush_interval=FLUSH_S,
            **rewind,
        )
        self._run = wandb.init(
            project=spec.project,
            entity=spec.entity,
            mode=spec.mode,
            name=spec.run_name or start.run_name,
            dir=str(root),
            config=dict(start.config),
            settings=settings,
            reinit="create_new",
            **which,
        )
        _own_service = os.environ.get("WANDB_SERVICE")
        if previous is not None:  # a resume may change settings (more steps): the newest config wins
            self._run.config.update(dict(start.config), allow_val_change=True)
        start.state["wandb"] = {"id": run_id, "project": spec.project, "entity": spec.entity}
        self.files_dir = Path(self._run.dir)

    def log(self, step: int, values: Mapping[str, int | float], last: bool) -> None:
        # W&B holds a step's row open for more values until a later step or commit=True: commit the last
        # values of a step, so a killed driver loses no finished step (at most FLUSH_S of them on disk)
        self._run.log(dict(values), step=step, commit=last)

    def log_file(self, path: Path, folder: str) -> None:
        dest = self.files_dir / folder / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        self._run.save(str(dest), base_path=str(self.files_dir), policy="now")

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
