"""The inference loop of an agent graph driven by scripted outputs: MarsRL's V–C loop (its semantics as
before graphs: accept after 4, give up, max iterations, truncation) and the IMO-2025 pipeline (accept
after 5 yes judgements, 30 iterations at most, the Corrector reading the Verifier's report)."""

from __future__ import annotations

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.loop import InferenceLoop, LoopResult, choose_fallback
from mars_megatron.config import ConfigError, EvalConfig

MARSRL = load_graph("marsrl")
IMO = load_graph("imo_refine")

CORRECT = "**Final Verdict**: fine.\n\n**List of Findings**: None\n\n**Correctness**: Correct"
WRONG = (
    "**Final Verdict**: broken.\n\n**List of Findings**: Critical Error in step 2.\n\n**Correctness**: Wrong"
)
S, V, C, J = "solver", "verifier", "corrector", "judge"


def run(loop: InferenceLoop, script: list[tuple[str, str] | tuple[str, str, bool]]) -> LoopResult:
    """Feed scripted outputs, checking each request has the role the script expects."""
    for i, step in enumerate(script):
        role, text, truncated = (*step, False) if len(step) == 2 else step
        request = loop.next_request()
        assert request is not None, f"loop ended early, before step {i} ({role})"
        assert request.role == role, f"step {i}: expected {role}, got {request.role}"
        loop.observe(text, truncated=truncated)
    assert loop.next_request() is None, "loop wanted more requests than scripted"
    return loop.result()


def marsrl(config: EvalConfig | None = None, prompts: str | None = None) -> InferenceLoop:
    return InferenceLoop("p", MARSRL, config, prompts)


# --- MarsRL ----------------------------------------------------------------------------------------


def test_marsrl_accepts_after_four_consecutive_correct() -> None:
    result = run(
        marsrl(), [(S, "<think>t</think>ans 1"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, CORRECT)]
    )
    assert result.accepted and result.stop_reason == "accepted"
    assert result.solution == "ans 1" and result.correct_votes == 4
    assert result.calls == {S: 1, V: 4, C: 0} and list(result.calls) == [S, V, C]
    assert [step.verdict for step in result.history] == [None, True, True, True, True]
    assert [step.solution for step in result.history] == [0, 0, 0, 0, 0]


def test_marsrl_wrong_resets_streak_and_the_corrector_reads_the_bug_report() -> None:
    loop = marsrl()
    for role, text in [(S, "ans 1"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, WRONG)]:
        assert loop.next_request().role == role
        loop.observe(text)
    request = loop.next_request()
    assert request.role == C
    assert request.messages[1] == {"role": "assistant", "content": "ans 1"}
    assert "Critical Error in step 2." in request.messages[2]["content"]
    assert "**Correctness**" not in request.messages[2]["content"]
    result = run(
        loop, [(C, "<think>fix</think>ans 2"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, CORRECT)]
    )
    assert result.accepted and result.solution == "ans 2" and result.solutions == ("ans 1", "ans 2")
    assert result.calls == {S: 1, V: 8, C: 1}


def test_marsrl_prompts_render_the_graph_files() -> None:
    """The compact set, whole: what the tiny run's models were trained on."""
    loop = marsrl(prompts="compact")
    loop.problem = " 3+4? \n"
    assert loop.next_request().messages == [{"role": "user", "content": "3+4?\n\nAnswer in \\boxed{}."}]
    loop.observe("<think>hm</think>\\boxed{8}")
    assert loop.next_request().messages == [
        {"role": "user", "content": "3+4?\nSolution: \\boxed{8}\nEnd with Correctness: Correct or Wrong."}
    ]
    loop.observe("3+4=7.\nCorrectness: Wrong")
    assert loop.next_request().messages == [
        {"role": "user", "content": "3+4?\n\nAnswer in \\boxed{}."},
        {"role": "assistant", "content": "\\boxed{8}"},
        {"role": "user", "content": "Findings: 3+4=7.\nCorrect the solution. Answer in \\boxed{}."},
    ]
    full = marsrl().next_request().messages  # the default set: the graph's first, MarsRL's full texts
    assert full[0]["content"].startswith("p\n\nSolve the following problem.")


def test_marsrl_verifier_after_a_correction_sees_the_new_solution() -> None:
    loop = marsrl()
    for text in ("ans 1", WRONG, "ans 2"):
        loop.observe(text)
    request = loop.next_request()
    assert request.role == V
    assert "ans 2" in request.messages[1]["content"] and "ans 1" not in request.messages[1]["content"]


