"""Checkpoints are data: loading one never runs code from it, and a cut or altered one is named.

* a crafted ``.metadata`` (pickle ``__reduce__`` → ``os.system``), ``common.pt``, object inside a data
  shard or RNG file is refused naming the file, and its command never runs — through ``mcore_to_hf``
  (what ``mars convert mcore-to-hf`` runs), ``load_rank_state`` (``mars train --resume``) and the CLI
  (``mars convert``, ``mars score``), where it is refused before any rank starts;
* the manifest names a truncated, flipped, deleted or added file and a missing manifest, in converted
  checkpoints and training checkpoints (``CheckpointStore.resolve``);
* a legitimate checkpoint still converts bit-exactly and resumes.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from mars_megatron.checkpoint import CheckpointStore, python_rng_state
from mars_megatron.checkpoint.dist_metadata import MetadataUnpickler, read_metadata
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.checkpoint.manifest import (
    LEGACY_MANIFEST,
    MANIFEST,
    list_files,
    seal,
    verify_manifest,
    write_manifest,
)
from mars_megatron.conversion.direct import mcore_to_hf_direct
from mars_megatron.models.presets import init_model
from mars_megatron.training import parallel
from tests.checkpoint_workers import POLICY, Run, run
from tests.dist_workers import Op, run_expecting_errors, run_ops
from tests.test_conversion import assert_bit_identical
from tests.trust_workers import resume_errors

REPO = Path(__file__).resolve().parents[1]
S = (1, 1, 1, None)  # single-rank layout (tp, pp, ep, etp)


class _Payload:
    """Unpickling this runs ``touch MARKER`` (what a crafted checkpoint file would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------------------------------- crafting
def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _shard(dist_dir: Path) -> Path:
    return sorted(dist_dir.glob("*.distcp"))[0]


def _craft_metadata(dist_dir: Path, marker: Path) -> None:
    (dist_dir / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))


