"""The manifest every checkpoint carries: each file's relative path, size and BLAKE3 digest, written last.

A checkpoint is a directory of many files written by many ranks, then copied, synced and mounted by
other tools. A cut, lost or altered file used to surface as an ``EOFError`` or ``ZeroDivisionError``
deep inside megatron after the whole start-up; checked against the manifest first, it is named::

    <dir>/MANIFEST.json   {"format": "mars-manifest-v2", "files": {"model/__0_0.distcp":
                           {"size": 490403, "blake3": "…"}, ...}}

The digest is BLAKE3 (256 bits, cryptographic like SHA-256), not SHA-256 as in the first version of the
format: SHA-256 runs at 0.27 GB/s a core on a CPU without the SHA extensions (measured on one of this
project's 2-core machines; several times that with them), so on such a machine hashing alone took six
times as long as reading and writing the checkpoint, on every save, conversion and load. BLAKE3 runs at
about 4 GB/s a core on the same CPU and releases the GIL. Manifests of the first version
(``MANIFEST.sha256.json``, ``mars-manifest-v1``, SHA-256) are still read and checked with SHA-256; new ones
are written as above.

A sub-directory with a manifest of its own (a policy folder inside a training checkpoint) appears in its
parent's manifest as that one file: its digest pins the whole sub-tree, and each folder is checked on its
own where it is loaded on its own.

Checking costs one read of the checkpoint. The dist-checkpoint data shards (``*.distcp``, nearly all of
the bytes) are hashed by the ranks that load them, each rank a share (:func:`verify_collective`); every
other file (metadata, JSON, RNG and schedule states: what is parsed) is hashed before anything starts
(:func:`verify_manifest`). ``MARS_CHECKPOINT_VERIFY=sizes`` skips the shards' digests (sizes are always
checked), for storage whose integrity is trusted. Writing one reads back only the files whose digests
were not computed as they were written (:func:`record_written`: the data shards of a conversion's
``dist_save``). The manifest guards against accidents, not an attacker who can also rewrite it: what
makes loading safe is that no file is unpickled beyond plain data (``dist_load.py``, ``safe_load.py``).

Sealing an existing directory (a checkpoint from before manifests existed, after deciding to trust it)::

    python -m mars_megatron.checkpoint.manifest <checkpoint dir>
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mars_megatron.checkpoint.atomic import write_text_atomic
from mars_megatron.checkpoint.errors import CheckpointError
from mars_megatron.json_file import read_json

__all__ = [
    "MANIFEST",
    "list_files",
    "record_written",
    "seal_command",
    "verify_collective",
    "verify_manifest",
    "write_collective",
    "write_manifest",
]

MANIFEST = "MANIFEST.json"
FORMAT = "mars-manifest-v2"
ALGORITHM = "blake3"
LEGACY_MANIFEST = "MANIFEST.sha256.json"
"""The first version's file (``mars-manifest-v1``, SHA-256): read and checked, never written."""
_FORMATS = {MANIFEST: ("mars-manifest-v2", "blake3"), LEGACY_MANIFEST: ("mars-manifest-v1", "sha256")}
_NAMES = {"blake3": "BLAKE3", "sha256": "SHA-256"}
VERIFY_ENV = "MARS_CHECKPOINT_VERIFY"
SHARD_SUFFIX = ".distcp"
_MAX_LISTED = 8
_THREADS = min(8, os.cpu_count() or 1)

Entry = dict[str, Any]  # {"size": int, ALGORITHM: str}


def seal_command(directory: str | Path) -> str:
    return f"python -m mars_megatron.checkpoint.manifest {directory}"


