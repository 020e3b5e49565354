"""HF ↔ Megatron-Core checkpoint conversion with real megatron-core, transformers and gloo processes.

Round trips HF → Megatron dist checkpoint → HF must reproduce every tensor bit for bit, in every TP/PP/EP
layout and across layouts (write with one, read with another). Conversions are grouped into one
``parallel.launch`` per world size, because starting the processes costs far more than converting tiny
checkpoints; each test then checks its own outputs.
"""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_megatron.checkpoint.dist_metadata import read_metadata
from mars_megatron.checkpoint.manifest import MANIFEST, seal, verify_manifest
from mars_megatron.config import ParallelConfig
from mars_megatron.conversion.direct import hf_to_mcore_direct, mcore_to_hf_direct
from mars_megatron.conversion.hf_io import INDEX
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.dist_workers import Layout, Op, run_expecting_errors, run_ops

LAUNCH_TIMEOUT_S = 600.0

# ------------------------------------------------------------------------------------------ source models
# name -> (preset, dtype, overrides). Seeds differ per source so no two sources share weights.
SOURCES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "dense": ("tiny-dense", "float32", {}),
    "moe": ("tiny-moe", "float32", {}),
    "dense-bf16": ("tiny-dense", "bfloat16", {}),
    "moe-bf16": ("tiny-moe", "bfloat16", {}),
    "dense-tied": ("tiny-dense", "float32", {"vocab_size": 1000, "tie_word_embeddings": True}),
    "moe-tied": ("tiny-moe", "float32", {"vocab_size": 1000, "tie_word_embeddings": True}),
}
# Tensors in each source: embed + 2 layers x (9 attention/norm tensors + mlp) + final norm (+ lm_head).
# Dense mlp: gate/up/down = 3; MoE mlp: router + 4 experts x 3 = 13.
TENSOR_COUNTS = {"dense": 25, "moe": 45, "dense-bf16": 25, "moe-bf16": 45, "dense-tied": 24, "moe-tied": 44}
VOCAB = {"dense-tied": 1000, "moe-tied": 1000}  # others: the preset's 1024
PADDED_VOCAB = 1024  # both 1000 and 1024 pad to a multiple of 128 → 1024
HIDDEN = 128
ASSETS = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


def dtype_of(source: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[SOURCES[source][1]]


# ---------------------------------------------------------------------------------------------- layouts
def fmt(layout: Layout) -> str:
    tp, pp, ep, etp = layout
    parts = [f"{k}{v}" for k, v in (("tp", tp), ("pp", pp), ("ep", ep)) if v > 1]
    if etp is not None:
        parts.append(f"etp{etp}")
    return "x".join(parts) or "single"


def pconfig(layout: Layout) -> ParallelConfig:
    tp, pp, ep, etp = layout
    return ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp)


@dataclass(frozen=True)
class Case:
    """Convert ``source`` to Megatron in layout ``write``, then back to HF in layout ``read``, both on a
    world of ``world`` ranks (ranks beyond a layout's minimum world are data-parallel)."""

    source: str
    world: int
    write: Layout
    read: Layout

    @property
    def id(self) -> str:
        cross = "" if self.read == self.write else f"-read-{fmt(self.read)}"
        return f"{self.source}-w{self.world}-{fmt(self.write)}{cross}"


# (tp, pp, ep, etp); etp None = Megatron's default, expert tensor parallelism equal to tp.
S, TP2, PP2, EP2 = (1, 1, 1, None), (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, None)
PP2EP2, TP2PP2 = (1, 2, 2, None), (2, 2, 1, None)
TP2EP2 = (2, 1, 2, None)  # experts split over ep=2 and etp=2: needs 4 ranks
TP2EP2_ETP1 = (2, 1, 2, 1)  # whole experts, split over ep=2 only: fits 2 ranks
TP2PP2EP2_ETP1 = (2, 2, 2, 1)

