"""Reading a deciding role's output: its pass/fail verdict (by the graph's reader: ``correctness`` or
``yes_no``) and the bug report a report hands on to the role that revises the solution.

All of them read the output with its thinking stripped: a model may muse about "correctness" or say
"no" while reasoning, and only the written text counts.
"""

import re
from collections.abc import Callable

from mars_megatron.agents.thinking import strip_thinking

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
    Wrong; a verdict reward treats it as unrewarded).
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


# Markdown and punctuation a yes/no answer may open with: "**Yes**", "> No.", "`yes`", "(No)".
_LEADING = re.compile(r"[\s*_#:\-–—=>|`'\"\[(]*")
_ANSWERS = {"yes": True, "no": False}


def parse_yes_no(text: str) -> bool | None:
    """True for a visible text that opens with the word ``yes``, False for ``no``, None otherwise.

    Why only the first word: a yes/no judgement is asked for exactly that answer first, and the text
    after it may well quote "no issues" or "yes, but"; reading further would let its reasons decide.
    Anything else ("Yeah", "Not", "Noted", an empty or truncated output) is None, which a loop treats
    as a failing verdict and a reward treats as unrewarded, as for :func:`parse_verdict`.
    """
    visible = strip_thinking(text)
    rest = visible[_LEADING.match(visible).end() :]
    word = _WORD.match(rest)
    if word is None:
        return None
    return _ANSWERS.get(word.group(0).lower())


READERS: dict[str, Callable[[str], bool | None]] = {"correctness": parse_verdict, "yes_no": parse_yes_no}
"""A graph role's ``verdict`` reader by name."""


def read_verdict(reader: str | None, text: str) -> bool | None:
    """The verdict of ``text`` by the graph's ``reader`` (``correctness`` or ``yes_no``); None for a role
    that reads none."""
    if reader is None:
        return None
    try:
        return READERS[reader](text)
    except KeyError:
        raise ValueError(f"unknown verdict reader {reader!r}; known: {', '.join(READERS)}") from None


def bug_report(text: str, reader: str | None = "correctness") -> str:
    """The visible report before its last Correctness section (heading markdown dropped).

    This is what the role that revises the solution reads: the verdict and findings, without the final
    one-word grade. A report with no Correctness section is passed on whole, since it is all its author
    said; so is the report of a role whose verdict is not read from a Correctness section (``reader``
    other than ``correctness``, e.g. a report with no verdict of its own, None), where the word
    "correctness" in a finding is no section and cutting there would lose the findings after it.
    """
    visible = strip_thinking(text)
    if reader != "correctness":
        return visible
    section = _last_section(visible)
    if section is None:
        return visible
    before = visible[: section.start()]
    return _HEADING_PREFIX.sub("", before).strip()
