"""The streaming safetensors writer: fixed layout, tensors written at their offsets in any order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mars_megatron.conversion.hf_io import INDEX, CheckpointError, HFReader, HFWriter

LAYOUT = {
    "a": ((3, 5), torch.bfloat16),  # 30 bytes
    "b": ((7,), torch.float32),  # 28 bytes
    "c": ((2, 2), torch.float16),  # 8 bytes
}


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*shape, generator=g).to(dtype) for n, (shape, dtype) in LAYOUT.items()}


def test_out_of_order_writes_make_loadable_shards(tmp_path: Path) -> None:
    ts = tensors()
    writer = HFWriter(tmp_path, LAYOUT, max_shard_bytes=40)  # a: 30 B alone; b + c: 36 B
    for name in ("c", "a", "b"):
        writer.add(name, ts[name])
    writer.close()
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 66
    assert index["weight_map"] == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    got: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / f, framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
        got.update(load_file(tmp_path / f))
    assert set(got) == set(ts)
    for name, t in ts.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([INDEX, *set(index["weight_map"].values())])
    reader = HFReader(tmp_path)
    assert reader.dtype("a") == "BF16" and reader.shape("b") == (7,)


def test_non_contiguous_tensor_is_written_in_logical_order(tmp_path: Path) -> None:
    layout = {"t": ((4, 3), torch.float32)}
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    writer = HFWriter(tmp_path, layout)
    writer.add("t", base.t())  # a transposed view
    writer.close()
    assert torch.equal(load_file(tmp_path / "model-00001-of-00001.safetensors")["t"], base.t())


def test_errors_name_the_tensor(tmp_path: Path) -> None:
    ts = tensors()
    writer = HFWriter(tmp_path, LAYOUT)
    with pytest.raises(CheckpointError, match="tensor 'zz' is not in the planned layout"):
        writer.add("zz", ts["a"])
    with pytest.raises(CheckpointError, match=r"tensor 'a' is \[3, 5\] torch.float32, the layout says"):
        writer.add("a", ts["a"].float())
    writer.add("a", ts["a"])
    with pytest.raises(CheckpointError, match="tensor 'a' written twice"):
        writer.add("a", ts["a"])
    with pytest.raises(CheckpointError, match=r"2 planned tensor\(s\) never arrived"):
        writer.close()
    assert not (tmp_path / INDEX).exists()


def test_reader_follows_symlinked_shards_like_the_hf_hub_cache(tmp_path: Path) -> None:
    """The hub cache's snapshot folders hold symlinks into ``../../blobs``: the index names plain files,
    so they are read; only a name in the index that leaves the folder is refused (tests/bad_inputs)."""
    ts = tensors()
    blobs = tmp_path / "blobs"
    writer = HFWriter(blobs, LAYOUT, max_shard_bytes=40)
    for name, tensor in ts.items():
        writer.add(name, tensor)
    writer.close()
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for file in blobs.iterdir():
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / file.name)
    reader = HFReader(snapshot)
    assert sorted(reader.names()) == sorted(ts)
    assert all(torch.equal(reader.get(n), t) for n, t in ts.items())


@pytest.mark.parametrize("shard", ["../blobs/x.safetensors", "/abs/x.safetensors", "..", "", 3, None])
def test_reader_refuses_an_index_naming_a_shard_outside_the_folder(tmp_path: Path, shard: object) -> None:
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"a": "x.safetensors", "b": shard}}))
    with pytest.raises(CheckpointError, match=rf"{INDEX}: entry 'b' of 'weight_map' names shard"):
        HFReader(tmp_path)