def test_start_step_retried_while_truncated() -> None:
    script = [(S, "<think>cut", True)] * 3 + [(S, "ans")] + [(V, CORRECT)] * 4
    result = run(marsrl(EvalConfig(start_retries=3)), script)
    assert result.accepted and result.calls[S] == 4
    assert [step.solution for step in result.history[:4]] == [None, None, None, 0]


def test_start_step_gives_up_after_retries_with_todays_stop_reason() -> None:
    result = run(marsrl(EvalConfig(start_retries=2)), [(S, "<think>cut", True)] * 3)
    assert not result.accepted and result.stop_reason == "solver_truncated"
    assert result.solution == "" and result.calls == {S: 3, V: 0, C: 0}
    assert [step.solution for step in result.history] == [None, None, 0]
    # the graph's start_retries (3) when the evaluation section leaves it null
    assert run(marsrl(), [(S, "x", True)] * 4).calls[S] == 4


def test_gives_up_after_consecutive_failures() -> None:
    config = EvalConfig(give_up_after=3, max_iterations=10)
    script = [(S, "a1"), (V, WRONG), (C, "a2"), (V, "no verdict here"), (C, "a3"), (V, WRONG)]
    result = run(marsrl(config), script)
    assert result.stop_reason == "gave_up" and not result.accepted
    assert result.solution == "a3"  # never judged Correct: the last solution
    assert result.calls == {S: 1, V: 3, C: 2}


def test_a_pass_resets_the_failure_count() -> None:
    config = EvalConfig(give_up_after=2, max_iterations=5, accept_after=3)
    script = [(S, "a1"), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG), (C, "a3"), (V, WRONG)]
    result = run(marsrl(config), script)
    assert result.stop_reason == "gave_up" and result.calls[V] == 4


def test_truncated_verdict_counts_as_failure() -> None:
    config = EvalConfig(accept_after=1, max_iterations=2)
    result = run(marsrl(config), [(S, "a1"), (V, CORRECT, True), (C, "a2"), (V, CORRECT)])
    assert result.history[1].verdict is None
    assert result.accepted and result.solution == "a2"


def test_truncated_correction_is_dropped() -> None:
    config = EvalConfig(accept_after=1)
    result = run(marsrl(config), [(S, "a1"), (V, WRONG), (C, "<think>cut", True), (V, CORRECT)])
    assert result.accepted and result.solution == "a1"
    assert [step.solution for step in result.history] == [0, 0, None, 0]


def test_max_iterations_falls_back_to_most_passes() -> None:
    config = EvalConfig(max_iterations=5, accept_after=4)
    script = [(S, "a1"), (V, CORRECT), (V, CORRECT), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG)]
    result = run(marsrl(config), script)
    assert result.stop_reason == "max_iterations" and not result.accepted
    assert result.solution == "a1" and result.correct_votes == 2
    assert result.calls[C] == 1  # no correction requested after the last verdict


def test_fallback_tie_goes_to_latest() -> None:
    script = [(S, "a1"), (V, CORRECT), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG)]
    result = run(marsrl(EvalConfig(max_iterations=4)), script)
    assert result.solution == "a2" and result.correct_votes == 1


@pytest.mark.parametrize(
    ("votes", "expected"), [([0], 0), ([0, 0, 0], 2), ([2, 1, 0], 0), ([1, 3, 3, 0], 2), ([0, 1], 1)]
)
def test_choose_fallback(votes: list[int], expected: int) -> None:
    assert choose_fallback(votes) == expected


def test_loop_misuse_raises() -> None:
    loop = marsrl(EvalConfig(start_retries=0))
    with pytest.raises(RuntimeError):
        loop.result()
    loop.observe("<think>cut", truncated=True)
    assert loop.done and loop.next_request() is None
    with pytest.raises(RuntimeError):
        loop.observe("more")
    with pytest.raises(ValueError, match="no prompt set 'nope'"):
        marsrl(prompts="nope")


