"""Reward functions of the user's, run as the reward workers run them: in spawned processes with a hard
timeout; every way a function can fail scores 0, is counted by reason and leaves the next output scored.
Also the spec in the graph file and the config, the request a function receives, and the shipped examples
(the subset-sum checker, a code task's unit tests in a sandbox)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mars_megatron.agents.graph import GraphError, RewardFunction
from mars_megatron.agents.graph_file import graph_for, reward_function
from mars_megatron.agents.sample import Sample
from mars_megatron.config import load_config
from mars_megatron.evaluation.data import Problem
from mars_megatron.rewards.functions import (
    FunctionPool,
    FunctionPools,
    RewardRequest,
    check_function,
    check_graph_functions,
)
from mars_megatron.rewards.metrics import role_metrics
from mars_megatron.rewards.scoring import RewardWorker, ScoreRequest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "rewards"

FUNCTIONS = """
import math, os, time
from mars_megatron.rewards.functions import RewardResult

def good(request):
    return 0.75

def raises(request):
    raise KeyError("no such column")

def hangs(request):
    time.sleep(600)

def nan(request):
    return math.nan

def text(request):
    return "yes"

def exits(request):
    os._exit(3)

def rich(request):
    return RewardResult(1.0, verdict=False, details={"length": float(len(request.response))})

def echo(request):
    seen = (request.problem, request.reference, request.response, request.role, dict(request.extra),
            request.judged_solution, request.judged_right)
    return RewardResult(float(seen == EXPECTED), details={"matched": float(seen == EXPECTED)})

EXPECTED = ("What is 2+3?", "5", "I think \\\\boxed{5}", "verifier", {"source": "aime"}, "so \\\\boxed{6}",
            False)
"""


@pytest.fixture(scope="module")
def functions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fns") / "my_rewards.py"
    path.write_text(FUNCTIONS)
    return path


def _request(response: str = "r") -> RewardRequest:
    return RewardRequest("p", "1", response, "solver")


def test_every_failure_scores_zero_is_counted_and_the_next_output_is_scored(functions: Path) -> None:
    outcomes = {}
    pools = FunctionPools()
    try:
        for name in ("good", "raises", "nan", "text", "exits", "rich", "hangs"):
            pool = pools.get(f"{functions}:{name}", 1.0)
            start = time.monotonic()
            outcomes[name] = (pool.score([_request("abc")])[0], time.monotonic() - start)
            if name in ("exits", "hangs"):  # the process was replaced: the next output is scored
                assert pool.score([_request()])[0].reason == ("crashed" if name == "exits" else "timeout")
        reasons = {name: o.reason for name, (o, _) in outcomes.items()}
        assert reasons == {"good": None, "raises": "error", "nan": "nan", "text": "bad_type",
                           "exits": "crashed", "rich": None, "hangs": "timeout"}  # fmt: skip
        assert outcomes["good"][0].score == 0.75
        assert all(o.score == 0.0 for o, _ in outcomes.values() if o.reason)
        assert (
            "KeyError" in outcomes["raises"][0].message and "no such column" in outcomes["raises"][0].message
        )
        rich = outcomes["rich"][0]
        assert (rich.score, rich.verdict, rich.details) == (1.0, False, {"length": 3.0})
        assert 1.0 <= outcomes["hangs"][1] < 5.0  # killed at its timeout, not after the sleep
        assert pools.get(f"{functions}:hangs", 1.0).counts["timeout"] == 2
    finally:
        pools.close()


def test_a_function_that_cannot_load_scores_zero_without_retrying(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def score(request)\n    return 1\n")
    assert "SyntaxError" in (check_function(f"{broken}:score") or "")
    assert "has no attribute 'nope'" in (check_function(f"{EXAMPLES / 'sums.py'}:nope") or "")
    assert "No module named 'no_such_pkg'" in (check_function("no_such_pkg.rewards:score") or "")
    assert "must take one argument" in (check_function("os:getcwd") or "")
    pool = FunctionPool(f"{broken}:score", 5.0)
    try:
        first, second = pool.score([_request(), _request()])
        assert first.reason == second.reason == "load_error" and "SyntaxError" in first.message
        assert pool.counts["load_error"] == 2
    finally:
        pool.close()


def test_the_request_carries_problem_extra_columns_and_the_judged_solution(functions: Path) -> None:
    """The one conversion of a record (ScoreRequest.of), through the real RewardWorker's scoring."""
    graph = graph_for(load_config(None, [f"algorithm.reward_functions.verifier={functions}:echo"]))
    role = graph.roles["verifier"]
    assert role.reward == "function" and role.function == RewardFunction(
        f"{functions}:echo", 10.0, "algorithm.reward_functions.verifier"
    )
    text = "I think \\boxed{5}"
    sample = Sample(np.array([1]), np.array([2]), "verifier1", "p1", sample_id="s1", text=text,
                    judged_id="s0", judged_right=False, role="verifier")  # fmt: skip
    problem = Problem("p1", "What is 2+3?", "5", 1, {"source": "aime"})
    request = ScoreRequest.of(sample, role, problem, "so \\boxed{6}")
    worker = RewardWorker()
    try:
        ((sid, reward, verdict, info),) = worker.score([request])
    finally:
        worker.checker.close()
        worker.functions.close()
    # the verdict is read from the text when the function gives none (here: no verdict section: None)
    assert (sid, reward, verdict, info) == ("s1", 1.0, None, {"matched": 1.0})


