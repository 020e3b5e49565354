"""The V–C inference loop (evaluation) as a state machine the caller drives.

The caller asks :meth:`InferenceLoop.next_request` for the next (role, messages), runs it on any
engine, and hands the text back with :meth:`InferenceLoop.observe`. Keeping engines out makes every
branch of the loop testable with scripted outputs, and lets a driver batch many loops at once.

Flow: Solver (re-run while its output is truncated, at most ``1 + solver_retries`` times), then up
to ``max_iterations`` iterations of {Verifier; if the verdict is an error, Corrector}.
"""

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from mars_megatron.agents.prompts import PROMPT_SETS, PromptSet, strip_thinking
from mars_megatron.agents.roles import Message, Role
from mars_megatron.agents.verdict import bug_report, parse_verdict
from mars_megatron.config import EvalConfig

StopReason = Literal["accepted", "gave_up", "max_iterations", "solver_truncated"]


@dataclass(frozen=True)
class Request:
    """One agent call for the engine: which role speaks and the chat it continues."""

    role: Role
    messages: list[Message]


@dataclass(frozen=True)
class LoopStep:
    """One observed output. ``verdict`` is set for the Verifier only (None there means unparseable)."""

    role: Role
    text: str
    truncated: bool = False
    verdict: bool | None = None
    solution: int | None = None
    """Index into :attr:`LoopResult.solutions`: for the Solver and Corrector the solution this output
    became (None when it was dropped, truncated), for the Verifier the solution it judged; so an
    evaluation can score the Verifier against the truth of what it saw, not of the final answer."""


@dataclass(frozen=True)
class LoopResult:
    """What the loop answers with, and how it got there."""

    solution: str
    """Visible text (thinking stripped) of the chosen solution."""
    accepted: bool
    stop_reason: StopReason
    correct_votes: int
    """How many times the chosen solution was judged ``Correct``."""
    calls: dict[Role, int]
    history: tuple[LoopStep, ...]
    solutions: tuple[str, ...] = ()
    """Visible text of every complete solution, in the order they were made."""
    chosen: int = 0
    """Index of ``solution`` in :attr:`solutions`."""


class _Phase(Enum):
    SOLVE = "solve"
    VERIFY = "verify"
    CORRECT = "correct"
    DONE = "done"


class InferenceLoop:
    """Runs one problem through the V–C system; see the module docstring for the flow."""

    def __init__(
        self, problem: str, config: EvalConfig | None = None, prompts: PromptSet | None = None
    ) -> None:
        """``config``: the loop's budgets (``solver_retries``, ``max_iterations``, ``accept_after``,
        ``give_up_after``) from the ``evaluation`` section; defaults are MarsRL's evaluation settings.
        ``prompts``: the prompt set the roles were trained with (default ``"marsrl"``); a model trained
        on ``compact`` prompts must be evaluated with them, or it answers text it never saw."""
        self.problem = problem
        self.config = config or EvalConfig()
        self.prompts = prompts or PROMPT_SETS["marsrl"]
        self._phase = _Phase.SOLVE
        self._history: list[LoopStep] = []
        self._solutions: list[str] = []  # visible text of every complete solution, in order
        self._votes: list[int] = []  # Correct verdicts per solution
        self._solver_runs = 0
        self._iterations = 0
        self._streak_correct = 0
        self._streak_errors = 0
        self._last_report = ""
        self._stop_reason: StopReason | None = None

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    def next_request(self) -> Request | None:
        """The next agent call, or None once the loop has finished."""
        if self._phase is _Phase.SOLVE:
            return Request(Role.SOLVER, self.prompts.solver_messages(self.problem))
        if self._phase is _Phase.VERIFY:
            return Request(Role.VERIFIER, self.prompts.verifier_messages(self.problem, self._solutions[-1]))
        if self._phase is _Phase.CORRECT:
            messages = self.prompts.corrector_messages(self.problem, self._solutions[-1], self._last_report)
            return Request(Role.CORRECTOR, messages)
        return None

    def observe(self, output_text: str, truncated: bool = False) -> None:
        """Feed the output of the request last returned by :meth:`next_request`."""
        if self._phase is _Phase.DONE:
            raise RuntimeError("InferenceLoop.observe called after the loop finished")
        if self._phase is _Phase.SOLVE:
            self._observe_solver(output_text, truncated)
        elif self._phase is _Phase.VERIFY:
            self._observe_verifier(output_text, truncated)
        else:
            self._observe_corrector(output_text, truncated)

    def _observe_solver(self, text: str, truncated: bool) -> None:
        self._solver_runs += 1
        last_try = self._solver_runs > self.config.solver_retries
        kept = len(self._solutions) if not truncated or last_try else None
        self._history.append(LoopStep(Role.SOLVER, text, truncated, solution=kept))
        if not truncated:
            self._add_solution(text)
            self._phase = _Phase.VERIFY
        elif last_try:
            # Nothing complete to verify: answer with what the last run made visible (often "").
            self._add_solution(text)
            self._finish("solver_truncated")

    def _observe_verifier(self, text: str, truncated: bool) -> None:
        # A truncated report never reached a deliberate verdict, whatever its text happens to say.
        verdict = None if truncated else parse_verdict(text)
        self._history.append(LoopStep(Role.VERIFIER, text, truncated, verdict, len(self._solutions) - 1))
        self._iterations += 1
        if verdict is True:
            self._votes[-1] += 1
            self._streak_correct += 1
            self._streak_errors = 0
            if self._streak_correct >= self.config.accept_after:
                return self._finish("accepted")
        else:
            self._streak_correct = 0
            self._streak_errors += 1
            if self._streak_errors >= self.config.give_up_after:
                return self._finish("gave_up")
        if self._iterations >= self.config.max_iterations:
            # A correction made now could never be verified, so it is not requested.
            return self._finish("max_iterations")
        if verdict is not True:
            self._last_report = bug_report(text)
            self._phase = _Phase.CORRECT

    def _observe_corrector(self, text: str, truncated: bool) -> None:
        kept = None if truncated else len(self._solutions)
        self._history.append(LoopStep(Role.CORRECTOR, text, truncated, solution=kept))
        if not truncated:
            self._add_solution(text)
        # A truncated revision is dropped: the previous solution is verified again next iteration.
        self._phase = _Phase.VERIFY

    def _add_solution(self, text: str) -> None:
        self._solutions.append(strip_thinking(text))
        self._votes.append(0)

    def _finish(self, reason: StopReason) -> None:
        self._stop_reason = reason
        self._phase = _Phase.DONE

    def result(self) -> LoopResult:
        """The answer: the accepted solution, else :func:`choose_fallback`'s pick."""
        if self._stop_reason is None:
            raise RuntimeError("InferenceLoop.result called before the loop finished")
        accepted = self._stop_reason == "accepted"
        index = len(self._solutions) - 1 if accepted else choose_fallback(self._votes)
        calls = {role: sum(step.role is role for step in self._history) for role in Role}
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
    """Index of the solution judged ``Correct`` most often; ties go to the latest.

    With no ``Correct`` verdict at all this is the last solution, the one most revised.
    """
    if not correct_votes:
        raise ValueError("choose_fallback needs at least one solution")
    best = max(correct_votes)
    return max(i for i, votes in enumerate(correct_votes) if votes == best)
