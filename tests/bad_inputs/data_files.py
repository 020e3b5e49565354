"""Data files beyond JSONL and their mapping: Parquet, Arrow and ``datasets`` folders as
``data.train_file`` / ``evaluation.test_file`` / ``mars eval --data`` read them, with ``data.fields``,
``data.filter`` and ``data.split`` (``--field``/``--filter``/``--split``).

A file that cannot be read, or lacks a mapped column, is refused naming the file and the field; a row
that cannot be used is skipped with a warning naming ``file:row``, the column and the reason (as a bad
JSONL line is); a setting that cannot be read is a config error naming it. Pickles are refused by name,
never opened.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from tests.bad_inputs.harness import MARKER, Case, Workspace, mars_main

ROW = {"qid": "p1", "problem": "What is 2+3?", "answer": "5"}


def _parquet(ws: Workspace, rows: list[dict[str, Any]], name: str = "d.parquet") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = ws.path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _dir(ws: Workspace, name: str) -> Path:
    ws.path(name).mkdir()
    return ws.path(name)


def _load(path: Path, **fields: Any) -> Any:
    from mars_megatron.problems import FieldMap, load_problems

    split = fields.pop("split", None)
    return load_problems(path, fields=FieldMap(**fields), split=split)


def _row(ws: Workspace, bad: dict[str, Any], **fields: Any) -> Any:
    """One good row, then the bad one (a warning must name ``d.parquet:2``)."""
    keys = set(ROW) | set(bad)
    rows = [{k: ROW.get(k) for k in keys}, {**{k: None for k in keys}, **bad}]
    return _load(_parquet(ws, rows), **fields)


def _saved(ws: Workspace, splits: dict[str, list[dict[str, Any]]] | None) -> Path:
    import datasets

    path = ws.path("ds")
    if splits is None:
        datasets.Dataset.from_list([ROW]).save_to_disk(str(path))
    else:
        datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(
            str(path)
        )
    return path


def _train(ws: Workspace, path: Path, *overrides: str) -> Any:
    """``mars train``'s checks before anything starts (``prepare``) on ``path`` with ``overrides``."""
    from mars_megatron.config import load_config
    from mars_megatron.pipeline.trainer import prepare

    cfg = load_config(
        None,
        [f"model.hf_dir={ws.fixtures.hf_dense}", f"data.train_file={path}",
         f"logging.run_dir={ws.path('run')}", *overrides],
    )  # fmt: skip
    return prepare(cfg, nproc=None, resume=None, check_machine=False)


def _config(*overrides: str) -> Any:
    from mars_megatron.config import load_config

    return load_config(None, list(overrides))


def _eval(ws: Workspace, path: Path, *flags: str) -> Any:
    return mars_main(
        "eval", "--data", path, *flags, "--model", ws.fixtures.hf_dense, "--engine", "openai", "--endpoint",
        "http://127.0.0.1:9", "--samples", "1", "--out", ws.path("out"),
    )  # fmt: skip


def _pickle(ws: Workspace) -> Path:
    class Boom:
        def __reduce__(self) -> Any:
            return (Path(str(ws.root / MARKER)).touch, ())

    path = ws.path("d.pkl")
    path.write_bytes(pickle.dumps(Boom()))
    return path


