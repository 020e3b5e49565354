"""Verdict parsing and bug-report extraction from Verifier outputs."""

import pytest

from mars_megatron.agents.verdict import bug_report, parse_verdict

REPORT = (
    "**Final Verdict**: The solution is invalid.\n\n"
    "**List of Findings**:\n* Step 2: Critical Error, 3 + 4 is not 8.\n\n"
    "**Correctness**: Wrong"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("**Correctness**: Correct", True),
        ("**Correctness**: Wrong", False),
        ("**Correctness:** Correct", True),
        ("Correctness: correct", True),
        ("CORRECTNESS: WRONG", False),
        ("## Correctness\n\nCorrect", True),
        ("### Correctness\n\n**Wrong**", False),
        ("**Correctness**:\n\n*Correct*", True),
        ("Correctness: __Correct__", True),
        ("Correctness: `Wrong`", False),
        ("Correctness - Correct.", True),
        ("Correctness: Correct\n\nThat is my final answer.", True),
        (REPORT, False),
    ],
)
def test_markdown_variants(text: str, expected: bool) -> None:
    assert parse_verdict(text) is expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "The solution looks fine. Correct.",  # no section
        "**Correctness**:",  # truncated right after the heading
        "**Correctness**: ",
        "**Correctness**: Incorrect",  # must not read as Correct
        "**Correctness**: Correctly argued",
        "**Correctness**: Partially correct",
        "**Correctness**: Yes",
        "**Correctness**: Corréct",  # non-ASCII noise inside the word
        "**Correctness**: \u200bCorrect",  # zero-width space before the word
        "**Correctness**: Соrrect",  # Cyrillic look-alike letters
        "**Correctness**: 正确",
        "<think>**Correctness**: Correct",  # truncated while still thinking
    ],
)
def test_unparseable_is_none(text: str) -> None:
    assert parse_verdict(text) is None


def test_last_section_wins() -> None:
    assert parse_verdict("Correctness: Wrong\n...on reflection...\nCorrectness: Correct") is True
    assert parse_verdict("Correctness: Correct\n...on reflection...\nCorrectness: Wrong") is False
    # a later mention that is not followed by a verdict makes the output unparseable
    assert parse_verdict("Correctness: Correct\nI am unsure about the correctness of step 3.") is None


def test_thinking_is_ignored() -> None:
    assert parse_verdict("<think>Correctness: Correct? no...</think>**Correctness**: Wrong") is False
    assert parse_verdict("<think>**Correctness**: Wrong</think>The end.") is None


def test_incorrectness_is_not_the_section() -> None:
    assert parse_verdict("**Correctness**: Wrong, given the incorrectness: Correct") is False


def test_bug_report_is_text_before_last_correctness_section() -> None:
    expected = (
        "**Final Verdict**: The solution is invalid.\n\n"
        "**List of Findings**:\n* Step 2: Critical Error, 3 + 4 is not 8."
    )
    assert bug_report(REPORT) == expected
    assert bug_report("<think>musing</think>" + REPORT) == expected
    assert bug_report("Findings: gap.\n\n## Correctness\nWrong") == "Findings: gap."


def test_bug_report_without_section_is_whole_visible_text() -> None:
    assert bug_report("<think>x</think>  Step 1 is a Justification Gap. ") == "Step 1 is a Justification Gap."
    assert bug_report("<think>never closed") == ""
