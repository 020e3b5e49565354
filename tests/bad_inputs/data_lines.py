"""Data lines: the JSONL problems of ``mars train`` (``data.train_file``, ``evaluation.test_file``),
``mars eval --data`` and ``mars sft`` (``train_file``), the token lines of ``mars score --input`` and its
``--routing`` arrays.

A bad problem line is skipped with a warning naming ``file:line`` and the reason (by design: one bad
line of a public data set must not stop an evaluation); a file with no usable line is refused. Token
lines and routing arrays are refused at the first bad one.
"""

from __future__ import annotations

import json
from typing import Any

from tests.bad_inputs.harness import Case, Workspace, mars_main

GOOD = json.dumps({"qid": "p1", "problem": "What is 2+3?", "answer": "5"})

# (name, raw line, a word the reason must hold)
PROBLEM_LINES: list[tuple[str, bytes | str, str]] = [
    ("not-json", "this is not json", "invalid JSON"),
    ("truncated-json", '{"problem": "2+2", "answer": ', "invalid JSON"),
    ("single-quotes", "{'problem': '2+2', 'answer': '4'}", "invalid JSON"),
    ("trailing-garbage", '{"problem": "2+2", "answer": "4"} x', "invalid JSON"),
    ("json-array", '["2+2", "4"]', "JSON object"),
    ("json-string", '"2+2"', "JSON object"),
    ("json-number", "42", "JSON object"),
    ("json-null", "null", "JSON object"),
    ("json-true", "true", "JSON object"),
    ("empty-object", "{}", "problem text"),
    ("missing-problem", '{"answer": "4"}', "problem text"),
    ("empty-problem", '{"problem": "", "answer": "4"}', "problem text"),
    ("blank-problem", '{"problem": "   \\n\\t", "answer": "4"}', "problem text"),
    ("problem-int", '{"problem": 22, "answer": "4"}', "problem text"),
    ("problem-list", '{"problem": ["2+2"], "answer": "4"}', "problem text"),
    ("problem-dict", '{"problem": {"text": "2+2"}, "answer": "4"}', "problem text"),
    ("problem-bool", '{"problem": true, "answer": "4"}', "problem text"),
    ("problem-null", '{"problem": null, "answer": "4"}', "problem text"),
    ("missing-answer", '{"problem": "2+2"}', "reference answer"),
    ("answer-null", '{"problem": "2+2", "answer": null}', "reference answer"),
    ("answer-empty", '{"problem": "2+2", "answer": ""}', "reference answer"),
    ("answer-blank", '{"problem": "2+2", "answer": "  "}', "reference answer"),
    ("answer-bool", '{"problem": "2+2", "answer": true}', "reference answer"),
    ("answer-list", '{"problem": "2+2", "answer": [4]}', "reference answer"),
    ("answer-dict", '{"problem": "2+2", "answer": {"v": 4}}', "reference answer"),
    ("answer-nan", '{"problem": "2+2", "answer": NaN}', "reference answer"),
    ("answer-infinity", '{"problem": "2+2", "answer": Infinity}', "reference answer"),
    ("answer-neg-infinity", '{"problem": "2+2", "answer": -Infinity}', "reference answer"),
    ("answer-huge-int", '{"problem": "2+2", "answer": ' + "9" * 5000 + "}", "digits"),
    ("answer-huge-exponent", '{"problem": "2+2", "answer": 1e999}', "reference answer"),
    ("answer-empty-math", '{"problem": "2+2", "answer": "$$"}', "reference answer"),
    ("answer-empty-box", '{"problem": "2+2", "answer": "\\\\boxed{}"}', "reference answer"),
    ("answer-unbalanced-open", '{"problem": "2+2", "answer": "\\\\frac{1}{2"}', "reference answer"),
    ("answer-unbalanced-close", '{"problem": "2+2", "answer": "x}{"}', "reference answer"),
    ("answer-dangling-frac", '{"problem": "2+2", "answer": "\\\\frac{"}', "reference answer"),
    ("ans_box-null", '{"query": "2+2", "ans_box": null}', "reference answer"),
    ("duplicate-qid", GOOD, "duplicate"),
    ("non-utf8-problem", b'{"problem": "2+2\xff\xfe", "answer": "4"}', "UTF-8"),
    ("non-utf8-answer", b'{"problem": "2+2", "answer": "\xc3\x28"}', "UTF-8"),
    ("latin1-line", '{"problem": "caf\u00e9 2+2", "answer": "4"}'.encode("latin-1"), "UTF-8"),
    ("lone-surrogate", '{"problem": "2+2 \\ud800", "answer": "4"}', "surrogate"),
    ("deep-nesting", "[" * 100_000 + "]" * 100_000, "JSON"),
    ("deep-nesting-object", '{"a":' * 50_000 + "1" + "}" * 50_000, "JSON"),
    ("huge-line", json.dumps({"problem": "x" * (3 * 2**20), "answer": "4"}), "MiB"),
    ("nul-bytes", b'{"problem": "2+2", "answer": "4"}\x00\x00\x00', "invalid JSON"),
    ("bom-mid-file", '\ufeff{"problem": "2+2", "answer": "4"}', "invalid JSON"),
    ("binary-garbage", bytes(range(256)) * 4, "line"),
]


