"""``torch.save`` records of plain tensors: written around the tensor's own bytes, and read straight into the
tensor they are loaded into.

A ``torch_dist`` data shard is a run of ``torch.save`` records, one per tensor item, each a zip archive
with ``data.pkl`` (the call that rebuilds the tensor) and ``data/0`` (its bytes). torch's reader
``torch.load``s every record: the weights-only unpickler (pure Python), a fresh storage, then a copy into
the destination. On one rank of a 325 MB model that is 538 records and most of the load.

**The record's form.** Without a CRC-32, the record ``torch.save`` writes for a contiguous CPU tensor is
the same bytes for every tensor of one dtype and shape, apart from the tensor's own bytes in the middle:
the pickle names only the dtype, shape and stride; the zip members' sizes and offsets follow from them;
and the serialization id torch writes last combines the member names with their CRCs, all 0.
:func:`record_form` takes those bytes before and after the tensor's from ``torch.save`` itself (of an
uninitialised tensor of that dtype and shape, into a sink that keeps everything but the tensor's bytes),
once per form. So the record is still defined by torch, not by a copy of its format here.

**Writing** (:func:`write_record`): the bytes before, the tensor's bytes as they are, the bytes after:
three writes instead of the 39 ``torch.save`` makes through the pickler and the zip writer, 0.5 ms a
record on 2 cores. The result is ``torch.save``'s byte for byte (``tests/test_tensor_record.py``).

**Reading** (:func:`read_into`, :func:`data_offset`): the tensor's bytes are read directly into the
destination, one copy, when the record is exactly what ``torch.save`` writes for a contiguous CPU tensor
of the destination's dtype and shape. A record of that form without a CRC (every record mars writes) is
recognised by comparing its bytes before and after the tensor's with :func:`record_form`'s. Any other
record is parsed: ``data.pkl`` with ``pickletools.genops``, which executes nothing, must be that call with
those numbers and nothing else; ``data/0`` must be stored uncompressed with the destination's size.
Anything else (another dtype, a slice of the record, a record of another form) returns False, and the
caller reads it the general way (``torch.load(weights_only=True)``), so nothing a file says is run either
way.

Neither member's CRC-32 is checked. The records mars writes carry none (:func:`records_without_crc`),
because the manifest's BLAKE3 digest of every data shard, checked before a load, already covers each byte,
and the CRC was over a quarter of a conversion's time on a CPU without CRC instructions. ``torch.load``
does not check it either.

The form of ``data.pkl`` is checked against ``torch.save`` itself: for each dtype and number of
dimensions, the record of a one-element tensor must match the form expected here, or the parsed path is
not used for them (a torch that pickles tensors differently reads everything the general way).
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickletools
import struct
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RecordForm", "data_offset", "read_into", "record_form", "records_without_crc", "write_record"]

_MEMO = frozenset({"BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"})
_INTS = frozenset({"BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4"})
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_SIGNATURE = 0x04034B50
_STORED = 0
_MAX_PICKLE = 1 << 16  # a plain tensor's data.pkl is a few hundred bytes

Op = tuple[str, Any]


@contextmanager
def records_without_crc() -> Iterator[None]:
    """``torch.save`` writes its zip members with a CRC-32 of 0 while this is open, instead of computing
    one over every byte on the saving thread (0.14 s of a 0.5 s conversion of a 325 MB model, 2 cores
    without CRC instructions). The checkpoint loses no check: the manifest's BLAKE3 digest of every data
    shard covers the same bytes and is verified before any load, and neither ``torch.load`` nor our
    record reader checks a member's CRC. The switch is torch's process-wide one; a ``torch.save`` on
    another thread meanwhile writes no CRC either, which every reader accepts."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


@dataclass(frozen=True)
class RecordForm:
    """The record ``torch.save`` writes without a CRC for any contiguous CPU tensor of one dtype and shape:
    ``prefix``, then the tensor's ``nbytes`` bytes, then ``suffix`` (module docstring)."""

    prefix: bytes
    suffix: bytes
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)


