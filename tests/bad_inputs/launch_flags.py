"""Launch flags: ``mars launch`` through ``mars_megatron.launch.nemo.main`` in-process (its checks,
``build_spec``, run before anything is written or started). The hostile values of every Slurm flag are
``tests/test_launch_inputs.py``'s cases (counted here, run there); the rest are this suite's own."""

from __future__ import annotations

import functools
from typing import Any

from tests.bad_inputs.harness import YAML_TAG, Case, Workspace, mars_main

CATEGORY = "launch flags"


def _launch(ws: Workspace, *args: Any, slurm: bool = True, **values: str) -> Any:
    from mars_megatron.launch import nemo
    from tests.test_launch import ALL_TRAINER, Q30B, TINY
    from tests.test_launch_inputs import argv

    if slurm:
        line = argv(ws.root, **values)
    else:
        line = [str(TINY), "--executor", "local", "--job-dir", str(ws.path("jobs")), "--dry-run"]
    line = [*line, *(a(ws) if callable(a) else str(a) for a in args)]
    assert Q30B and ALL_TRAINER
    return mars_main(*line, main=nemo.main)


def _hostile(ws: Workspace, flag: str, value: str) -> Any:
    if flag == "--job-dir":
        return _launch(ws, f"--job-dir={ws.path('jobs')}/{value}" if value else "--job-dir=")
    return _launch(ws, **{flag[2:].replace("-", "_"): value})


CONFIGS = [("missing", None), ("not-yaml", "a: [b"), ("list", "- 1"), ("tag", "!!python/name:os.system"),
           ("binary", "\x00\x01")]  # fmt: skip
OWN: list[tuple[str, tuple[Any, ...], bool, tuple[str, ...]]] = [
    ("nodes-zero", ("--nodes", "0"), True, ("--nodes",)),
    ("nodes-negative", ("--nodes", "-2"), True, ("--nodes",)),
    ("nodes-text", ("--nodes", "two"), True, ("--nodes",)),
    ("gpus-per-node-negative", ("--gpus-per-node", "-8"), True, ("--gpus-per-node",)),
    ("gpus-per-node-layout", ("--gpus-per-node", "3"), True, ("--gpus-per-node",)),
    ("cpus-per-node-zero", ("--cpus-per-node", "0"), True, ("--cpus-per-node",)),
    ("env-no-equals", ("--env", "NOTE"), True, ("--env",)),
    ("env-bad-key", ("--env", "1X=y"), True, ("--env",)),
    ("env-empty-key", ("--env", "=y"), True, ("--env",)),
    ("env-shell-key", ("--env", "A;touch PWNED=1"), True, ("--env",)),
    ("env-subst-key", ("--env", "X$(touch PWNED)=1"), True, ("--env",)),
    ("executor-unknown", ("--executor", "k8s"), True, ("--executor",)),
    ("override-unknown-key", ("parallel.tpp=2",), True, ("parallel.tpp",)),
    ("override-nan", ("optimizer.lr=.nan",), True, ("optimizer.lr",)),
    ("override-yaml-tag", (f"train.steps={YAML_TAG}",), True, ("train.steps",)),
    ("override-malformed", ("=5",), True, ("=5",)),
    ("local-with-account", ("--account", "acct"), False, ("--account",)),
    ("local-with-image", ("--container-image", "nvcr.io/x"), False, ("--container-image",)),
    ("local-two-nodes", ("--nodes", "2"), False, ("--nodes",)),
    ("local-gpus-layout", ("--gpus-per-node", "3"), False, ("parallel",)),
    ("local-job-dir-empty", ("--job-dir=",), False, ("--job-dir",)),
]  # fmt: skip


def _config(ws: Workspace, text: str | None) -> Any:
    from mars_megatron.launch import nemo

    path = ws.path("c.yaml")
    if text is not None:
        ws.write("c.yaml", text)
    return mars_main(path, "--executor", "local", "--job-dir", ws.path("jobs"), "--dry-run", main=nemo.main)


def cases() -> list[Case]:
    from tests.test_launch_inputs import CASES

    out = []
    for flag, value in CASES:
        feed = functools.partial(_hostile, flag=flag, value=value)
        name = f"hostile/{flag}={value!r}"
        out.append(Case(CATEGORY, name, feed, (flag,), covered_by="tests/test_launch_inputs.py"))
    for name, args, slurm, names in OWN:
        out.append(Case(CATEGORY, name, lambda ws, a=args, s=slurm: _launch(ws, *a, slurm=s), names))
    for name, text in CONFIGS:
        out.append(Case(CATEGORY, f"config-{name}", lambda ws, t=text: _config(ws, t), ("{ws}/c.yaml",)))
    return out
