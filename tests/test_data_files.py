"""Data files in the formats the field uses, written here by the real libraries (pyarrow, ``datasets``),
read through the one loader (``mars_megatron.problems``) with a field mapping and a filter: what is kept,
what is left out and why, and that a table is streamed in batches of only the mapped columns."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mars_megatron.problems import FieldMap, load_problems
from mars_megatron.row_filter import FilterError, parse_condition

REPO = Path(__file__).resolve().parents[1]
ARITH = REPO / "examples" / "data" / "arith_train.jsonl"
INSTRUCTION = "Solve the following math problem step by step.\n\n"


def arith() -> list[dict[str, Any]]:
    return [json.loads(line) for line in ARITH.read_text().splitlines()]


def dapo_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """DAPO-Math-17k's shape: the problem as a chat list, the answer a string in a nested column."""
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["problem"]}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(r["answer"]), "style": "rule"},
            "extra_info": {"index": r["qid"], "split": "default"},
        }
        for r in records
    ]


def write_dapo(path: Path, records: list[dict[str, Any]], *, junk: bool = True) -> Path:
    """``records`` in DAPO's shape; with ``junk``, two rows the filter leaves out and two unusable ones
    between them (which must not change what is kept, nor its order)."""
    rows = dapo_rows(records)
    if junk:
        odd = dapo_rows(records[:2])
        odd[0]["reward_model"]["style"] = "model"  # filtered out
        odd[1]["reward_model"]["style"] = "model"
        bad = dapo_rows(records[2:4])
        bad[0]["reward_model"]["ground_truth"] = None  # no answer
        bad[1]["reward_model"]["ground_truth"] = "\\frac{1}{2"  # an answer math-verify cannot read
        bad[1]["extra_info"]["index"] = "bad-1"
        rows = rows[:3] + odd + rows[3:10] + bad + rows[10:]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    return path


DAPO_FIELDS = FieldMap(
    problem="prompt",
    answer="reward_model.ground_truth",
    id="extra_info.index",
    extra=("data_source", "extra_info.split"),
    filter=('reward_model.style == "rule"',),
)


def aime_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """AIME25's shape: ``query``, an integer ``ans_box``, an ``id``."""
    return [
        {"id": r["qid"], "query": r["problem"], "ans_box": int(r["answer"]), "year": 2025} for r in records
    ]


def save_aime(path: Path, train: list[dict[str, Any]], test: list[dict[str, Any]]) -> Path:
    """A ``datasets`` DatasetDict with train and test splits, written by ``save_to_disk``."""
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(aime_records(train)),
            "test": datasets.Dataset.from_list(aime_records(test)),
        }
    ).save_to_disk(str(path))
    return path


AIME_FIELDS = FieldMap(problem="query", answer="ans_box", id="id")


def test_a_dapo_like_parquet_is_mapped_filtered_and_its_bad_rows_counted(tmp_path: Path) -> None:
    records = arith()
    path = write_dapo(tmp_path / "dapo.parquet", records)
    with pytest.warns(UserWarning) as caught:
        data = load_problems(path, fields=DAPO_FIELDS)
    assert [(p.problem_id, p.text, p.reference) for p in data.problems] == [
        (r["qid"], r["problem"], str(r["answer"])) for r in records
    ]
    assert data.problems[0].extra == {"data_source": "math_dapo", "extra_info.split": "default"}
    assert (data.rows, data.filtered, data.unusable) == (len(records) + 4, 2, 2)
    assert dict(data.reasons) == {"no reference answer": 1, "bad reference answer": 1}
    messages = [str(w.message) for w in caught]
    assert f"{path}:13: no reference answer in column 'reward_model.ground_truth'" in messages[0]
    assert f"{path}:14: bad reference answer in 'reward_model.ground_truth'" in messages[1]
    assert data.summary("data") == (
        f"data: {len(records)} problems of {len(records) + 4} rows, 2 left out by the filter, 2 unusable "
        "(1 no reference answer, 1 bad reference answer)"
    )


def test_an_aime_like_saved_dataset_needs_its_split_named(tmp_path: Path) -> None:
    records = arith()
    path = save_aime(tmp_path / "aime", records[:60], records[60:])
    with pytest.raises(ValueError, match=r"aime: holds the splits test, train; choose one with data.split"):
        load_problems(path, fields=AIME_FIELDS)
    data = load_problems(path, fields=AIME_FIELDS, split="test")
    assert [(p.problem_id, p.text, p.reference, p.line) for p in data.problems] == [
        (r["qid"], r["problem"], int(r["answer"]), i) for i, r in enumerate(records[60:], start=1)
    ]
    with pytest.raises(ValueError, match=r"no split 'dev' \(data.split\); its splits: test, train"):
        load_problems(path, fields=AIME_FIELDS, split="dev")
    # the usual names need no mapping: query and ans_box are among them (id is not qid: row numbers)
    assert [p.problem_id for p in load_problems(path, split="train").problems][:2] == ["row1", "row2"]


def test_a_folder_of_parquet_files_is_read_by_split_in_name_order(tmp_path: Path) -> None:
    records = arith()
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    for name, part in (("train-00001-of-00002", records[30:60]), ("train-00000-of-00002", records[:30]),
                       ("test-00000-of-00001", records[60:])):  # fmt: skip
        pq.write_table(pa.Table.from_pylist(aime_records(part)), folder / f"{name}.parquet")
    with pytest.raises(ValueError, match="holds the splits test, train"):
        load_problems(tmp_path / "hub", fields=AIME_FIELDS)
    data = load_problems(tmp_path / "hub", fields=AIME_FIELDS, split="train")
    assert [p.problem_id for p in data.problems] == [r["qid"] for r in records[:60]]


