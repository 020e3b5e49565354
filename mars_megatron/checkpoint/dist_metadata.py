"""The ``.metadata`` of a Megatron dist checkpoint (``torch_dist``), read without running code from it.

torch's ``FileSystemReader.read_metadata`` reads it with ``pickle.load``: any class, any call. Here it goes
through :class:`MetadataUnpickler`, which admits only the ``torch.distributed.checkpoint`` metadata classes,
``torch.Size``, dtypes and layouts (:mod:`~mars_megatron.checkpoint.dist_load` has the rest of a load).

A module of its own, importing torch and nothing of megatron's: the launching process reads the metadata in
its pre-flight and the converters in their checks, and megatron-core's import (about 4 s of CPU on this
project's 2-core machines, torch's own excluded) is paid only by the processes that load weights.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from mars_megatron.checkpoint.errors import CheckpointError

__all__ = ["METADATA_FILE", "MetadataUnpickler", "read_metadata"]

METADATA_FILE = ".metadata"

_ALLOWED: dict[str, tuple[str, ...]] = {
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),  # a layout by name (torch.strided)
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ),
    # megatron keeps the save plans in the metadata (to reuse them on the next save)
    "torch.distributed.checkpoint.planner": (
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
    ),
}
"""What a dist checkpoint's ``.metadata`` needs, besides torch dtypes: dataclasses and enums whose
construction runs no code of the file's choosing."""


def _allowed_classes() -> list[type]:
    import importlib

    found = [getattr(importlib.import_module(m), n) for m, names in _ALLOWED.items() for n in names]
    return [c for c in found if isinstance(c, type)]


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals in :data:`_ALLOWED` and torch dtypes.

    Reading also refuses a file that sets attributes on one of those classes (pickle's BUILD can do that
    to any object on its stack, classes included): the class is restored and the file named.
    """

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.path}: refused: it asks for {module}.{name}, which the metadata of a dist checkpoint "
            "never holds, so loading it could run code; nothing from it was run"
        )

    def load(self) -> Any:
        classes = _allowed_classes()
        before = [dict(vars(c)) for c in classes]
        try:
            return super().load()
        finally:
            changed = [c for c, b in zip(classes, before, strict=True) if dict(vars(c)) != b]
            for cls, saved in zip(classes, before, strict=True):
                if cls in changed:
                    _restore(cls, saved)
            if changed:
                names = ", ".join(c.__qualname__ for c in changed)
                raise CheckpointError(f"{self.path}: refused: it rewrites the class(es) {names}")


def _restore(cls: type, saved: dict[str, Any]) -> None:
    for key in set(vars(cls)) - set(saved):
        delattr(cls, key)
    for key, value in saved.items():
        if vars(cls).get(key, _MISSING) is not value:
            setattr(cls, key, value)


_MISSING = object()


def read_metadata(checkpoint_dir: str | Path) -> Metadata:
    """The ``.metadata`` of the dist checkpoint in ``checkpoint_dir``, read through
    :class:`MetadataUnpickler` and checked: a :class:`Metadata` whose storage entries name plain files
    of that directory. :class:`CheckpointError` naming the file otherwise."""
    directory = Path(checkpoint_dir)
    path = directory / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {directory} is not a complete dist checkpoint")
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except Exception as e:  # a cut or garbled pickle raises many types
        raise CheckpointError(f"{path}: unreadable or cut short ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not dist-checkpoint metadata")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{path}: names data file {name!r}, which is not a file of {directory}")
    return metadata
