"""HF ↔ Megatron distributed checkpoints, run on every rank of any TP/PP/EP layout.

A Megatron checkpoint written here is a directory::

    mars_checkpoint.json   format tag, architecture, vocabulary padding, dtype, where the weights are
    hf/                    the source's config.json, tokenizer and generation files
    model/                 megatron dist_checkpointing (torch_dist) — loadable into any layout
    MANIFEST.sha256.json   every other file's size and SHA-256, written last (checkpoint/manifest.py)

A policy folder of a ``mars train`` checkpoint is one too: its weights sit beside the optimizer state in
``dist/`` (the metadata names that folder and the sharding metadata it was saved with), so a trained
policy starts another run, is evaluated or is exported to HF like any converted checkpoint.

Both directions write into a temporary sibling directory and rename it into place only after every
rank has finished and every file is synced to disk, so an interrupted or failed conversion (or a power
cut) never leaves a half-written output.

Reading one checks it against its manifest first (:func:`read_meta`; the data shards' digests when the
weights load, split between the ranks) and unpickles nothing but plain data
(``mars_megatron/checkpoint/dist_load.py``); see docs/checkpoints.md.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from mars_megatron.checkpoint.atomic import fsync_dir, fsync_tree
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.checkpoint.model_meta import META, copy_assets, read_meta, write_meta
from mars_megatron.config import ParallelConfig
from mars_megatron.conversion.hf_io import HFReader, HFWriter
from mars_megatron.conversion.model_io import export_weights, load_weights, validate_hf_checkpoint
from mars_megatron.conversion.outputs import check_assets, check_loadable, check_output_dir
from mars_megatron.conversion.qwen3_mapping import expected_hf_tensors
from mars_megatron.dtypes import torch_dtype
from mars_megatron.models.hf_config import Qwen3Arch, load_hf_config
from mars_megatron.training.model_provider import build_model


@contextmanager
def staged_output(out: Path, *, manifest: bool = True) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into (collective): renamed to ``out`` when every rank
    leaves the block without an exception, removed otherwise, so ``out`` is never half-written.
    ``manifest``: seal it with a manifest of its files first (every mars checkpoint; not HF exports)."""
    tmp = _staging_dir(out)
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        _finish(tmp, out, ok, manifest)


def _staging_dir(out: Path) -> Path:
    """Rank 0 makes a fresh temporary sibling of ``out`` and tells every rank its path."""
    check_output_dir(out)  # on every rank, so no rank is left waiting in the broadcast below
    holder = [None]
    if dist.get_rank() == 0:
        tmp = out.parent / f".{out.name}.partial"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        holder = [str(tmp)]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])  # type: ignore[arg-type]


def _finish(tmp: Path, out: Path, ok: bool, manifest: bool) -> None:
    """Every rank reports success; on unanimous success the ranks hash the files for the manifest and
    rank 0 syncs the staged files to disk and renames, else rank 0 removes the staging dir."""
    from mars_megatron.checkpoint.manifest import write_collective

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    if all(flags) and manifest:
        dist.barrier()  # every rank's files are written
        write_collective(tmp)
    if dist.get_rank() == 0:
        if all(flags):
            fsync_tree(tmp)  # what every rank wrote is on disk before the name appears
            tmp.rename(out)
            fsync_dir(out.parent)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()


def is_mcore_checkpoint(path: str | Path) -> bool:
    """True for a directory written by :func:`hf_to_mcore` (as opposed to an HF model directory)."""
    return (Path(path) / META).is_file()


def save_mcore(model: torch.nn.Module, directory: Path) -> None:
    """Save ``model``'s weights as a ``torch_dist`` dist checkpoint in ``directory`` (collective), written
    and hashed in this process (:mod:`mars_megatron.checkpoint.dist_save`)."""
    from mars_megatron.checkpoint import dist_save

    directory.mkdir(exist_ok=True)
    dist.barrier()
    dist_save.save(getattr(model, "module", model).sharded_state_dict(), directory)