def test_a_mapped_column_the_file_lacks_is_an_error_naming_file_field_and_columns(tmp_path: Path) -> None:
    path = write_dapo(tmp_path / "dapo.parquet", arith()[:5], junk=False)
    fields = FieldMap(problem="prompt", answer="solution", id="extra_info.index")
    with pytest.raises(ValueError) as err:
        load_problems(path, fields=fields)
    assert str(err.value) == (
        f"{path}: no column 'solution' for data.answer ('solution'); its columns: data_source, prompt, "
        "ability, reward_model, extra_info"
    )


def test_a_table_is_streamed_in_batches_of_the_mapped_columns(tmp_path: Path) -> None:
    """A 64 MB column nobody mapped is never read, and the mapped ones come a row group at a time: Arrow's
    own allocations stay a small fraction of the file while every row is read."""
    n = 4096
    rows = [{"question": f"q{i}?", "answer": str(i), "image": os.urandom(16384)} for i in range(n)]
    path = tmp_path / "big.parquet"
    pq.write_table(
        pa.Table.from_pylist(rows), path, row_group_size=256, compression="none", use_dictionary=False
    )
    del rows
    assert path.stat().st_size > 64 * 2**20
    from mars_megatron.problems.sources import read_rows

    fields = FieldMap(problem="question", answer="answer")
    peak = 0
    seen = 0
    for _, _, row in read_rows(
        path, split=None, wanted=fields.top_columns(), named=fields.named(), key="data"
    ):
        assert set(row) == {"question", "answer"}  # type: ignore[arg-type]
        peak = max(peak, pa.total_allocated_bytes())
        seen += 1
    assert seen == n and peak < 4 * 2**20, peak


def test_bad_jsonl_lines_and_unreadable_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"problem": "1+1?", "answer": 2}\n[1]\n{"problem": "x", "answer": "\\\\frac{1"}\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_problems(path)
    assert len(data.problems) == 1 and data.unusable == 2
    assert [str(w.message).split(": ", 1)[0] for w in caught] == [f"skipping {path}:2", f"skipping {path}:3"]
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"fake.parquet: not a readable Parquet file"):
        load_problems(fake)
    csv = tmp_path / "d.csv"
    csv.write_text("problem,answer\n1+1?,2\n")
    with pytest.raises(ValueError, match=r"d.csv: .csv files are not read; data reads JSONL"):
        load_problems(csv)
    with pytest.raises(ValueError, match=r"empty: a folder with neither a saved dataset"):
        (tmp_path / "empty").mkdir()
        load_problems(tmp_path / "empty")


def test_many_bad_rows_are_counted_not_each_printed(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": f"p{i}", "answer": None} for i in range(500)]), path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_problems(path)
    assert data.unusable == 500 and len(data.skipped) == 20 and len(caught) == 21
    assert str(caught[-1].message) == f"{path}: 480 more unusable rows not shown (500 no reference answer)"


@pytest.mark.parametrize(
    ("text", "row", "holds"),
    [
        ('reward_model.style == "rule"', {"reward_model": {"style": "rule"}}, True),
        ("level >= 3", {"level": 2}, False),
        ("level >= 3", {"level": "5"}, False),  # a string is not ordered against a number
        ('source in ["aime", "amc"]', {"source": "amc"}, True),
        ('source not in ["aime"]', {}, True),  # absent: not among anything
        ('prompt.0.role == "user"', {"prompt": [{"role": "user"}]}, True),
        ("missing == null", {}, False),
    ],
)
def test_filter_conditions(text: str, row: dict[str, Any], holds: bool) -> None:
    assert parse_condition(text).holds(row) is holds


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("__import__('os').system('x') == 1", "is not 'PATH OP VALUE'"),
        ("level >= three", "is not a JSON literal"),
        ("level in 3", "needs a JSON list"),
        ("level < [1]", "needs a number or a string"),
        ("a..b == 1", "is not 'PATH OP VALUE'"),
        ("x == " + "1" * 5000, "at most 4096"),
    ],
)
def test_bad_filter_conditions_say_why(text: str, why: str) -> None:
    with pytest.raises(FilterError, match=why):
        parse_condition(text)


def test_answers_math_verify_cannot_read_are_kept_when_a_function_judges(tmp_path: Path) -> None:
    """A code task's answer column holds test cases, and some rows none: refused for math-verify, kept as
    JSON for a reward function (``check_answers=False``: no role of the run is judged by math-verify)."""
    rows = [
        {"question": "Write add.", "cases": [[1, 2, 3], [0, 0, 0]]},
        {"question": "Write nop.", "cases": None},
    ]
    path = tmp_path / "code.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.warns(UserWarning):
        assert load_problems(path, fields=FieldMap(problem="question", answer="cases")).unusable == 2
    data = load_problems(path, fields=FieldMap(problem="question", answer="cases", check_answers=False))
    assert [p.reference for p in data.problems] == [[[1, 2, 3], [0, 0, 0]], None]


def test_the_usual_names_and_filter_columns_are_read_beside_the_mapped_ones(tmp_path: Path) -> None:
    """Only some fields mapped: the others' usual columns (qid, answer) are still read from a table, and
    so is a column only the filter names (written without spaces)."""
    rows = [
        {"qid": f"q{i}", "prompt": f"{i}+1?", "answer": str(i + 1), "level": i, "blob": "x"} for i in range(4)
    ]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = load_problems(path, fields=FieldMap(problem="prompt", filter=("level>=2",)))
    assert [(p.problem_id, p.reference) for p in data.problems] == [("q2", "3"), ("q3", "4")]
    assert data.filtered == 2
