"""Reward functions of the user's: the spec (``algorithm.reward_functions``, ``algorithm.reward_timeout_s``,
a graph file's ``reward: {function, timeout_s}``) and the function it names, refused before anything
starts with an error naming the field and the function. The function is imported in a process of its own
(``check_function``), so a module that fails, exits or runs code while importing neither takes ``mars``
with it nor runs in it: a canary written at import time must not appear in the checking process's folder
(it does appear in the subprocess's: that is the user's own code, run as the docs say)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tests.bad_inputs.harness import Case, Workspace

REPO = Path(__file__).resolve().parents[2]
SUMS = REPO / "examples" / "rewards" / "sums.py"
MARSRL = REPO / "mars_megatron" / "agents" / "graphs" / "marsrl"


def _config(*overrides: str) -> Any:
    from mars_megatron.agents.graph_file import graph_for
    from mars_megatron.config import load_config
    from mars_megatron.rewards.functions import check_graph_functions

    check_graph_functions(graph_for(load_config(None, list(overrides))))


def _module(ws: Workspace, text: str) -> Path:
    return ws.write("my_reward.py", text)


def _function(ws: Workspace, text: str, name: str = "score") -> Any:
    return _config(f"algorithm.reward_functions.solver={_module(ws, text)}:{name}")


def _graph(ws: Workspace, reward: str) -> Any:
    """The shipped MarsRL graph with the Solver's reward replaced by ``reward`` (YAML text)."""
    folder = ws.path("graph")
    shutil.copytree(MARSRL, folder)
    path = folder / "graph.yaml"
    text = path.read_text().replace("reward: answer        #", f"reward: {reward}  #", 1)
    path.write_text(text)
    return _config(f"agents.graph={path}")


MODULES: list[tuple[str, str, str, tuple[str, ...]]] = [
    # (name, module text, function name, what the error names beside the field)
    ("syntax-error", "def score(request)\n    return 1\n", "score", ("SyntaxError",)),
    ("import-raises", "raise RuntimeError('no GPU here')\n", "score", ("RuntimeError", "no GPU here")),
    ("import-exits", "import sys\nsys.exit(3)\n", "score", ("my_reward.py",)),
    (
        "missing-import",
        "import no_such_module_xyz\ndef score(r):\n    return 1\n",
        "score",
        ("no_such_module_xyz",),
    ),
    ("no-such-function", "def other(request):\n    return 1\n", "score", ("has no attribute 'score'",)),
    ("not-callable", "score = 3\n", "score", ("not a function",)),
    ("no-argument", "def score():\n    return 1\n", "score", ("one argument",)),
    ("two-arguments", "def score(a, b):\n    return 1\n", "score", ("one argument",)),
    ("a-class", "class score:\n    pass\n", "score", ("one argument",)),
]

SPECS: list[tuple[str, str, tuple[str, ...]]] = [
    ("no-colon", "examples/rewards/sums.py", ("package.module:function",)),
    ("two-colons", "a:b:c", ("package.module:function",)),
    ("bad-name", "pkg.mod:not-a-name", ("not a Python name",)),
    ("empty-name", "pkg.mod:", ("expected str",)),  # YAML reads it as a mapping
    ("path-traversal", "../../etc/passwd:x", ("neither a module path",)),
    ("absolute-non-py", "/etc/passwd:x", ("neither a module path",)),
    ("missing-file", "nowhere/missing.py:score", ("missing.py", "not found")),
    ("missing-module", "no_such_pkg_xyz.rewards:score", ("no_such_pkg_xyz",)),
    ("builtin-no-arg", "os:getcwd", ("one argument",)),
    ("empty", "''", ("package.module:function",)),
    ("shell-text", "'x; touch PWNED:score'", ("neither a module path",)),
]


def cases() -> list[Case]:
    out: list[Case] = []

    def add(name: str, feed: Any, *names: str, **kw: Any) -> None:
        out.append(Case("reward functions", name, feed, names, **kw))

    for name, text, function, names in MODULES:
        add(f"module/{name}", lambda ws, t=text, f=function: _function(ws, t, f),
            "algorithm.reward_functions.solver", *names)  # fmt: skip
    for name, spec, names in SPECS:
        add(f"spec/{name}", lambda ws, s=spec: _config(f"algorithm.reward_functions.solver={s}"),
            "algorithm.reward_functions.solver", *names)  # fmt: skip
    add("spec/unknown-role", lambda ws: _config(f"algorithm.reward_functions.judge={SUMS}:score"),
        "algorithm.reward_functions.judge", "judge")  # fmt: skip
    add("spec/not-a-mapping", lambda ws: _config(f"algorithm.reward_functions={SUMS}:score"),
        "algorithm.reward_functions")  # fmt: skip
    add("spec/not-a-string", lambda ws: _config("algorithm.reward_functions.solver=3"),
        "algorithm.reward_functions.solver")  # fmt: skip
    for name, value in (
        ("zero", "0"),
        ("negative", "-1"),
        ("huge", "1e9"),
        ("nan", ".nan"),
        ("text", "soon"),
    ):
        add(f"timeout/{name}", lambda ws, v=value: _config(f"algorithm.reward_timeout_s={v}"),
            "algorithm.reward_timeout_s")  # fmt: skip
    for name, reward, names in [
        ("unknown-key", "{function: 'pkg.mod:score', retries: 3}", ("roles.solver.reward", "retries")),
        ("no-function", "{timeout_s: 3}", ("roles.solver.reward", "needs function")),
        ("bad-timeout", "{function: 'pkg.mod:score', timeout_s: 0}", ("roles.solver.reward.timeout_s",)),
        ("list", "[answer]", ("roles.solver.reward",)),
        ("unknown-kind", "score", ("roles.solver.reward", "score")),
        ("the-word-function", "function", ("roles.solver.reward", "function")),
        (
            "file-beside-missing",
            "{function: 'rewards/missing.py:score'}",
            ("roles.solver.reward.function", "not found"),
        ),
        ("module-missing", "{function: 'no_such_pkg_xyz:score'}", ("roles.solver.reward", "no_such_pkg_xyz")),
    ]:
        add(f"graph/{name}", lambda ws, r=reward: _graph(ws, r), *names)
    return out
