"""Saving a Megatron dist checkpoint (``torch_dist``) in the saving process, hashed as it is written.

``dist_checkpointing.save`` of megatron-core 0.16.1 writes the data shards from forked processes: it
clones every tensor that is a view (both halves of every SwiGLU ``linear_fc1``, nearly two thirds of an
MoE model's bytes), forks a process that forks one writer per file, and ships the results back through a
``multiprocessing`` manager queue. Built for a GPU trainer that saves asynchronously, on a one-off
conversion that is most of the time: 0.49 s of a 0.64 s save of a 325 MB model (2 cores). The manifest
then read every byte back to hash it (0.18 s).

Here megatron and torch still do everything that defines the format: the sharded state dict and its
validation, the save plan, ``.metadata``, ``common.pt``, ``metadata.json``, and every item of a data shard
is written by torch's own ``_write_item`` (a ``torch.save`` per tensor, at the offsets ``.metadata``
records). What changes is only who writes the data shards, and how:

* this process writes them, one file after another, with no fork and no result queue;
* a tensor that is a view is saved through a tensor that owns exactly its bytes (the same memory, no
  copy): ``torch.save`` of a view would store the whole underlying storage, which is why megatron clones;
* each file's digest (the manifest's BLAKE3) is computed from the bytes as they are written, on a thread of
  its own (hashing releases the GIL), and handed to the manifest
  (:func:`~mars_megatron.checkpoint.manifest.record_written`), which then need not read the file back;
* every file is fsynced (megatron leaves ``common.pt`` and ``metadata.json`` to the page cache), and the
  directory after them;
* each record's zip members carry no CRC-32
  (:func:`~mars_megatron.checkpoint.tensor_record.records_without_crc`): the manifest's digest of the
  whole shard covers the same bytes, is checked before every load, and is computed on another core.

The loader cannot tell the difference: ``tests/test_dist_save.py`` checks that the data shards are byte
for byte those ``dist_checkpointing.save`` writes with the CRC turned off the same way, that ``.metadata``
places every item at the same offset of the same file, and that both load back bit-exactly, through our
loader and through megatron's.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    FileSystemWriterAsync,
    _split_by_size_and_type,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.api import _wrap_exception
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from mars_megatron.checkpoint.atomic import SyncBehind, fsync_dir, fsync_file
from mars_megatron.checkpoint.file_bytes import Origin, write_at
from mars_megatron.checkpoint.manifest import ALGORITHM, new_digest, record_written
from mars_megatron.checkpoint.tensor_record import records_without_crc

__all__ = ["FILES_PER_RANK", "DigestThread", "ShardFile", "save"]

FILES_PER_RANK = 2
"""Data shards each rank writes (megatron's default ``thread_count``): the items are split between them
by size; each file is fsynced while the next one is written."""

_SMALL = 1 << 20
"""Writes below this many bytes (zip headers, pickles, small tensors) are gathered into one buffer: they
come from torch's transient buffers, so they are copied, and one system call writes many of them."""


def save(sharded_state_dict: Any, directory: str | Path, *, content_metadata: dict | None = None) -> None:
    """``dist_checkpointing.save`` of ``sharded_state_dict`` into ``directory`` in the ``torch_dist``
    format, written by this process (collective, like megatron's)."""
    from megatron.core import dist_checkpointing

    root = Path(directory)
    with records_without_crc():
        dist_checkpointing.save(
            sharded_state_dict,
            str(root),
            sharded_strategy=InProcessSaveStrategy(),
            content_metadata=content_metadata,
        )
    # megatron's own files, written without fsync (.metadata is fsynced by torch's writer)
    for name in ("common.pt", "metadata.json"):
        if (root / name).is_file():
            fsync_file(root / name)
    fsync_dir(root)


class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's ``torch_dist`` save strategy with :class:`InProcessWriter` as its storage writer.

    ``async_save`` follows megatron-core 0.16.1's own line for line, without the cached-plan branches
    (a conversion saves once), apart from the writer (``tests/test_dist_save.py`` notices if megatron's
    changes)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1, thread_count=FILES_PER_RANK)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        from megatron.core.dist_checkpointing.strategies import torch as mtorch
        from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan

        sharded_state_dict, _, _ = mtorch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mtorch.mcore_to_pyt_state_dict(sharded_state_dict, False)
        writer = InProcessWriter(checkpoint_dir, thread_count=self.thread_count)
        save_state_dict_ret, *_ = save_state_dict_async_plan(
            pyt_state_dict,
            writer,
            None,
            0,
            planner=mtorch.MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            ),
        )
        return self._get_save_and_finalize_callbacks(writer, save_state_dict_ret)


