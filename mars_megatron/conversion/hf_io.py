"""Streaming access to HF safetensors checkpoints: read one tensor at a time, write size-bounded shards.

Neither side ever holds the whole model: the reader memory-maps shard files and returns single tensors;
the writer buffers at most one shard (``max_shard_bytes``) before flushing it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from mars_megatron.checkpoint.atomic import SyncBehind
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.checkpoint.file_bytes import Origin, write_at
from mars_megatron.dtypes import SAFETENSORS_TAGS
from mars_megatron.json_file import read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _read_index(index: Path) -> dict[str, str]:
    """``weight_map`` of the safetensors index ``index``: tensor name → shard file, checked.

    The index is input (it comes with a downloaded model), and every shard it names is opened: a name
    such as ``../other/x.safetensors`` or ``/abs/x.safetensors`` would make the reader open files outside
    the model folder, so a shard must be a plain file name in it (what HF writes). Symlinked shards are
    still followed: the HF hub cache is made of them (``snapshots/<rev>/x.safetensors ->
    ../../blobs/<sha>``), and a symlink is put there by whoever set the folder up, not by the index."""
    record = read_json(index, CheckpointError)
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{index}: not a valid safetensors index: holds a JSON {type(record).__name__}, not an object "
            "with a 'weight_map'"
        )
    weight_map = record.get("weight_map")
    if not isinstance(weight_map, dict):
        got = "missing" if "weight_map" not in record else f"a {type(weight_map).__name__}"
        raise CheckpointError(
            f"{index}: not a valid safetensors index: field 'weight_map' is {got}; it must map tensor "
            "names to shard files"
        )
    for name, file in weight_map.items():
        if not _plain_file_name(file):
            raise CheckpointError(
                f"{index}: entry {name!r} of 'weight_map' names shard {file!r}; a shard must be the plain "
                "name of a file in the model folder"
            )
    return weight_map


def _plain_file_name(file: object) -> bool:
    """Whether ``file`` names an entry of the folder itself: no separator, not ``.``/``..``, not absolute
    (backslashes are refused too: an index written on Windows may use them as separators)."""
    return isinstance(file, str) and file not in ("", ".", "..") and "/" not in file and "\\" not in file


class HFReader:
    """Lazily reads tensors of an HF checkpoint directory by name (sharded or single-file)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = _read_index(index)
        elif (self.dir / SINGLE).is_file():
            try:
                with safe_open(self.dir / SINGLE, framework="pt") as f:
                    self.weight_map = {k: SINGLE for k in f.keys()}
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{self.dir / SINGLE}: not a readable safetensors file ({e})") from None
        else:
            raise CheckpointError(f"{self.dir}: no {INDEX} or {SINGLE} found")
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in {INDEX} is missing")
            self._handles[file] = safe_open(path, framework="pt")
        return self._handles[file]

    def _read(self, name: str, what: str) -> Any:
        """One access to ``name`` in its shard (the tensor or its header slice), with errors that name the
        shard file: safetensors names only the tensor."""
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.dir}: tensor '{name}' is missing from the checkpoint")
        try:
            handle = self._handle(file)
            return handle.get_tensor(name) if what == "tensor" else handle.get_slice(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.dir / file}: cannot read tensor '{name}' ({e})") from e

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, "tensor")

    def slice(self, name: str) -> Any:
        """A lazy view of ``name`` (safetensors' slice): indexing it reads only the rows asked for."""
        return self._read(name, "slice")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._read(name, "slice").get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype tag of ``name`` (``F32``, ``BF16``, ``F16`` …), from the header only."""
        return str(self._read(name, "slice").get_dtype())

    def close(self) -> None:
        """Drop the memory maps (their pages otherwise stay resident for the rest of the conversion)."""
        self._handles.clear()

    def file_of(self, name: str) -> Path:
        return self.dir / self.weight_map[name]


class HFWriter:
    """Writes safetensors shards whose layout is fixed up front, each tensor straight to its offset.

    Every name, shape and dtype is known before export starts (they follow from config.json), so each
    shard's header is written first and tensors are then written in any order as they arrive, through
    ``os.pwrite`` (or copied by the kernel from the file a tensor is a view of). Nothing is buffered:
    memory stays at one tensor however large the shards are. A shard whose last tensor arrived is synced
    on a thread while the next ones are written (:class:`~mars_megatron.checkpoint.atomic.SyncBehind`).
    Shards get their final names and the index is written by :meth:`close`, once every tensor arrived and
    every shard is on disk.
    """

    def __init__(
        self,
        out_dir: str | Path,
        layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
        max_shard_bytes: int = 5 * 2**30,
    ) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._layout = layout
        shards: list[list[str]] = [[]]
        size = 0
        for name, (shape, dtype) in layout.items():
            nbytes = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        count = len(shards)
        self._final = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (shard, absolute offset, nbytes)
        self._fds: list[int] = []
        self._pending: list[set[str]] = []
        self._sync = SyncBehind("hf-writer-sync")
        self._total = 0
        for index, names in enumerate(shards):
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                shape, dtype = layout[name]
                nbytes = math.prod(shape) * dtype.itemsize
                header[name] = {
                    "dtype": SAFETENSORS_TAGS[dtype],
                    "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes],
                }
                offset += nbytes
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
            fd = os.open(
                self.dir / f".shard-{index}.safetensors", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            os.pwrite(fd, len(blob).to_bytes(8, "little") + blob, 0)
            os.ftruncate(fd, 8 + len(blob) + offset)
            base = 8 + len(blob)
            for name in names:
                start, end = header[name]["data_offsets"]
                self._where[name] = (index, base + start, end - start)
            self._fds.append(fd)
            self._pending.append(set(names))
            self._total += offset

    def add(self, name: str, tensor: torch.Tensor, origin: Origin | None = None) -> None:
        """Write ``tensor`` as ``name``; copied by the kernel from ``origin`` (a file holding its bytes,
        :mod:`~mars_megatron.checkpoint.file_bytes`) where given."""
        if name not in self._where:
            raise CheckpointError(f"tensor '{name}' is not in the planned layout")
        index, offset, nbytes = self._where[name]
        if name not in self._pending[index]:
            raise CheckpointError(f"tensor '{name}' written twice")
        shape, dtype = self._layout[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise CheckpointError(
                f"tensor '{name}' is {list(tensor.shape)} {tensor.dtype}, "
                f"the layout says {list(shape)} {dtype}"
            )
        data = tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
        assert data.nbytes == nbytes
        write_at(self._fds[index], offset, memoryview(data), origin)
        self._pending[index].discard(name)
        if not self._pending[index]:  # the shard is complete
            self._sync.fsync(self._fds[index])

    def close(self) -> None:
        """Check every planned tensor arrived, give the shards their final names, write the index."""
        missing = [n for pending in self._pending for n in pending]
        try:
            self._sync.wait()
        finally:
            self._sync.close()
            for fd in self._fds:
                os.close(fd)
            self._fds = []
        if missing:
            raise CheckpointError(f"{len(missing)} planned tensor(s) never arrived, e.g. '{missing[0]}'")
        weight_map: dict[str, str] = {}
        for index, final in enumerate(self._final):
            os.replace(self.dir / f".shard-{index}.safetensors", self.dir / final)
        for name, (index, _, _) in self._where.items():
            weight_map[name] = self._final[index]
        index_json = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index_json, indent=2) + "\n")


def iter_tensors(reader: HFReader) -> Iterator[tuple[str, torch.Tensor]]:
    for name in reader.names():
        yield name, reader.get(name)
