"""Reading a ``torch.save`` record straight into its destination (``checkpoint/tensor_record.py``): exact for
the plain record of a tensor like the destination, and a refusal (False, destination untouched, nothing
run) for every other record, which the loader then reads the general way."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from mars_megatron.checkpoint.tensor_record import read_into


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@contextmanager
def _records(tmp_path: Path, *objects: object) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """A file holding ``torch.save`` of each object one after another (as a data shard does): its open
    descriptor and each record's (offset, length)."""
    path, places = tmp_path / "shard.distcp", []
    with open(path, "wb") as f:
        f.write(b"\0" * 13)  # records do not start at offset 0 in a shard
        for obj in objects:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            places.append((f.tell(), len(buffer.getvalue())))
            f.write(buffer.getvalue())
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, places
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (0, 4)])
def test_a_plain_record_is_read_exactly(tmp_path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape) * 100).to(dtype)
    with _records(tmp_path, torch.zeros(3), tensor) as (fd, places):
        target = torch.full(shape, 7).to(dtype)
        assert read_into(fd, *places[1], target)
    assert torch.equal(target, tensor)


def test_a_saved_view_is_read_as_its_own_bytes(tmp_path: Path) -> None:
    """What both dist-checkpoint writers store for half of a SwiGLU weight (a clone, or our owning view)."""
    half = torch.randn(8, 4)[4:]
    with _records(tmp_path, half.clone()) as (fd, places):
        target = torch.empty(4, 4)
        assert read_into(fd, *places[0], target)
    assert torch.equal(target, half)


def _refused(tmp_path: Path, saved: object, target: torch.Tensor) -> None:
    before = target.clone()
    with _records(tmp_path, saved) as (fd, places):
        assert not read_into(fd, *places[0], target)
    assert torch.equal(target, before)


def test_other_dtype_shape_or_layout_is_left_to_torch_load(tmp_path: Path) -> None:
    _refused(tmp_path, torch.randn(3, 4), torch.zeros(3, 4, dtype=torch.float64))  # cast: torch's job
    _refused(tmp_path, torch.randn(3, 4), torch.zeros(4, 3))  # another shape
    _refused(tmp_path, torch.randn(4, 3).t(), torch.zeros(3, 4))  # stored strided
    _refused(tmp_path, torch.randn(8, 3)[2:6], torch.zeros(4, 3))  # stored with its whole storage
    _refused(tmp_path, torch.randn(3, 4), torch.zeros(4, 3).t())  # destination not contiguous
    _refused(tmp_path, torch.randn(3, 4).requires_grad_(), torch.zeros(3, 4))


def test_a_record_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _refused(tmp_path, _Payload(marker), torch.zeros(3))
    _refused(tmp_path, {"t": torch.zeros(3), "x": _Payload(marker)}, torch.zeros(3))
    assert not marker.exists()


def test_a_damaged_record_is_refused(tmp_path: Path) -> None:
    with _records(tmp_path, torch.randn(16)) as (fd, places):
        offset, length = places[0]
        target = torch.zeros(16)
        assert not read_into(fd, offset, length - 30, target)  # its zip directory cut off
        assert not read_into(fd, offset + 1, length - 1, target)  # misplaced
    assert torch.equal(target, torch.zeros(16))


def test_a_record_without_crc_is_read_directly(tmp_path: Path) -> None:
    """What ``dist_save.records_without_crc`` writes: every member's CRC-32 is 0, and the record is still
    read straight into its destination (``zipfile`` would refuse to read its members)."""
    from mars_megatron.checkpoint.dist_save import records_without_crc

    tensor = torch.randn(5, 6)
    with records_without_crc():
        with _records(tmp_path, tensor) as (fd, places):
            offset, length = places[0]
            members = zipfile.ZipFile(io.BytesIO(os.pread(fd, length, offset))).infolist()
            assert [m.CRC for m in members] == [0] * len(members)
            target = torch.zeros(5, 6)
            assert read_into(fd, offset, length, target)
    assert torch.equal(target, tensor)
    assert torch.serialization.get_crc32_options()  # restored
