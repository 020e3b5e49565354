"""Inference loop driven by scripted outputs, and training-trajectory input selection."""

import pytest

from mars_megatron.agents.loop import InferenceLoop, LoopResult, choose_fallback
from mars_megatron.agents.roles import Role
from mars_megatron.config import ConfigError, EvalConfig

CORRECT = "**Final Verdict**: fine.\n\n**List of Findings**: None\n\n**Correctness**: Correct"
WRONG = (
    "**Final Verdict**: broken.\n\n**List of Findings**: Critical Error in step 2.\n\n**Correctness**: Wrong"
)


def run(loop: InferenceLoop, script: list[tuple[Role, str] | tuple[Role, str, bool]]) -> LoopResult:
    """Feed scripted outputs, checking each request has the role the script expects."""
    for step in script:
        role, text, truncated = (*step, False) if len(step) == 2 else step
        request = loop.next_request()
        assert request is not None, f"loop ended early, before {role}"
        assert request.role is role
        loop.observe(text, truncated=truncated)
    assert loop.next_request() is None, "loop wanted more requests than scripted"
    return loop.result()


S, V, C = "solver", "verifier", "corrector"


def test_accepts_after_consecutive_correct() -> None:
    result = run(
        InferenceLoop("p"),
        [(S, "<think>t</think>ans 1"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, CORRECT)],
    )
    assert result.accepted and result.stop_reason == "accepted"
    assert result.solution == "ans 1"
    assert result.correct_votes == 4
    assert result.calls == {S: 1, V: 4, C: 0}
    assert [step.verdict for step in result.history] == [None, True, True, True, True]


def test_wrong_resets_streak_and_triggers_corrector() -> None:
    loop = InferenceLoop("p")
    run_prefix = [(S, "ans 1"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, WRONG)]
    for role, text in run_prefix:
        assert loop.next_request().role is role
        loop.observe(text)
    request = loop.next_request()
    assert request.role is C
    assert request.messages[1] == {"role": "assistant", "content": "ans 1"}
    assert "Critical Error in step 2." in request.messages[2]["content"]
    assert "**Correctness**" not in request.messages[2]["content"]
    result = run(
        loop, [(C, "<think>fix</think>ans 2"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, CORRECT)]
    )
    assert result.accepted and result.solution == "ans 2"
    assert result.calls == {S: 1, V: 8, C: 1}


def test_verifier_after_correction_sees_new_solution() -> None:
    loop = InferenceLoop("p")
    for text in ("ans 1", WRONG, "ans 2"):
        loop.observe(text)
    request = loop.next_request()
    assert request.role is V
    assert "ans 2" in request.messages[1]["content"] and "ans 1" not in request.messages[1]["content"]


def test_solver_retried_when_truncated() -> None:
    script = [(S, "<think>cut", True)] * 3 + [(S, "ans")] + [(V, CORRECT)] * 4
    result = run(InferenceLoop("p", EvalConfig(solver_retries=3)), script)
    assert result.accepted and result.calls[S] == 4


def test_solver_gives_up_after_retries() -> None:
    result = run(InferenceLoop("p", EvalConfig(solver_retries=2)), [(S, "<think>cut", True)] * 3)
    assert not result.accepted and result.stop_reason == "solver_truncated"
    assert result.solution == "" and result.calls == {S: 3, V: 0, C: 0}


def test_gives_up_after_consecutive_errors() -> None:
    config = EvalConfig(give_up_after=3, max_iterations=10)
    script = [(S, "a1"), (V, WRONG), (C, "a2"), (V, "no verdict here"), (C, "a3"), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.stop_reason == "gave_up" and not result.accepted
    assert result.solution == "a3"  # never judged Correct: the last solution
    assert result.calls == {S: 1, V: 3, C: 2}


def test_correct_resets_error_count() -> None:
    config = EvalConfig(give_up_after=2, max_iterations=5, accept_after=3)
    script = [(S, "a1"), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG), (C, "a3"), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.stop_reason == "gave_up" and result.calls[V] == 4


def test_truncated_verifier_counts_as_error() -> None:
    config = EvalConfig(accept_after=1, max_iterations=2)
    result = run(InferenceLoop("p", config), [(S, "a1"), (V, CORRECT, True), (C, "a2"), (V, CORRECT)])
    assert result.history[1].verdict is None
    assert result.accepted and result.solution == "a2"


def test_truncated_correction_is_dropped() -> None:
    config = EvalConfig(accept_after=1)
    result = run(InferenceLoop("p", config), [(S, "a1"), (V, WRONG), (C, "<think>cut", True), (V, CORRECT)])
    assert result.accepted and result.solution == "a1"


def test_max_iterations_falls_back_to_most_correct_votes() -> None:
    config = EvalConfig(max_iterations=5, accept_after=4)
    script = [(S, "a1"), (V, CORRECT), (V, CORRECT), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.stop_reason == "max_iterations" and not result.accepted
    assert result.solution == "a1" and result.correct_votes == 2
    assert result.calls[C] == 1  # no correction requested after the last verification


def test_fallback_tie_goes_to_latest() -> None:
    config = EvalConfig(max_iterations=4)
    script = [(S, "a1"), (V, CORRECT), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.solution == "a2" and result.correct_votes == 1


@pytest.mark.parametrize(
    ("votes", "expected"), [([0], 0), ([0, 0, 0], 2), ([2, 1, 0], 0), ([1, 3, 3, 0], 2), ([0, 1], 1)]
)
def test_choose_fallback(votes: list[int], expected: int) -> None:
    assert choose_fallback(votes) == expected


def test_loop_misuse_raises() -> None:
    loop = InferenceLoop("p", EvalConfig(solver_retries=0))
    with pytest.raises(RuntimeError):
        loop.result()
    loop.observe("<think>cut", truncated=True)
    assert loop.done
    with pytest.raises(RuntimeError):
        loop.observe("more")


@pytest.mark.parametrize("field", ["max_iterations", "accept_after", "give_up_after"])
def test_loop_budgets_are_checked_by_the_config_naming_the_field(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EvalConfig(**{field: 0})
    with pytest.raises(ConfigError, match="solver_retries"):
        EvalConfig(solver_retries=-1)