class _FormSink:
    """The stream :func:`record_form` saves into: keeps every write but the one of the tensor's own bytes
    (told apart by their address: ``torch.save`` hands the storage's memory over as it is), where it
    notes the place."""

    def __init__(self, start: int, nbytes: int) -> None:
        self._range = (start, start + nbytes)
        self.before: list[bytes] = []
        self.after: list[bytes] = []
        self.data_writes = 0  # writes of the tensor's bytes
        self.split = False  # one of them held only part: the bytes have no single place in the record

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        at = np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else -1
        if self._range[0] <= at and at + view.nbytes <= self._range[1]:
            self.data_writes += 1
            self.split |= view.nbytes != self._range[1] - self._range[0]
        else:
            (self.after if self.data_writes else self.before).append(bytes(view))
        return view.nbytes

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def record_form(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordForm | None:
    """The :class:`RecordForm` of a ``dtype`` tensor of ``shape``, taken from ``torch.save`` (module
    docstring); None for a tensor of no bytes, or if torch does not write its bytes in one piece (such
    records are written and read the general way). Cached: a model's records repeat a few dozen forms."""
    try:  # never touched: its bytes are not kept (the kernel maps a large one lazily)
        tensor = torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError, ValueError, OverflowError):  # a shape no machine holds
        return None
    if tensor.nbytes == 0:
        return None
    sink = _FormSink(tensor.data_ptr(), tensor.nbytes)
    with records_without_crc():
        torch.save(tensor, sink)
    if sink.data_writes != 1 or sink.split:
        return None
    return RecordForm(b"".join(sink.before), b"".join(sink.after), tensor.nbytes)


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``torch.save`` writes ``tensor`` in the :class:`RecordForm` of its dtype and shape: a plain
    contiguous CPU tensor that owns exactly its bytes, with nothing else to pickle."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and not tensor.__dict__
    )


def write_record(stream: Any, tensor: torch.Tensor) -> None:
    """``torch.save(tensor, stream)`` without a CRC, byte for byte, as three writes when ``tensor`` is
    plain (:class:`RecordForm`); the tensor's bytes are handed to ``stream.write`` as a view of its own
    memory, as ``torch.save`` hands them. Any other tensor goes through ``torch.save``."""
    form = record_form(tensor.dtype, tuple(tensor.shape)) if _plain(tensor) else None
    if form is None:
        with records_without_crc():
            torch.save(tensor, stream)
        return
    stream.write(form.prefix)
    stream.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    stream.write(form.suffix)


def read_into(fd: int, offset: int, length: int, target: torch.Tensor) -> bool:
    """Fill ``target`` from the ``torch.save`` record at ``offset`` (``length`` bytes) of the open file
    ``fd`` if the record is the plain one of a tensor like ``target`` (module docstring); False, with
    ``target`` unchanged, if it is not. ``OSError`` if the file cannot be read."""
    if target.device.type != "cpu" or not target.is_contiguous():
        return False
    start = data_offset(fd, offset, length, target.dtype, tuple(target.shape))
    if start is None:
        return False
    _read_fully(fd, target.reshape(-1).view(torch.uint8).numpy(), start)
    return True


def data_offset(fd: int, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """Where in the file the bytes of the tensor stored by the record at ``offset`` start, if the record
    is the plain one of a contiguous ``dtype`` tensor of ``shape`` (module docstring); None if it is not.
    The tensor's ``numel * itemsize`` bytes from there are inside the record."""
    form = record_form(dtype, shape)
    if form is not None and length == form.length:
        end = offset + len(form.prefix) + form.nbytes
        if (
            os.pread(fd, len(form.prefix), offset) == form.prefix
            and os.pread(fd, len(form.suffix), end) == form.suffix
        ):
            return offset + len(form.prefix)
    view = _RecordView(fd, offset, length)
    try:
        archive = zipfile.ZipFile(view)
        pickled = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickled) != 1:
            return None
        prefix = pickled[0].removesuffix("data.pkl")
        info = archive.getinfo(pickled[0])
        data = archive.getinfo(prefix + "data/0")
        at = _member_start(view, info)
        if at is None or info.file_size > _MAX_PICKLE:
            return None
        if not _is_plain(view.pread(at, info.file_size), dtype, shape):
            return None
        start = _member_start(view, data)
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, struct.error, NotImplementedError):
        return None
    if start is None or data.file_size != dtype.itemsize * math.prod(shape):
        return None
    return offset + start


def _member_start(view: _RecordView, info: zipfile.ZipInfo) -> int | None:
    """Where the bytes of the stored (uncompressed) member ``info`` start in the record, if they lie
    inside it. Read through its local header, not ``ZipFile.read``: the member's CRC-32 is not checked
    (records written without one hold 0 there, module docstring)."""
    if info.compress_type != _STORED or info.compress_size != info.file_size:
        return None
    header = _LOCAL_HEADER.unpack(view.pread(info.header_offset, _LOCAL_HEADER.size))
    if header[0] != _LOCAL_SIGNATURE:
        return None
    start = info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
    if start + info.file_size > view.length:
        return None
    return start


