"""Loading a Megatron dist checkpoint (``torch_dist``) without running code from it.

megatron-core 0.16.1 and torch read such a directory with three kinds of unpickling:

* ``.metadata`` — ``pickle.load`` in torch's ``FileSystemReader.read_metadata``: any class, any call;
* objects inside the ``*.distcp`` shards (``_extra_state`` and other non-tensors) — ``torch.load(...,
  weights_only=False)`` in torch's ``DefaultLoadPlanner.load_bytes``;
* ``common.pt`` — ``torch.load`` without ``weights_only``, so restricted only while nobody sets
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``.

(Tensors in the shards are already read with ``weights_only=True``, ``metadata.json`` is JSON.) Here each
one is restricted: ``.metadata`` goes through
:class:`~mars_megatron.checkpoint.dist_metadata.MetadataUnpickler`, which admits only the
``torch.distributed.checkpoint`` metadata classes, ``torch.Size``, dtypes and layouts (measured on the
checkpoints this project writes, converted and trained, dense and MoE, with and without the distributed
optimizer), and the objects and ``common.pt`` load with ``weights_only=True``. A file that asks for
anything else is refused with a :class:`CheckpointError` naming it and the class, before anything from it
runs. The reader, planner and strategies below are megatron's own with those reads swapped; pass them
with :func:`load` / :func:`load_content_metadata` instead of ``dist_checkpointing.load``.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner, TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mars_megatron.checkpoint.dist_metadata import MetadataUnpickler, read_metadata
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.checkpoint.safe_load import TORCH_LOAD_ERRORS, load_plain, refusal_reason
from mars_megatron.checkpoint.tensor_record import read_into

__all__ = ["MetadataUnpickler", "load", "load_content_metadata", "read_metadata"]

COMMON_FILE = "common.pt"


class SafeFileSystemReader(FileSystemReader):
    """torch's reader, with ``.metadata`` read by :func:`read_metadata` (once: megatron asks again), plain
    tensor records read straight into their destination (:mod:`~mars_megatron.checkpoint.tensor_record`)
    and read failures named by the checkpoint directory."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.directory = Path(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.directory}: per-rank metadata files are not part of this format")
        if self._metadata is None:
            self._metadata = read_metadata(self.directory)
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            rest = self._read_plain_records(plan, planner)
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        except CheckpointError:
            raise
        except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
            raise CheckpointError(
                f"{self.directory}: a data shard is unreadable or cut short ({type(e).__name__}: {e})"
            ) from None

    def _read_plain_records(self, plan: Any, planner: Any) -> list[Any]:
        """Read every tensor item whose record is a plain ``torch.save`` of the whole destination tensor
        straight into it (:mod:`~mars_megatron.checkpoint.tensor_record`); the items left to torch's
        reader are returned."""
        from torch.distributed.checkpoint.planner import LoadItemType

        rest, per_file = [], {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            whole = not any(item.storage_offsets) and not info.transform_descriptors
            if item.type == LoadItemType.TENSOR and whole:
                per_file.setdefault(info.relative_path, []).append(item)
            else:
                rest.append(item)
        for name, items in per_file.items():
            fd = os.open(self.directory / name, os.O_RDONLY)
            try:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    target = planner.resolve_tensor(item).detach()
                    if tuple(item.lengths) == tuple(target.shape) and read_into(
                        fd, info.offset, info.length, target
                    ):
                        planner.commit_tensor(item, target)
                    else:
                        rest.append(item)
            finally:
                os.close(fd)
        return rest


class SafeLoadPlanner(MCoreLoadPlanner):
    """megatron's planner, with the non-tensor objects in the shards loaded by ``weights_only=True``."""

    def __init__(self, *args: Any, directory: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.directory = directory

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"{self.directory}: refused: object {fqn!r} in a data shard holds more than tensors and "
                f"plain values, so loading it could run code; not loaded ({refusal_reason(e)})"
            ) from None
        except TORCH_LOAD_ERRORS as e:
            raise CheckpointError(f"{self.directory}: object {fqn!r} is unreadable ({e})") from None
        if self.flatten_state_dict:  # as torch's DefaultLoadPlanner.load_bytes
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron's ``torch_dist`` load strategy reading through :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`. ``load`` follows megatron-core 0.16.1's own line for line apart from those
    two objects (``tests/test_checkpoint_trust.py`` notices if megatron's changes). ``metadata``: the
    checkpoint's ``.metadata`` already read by :func:`read_metadata`."""

    def __init__(self, metadata: Metadata | None = None) -> None:
        super().__init__()
        self.metadata = metadata

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.dist_checkpointing.strategies import torch as mtorch
        from torch.distributed import checkpoint

        flexible_shape_sharded_tensors = [
            sh_ten
            for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch
        ]
        allow_shape_mismatch_sharded_tensors = {
            sh_ten.key: sh_ten
            for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch
        }
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = mtorch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mtorch.mcore_to_pyt_state_dict(sharded_state_dict, True)
        fsr = SafeFileSystemReader(checkpoint_dir, self.metadata)
        checkpoint.load_state_dict(
            pyt_state_dict,
            fsr,
            planner=SafeLoadPlanner(
                shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
                allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors,
                directory=Path(checkpoint_dir),
            ),
        )
        self.cached_global_metadata = fsr.read_metadata()
        mcore_state_dict = {k: mtorch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = mtorch._replace_sharded_keys_with_state_dict_keys(
            mcore_state_dict, flat_mapping, rename_mapping
        )
        mtorch._restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata | None = None) -> Any:
        return super().load_tensors_metadata(checkpoint_dir, metadata or read_metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: Path) -> Any:
        raise CheckpointError(f"{checkpoint_dir}: sharded-metadata loading is not used by mars (refused)")


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """``common.pt`` through :func:`~mars_megatron.checkpoint.safe_load.load_plain` (``weights_only``)."""

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        return load_plain(Path(checkpoint_dir) / COMMON_FILE)

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        raise CheckpointError(f"{checkpoint_dir}: per-object .pt files are not part of the torch_dist format")


def load(sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
    """``dist_checkpointing.load`` of a ``torch_dist`` checkpoint with every unpickling restricted
    (collective, like megatron's). The metadata is read first, so a crafted one is refused as itself
    rather than inside torch's per-rank failure report; a refusal from inside the load (an object in a
    shard) is raised as the :class:`CheckpointError` it is, on every rank."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import CheckpointException

    metadata = read_metadata(checkpoint_dir)
    _merge_swiglu_halves_in_place(sharded_state_dict)
    try:
        return dist_checkpointing.load(
            sharded_state_dict,
            str(checkpoint_dir),
            sharded_strategy=SafeTorchDistLoadStrategy(metadata),
            common_strategy=SafeCommonLoadStrategy(),
        )
    except CheckpointException as e:
        ours = [failure[0] for failure in e.failures.values() if isinstance(failure[0], CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


SWIGLU_MERGE = "apply_swiglu_sharded_factory.<locals>.sh_ten_merge_fn"
"""megatron's merge of a SwiGLU ``linear_fc1`` loaded as its two halves: ``torch.cat`` along dim 0."""


def _merge_swiglu_halves_in_place(sharded_state_dict: Any) -> None:
    """megatron loads each SwiGLU ``linear_fc1`` as its gate and up halves, views of the parameter (so
    they are read in place), then ``torch.cat``s them into a new tensor that ``load_state_dict`` copies
    back: two copies of nearly two thirds of an MoE model. When the halves are the parameter's two halves
    in order, their concatenation is the parameter itself, returned as is (and copying a tensor onto
    itself is free); anything else is concatenated as before."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory) and value.merge_fn.__qualname__ == SWIGLU_MERGE:
            value.merge_fn = functools.partial(_whole_or_merge, value.data, value.merge_fn)


def _whole_or_merge(whole: torch.Tensor, merge: Any, parts: list[torch.Tensor]) -> torch.Tensor:
    if _tile_dim0(whole, parts):
        return whole
    return merge(parts)


def _tile_dim0(whole: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Whether ``parts`` are consecutive contiguous pieces of ``whole``'s memory along dim 0, covering it:
    then ``torch.cat(parts)`` equals ``whole``."""
    if not parts or not whole.is_contiguous() or whole.dim() == 0:
        return False
    at = whole.data_ptr()
    for part in parts:
        same_kind = part.dtype == whole.dtype and part.device == whole.device and part.dim() == whole.dim()
        if not same_kind or not part.is_contiguous() or part.shape[1:] != whole.shape[1:]:
            return False
        if part.data_ptr() != at:
            return False
        at += part.nbytes
    return at == whole.data_ptr() + whole.nbytes


def load_content_metadata(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """``dist_checkpointing.load_content_metadata``, with ``common.pt`` read by ``weights_only``."""
    from megatron.core.dist_checkpointing.serialization import _CONTENT_METADATA_KEY

    common = SafeCommonLoadStrategy().load_common(checkpoint_dir)
    if not isinstance(common, dict):
        raise CheckpointError(
            f"{Path(checkpoint_dir) / COMMON_FILE}: holds a {type(common).__name__}, not a dict"
        )
    return common.get(_CONTENT_METADATA_KEY)
