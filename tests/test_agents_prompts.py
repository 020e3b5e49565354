"""Prompt builders: message structure, constants actually used, thinking stripped."""

import pytest

from mars_megatron.agents.prompts import (
    CORRECTOR_INSTRUCTION,
    SOLVER_INSTRUCTION,
    VERIFIER_SYSTEM_PROMPT,
    corrector_messages,
    solver_messages,
    strip_thinking,
    verifier_messages,
)

PROBLEM = "Find the sum of all positive integers n < 10."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain answer", "plain answer"),
        ("  padded \n", "padded"),
        ("<think>reasoning</think>\n\nThe answer is 45.", "The answer is 45."),
        ("pre-filled reasoning</think> answer", "answer"),  # template opened <think> for the model
        ("<think>a</think> mid <think>b</think> final", "final"),  # last </think> wins
        ("<think>truncated reasoning that never ends", ""),  # dangling block: nothing visible
        ("<think>a</think> visible <think>truncated", "visible"),
        ("", ""),
        ("<think></think>", ""),
    ],
)
def test_strip_thinking(text: str, expected: str) -> None:
    assert strip_thinking(text) == expected


def test_solver_gets_problem_only_without_system_prompt() -> None:
    messages = solver_messages(PROBLEM)
    assert [m["role"] for m in messages] == ["user"]
    assert PROBLEM in messages[0]["content"]
    assert SOLVER_INSTRUCTION in messages[0]["content"]
    assert "\\boxed{}" in messages[0]["content"]


def test_verifier_prompt_names_required_sections() -> None:
    for phrase in ("**Final Verdict**", "**List of Findings**", "**Correctness**", "Critical Error"):
        assert phrase in VERIFIER_SYSTEM_PROMPT
    assert "Justification Gap" in VERIFIER_SYSTEM_PROMPT
    assert "Correct or Wrong" in VERIFIER_SYSTEM_PROMPT


def test_verifier_messages_strip_solution_thinking() -> None:
    solution = "<think>secret musing</think>So n sums to 45, \\boxed{45}."
    messages = verifier_messages(PROBLEM, solution)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == VERIFIER_SYSTEM_PROMPT
    user = messages[1]["content"]
    assert PROBLEM in user
    assert "So n sums to 45, \\boxed{45}." in user
    assert "secret musing" not in user and "<think>" not in user
    assert user.index(PROBLEM) < user.index("So n sums")


def test_corrector_messages_continue_the_solver_chat() -> None:
    report = "**Final Verdict**: wrong sum.\n\n**List of Findings**: Critical Error in step 2."
    messages = corrector_messages(PROBLEM, "<think>hmm</think>The answer is 44.", report)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0] == solver_messages(PROBLEM)[0]
    assert messages[1]["content"] == "The answer is 44."
    last = messages[2]["content"]
    assert last == CORRECTOR_INSTRUCTION.format(bug_report=report)
    assert report in last and "\\boxed{}" in last


def test_builders_return_fresh_lists() -> None:
    first = solver_messages(PROBLEM)
    first[0]["content"] = "mutated"
    assert solver_messages(PROBLEM)[0]["content"] != "mutated"