@pytest.mark.parametrize("field", ["max_iterations", "accept_after", "give_up_after"])
def test_loop_budgets_are_checked_by_the_config_naming_the_field(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EvalConfig(**{field: 0})
    with pytest.raises(ConfigError, match="start_retries"):
        EvalConfig(start_retries=-1)


# --- IMO 2025: solve, verify, judge (yes/no), correct -----------------------------------------------

LOG = "Summary: step 2 is a Critical Error; the correctness of step 3 was not checked.\nLog: 3+4 is 7, not 8."


def imo(config: EvalConfig | None = None, prompts: str | None = None) -> InferenceLoop:
    return InferenceLoop("3+4?", IMO, config, prompts)


def test_imo_accepts_after_five_consecutive_yes() -> None:
    script = [(S, "\\boxed{7}")] + [(V, "all steps hold"), (J, "Yes.")] * 5
    result = run(imo(), script)
    assert result.accepted and result.stop_reason == "accepted" and result.correct_votes == 5
    assert result.calls == {S: 1, V: 5, J: 5, C: 0} and list(result.calls) == [S, V, J, C]
    assert [s.verdict for s in result.history if s.role == J] == [True] * 5
    assert [s.verdict for s in result.history if s.role == V] == [None] * 5  # a report with no verdict


def test_imo_four_yes_then_a_no_sends_the_verifiers_log_to_the_corrector() -> None:
    loop = imo()
    for role, text in [(S, "<think>x</think>\\boxed{8}")] + [(V, "fine"), (J, "**Yes**")] * 4 + [(V, LOG)]:
        assert loop.next_request().role == role
        loop.observe(text)
    judge = loop.next_request()
    assert judge.role == J and LOG in judge.messages[-1]["content"]
    loop.observe("No, the report names a critical error in step 2.")
    corrector = loop.next_request()
    assert corrector.role == C
    assert corrector.messages[1] == {"role": "assistant", "content": "\\boxed{8}"}
    last = corrector.messages[-1]["content"]
    # the whole log (a report without a Correctness section is not cut at the word), not the judge's text
    assert LOG in last and "names a critical error" not in last
    result = run(loop, [(C, "\\boxed{7}")] + [(V, "fine"), (J, "yes")] * 5)
    assert (
        result.accepted
        and result.solution == "\\boxed{7}"
        and result.solutions == ("\\boxed{8}", "\\boxed{7}")
    )
    assert result.calls == {S: 1, V: 10, J: 10, C: 1}
    # each judgement and report names the solution it was about
    assert [s.solution for s in result.history if s.role == J] == [0] * 5 + [1] * 5


def test_imo_gives_up_after_ten_consecutive_no() -> None:
    script = [(S, "a0")]
    for i in range(1, 10):
        script += [(V, f"log {i}"), (J, "No."), (C, f"a{i}")]
    script += [(V, "log 10"), (J, "no")]
    result = run(imo(), script)
    assert result.stop_reason == "gave_up" and not result.accepted
    assert result.calls == {S: 1, V: 10, J: 10, C: 9} and result.solution == "a9"


def test_imo_stops_after_thirty_judgements_without_a_last_correction() -> None:
    script = [(S, "a0")]
    for i in range(15):  # yes, no, yes, no, ...: never 5 yes nor 10 no in a row
        script += [(V, "ok"), (J, "yes"), (V, "bad"), (J, "no")]
        if i < 14:
            script += [(C, f"a{i + 1}")]
    result = run(imo(), script)
    assert result.stop_reason == "max_iterations" and result.calls[J] == 30 and result.calls[C] == 14
    assert result.solution == "a14" and result.correct_votes == 1  # one yes each: the tie goes to the latest
    shorter = [(S, "a0"), (V, "ok"), (J, "yes"), (V, "bad"), (J, "no")]
    assert run(imo(EvalConfig(max_iterations=2)), shorter).stop_reason == "max_iterations"


@pytest.mark.parametrize(
    ("text", "truncated", "verdict"),
    [
        ("Yes", False, True),
        ("no", False, False),
        ("<think>no, wait</think>**Yes**, the log shows no error.", False, True),
        ("Nope", False, None),
        ("The answer is yes.", False, None),
        ("Yes", True, None),  # truncated: no deliberate verdict
    ],
)
def test_imo_judge_reads_a_leading_yes_or_no(text: str, truncated: bool, verdict: bool | None) -> None:
    config = EvalConfig(accept_after=1, give_up_after=1)
    result = run(imo(config), [(S, "a"), (V, "log"), (J, text, truncated)])
    assert result.history[-1].verdict is verdict
    assert result.stop_reason == ("accepted" if verdict else "gave_up")


def test_imo_truncated_start_retries() -> None:
    result = run(imo(), [(S, "<think>cut", True)] * 4)
    assert result.stop_reason == "solver_truncated" and result.calls[S] == 4
    result = run(imo(), [(S, "cut", True), (S, "a")] + [(V, "ok"), (J, "Yes")] * 5)
    assert result.accepted and result.solution == "a"


def test_imo_compact_prompts() -> None:
    loop = imo(prompts="compact")
    for text in ("\\boxed{8}", "3+4=7."):
        loop.observe(text)
    assert loop.next_request().messages == [
        {
            "role": "user",
            "content": "Findings: 3+4=7.\nSolution: \\boxed{8}\n"
            "Is the solution correct and complete? Say yes or no.",
        }
    ]