CASES = [
    # one process
    *(Case(src, 1, S, S) for src in SOURCES),
    # two processes: every TP/PP/EP value for both presets, data parallelism, cross-layout reads
    Case("dense", 2, TP2, TP2),
    Case("dense", 2, PP2, PP2),
    Case("dense", 2, S, S),  # data-parallel size 2
    Case("dense", 2, TP2, PP2),
    Case("dense", 2, PP2, TP2),
    Case("moe", 2, TP2, TP2),  # ep=1: experts split over TP (etp = tp)
    Case("moe", 2, PP2, PP2),
    Case("moe", 2, EP2, EP2),
    Case("moe", 2, TP2EP2_ETP1, TP2EP2_ETP1),
    Case("moe", 2, TP2EP2_ETP1, PP2),
    Case("moe", 2, EP2, TP2),
    Case("moe", 2, TP2, EP2),
    Case("moe", 2, PP2, EP2),
    Case("dense-bf16", 2, TP2, TP2),
    Case("moe-bf16", 2, TP2EP2_ETP1, TP2EP2_ETP1),
    Case("moe-bf16", 2, TP2EP2_ETP1, PP2),
    Case("dense-tied", 2, TP2, TP2),
    Case("dense-tied", 2, PP2, PP2),
    Case("dense-tied", 2, TP2, PP2),
    Case("moe-tied", 2, EP2, EP2),
    Case("moe-tied", 2, TP2EP2_ETP1, PP2),
    # four processes
    Case("moe", 4, PP2EP2, PP2EP2),
    Case("moe", 4, PP2EP2, TP2),  # read with data-parallel size 2
    Case("moe", 4, PP2EP2, S),  # read with data-parallel size 4
    Case("moe", 4, TP2EP2, TP2EP2),
    Case("moe", 4, TP2EP2, PP2EP2),
    Case("moe", 4, TP2PP2EP2_ETP1, TP2PP2EP2_ETP1),
    Case("moe", 4, TP2PP2EP2_ETP1, EP2),
    Case("dense", 4, TP2PP2, TP2PP2),
    Case("dense", 4, TP2PP2, S),
    Case("moe-bf16", 4, PP2EP2, TP2EP2),
    Case("moe-tied", 4, PP2EP2, TP2),
    Case("moe-tied", 4, TP2EP2, PP2),
    Case("dense-tied", 4, TP2PP2, TP2PP2),
]
DIRECT_READS: dict[int, list[tuple[str, Layout]]] = {
    2: [("dense", TP2), ("moe", EP2), ("moe-bf16", TP2EP2_ETP1), ("dense-tied", PP2)],
    4: [("moe", TP2EP2), ("moe-tied", PP2EP2)],
}
"""Checkpoints written by ``hf_to_mcore_direct`` (one process, no model) that the model path reads back in
these layouts, in the launches the cases make anyway."""
CASE_BY_ID = {c.id: c for c in CASES}
assert len(CASE_BY_ID) == len(CASES), "case ids must be unique"
for _c in CASES:  # every layout must be realisable on its world (data parallelism fills the rest)
    assert all(_c.world % parallel.min_world_size(pconfig(x)) == 0 for x in (_c.write, _c.read)), _c.id


def case_param(case: Case) -> Any:
    marks = [pytest.mark.multiproc] if case.world > 1 else []
    return pytest.param(case, id=case.id, marks=marks)