# ------------------------------------------------------------------------------------------------ files
def list_files(directory: str | Path) -> list[str]:
    """Every file under ``directory`` a manifest covers, as sorted relative POSIX paths: a sub-directory
    holding a manifest counts as that manifest alone; the directory's own manifest and ``*.partial``
    leftovers of an atomic write are not listed. A symlink is refused (a checkpoint holds plain files)."""
    root = Path(directory)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        nested = _manifest_name(filenames)
        if here != root and nested is not None:
            found.append((here / nested).relative_to(root).as_posix())
            dirnames.clear()
            continue
        for name in filenames:
            path = here / name
            if (here == root and name in _FORMATS) or name.endswith(".partial"):
                continue
            if path.is_symlink():
                raise CheckpointError(f"{path}: a symlink; a checkpoint holds plain files only")
            found.append(path.relative_to(root).as_posix())
        for name in dirnames:
            if (here / name).is_symlink():
                raise CheckpointError(f"{here / name}: a symlink; a checkpoint holds plain files only")
        dirnames.sort()
    return sorted(found)


def _manifest_name(filenames: Iterable[str]) -> str | None:
    """The manifest among a directory's files: this version's, else the first version's, else None."""
    names = set(filenames)
    return next((m for m in (MANIFEST, LEGACY_MANIFEST) if m in names), None)


def new_digest(algorithm: str = ALGORITHM) -> Any:
    """A fresh hash object of ``algorithm`` (``blake3``, or ``sha256`` for first-version manifests)."""
    if algorithm == "blake3":
        import blake3

        return blake3.blake3()
    return hashlib.new(algorithm)


def algorithm_of(entry: Entry) -> str:
    """Which digest an entry holds (a parent's manifest may pin a nested one of the first version)."""
    return ALGORITHM if ALGORITHM in entry else "sha256"


def _entry(path: Path, algorithm: str = ALGORITHM) -> Entry:
    """Size and digest of one file. BLAKE3 hashes the file through a mapping, on this thread: no copy of
    every byte into a buffer first (a third less CPU and memory traffic than reading it, which matters
    when an export hashes its source while copying it). A file truncated while it is hashed would end
    the process with SIGBUS; checkpoints are written into a staging folder and renamed, never truncated
    in place. As with a read, a file that changes while it is hashed gets an entry that matches neither
    version, which a check reports as changed."""
    if algorithm == "blake3":
        import blake3

        digest = blake3.blake3(max_threads=1).update_mmap(path).hexdigest()
        return {"size": os.stat(path).st_size, algorithm: digest}
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, lambda: new_digest(algorithm)).hexdigest()
        size = os.fstat(f.fileno()).st_size
    return {"size": size, algorithm: digest}


_written: dict[tuple[int, int], tuple[tuple[int, ...], Entry]] = {}
"""Digests of files this process wrote, computed from the bytes as they were written, by (device, inode),
with the stamp the file had once closed."""


