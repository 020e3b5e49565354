"""Verdict parsing (the ``correctness`` and ``yes_no`` readers) and bug-report extraction."""

import pytest

from mars_megatron.agents.verdict import bug_report, parse_verdict, parse_yes_no, read_verdict

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


def test_bug_report_of_a_report_without_a_correctness_verdict_is_whole() -> None:
    """A report whose role reads no Correctness section (a verification log judged by another role) is
    handed on whole: "correctness" in a finding is no section to cut at."""
    log = "Step 2: Critical Error.\nThe correctness of step 3 depends on it.\nStep 4: fine."
    assert bug_report(log) == "Step 2: Critical Error.\nThe"  # the correctness reader cuts at the word
    assert bug_report("<think>x</think>" + log, None) == log
    assert bug_report(log, "yes_no") == log


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Yes", True),
        ("yes.", True),
        ("No", False),
        ("NO, there is a critical error.", False),
        ("**Yes**", True),
        ("> No.", False),
        ("`yes`", True),
        ("(No)", False),
        ("\n\n  Yes, the report finds no issue.", True),
        ("<think>no... wait</think>Yes", True),
        ("<think>Yes</think>", None),  # only thinking
        ("<think>yes", None),  # truncated while thinking
        ("", None),
        ("Yeah", None),
        ("Nope", None),
        ("Noted: no issues.", None),
        ("Not really", None),
        ("The answer is yes", None),  # only a leading word counts
        ("Yés", None),
    ],
)
def test_yes_no_reads_the_leading_word(text: str, expected: bool | None) -> None:
    assert parse_yes_no(text) is expected


def test_read_verdict_by_reader_name() -> None:
    assert read_verdict("yes_no", "no") is False
    assert read_verdict("correctness", REPORT) is False
    assert read_verdict("correctness", "Yes") is None
    with pytest.raises(ValueError, match="unknown verdict reader 'score'"):
        read_verdict("score", "Yes")
