"""Writes that readers see whole or not at all, and renames that survive a power cut.

Why a module of its own: manifests, checkpoint stores and rank state all write this way, and the
manifest sits below the store.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Make the content of the file ``path`` durable (whoever wrote it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory bottom-up, ``root`` included: before a
    staged directory is renamed into place, so that after a power cut the new name never points at files
    the disk does not hold yet. A file already synced costs a fraction of a millisecond."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        here = Path(dirpath)
        for name in filenames:
            if not (here / name).is_symlink():
                fsync_file(here / name)
        fsync_dir(here)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
