"""Configs: ``mars train``/``mars config``/``mars launch`` YAML files and ``dotted.key=value`` overrides,
through ``load_config`` (every field: wrong types, bools for ints, lists, NaN/inf, negative and absurd
values, unknown keys), whole files (YAML tags that would run code, non-mapping documents, binary garbage,
deep nesting, aliases), and ``mars train``'s checks before anything starts (``prepare``: model and data
paths, a run directory that already holds a run, which must stay untouched)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tests.bad_inputs.harness import YAML_TAG, Case, Workspace, mars

CATEGORY = "configs"
INT_FIELDS = (
    "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "train.steps", "train.pack_length",
    "train.updates_per_batch", "train.seed", "data.problems_per_step", "agents.group_size",
    "agents.inputs_per_agent", "agents.max_steps", "rollout.max_response_tokens",
    "rollout.max_input_tokens", "rollout.max_batch", "rollout.tp", "checkpoint.keep_last",
    "model.vocab_pad_multiple",
)  # fmt: skip
FLOAT_FIELDS = (
    "optimizer.lr", "optimizer.weight_decay", "optimizer.adam_beta1", "optimizer.adam_beta2",
    "optimizer.adam_eps", "optimizer.clip_grad", "rollout.temperature", "rollout.top_p", "algorithm.clip_low",
    "algorithm.clip_high", "algorithm.kl_coef",
)  # fmt: skip
CHOICE_FIELDS = ("model.dtype", "rollout.engine", "agents.strategy", "algorithm.reward", "pipeline.mode")
INT_VALUES = {"string": "'two'", "float": "2.5", "bool": "true", "list": "[2]", "map": "{a: 1}",
              "negative": "-3", "absurd": str(10**30), "huge-digits": "9" * 5000, "nan": ".nan"}  # fmt: skip
FLOAT_VALUES = {"string": "'fast'", "bool": "false", "list": "[0.1]", "nan": ".nan", "inf": ".inf",
                "minus-inf": "-.inf", "negative": "-1.0", "absurd": "1e300"}  # fmt: skip


def _load(ws: Workspace, text: str | bytes | None = None, *overrides: str) -> Any:
    from mars_megatron.config import load_config

    path = None
    if text is not None:
        path = ws.write("c.yaml", text)
    return load_config(path, list(overrides))


def _override(ws: Workspace, text: str) -> Any:
    from mars_megatron.config import load_config

    return load_config(None, [text])


def _prepare(ws: Workspace, *overrides: Any, resume: str | None = None) -> Any:
    from mars_megatron.config import load_config
    from mars_megatron.pipeline.trainer import prepare

    base = [f"model.hf_dir={ws.fixtures.hf_dense}", f"data.train_file={ws.fixtures.eval_data}",
            f"logging.run_dir={ws.path('run')}"]  # fmt: skip
    cfg = load_config(None, [*base, *(o(ws) if callable(o) else o for o in overrides)])
    return prepare(cfg, nproc=None, resume=resume, check_machine=False)


def _earlier_run(ws: Workspace) -> None:
    run = ws.path("run")
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("train:\n  steps: 5\n")


FILES: list[tuple[str, str | bytes, tuple[str, ...]]] = [
    ("yaml-python-object", f"train: {YAML_TAG}\n", ("c.yaml",)),
    ("yaml-python-name", "train:\n  steps: !!python/name:os.system\n", ("c.yaml",)),
    ("yaml-python-module", "x: !!python/module:os\n", ("c.yaml",)),
    ("yaml-custom-tag", "train: !evil {steps: 1}\n", ("c.yaml",)),
    ("yaml-binary-tag", "train:\n  steps: !!binary aGVsbG8=\n", ("c.yaml", "train.steps")),
    ("yaml-timestamp", "train:\n  steps: 2024-01-01\n", ("c.yaml", "train.steps")),
    ("yaml-set", "train:\n  steps: !!set {1, 2}\n", ("c.yaml", "train.steps")),
    ("list-document", "- train\n- steps\n", ("c.yaml",)),
    ("scalar-document", "hello\n", ("c.yaml",)),
    ("number-document", "42\n", ("c.yaml",)),
    ("two-documents", "train: {}\n---\ntrain: {}\n", ("c.yaml",)),
    ("not-yaml", "train: [steps\n", ("c.yaml",)),
    ("tabs", "train:\n\tsteps: 2\n", ("c.yaml",)),
    ("binary", bytes(range(256)) * 4, ("c.yaml",)),
    ("latin1", "logging:\n  run_dir: caf\u00e9\n".encode("latin-1"), ("c.yaml",)),
    ("utf16", "train: {}\n".encode("utf-16"), ("c.yaml",)),
    ("deep-nesting", "a: " + "[" * 50_000 + "]" * 50_000 + "\n", ("c.yaml",)),
    ("deep-mapping", "".join("  " * i + f"k{i}:\n" for i in range(3000)), ("c.yaml",)),
    ("alias-bomb", "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n", ("c.yaml",)),
    ("duplicate-key", "train:\n  steps: 2\n  steps: 3\n", ("c.yaml", "steps")),
    ("unknown-section", "trian:\n  steps: 2\n", ("c.yaml", "trian")),
    ("unknown-key", "train:\n  stpes: 2\n", ("c.yaml", "train.stpes")),
    ("section-scalar", "train: 5\n", ("c.yaml", "train")),
    ("section-list", "train: [1]\n", ("c.yaml", "train")),
    ("key-int", "train:\n  1: 2\n", ("c.yaml", "train")),
    ("key-null", "train:\n  ~: 2\n", ("c.yaml", "train")),
    ("nul-byte", "train:\n  steps: 2\x00\n", ("c.yaml",)),
]  # fmt: skip
OVERRIDES: list[tuple[str, str, tuple[str, ...]]] = [
    ("no-equals", "train.steps", ("train.steps",)),
    ("empty-key", "=5", ("=5",)),
    ("empty-part", "train..steps=5", ("train..steps",)),
    ("trailing-dot", "train.=5", ("train.",)),
    ("unknown-key", "train.stpes=5", ("train.stpes",)),
    ("unknown-section", "trian.steps=5", ("trian",)),
    ("section-scalar", "train=5", ("train",)),
    ("too-deep", "train.steps.x=5", ("train.steps",)),
    ("empty-value", "train.steps=", ("train.steps",)),
    ("yaml-tag", f"train.steps={YAML_TAG}", ("train.steps",)),
    ("bad-yaml", "train.steps=[1", ("train.steps",)),
    ("shell", "logging.run_dir=$(touch PWNED)", ()),
]


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case(CATEGORY, name, feed, names, **kw))

    for field in INT_FIELDS:
        for label, value in INT_VALUES.items():
            add(f"int/{field}={label}", functools.partial(_override, text=f"{field}={value}"), field)
            if label in ("string", "bool", "nan"):
                section, key = field.split(".")
                text = f"{section}:\n  {key}: {value}\n"
                add(f"file-int/{field}={label}", lambda ws, t=text: _load(ws, t), "{ws}/c.yaml", field)
    for field in FLOAT_FIELDS:
        for label, value in FLOAT_VALUES.items():
            add(f"float/{field}={label}", functools.partial(_override, text=f"{field}={value}"), field)
    for field in CHOICE_FIELDS:
        for label, value in (("unknown", "evil"), ("int", "3"), ("list", "[a]"), ("null", "null")):
            add(f"choice/{field}={label}", functools.partial(_override, text=f"{field}={value}"), field)
    for name, text, names in FILES:
        add(
            f"file/{name}",
            lambda ws, t=text: _load(ws, t),
            *("{ws}/" + n if n == "c.yaml" else n for n in names),
        )
    add("file/missing", lambda ws: _load_path(ws, ws.path("none.yaml")), "{ws}/none.yaml")
    add("file/directory", lambda ws: _load_path(ws, ws.root), "{ws}")
    for name, text, names in OVERRIDES:
        if name == "shell":  # a path with shell text is just a name: accepted, and nothing runs
            continue
        add(f"override/{name}", functools.partial(_override, text=text), *names)
    add("train/model-missing", lambda ws: _prepare(ws, f"model.hf_dir={ws.path('nomodel')}"), "model.hf_dir")
    add("train/model-not-a-model", lambda ws: _prepare(ws, f"model.hf_dir={ws.root}"), "{ws}")
    add(
        "train/data-missing",
        lambda ws: _prepare(ws, f"data.train_file={ws.path('d.jsonl')}"),
        "data.train_file",
    )
    add("train/layout-not-dividing", lambda ws: _prepare(ws, "parallel.tp=3"), "parallel")
    add("train/run-dir-holds-run", lambda ws: (_earlier_run(ws), _prepare(ws))[1], "{ws}/run", "--resume",
        preserve=("run",))  # fmt: skip
    add("train/resume-without-save-dir", functools.partial(_resume, save_dir=False), "checkpoint.save_dir",
        preserve=("run",))  # fmt: skip
    add(
        "train/resume-missing-checkpoint",
        functools.partial(_resume, save_dir=True),
        "step_9",
        preserve=("run",),
    )
    out = [dataclasses.replace(c, needs=("hf_dense",) if c.name.startswith("train/") else ()) for c in out]
    tag = FILES[0][1]
    out.append(Case(CATEGORY, "cli/config-yaml-tag", lambda ws: mars("config", ws.write("c.yaml", tag)),
                    ("c.yaml",), cli=True))  # fmt: skip
    unknown = "trian: {}"
    out.append(Case(CATEGORY, "cli/train-unknown-key", lambda ws: mars("train", ws.write("c.yaml", unknown)),
                    ("trian",), cli=True))  # fmt: skip
    return out


def _resume(ws: Workspace, save_dir: bool) -> Any:
    """``--resume`` over a run directory that holds a run: refused, and the run is left as it was."""
    _earlier_run(ws)
    if save_dir:
        return _prepare(ws, f"checkpoint.save_dir={ws.path('ck')}", resume="step_9")
    return _prepare(ws, resume="latest")


def _load_path(ws: Workspace, path: Any) -> Any:
    from mars_megatron.config import load_config

    return load_config(path, [])