def _craft_shard_object(dist_dir: Path, marker: Path) -> str:
    """Point one of the shard's non-tensor objects at a crafted ``torch.save`` appended to its file."""
    metadata = read_metadata(dist_dir)
    names = {k for k, v in metadata.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata"}
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn in names)
    buffer = io.BytesIO()
    torch.save(_Payload(marker), buffer)
    with open(dist_dir / info.relative_path, "ab") as f:
        info.offset, info.length = f.tell(), len(buffer.getvalue())
        f.write(buffer.getvalue())
    (dist_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    return index.fqn


def _escape_metadata(dist_dir: Path) -> None:
    metadata = read_metadata(dist_dir)
    next(iter(metadata.storage_data.values())).relative_path = "../../elsewhere.distcp"
    (dist_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def _flip_byte(path: Path, at: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-moe", tmp_path_factory.mktemp("trust") / "hf")


@pytest.fixture(scope="module")
def mcore(hf: Path) -> Path:
    out = hf.parent / "mcore"
    parallel.launch(run_ops, 1, [Op("to_mcore", str(hf), str(out), S)], timeout_s=300)
    return out


@pytest.fixture(scope="module")
def training(hf: Path) -> Path:
    """A training checkpoint of one step (model, distributed optimizer, RNG), committed by the store."""
    store = CheckpointStore(hf.parent / "ckpt", keep_last=2)
    staging = store.begin(1)
    parallel.launch(run, 1, [Run("t", str(hf), {}, 1, 1, str(staging), 1)], timeout_s=300)
    return store.commit(staging, 1, {"step": 1, "python_rng": python_rng_state()})


# ---------------------------------------------------------------------------------------- the manifest
def _fake_checkpoint(root: Path) -> Path:
    store = CheckpointStore(root, keep_last=3)
    staging = store.begin(3)
    (staging / POLICY / "dist").mkdir(parents=True)
    (staging / POLICY / "dist" / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (staging / POLICY / "layout.json").write_text("{}")
    write_manifest(staging / POLICY)
    (staging / "pipeline_state.pt").write_bytes(b"p" * 100)
    return store.commit(staging, 3, {"step": 3})


def test_commit_seals_a_checkpoint_with_nested_manifests(tmp_path: Path) -> None:
    ckpt = _fake_checkpoint(tmp_path)
    top = json.loads((ckpt / MANIFEST).read_text())
    assert top["format"] == "mars-manifest-v2"
    assert sorted(top["files"]) == ["pipeline_state.pt", f"{POLICY}/{MANIFEST}", "trainer_state.json"]
    state = top["files"]["trainer_state.json"]
    data = (ckpt / "trainer_state.json").read_bytes()
    assert state == {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}
    inner = json.loads((ckpt / POLICY / MANIFEST).read_text())["files"]
    assert sorted(inner) == ["dist/__0_0.distcp", "layout.json"]
    assert list_files(ckpt) == sorted(top["files"])
    verify_manifest(ckpt, shards=True)
    assert CheckpointStore(tmp_path, keep_last=3).resolve("latest") == ckpt


@pytest.mark.parametrize(
    ("damage", "named", "says"),
    [
        (
            lambda c: _truncate(c / "pipeline_state.pt"),
            "pipeline_state.pt",
            "50 bytes, the manifest says 100 (cut short)",
        ),
        (
            lambda c: _flip_byte(c / "pipeline_state.pt", 3),
            "pipeline_state.pt",
            "BLAKE3 differs from the manifest",
        ),
        (
            lambda c: (c / POLICY / "layout.json").unlink(),
            f"{POLICY}/layout.json",
            "missing (listed in the manifest",
        ),
        (
            lambda c: (c / POLICY / "dist" / "evil.pt").write_bytes(b"x"),
            f"{POLICY}/dist/evil.pt",
            "not in the manifest",
        ),
        (lambda c: (c / POLICY / "layout.json").write_text("[]"), f"{POLICY}/layout.json", "BLAKE3 differs"),
        (
            lambda c: (c / POLICY / MANIFEST).write_text("{}"),
            f"{POLICY}/{MANIFEST}",
            "bytes, the manifest says",
        ),
    ],
    ids=["truncated", "flipped-byte", "deleted", "added", "edited-in-policy", "policy-manifest-replaced"],
)
def test_resolve_names_what_changed(tmp_path: Path, damage: Any, named: str, says: str) -> None:
    ckpt = _fake_checkpoint(tmp_path)
    damage(ckpt)
    store = CheckpointStore(tmp_path, keep_last=3)
    for resume in ("latest", str(ckpt)):
        with pytest.raises(CheckpointError) as info:
            store.resolve(resume)
        message = str(info.value)
        assert message.startswith(f"{ckpt}: does not match its manifest ({MANIFEST}), refused before loading")
        assert f"{ckpt / named}: " in message and says in message, message
        assert f"python -m mars_megatron.checkpoint.manifest {ckpt}" in message  # the way out, if deliberate


def test_shard_digests_are_left_to_the_loading_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flipped byte in a data shard keeps its size: the pre-start check (sizes, other digests) passes
    it, the full one (what each rank runs on its share) names it."""
    ckpt = _fake_checkpoint(tmp_path)
    _flip_byte(ckpt / POLICY / "dist" / "__0_0.distcp")
    verify_manifest(ckpt)
    with pytest.raises(
        CheckpointError, match=re.escape(f"{ckpt / POLICY / 'dist' / '__0_0.distcp'}: BLAKE3")
    ):
        verify_manifest(ckpt, shards=True)


def _as_first_version(directory: Path) -> None:
    """Rewrite ``directory``'s manifest (and nested ones) as the first version wrote them: SHA-256
    digests in ``MANIFEST.sha256.json``."""
    for path in sorted(directory.rglob(MANIFEST), key=lambda p: -len(p.parts)):
        files = json.loads(path.read_text())["files"]
        for name in list(files):
            data = (path.parent / name.replace(MANIFEST, LEGACY_MANIFEST)).read_bytes()
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        files = {k.replace(MANIFEST, LEGACY_MANIFEST): v for k, v in files.items()}
        # nested first: a parent pins its child's rewritten manifest
        path.with_name(LEGACY_MANIFEST).write_text(json.dumps({"format": "mars-manifest-v1", "files": files}))
        path.unlink()


def test_a_first_version_manifest_is_still_checked_with_sha256(tmp_path: Path) -> None:
    """Checkpoints written before the digest became BLAKE3 verify as they are, a damaged one is named
    with the digest its manifest holds, and re-sealing writes this version's manifest in its place."""
    ckpt = _fake_checkpoint(tmp_path)
    _as_first_version(ckpt)
    assert not list(ckpt.rglob(MANIFEST)) and (ckpt / POLICY / LEGACY_MANIFEST).is_file()
    assert sorted(list_files(ckpt)) == [
        "pipeline_state.pt",
        f"{POLICY}/{LEGACY_MANIFEST}",
        "trainer_state.json",
    ]
    verify_manifest(ckpt, shards=True)
    _flip_byte(ckpt / POLICY / "dist" / "__0_0.distcp")
    shard = ckpt / POLICY / "dist" / "__0_0.distcp"
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: SHA-256 differs from the manifest")):
        verify_manifest(ckpt, shards=True)
    seal(ckpt / POLICY)  # deliberate: the nested folder now has a v2 manifest, which the parent does not pin
    assert not (ckpt / POLICY / LEGACY_MANIFEST).exists()
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / POLICY / MANIFEST}: not in the manifest")):
        verify_manifest(ckpt)
    seal(ckpt)
    assert json.loads((ckpt / MANIFEST).read_text())["format"] == "mars-manifest-v2"
    assert not (ckpt / LEGACY_MANIFEST).exists()
    verify_manifest(ckpt, shards=True)


def test_a_checkpoint_without_manifest_is_refused_with_the_way_out(tmp_path: Path) -> None:
    ckpt = _fake_checkpoint(tmp_path)
    (ckpt / MANIFEST).unlink()
    with pytest.raises(CheckpointError) as info:
        CheckpointStore(tmp_path, keep_last=3).resolve(str(ckpt))
    assert str(info.value).startswith(f"{ckpt / MANIFEST}: missing; every checkpoint carries a manifest")
    proc = subprocess.run(
        [sys.executable, "-m", "mars_megatron.checkpoint.manifest", str(ckpt)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"wrote {ckpt / MANIFEST}", proc.stderr
    assert CheckpointStore(tmp_path, keep_last=3).resolve(str(ckpt)) == ckpt


@pytest.mark.parametrize(
    "manifest",
    [
        "not json",
        '{"format": "other", "files": {}}',
        '{"format": "mars-manifest-v2", "files": {"../../etc/passwd": {"size": 1, "blake3": "x"}}}',
        '{"format": "mars-manifest-v2", "files": {"a": {"size": "1", "blake3": "x"}}}',
        '{"format": "mars-manifest-v2", "files": {"a": {"size": 1, "sha256": "x"}}}',
        '{"format": "mars-manifest-v1", "files": {}}',
    ],
    ids=["not-json", "foreign-format", "path-escapes", "size-not-int", "other-digest", "v1-in-v2-file"],
)
def test_a_malformed_manifest_is_named(tmp_path: Path, manifest: str) -> None:
    ckpt = _fake_checkpoint(tmp_path)
    (ckpt / MANIFEST).write_text(manifest)
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt / MANIFEST}: ")):
        verify_manifest(ckpt)


def test_a_symlink_is_refused(tmp_path: Path) -> None:
    ckpt = _fake_checkpoint(tmp_path)
    (ckpt / POLICY / "dist" / "__0_0.distcp").unlink()
    (ckpt / POLICY / "dist" / "__0_0.distcp").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="a symlink; a checkpoint holds plain files only"):
        verify_manifest(ckpt)


# ------------------------------------------------------------------------------------ the metadata reader
def test_megatron_and_torch_code_mirrored_by_dist_load_is_unchanged() -> None:
    """dist_load.SafeTorchDistLoadStrategy.load and SafeLoadPlanner.load_bytes copy these two methods
    (megatron-core 0.16.1, torch 2.13) with the reader, planner and unpickling swapped; when they change,
    compare and update the copies, then these digests."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    def digest(fn: Any) -> str:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]

    assert digest(TorchDistLoadShardedStrategy.load) == "960cfa14f177d722"
    assert digest(DefaultLoadPlanner.load_bytes) == "666701f9808c4bc2"


def test_metadata_of_real_checkpoints_loads_and_crafted_metadata_is_refused(
    tmp_path: Path, mcore: Path, training: Path
) -> None:
    for dist_dir in (mcore / "model", training / POLICY / "dist"):
        metadata = read_metadata(dist_dir)
        assert metadata.state_dict_metadata and metadata.storage_data
    marker = tmp_path / "ran"
    bad = tmp_path / "dist"
    bad.mkdir()
    _craft_metadata(bad, marker)
    with pytest.raises(CheckpointError) as info:
        read_metadata(bad)
    assert str(info.value) == (
        f"{bad / '.metadata'}: refused: it asks for posix.system, which the metadata of a dist checkpoint "
        "never holds, so loading it could run code; nothing from it was run"
    )
    assert not marker.exists()
    (bad / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match=r"\.metadata: holds a dict, not dist-checkpoint metadata"):
        read_metadata(bad)
    (bad / ".metadata").write_bytes((mcore / "model" / ".metadata").read_bytes()[:500])
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable or cut short \("):
        read_metadata(bad)


def test_metadata_that_rewrites_an_allowed_class_is_refused_and_the_class_restored() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    # GLOBAL Metadata; BUILD with slot state {"__init__": None}: setattr on the class itself
    crafted = b"ctorch.distributed.checkpoint.metadata\nMetadata\nN(dS'__init__'\nNs\x86b."
    original = Metadata.__init__
    with pytest.raises(
        CheckpointError, match=r"^x/\.metadata: refused: it rewrites the class\(es\) Metadata$"
    ):
        MetadataUnpickler(io.BytesIO(crafted), Path("x/.metadata")).load()
    assert Metadata.__init__ is original


# ----------------------------------------------------------------------------- mcore_to_hf (mars convert)
@pytest.fixture(scope="module")
def converted(mcore: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every hostile copy of the converted checkpoint through ``mcore_to_hf``, in one single-rank launch."""
    root = tmp_path_factory.mktemp("hostile")
    marker = root / "ran"
    cases: dict[str, Path] = {}

    def case(name: str, reseal: bool = False, damage: Any = None) -> Path:
        src = _copy(mcore, root / name)
        damage(src)
        if reseal:  # the manifest rewritten to match: only the reader stands between file and code
            seal(src)
        cases[name] = src
        return src

    facts = {"shard": _shard(mcore / "model").name}
    case("metadata-resealed", True, lambda c: _craft_metadata(c / "model", marker))
    case("metadata-stale-manifest", False, lambda c: _craft_metadata(c / "model", marker))
    case(
        "common-resealed",
        True,
        lambda c: torch.save({"content_metadata": _Payload(marker)}, c / "model/common.pt"),
    )
    case("shard-object-resealed", True, lambda c: facts.update(fqn=_craft_shard_object(c / "model", marker)))
    case("escaping-path-resealed", True, lambda c: _escape_metadata(c / "model"))
    case("flipped-shard", False, lambda c: _flip_byte(_shard(c / "model")))
    case("truncated-shard", False, lambda c: _truncate(_shard(c / "model")))
    case("deleted-shard", False, lambda c: _shard(c / "model").unlink())
    case("no-manifest", False, lambda c: (c / MANIFEST).unlink())
    case("added-file", False, lambda c: (c / "model" / "extra.pt").write_bytes(b"x"))
    case("legitimate", False, lambda c: None)
    names = list(cases)
    ops = [Op("to_hf", str(cases[n]), str(root / f"{n}.out"), S) for n in names]
    raised = parallel.launch(run_expecting_errors, 1, ops, timeout_s=600)[0]
    return {"raised": dict(zip(names, raised, strict=True)), "cases": cases, "marker": marker, "facts": facts}


def _refused(converted: dict[str, Any], name: str) -> tuple[Path, str]:
    kind, message = converted["raised"][name]
    assert kind == "CheckpointError", f"{name}: raised {kind or 'nothing'}: {message}"
    src = converted["cases"][name]
    assert not Path(f"{src}.out").exists() and not converted["marker"].exists()
    return src, message


def test_crafted_files_are_refused_by_mcore_to_hf_and_never_run(converted: dict[str, Any]) -> None:
    src, message = _refused(converted, "metadata-resealed")
    assert message.startswith(f"{src / 'model' / '.metadata'}: refused: it asks for posix.system")
    src, message = _refused(converted, "common-resealed")
    assert message.startswith(f"{src / 'model' / 'common.pt'}: refused: it holds more than tensors")
    src, message = _refused(converted, "shard-object-resealed")
    fqn = converted["facts"]["fqn"]
    assert message.startswith(f"{src / 'model'}: refused: object {fqn!r} in a data shard holds more than")
    src, message = _refused(converted, "escaping-path-resealed")
    assert message == (
        f"{src / 'model' / '.metadata'}: names data file '../../elsewhere.distcp', which is not a file of "
        f"{src / 'model'}"
    )


@pytest.mark.parametrize(
    ("name", "file", "says"),
    [
        ("metadata-stale-manifest", "model/.metadata", "bytes, the manifest says"),
        ("flipped-shard", "model/{shard}", "BLAKE3 differs from the manifest"),
        ("truncated-shard", "model/{shard}", "(cut short)"),
        ("deleted-shard", "model/{shard}", "missing (listed in the manifest"),
        ("added-file", "model/extra.pt", "not in the manifest"),
    ],
)
def test_damage_is_named_by_mcore_to_hf(converted: dict[str, Any], name: str, file: str, says: str) -> None:
    src, message = _refused(converted, name)
    assert message.startswith(f"{src}: does not match its manifest ({MANIFEST}), refused before loading: ")
    path = src / file.format(shard=converted["facts"]["shard"])
    assert f"{path}: " in message and says in message, message


def test_the_direct_export_refuses_or_never_reads_every_hostile_copy(
    converted: dict[str, Any], hf: Path
) -> None:
    """``mcore_to_hf_direct`` (``mars convert mcore-to-hf``'s default) on the same copies: what the model
    path refuses for the metadata or the manifest it refuses with the same message; ``common.pt`` and the
    objects in the shards it never reads (an export needs only the tensors), so those copies export
    bit-identically, and nothing ran either way."""
    refused_alike = [n for n in converted["cases"] if n not in ("common-resealed", "shard-object-resealed")]
    for name, src in converted["cases"].items():
        out = Path(f"{src}.direct")
        try:
            mcore_to_hf_direct(src, out)
            raised = ("", "")
        except CheckpointError as e:
            raised = ("CheckpointError", str(e))
        if name in refused_alike and name != "legitimate":
            assert raised == converted["raised"][name], name
            assert not out.exists() and not (out.parent / f".{out.name}.partial").exists(), name
        else:
            assert raised == ("", ""), (name, raised)
            assert_bit_identical(hf, out)
    assert not converted["marker"].exists()


def test_missing_manifest_is_named_by_mcore_to_hf(converted: dict[str, Any]) -> None:
    src, message = _refused(converted, "no-manifest")
    assert message.startswith(f"{src / MANIFEST}: missing; every checkpoint carries a manifest")
    assert f"seal it with `python -m mars_megatron.checkpoint.manifest {src}`" in message


def test_a_legitimate_checkpoint_still_converts_bit_exactly(converted: dict[str, Any], hf: Path) -> None:
    assert converted["raised"]["legitimate"] == ("", "")
    out = Path(f"{converted['cases']['legitimate']}.out")
    assert not (out / MANIFEST).exists()  # an HF export is an HF folder
    assert_bit_identical(hf, out)


# ------------------------------------------------------------------------------ load_rank_state (resume)
def test_resume_refuses_crafted_and_damaged_policy_folders(tmp_path: Path, hf: Path, training: Path) -> None:
    marker = tmp_path / "ran"

    def case(name: str, damage: Any, reseal: bool) -> str:
        root = _copy(training, tmp_path / name)
        damage(root / POLICY)
        if reseal:
            seal(root / POLICY)
        return str(root)

    cases = {
        "legitimate": case("legitimate", lambda p: None, False),
        "metadata": case("metadata", lambda p: _craft_metadata(p / "dist", marker), True),
        "rng": case("rng", lambda p: torch.save({"python": _Payload(marker)}, p / "rng" / "rank_0.pt"), True),
        "flipped": case("flipped", lambda p: _flip_byte(_shard(p / "dist")), False),
        "no-manifest": case("no-manifest", lambda p: (p / MANIFEST).unlink(), False),
    }
    raised = dict(
        zip(cases, parallel.launch(resume_errors, 1, str(hf), list(cases.values()), POLICY)[0], strict=True)
    )
    assert raised["legitimate"] == ("", "")
    policy = {n: Path(c) / POLICY for n, c in cases.items()}
    assert raised["metadata"][0] == "CheckpointError"
    assert raised["metadata"][1].startswith(
        f"{policy['metadata'] / 'dist' / '.metadata'}: refused: it asks for"
    )
    assert raised["rng"][1].startswith(f"{policy['rng'] / 'rng' / 'rank_0.pt'}: refused:")
    shard = _shard(policy["flipped"] / "dist")
    assert raised["flipped"][1].startswith(f"{policy['flipped']}: does not match its manifest")
    assert f"{shard}: BLAKE3 differs from the manifest" in raised["flipped"][1]
    assert raised["no-manifest"][1].startswith(f"{policy['no-manifest'] / MANIFEST}: missing;")
    assert not marker.exists()
    # the driver refuses the resealed policy folder before any rank starts: the top manifest pins it
    with pytest.raises(CheckpointError, match=re.escape(f"{policy['metadata'] / MANIFEST}: ")):
        CheckpointStore(tmp_path, keep_last=1).resolve(cases["metadata"])


# ------------------------------------------------------------------------------------------------- CLI
def _mars(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mars_megatron.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    return proc, time.perf_counter() - started


def test_cli_refuses_a_crafted_checkpoint_before_any_rank_starts(tmp_path: Path, mcore: Path) -> None:
    """``mars convert mcore-to-hf`` and ``mars score`` read the metadata in the launching process, the
    restricted way: the crafted file is named, nothing ran, no rank started (no staging directory)."""
    marker = tmp_path / "ran"
    src = _copy(mcore, tmp_path / "crafted")
    _craft_metadata(src / "model", marker)
    seal(src)
    expected = f"{src / 'model' / '.metadata'}: refused: it asks for posix.system"
    proc, seconds = _mars("convert", "mcore-to-hf", str(src), str(tmp_path / "out"))
    assert proc.returncode == 2 and f"mars convert: error: {expected}" in proc.stderr, proc.stderr
    assert not (tmp_path / ".out.partial").exists() and not (tmp_path / "out").exists()
    proc, _ = _mars(
        "score",
        "--model-dir",
        str(src),
        "--input",
        str(tmp_path / "tokens.jsonl"),
        "--output",
        str(tmp_path / "s"),
    )
    assert proc.returncode == 2 and f"mars score: error: {expected}" in proc.stderr, proc.stderr
    assert not marker.exists()
    print(f"refused in {seconds:.1f} s")  # start-up of the ranks alone takes longer
