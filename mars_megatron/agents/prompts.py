"""Prompt builders for the three roles, written in our own words after the MarsRL structure.

The prompt texts are module constants so a change to them is a visible, versioned diff and tests can
check that each builder really uses them. Builders return plain chat messages; applying a chat
template and tokenising is the engine adapter's job.

Two prompt sets share one message layout (:class:`PromptSet`): ``"marsrl"``, the full texts below, and
``"compact"``, a few words per role for tiny models on CPU, which pay for every prompt token in
rollout and training. The module-level builders are the ``"marsrl"`` set.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from mars_megatron.agents.roles import Message

PROMPT_VERSION = "1"
"""Bump when any prompt text below changes, so results can be traced to the prompts that made them."""

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"

SOLVER_INSTRUCTION = "Solve the following problem. Reason carefully, and put your final answer in \\boxed{}."
"""Appended to the problem for the Solver (which gets no system prompt)."""

VERIFIER_SYSTEM_PROMPT = """\
You are a meticulous reviewer of mathematical solutions. You are given a problem and a proposed
solution. Check the solution step by step: recompute every calculation, test every claim, and make
sure each step follows from what came before. Do not fix the solution and do not solve the problem
yourself; your task is only to judge the reasoning that is written down.

Classify every issue you find as one of:
- Critical Error: a mistake that breaks the argument, such as a false statement, a wrong
  calculation or a logical fallacy, so that the conclusion no longer follows.
- Justification Gap: a step whose conclusion may be right but which is not adequately argued.

End your answer with exactly these three sections, in this order:

**Final Verdict**: one sentence saying whether the solution is correct and complete.

**List of Findings**: every issue, each with its location in the solution, its classification
(Critical Error or Justification Gap) and a short explanation. Write "None" if there are no issues.

**Correctness**: exactly one word, either Correct or Wrong. Say Correct only if the solution has no
Critical Error and no Justification Gap and its final answer is right.
"""
"""System prompt of the Verifier; the Correctness section is what :func:`parse_verdict` reads."""

VERIFIER_USER_TEMPLATE = """\
## Problem

{problem}

## Solution

{solution}
"""
"""User message of the Verifier: the problem and the solution with its thinking removed."""

CORRECTOR_INSTRUCTION = """\
A reviewer checked your solution above and wrote the report below. Read it carefully. For each
finding, either correct your solution or, if you are sure the finding is mistaken, explain why.
Then write a complete, improved solution from the beginning and put your final answer in \\boxed{{}}.

## Review report

{bug_report}
"""
"""Last user message of the Corrector: the correction request followed by the Verifier's bug report."""


def strip_thinking(text: str) -> str:
    """The visible part of a model output: everything after the last ``</think>``, stripped.

    Why the dangling case matters: a truncated output may open ``<think>`` and never close it; all
    of its text is then reasoning, so the visible solution is empty (the Verifier must not judge
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


@dataclass(frozen=True)
class PromptSet:
    """The texts of one prompt set; the message layout is fixed here, so every set has the same roles,
    turns, ``\\boxed{}`` answers and Correctness section, and only the wording differs.

    ``verifier_user_template`` has ``{problem}`` and ``{solution}`` fields and ``corrector_instruction``
    a ``{bug_report}`` field (``str.format``: literal braces are doubled). An empty ``verifier_system``
    means the Verifier gets no system message.
    """

    name: str
    solver_instruction: str
    verifier_system: str
    verifier_user_template: str
    corrector_instruction: str

    def __post_init__(self) -> None:
        for field_name, needed in (
            ("verifier_user_template", ("{problem}", "{solution}")),
            ("corrector_instruction", ("{bug_report}",)),
        ):
            text = getattr(self, field_name)
            for placeholder in needed:
                if placeholder not in text:
                    raise ValueError(f"PromptSet.{field_name} of {self.name!r} lacks {placeholder}")

    def solver_messages(self, problem: str) -> list[Message]:
        """The Solver sees the problem only: a single user message, no system prompt."""
        return [{"role": "user", "content": f"{problem.strip()}\n\n{self.solver_instruction}"}]

    def verifier_messages(self, problem: str, solution_text: str) -> list[Message]:
        """[system prompt,] [problem, solution]; the solution's thinking is stripped before judging."""
        user = self.verifier_user_template.format(
            problem=problem.strip(), solution=strip_thinking(solution_text)
        )
        system: list[Message] = (
            [{"role": "system", "content": self.verifier_system}] if self.verifier_system else []
        )
        return [*system, {"role": "user", "content": user}]

    def corrector_messages(self, problem: str, previous_solution: str, bug_report: str) -> list[Message]:
        """[user: problem, assistant: previous solution (thinking stripped), user: correction + report].

        The first turn repeats the Solver's prompt so the Corrector continues the conversation the
        solution came from.
        """
        return [
            *self.solver_messages(problem),
            {"role": "assistant", "content": strip_thinking(previous_solution)},
            {"role": "user", "content": self.corrector_instruction.format(bug_report=bug_report.strip())},
        ]


