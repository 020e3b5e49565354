"""Prompt text helpers shared by every agent graph: the template variables a graph's prompts are rendered
with (an output's visible part: :mod:`.thinking`).

The prompt texts themselves are the graphs' (``agents/graphs/<name>/prompts/<set>/*.txt``): a change to
them is a visible, versioned diff of a data file, and tests pin the texts the tiny run was trained with.
Applying a chat template and tokenising is the engine adapter's job.
"""

from __future__ import annotations

from mars_megatron.agents.thinking import strip_thinking


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
