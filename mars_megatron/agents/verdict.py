"""Reading the Verifier's report: its pass/fail verdict and the bug report handed to the Corrector.

Both read the report with its thinking stripped: a model may muse about "correctness" while
reasoning, and only the written report counts.
"""

import re

from mars_megatron.agents.prompts import strip_thinking

# "correctness" as a whole word, so "incorrectness" in a finding is not mistaken for the section.
_SECTION = re.compile(r"\bcorrectness\b", re.IGNORECASE)
# Markdown and punctuation that may sit between the section name and its word:
# "**Correctness**: Correct", "## Correctness\n\n*Wrong*", "Correctness — `Correct`".
_SEPARATORS = re.compile(r"[\s*_#:\-–—=>|`'\"\[(]*")
# The verdict word: letters/digits of any script, so "Corréct" is read whole and rejected.
_WORD = re.compile(r"[^\W_]+")
# Markdown that opens a section heading and belongs to the section, not to the report before it.
_HEADING_PREFIX = re.compile(r"[\s*_#]*$")

_VERDICTS = {"correct": True, "wrong": False}


def _last_section(visible: str) -> re.Match[str] | None:
    matches = list(_SECTION.finditer(visible))
    return matches[-1] if matches else None


def parse_verdict(text: str) -> bool | None:
    """True for ``Correct``, False for ``Wrong``, None when the report has no readable verdict.

    The verdict is the word right after the LAST "correctness" of the visible report, so a report
    that restates its sections, or quotes the format, is judged by its final word. Anything else
    (no section, another word such as "Incorrect" or "Correctly", a truncated or empty report,
    non-ASCII look-alikes) is None: callers decide what None means (the inference loop treats it as
    Wrong; the Verifier's reward treats it as unrewarded).
    """
    visible = strip_thinking(text)
    section = _last_section(visible)
    if section is None:
        return None
    rest = visible[section.end() :]
    rest = rest[_SEPARATORS.match(rest).end() :]
    word = _WORD.match(rest)
    if word is None:
        return None
    return _VERDICTS.get(word.group(0).lower())


def bug_report(text: str) -> str:
    """The visible report before its last Correctness section (heading markdown dropped).

    This is what the Corrector reads: the verdict and findings, without the final one-word grade.
    A report with no Correctness section is passed on whole, since it is all the Verifier said.
    """
    visible = strip_thinking(text)
    section = _last_section(visible)
    if section is None:
        return visible
    before = visible[: section.start()]
    return _HEADING_PREFIX.sub("", before).strip()


def read_verdict(reader: str | None, text: str) -> bool | None:
    """The verdict of an output by its role's reader (the graph's ``roles.<name>.verdict``): None for a
    role that reads none."""
    if reader is None:
        return None
    if reader == "correctness":
        return parse_verdict(text)
    raise ValueError(f"unknown verdict reader {reader!r}")