# The compact texts use words the tiny tokenizer (models/tokenizer.py) keeps whole: a few tokens each.
COMPACT_SOLVER_INSTRUCTION = "Answer in \\boxed{}."
COMPACT_VERIFIER_USER_TEMPLATE = "{problem}\nSolution: {solution}\nEnd with Correctness: Correct or Wrong."
COMPACT_CORRECTOR_INSTRUCTION = "Findings: {bug_report}\nCorrect the solution. Answer in \\boxed{{}}."

PROMPT_SETS: Mapping[str, PromptSet] = MappingProxyType(
    {
        "marsrl": PromptSet(
            name="marsrl",
            solver_instruction=SOLVER_INSTRUCTION,
            verifier_system=VERIFIER_SYSTEM_PROMPT,
            verifier_user_template=VERIFIER_USER_TEMPLATE,
            corrector_instruction=CORRECTOR_INSTRUCTION,
        ),
        # Same structure in a few words, for tiny models: no system message, the Correctness section
        # named in the Verifier's request, the report handed to the Corrector after "Review:".
        "compact": PromptSet(
            name="compact",
            solver_instruction=COMPACT_SOLVER_INSTRUCTION,
            verifier_system="",
            verifier_user_template=COMPACT_VERIFIER_USER_TEMPLATE,
            corrector_instruction=COMPACT_CORRECTOR_INSTRUCTION,
        ),
    }
)
"""Prompt sets by name; ``"marsrl"`` is the default everywhere."""


def prompt_set(name: str) -> PromptSet:
    """The prompt set called ``name``; a ValueError lists the valid names."""
    try:
        return PROMPT_SETS[name]
    except KeyError:
        raise ValueError(
            f"unknown prompt set {name!r}; valid prompt sets: {', '.join(sorted(PROMPT_SETS))}"
        ) from None


def solver_messages(problem: str) -> list[Message]:
    """The Solver sees the problem only: a single user message, no system prompt (``"marsrl"`` set)."""
    return PROMPT_SETS["marsrl"].solver_messages(problem)


def verifier_messages(problem: str, solution_text: str) -> list[Message]:
    """System prompt plus [problem, solution]; the solution's thinking is stripped before judging."""
    return PROMPT_SETS["marsrl"].verifier_messages(problem, solution_text)


def corrector_messages(problem: str, previous_solution: str, bug_report: str) -> list[Message]:
    """[user: problem, assistant: previous solution (thinking stripped), user: correction + report]
    in the ``"marsrl"`` set; see :meth:`PromptSet.corrector_messages`."""
    return PROMPT_SETS["marsrl"].corrector_messages(problem, previous_solution, bug_report)


def prompt_variables(problem: str, solution: str | None = None, report: str | None = None) -> dict[str, str]:
    """The template variables of an agent graph's prompts (agents/graph.py: VARIABLES) from the texts
    they come from: the problem (stripped), the solution's and the report's visible text, and the report
    before its verdict section (``bug_report``). One definition for training rollouts, the inference loop
    and the warm start's demos, so a model is evaluated on the very text it was trained on."""
    from mars_megatron.agents.verdict import bug_report

    variables = {"problem": problem.strip()}
    if solution is not None:
        variables["solution"] = strip_thinking(solution)
    if report is not None:
        variables["report"] = strip_thinking(report)
        variables["bug_report"] = bug_report(report).strip()
    return variables
