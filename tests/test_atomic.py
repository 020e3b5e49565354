"""Durable writes (``mars_megatron/checkpoint/atomic.py``): what a staged checkpoint or export is synced
with before it is renamed into place."""

from __future__ import annotations

from pathlib import Path

from mars_megatron.checkpoint.atomic import fsync_tree


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