def _problem_file(ws: Workspace, raw: bytes | str) -> Any:
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", errors="surrogatepass")
    return ws.write("data.jsonl", GOOD.encode() + b"\n" + data + b"\n")


def _load(ws: Workspace, raw: bytes | str) -> Any:
    from mars_megatron.evaluation.data import load_problems

    path = _problem_file(ws, raw)
    dataset = load_problems(path)
    for p in dataset.problems:  # what reaches the engines and results.jsonl must be clean text
        p.text.encode("utf-8")
        str(p.reference).encode("utf-8")
    return dataset


def _whole_file(ws: Workspace, data: bytes | None) -> Any:
    """``mars eval`` up to the point where it would start engines: a file with nothing to evaluate is
    refused before OUT is written."""
    path = ws.path("data.jsonl")
    if data is not None:
        ws.write("data.jsonl", data)
    return mars_main(
        "eval", "--data", path, "--model", ws.fixtures.hf_dense, "--engine", "openai", "--endpoint",
        "http://127.0.0.1:9", "--samples", "1", "--out", ws.path("out"),
    )  # fmt: skip


def _train_file(ws: Workspace, data: bytes | None) -> Any:
    """``mars train``'s checks before anything starts (``prepare``): the training file."""
    from mars_megatron.config import load_config
    from mars_megatron.pipeline.trainer import prepare

    path = ws.path("train.jsonl")
    if data is not None:
        ws.write("train.jsonl", data)
    cfg = load_config(
        None,
        [
            f"model.hf_dir={ws.fixtures.hf_dense}",
            f"data.train_file={path}",
            f"logging.run_dir={ws.path('run')}",
        ],
    )
    return prepare(cfg, nproc=None, resume=None, check_machine=False)


def _sft_file(ws: Workspace, data: bytes) -> Any:
    from mars_megatron.tasks.arith import load_arith_file

    return load_arith_file(ws.write("sft.jsonl", data))


WHOLE_FILES: list[tuple[str, bytes | None]] = [
    ("missing", None),
    ("empty", b""),
    ("blank-lines-only", b"\n\n   \n\t\n"),
    ("all-lines-bad", b"nope\n{}\n[1]\n"),
    ("binary", bytes(range(256)) * 64),
    ("utf16", GOOD.encode("utf-16")),
]


def _token_file(ws: Workspace, raw: bytes | str) -> Any:
    from mars_megatron.jobs import read_token_lines

    data = raw if isinstance(raw, bytes) else raw.encode("utf-8")
    return read_token_lines(ws.write("tokens.jsonl", b'{"tokens": [1, 2, 3]}\n' + data + b"\n"), 1024)


TOKEN_LINES: list[tuple[str, bytes | str]] = [
    ("not-json", "tokens: 1 2 3"),
    ("array", "[1, 2, 3]"),
    ("no-tokens", '{"ids": [1, 2]}'),
    ("empty", '{"tokens": []}'),
    ("null", '{"tokens": null}'),
    ("string", '{"tokens": "1 2 3"}'),
    ("negative", '{"tokens": [1, -2]}'),
    ("float", '{"tokens": [1, 2.5]}'),
    ("float-integral", '{"tokens": [1, 2.0]}'),
    ("bool", '{"tokens": [1, true]}'),
    ("string-ids", '{"tokens": ["1", "2"]}'),
    ("nested", '{"tokens": [[1, 2]]}'),
    ("out-of-vocab", '{"tokens": [1, 1024]}'),
    ("huge-id", '{"tokens": [1, ' + "9" * 400 + "]}"),
    ("nan", '{"tokens": [1, NaN]}'),
    ("non-utf8", b'{"tokens": [1, 2]} \xff'),
    ("deep-nesting", "[" * 100_000 + "]" * 100_000),
]


