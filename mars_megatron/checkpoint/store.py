"""The directory side of training checkpoints: staging, atomic commit, retention, and finding one to resume.

A checkpoint root holds one training history::

    root/
      step_000012/             a complete checkpoint: trainer_state.json, then the manifest, then renamed
        trainer_state.json     the driver's JSON state (step, policy version, data position, ...)
        <policy>/...           what each policy's ranks wrote (see rank_state.py), with its own manifest
        MANIFEST.sha256.json   size and SHA-256 of every file here (a policy folder: of its manifest)
      step_000016/
      latest                   name of the newest checkpoint, for people and tools
      .tmp-step_000020-x1y2/   a checkpoint being written (or left by a crash; removed on the next commit)

Why this shape: ranks may be other processes or other machines writing into a shared filesystem, so the
driver hands them a staging directory and only the driver decides when it is complete. A checkpoint
appears under its final name in one ``rename`` after every byte is on disk, so a crash at any moment
leaves either the previous set of checkpoints or the new one, never a half-written ``step_*``; and a
``step_*`` without ``trainer_state.json`` is never taken for a checkpoint. Checkpoints are removed the
same way in reverse (renamed to ``.tmp-*`` first), so a half-deleted one is never mistaken for complete.
:meth:`CheckpointStore.resolve` checks the one to resume against its manifests (manifest.py) before any
rank starts.

This module needs no torch.distributed: it runs in the driver process. One run writes to a root at a time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mars_megatron.checkpoint.atomic import fsync_dir, write_text_atomic
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.checkpoint.manifest import verify_manifest, write_manifest
from mars_megatron.json_file import read_json

__all__ = ["STATE_FILE", "CheckpointError", "CheckpointStore", "checkpoint_name"]

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
STATE_FORMAT = "mars-trainer-state-v1"
_TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step``; zero-padded so names sort by step."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step_{step:06d}"


def _fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path``: ranks may have left data in the page cache."""
    for dirpath, _, filenames in os.walk(path):
        for filename in filenames:
            file = Path(dirpath) / filename
            if file.is_symlink():
                continue
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


