"""Tensor bytes written into a file, copied by the kernel when they are already the bytes of another file.

Why a module of its own: both converters (``conversion/direct.py``) write tensors that are views of a
memory-mapped file (the HF shards one way, the ``torch_dist`` records the other), and writing such a
view through ``write`` makes the process fault in every page of the mapping and copy it out again.
``copy_file_range`` copies from the source file's page cache to the target's inside the kernel, with no
mapping touched: conversions of 325 MB 3–10 % faster on this project's 2-core machines, on disk and on
tmpfs (docs/benchmarks.md#conversion). The digest of what is written is still taken from the mapped view,
on another thread: the same file's bytes.

:class:`MappedFile` maps a file and remembers where, so that :meth:`MappedFile.origin` can say which bytes
of the file a contiguous view holds; :func:`write_at` then copies them from there. Where the kernel or
file system refuses the copy (another file system on an old kernel, a special file), the bytes are written
from memory as before, and no later copy is tried.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["MappedFile", "Origin", "write_at"]

Origin = tuple[int, int]
"""Where the bytes being written already are: an open file descriptor and the offset in that file."""

_REFUSED = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.ESPIPE, errno.EPERM}
_kernel_copy = hasattr(os, "copy_file_range")


class MappedFile:
    """A file mapped privately (copy-on-write: torch wants a writable buffer; nothing writes to it) and
    kept open. The mapping is released with the last view of it; :meth:`close` closes the descriptor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.mapped = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = len(self.mapped)
        self._base = np.frombuffer(self.mapped, dtype=np.uint8).ctypes.data if self.size else 0

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        """``count`` elements of ``dtype`` from byte ``offset``, no copy."""
        return torch.frombuffer(self.mapped, dtype=dtype, count=count, offset=offset)

    def origin(self, tensor: torch.Tensor) -> Origin | None:
        """Where in this file the bytes of ``tensor`` are, if it is a contiguous view of this mapping."""
        start = tensor.data_ptr()
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        if self._base <= start and start + tensor.nbytes <= self._base + self.size:
            return self.fd, start - self._base
        return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def origin_in(files: Any, tensor: torch.Tensor) -> Origin | None:
    """:meth:`MappedFile.origin` of ``tensor`` in the first of ``files`` that holds it."""
    for file in files:
        found = file.origin(tensor)
        if found is not None:
            return found
    return None


def write_at(fd: int, offset: int, data: memoryview, origin: Origin | None = None) -> None:
    """Write ``data`` at ``offset`` of ``fd`` (not moving its file position); copied by the kernel from
    ``origin``, which must hold the same bytes, where it can be."""
    global _kernel_copy
    done = 0
    if origin is not None and _kernel_copy:
        source, at = origin
        try:
            while done < data.nbytes:
                got = os.copy_file_range(source, fd, data.nbytes - done, at + done, offset + done)
                if got == 0:  # the source is shorter than it was when mapped: write from memory
                    break
                done += got
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            _kernel_copy = False
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)
