"""HF safetensors ↔ a mars Megatron checkpoint in one process, with no model: tensor bytes copied between
the safetensors files and the ``torch_dist`` records.

A ``torch_dist`` checkpoint stores each parameter as a global tensor cut into chunks, one ``torch.save``
record per chunk, and records where each chunk sits in ``.metadata``. The layout does not depend on who
writes it, so the checkpoint :func:`mars_megatron.convert.hf_to_mcore` writes from a one-rank model
(every parameter whole, SwiGLU halves and experts as chunks of their own) can be written straight from
the HF files: nearly every chunk *is* one HF tensor's bytes, saved from a view of the memory-mapped
source, so each byte is read once and written once. Only ``linear_qkv`` (q, k, v interleaved per query
group) and a padded vocabulary are built in memory, through the same mapping functions as the model path
(:mod:`~mars_megatron.conversion.qwen3_mapping`).

Building a model, filling it and running megatron's save planning cost more than the copy itself (on 2
cores, 325 MB: 1.15 s through a model, 0.37 s here, against 0.35–0.38 s for the raw copy with the same
fsyncs; ``tools/bench/convert.py``). Here the data shards go through the same stream as
:mod:`~mars_megatron.checkpoint.dist_save` (digest on a thread of its own, each file fsynced while the next
is written), split into :data:`FILES` files so that little is left to sync after the last write, and each
record is written around the tensor's bytes (:func:`~mars_megatron.checkpoint.tensor_record.write_record`).

The export (:func:`mcore_to_hf_direct`) walks the same layout backwards: each HF tensor is written from a
view of the mapped record that holds it, after the data shards are checked against the manifest. A
checkpoint written in another layout (a trained policy's TP or EP pieces) is read too, each piece copied
together from the records that overlap it; one missing a tensor is left to the model path.

What makes this safe to ship beside the model path: ``tests/test_conversion.py`` checks that the two
write the same ``.metadata`` entries (keys, global shapes, chunks, objects) for dense and MoE models, and
that a direct checkpoint loads into TP/PP/EP layouts bit-exactly. A conversion that asks for another
dtype goes through the model path (a cast is arithmetic; this one only moves bytes).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mars_megatron.checkpoint.atomic import SyncBehind, fsync_dir, fsync_tree
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.checkpoint.file_bytes import MappedFile, Origin, origin_in
from mars_megatron.checkpoint.model_meta import copy_assets, write_meta
from mars_megatron.checkpoint.tensor_record import data_offset, records_without_crc, write_record
from mars_megatron.config import ParallelConfig
from mars_megatron.conversion.hf_io import HFReader
from mars_megatron.conversion.model_io import validate_hf_checkpoint
from mars_megatron.conversion.qwen3_mapping import ParamPlan, plan_for, shard_into
from mars_megatron.dtypes import torch_dtype
from mars_megatron.models.hf_config import Qwen3Arch, load_hf_config

__all__ = [
    "FILES",
    "Chunk",
    "can_convert_directly",
    "checkpoint_layout",
    "export_problem",
    "hf_to_mcore_direct",
    "mcore_to_hf_direct",
]

FILES = 8
"""Data shards written (fewer for a model of fewer chunks): each is fsynced while the next is written,
so the last one's sync is what is left at the end."""

MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
"""``metadata.json`` as megatron-core writes it for a ``torch_dist`` checkpoint."""


@dataclass(frozen=True)
class Chunk:
    """One record of the checkpoint: a piece of the global tensor ``key``, made from HF tensors."""

    key: str
    offsets: tuple[int, ...]  # where the piece starts in the global tensor
    shape: tuple[int, ...]  # the piece's (the record's) shape
    plan: ParamPlan  # the HF tensors the piece is made of, and how (one rank of one)
    half: int | None = None  # a SwiGLU half stored as a chunk of its own: 0 gate, 1 up (the HF tensor)
    stacked: bool = False  # one layer's slice of a tensor stacked over layers (a leading 1 in ``shape``)