# ------------------------------------------------------------------------------------------------ helpers
def read_hf(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint, checking that each shard holds exactly what the index says."""
    weight_map: dict[str, str] = json.loads((model_dir / INDEX).read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        loaded = load_file(model_dir / file)
        listed = sorted(n for n, f in weight_map.items() if f == file)
        assert sorted(loaded) == listed, f"{model_dir / file} does not hold what {INDEX} lists"
        tensors.update(loaded)
    return tensors


def shard_files(model_dir: Path) -> list[str]:
    return sorted(set(json.loads((model_dir / INDEX).read_text())["weight_map"].values()))


def assert_bit_identical(src: Path, out: Path) -> None:
    a, b = read_hf(src), read_hf(out)
    assert sorted(b) == sorted(a), f"tensor names differ: {sorted(set(a) ^ set(b))}"
    meta_diff = [
        (n, (a[n].dtype, tuple(a[n].shape)), (b[n].dtype, tuple(b[n].shape)))
        for n in a
        if (a[n].dtype, a[n].shape) != (b[n].dtype, b[n].shape)
    ]
    assert not meta_diff, f"dtype/shape differ (name, source, output): {meta_diff[:5]}"
    value_diff = [
        n
        for n in a
        if not torch.equal(a[n], b[n])
        or not torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
    ]
    assert not value_diff, f"{len(value_diff)} tensor(s) not bit-identical, e.g. {value_diff[:5]}"


def assert_assets_carried(src: Path, out: Path) -> None:
    """Config, tokenizer and generation files arrive byte for byte; nothing else but weights is there."""
    weights = {INDEX, *shard_files(out)}
    out_files = {p.name for p in out.iterdir()}
    assert out_files - weights == ASSETS, f"unexpected files: {sorted(out_files ^ (weights | ASSETS))}"
    for name in sorted(ASSETS):
        assert (out / name).read_bytes() == (src / name).read_bytes(), f"{name} changed"


def partial_of(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was left behind"
    assert not partial_of(out).exists(), f"{partial_of(out)} was left behind"


def dist_checkpoint_shapes(model_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor stored in a torch_dist checkpoint (read without processes)."""
    metadata = FileSystemReader(str(model_dir)).read_metadata()
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if hasattr(md, "size")
    }


# ----------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        name: init_model(preset, root / name, seed=seed, dtype=dtype, overrides=overrides)
        for seed, (name, (preset, dtype, overrides)) in enumerate(SOURCES.items())
    }


class Conversions:
    """Runs all cases of a world size in one launch, the first time any of them is asked for."""

    def __init__(self, sources: dict[str, Path], root: Path) -> None:
        self.sources, self.root = sources, root
        self.seconds: dict[int, list[float]] = {}

    def mcore_dir(self, source: str, world: int, write: Layout) -> Path:
        return self.root / f"w{world}" / f"{source}-{fmt(write)}.mcore"

    def direct_dir(self, source: str) -> Path:
        """``source`` converted by ``hf_to_mcore_direct`` (in this process, once)."""
        out = self.root / f"{source}.direct"
        if not out.exists():
            hf_to_mcore_direct(self.sources[source], out)
        return out

    def direct_read_dir(self, source: str, world: int, read: Layout) -> Path:
        """The direct checkpoint of ``source`` exported by the model path in layout ``read``."""
        self._ensure(world)
        return self.root / f"w{world}" / f"{source}.direct-read-{fmt(read)}.hf"

    def out_dir(self, case: Case) -> Path:
        self._ensure(case.world)
        return self.out_dir_path(case)

    def _ensure(self, world: int) -> None:
        if world in self.seconds:
            return
        (self.root / f"w{world}").mkdir()
        cases = [c for c in CASES if c.world == world]
        writes = sorted({(c.source, c.write) for c in cases}, key=lambda sw: (fmt(sw[1]), sw[0]))
        ops = [Op("to_mcore", str(self.sources[s]), str(self.mcore_dir(s, world, w)), w) for s, w in writes]
        ops += [
            Op("to_hf", str(self.mcore_dir(c.source, world, c.write)), str(self.out_dir_path(c)), c.read)
            for c in sorted(cases, key=lambda c: (fmt(c.read), c.id))
        ]
        ops += [  # the direct path's checkpoints, read by the model path in other layouts
            Op(
                "to_hf",
                str(self.direct_dir(s)),
                str(self.root / f"w{world}" / f"{s}.direct-read-{fmt(r)}.hf"),
                r,
            )
            for s, r in sorted(DIRECT_READS.get(world, []), key=lambda sr: (fmt(sr[1]), sr[0]))
        ]
        self.seconds[world] = parallel.launch(run_ops, world, ops, timeout_s=LAUNCH_TIMEOUT_S)[0]

    def out_dir_path(self, case: Case) -> Path:
        return self.root / f"w{case.world}" / f"{case.id}.hf"


