"""Durable writes (``mars_megatron/checkpoint/atomic.py``): what a staged checkpoint or export is synced
with before it is renamed into place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mars_megatron.checkpoint.atomic import SyncBehind, fsync_tree


def test_fsync_tree_syncs_a_nested_tree_and_follows_no_link(tmp_path: Path) -> None:
    """Every file and folder of a staged tree is synced in place (nothing is rewritten); a symlink, even
    a dangling one (the HF hub cache is made of links), is not followed."""
    (tmp_path / "model" / "sub").mkdir(parents=True)
    files = {"a.bin": b"a" * 5000, "model/b.distcp": b"b" * 70000, "model/sub/c.json": b"{}"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "model" / "gone").symlink_to(tmp_path / "nowhere")
    fsync_tree(tmp_path)
    assert {n: (tmp_path / n).read_bytes() for n in files} == files
    assert (tmp_path / "model" / "gone").is_symlink()


def test_sync_behind_syncs_each_file_and_waits(tmp_path: Path) -> None:
    paths = [tmp_path / f"shard{i}" for i in range(3)]
    fds = [os.open(p, os.O_CREAT | os.O_WRONLY, 0o644) for p in paths]
    try:
        with SyncBehind("test-sync") as sync:
            for i, fd in enumerate(fds):
                os.write(fd, bytes([i]) * 5000)
                sync.fsync(fd)
            sync.wait()
    finally:
        for fd in fds:
            os.close(fd)
    assert [p.read_bytes() for p in paths] == [bytes([i]) * 5000 for i in range(3)]


def test_sync_behind_raises_a_failed_fsync_at_wait() -> None:
    """A file is durable only once ``wait`` returns: a sync that failed on the thread is raised there."""
    fd = os.sysconf("SC_OPEN_MAX") + 7  # above any descriptor this process can hold: EBADF
    with SyncBehind("test-sync") as sync:
        sync.fsync(fd)
        with pytest.raises(OSError):
            sync.wait()
        sync.wait()  # reported once