def _read_fully(fd: int, into: Any, at: int) -> None:
    view, done = memoryview(into), 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], at + done)
        if got == 0:
            raise EOFError(f"data ends {view.nbytes - done} bytes early")
        done += got


@functools.lru_cache(maxsize=4096)
def _is_plain(pickled: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether ``pickled`` is the ``data.pkl`` of a plain ``dtype`` tensor of ``shape``. Cached by its
    bytes: the records of one model repeat a few dozen forms (every expert's weight pickles alike)."""
    return _ops(pickled) == _expected(dtype, shape)


def _ops(pickled: bytes) -> list[Op]:
    """The opcodes of a pickle with their arguments, memo bookkeeping left out and every integer opcode
    named ``INT`` (which one pickle picks depends on the value)."""
    out = []
    for opcode, arg, _ in pickletools.genops(pickled):
        if opcode.name in _MEMO:
            continue
        out.append(("INT" if opcode.name in _INTS else opcode.name, arg))
    return out


def _tuple(values: tuple[int, ...]) -> list[Op]:
    """How pickle protocol 2 writes a tuple of integers."""
    ints = [("INT", v) for v in values]
    if not values:
        return [("EMPTY_TUPLE", None)]
    if len(values) <= 3:
        return [*ints, (f"TUPLE{len(values)}", None)]
    return [("MARK", None), *ints, ("TUPLE", None)]


def _form(storage: str, shape: tuple[int, ...]) -> list[Op]:
    """``data.pkl`` of ``torch.save`` of a contiguous CPU tensor of ``shape`` whose storage class is
    ``storage``: ``torch._utils._rebuild_tensor_v2(<storage '0' on cpu of numel elements>, 0, shape,
    stride, False, OrderedDict())``."""
    numel = 1
    stride = []
    for size in reversed(shape):
        stride.append(numel)
        numel *= size
    return [
        ("PROTO", 2),
        ("GLOBAL", "torch._utils _rebuild_tensor_v2"),
        ("MARK", None),
        ("MARK", None),
        ("BINUNICODE", "storage"),
        ("GLOBAL", storage),
        ("BINUNICODE", "0"),
        ("BINUNICODE", "cpu"),
        ("INT", numel),
        ("TUPLE", None),
        ("BINPERSID", None),
        ("INT", 0),
        *_tuple(shape),
        *_tuple(tuple(reversed(stride))),
        ("NEWFALSE", None),
        ("GLOBAL", "collections OrderedDict"),
        ("EMPTY_TUPLE", None),
        ("REDUCE", None),
        ("TUPLE", None),
        ("REDUCE", None),
        ("STOP", None),
    ]


@functools.lru_cache(maxsize=1024)
def _expected(dtype: torch.dtype, shape: tuple[int, ...]) -> list[Op] | None:
    storage = _storage_class(dtype, len(shape))
    return None if storage is None else _form(storage, shape)


@functools.cache
def _storage_class(dtype: torch.dtype, ndim: int) -> str | None:
    """The storage class ``torch.save`` names for ``dtype``, if its record of a one-element tensor of
    ``ndim`` dimensions has the form :func:`_form` expects (None otherwise: not read directly)."""
    buffer = io.BytesIO()
    torch.save(torch.zeros((1,) * ndim, dtype=dtype), buffer)
    with zipfile.ZipFile(buffer) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        ops = _ops(archive.read(names[0]))
    storage = ops[5][1] if len(ops) > 5 and ops[5][0] == "GLOBAL" else None
    if not isinstance(storage, str) or ops != _form(storage, (1,) * ndim):
        return None
    return storage


class _RecordView(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file as a seekable read-only file, read with
    ``pread`` (``zipfile`` reads a record's directory through it)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise ValueError("seek before the start of the record")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        size = max(0, min(view.nbytes, self._length - self._pos))
        got = os.preadv(self._fd, [view[:size]], self._offset + self._pos) if size else 0
        self._pos += got
        return got

    @property
    def length(self) -> int:
        return self._length

    def pread(self, at: int, size: int) -> bytes:
        if at < 0 or at + size > self._length:
            raise ValueError("read outside the record")
        return os.pread(self._fd, size, self._offset + at)