@pytest.fixture(scope="module")
def conversions(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Conversions:
    return Conversions(sources, tmp_path_factory.mktemp("converted"))


# ------------------------------------------------------------------------------------------------- tests
def test_sources_are_what_the_cases_claim(sources: dict[str, Path]) -> None:
    for name, path in sources.items():
        tensors = read_hf(path)
        assert len(tensors) == TENSOR_COUNTS[name], name
        assert {t.dtype for t in tensors.values()} == {dtype_of(name)}, name
        assert tensors["model.embed_tokens.weight"].shape == (VOCAB.get(name, 1024), HIDDEN), name
        assert ("lm_head.weight" in tensors) == ("tied" not in name), name
        assert len(shard_files(path)) > 1, f"{name}: source should be sharded to exercise the index"
        assert ASSETS <= {p.name for p in path.iterdir()}, name


@pytest.mark.parametrize("case", [case_param(c) for c in CASES])
def test_round_trip_is_bit_identical(case: Case, sources: dict[str, Path], conversions: Conversions) -> None:
    out = conversions.out_dir(case)
    assert_bit_identical(sources[case.source], out)
    # Rewritten into one shard (default 5 GiB limit), not copied: the source has several.
    assert shard_files(out) == ["model-00001-of-00001.safetensors"]
    assert_assets_carried(sources[case.source], out)
    assert not partial_of(out).exists()


@pytest.mark.parametrize(
    "world", [1, pytest.param(2, marks=pytest.mark.multiproc), pytest.param(4, marks=pytest.mark.multiproc)]
)
def test_megatron_checkpoint_is_layout_free(
    world: int, sources: dict[str, Path], conversions: Conversions
) -> None:
    """Whatever layout wrote it, the dist checkpoint holds whole tensors, the vocabulary padded to 1024."""
    writes = sorted(
        {(c.source, c.write) for c in CASES if c.world == world}, key=lambda sw: (sw[0], fmt(sw[1]))
    )
    conversions.out_dir(next(c for c in CASES if c.world == world))  # make sure this world ran
    assert len(writes) >= 6
    for source, write in writes:
        mcore = conversions.mcore_dir(source, world, write)
        meta = json.loads((mcore / "mars_checkpoint.json").read_text())
        assert meta["format"] == "mars-mcore-v1"
        assert meta["written_by_layout"] == dict(zip(("tp", "pp", "ep"), write[:3], strict=True))
        assert meta["dtype"] == SOURCES[source][1]
        assert meta["arch"]["vocab_size"] == VOCAB.get(source, 1024)
        assert meta["arch"]["tie_word_embeddings"] == ("tied" in source)
        shapes = dist_checkpoint_shapes(mcore / "model")
        label = f"{source} written in {fmt(write)}"
        assert shapes["embedding.word_embeddings.weight"] == ((PADDED_VOCAB, HIDDEN), dtype_of(source)), label
        assert all(dtype == dtype_of(source) for _, dtype in shapes.values()), label
        assert {p.name for p in (mcore / "hf").iterdir()} == ASSETS, label
        for name in ASSETS:
            assert (mcore / "hf" / name).read_bytes() == (sources[source] / name).read_bytes(), label
        assert not list(mcore.rglob("*.safetensors")), label


# ------------------------------------------------------------------------------------------ the direct path
def _records(mcore: Path) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """Every record of a dist checkpoint by (key, chunk offsets), loaded with ``weights_only``."""
    metadata = read_metadata(mcore / "model")
    out = {}
    for index, info in metadata.storage_data.items():
        with open(mcore / "model" / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        offsets = None if index.offset is None else tuple(index.offset)
        out[(index.fqn, offsets)] = torch.load(io.BytesIO(data), weights_only=True)
    return out


def _entries(mcore: Path) -> dict[str, Any]:
    """Each tensor's global shape, properties and chunks (sorted), or ``bytes`` for an object."""
    entries = {}
    for key, md in read_metadata(mcore / "model").state_dict_metadata.items():
        if hasattr(md, "chunks"):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            entries[key] = (tuple(md.size), md.properties, chunks)
        else:
            entries[key] = "bytes"
    return entries


@pytest.mark.parametrize("source", list(SOURCES))
def test_direct_checkpoint_is_the_one_a_model_writes(
    source: str, sources: dict[str, Path], conversions: Conversions
) -> None:
    """``hf_to_mcore_direct`` (no model) writes what one rank of a Megatron model writes: the same
    tensors with the same global shapes, dtypes and chunks, the same objects, every record's value
    equal; and a manifest of this version that checks out."""
    model_path = conversions.mcore_dir(source, 1, S)
    conversions.out_dir(CASE_BY_ID[f"{source}-w1-single"])  # world 1 ran
    direct = conversions.direct_dir(source)
    assert _entries(direct) == _entries(model_path)
    ours, theirs = _records(direct), _records(model_path)
    assert ours.keys() == theirs.keys()
    differ = [
        k
        for k in ours
        if not (torch.equal(ours[k], theirs[k]) if torch.is_tensor(ours[k]) else ours[k] == theirs[k])
    ]
    assert not differ, differ[:5]
    assert json.loads((direct / "mars_checkpoint.json").read_text()) == json.loads(
        (model_path / "mars_checkpoint.json").read_text()
    )
    assert {p.name for p in (direct / "hf").iterdir()} == ASSETS
    verify_manifest(direct, shards=True)
    assert json.loads((direct / MANIFEST).read_text())["format"] == "mars-manifest-v2"
    assert not partial_of(direct).exists()


@pytest.mark.parametrize("source", list(SOURCES))
def test_direct_round_trip_is_bit_identical(
    source: str, sources: dict[str, Path], conversions: Conversions
) -> None:
    out = conversions.root / f"{source}.direct.hf"
    mcore_to_hf_direct(conversions.direct_dir(source), out)
    assert_bit_identical(sources[source], out)
    assert shard_files(out) == ["model-00001-of-00001.safetensors"]
    assert_assets_carried(sources[source], out)
    assert not partial_of(out).exists()


@pytest.mark.parametrize(
    ("source", "world", "read"),
    [
        pytest.param(s, w, r, id=f"{s}-w{w}-read-{fmt(r)}", marks=pytest.mark.multiproc)
        for w, reads in DIRECT_READS.items()
        for s, r in reads
    ],
)
def test_direct_checkpoint_loads_into_other_layouts(
    source: str, world: int, read: Layout, sources: dict[str, Path], conversions: Conversions
) -> None:
    assert_bit_identical(sources[source], conversions.direct_read_dir(source, world, read))


@pytest.mark.parametrize(
    "world", [1, pytest.param(2, marks=pytest.mark.multiproc), pytest.param(4, marks=pytest.mark.multiproc)]
)
def test_direct_export_of_checkpoints_written_in_any_layout(
    world: int, tmp_path: Path, sources: dict[str, Path], conversions: Conversions
) -> None:
    """``mcore_to_hf_direct`` exports what the model path wrote in every layout: the records of a
    tensor written in pieces (TP, EP) are assembled, those of whole ones used as they are."""
    conversions.out_dir(next(c for c in CASES if c.world == world))
    writes = sorted(
        {(c.source, c.write) for c in CASES if c.world == world}, key=lambda sw: (sw[0], fmt(sw[1]))
    )
    for source, write in writes:
        out = tmp_path / f"{source}-{fmt(write)}.hf"
        mcore_to_hf_direct(conversions.mcore_dir(source, world, write), out)
        assert_bit_identical(sources[source], out)


LOADABLE = ["dense-w1-single", "moe-w1-single", "dense-bf16-w2-tp2", "moe-w4-pp2xep2-read-tp2"]
LOADABLE += ["dense-tied-w2-pp2", "moe-tied-w4-pp2xep2-read-tp2"]


@pytest.mark.parametrize("case", [case_param(CASE_BY_ID[i]) for i in LOADABLE])
def test_output_loads_in_transformers(case: Case, sources: dict[str, Path], conversions: Conversions) -> None:
    out = conversions.out_dir(case)
    src = sources[case.source]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if v} == {}, "missing/unexpected/mismatched weights"
    reference = AutoModelForCausalLM.from_pretrained(src)
    assert model.dtype == dtype_of(case.source)
    assert type(model).__name__ == json.loads((src / "config.json").read_text())["architectures"][0]
    head = model.get_output_embeddings().weight
    assert head.shape == (VOCAB.get(case.source, 1024), HIDDEN)
    if "tied" in case.source:
        assert head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[5, 17, 300, 42, 900, 3, 77, 256]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert got.shape == (1, 8, VOCAB.get(case.source, 1024))
    assert torch.equal(got, want)
    tok, ref_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(src)
    text = "Verdict: Correct. \\boxed{42}<|im_end|>"
    assert tok(text).input_ids == ref_tok(text).input_ids
    assert len(tok) == VOCAB.get(case.source, 1024)


# ------------------------------------------------------------------------------------------------ errors
@dataclass(frozen=True)
class BadInput:
    op: Op
    expected_type: str


def _rewrite_shard(model_dir: Path, tensor: str, new: torch.Tensor | None, *, keep_index: bool) -> Path:
    """Replace (or, with ``new=None``, drop) ``tensor`` in its shard file; return that file's path."""
    index_path = model_dir / INDEX
    index = json.loads(index_path.read_text())
    shard = model_dir / index["weight_map"][tensor]
    tensors = load_file(shard)
    if new is None:
        del tensors[tensor]
        if not keep_index:
            del index["weight_map"][tensor]
            index_path.write_text(json.dumps(index, indent=2))
    else:
        tensors[tensor] = new
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _edit_json(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="module")
def bad_inputs(
    sources: dict[str, Path], conversions: Conversions, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Broken checkpoints, each converted once in a single-rank world; returns what each raised."""
    root = tmp_path_factory.mktemp("bad")
    dense = sources["dense"]
    conversions.out_dir(CASE_BY_ID["dense-w1-single"])  # a good Megatron checkpoint to break
    good_mcore = conversions.mcore_dir("dense", 1, S)

    def hf_copy(name: str) -> Path:
        return Path(shutil.copytree(dense, root / name))

    edited: list[Path] = []

    def mcore_copy(name: str) -> Path:
        edited.append(Path(shutil.copytree(good_mcore, root / name)))
        return edited[-1]

    facts: dict[str, Any] = {}
    cases: dict[str, BadInput] = {}

    src = hf_copy("missing-tensor")
    facts["missing-tensor"] = _rewrite_shard(
        src, "model.layers.1.self_attn.k_proj.weight", None, keep_index=False
    )
    cases["missing-tensor"] = BadInput(
        Op("to_mcore", str(src), str(root / "missing-tensor.out"), S), "CheckpointError"
    )

    src = hf_copy("missing-from-shard")
    facts["missing-from-shard"] = _rewrite_shard(
        src, "model.layers.1.self_attn.k_proj.weight", None, keep_index=True
    )
    cases["missing-from-shard"] = BadInput(
        Op("to_mcore", str(src), str(root / "missing-from-shard.out"), S), "CheckpointError"
    )

    src = hf_copy("misshaped")
    facts["misshaped"] = _rewrite_shard(
        src, "model.layers.0.mlp.down_proj.weight", torch.zeros(HIDDEN, 128), keep_index=True
    )
    cases["misshaped"] = BadInput(Op("to_mcore", str(src), str(root / "misshaped.out"), S), "CheckpointError")

    src = hf_copy("wrong-dtype")
    facts["wrong-dtype"] = _rewrite_shard(
        src, "model.norm.weight", torch.ones(HIDDEN, dtype=torch.float16), keep_index=True
    )
    cases["wrong-dtype"] = BadInput(
        Op("to_mcore", str(src), str(root / "wrong-dtype.out"), S), "CheckpointError"
    )

    src = hf_copy("unsupported-arch")
    _edit_json(src / "config.json", lambda c: c.update(architectures=["LlamaForCausalLM"]))
    cases["unsupported-arch"] = BadInput(
        Op("to_mcore", str(src), str(root / "unsupported-arch.out"), S), "HFConfigError"
    )

    src = hf_copy("missing-field")
    _edit_json(src / "config.json", lambda c: c.pop("hidden_size"))
    cases["missing-field"] = BadInput(
        Op("to_mcore", str(src), str(root / "missing-field.out"), S), "HFConfigError"
    )

    for kind, source in (("to_mcore", dense), ("to_hf", good_mcore)):
        out = root / f"exists-{kind}.out"
        out.mkdir()
        (out / "keep.txt").write_text("precious")
        cases[f"exists-{kind}"] = BadInput(Op(kind, str(source), str(out), S), "FileExistsError")

    cases["not-mars"] = BadInput(Op("to_hf", str(dense), str(root / "not-mars.out"), S), "CheckpointError")

    src = mcore_copy("wrong-format")
    _edit_json(src / "mars_checkpoint.json", lambda m: m.update(format="something-else"))
    cases["wrong-format"] = BadInput(
        Op("to_hf", str(src), str(root / "wrong-format.out"), S), "CheckpointError"
    )

    # Failures after the staging directory exists: it must be removed again.
    src = mcore_copy("model-missing")
    shutil.rmtree(src / "model")
    cases["model-missing"] = BadInput(
        Op("to_hf", str(src), str(root / "model-missing.out"), S), "CheckpointError"
    )

    src = mcore_copy("no-tokenizer")  # an export without it would "succeed" and load nowhere
    (src / "hf" / "tokenizer_config.json").unlink()
    cases["no-tokenizer"] = BadInput(
        Op("to_hf", str(src), str(root / "no-tokenizer.out"), S), "CheckpointError"
    )

    src = mcore_copy("meta-disagrees")
    _edit_json(src / "mars_checkpoint.json", lambda m: m["arch"].update(ffn_hidden_size=512))
    cases["meta-disagrees"] = BadInput(
        Op("to_hf", str(src), str(root / "meta-disagrees.out"), S), "CheckpointException"
    )

    # Not an error: a stale staging directory from an earlier crash is replaced, not reused.
    stale_out = root / "stale.out"
    partial_of(stale_out).mkdir()
    (partial_of(stale_out) / "model-00001-of-00009.safetensors").write_bytes(b"junk")
    cases["stale-partial"] = BadInput(Op("to_hf", str(good_mcore), str(stale_out), S), "")

    for src in edited:  # each case tests its own check, not the manifest (tests/test_checkpoint_trust.py)
        seal(src)
    names = list(cases)
    results = parallel.launch(
        run_expecting_errors, 1, [cases[n].op for n in names], timeout_s=LAUNCH_TIMEOUT_S
    )[0]
    return {
        "raised": dict(zip(names, results, strict=True)),
        "cases": cases,
        "facts": facts,
        "root": root,
    }


def _raised(bad_inputs: dict[str, Any], name: str) -> tuple[Path, str]:
    case: BadInput = bad_inputs["cases"][name]
    kind, message = bad_inputs["raised"][name]
    assert kind == case.expected_type, f"{name}: raised {kind or 'nothing'}: {message}"
    return Path(case.op.dst), message


def test_missing_tensor_is_named(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "missing-tensor")
    src = bad_inputs["cases"]["missing-tensor"].op.src
    assert f"{src}: 1 tensor(s) missing from the checkpoint" in message
    assert "'model.layers.1.self_attn.k_proj.weight'" in message
    assert_nothing_written(out)


def test_tensor_listed_in_index_but_absent_from_shard_names_the_file(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "missing-from-shard")
    shard = bad_inputs["facts"]["missing-from-shard"]
    assert message.startswith(f"{shard}: cannot read tensor 'model.layers.1.self_attn.k_proj.weight' (")
    assert_nothing_written(out)


def test_misshaped_tensor_names_file_tensor_and_shapes(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "misshaped")
    shard = bad_inputs["facts"]["misshaped"]
    assert message == (
        f"{shard}: tensor 'model.layers.0.mlp.down_proj.weight' has shape [128, 128], "
        "config.json implies [128, 256]"
    )
    assert_nothing_written(out)


def test_wrong_dtype_is_refused_not_cast(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "wrong-dtype")
    shard = bad_inputs["facts"]["wrong-dtype"]
    assert message == (
        f"{shard}: tensor 'model.norm.weight' is F16, config.json declares float32 (F32); "
        "refusing to cast silently"
    )
    assert_nothing_written(out)


def test_unsupported_architecture_names_config_field(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "unsupported-arch")
    config = Path(bad_inputs["cases"]["unsupported-arch"].op.src) / "config.json"
    assert message.startswith(
        f"{config}: unsupported architecture 'LlamaForCausalLM' in field 'architectures'"
    )
    assert "Qwen3MoeForCausalLM" in message  # lists what is supported
    assert_nothing_written(out)


def test_missing_config_field_is_named(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "missing-field")
    config = Path(bad_inputs["cases"]["missing-field"].op.src) / "config.json"
    assert message == f"{config}: missing required field 'hidden_size'"
    assert_nothing_written(out)


@pytest.mark.parametrize("kind", ["to_mcore", "to_hf"])
def test_existing_output_directory_is_refused_and_untouched(bad_inputs: dict[str, Any], kind: str) -> None:
    out, message = _raised(bad_inputs, f"exists-{kind}")
    assert message == f"{out}: output directory already exists; choose a new path or remove it"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    assert not partial_of(out).exists()


def test_mcore_to_hf_on_a_non_mars_directory(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "not-mars")
    src = Path(bad_inputs["cases"]["not-mars"].op.src)
    assert message == f"{src / 'mars_checkpoint.json'}: missing; {src} is not a mars Megatron checkpoint"
    assert_nothing_written(out)


def test_mcore_to_hf_on_a_foreign_format_tag(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "wrong-format")
    meta = Path(bad_inputs["cases"]["wrong-format"].op.src) / "mars_checkpoint.json"
    assert message == f"{meta}: field 'format' is 'something-else', expected 'mars-mcore-v1'"
    assert_nothing_written(out)


def test_mcore_to_hf_without_hf_assets_is_refused(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "no-tokenizer")
    config = Path(bad_inputs["cases"]["no-tokenizer"].op.src) / "hf" / "tokenizer_config.json"
    assert message.startswith(f"{config}: missing; the checkpoint carries no HF tokenizer_config")
    assert_nothing_written(out)


def test_failure_after_staging_removes_it_missing_model(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "model-missing")
    model = Path(bad_inputs["cases"]["model-missing"].op.src) / "model"
    assert message == f"{model}: missing; {model.parent} has no model weights"
    assert_nothing_written(out)


def test_failure_after_staging_removes_it_shape_mismatch(bad_inputs: dict[str, Any]) -> None:
    out, message = _raised(bad_inputs, "meta-disagrees")
    # Megatron names the tensor whose stored shape contradicts the architecture in mars_checkpoint.json.
    assert "Global shape mismatch" in message
    assert "linear_fc1.weight" in message and "512" in message
    assert_nothing_written(out)


def test_stale_staging_directory_is_replaced(bad_inputs: dict[str, Any], sources: dict[str, Path]) -> None:
    out, message = _raised(bad_inputs, "stale-partial")
    assert message == ""
    assert not partial_of(out).exists()
    assert shard_files(out) == ["model-00001-of-00001.safetensors"]
    assert not (out / "model-00001-of-00009.safetensors").exists()
    assert_bit_identical(sources["dense"], out)


@pytest.mark.multiproc
def test_error_on_every_rank_reaches_caller_and_cleans_up(tmp_path: Path) -> None:
    """A layout error raised after staging, on both ranks: launch re-raises a rank's traceback and the
    staging directory is gone."""
    src = init_model("tiny-dense", tmp_path / "kv1", seed=7, overrides={"num_key_value_heads": 1})
    out = tmp_path / "kv1.mcore"
    with pytest.raises(RuntimeError) as info:
        parallel.launch(run_ops, 2, [Op("to_mcore", str(src), str(out), TP2)], timeout_s=LAUNCH_TIMEOUT_S)
    message = str(info.value)
    assert message.startswith(("rank 0 of 2 failed:\nTraceback", "rank 1 of 2 failed:\nTraceback"))
    assert "in hf_to_mcore" in message
    assert "LayoutError: parallel.tp: 2 must divide num_key_value_heads (1)" in message
    assert_nothing_written(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv1"]