def checkpoint_layout(
    arch: Qwen3Arch, padded_vocab: int
) -> tuple[dict[str, tuple[int, ...]], list[Chunk], list[str]]:
    """Global shape of every tensor, every chunk, and every object key (``_extra_state``) of the
    checkpoint a one-rank model of ``arch`` saves with megatron-core 0.16.1's local spec, in the names
    the Transformer Engine spec reads too (``tests/test_conversion.py`` compares it with megatron's).

    megatron stacks the layers of a homogeneous decoder into one tensor per parameter (``decoder.layers.
    self_attention.linear_qkv.weight`` of shape ``[layers, ...]``, one chunk per layer); a decoder with an
    MoE layer list (every Qwen3-MoE here: ``moe_layer_freq`` is a list) is saved layer by layer."""
    h, layers = arch.hidden_size, arch.num_layers
    stacked = not arch.is_moe
    shapes: dict[str, tuple[int, ...]] = {}
    chunks: list[Chunk] = []
    objects: list[str] = []

    def whole(key: str, shape: tuple[int, ...]) -> None:
        shapes[key] = shape
        chunks.append(Chunk(key, (0,) * len(shape), shape, plan_for(key, arch)))

    def of_layer(
        layer: int,
        rest: str,
        shape: tuple[int, ...],
        *,
        plan: str | None = None,
        at: tuple[int, ...] | None = None,
        piece: tuple[int, ...] | None = None,
        half: int | None = None,
    ) -> None:
        """Layer ``layer``'s tensor ``rest`` (global ``shape``), or the chunk ``piece`` of it at ``at``."""
        made_of = plan_for(f"decoder.layers.{layer}.{plan or rest}", arch)
        at, piece = at or (0,) * len(shape), piece or shape
        if stacked:
            key, shape, at, piece = f"decoder.layers.{rest}", (layers, *shape), (layer, *at), (1, *piece)
        else:
            key = f"decoder.layers.{layer}.{rest}"
        shapes[key] = shape
        chunks.append(Chunk(key, at, piece, made_of, half, stacked))

    def state_of(layer: int, rest: str, index: int = 0, count: int = 1) -> None:
        """The ``_extra_state`` object of a linear layer (of expert ``index`` of ``count``)."""
        if stacked:
            objects.append(f"decoder.layers.{rest}._extra_state/shard_{layer}_{layers}")
        else:
            objects.append(f"decoder.layers.{layer}.{rest}._extra_state/shard_{index}_{count}")

    whole("embedding.word_embeddings.weight", (padded_vocab, h))
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    attn = "self_attention."
    for layer in range(layers):
        of_layer(layer, attn + "linear_qkv.layer_norm_weight", (h,), plan="input_layernorm.weight")
        of_layer(layer, attn + "linear_proj.weight", (h, arch.num_attention_heads * arch.head_dim))
        state_of(layer, attn + "linear_proj")
        of_layer(layer, attn + "linear_qkv.weight", (qkv_rows, h))
        if arch.attention_bias:
            of_layer(layer, attn + "linear_qkv.bias", (qkv_rows,))
        state_of(layer, attn + "linear_qkv")
        of_layer(layer, attn + "q_layernorm.weight", (arch.head_dim,))
        of_layer(layer, attn + "k_layernorm.weight", (arch.head_dim,))
        of_layer(layer, "mlp.linear_fc1.layer_norm_weight", (h,), plan="pre_mlp_layernorm.weight")
        if arch.is_moe and arch.moe_layers[layer]:
            assert arch.num_experts is not None and arch.moe_ffn_hidden_size is not None
            experts, f = arch.num_experts, arch.moe_ffn_hidden_size
            of_layer(layer, "mlp.router.weight", (experts, h))
            for e in range(experts):
                local = f"mlp.experts.local_experts.{e}."
                for i in (0, 1):
                    at, piece = (e, i * f, 0), (1, f, h)
                    fc1 = "mlp.experts.experts.linear_fc1.weight"
                    of_layer(
                        layer,
                        fc1,
                        (experts, 2 * f, h),
                        plan=local + "linear_fc1.weight",
                        at=at,
                        piece=piece,
                        half=i,
                    )
                fc2 = "mlp.experts.experts.linear_fc2.weight"
                of_layer(
                    layer,
                    fc2,
                    (experts, h, f),
                    plan=local + "linear_fc2.weight",
                    at=(e, 0, 0),
                    piece=(1, h, f),
                )
                state_of(layer, "mlp.experts.experts.linear_fc1", e, experts)
                state_of(layer, "mlp.experts.experts.linear_fc2", e, experts)
        else:
            f = arch.ffn_hidden_size
            for i in (0, 1):
                of_layer(layer, "mlp.linear_fc1.weight", (2 * f, h), at=(i * f, 0), piece=(f, h), half=i)
            state_of(layer, "mlp.linear_fc1")
            of_layer(layer, "mlp.linear_fc2.weight", (h, f))
            state_of(layer, "mlp.linear_fc2")
    whole("decoder.final_layernorm.weight", (h,))
    if not arch.tie_word_embeddings:
        whole("output_layer.weight", (padded_vocab, h))
    return shapes, chunks, objects