def _routing(ws: Workspace, arrays: Any, n_seqs: int = 1) -> Any:
    import numpy as np

    from mars_megatron.jobs import read_routing
    from mars_megatron.models.hf_config import load_hf_config

    path = ws.path("routing.npz")
    if isinstance(arrays, bytes):
        path.write_bytes(arrays)
    else:
        np.savez(path, *arrays) if isinstance(arrays, list) else np.savez(path, **arrays)
    arch = load_hf_config(ws.fixtures.hf_moe)
    seqs = [[1, 2, 3, 4]] * n_seqs
    return read_routing(path, seqs, arch)


def _routing_cases() -> list[tuple[str, Any, tuple[str, ...]]]:
    import numpy as np

    moe, topk = 2, 2  # tiny-moe: 2 MoE layers, top-2 of 4 experts
    good = np.zeros((3, moe, topk), dtype=np.int64)
    good[..., 1] = 1
    obj = np.empty((3, moe, topk), dtype=object)
    return [
        ("not-npz", b"not a zip file", ("routing.npz",)),
        ("empty-file", b"", ("routing.npz",)),
        ("object-array", [obj], ("routing.npz",)),
        ("float-array", [good.astype(np.float32)], ("routing.npz", "arr_0")),
        ("too-few-arrays", [], ("routing.npz", "arr_0")),
        ("too-many-arrays", [good, good], ("routing.npz", "arr_1")),
        ("named-arrays", {"x": good}, ("routing.npz", "arr_0")),
        ("wrong-rows", [good[:2]], ("routing.npz", "arr_0")),
        ("wrong-layers", [np.zeros((3, 3, topk), dtype=np.int64)], ("routing.npz", "arr_0")),
        ("wrong-topk", [np.zeros((3, moe, 1), dtype=np.int64)], ("routing.npz", "arr_0")),
        ("expert-out-of-range", [good + 4], ("routing.npz", "arr_0")),
        ("expert-negative", [good - 5], ("routing.npz", "arr_0")),
        ("repeated-expert", [np.zeros((3, moe, topk), dtype=np.int64)], ("routing.npz", "arr_0")),
        ("one-dimensional", [np.zeros(3, dtype=np.int64)], ("routing.npz", "arr_0")),
    ]


def _read_tokens(path: Any) -> Any:
    from mars_megatron.jobs import read_token_lines

    return read_token_lines(path)


SFT_FILES: list[tuple[str, bytes | None]] = [
    *WHOLE_FILES[1:],
    ("wrong-sum", b'{"problem": "What is 2+3?", "answer": "6"}\n'),
    ("not-a-sum", b'{"problem": "What is love?", "answer": "6"}\n'),
    ("bad-line", GOOD.encode() + b"\nnope\n"),
]


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case("data lines", name, feed, names, **kw))

    for name, raw, reason in PROBLEM_LINES:
        add(f"problems/{name}", lambda ws, r=raw: _load(ws, r), "{ws}/data.jsonl:2", reason, warning=True)
    for name, data in WHOLE_FILES:
        add(
            f"eval-file/{name}", lambda ws, d=data: _whole_file(ws, d), "{ws}/data.jsonl", needs=("hf_dense",)
        )
        add(
            f"train-file/{name}",
            lambda ws, d=data: _train_file(ws, d),
            "{ws}/train.jsonl",
            needs=("hf_dense",),
        )
    for name, data in SFT_FILES:
        add(f"sft-file/{name}", lambda ws, d=data: _sft_file(ws, d or b""), "{ws}/sft.jsonl")
    for name, raw in TOKEN_LINES:
        add(f"score-tokens/{name}", lambda ws, r=raw: _token_file(ws, r), "{ws}/tokens.jsonl:2")
    add("score-tokens/empty-file", lambda ws: _read_tokens(ws.write("t.jsonl", b"")), "{ws}/t.jsonl")
    add("score-tokens/directory", lambda ws: _read_tokens(ws.root), "{ws}")
    for name, arrays, names in _routing_cases():
        shown = tuple(f"{{ws}}/{n}" if n.endswith(".npz") else n for n in names)
        add(f"score-routing/{name}", lambda ws, a=arrays: _routing(ws, a), *shown, needs=("hf_moe",))
    return out
