"""``torch.save`` records of plain tensors (``checkpoint/tensor_record.py``). Written around the tensor's
bytes: ``torch.save``'s record byte for byte. Read straight into the destination: exact for the plain record
of a tensor like the destination, and a refusal (False, destination untouched, nothing run) for every other
record, which the loader then reads the general way."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from mars_megatron.checkpoint.tensor_record import (
    data_offset,
    read_into,
    record_form,
    records_without_crc,
    write_record,
)


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
    """What ``records_without_crc`` writes: every member's CRC-32 is 0, and the record is still
    read straight into its destination (``zipfile`` would refuse to read its members)."""
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


class _Stream:
    """A stream like a data shard's: ``torch.save`` and ``write_record`` write into it (and flush it)."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.writes = 0

    def write(self, data: object) -> int:
        self.writes += 1
        return self.buffer.write(data)  # type: ignore[arg-type]

    def flush(self) -> None:
        pass


def _saved_without_crc(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    with records_without_crc():
        torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (1, 4096)])
def test_a_written_record_is_torch_saves_byte_for_byte(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape) * 100).to(dtype)
    stream = _Stream()
    write_record(stream, tensor)
    assert stream.buffer.getvalue() == _saved_without_crc(tensor)
    assert stream.writes == 3  # the bytes before, the tensor's own, the bytes after
    assert torch.equal(torch.load(io.BytesIO(stream.buffer.getvalue()), weights_only=True), tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(4, 3).t(),  # strided
        torch.randn(8, 3)[2:6],  # a view of a larger storage: torch.save stores all of it
        torch.randn(3, 4).requires_grad_(),
        torch.nn.Parameter(torch.randn(3)),
        torch.zeros(0, 4),  # no bytes
    ],
    ids=["strided", "view", "requires-grad", "parameter", "empty"],
)
def test_any_other_tensor_is_written_by_torch_save(tensor: torch.Tensor) -> None:
    stream = _Stream()
    write_record(stream, tensor)
    assert stream.buffer.getvalue() == _saved_without_crc(tensor)
    assert stream.writes > 3


def test_a_record_of_the_known_form_is_found_by_its_bytes(tmp_path: Path) -> None:
    """Records mars writes are matched against :func:`record_form`; one of the same length whose bytes
    around the tensor differ is not taken for it (here it is then parsed, and refused)."""
    tensor = torch.randn(6, 4)
    form = record_form(tensor.dtype, (6, 4))
    assert form is not None and form.nbytes == tensor.nbytes
    record = bytearray(_saved_without_crc(tensor))
    assert len(record) == form.length and record.startswith(form.prefix) and record.endswith(form.suffix)
    path = tmp_path / "shard.distcp"
    at = record.index(b"FloatStorage")  # the pickle names another class: not a plain tensor's record
    record[at : at + 5] = b"Evil_"
    path.write_bytes(b"\0" * 5 + _saved_without_crc(tensor) + bytes(record))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert data_offset(fd, 5, form.length, tensor.dtype, (6, 4)) == 5 + len(form.prefix)
        assert data_offset(fd, 5 + form.length, form.length, tensor.dtype, (6, 4)) is None
    finally:
        os.close(fd)


def test_a_shape_no_machine_holds_has_no_form() -> None:
    """The form of a shape named by a (hostile) ``.metadata`` is not allocated: no form, no record."""
    assert record_form(torch.float32, (1 << 62,)) is None
    assert record_form(torch.float32, (0, 3)) is None