# ---------------------------------------------------------------------------------------------- source
class _Source:
    """The HF shards memory-mapped, each tensor a view of its bytes (no copy until it is written, and then
    by the kernel, from the file: :mod:`~mars_megatron.checkpoint.file_bytes`)."""

    def __init__(self, reader: HFReader, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._spans: dict[str, tuple[MappedFile, int, int]] = {}
        self.files: list[MappedFile] = []
        try:
            for file in sorted(set(reader.weight_map.values())):
                self._map(reader.dir / file)
        except BaseException:
            self.close()
            raise

    def _map(self, path: Path) -> None:
        # unmapped when the last view of it is gone (the writer holds the last tensor a while)
        mapped = MappedFile(path)
        self.files.append(mapped)
        n = int.from_bytes(mapped.mapped[:8], "little")
        header = json.loads(mapped.mapped[8 : 8 + n])
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = (8 + n + o for o in entry["data_offsets"])
            if not 8 + n <= start <= end <= mapped.size:
                raise CheckpointError(f"{path}: tensor '{name}' lies outside the file")
            self._spans[name] = (mapped, start, end)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        mapped, start, end = self._spans[name]
        return mapped.view(self._dtype, start, (end - start) // self._dtype.itemsize).view(shape)

    def close(self) -> None:
        for file in self.files:
            file.close()


def _record_tensor(chunk: Chunk, source: _Source, shapes: dict[str, tuple[int, ...]], arch: Qwen3Arch) -> Any:
    """The tensor the chunk's record holds: a view of the source where the chunk is one HF tensor."""
    plan = chunk.plan
    if chunk.half is not None:
        name = plan.hf_names[chunk.half]
        return source.get(name, shapes[name]).view(chunk.shape)
    full = [source.get(n, shapes[n]) for n in plan.hf_names]
    natural = chunk.shape[1:] if chunk.stacked else chunk.shape  # the HF tensor's shape, or the fused one
    if plan.split in ("none", "col", "row") or (plan.split == "vocab" and full[0].shape == natural):
        return full[0].view(chunk.shape)
    built = shard_into(torch.empty(natural, dtype=full[0].dtype), plan, full, 0, 1, arch)
    return built.view(chunk.shape)


# --------------------------------------------------------------------------------------------- writing
def _split_files(chunks: list[Chunk], nbytes: list[int], files: int) -> list[list[int]]:
    """Consecutive runs of chunk indices of about equal bytes, one per file."""
    total, out, run, acc = sum(nbytes), [], [], 0
    for i, size in enumerate(nbytes):
        run.append(i)
        acc += size
        if acc * files >= total * (len(out) + 1) and len(out) < files - 1:
            out.append(run)
            run = []
    return [*out, run] if run else out


def _none_record() -> bytes:
    """What megatron stores for a local-spec layer's ``_extra_state`` (``[None]``: the module's ``None``
    in the list a ``ShardedObject`` holds), as a record."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def write_dist_checkpoint(directory: Path, arch: Qwen3Arch, reader: HFReader, padded_vocab: int) -> None:
    """The ``torch_dist`` folder (data shards, ``.metadata``, ``common.pt``, ``metadata.json``) of a
    one-rank model of ``arch`` holding ``reader``'s tensors. The shards' digests are recorded for the
    manifest as they are written, and each shard is synced to disk; the small files are left to the
    caller's sync of the whole folder."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from mars_megatron.checkpoint.dist_save import DigestThread, ShardFile
    from mars_megatron.checkpoint.manifest import record_written
    from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors

    dtype = torch_dtype(arch.dtype)
    hf_shapes = expected_hf_tensors(arch)
    shapes, chunks, objects = checkpoint_layout(arch, padded_vocab)
    nbytes = [dtype.itemsize * int(torch.Size(c.shape).numel()) for c in chunks]
    storage: dict[Any, Any] = {}
    hasher = DigestThread()
    written: list[ShardFile] = []
    source = _Source(reader, dtype)
    try:
        with SyncBehind("direct-sync") as sync, records_without_crc():
            none = _none_record()
            for f, indices in enumerate(_split_files(chunks, nbytes, FILES)):
                name = f"__0_{f}.distcp"
                shard = ShardFile(directory / name, hasher, sync)
                written.append(shard)
                for key in objects if f == 0 else ():  # small: all in the first file
                    at = shard.tell()
                    shard.write(none)
                    storage[MetadataIndex(key)] = _StorageInfo(name, at, len(none))
                for i in indices:
                    chunk = chunks[i]
                    tensor = _record_tensor(chunk, source, hf_shapes, arch)
                    shard.holding(tensor, origin_in(source.files, tensor))
                    at = shard.tell()
                    write_record(shard, tensor)
                    index = MetadataIndex(chunk.key, torch.Size(chunk.offsets))
                    storage[index] = _StorageInfo(name, at, shard.tell() - at)
                shard.complete()  # synced while the next file is written
            sync.wait()
        digests = hasher.join()
    finally:
        hasher.stop()
        source.close()
        for shard in written:
            shard.close()
    for shard in written:
        record_written(shard.path, digests[shard.path])
    properties = TensorProperties(dtype=dtype)
    state: dict[str, Any] = {key: BytesStorageMetadata() for key in objects}
    for key, shape in shapes.items():
        state[key] = TensorStorageMetadata(properties, torch.Size(shape), [])
    for chunk in chunks:
        state[chunk.key].chunks.append(
            ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.shape))
        )
    metadata = Metadata(
        state_dict_metadata=state,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(directory), save_id=uuid.uuid4().hex),
        version=CURRENT_DCP_VERSION,
    )
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    torch.save({}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))  # synced by the caller