ROWS: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, ...]]] = [
    # (name, the bad row, the mapping, what the warning names beside d.parquet:2)
    (
        "chat-without-user",
        {"prompt": [{"role": "system", "content": "x"}]},
        {"problem": "prompt"},
        ("prompt",),
    ),
    (
        "chat-content-not-text",
        {"prompt": [{"role": "user", "content": 3}]},
        {"problem": "prompt"},
        ("prompt",),
    ),
    ("problem-nested-missing", {"q": {"other": "x"}, "answer": "4"}, {"problem": "q.text"}, ("q.text",)),
    ("answer-nested-null", {"problem": "2+2", "rm": {"gt": None}}, {"answer": "rm.gt"}, ("rm.gt",)),
    ("answer-list", {"problem": "2+2", "rm": {"gt": ["4"]}}, {"answer": "rm.gt"}, ("rm.gt",)),
    ("answer-unbalanced", {"problem": "2+2", "rm": {"gt": "\\frac{1"}}, {"answer": "rm.gt"}, ("rm.gt",)),
    ("id-null", {"problem": "2+2", "answer": "4", "meta": {"i": None}}, {"id": "meta.i"}, ("meta.i",)),
    ("id-float", {"problem": "2+2", "answer": "4", "meta": {"i": 1.5}}, {"id": "meta.i"}, ("meta.i",)),
    ("id-duplicate", {"problem": "2+2", "answer": "4", "qid": "p1"}, {}, ("duplicate",)),
    ("extra-bytes", {"problem": "2+2", "answer": "4", "blob": b"\x00\x01"}, {"extra": ("blob",)}, ("blob",)),
    ("extra-missing-nested", {"problem": "2+2", "answer": "4", "m": {"a": 1}}, {"extra": ("m.b",)}, ("m.b",)),
    ("row-too-large", {"problem": "x" * (2 * 2**20), "answer": "4"}, {}, ("MiB",)),
]


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case("data files", name, feed, names, **kw))

    for name, bad, fields, names in ROWS:
        add(
            f"rows/{name}",
            lambda ws, b=bad, f=fields: _row(ws, b, **f),
            "{ws}/d.parquet:2",
            *names,
            warning=True,
        )
    # whole files
    add(
        "file/garbage-parquet",
        lambda ws: _load(ws.write("d.parquet", b"PAR1 garbage")),
        "{ws}/d.parquet",
        "Parquet",
    )
    add("file/truncated-parquet",
        lambda ws: _load(ws.write("d.parquet", _parquet(ws, [ROW] * 50, "good.parquet").read_bytes()[:-40])),
        "{ws}/d.parquet")  # fmt: skip
    add("file/parquet-magic-in-jsonl-name",
        lambda ws: _load(ws.write("d.jsonl", b"PAR1" + b"\x00" * 64)), "{ws}/d.jsonl", "Parquet")  # fmt: skip
    add(
        "file/garbage-arrow",
        lambda ws: _load(ws.write("d.arrow", b"ARROW1 garbage")),
        "{ws}/d.arrow",
        "Arrow",
    )
    add("file/csv", lambda ws: _load(ws.write("d.csv", b"problem,answer\n1+1,2\n")), "{ws}/d.csv", ".csv")
    add("file/pickle-refused-unopened", lambda ws: _load(_pickle(ws)), "{ws}/d.pkl", ".pkl")
    add("file/empty-folder", lambda ws: _load(_dir(ws, "f")), "{ws}/f", "neither")
    add("file/missing-column",
        lambda ws: _load(_parquet(ws, [ROW]), problem="problem", answer="solution"),
        "{ws}/d.parquet", "solution", "answer", "its columns")  # fmt: skip
    add("file/missing-nested-column-top",
        lambda ws: _load(_parquet(ws, [ROW]), problem="prompt.0.content", answer="answer"),
        "{ws}/d.parquet", "prompt", "problem")  # fmt: skip
    add("file/missing-extra-column",
        lambda ws: _load(_parquet(ws, [ROW]), problem="problem", answer="answer", extra=("tests",)),
        "{ws}/d.parquet", "tests", "extra[0]")  # fmt: skip
    add("split/needed", lambda ws: _load(_saved(ws, {"train": [ROW], "test": [ROW]})),
        "{ws}/ds", "test, train", "split")  # fmt: skip
    add(
        "split/unknown",
        lambda ws: _load(_saved(ws, {"train": [ROW]}), split="dev"),
        "{ws}/ds",
        "dev",
        "train",
    )
    add(
        "split/on-a-dataset-without-splits",
        lambda ws: _load(_saved(ws, None), split="train"),
        "{ws}/ds",
        "split",
    )
    add("split/on-one-file", lambda ws: _load(_parquet(ws, [ROW]), split="train"), "{ws}/d.parquet", "split")
    add("split/parquet-folder-needs-one",
        lambda ws: (_parquet(ws, [ROW], "hub/train-0.parquet"),
                    _parquet(ws, [ROW], "hub/test-0.parquet"), _load(ws.path("hub")))[-1],
        "{ws}/hub", "test, train")  # fmt: skip
    add("saved/corrupt-state",
        lambda ws: (_saved(ws, None), ws.write("ds/state.json", b"{not json"), _load(ws.path("ds")))[-1],
        "{ws}/ds", "save_to_disk")  # fmt: skip
    # the train pre-flight: counts in the message when nothing is usable
    add("train/all-rows-filtered",
        lambda ws: _train(ws, _parquet(ws, [ROW]), 'data.filter=["answer == \\"6\\""]'),
        "{ws}/d.parquet", "1 left out by the filter", needs=("hf_dense",))  # fmt: skip
    add("train/missing-column",
        lambda ws: _train(ws, _parquet(ws, [ROW]), "data.fields.answer=gt"),
        "{ws}/d.parquet", "data.answer", "gt", needs=("hf_dense",))  # fmt: skip
    # settings
    for name, override, field in [
        ("problem-path-traversal", "data.fields.problem=../x", "data.fields.problem"),
        ("problem-path-empty", "data.fields.problem=''", "data.fields.problem"),
        ("answer-path-spaces", "data.fields.answer='a b'", "data.fields.answer"),
        ("id-path-newline", 'data.fields.id="a\\nb"', "data.fields.id"),
        ("extra-not-list", "data.fields.extra=tests", "data.fields.extra"),
        ("extra-duplicate", "data.fields.extra=[a, a]", "data.fields.extra"),
        (
            "filter-python",
            """data.filter=["__import__('os').system('touch PWNED') == 1"]""",
            "data.filter[0]",
        ),
        ("filter-no-op", "data.filter=[level]", "data.filter[0]"),
        ("filter-bad-literal", "data.filter=['level >= three']", "data.filter[0]"),
        ("filter-in-scalar", "data.filter=['level in 3']", "data.filter[0]"),
        ("filter-not-list", "data.filter='level >= 3'", "data.filter"),
        ("filter-huge", "data.filter=['x == " + "1" * 5000 + "']", "data.filter[0]"),
        ("eval-filter-python", "evaluation.filter=['os.system(1)']", "evaluation.filter[0]"),
        ("eval-fields-path", "evaluation.fields.problem=/etc/passwd", "evaluation.fields.problem"),
        ("split-not-str", "data.split=[a]", "data.split"),
    ]:
        add(f"settings/{name}", lambda ws, o=override: _config(o), field)
    for name, flags, names in [
        ("field-no-equals", ("--field", "problem"), ("--field",)),
        ("field-unknown-name", ("--field", "solution=x"), ("--field", "solution")),
        ("field-twice", ("--field", "problem=a", "--field", "problem=b"), ("--field", "problem")),
        ("field-bad-path", ("--field", "answer=a..b"), ("--field",)),
        ("filter-bad", ("--filter", "level >>= 3"), ("--filter",)),
    ]:
        add(f"eval-flags/{name}", lambda ws, f=flags: _eval(ws, _parquet(ws, [ROW]), *f), *names,
            needs=("hf_dense",), preserve=())  # fmt: skip
    add("eval-flags/missing-column",
        lambda ws: _eval(ws, _parquet(ws, [ROW]), "--field", "answer=gt"), "{ws}/d.parquet", "gt",
        needs=("hf_dense",))  # fmt: skip
    return out
