"""Rewards: answer extraction, AnswerChecker (real math-verify in worker processes), per-agent rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mars_megatron.rewards import (
    AnswerChecker,
    CheckerConfig,
    CheckResult,
    answer_reward,
    answer_rewards,
    extract_boxed,
    normalize_reference,
    verdict_reward,
)

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
DATA_FILES = [DATA / "aime2025.jsonl", DATA / "beyond_aime.jsonl"]
HANG = r"\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate the tower: never finishes without a timeout
REPO = Path(__file__).resolve().parents[1]


def load_references() -> list:
    return [
        json.loads(line)["ans_box"] for path in DATA_FILES for line in path.read_text().splitlines() if line
    ]


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(CheckerConfig(num_workers=2, timeout_s=2.0)) as c:
        yield c


# --- answers.py (pure) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{5}.", "5"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{a^{2}}{b_{1}}}", r"\frac{a^{2}}{b_{1}}"),
        (r"\fbox{42}", "42"),
        (r"\boxed {7}", "7"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"<think>maybe \boxed{3}</think> final \boxed{4}", "4"),
        (r"<think>\boxed{3}</think> no box after thinking", None),
        (r"<think>still thinking \boxed{3}", None),  # thinking never ended: no visible answer
        (r"\boxed{3} ... \boxed{12", None),  # the last box is cut off
        (r"\boxed{}", None),
        ("no answer here", None),
        ("", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_normalize_reference():
    assert normalize_reference(336) == "$336$"
    assert normalize_reference(2.0) == "$2$"
    assert normalize_reference(0.5) == "$0.5$"
    assert normalize_reference(" 336^\\circ ") == "$336^\\circ$"
    assert normalize_reference("$x$") == "$x$"
    with pytest.raises(ValueError, match="empty"):
        normalize_reference("  ")
    with pytest.raises(TypeError):
        normalize_reference(True)


# --- agent rewards --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verdict", "truth", "reward"),
    [
        (True, True, 1.0),
        (False, False, 1.0),
        (True, False, 0.0),
        (False, True, 0.0),
        (None, True, 0.0),
        (None, False, 0.0),
    ],
)
def test_verdict_reward_truth_table(verdict, truth, reward):
    assert verdict_reward(verdict, truth) == reward


# --- AnswerChecker with real math-verify ----------------------------------------------------------------


def test_every_test_set_answer_matches_itself_and_not_off_by_one(checker):
    references = load_references()
    assert {type(r) for r in references} == {str, int}  # one file stores strings, the other integers
    pairs = [(f"The answer is \\boxed{{{r}}}.", r) for r in references]
    for r in references:
        number = int(str(r).removesuffix("^\\circ"))
        pairs.append((f"The answer is \\boxed{{{number + 1}}}.", r))
    rewards = answer_rewards(pairs, checker)
    assert rewards == [1.0] * len(references) + [0.0] * len(references)


def test_degree_answer_matches_plain_number(checker):
    assert "336^\\circ" in load_references()
    assert answer_reward(r"\boxed{336}", "336^\\circ", checker) == 1.0
    assert answer_reward(r"\boxed{337}", "336^\\circ", checker) == 0.0


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        (r"\boxed{\frac{1}{2}}", "0.5", CheckResult(True, "ok")),
        (r"\boxed{\dfrac{1}{2}}", 0.5, CheckResult(True, "ok")),
        (r"\boxed{0.5}", r"\frac{1}{2}", CheckResult(True, "ok")),
        (r"<think>\boxed{1}</think>\boxed{17}", 17, CheckResult(True, "ok")),
        (r"\boxed{asdf qwe}", 17, CheckResult(False, "ok")),
        (r"\boxed{}{}", 17, CheckResult(False, "no_answer")),
        (r"\boxed{)(}", 17, CheckResult(False, "ok")),  # garbage: math-verify compares it as a string
        (r"\boxed{$}", 17, CheckResult(False, "parse_error")),  # math-verify extracts nothing
        ("", 17, CheckResult(False, "no_answer")),
        ("The answer is 17.", 17, CheckResult(False, "no_answer")),
    ],
)
def test_check_cases(checker, response, reference, expected):
    assert checker.check(response, reference) == expected


def test_hang_input_really_hangs_without_timeout():
    code = textwrap.dedent(
        f"""
        from math_verify import parse, verify
        gold, pred = parse("$336$", parsing_timeout=None), parse(r"{HANG}", parsing_timeout=None)
        verify(gold, pred, timeout_seconds=None)
        """
    )
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], timeout=4, capture_output=True)


def test_hang_times_out_in_worker_and_pool_keeps_working(checker):
    before = checker.counters.timeouts
    start = time.monotonic()
    results = checker.check_many([(HANG, 336), (r"\boxed{336}", 336), (HANG, "7"), (r"\boxed{8}", "7")])
    assert time.monotonic() - start < 2.0 * checker.config.timeout_s
    assert results == [
        CheckResult(False, "timeout"),
        CheckResult(True, "ok"),
        CheckResult(False, "timeout"),
        CheckResult(False, "ok"),
    ]
    assert checker.counters.timeouts == before + 2
    assert answer_reward(HANG, 336, checker) == 0.0
    assert answer_reward(r"\boxed{336}", 336, checker) == 1.0


def test_hung_worker_is_killed_and_replaced():
    # math-verify's own timeout (30 s) is longer than the hard limit: the parent must kill the worker.
    config = CheckerConfig(num_workers=1, timeout_s=1.5, worker_timeout_s=30, chunk_size=8)
    with AnswerChecker(config) as checker:
        old_pid = checker._workers[0].process.pid
        pairs = [(r"\boxed{1}", 1), (r"\boxed{2}", 3), (HANG, 336), (r"\boxed{4}", 4), (r"\boxed{5}", 5)]
        start = time.monotonic()
        results = checker.check_many(pairs)
        assert time.monotonic() - start < 10
        assert [r.status for r in results] == ["ok", "ok", "timeout", "ok", "ok"]
        assert [r.correct for r in results] == [True, False, False, True, True]
        assert checker.counters.workers_replaced == 1
        assert checker._workers[0].process.pid != old_pid
        assert checker.check(r"\boxed{6}", 6) == CheckResult(True, "ok")
        assert checker.counters.checks == 6 and checker.counters.timeouts == 1


def test_close_stops_workers_and_rejects_more_work():
    checker = AnswerChecker(CheckerConfig(num_workers=1))
    processes = [w.process for w in checker._workers]
    checker.close()
    checker.close()  # idempotent
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        checker.check(r"\boxed{1}", 1)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_workers_exit_when_parent_dies_without_closing():
    code = textwrap.dedent(
        """
        import os
        from mars_megatron.rewards import AnswerChecker, CheckerConfig
        if __name__ == "__main__":
            checker = AnswerChecker(CheckerConfig(num_workers=1))
            assert checker.check(r"\\boxed{1}", 1).correct
            print(checker._workers[0].process.pid, flush=True)
            os._exit(0)  # no close, no atexit
        """
    )
    script = REPO / "tests" / f"_orphan_check_{os.getpid()}.py"
    script.write_text(code)
    try:
        out = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=REPO
        )
    finally:
        script.unlink()
    worker_pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker_pid)