# ------------------------------------------------------------------------------------------- HF → mcore
def can_convert_directly(hf_dir: str | Path, dtype: str | None) -> bool:
    """Whether :func:`hf_to_mcore_direct` writes what was asked: no cast (the source's dtype)."""
    return dtype is None or torch_dtype(dtype) == torch_dtype(load_hf_config(hf_dir).dtype)


@contextmanager
def _staged(out_dir: str | Path, *, seal: bool) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` to write into, renamed into place once complete: sealed with a
    manifest (``seal``), every file and directory synced, then the rename; removed on any error."""
    from mars_megatron.checkpoint.manifest import write_manifest
    from mars_megatron.conversion.outputs import check_output_dir

    out = check_output_dir(out_dir)
    tmp = out.parent / f".{out.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if seal:
            write_manifest(tmp)
        fsync_tree(tmp)
        tmp.rename(out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hf_to_mcore_direct(hf_dir: str | Path, out_dir: str | Path, *, vocab_pad_multiple: int = 128) -> None:
    """Convert an HF Qwen3 checkpoint into a mars Megatron checkpoint (the layout of
    :func:`mars_megatron.convert.hf_to_mcore` on one rank: loadable into any TP/PP/EP layout) without a
    model or a process group. Written into a temporary sibling, sealed with its manifest, synced, and
    renamed into place only when complete."""
    arch = load_hf_config(hf_dir)
    reader = HFReader(hf_dir)
    validate_hf_checkpoint(reader, arch)
    reader.close()
    with _staged(out_dir, seal=True) as tmp:
        (tmp / "model").mkdir()
        write_dist_checkpoint(tmp / "model", arch, reader, arch.padded_vocab_size(vocab_pad_multiple))
        (tmp / "hf").mkdir()
        copy_assets(hf_dir, tmp / "hf")
        write_meta(tmp, arch, arch.dtype, vocab_pad_multiple, ParallelConfig())


# ------------------------------------------------------------------------------------------- mcore → HF
class _Records:
    """The tensors of a dist checkpoint's records, by key and chunk: a view of the memory-mapped data
    shard where the record is a plain ``torch.save`` of a tensor (:mod:`~mars_megatron.checkpoint.
    tensor_record`), else loaded with ``weights_only``; a piece no record holds as such (a checkpoint
    saved in another layout) is copied together from the records that overlap it."""

    def __init__(self, folder: Path, metadata: Any, dtype: torch.dtype) -> None:
        self.folder, self.metadata, self.dtype = folder, metadata, dtype
        self._mapped: dict[str, MappedFile] = {}

    def _file(self, name: str) -> MappedFile:
        if name not in self._mapped:
            self._mapped[name] = MappedFile(self.folder / name)
        return self._mapped[name]

    def origin(self, tensor: torch.Tensor) -> Origin | None:
        """Where in a data shard the bytes of ``tensor`` are, if it is a contiguous view of one."""
        return origin_in(self._mapped.values(), tensor)

    def record(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data.get(MetadataIndex(key, torch.Size(offsets)))
        if info is None:
            raise CheckpointError(f"{self.folder / '.metadata'}: no record of '{key}' at {list(offsets)}")
        file = self._file(info.relative_path)
        if info.offset + info.length > file.size:
            raise CheckpointError(f"{self.folder / info.relative_path}: cut short (record of '{key}')")
        start = data_offset(file.fd, info.offset, info.length, self.dtype, shape)
        if start is not None:
            return file.view(self.dtype, start, math.prod(shape)).view(shape)
        return self._load(key, info, shape)

    def _load(self, key: str, info: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """A record of another form (a slice, another writer), loaded the general, restricted way."""
        path = self.folder / info.relative_path
        mapped = self._file(info.relative_path).mapped
        try:
            tensor = torch.load(
                io.BytesIO(mapped[info.offset : info.offset + info.length]), weights_only=True
            )
        except Exception as e:  # torch raises many types for a bad record
            raise CheckpointError(f"{path}: the record of '{key}' is unreadable ({e})") from None
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{path}: the record of '{key}' is not a {self.dtype} tensor of {list(shape)}"
            )
        return tensor

    def piece(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's tensor: its own record where the checkpoint has one, else copied together from
        the parts of the records that overlap it (one chunk's memory, whatever layout wrote them)."""
        stored = self.metadata.state_dict_metadata[chunk.key]
        for c in stored.chunks:
            if tuple(c.offsets) == chunk.offsets and tuple(c.sizes) == chunk.shape:
                return self.record(chunk.key, chunk.offsets, chunk.shape)
        piece = torch.empty(chunk.shape, dtype=self.dtype)
        covered = 0
        for c in stored.chunks:
            lo = [max(a, b) for a, b in zip(c.offsets, chunk.offsets, strict=True)]
            hi = [
                min(a + n, b + m)
                for a, n, b, m in zip(c.offsets, c.sizes, chunk.offsets, chunk.shape, strict=True)
            ]
            if any(low >= high for low, high in zip(lo, hi, strict=True)):
                continue
            record = self.record(chunk.key, tuple(c.offsets), tuple(c.sizes))
            source = tuple(slice(low - o, high - o) for low, high, o in zip(lo, hi, c.offsets, strict=True))
            target = tuple(
                slice(low - o, high - o) for low, high, o in zip(lo, hi, chunk.offsets, strict=True)
            )
            piece[target] = record[source]
            covered += math.prod(high - low for low, high in zip(lo, hi, strict=True))
        if covered != math.prod(chunk.shape):
            raise CheckpointError(
                f"{self.folder}: the records of '{chunk.key}' cover {covered} of the "
                f"{math.prod(chunk.shape)} values at {list(chunk.offsets)}"
            )
        return piece

    def close(self) -> None:
        for file in self._mapped.values():
            file.close()  # each mapping goes with the last view of it
        self._mapped.clear()


def export_problem(mcore_dir: str | Path) -> str | None:
    """Why :func:`mcore_to_hf_direct` cannot export this mars checkpoint (then the model path does), or
    None: every tensor of the layout must be in the checkpoint with its global shape and dtype, chunked
    in any way (a training checkpoint in any TP/PP/EP layout qualifies)."""
    from mars_megatron.checkpoint.dist_metadata import read_metadata
    from mars_megatron.checkpoint.model_meta import read_meta

    arch, meta = read_meta(mcore_dir)
    return _layout_problem(arch, meta, read_metadata(Path(mcore_dir) / meta.get("weights", "model")))


def _layout_problem(arch: Qwen3Arch, meta: dict[str, Any], metadata: Any) -> str | None:
    """:func:`export_problem` on a checkpoint's metadata already read."""
    shapes, _, _ = checkpoint_layout(arch, arch.padded_vocab_size(meta["vocab_pad_multiple"]))
    dtype = torch_dtype(meta["dtype"])
    for key, shape in shapes.items():
        stored = metadata.state_dict_metadata.get(key)
        if stored is None or not hasattr(stored, "chunks"):
            return f"tensor '{key}' is not in the checkpoint as such"
        if tuple(stored.size) != shape or stored.properties.dtype != dtype:
            return (
                f"tensor '{key}' is {stored.properties.dtype} {list(stored.size)}, not {dtype} {list(shape)}"
            )
    return None


def mcore_to_hf_direct(
    mcore_dir: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Export a mars Megatron checkpoint as HF safetensors in one process, with no model: each HF tensor
    is written from a view of the record that holds it (a copy only for ``linear_qkv``'s split and the
    vocabulary's padding). The data shards are checked against the manifest (their digests unless
    ``MARS_CHECKPOINT_VERIFY=sizes``), as :func:`mars_megatron.convert.load_mcore` does, while they are
    read: nothing is renamed into place unless the check passes."""
    from mars_megatron.checkpoint.dist_metadata import read_metadata
    from mars_megatron.checkpoint.manifest import shard_digests_wanted, verify_manifest
    from mars_megatron.checkpoint.model_meta import read_meta
    from mars_megatron.conversion.hf_io import HFWriter
    from mars_megatron.conversion.outputs import check_assets, check_loadable
    from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors, unshard

    arch, meta = read_meta(mcore_dir)
    assets = check_assets(mcore_dir)
    folder = Path(mcore_dir) / meta.get("weights", "model")
    metadata = read_metadata(folder)
    problem = _layout_problem(arch, meta, metadata)
    if problem is not None:
        raise CheckpointError(f"{mcore_dir}: cannot be exported directly: {problem}")
    # The shards' digests (read_meta checked everything else) are checked on another core while the export
    # reads them (one file at a time: the copy needs the other): records are parsed without running
    # anything, and nothing is renamed into place before the check has passed. A failed check is the
    # error reported, whatever the export met meanwhile.
    checking = ThreadPoolExecutor(1, thread_name_prefix="export-verify")
    verified = (
        checking.submit(verify_manifest, mcore_dir, shards=True, threads=1)
        if shard_digests_wanted()
        else None
    )
    checking.shutdown(wait=False)
    dtype = torch_dtype(meta["dtype"])
    _, chunks, _ = checkpoint_layout(arch, arch.padded_vocab_size(meta["vocab_pad_multiple"]))
    hf_shapes = expected_hf_tensors(arch)
    records = _Records(folder, metadata, dtype)
    try:
        with _staged(out_dir, seal=False) as tmp:
            writer = HFWriter(tmp, {n: (shape, dtype) for n, shape in hf_shapes.items()}, max_shard_bytes)
            for chunk in chunks:
                piece = records.piece(chunk)
                natural = piece.reshape(chunk.shape[1:]) if chunk.stacked else piece
                if chunk.half is not None:
                    name = chunk.plan.hf_names[chunk.half]
                    tensor = natural.reshape(hf_shapes[name])
                    writer.add(name, tensor, records.origin(tensor))
                    continue
                for name, tensor in zip(
                    chunk.plan.hf_names, unshard(chunk.plan, [natural], arch), strict=True
                ):
                    tensor = tensor.reshape(hf_shapes[name])
                    writer.add(name, tensor, records.origin(tensor))
            copy_assets(assets, tmp)
            check_loadable(tmp)  # while the last shards are synced
            writer.close()
            if verified is not None:
                verified.result()
    except BaseException:
        if verified is not None:
            verified.result()  # raises the manifest's complaint first
        raise
    finally:
        records.close()