class CheckpointStore:
    """Checkpoints of one run under ``root``, at most ``keep_last`` of them kept."""

    def __init__(self, root: str | Path, keep_last: int) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last

    # ------------------------------------------------------------------------------------------ writing
    def begin(self, step: int) -> Path:
        """Create and return a fresh staging directory for the checkpoint of ``step``; the ranks write
        into it, then :meth:`commit` (or :meth:`abort`) finishes it."""
        name = checkpoint_name(step)
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=self.root))

    def commit(self, staging: str | Path, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` into ``staging`` and publish it as ``step_NNNNNN``; returns the final path.

        Afterwards: ``latest`` names it; complete checkpoints beyond ``keep_last`` are removed (oldest
        first, never this one); checkpoints of a *later* step are removed as well, because they belong to
        a history this run abandoned by resuming from an earlier checkpoint and would otherwise be taken
        for the newest; and staging directories left by crashed runs are removed.
        """
        staging = self._check_staging(staging, step)
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        record = {"format": STATE_FORMAT, "step": step, "state": state}
        try:
            text = json.dumps(record, indent=1, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"trainer state for step {step} is not JSON-serialisable: {e}") from e
        write_text_atomic(staging / STATE_FILE, text)
        write_manifest(staging)  # last; the policy folders are sealed already, so this hashes little
        _fsync_tree(staging)

        final = self.root / checkpoint_name(step)
        if final.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside first. A crash
            # in between leaves no step_NNNNNN, so latest() falls back to the previous checkpoint.
            self._discard(final)
        staging.rename(final)
        fsync_dir(self.root)
        write_text_atomic(self.root / LATEST_FILE, final.name + "\n")
        self._prune(step)
        return final

    def abort(self, staging: str | Path) -> None:
        """Remove a staging directory whose checkpoint will not be committed."""
        path = Path(staging)
        if path.exists():
            shutil.rmtree(path)

    def _check_staging(self, staging: str | Path, step: int) -> Path:
        path = Path(staging)
        expected = f"{_TMP_PREFIX}{checkpoint_name(step)}-"
        if path.parent.resolve() != self.root.resolve() or not path.name.startswith(expected):
            raise ValueError(f"{path}: not a staging directory of step {step} under {self.root} (see begin)")
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: staging directory does not exist (committed or aborted?)")
        return path

    def _discard(self, path: Path) -> None:
        """Rename ``path`` to a ``.tmp-*`` name (one atomic step), then delete it."""
        trash = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}discard-{path.name}-", dir=self.root))
        target = trash / path.name
        path.rename(target)
        fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self, committed: int) -> None:
        complete = self.checkpoints()
        later = [(s, p) for s, p in complete if s > committed]
        for s, p in later:
            log.warning("removing %s: its step %d is later than the one just written (%d)", p, s, committed)
            self._discard(p)
        earlier = [(s, p) for s, p in complete if s < committed]
        for _, p in earlier[: max(0, len(earlier) - (self.keep_last - 1))]:
            self._discard(p)
        for entry in self.root.iterdir():
            if entry.name.startswith(_TMP_PREFIX) or entry.name.endswith(".partial"):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------ reading
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first; staging and incomplete dirs are skipped."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _NAME.match(entry.name)
            if match and entry.is_symlink():  # linked to another step: it would be loaded as this one
                raise CheckpointError(
                    f"{entry}: a symlink (to {entry.resolve()}); a checkpoint is a plain folder"
                )
            if match and (entry / STATE_FILE).is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def latest(self) -> Path | None:
        """The complete checkpoint of the highest step, or ``None`` if there is none."""
        found = self.checkpoints()
        return found[-1][1] if found else None

    def resolve(self, resume: str | Path | bool | None) -> Path | None:
        """Which checkpoint ``--resume`` means: ``True``/``"latest"`` the newest one here (``None`` if
        there is none yet, i.e. a fresh start); ``False``/``None``/``""`` none; anything else a path to
        a complete checkpoint (relative paths are also tried under the root, e.g. ``step_000012``).

        The checkpoint is checked against its manifests first (every file present with its size, every
        digest but the data shards', which the ranks check as they load): :class:`CheckpointError`
        naming the bad files, before anything starts. The newest one is not skipped for an older one
        when it fails: resuming elsewhere than asked is for the user to choose (give its path)."""
        if resume is None or resume is False or resume == "":
            return None
        if resume is True or resume == "latest":
            latest = self.latest()
            if latest is not None:
                verify_manifest(latest)
            return latest
        path = Path(resume)
        if not path.exists() and not path.is_absolute() and (self.root / path).exists():
            path = self.root / path
        if not path.is_dir():
            raise CheckpointError(f"{path}: resume checkpoint does not exist or is not a directory")
        if path.is_symlink():  # a step folder linked to another step: resuming would load that one
            raise CheckpointError(f"{path}: a symlink (to {path.resolve()}); a checkpoint is a plain folder")
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(
                f"{path}: not a complete checkpoint (no {STATE_FILE}; an interrupted save leaves none)"
            )
        verify_manifest(path)
        return path

    @staticmethod
    def load_state(path: str | Path) -> dict[str, Any]:
        """The trainer state that :meth:`commit` stored in checkpoint ``path``."""
        file = Path(path) / STATE_FILE
        if not file.is_file():
            raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint")
        record = read_json(file, CheckpointError)
        if not isinstance(record, dict) or record.get("format") != STATE_FORMAT:
            found = record.get("format") if isinstance(record, dict) else type(record).__name__
            raise CheckpointError(f"{file}: field 'format' is {found!r}, expected {STATE_FORMAT!r}")
        if not isinstance(record.get("state"), dict):
            raise CheckpointError(f"{file}: field 'state' is missing or not an object")
        return record["state"]
