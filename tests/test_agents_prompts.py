"""The MarsRL graph's full prompts: message structure, thinking stripped, the report without its verdict."""

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.prompts import prompt_variables
from mars_megatron.agents.thinking import strip_thinking
from mars_megatron.agents.verdict import bug_report

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


GRAPH = load_graph("marsrl")


def messages(role: str, solution: str | None = None, report: str | None = None) -> list[dict[str, str]]:
    """``role``'s chat in MarsRL's full prompt set, as rollouts, the loop and the demos build it."""
    return GRAPH.roles[role].messages("marsrl", prompt_variables(PROBLEM, solution, report))


def test_solver_gets_problem_only_without_system_prompt() -> None:
    (message,) = messages("solver")
    assert message["role"] == "user"
    assert message["content"].startswith(PROBLEM + "\n\n") and "\\boxed{}" in message["content"]


def test_verifier_prompt_names_required_sections() -> None:
    system = messages("verifier", "x")[0]["content"]
    for phrase in ("**Final Verdict**", "**List of Findings**", "**Correctness**", "Critical Error"):
        assert phrase in system
    assert "Justification Gap" in system and "Correct or Wrong" in system


def test_verifier_messages_strip_solution_thinking() -> None:
    chat = messages("verifier", "<think>secret musing</think>So n sums to 45, \\boxed{45}.")
    assert [m["role"] for m in chat] == ["system", "user"]
    user = chat[1]["content"]
    assert PROBLEM in user
    assert "So n sums to 45, \\boxed{45}." in user
    assert "secret musing" not in user and "<think>" not in user
    assert user.index(PROBLEM) < user.index("So n sums")


def test_corrector_messages_continue_the_solver_chat() -> None:
    report = (
        "**Final Verdict**: wrong sum.\n\n**List of Findings**: Critical Error in step 2.\n\n"
        "**Correctness**: Wrong"
    )
    chat = messages("corrector", "<think>hmm</think>The answer is 44.", report)
    assert [m["role"] for m in chat] == ["user", "assistant", "user"]
    assert chat[0] == messages("solver")[0]
    assert chat[1]["content"] == "The answer is 44."
    last = chat[2]["content"]
    assert "Critical Error in step 2." in last and "Correctness**: Wrong" not in last  # the verdict is cut
    assert last.rstrip().endswith("## Review report\n\n" + bug_report(report)) and "\\boxed{}" in last


def test_builders_return_fresh_lists() -> None:
    first = messages("solver")
    first[0]["content"] = "mutated"
    assert messages("solver")[0]["content"] != "mutated"
