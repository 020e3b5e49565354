"""Eval flags: ``mars eval`` through its real entry (``mars_megatron.cli.main`` in-process; a few through
the ``mars`` command). Every flag is checked before OUT is written; an OUT that holds results is never
changed by a refused run (``preserve``)."""

from __future__ import annotations

import json
from typing import Any

from tests.bad_inputs.harness import YAML_TAG, Case, Workspace, mars, mars_main

CATEGORY = "eval flags"


def _argv(ws: Workspace, **flags: Any) -> list[str]:
    """A good command line (one problem, the tiny model, 4 tokens), ``flags`` replacing or removing
    (``None``) flags; keys are flag names without dashes, '_' for '-'."""
    base: dict[str, Any] = {
        "data": ws.fixtures.eval_data,
        "model": ws.fixtures.hf_dense,
        "engine": "transformers",
        "samples": "1",
        "out": ws.path("out"),
        "max-tokens": "4",
    }
    for key, value in flags.items():
        base[key.replace("_", "-")] = value
    argv = ["eval"]
    for key, value in base.items():
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            argv += [f"--{key}"] if v is True else [f"--{key}", str(v)]
    return argv


def _eval(ws: Workspace, setup: Any = None, **flags: Any) -> Any:
    if setup is not None:
        setup(ws)
    return mars_main(*_argv(ws, **{k: (v(ws) if callable(v) else v) for k, v in flags.items()}))


def _filled_out(ws: Workspace) -> None:
    """OUT of an earlier evaluation: results and the config that produced them."""
    out = ws.path("out")
    out.mkdir()
    (out / "results.jsonl").write_text(
        json.dumps({"problem_id": "p1", "sample": 0, "system_correct": True}) + "\n"
    )
    (out / "config.json").write_text(json.dumps({"samples": 7, "engine": "transformers"}))


def _garbage_config(ws: Workspace) -> None:
    _filled_out(ws)
    (ws.path("out") / "config.json").write_bytes(b"\xff\x00 not json")


def _no_config(ws: Workspace) -> None:
    _filled_out(ws)
    (ws.path("out") / "config.json").unlink()


def _file(name: str, data: bytes) -> Any:
    return lambda ws: ws.write(name, data)


def _dir(name: str) -> Any:
    def make(ws: Workspace) -> Any:
        ws.path(name).mkdir()
        return ws.path(name)

    return make


