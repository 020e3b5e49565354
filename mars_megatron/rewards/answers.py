"""Final-answer extraction and reference normalisation (pure: strings in, strings out).

Roles that write solutions are asked to put their final answer in ``\\boxed{...}``. Reward checking only looks
at the last boxed expression of the visible answer, i.e. after the model's thinking, and hands math-verify
that short expression rather than the whole response (parsing a long response is slow and may pick up
intermediate results)."""

from __future__ import annotations

import math
import re

from mars_megatron.agents.thinking import strip_thinking

# ``\boxed{`` or ``\fbox{``, optionally with spaces before the brace. The name must not continue
# (``\boxedx{`` is some other command).
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*\{")


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` matching the ``{`` just before ``start``; escaped ``\\{``/``\\}`` do not count."""
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (``\{``, ``\}``, ``\\``)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) after stripping thinking.

    Nested braces are matched. Returns ``None`` when there is no boxed expression, when the last one is
    unterminated (a truncated answer is not silently replaced by an earlier, intermediate one), when the
    thinking never ended, or when the box is empty.
    """
    # One definition of "visible" for the whole system: what a judge reads is what is rewarded.
    visible = strip_thinking(text)
    last = None
    for last in _BOX_OPEN.finditer(visible):  # noqa: B007 — we want the last match
        pass
    if last is None:
        return None
    end = _closing_brace(visible, last.end())
    if end is None:
        return None
    content = visible[last.end() : end].strip()
    return content or None


def normalize_reference(reference: str | int | float) -> str:
    """A reference answer as math-verify should parse it: a string, wrapped in ``$...$`` when bare.

    Integers and floats (as some JSON datasets store them) become their decimal text. A reference that is
    already in math mode (``$...$``, ``\\(...\\)``, ``\\[...\\]``) or boxed is returned as it is.
    """
    if isinstance(reference, bool):
        raise TypeError(f"reference answer must be a string or a number, got {reference!r}")
    if isinstance(reference, int):
        text = str(reference)
    elif isinstance(reference, float):
        if not math.isfinite(reference):
            raise ValueError(f"reference answer must be finite, got {reference!r}")
        text = str(int(reference)) if reference.is_integer() else repr(reference)
    elif isinstance(reference, str):
        text = reference.strip()
    else:
        raise TypeError(f"reference answer must be a string or a number, got {type(reference).__name__}")
    if not text:
        raise ValueError("reference answer is empty")
    if text.startswith(("$", "\\(", "\\[")) or _BOX_OPEN.search(text):
        return text
    return f"${text}$"


def check_reference(reference: str | int | float) -> str:
    """:func:`normalize_reference`, refusing what math-verify cannot read as an answer: empty math
    (``$$``, ``\\boxed{}``) and unbalanced braces (``\\frac{1}{2``). math-verify does not fail on those, it
    falls back to comparing the raw text, so a data set's typo would silently score every response 0 (or
    reward a response that repeats the typo). Checked when problems are loaded, not at every reward.

    A reference that names a task's rule (:mod:`~mars_megatron.rewards.programs`, e.g. ``subset_sum: 1 3 4
    6 8 = 13``) is read by that rule instead, whole: a malformed one is a ValueError saying what is wrong,
    and it is returned as it is (the rule, not math-verify, will check answers against it)."""
    from mars_megatron.rewards.programs import program_of

    program = program_of(reference)
    if program is not None:
        program.read(str(reference))
        return str(reference)
    text = normalize_reference(reference)
    depth = 0
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            raise ValueError(f"reference answer {text!r} has a '}}' without its '{{'")
        i += 1
    if depth:
        raise ValueError(f"reference answer {text!r} has {depth} unclosed '{{'")
    inner = text
    for open_, close in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if inner.startswith(open_) and inner.endswith(close) and len(inner) >= len(open_) + len(close):
            inner = inner[len(open_) : len(inner) - len(close)].strip()
            break
    box = _BOX_OPEN.match(inner)
    if box is not None and inner.endswith("}"):
        inner = inner[box.end() : -1].strip()
    if not inner:
        raise ValueError(f"reference answer {text!r} is empty math")
    return text
