"""An agent graph's inference loop (``graph.loop``; ``mars eval``) as a state machine the caller drives.

The caller asks :meth:`InferenceLoop.next_request` for the next (role, messages), runs it on any
engine, and hands the text back with :meth:`InferenceLoop.observe`. Keeping engines out makes every
branch of the loop testable with scripted outputs, and lets a driver batch many loops at once.

Flow: the start step writes the first solution (re-run while its output is truncated, at most
``1 + start_retries`` times); then each step's role speaks and the loop goes to the step's ``next``,
or, after a role that decides, to ``on_pass`` or ``on_fail``. Only verdicts count: each is one
iteration; ``accept_after`` consecutive passes accept the current solution, ``give_up_after``
consecutive failures give up, and ``max_iterations`` verdicts end the loop.

A role with a tool serves its calls inside its step (``ToolSpec`` in agents/graph.py): a turn that ends
with a call (and calls left) runs the tool here, asks the tool's distiller for a digest (a request of its
own), and asks the role to go on after its turn and the observation (:attr:`Request.continuation`); the
step's output is its turns and observations in order.

What each kind of output does: a ``solution`` (complete, not truncated) becomes the current solution
(a truncated one after the start is dropped, and the previous solution goes on); a ``report`` becomes
the latest report, which later prompts read as ``report`` and ``bug_report``; a verdict (read from a
deciding role's output; a truncated output has none, and no verdict is a failure) counts for the
current solution.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars_megatron.agents.graph import (
    AgentGraph,
    LoopBudgets,
    LoopStepSpec,
    RoleSpec,
    ToolSpec,
    prompt_set_of,
)
from mars_megatron.agents.roles import Message
from mars_megatron.agents.thinking import strip_thinking
from mars_megatron.agents.tools import observation, parse_call, run_tool
from mars_megatron.agents.verdict import bug_report, read_verdict
from mars_megatron.config import EvalConfig

ACCEPTED, GAVE_UP, MAX_ITERATIONS, ENDED = "accepted", "gave_up", "max_iterations", "ended"
"""Stop reasons; ``ended``: the loop reached a step with nowhere to go (a graph without a verdict, e.g. a
single tool-using step), and its latest solution is the answer."""
TRUNCATED_SUFFIX = "_truncated"
"""A loop whose start step never wrote a complete solution stops with ``<start role>_truncated``
(MarsRL: ``solver_truncated``)."""


@dataclass(frozen=True)
class Request:
    """One agent call for the engine: which role (a graph role name) speaks and the chat it continues."""

    role: str
    messages: list[Message]
    continuation: tuple[tuple[str, bool], ...] = ()
    """A role going on after a served tool call: ``(text, is_turn)`` pieces that follow the chat's
    generation prompt, in order: its own turns (each followed by the end-of-turn token) and the
    observations between them."""


@dataclass(frozen=True)
class LoopStep:
    """One observed output. ``verdict`` is set for a deciding role only (None there means unreadable)."""

    role: str
    text: str
    truncated: bool = False
    verdict: bool | None = None
    solution: int | None = None
    """Index into :attr:`LoopResult.solutions`: for a solution step the solution this output became
    (None when it was dropped, truncated), for any other step the solution it judged or reported on;
    so an evaluation can score a verdict against the truth of what it saw, not of the final answer."""
    partial: bool = False
    """A turn of a tool-using role that ended with a served call: the step's output is the later entry of
    the same role that completes it (its turns and observations). The history has one entry per engine
    call, in call order."""


@dataclass(frozen=True)
class LoopResult:
    """What the loop answers with, and how it got there."""

    solution: str
    """Visible text (thinking stripped) of the chosen solution."""
    accepted: bool
    stop_reason: str
    """``accepted``, ``gave_up``, ``max_iterations``, ``ended`` or ``<start role>_truncated``."""
    correct_votes: int
    """How many passing verdicts the chosen solution got."""
    calls: dict[str, int]
    """Calls per role, every role of the graph in its order."""
    history: tuple[LoopStep, ...]
    solutions: tuple[str, ...] = ()
    """Visible text of every complete solution, in the order they were made."""
    chosen: int = 0
    """Index of ``solution`` in :attr:`solutions`."""


class InferenceLoop:
    """Runs one problem through ``graph``'s loop; see the module docstring for the flow."""

    def __init__(
        self,
        problem: str,
        graph: AgentGraph,
        config: EvalConfig | None = None,
        prompts: str | None = None,
    ) -> None:
        """``config``: the ``evaluation`` section, whose loop settings override the graph's
        (:class:`LoopBudgets`). ``prompts``: the graph's prompt set the roles were trained with (None:
        its first); a model trained on ``compact`` prompts must be evaluated with them, or it answers
        text it never saw."""
        self.problem = problem
        self.graph = graph
        self.budgets = LoopBudgets.of(graph, config)
        self.prompts = prompt_set_of(graph, prompts)
        self._step: LoopStepSpec | None = graph.loop.steps[graph.loop.start]
        self._history: list[LoopStep] = []
        self._solutions: list[str] = []  # visible text of every complete solution, in order
        self._votes: list[int] = []  # passing verdicts per solution
        self._start_runs = 0
        self._iterations = 0
        self._streak_pass = 0
        self._streak_fail = 0
        self._report = ""  # the latest report's visible text
        self._bug_report = ""  # and what of it a revision reads (verdict.bug_report)
        self._stop_reason: str | None = None
        self._pieces: list[tuple[str, bool]] = []  # a tool-using step so far: its turns and observations
        self._call: tuple[str, str] | None = None  # (purpose, tool output) awaiting the distiller's digest

    @property
    def done(self) -> bool:
        return self._step is None

    def variables(self) -> dict[str, str]:
        """What the next prompt may use: the problem, the current solution, the latest report and its
        bug report (the last two empty until a report is written)."""
        return {
            "problem": self.problem.strip(),
            "solution": strip_thinking(self._solutions[-1]) if self._solutions else "",
            "report": self._report,
            "bug_report": self._bug_report,
        }

    def next_request(self) -> Request | None:
        """The next agent call, or None once the loop has finished."""
        if self._step is None:
            return None
        role = self.graph.roles[self._step.role]
        if self._call is not None:  # the step's role waits for the digest of its call
            assert role.tool is not None
            distiller = self.graph.roles[role.tool.distiller]
            purpose, output = self._call
            return Request(
                distiller.name, distiller.messages(self.prompts, {"purpose": purpose, "tool_output": output})
            )
        return Request(role.name, role.messages(self.prompts, self.variables()), tuple(self._pieces))

    def observe(self, output_text: str, truncated: bool = False) -> None:
        """Feed the output of the request last returned by :meth:`next_request`."""
        step = self._step
        if step is None:
            raise RuntimeError("InferenceLoop.observe called after the loop finished")
        role = self.graph.roles[step.role]
        if self._call is not None:  # a digest: it goes back to the caller as an observation
            assert role.tool is not None
            self._history.append(
                LoopStep(role.tool.distiller, output_text, truncated, solution=self._judged())
            )
            self._pieces.append((observation(output_text), False))
            self._call = None
            return
        if role.tool is not None:
            output_text = self._serve(role.tool, output_text, truncated)
            if self._call is not None:
                return
        self._observe_output(step, role, output_text, truncated)

    def _serve(self, tool: ToolSpec, text: str, truncated: bool) -> str:
        """A turn of a tool-using role: a call is served (the tool runs here; the distiller is asked
        next) when the turn ended by itself and calls are left; otherwise the turns and observations so
        far, in order, are the step's output."""
        calls = sum(not turn for _, turn in self._pieces)
        call = None if truncated or calls >= tool.max_calls else parse_call(text)
        self._pieces.append((text, True))
        if call is not None:
            self._call = (call.purpose, run_tool(call, allowed=[tool.name]))
            assert self._step is not None
            self._history.append(LoopStep(self._step.role, text, partial=True, solution=self._judged()))
            return text
        whole = "".join(piece for piece, _ in self._pieces)
        self._pieces = []
        return whole

    def _observe_output(self, step: LoopStepSpec, role: RoleSpec, output_text: str, truncated: bool) -> None:
        if step.name == self.graph.loop.start:
            self._observe_start(step, output_text, truncated)
        elif role.verdict is not None:
            self._observe_verdict(step, output_text, truncated)
        elif role.output == "solution":
            # A truncated revision is dropped: the previous solution goes on to the next step.
            kept = None if truncated else len(self._solutions)
            self._history.append(LoopStep(role.name, output_text, truncated, solution=kept))
            if not truncated:
                self._add_solution(output_text)
            self._step = self._go(step.next)
        else:
            self._history.append(LoopStep(role.name, output_text, truncated, solution=self._judged()))
            if role.output == "report":
                self._keep_report(output_text, role.verdict)
            self._step = self._go(step.next)

    def _observe_start(self, step: LoopStepSpec, text: str, truncated: bool) -> None:
        self._start_runs += 1
        last_try = self._start_runs > self.budgets.start_retries
        kept = len(self._solutions) if not truncated or last_try else None
        self._history.append(LoopStep(step.role, text, truncated, solution=kept))
        if not truncated:
            self._add_solution(text)
            self._step = self._go(step.next)
        elif last_try:
            # Nothing complete to judge: answer with what the last run made visible (often "").
            self._add_solution(text)
            self._finish(step.role + TRUNCATED_SUFFIX)

    def _observe_verdict(self, step: LoopStepSpec, text: str, truncated: bool) -> None:
        role = self.graph.roles[step.role]
        # A truncated output never reached a deliberate verdict, whatever its text happens to say.
        verdict = None if truncated or role.verdict is None else read_verdict(role.verdict, text)
        self._history.append(LoopStep(role.name, text, truncated, verdict, self._judged()))
        if role.output == "report":
            self._keep_report(text, role.verdict)
        self._iterations += 1
        if verdict is True:
            self._votes[-1] += 1
            self._streak_pass += 1
            self._streak_fail = 0
            if self._streak_pass >= self.budgets.accept_after:
                return self._finish(ACCEPTED)
        else:
            self._streak_pass = 0
            self._streak_fail += 1
            if self._streak_fail >= self.budgets.give_up_after:
                return self._finish(GAVE_UP)
        if self._iterations >= self.budgets.max_iterations:
            # A correction made now could never be judged, so it is not requested.
            return self._finish(MAX_ITERATIONS)
        self._step = self._go(step.on_pass if verdict is True else step.on_fail)

    def _keep_report(self, text: str, reader: str | None) -> None:
        self._report = strip_thinking(text)
        self._bug_report = bug_report(text, reader)

    def _go(self, name: str | None) -> LoopStepSpec | None:
        if name is None:  # a step with nowhere to go ends the loop (validate() allows it after no verdict)
            self._finish(ENDED)
            return None
        return self.graph.loop.steps[name]

    def _judged(self) -> int:
        """The current solution: what a report or a verdict is about."""
        return len(self._solutions) - 1

    def _add_solution(self, text: str) -> None:
        self._solutions.append(strip_thinking(text))
        self._votes.append(0)

    def _finish(self, reason: str) -> None:
        self._stop_reason = reason
        self._step = None

    def result(self) -> LoopResult:
        """The answer: the accepted solution, else :func:`choose_fallback`'s pick."""
        if self._stop_reason is None:
            raise RuntimeError("InferenceLoop.result called before the loop finished")
        accepted = self._stop_reason == ACCEPTED
        index = len(self._solutions) - 1 if accepted else choose_fallback(self._votes)
        calls = {role: sum(step.role == role for step in self._history) for role in self.graph.roles}
        return LoopResult(
            solution=self._solutions[index],
            accepted=accepted,
            stop_reason=self._stop_reason,
            correct_votes=self._votes[index],
            calls=calls,
            history=tuple(self._history),
            solutions=tuple(self._solutions),
            chosen=index,
        )


def choose_fallback(correct_votes: list[int]) -> int:
    """Index of the solution that passed most often; ties go to the latest.

    With no passing verdict at all this is the last solution, the one most revised.
    """
    if not correct_votes:
        raise ValueError("choose_fallback needs at least one solution")
    best = max(correct_votes)
    return max(i for i, votes in enumerate(correct_votes) if votes == best)
