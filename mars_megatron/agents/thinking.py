"""The visible part of a model output: what follows its reasoning.

Why a module of its own: the prompts, the verdict parser, the inference loop, tools and answer rewards all
read an output's visible text, and the verdict parser sits below the prompts.
"""

from __future__ import annotations

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def strip_thinking(text: str) -> str:
    """The visible part of a model output: everything after the last ``</think>``, stripped.

    Why the dangling case matters: a truncated output may open ``<think>`` and never close it; all
    of its text is then reasoning, so the visible solution is empty (a judge must not judge
    half a thought). A ``</think>`` without an opening tag (templates that pre-fill ``<think>``)
    still marks the end of the reasoning.
    """
    close = text.rfind(_THINK_CLOSE)
    if close >= 0:
        text = text[close + len(_THINK_CLOSE) :]
    open_ = text.find(_THINK_OPEN)
    if open_ >= 0:
        text = text[:open_]
    return text.strip()
