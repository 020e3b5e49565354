"""Reading a ``torch.save`` record of a plain tensor straight into the tensor it is loaded into.

A ``torch_dist`` data shard is a run of ``torch.save`` records, one per tensor item, each a zip archive
with ``data.pkl`` (the call that rebuilds the tensor) and ``data/0`` (its bytes). torch's reader
``torch.load``s every record: the weights-only unpickler (pure Python), a fresh storage, then a copy into
the destination. On one rank of a 325 MB model that is 538 records and most of the load.

:func:`read_into` reads ``data/0`` directly into the destination, one copy, when the record is exactly
what ``torch.save`` writes for a contiguous CPU tensor of the destination's dtype and shape: ``data.pkl``
is parsed with ``pickletools.genops``, which executes nothing, and must be that call with those numbers
and nothing else; ``data/0`` must be stored uncompressed with the destination's size. Anything else
(another dtype, a slice of the record, a record of another form) returns False, and the caller reads it
the general way (``torch.load(weights_only=True)``), so nothing a file says is run either way.

Neither member's CRC-32 is checked. The records mars writes carry none (``torch.save`` with its CRC turned
off, :func:`~mars_megatron.checkpoint.dist_save.records_without_crc`), because the manifest's BLAKE3
digest of every data shard, checked before a load, already covers each byte, and the CRC was over a quarter
of a conversion's time on a CPU without CRC instructions. ``torch.load`` does not check it either.

The form of ``data.pkl`` is checked against ``torch.save`` itself: for each dtype and number of
dimensions, the record of a one-element tensor must match the form expected here, or the direct path is
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
from typing import Any

import torch

__all__ = ["data_offset", "read_into"]

_MEMO = frozenset({"BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"})
_INTS = frozenset({"BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4"})
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_SIGNATURE = 0x04034B50
_STORED = 0
_MAX_PICKLE = 1 << 16  # a plain tensor's data.pkl is a few hundred bytes

Op = tuple[str, Any]


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
