"""The file that makes a folder a mars checkpoint of a model (``mars_checkpoint.json``: format tag,
architecture, dtype, vocabulary padding, where the weights are) and the HF files copied beside it.

Why in ``checkpoint``: a converted model (``mars convert``, ``mars sft``) and a trained policy
(:func:`~mars_megatron.checkpoint.rank_state.save_rank_state`) both write it, and everything that loads a
model reads it; the layers that build or convert a model sit above this one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.checkpoint.manifest import verify_manifest
from mars_megatron.config import ParallelConfig
from mars_megatron.json_file import read_json
from mars_megatron.models.hf_config import Qwen3Arch

FORMAT = "mars-mcore-v1"
META = "mars_checkpoint.json"
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


def read_meta(mcore_dir: str | Path) -> tuple[Qwen3Arch, dict[str, Any]]:
    """Architecture and metadata of a mars checkpoint (``mars convert``'s, ``mars sft``'s or a policy's),
    after checking it against its manifest (every file present with its size, and the digest of every
    file but the data shards: cheap, so a cut or altered checkpoint is refused before any start-up)."""
    path = Path(mcore_dir) / META
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {mcore_dir} is not a mars Megatron checkpoint")
    verify_manifest(mcore_dir)
    meta = read_json(path, CheckpointError)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: field 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    weights = meta.get("weights", "model")
    inside = (Path(mcore_dir) / str(weights)).resolve()
    if (
        not isinstance(weights, str)
        or not weights
        or "/" in weights
        or "\\" in weights
        or weights in (".", "..")
        or not inside.is_relative_to(Path(mcore_dir).resolve())
    ):  # the weights are a folder of this checkpoint, never another one's (a resealed manifest passes)
        raise CheckpointError(
            f"{path}: field 'weights' is {str(weights)[:100]!r}; it must name a folder inside {mcore_dir}"
        )
    arch_fields = dict(meta["arch"])
    arch_fields["moe_layers"] = tuple(arch_fields.get("moe_layers", ()))
    return Qwen3Arch(**arch_fields), meta


def write_meta(
    directory: Path,
    arch: Qwen3Arch,
    dtype: str,
    vocab_pad_multiple: int,
    parallel: ParallelConfig,
    *,
    weights: str = "model",
    state_key: str | None = None,
    sharded_metadata: dict[str, Any] | None = None,
) -> None:
    """The metadata file that makes ``directory`` a mars checkpoint (:func:`read_meta` reads it back).

    ``weights`` is the dist-checkpoint folder holding the model; ``state_key`` the key the model's state
    sits under in it (a training checkpoint saves ``{"model": ..., "optimizer": ...}``; a converted one
    the model's state alone); ``sharded_metadata`` the content metadata it was saved with.
    """
    meta = {
        "format": FORMAT,
        "arch": dataclasses.asdict(arch),
        "dtype": dtype,
        "vocab_pad_multiple": vocab_pad_multiple,
        "written_by_layout": {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep},
        "weights": weights,
        "state_key": state_key,
        "sharded_metadata": sharded_metadata,
    }
    (directory / META).write_text(json.dumps(meta, indent=2) + "\n")


def copy_assets(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config/tokenizer/generation files that exist in ``src`` into ``dst``; returns their names."""
    copied = []
    for name in ASSET_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
