"""Demonstrations of all three roles for the supervised warm start of the tiny run.

What they must do: teach every role its *format* and the *skill* (adding, comparing), yet leave each
role right only part of the time when sampled at temperature 1, so that reinforcement learning has a
reward to raise for every role.

How: every role has two modes, told apart by the first token of the response. The *careful* mode
works the sum out and is right; the *careless* mode skips the work:

==========  ==============================================  =====================================
role        careful (share ``<role>_careful``)               careless
==========  ==============================================  =====================================
Solver      ``3+4=7. \\boxed{7}``                           guesses: ``\\boxed{R}``, R uniform
Verifier    ``3+4=7.\\nCorrectness: Wrong`` (recomputes;    rubber-stamps:
            Correct iff the sum is the solution's answer)    ``Correctness: Correct``
Corrector   ``3+4=7. \\boxed{7}``                           stubborn: repeats its previous answer
==========  ==============================================  =====================================

Why modes rather than noisy answers: measured on the tiny MoE, 150 warm-start steps on demos whose
answers were right 40% of the time (no marker) left the greedy Solver at 6% (chance: 5%): the noise
drowned the skill. The same steps on clean demos gave 99%. With modes, every careful demo is a clean
lesson, the careless ones only teach how often to skip the work, and reinforcement learning has one
early decision per response to shift (work it out) whose pay-off is shared across all problems.

The shares are low (20 % careful by default) so that every role starts mostly careless and the room left
to reinforcement learning is the decision to work carefully, not arithmetic it never learned: the warm
start's skill phase makes careful sums right 92-97 % of the time (``SFTConfig.skill_steps``).

Demos are chat conversations in a prompt set (``compact`` for the tiny model); :func:`encode_demo`
turns one into token ids with the policy's chat template and the mask of the tokens that are trained.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mars_megatron.agents.prompts import PromptSet
from mars_megatron.agents.roles import Message, Role
from mars_megatron.config import ConfigError, Section, _field
from mars_megatron.evaluation.data import Problem
from mars_megatron.tasks.arith import operands


@dataclass
class DemoConfig(Section):
    """How often each role works carefully in the demos, and the mix of roles (a config section)."""

    solver_careful: float = _field(
        0.2, "Share of Solver demos that work the sum out (the rest guess a random number).", min=0, max=1
    )
    verifier_careful: float = _field(
        0.2,
        "Share of Verifier demos that recompute the sum and compare (the rest accept the solution "
        "unchecked).",
        min=0,
        max=1,
    )
    verifier_input_accuracy: float = _field(
        0.5, "Share of the Verifier demos' solutions that are correct.", min=0, max=1
    )
    corrector_careful: float = _field(
        0.2,
        "Share of Corrector demos that work the sum out (the rest repeat the rejected answer).",
        min=0,
        max=1,
    )
    solver_weight: float = _field(1.0, "Relative number of Solver demos.", min=0)
    verifier_weight: float = _field(1.0, "Relative number of Verifier demos.", min=0)
    corrector_weight: float = _field(1.0, "Relative number of Corrector demos.", min=0)
    seed: int = _field(0, "Seed of the demos' roles, problems and modes.", min=0)

    def validate(self) -> None:
        if self.solver_weight + self.verifier_weight + self.corrector_weight == 0:
            raise ConfigError("at least one role needs a positive weight", "solver_weight")

    def with_careful(self, share: float) -> DemoConfig:
        """The same demos with every role careful at ``share`` (the warm start's skill phase)."""
        return dataclasses.replace(
            self, solver_careful=share, verifier_careful=share, corrector_careful=share
        )


@dataclass(frozen=True)
class Demo:
    """One demonstration: the role's input messages and the response it is trained to write."""

    role: Role
    problem_id: str
    messages: list[Message]
    response: str
    careful: bool
    """Written in the careful mode."""
    rewarded: bool
    """Whether this response earns reward 1 under the role's real reward."""


def boxed(answer: int) -> str:
    return f"\\boxed{{{answer}}}"


def careful_solution(a: int, b: int) -> str:
    """The careful Solver/Corrector response: the sum worked out, then boxed."""
    return f"{a}+{b}={a + b}. {boxed(a + b)}"


def careful_report(a: int, b: int, shown: int) -> str:
    """The careful Verifier response: the recomputed sum, then the verdict that follows from it."""
    verdict = "Correct" if a + b == shown else "Wrong"
    return f"{a}+{b}={a + b}.\nCorrectness: {verdict}"


CARELESS_REPORT = "Correctness: Correct"
"""The careless Verifier's whole response: a verdict without any check (no bug report)."""


def _wrong(rng: random.Random, answer: int, max_answer: int) -> int:
    """A uniformly random integer in ``0..max(max_answer, 1)`` other than ``answer``."""
    while True:
        value = rng.randint(0, max(max_answer, 1))
        if value != answer:
            return value


def build_demos(problems: Sequence[Problem], prompts: PromptSet, cfg: DemoConfig, n: int) -> list[Demo]:
    """``n`` demos, each of a role drawn by the weights, on a problem drawn from ``problems``.

    Deterministic for a given ``cfg.seed`` (a longer list starts with the shorter one). Guesses and
    wrong solutions are drawn from ``0..the largest answer`` of ``problems``. The Verifier judges
    solutions in both of the Solver's formats, right or wrong in either; the Corrector revises a wrong
    guess that a careful Verifier rejected, with that Verifier's report.
    """
    if not problems:
        raise ValueError("build_demos: no problems")
    rng = random.Random(cfg.seed)
    top = max(int(p.reference) for p in problems)
    roles = (Role.SOLVER, Role.VERIFIER, Role.CORRECTOR)
    weights = (cfg.solver_weight, cfg.verifier_weight, cfg.corrector_weight)
    makers = {Role.SOLVER: _solver_demo, Role.VERIFIER: _verifier_demo, Role.CORRECTOR: _corrector_demo}
    demos = []
    for _ in range(n):
        role = rng.choices(roles, weights)[0]
        demos.append(makers[role](rng.choice(problems), prompts, cfg, rng, top))
    return demos


def _solver_demo(p: Problem, prompts: PromptSet, cfg: DemoConfig, rng: random.Random, top: int) -> Demo:
    a, b = operands(p)
    careful = rng.random() < cfg.solver_careful
    response = careful_solution(a, b) if careful else boxed(rng.randint(0, top))
    return _demo(Role.SOLVER, p, prompts.solver_messages(p.text), response, careful, a + b)


def _verifier_demo(p: Problem, prompts: PromptSet, cfg: DemoConfig, rng: random.Random, top: int) -> Demo:
    a, b = operands(p)
    right = rng.random() < cfg.verifier_input_accuracy
    shown = a + b if right else _wrong(rng, a + b, top)
    # in either of the Solver's formats, right or wrong, so the format says nothing about correctness
    solution = f"{a}+{b}={shown}. {boxed(shown)}" if rng.random() < 0.5 else boxed(shown)
    careful = rng.random() < cfg.verifier_careful
    response = careful_report(a, b, shown) if careful else CARELESS_REPORT
    messages = prompts.verifier_messages(p.text, solution)
    return Demo(Role.VERIFIER, p.problem_id, messages, response, careful, careful or right)


def _corrector_demo(p: Problem, prompts: PromptSet, cfg: DemoConfig, rng: random.Random, top: int) -> Demo:
    a, b = operands(p)
    previous = _wrong(rng, a + b, top)
    report = careful_report(a, b, previous).split("\nCorrectness:")[0]
    # the rejected solution in either of the Solver's formats: a careful Solver's slips reach it too
    solution = f"{a}+{b}={previous}. {boxed(previous)}" if rng.random() < 0.5 else boxed(previous)
    messages = prompts.corrector_messages(p.text, solution, report)
    careful = rng.random() < cfg.corrector_careful
    response = careful_solution(a, b) if careful else boxed(previous)
    return _demo(Role.CORRECTOR, p, messages, response, careful, a + b)


def _demo(role: Role, p: Problem, messages: list[Message], response: str, careful: bool, answer: int) -> Demo:
    return Demo(role, p.problem_id, messages, response, careful, response.endswith(boxed(answer)))


def encode_demo(demo: Demo, codec: Any) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response + end-of-turn, and the target mask for them.

    ``codec`` is a :class:`~mars_megatron.rollout.chat.ChatCodec`: the prompt is exactly what a rollout
    engine is given (chat template with the generation prompt), the response is the tokenised text
    followed by the tokenizer's end-of-turn token (``<|im_end|>``) so the model learns to stop where
    the engines stop. ``target_mask`` has ``len(ids) - 1`` entries: entry t is 1 when token t+1 is a
    response token (trained), 0 for prompt tokens.
    """
    prompt = list(codec.encode(demo.messages))
    tokenizer = codec.tokenizer
    response = list(tokenizer(demo.response, add_special_tokens=False)["input_ids"])
    response.append(int(tokenizer.eos_token_id))
    ids = prompt + response
    return ids, [0] * (len(prompt) - 1) + [1] * len(response)
