"""Tensor bytes written by the kernel from the file a tensor is a view of (``checkpoint/file_bytes.py``):
the right bytes land at the right place, a view that is not one of the file's byte runs has no origin,
and a refused copy falls back to writing from memory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mars_megatron.checkpoint import file_bytes
from mars_megatron.checkpoint.file_bytes import MappedFile, origin_in, write_at


@pytest.fixture
def mapped(tmp_path: Path) -> Iterator[MappedFile]:
    values = torch.arange(4096, dtype=torch.float32)
    path = tmp_path / "source.bin"
    path.write_bytes(b"h" * 24 + values.numpy().tobytes())
    file = MappedFile(path)
    yield file
    file.close()


def test_a_contiguous_view_knows_where_its_bytes_are(mapped: MappedFile) -> None:
    whole = mapped.view(torch.float32, 24, 4096)
    assert mapped.origin(whole) == (mapped.fd, 24)
    rows = whole.view(64, 64)[3:5]  # contiguous rows further in
    assert mapped.origin(rows) == (mapped.fd, 24 + 3 * 64 * 4)
    assert mapped.origin(whole.view(64, 64)[:, :8]) is None  # strided: not one run of bytes
    assert mapped.origin(whole.clone()) is None  # another memory
    assert origin_in([mapped], rows) == mapped.origin(rows)
    assert origin_in([mapped], torch.zeros(3)) is None


def test_write_at_copies_from_the_origin(tmp_path: Path, mapped: MappedFile) -> None:
    rows = mapped.view(torch.float32, 24, 4096).view(64, 64)[10:30]
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"x" * 7)
        write_at(fd, 7, memoryview(rows.numpy()).cast("B"), mapped.origin(rows))
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7  # the file position is not moved
    finally:
        os.close(fd)
    data = out.read_bytes()
    assert data[:7] == b"x" * 7
    assert torch.equal(torch.frombuffer(bytearray(data[7:]), dtype=torch.float32).view(20, 64), rows)


def test_a_refused_copy_writes_from_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source the kernel will not copy from (a pipe): the bytes are written from memory, and no later
    kernel copy is tried."""
    monkeypatch.setattr(file_bytes, "_kernel_copy", True)
    read, write = os.pipe()
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        write_at(fd, 0, memoryview(b"abcdef"), (read, 0))
    finally:
        for f in (fd, read, write):
            os.close(f)
    assert out.read_bytes() == b"abcdef"
    assert file_bytes._kernel_copy is False