OPENAI = {"engine": "openai", "endpoint": "http://127.0.0.1:9"}
# (name, flags, names the error must hold)
FLAG_CASES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("samples-zero", {"samples": "0"}, ("--samples",)),
    ("samples-negative", {"samples": "-3"}, ("--samples",)),
    ("samples-text", {"samples": "many"}, ("--samples",)),
    ("samples-float", {"samples": "1.5"}, ("--samples",)),
    ("samples-absurd", {"samples": str(10**12)}, ("--samples",)),
    ("limit-negative", {"limit": "-1"}, ("--limit",)),
    ("limit-text", {"limit": "all"}, ("--limit",)),
    ("max-tokens-zero", {"max_tokens": "0"}, ("--max-tokens",)),
    ("max-tokens-negative", {"max_tokens": "-5"}, ("--max-tokens",)),
    ("max-tokens-absurd", {"max_tokens": str(10**15)}, ("--max-tokens",)),
    ("max-tokens-text", {"max_tokens": "lots"}, ("--max-tokens",)),
    ("temperature-nan", {"temperature": "nan"}, ("--temperature",)),
    ("temperature-inf", {"temperature": "inf"}, ("--temperature",)),
    ("temperature-negative", {"temperature": "-0.5"}, ("--temperature",)),
    ("temperature-absurd", {"temperature": "1e300"}, ("--temperature",)),
    ("temperature-text", {"temperature": "hot"}, ("--temperature",)),
    ("top-p-zero", {"top_p": "0"}, ("--top-p",)),
    ("top-p-over-one", {"top_p": "1.5"}, ("--top-p",)),
    ("top-p-nan", {"top_p": "nan"}, ("--top-p",)),
    ("top-k-zero", {"top_k": "0"}, ("--top-k",)),
    ("top-k-minus-two", {"top_k": "-2"}, ("--top-k",)),
    ("seed-negative", {"seed": "-1"}, ("--seed",)),
    ("seed-huge", {"seed": str(2**40)}, ("--seed",)),
    ("max-iterations-zero", {"max_iterations": "0"}, ("--max-iterations",)),
    ("accept-after-zero", {"accept_after": "0"}, ("--accept-after",)),
    ("give-up-after-zero", {"give_up_after": "0"}, ("--give-up-after",)),
    ("start-retries-negative", {"start_retries": "-1"}, ("--start-retries",)),
    ("max-input-tokens-zero", {"max_input_tokens": "0"}, ("--max-input-tokens",)),
    ("max-input-tokens-one", {"max_input_tokens": "1"}, ("--max-input-tokens",)),
    ("max-input-tokens-absurd", {"max_input_tokens": str(10**15)}, ("--max-input-tokens",)),
    ("max-concurrent-zero", {"max_concurrent": "0"}, ("--max-concurrent",)),
    ("checker-workers-zero", {"checker_workers": "0"}, ("--checker-workers",)),
    ("checker-workers-absurd", {"checker_workers": "100000"}, ("--checker-workers",)),
    ("engine-unknown", {"engine": "tensorrt"}, ("--engine",)),
    ("dtype-unknown", {"dtype": "int4"}, ("--dtype",)),
    ("prompts-unknown", {"prompts": "evil"}, ("--prompts",)),
    ("data-missing", {"data": lambda ws: ws.path("nope.jsonl")}, ("--data", "nope.jsonl")),
    ("data-directory", {"data": lambda ws: ws.root}, ("--data",)),
    ("data-flag-missing", {"data": None}, ("--data",)),
    ("model-missing", {"model": lambda ws: ws.path("nomodel")}, ("--model", "nomodel")),
    ("model-is-file", {"model": lambda ws: ws.fixtures.eval_data}, ("--model",)),
    ("model-empty-dir", {"model": _dir("empty")}, ("--model", "empty")),
    ("model-and-checkpoint", {"checkpoint": lambda ws: ws.root}, ("--checkpoint",)),
    ("no-model", {"model": None}, ("--model", "--checkpoint")),
    ("checkpoint-missing", {"model": None, "checkpoint": lambda ws: ws.path("ck")}, ("--checkpoint", "ck")),
    ("checkpoint-empty-dir", {"model": None, "checkpoint": _dir("c")}, ("--checkpoint",)),
    ("policy-unknown-role", {"policy": "judge=/tmp"}, ("--policy", "judge")),
    ("policy-no-equals", {"policy": "solver"}, ("--policy", "solver")),
    ("policy-empty-dir", {"policy": "solver="}, ("--policy",)),
    ("policy-not-a-model", {"policy": lambda ws: f"verifier={ws.root}"}, ("--policy", "verifier")),
    ("openai-no-endpoint", {"engine": "openai"}, ("--endpoint",)),
    ("endpoint-file-scheme", {"engine": "openai", "endpoint": "file:///etc/passwd"}, ("--endpoint", "file")),
    ("endpoint-ftp", {"engine": "openai", "endpoint": "ftp://127.0.0.1/"}, ("--endpoint", "ftp")),
    ("endpoint-no-scheme", {"engine": "openai", "endpoint": "127.0.0.1:8000"}, ("--endpoint",)),
    ("endpoint-no-host", {"engine": "openai", "endpoint": "http://"}, ("--endpoint",)),
    ("endpoint-bad-port", {"engine": "openai", "endpoint": "http://127.0.0.1:99999"}, ("--endpoint",)),
    ("endpoint-credentials", {**OPENAI, "endpoint": "http://user:pw@127.0.0.1:8000"}, ("--endpoint",)),
    ("endpoint-shell", {**OPENAI, "endpoint": "http://127.0.0.1:8000/;touch PWNED"}, ("--endpoint",)),
    ("served-model-two-plain", {**OPENAI, "served_model": ["a", "b"]}, ("--served-model",)),
    ("served-model-bad-role", {**OPENAI, "served_model": "judge=x"}, ("--served-model",)),
    ("config-missing", {"config": lambda ws: ws.path("run/config.yaml")}, ("--config", "config.yaml")),
    ("config-yaml-tag", {"config": lambda ws: ws.write("c.yaml", YAML_TAG)}, ("c.yaml",)),
    ("config-garbage", {"config": lambda ws: ws.write("c.yaml", b"\x00\xff\xfe")}, ("c.yaml",)),
    ("config-list", {"config": lambda ws: ws.write("c.yaml", "- 1\n- 2\n")}, ("c.yaml",)),
    ("config-unknown-key", {"config": lambda ws: ws.write("c.yaml", "agents:\n  promts: compact\n")},
     ("c.yaml", "agents.promts")),
    ("out-is-file", {"out": lambda ws: ws.write("outfile", "x")}, ("--out", "outfile")),
    ("out-parent-is-file", {"out": lambda ws: ws.write("f", "x") / "sub"}, ("--out",)),
]  # fmt: skip


def cases() -> list[Case]:
    out: list[Case] = []
    for name, flags, names in FLAG_CASES:
        out.append(Case(CATEGORY, name, lambda ws, f=flags: _eval(ws, **f), names, needs=("hf_dense",)))
    for name, setup, flags, names in [
        ("out-not-empty", _filled_out, {}, ("--out", "not empty")),
        ("resume-other-settings", _filled_out, {"resume": True}, ("--resume", "config.json", "samples")),
        ("resume-garbage-config", _garbage_config, {"resume": True}, ("--resume", "config.json")),
        ("resume-no-config", _no_config, {"resume": True}, ("--resume", "config.json")),
        ("resume-bad-flag", _filled_out, {"resume": True, "samples": "0"}, ("--samples",)),
        ("out-not-empty-bad-data", _filled_out, {"data": lambda ws: ws.write("d.jsonl", "{}")}, ("d.jsonl",)),
    ]:  # fmt: skip
        out.append(Case(CATEGORY, name, lambda ws, s=setup, f=flags: _eval(ws, s, **f), names,
                        preserve=("out",), needs=("hf_dense",)))  # fmt: skip
    # the real command, a few times (each start imports torch: seconds)
    out.append(Case(CATEGORY, "cli/samples-zero", lambda ws: mars(*_argv(ws, samples="0")), ("--samples",),
                    cli=True, needs=("hf_dense",)))  # fmt: skip
    out.append(Case(CATEGORY, "cli/out-not-empty", lambda ws: (_filled_out(ws), mars(*_argv(ws)))[1],
                    ("--out",), preserve=("out",), cli=True, needs=("hf_dense",)))  # fmt: skip
    out.append(Case(CATEGORY, "cli/data-all-bad", lambda ws: mars(*_argv(ws, data=ws.write("d.jsonl", "[]"))),
                    ("d.jsonl",), cli=True, needs=("hf_dense",)))  # fmt: skip
    return out
