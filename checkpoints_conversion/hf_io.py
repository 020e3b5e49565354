"""Streaming access to HF safetensors checkpoints: read one tensor at a time, write size-bounded shards.

Neither side ever holds the whole model: the reader memory-maps shard files and returns single tensors;
the writer buffers at most one shard (``max_shard_bytes``) before flushing it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files an HF model directory carries besides its weights; copied through conversions unchanged.
ASSET_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class CheckpointError(ValueError):
    """A checkpoint file that is missing, unreadable or does not hold what the model needs."""


class HFReader:
    """Lazily reads tensors of an HF checkpoint directory by name (sharded or single-file)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            self.weight_map: dict[str, str] = dict(weight_map)
        elif (self.dir / SINGLE).is_file():
            with safe_open(self.dir / SINGLE, framework="pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
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
    """Writes tensors in arrival order into ``model-XXXXX-of-YYYYY.safetensors`` shards plus an index."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buffer or any(name in s for s in self._shards):
            raise CheckpointError(f"tensor '{name}' written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().contiguous().cpu()
        self._buffer_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._buffer, str(self.dir / f".shard-{index}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> None:
        """Flush the last shard, give shards their final names and write the index."""
        if self._buffer or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.dir / f".shard-{i}.safetensors", self.dir / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_assets(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config/tokenizer/generation files that exist in ``src`` into ``dst``; returns their names."""
    copied = []
    for name in ASSET_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def iter_tensors(reader: HFReader) -> Iterator[tuple[str, torch.Tensor]]:
    for name in reader.names():
        yield name, reader.get(name)
