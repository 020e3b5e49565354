"""The rows of a data file, streamed: JSONL line by line, Parquet and Arrow in record batches of only the
columns the mapping needs, ``datasets`` folders memory-mapped. Never the whole file in memory at once.

Each reader yields ``(where, row number, row or RowError)``; ``where`` names the file the row is in (a
folder of Parquet files has several). Only ``datasets``' own on-disk formats are opened through it
(``load_from_disk``, ``Dataset.from_file``): no dataset script, nothing from a hub, nothing that runs
code. A file that is not what its name says is a ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mars_megatron.json_file import parse_json
from mars_megatron.problems.mapping import RowError

MAX_LINE_BYTES = 2**20
"""Longest JSONL line read (1 MiB): a longer one is skipped unread, so a file without newlines cannot fill
memory."""
BATCH_ROWS = 512
"""Rows per record batch read from a table: small enough that a batch of long rows stays a few MB."""
FORMATS = (
    "JSONL (.jsonl/.json, one object per line), Parquet (.parquet), Arrow (.arrow), a folder written by "
    "datasets' save_to_disk, or a folder of .parquet files"
)
UNSUPPORTED = (
    ".csv",
    ".tsv",
    ".xlsx",
    ".xls",
    ".pkl",
    ".pickle",
    ".pt",
    ".pth",
    ".npy",
    ".npz",
    ".zip",
    ".gz",
)
"""Kinds of file people try that are not read (convert them to Parquet or JSONL): refused by name, so a
CSV is not read as a file of bad JSON lines, and nothing is unpickled."""
SPLITS = ("train", "test", "validation", "valid", "dev", "eval")

Row = tuple[str, int, "dict[str, Any] | RowError"]


def _jsonl(path: Path) -> Iterator[Row]:
    with path.open("rb") as f:
        for line, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if not raw.strip():
                continue
            if line == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as some editors write
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line unread
                    raw = f.readline(MAX_LINE_BYTES)
                yield (
                    str(path),
                    line,
                    RowError("line too long", f"line longer than {MAX_LINE_BYTES // 2**20} MiB"),
                )
                continue
            try:
                record = parse_json(raw)  # not UTF-8, bad JSON, huge ints, deep nesting: a ValueError
            except ValueError as e:
                yield str(path), line, RowError("bad JSON", str(e))
                continue
            if not isinstance(record, dict):
                yield (
                    str(path),
                    line,
                    RowError("not an object", f"expected a JSON object, got {type(record).__name__}"),
                )
                continue
            yield str(path), line, record


def _columns(
    names: list[str], wanted: set[str] | None, where: Path, named: dict[str, str], key: str
) -> list[str] | None:
    """The columns to read (None: all of them), after checking that every mapped one exists: a
    ValueError naming the file, the field and the columns the file has."""
    for field, path in named.items():
        top = path.split(".")[0]
        if top not in names:
            shown = ", ".join(names[:40]) + (", ..." if len(names) > 40 else "")
            raise ValueError(f"{where}: no column '{top}' for {key}.{field} ('{path}'); its columns: {shown}")
    return None if wanted is None else [n for n in names if n in wanted]


def _batches(batches: Any, where: Path) -> Iterator[Row]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            row += 1
            yield str(where), row, record


def _parquet(path: Path, wanted: set[str] | None, named: dict[str, str], key: str) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({str(e)[:200]})") from None
    columns = _columns(table.schema_arrow.names, wanted, path, named, key)
    try:
        yield from _batches(table.iter_batches(batch_size=BATCH_ROWS, columns=columns), path)
    except pa.ArrowException as e:
        raise ValueError(f"{path}: corrupt Parquet data ({str(e)[:200]})") from None


def _arrow_dataset(
    ds: Any, where: Path, wanted: set[str] | None, named: dict[str, str], key: str
) -> Iterator[Row]:
    columns = _columns(list(ds.column_names), wanted, where, named, key)
    if columns is not None:
        ds = ds.select_columns(columns)
    yield from _batches(ds.with_format("arrow").iter(batch_size=BATCH_ROWS), where)


def _split_of(name: str, split: str | None, where: Path, splits: list[str]) -> str:
    splits = sorted(splits)
    if split is not None:
        if split not in splits:
            raise ValueError(f"{where}: no split '{split}' ({name}.split); its splits: {', '.join(splits)}")
        return split
    if len(splits) == 1:
        return splits[0]
    raise ValueError(f"{where}: holds the splits {', '.join(splits)}; choose one with {name}.split")


def _saved_dataset(
    path: Path, split: str | None, wanted: set[str] | None, named: dict[str, str], key: str
) -> Iterator[Row]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError, KeyError) as e:
        raise ValueError(f"{path}: not a readable save_to_disk folder ({str(e)[:200]})") from None
    if isinstance(ds, datasets.DatasetDict):
        chosen = _split_of(key, split, path, list(ds))
        ds, path = ds[chosen], path / chosen
    elif split is not None:
        raise ValueError(f"{path}: a dataset without splits, but {key}.split is '{split}'")
    yield from _arrow_dataset(ds, path, wanted, named, key)


def _parquet_folder(
    path: Path, split: str | None, wanted: set[str] | None, named: dict[str, str], key: str
) -> Iterator[Row]:
    """A folder of Parquet files as the Hub stores a dataset (``data/train-00000-of-00002.parquet``):
    the files of one split, in name order."""
    files = sorted(p for p in path.rglob("*.parquet") if p.is_file())
    if not files:
        raise ValueError(
            f"{path}: a folder with neither a saved dataset (state.json) nor .parquet files; {key} reads "
            f"{FORMATS}"
        )

    def split_of(file: Path) -> str | None:
        names = [file.stem.split("-")[0].split(".")[0], *(p.name for p in file.relative_to(path).parents)]
        return next((n for n in names if n in SPLITS), None)

    found = sorted({s for s in map(split_of, files) if s is not None})
    if split is not None or len(found) > 1:
        chosen = _split_of(key, split, path, found or ["(none)"])
        files = [f for f in files if split_of(f) == chosen]
    for file in files:
        yield from _parquet(file, wanted, named, key)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``datasets``' save_to_disk wrote (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def read_rows(
    path: Path, *, split: str | None, wanted: set[str] | None, named: dict[str, str], key: str
) -> Iterator[Row]:
    """The rows of ``path`` by its kind; ValueError naming the file for one that cannot be read."""
    if path.is_dir():
        if is_saved_dataset(path):
            return _saved_dataset(path, split, wanted, named, key)
        return _parquet_folder(path, split, wanted, named, key)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or folder")
    suffix = path.suffix.lower()
    if split is not None:
        raise ValueError(f"{path}: one file holds one split, but {key}.split is '{split}'")
    with path.open("rb") as f:
        magic = f.read(4)
    if suffix == ".parquet" or magic == b"PAR1":
        return _parquet(path, wanted, named, key)
    if suffix == ".arrow":
        import datasets

        try:
            ds = datasets.Dataset.from_file(str(path))
        except Exception as e:  # pyarrow and datasets raise many kinds for a bad file
            raise ValueError(
                f"{path}: not a readable Arrow file ({type(e).__name__}: {str(e)[:200]})"
            ) from None
        return _arrow_dataset(ds, path, wanted, named, key)
    if suffix in UNSUPPORTED:
        raise ValueError(f"{path}: {suffix} files are not read; {key} reads {FORMATS}")
    return _jsonl(path)  # any other name: JSONL, as data files always were (bad lines are named)