def _stamp_of(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def record_written(path: str | Path, entry: Entry) -> None:
    """Remember ``entry`` (size and digest) of the file ``path`` this process has just written, closed
    and fsynced, hashed from the bytes as they were written: the manifest written next takes it instead
    of reading the file back, as long as the file's size and times are unchanged. (Checking a manifest
    always reads the files.)"""
    st = os.stat(path)
    if st.st_size != entry["size"]:
        raise ValueError(f"{path}: {st.st_size} bytes on disk, {entry['size']} hashed as written")
    _written[(st.st_dev, st.st_ino)] = (_stamp_of(st), dict(entry))


def _take_written(path: Path) -> Entry | None:
    """The recorded entry of ``path``, if any and if the file is unchanged since (forgotten either way)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp, entry = _written.pop((st.st_dev, st.st_ino), (None, None))
    return entry if stamp == _stamp_of(st) else None


def _known_entries(root: Path, names: Iterable[str]) -> dict[str, Entry]:
    return {n: e for n in names if (e := _take_written(root / n)) is not None}


def digest_files(
    directory: str | Path, names: Iterable[str], algorithm: str = ALGORITHM, *, threads: int = _THREADS
) -> dict[str, Entry]:
    """Size and digest of each named file; ``threads`` files at a time, since hashing releases the GIL
    and storage is usually faster with several reads in flight."""
    root = Path(directory)
    names = list(names)
    with ThreadPoolExecutor(threads) as pool:
        return dict(zip(names, pool.map(lambda n: _entry(root / n, algorithm), names), strict=True))


# ---------------------------------------------------------------------------------------------- writing
def write_manifest(directory: str | Path, entries: dict[str, Entry] | None = None) -> Path:
    """Write ``directory``'s manifest atomically (``entries``: already hashed, e.g. by several ranks;
    default: hash every file now). Call it last, when no other file will change."""
    root = Path(directory)
    if entries is None:
        names = list_files(root)
        entries = _known_entries(root, names)
        entries |= digest_files(root, [n for n in names if n not in entries])
    record = {"format": FORMAT, "files": dict(sorted(entries.items()))}
    path = root / MANIFEST
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    (root / LEGACY_MANIFEST).unlink(missing_ok=True)  # superseded (a re-sealed first-version checkpoint)
    return path


def write_collective(directory: str | Path) -> None:
    """:func:`write_manifest` over every rank of the default process group (collective): rank 0 lists the
    files, each rank hashes a share of those no rank hashed as it wrote them (:func:`record_written`),
    rank 0 writes. Call after a barrier that follows the last write."""
    import torch.distributed as dist

    root = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    holder: list[Any] = [list_files(root) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    names: list[str] = holder[0]
    known: list[Any] = [None] * world  # what each rank hashed as it wrote
    dist.all_gather_object(known, _known_entries(root, names))
    done = {k: v for share in known for k, v in share.items()}
    rest = [n for n in names if n not in done]
    mine = digest_files(root, rest[rank::world])
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, mine | (done if rank == 0 else {}))
    if rank == 0:
        write_manifest(root, {k: v for share in shares for k, v in share.items()})
    dist.barrier()


# -------------------------------------------------------------------------------------------- checking
def read_manifest(directory: str | Path) -> dict[str, Entry]:
    """The files ``directory``'s manifest lists; :class:`CheckpointError` naming it if it is missing,
    unreadable or malformed."""
    root = Path(directory)
    path = root / MANIFEST
    if not path.is_file() and (root / LEGACY_MANIFEST).is_file():
        path = root / LEGACY_MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; every checkpoint carries a manifest of its files, written last. {root} is "
            "incomplete, not a checkpoint, or was written before manifests existed: if you trust it "
            f"(loading never runs code from it), seal it with `{seal_command(root)}`"
        )
    form, algorithm = _FORMATS[path.name]
    record = read_json(path, CheckpointError)
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("format") != form or not isinstance(files, dict):
        raise CheckpointError(f"{path}: not a {form} manifest (needs 'format' and a 'files' object)")
    for name, entry in files.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("size"), int)
        if not ok or not isinstance(entry.get(algorithm), str) or _escapes(name):
            raise CheckpointError(
                f"{path}: entry {name!r} is malformed (needs relative path, size, {algorithm})"
            )
    return files


def _escapes(name: str) -> bool:
    parts = Path(name).parts
    return not parts or Path(name).is_absolute() or ".." in parts


def _collect(root: Path, prefix: str, problems: list[str]) -> dict[str, Entry]:
    """Every file the manifests under ``root`` pin (nested manifests followed), by path relative to the
    directory first checked; structural problems (missing, extra, wrong size) appended to ``problems``."""
    listed = read_manifest(root)
    try:
        present = set(list_files(root))
    except CheckpointError as e:
        problems.append(str(e))
        present = set()
    for name in sorted(present - listed.keys()):
        problems.append(f"{root / name}: not in the manifest (a file added after it was written)")
    flat: dict[str, Entry] = {}
    for name, entry in sorted(listed.items()):
        path = root / name
        if name not in present:
            problems.append(f"{path}: missing (listed in the manifest with {entry['size']} bytes)")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            what = "cut short" if size < entry["size"] else "grown"
            problems.append(f"{path}: {size} bytes, the manifest says {entry['size']} ({what})")
            continue
        flat[prefix + name] = entry
        if Path(name).name in _FORMATS and Path(name).parent != Path("."):
            sub = Path(name).parent
            try:
                flat.update(_collect(root / sub, f"{prefix}{sub.as_posix()}/", problems))
            except CheckpointError as e:
                problems.append(str(e))
    return flat


def _raise(root: Path, problems: list[str]) -> None:
    if not problems:
        return
    shown = "; ".join(problems[:_MAX_LISTED])
    more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    raise CheckpointError(
        f"{root}: does not match its manifest ({MANIFEST}), refused before loading: {shown}{more}. "
        f"If the change was deliberate, re-seal it with `{seal_command(root)}`"
    )


def shard_digests_wanted() -> bool:
    """False when ``MARS_CHECKPOINT_VERIFY=sizes``: data shards are then checked by size only."""
    value = os.environ.get(VERIFY_ENV, "full")
    if value not in ("full", "sizes"):
        raise ValueError(f"{VERIFY_ENV}={value!r}: expected 'full' or 'sizes'")
    return value == "full"


def _check_digests(
    root: Path, flat: dict[str, Entry], names: list[str], threads: int = _THREADS
) -> list[str]:
    problems = []
    for algorithm in sorted({algorithm_of(flat[n]) for n in names}):
        mine = [n for n in names if algorithm_of(flat[n]) == algorithm]
        got = digest_files(root, mine, algorithm, threads=threads)
        problems += [
            f"{root / n}: {_NAMES[algorithm]} differs from the manifest (changed after it was written)"
            for n in mine
            if got[n][algorithm] != flat[n][algorithm] or got[n]["size"] != flat[n]["size"]
        ]
    return sorted(problems)


def verify_manifest(directory: str | Path, *, shards: bool = False, threads: int = _THREADS) -> None:
    """Check ``directory`` (and nested manifests) against its manifest: every listed file present with
    its size, nothing unlisted, and the digest of every file but the data shards (``shards=True``: of
    those too), ``threads`` files at a time (1 beside other work that needs the other cores). Cheap
    enough to run before any start-up; :class:`CheckpointError` naming each bad file."""
    root = Path(directory)
    problems: list[str] = []
    flat = _collect(root, "", problems)
    _raise(root, problems)
    names = [n for n in flat if shards or not n.endswith(SHARD_SUFFIX)]
    _raise(root, _check_digests(root, flat, names, threads))


_verified: dict[str, tuple[Any, ...]] = {}
"""Directories this process verified, with the file stamps they had: the same checkpoint loaded again
(several policies from one model) is not hashed again unless a file changed."""


def _stamp(root: Path, flat: dict[str, Entry]) -> tuple[Any, ...]:
    return tuple((n, (root / n).stat().st_mtime_ns, e[algorithm_of(e)]) for n, e in sorted(flat.items()))


def verify_collective(directory: str | Path) -> None:
    """:func:`verify_manifest` on every rank of the default process group (collective), the digests
    split between the ranks (data shards included unless ``MARS_CHECKPOINT_VERIFY=sizes``). Every rank
    raises the same :class:`CheckpointError`, so none is left waiting in a later collective."""
    import torch.distributed as dist

    root = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    fatal, problems, flat = "", [], {}
    try:
        flat = _collect(root, "", problems)
        if not problems and _verified.get(str(root.resolve())) != _stamp(root, flat):
            wanted = shard_digests_wanted()
            names = sorted(n for n in flat if wanted or not n.endswith(SHARD_SUFFIX))
            problems = _check_digests(root, flat, names[rank::world])
    except (CheckpointError, OSError, ValueError) as e:  # no usable manifest: its own message says why
        fatal = str(e)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (fatal, problems))
    fatal = next((f for f, _ in everyone if f), "")
    if fatal:
        raise CheckpointError(fatal)
    _raise(root, sorted({p for _, share in everyone for p in share}))
    _verified[str(root.resolve())] = _stamp(root, flat)


def seal(directory: str | Path) -> Path:
    """Write a manifest for an existing directory as it is now (see the module docstring)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    return write_manifest(root)


def _main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(f"usage: {seal_command('<checkpoint dir>')}", file=sys.stderr)
        return 2
    try:
        path = seal(argv[0])
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