def test_failures_and_details_reach_the_per_role_metrics() -> None:
    graph = graph_for(load_config(None, []))
    samples = []
    for i, info in enumerate([{"fail/timeout": 1.0}, {"length": 4.0}, {"length": 2.0}, {}]):
        q = Sample(
            np.array([1]), np.array([2]), "solver", f"p{i}", sample_id=f"s{i}", role="solver", reward=0.0
        )
        q.reward_info = info
        samples.append(q)
    out = role_metrics(samples, graph)
    assert out["reward_fn/solver/timeout"] == 1.0 and out["reward_fn/solver/length"] == 3.0


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ({"function": "no colon"}, "expected 'package.module:function'"),
        ({"function": "a:b:c"}, "expected 'package.module:function'"),
        ({"function": "pkg.mod:not-a-name"}, "is not a Python name"),
        ({"function": "../../etc/passwd:x"}, "neither a module path"),
        ({"function": "missing.py:score"}, "not found"),
        ({"function": "pkg.mod:score", "timeout_s": 0}, "timeout_s must be"),
        ({"function": "pkg.mod:score", "timeout_s": "10"}, "timeout_s must be"),
        ({"function": "pkg.mod:score", "timeout_s": 10**9}, "timeout_s must be"),
        ({"function": "pkg.mod:score", "retries": 3}, "retries"),
        ({"timeout_s": 3}, "needs function"),
    ],
)
def test_bad_reward_specs_name_the_field(spec: dict[str, Any], why: str, tmp_path: Path) -> None:
    with pytest.raises(GraphError, match=why) as err:
        reward_function(spec, "roles.solver.reward", tmp_path / "graph.yaml", tmp_path)
    assert "roles.solver.reward" in str(err.value)


def test_a_config_naming_a_function_that_cannot_load_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, [f"algorithm.reward_functions.solver={EXAMPLES / 'sums.py'}:scor"])
    with pytest.raises(
        ValueError, match=r"algorithm.reward_functions.solver: reward function .*sums.py:scor"
    ):
        check_graph_functions(graph_for(cfg))


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sums_and_subset_sum_examples() -> None:
    sums = _example("sums").score
    assert sums(RewardRequest("Find 4+9.", 13, "so \\boxed{13}", "solver")) == 1.0
    assert sums(RewardRequest("Find 4+9.", 13, "so \\boxed{12}", "solver")) == 0.0
    assert sums(RewardRequest("Find 4+9.", 13, "so \\boxed{thirteen}", "solver")) == 0.0
    subset = _example("subset_sum").score
    reference = "subset_sum: 1 3 4 6 8 = 13"
    for answer, right in (("4+9", False), ("1+4+8", True), ("3, 4, 6", True), ("8 + 4 + 1", True),
                          ("6+6+1", False), ("13", False)):  # fmt: skip
        result = subset(RewardRequest("p", reference, f"\\boxed{{{answer}}}", "solver"))
        assert result.score == float(right), answer
    assert subset(RewardRequest("p", reference, "no box", "solver")).details["no_answer"] == 1.0


def test_the_code_example_runs_tests_with_limits_and_no_network() -> None:
    code = _example("code_tests")
    if code.network_jail() is None:
        pytest.skip("no network namespace can be made here")
    code.CPU_S, code.WALL_S = 1, 5.0
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    cases = {
        "passed": "def add(a, b):\n    return a + b\n",
        "failed": "def add(a, b):\n    return a - b\n",
        "time": "def add(a, b):\n    while True:\n        pass\n",
        "memory": "blob = bytearray(2 * 1024**3)\ndef add(a, b):\n    return a + b\n",
        "network": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)\n"
        "def add(a, b):\n    return a + b\n",
    }
    got = {}
    for name, body in cases.items():
        request = RewardRequest(
            "Write add.", None, f"Here:\n```python\n{body}```", "solver", {"tests": tests}
        )
        result = code.score(request)
        got[name] = (result.score, sorted(result.details))
    assert got == {"passed": (1.0, ["passed"]), "failed": (0.0, ["failed"]), "time": (0.0, ["time"]),
                   "memory": (0.0, ["memory"]), "network": (0.0, ["failed"])}  # fmt: skip
    assert code.score(RewardRequest("Write add.", None, "no code", "solver", {"tests": tests})).score == 0.0