def preflight(mcore_dir: str | Path) -> tuple[Qwen3Arch, dict[str, Any]]:
    """:func:`read_meta`, plus what else can be checked of a mars checkpoint in the launching process
    before any rank starts: its dist-checkpoint metadata, read the restricted way."""
    from mars_megatron.checkpoint.dist_metadata import read_metadata

    arch, meta = read_meta(mcore_dir)
    read_metadata(Path(mcore_dir) / meta.get("weights", "model"))
    return arch, meta


def load_mcore(model: torch.nn.Module, mcore_dir: str | Path) -> None:
    """Load the weights of the mars checkpoint ``mcore_dir`` into ``model`` (any layout; collective).

    Only the model's tensors are read: a training checkpoint's optimizer state is left on disk. The
    data shards' digests are checked first, each rank a share; nothing is unpickled beyond plain data.
    """
    from mars_megatron.checkpoint import dist_load
    from mars_megatron.checkpoint.manifest import verify_collective

    _, meta = read_meta(mcore_dir)
    verify_collective(mcore_dir)
    weights = Path(mcore_dir) / meta.get("weights", "model")
    if not weights.is_dir():
        raise CheckpointError(f"{weights}: missing; {mcore_dir} has no model weights")
    inner = getattr(model, "module", model)
    sharded = inner.sharded_state_dict(metadata=meta.get("sharded_metadata"))
    key = meta.get("state_key")
    state = dist_load.load({key: sharded} if key else sharded, weights)
    inner.load_state_dict(state[key] if key else state)


def hf_to_mcore(
    hf_dir: str | Path,
    out_dir: str | Path,
    parallel: ParallelConfig,
    *,
    dtype: str | None = None,
    vocab_pad_multiple: int = 128,
    transformer_impl: str = "auto",
) -> None:
    """Convert an HF Qwen3 checkpoint to a Megatron distributed checkpoint (call on every rank)."""
    arch = load_hf_config(hf_dir)
    reader = HFReader(hf_dir)
    validate_hf_checkpoint(reader, arch)
    out = Path(out_dir)
    with staged_output(out) as tmp:
        model = build_model(
            arch,
            parallel,
            dtype=dtype,
            transformer_impl=transformer_impl,
            vocab_pad_multiple=vocab_pad_multiple,
        )
        load_weights(model, reader, arch, arch.padded_vocab_size(vocab_pad_multiple))
        reader.close()
        save_mcore(model, tmp / "model")
        if dist.get_rank() == 0:
            (tmp / "hf").mkdir()
            copy_assets(hf_dir, tmp / "hf")
            write_meta(tmp, arch, dtype or arch.dtype, vocab_pad_multiple, parallel)


def mcore_to_hf(
    mcore_dir: str | Path,
    out_dir: str | Path,
    parallel: ParallelConfig,
    *,
    max_shard_bytes: int = 5 * 2**30,
    transformer_impl: str = "auto",
    progress: bool = True,
) -> None:
    """Convert a mars Megatron checkpoint to HF safetensors (every rank): one from :func:`hf_to_mcore` or
    ``mars sft``, or a policy folder of a ``mars train`` checkpoint (the trained policy)."""
    arch, meta = read_meta(mcore_dir)
    assets = check_assets(mcore_dir)
    out = Path(out_dir)
    with staged_output(out, manifest=False) as tmp:  # an HF model directory
        model = build_model(
            arch,
            parallel,
            dtype=meta["dtype"],
            transformer_impl=transformer_impl,
            vocab_pad_multiple=meta["vocab_pad_multiple"],
        )
        load_mcore(model, mcore_dir)
        writer = None
        if dist.get_rank() == 0:
            dtype = torch_dtype(meta["dtype"])
            layout = {n: (shape, dtype) for n, shape in expected_hf_tensors(arch).items()}
            writer = HFWriter(tmp, layout, max_shard_bytes)
        total = len(expected_hf_tensors(arch))
        bar = tqdm(total=total, desc="mcore→hf", unit="tensor", disable=not progress or dist.get_rank() != 0)
        for name, tensor in export_weights(model, arch):
            assert writer is not None
            writer.add(name, tensor)
            bar.update()
        bar.close()
        if writer is not None:
            writer.close()
            copy_assets(assets, tmp)
            check_loadable(tmp)
