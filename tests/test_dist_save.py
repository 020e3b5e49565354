"""The in-process ``torch_dist`` writer (``mars_megatron/checkpoint/dist_save.py``) writes what megatron's
``dist_checkpointing.save`` writes, and what it hashed as it wrote is what the files hold.

One model (a tiny MoE, whose SwiGLU ``linear_fc1`` halves are views) is saved both ways on one rank and
on two (tensor-parallel: dense and expert weights split); the data shards must be byte for byte
megatron's (its records written without CRC-32 as ours are), ``.metadata`` must describe the same tensors
at the same places, and each checkpoint must load back bit-exactly (ours through megatron's loader too).
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import zipfile
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from mars_megatron.checkpoint import manifest
from mars_megatron.checkpoint.dist_metadata import read_metadata
from mars_megatron.checkpoint.dist_save import owning_storage
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.dist_save_workers import save_both_ways

LAYOUTS = {"single": (1, (1, 1, 1)), "tp2": (2, (2, 1, 1))}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("dist-save") / "hf")


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def saved(request: pytest.FixtureRequest, hf: Path) -> dict[str, Any]:
    world, layout = LAYOUTS[request.param]
    root = hf.parent / request.param
    root.mkdir()
    ranks = parallel.launch(save_both_ways, world, str(hf), str(root), layout, timeout_s=300)
    return {"root": root, "ranks": ranks}


def test_data_shards_are_megatrons_byte_for_byte(saved: dict[str, Any]) -> None:
    ours, theirs = saved["root"] / "mars", saved["root"] / "megatron"
    shards = sorted(p.name for p in theirs.glob("*.distcp"))
    assert shards and sorted(p.name for p in ours.glob("*.distcp")) == shards
    for name in shards:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    for name in ("common.pt", "metadata.json"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_metadata_places_every_item_where_megatrons_does(saved: dict[str, Any]) -> None:
    """Equal as data, field by field (not as bytes: pickle shares repeated strings differently, and
    ``storage_meta`` names the directory and a random save id)."""
    ours, theirs = (read_metadata(saved["root"] / d) for d in ("mars", "megatron"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.all_local_plans == theirs.all_local_plans
    assert (ours.planner_data, ours.version) == (theirs.planner_data, theirs.version)


def test_each_checkpoint_loads_back_bit_exactly(saved: dict[str, Any]) -> None:
    for rank in saved["ranks"]:
        assert rank["loads"] == {"mars": True, "megatron": True, "mars, by megatron's loader": True}


def test_records_carry_no_crc(saved: dict[str, Any]) -> None:
    """Every member of every record holds 0 where its CRC-32 would be (``records_without_crc``): the
    manifest's digest covers the bytes instead."""
    root = saved["root"] / "mars"
    places = read_metadata(root).storage_data.values()
    assert places
    for place in places:
        with open(root / place.relative_path, "rb") as f:
            f.seek(place.offset)
            record = zipfile.ZipFile(io.BytesIO(f.read(place.length)))
        assert [m.CRC for m in record.infolist()] == [0] * len(record.infolist()), place


def test_swiglu_halves_load_into_the_parameter_itself(saved: dict[str, Any]) -> None:
    """Each ``linear_fc1`` is read in place as its two halves, and the merge returns the parameter rather
    than a concatenated copy (``dist_load._merge_swiglu_halves_in_place``)."""
    for rank in saved["ranks"]:
        assert rank["in_place"] == {"mars": True, "megatron": True}


def test_digests_recorded_while_writing_are_the_files(saved: dict[str, Any]) -> None:
    for rank in saved["ranks"]:
        assert rank["recorded"] and rank["recorded"] == rank["actual"]


def test_megatron_code_mirrored_by_dist_save_is_unchanged() -> None:
    """InProcessSaveStrategy.async_save copies megatron-core 0.16.1's (without the cached-plan branches);
    InProcessWriter names and fills the files as its writer's prepare_write_data and write_preloaded_data
    do. When they change, compare and update the copies, then these digests."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    def digest(fn: Any) -> str:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]

    assert digest(TorchDistSaveShardedStrategy.async_save) == "dd6e48d9b9c427fb"
    assert digest(FileSystemWriterAsync.prepare_write_data) == "b11e2d368d860b84"
    assert digest(FileSystemWriterAsync.write_preloaded_data) == "0aef9e6cbe573e10"


# ------------------------------------------------------------------------------------------ owning_storage
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_view_is_saved_as_its_own_bytes_without_a_copy(dtype: torch.dtype) -> None:
    weight = torch.randn(8, 6).to(dtype)
    for half in torch.chunk(weight, 2):
        owned = owning_storage(half)
        assert owned.data_ptr() == half.data_ptr() and owned.untyped_storage().nbytes() == half.nbytes
        ours, clone = io.BytesIO(), io.BytesIO()
        torch.save(owned, ours)
        torch.save(half.clone(), clone)
        assert ours.getvalue() == clone.getvalue()


def test_a_strided_view_is_copied() -> None:
    weight = torch.randn(6, 8)
    column = weight[:, 2]
    owned = owning_storage(column)
    assert torch.equal(owned, column) and owned.untyped_storage().nbytes() == column.nbytes


# ------------------------------------------------------------------------------------- recorded digests
def test_a_recorded_digest_is_used_only_for_the_unchanged_file(tmp_path: Path) -> None:
    """A manifest takes the digest recorded while writing (here deliberately wrong, to see that it is
    taken) for a file that is unchanged since, and hashes a file that changed."""
    kept, changed = tmp_path / "kept.bin", tmp_path / "changed.bin"
    for path in (kept, changed):
        path.write_bytes(b"x" * 100)
        manifest.record_written(path, {"size": 100, "blake3": "recorded"})
    changed.write_bytes(b"y" * 100)
    os.utime(changed, ns=(1, 1))
    manifest.write_manifest(tmp_path)
    files = manifest.read_manifest(tmp_path)
    assert files["kept.bin"]["blake3"] == "recorded"
    assert files["changed.bin"]["blake3"] == blake3.blake3(b"y" * 100).hexdigest()


def test_a_recorded_size_that_differs_from_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match="10 bytes on disk, 11 hashed as written"):
        manifest.record_written(path, {"size": 11, "blake3": "0" * 64})
