"""Prompt text helpers shared by every agent graph: the visible part of an output and the template
variables a graph's prompts are rendered with.

The prompt texts themselves are the graphs' (``agents/graphs/<name>/prompts/<set>/*.txt``): a change to
them is a visible, versioned diff of a data file, and tests pin the texts the tiny run was trained with.
Applying a chat template and tokenising is the engine adapter's job.
"""

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


def prompt_variables(
    problem: str,
    solution: str | None = None,
    report: str | None = None,
    report_reader: str | None = "correctness",
) -> dict[str, str]:
    """The template variables of an agent graph's prompts (agents/graph.py: VARIABLES) from the texts
    they come from: the problem (stripped), the solution's and the report's visible text, and the report
    before its verdict section (``bug_report``; ``report_reader``: the verdict reader of the report's role,
    see :func:`~mars_megatron.agents.verdict.bug_report`). One definition for training rollouts and the
    warm start's demos, so a model is trained on the very text the inference loop gives it."""
    from mars_megatron.agents.verdict import bug_report

    variables = {"problem": problem.strip()}
    if solution is not None:
        variables["solution"] = strip_thinking(solution)
    if report is not None:
        variables["report"] = strip_thinking(report)
        variables["bug_report"] = bug_report(report, report_reader).strip()
    return variables