class InProcessWriter(FileSystemWriterAsync):
    """megatron's storage writer, writing its files in the calling process (see the module docstring).

    megatron calls :meth:`prepare_write_data` while planning, then the function from
    :meth:`get_save_function_and_args`, then (after a barrier) :meth:`retrieve_write_results` to build
    ``.metadata``. A failure is returned from there as torch's wrapped exception, so that megatron raises
    it on every rank rather than leaving the others waiting."""

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        prefix = plan.storage_data.prefix
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        self._files = [(f"{prefix}{i}{DEFAULT_SUFFIX}", bucket) for i, bucket in enumerate(buckets)]
        self._planner = planner
        self._results: list[WriteResult] | Any = []

    def get_save_function_and_args(self) -> tuple[Callable | None, Callable | None, list]:
        return (self._write_files, None, []) if self._files else (None, None, [])

    def retrieve_write_results(self) -> Any:
        return self._results

    def _write_files(self) -> None:
        hasher = DigestThread()
        sync = SyncBehind("dist-save-sync")
        files: list[ShardFile] = []
        try:
            for name, items in self._files:
                shard = ShardFile(Path(self.checkpoint_dir) / name, hasher, sync)
                files.append(shard)
                self._results.extend(self._write_items(shard, name, items))
                shard.complete()  # synced while the next file is written
            sync.wait()
            digests = hasher.join()
            for shard in files:
                shard.close()
                record_written(shard.path, digests[shard.path])
        except Exception as e:  # reported on every rank by megatron's finalize
            self._results = _wrap_exception(e)
        finally:
            sync.close()
            hasher.stop()
            for shard in files:
                shard.close()

    def _write_items(self, shard: ShardFile, name: str, items: list[WriteItem]) -> list[WriteResult]:
        results = []
        # bytes first, then tensors: the order of megatron's and torch's writers
        for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
            data = self._planner.resolve_data(item)
            if item.type != WriteItemType.BYTE_IO:
                data = owning_storage(data)
                shard.holding(data)
            result = _write_item(
                self.transforms, shard, data, item, name, serialization_format=SerializationFormat.TORCH_SAVE
            )
            results.append(result)
        return results


def owning_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU as a tensor whose storage is exactly its bytes, so that ``torch.save``
    writes those bytes only (as it would write a clone of it). A contiguous view shares the memory of
    ``tensor``; only a non-contiguous one is copied."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    if not tensor.is_contiguous():
        return tensor.clone()
    raw = tensor.reshape(-1).view(torch.uint8).numpy()  # this view's bytes, not the whole storage
    return torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape)


class ShardFile:
    """The stream ``_write_item`` writes one data shard through: small writes are buffered and copied,
    large ones (a tensor's storage, passed by ``torch.save`` as a view of the tensor's own memory) go to
    the file and the hasher as they are; ``tell`` is the offset ``.metadata`` records."""

    def __init__(self, path: Path, hasher: DigestThread, sync: SyncBehind) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        self._hasher = hasher
        self._sync = sync
        self._pending = bytearray()
        self._written = 0
        self._held: torch.Tensor | None = None
        self._held_range = (0, 0)
        self._held_origin: Origin | None = None

    def holding(self, tensor: torch.Tensor, origin: Origin | None = None) -> None:
        """The tensor being saved next: its memory may be handed to the hasher without a copy, and its
        bytes copied by the kernel from ``origin`` (a file holding them, :mod:`.file_bytes`) if given."""
        self._held = tensor
        start = tensor.data_ptr()
        self._held_range = (start, start + tensor.nbytes)
        self._held_origin = origin

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data if size >= _SMALL else 0
        if size < _SMALL or not self._held_range[0] <= start <= self._held_range[1] - size:
            self._pending += view
            if len(self._pending) >= _SMALL:
                self.flush()
            return size
        self.flush()
        origin = self._held_origin
        if origin is not None:
            origin = (origin[0], origin[1] + start - self._held_range[0])
        self._write_all(view, origin)
        self._hasher.update(view, keep=self._held)
        return size

    def _write_all(self, view: memoryview, origin: Origin | None = None) -> None:
        assert self._fd is not None
        write_at(self._fd, self._written, view, origin)
        self._written += view.nbytes

    def tell(self) -> int:
        return self._written + len(self._pending)

    def flush(self) -> None:
        if self._pending:
            chunk = bytes(self._pending)
            self._pending.clear()
            self._write_all(memoryview(chunk))
            self._hasher.update(memoryview(chunk), keep=None)

    def complete(self) -> None:
        """Everything is written: the file's digest ends here, and it is synced behind the caller (kept
        open until the :class:`SyncBehind` has waited)."""
        assert self._fd is not None
        self.flush()
        self._hasher.end_file(self.path)
        self._sync.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DigestThread:
    """The manifest's digest of each file from the chunks written to it, in order, on a thread of its own."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Any, Any]] = queue.Queue()
        self._digests: dict[Path, dict[str, Any]] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dist-save-digest", daemon=True)
        self._thread.start()

    def update(self, view: memoryview, keep: Any) -> None:
        """Hash ``view`` next; ``keep`` holds its memory alive until then."""
        self._queue.put(("data", view, keep))

    def end_file(self, path: Path) -> None:
        self._queue.put(("end", path, None))

    def join(self) -> dict[Path, dict[str, Any]]:
        """Every file's manifest entry (size and digest), once the thread has hashed all queued."""
        self._queue.put(("join", None, None))
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digests

    def stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(("join", None, None))
            self._thread.join()

    def _run(self) -> None:
        digest, size = new_digest(), 0
        while True:
            kind, payload, _ = self._queue.get()
            if kind == "join":
                return
            if self._error is not None:
                continue
            try:
                if kind == "data":
                    digest.update(payload)
                    size += payload.nbytes
                else:
                    self._digests[payload] = {"size": size, ALGORITHM: digest.hexdigest()}
                    digest, size = new_digest(), 0
            except BaseException as e:  # surfaced by join
                self._error = e
