"""The tool pair's tiny task and the demonstrations of its warm start.

The task: sums of two numbers of two or three digits (``Find 372+45.``, the addition task's wording, so
:func:`~mars_megatron.tasks.arith.operands` reads them). A tiny model cannot add such numbers reliably
by itself, the calculator can, so using the tool pays and the reasoner has a reason to learn to call it;
and the distiller, whose digest the reasoner copies, decides whether the call helps.

The demos follow :mod:`mars_megatron.tasks.demos`: each role has a *careful* and a *careless* mode, told
apart by the first token of the response, with a low careful share (20 % by default), so that
reinforcement learning starts with a reward to raise for both roles:

=========  ==========================================================  ==============================
role       careful (share ``DemoConfig.careful``)                          careless
=========  ==========================================================  ==============================
reasoner   ``use calc 37+45 for the sum`` <end of turn>, then after    guesses: ``\\boxed{R}``,
           the observation ``\\nRESULT <digest>\\n``: ``\\boxed{V}``     R uniform
           with V the number in the digest (right or not)
distiller  ``the sum is 82.`` (the value in the tool's output)         a wrong number: ``R.``
=========  ==========================================================  ==============================

A careful reasoner copies whatever the digest says (a wrong digest makes it wrong: the share of right
digests in its demos is ``DemoConfig.input_accuracy``), so the distiller's reward, the outcome of the answer
it served, depends on its own care. A reasoner demo has two turns separated by the observation;
:func:`encode_tool_demo` trains both turns and their end-of-turn tokens and masks the observation, the
layout the scheduler gives a served call (:class:`~mars_megatron.agents.graph.ToolSpec`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars_megatron.agents.graph import AgentGraph, ToolSpec
from mars_megatron.agents.tools import ToolCall, observation, run_tool
from mars_megatron.config import ConfigError
from mars_megatron.evaluation.data import Problem
from mars_megatron.tasks.arith import operands, problem_text, write_jsonl
from mars_megatron.tasks.demos import DemoConfig, boxed, wrong_answer

PURPOSE = "the sum"
"""What the demos' calls say they need the value for."""
LOW, HIGH = 10, 999
"""The operands' range: two or three digits."""
TRAIN_FILE, TEST_FILE = "tool_sums_train.jsonl", "tool_sums_test.jsonl"
"""The shipped task files in ``examples/data`` (:func:`write_task_files` writes them)."""


def sum_problems(n: int, seed: int = 0, *, low: int = LOW, high: int = HIGH) -> list[Problem]:
    """``n`` distinct problems ``a + b`` with ``low <= a, b <= high``, drawn with ``random.Random(seed)``
    (the same list on every machine); ids ``add-<a>-<b>``, ``line`` the 1-based position."""
    if not 0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
    pairs = (high - low + 1) ** 2
    if not 1 <= n <= min(pairs, 10**6):
        raise ValueError(f"n must be in 1..{min(pairs, 10**6)}, got {n}")
    rng = random.Random(seed)
    chosen: dict[tuple[int, int], None] = {}
    while len(chosen) < n:
        chosen.setdefault((rng.randint(low, high), rng.randint(low, high)), None)
    return [Problem(f"add-{a}-{b}", problem_text(a, b), a + b, i + 1) for i, (a, b) in enumerate(chosen)]


def train_test_split(train: int, test: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """Disjoint training and test sets: the first ``train`` and the next ``test`` of :func:`sum_problems`."""
    every = sum_problems(train + test, seed)
    held_out = [dataclasses.replace(p, line=i + 1) for i, p in enumerate(every[train:])]
    return every[:train], held_out


def write_task_files(folder: str | Path, train: int = 400, test: int = 100, seed: int = 0) -> list[Path]:
    """Write the task's train and test JSONL files (``examples/data`` holds these, with the defaults)."""
    folder = Path(folder)
    train_set, test_set = train_test_split(train, test, seed)
    return [write_jsonl(train_set, folder / TRAIN_FILE), write_jsonl(test_set, folder / TEST_FILE)]


# ------------------------------------------------------------------------------------------------ demos
@dataclass(frozen=True)
class ToolDemo:
    """One demonstration: the role's input messages, the turns it writes (each ends with end-of-turn)
    and the observations between them (inserted, not written by the role)."""

    role: str
    problem_id: str
    messages: list[dict[str, str]]
    turns: tuple[str, ...]
    observations: tuple[str, ...]
    """``len(turns) - 1`` texts: observation i follows turn i."""
    careful: bool
    rewarded: bool
    """Whether the response earns reward 1: the right boxed sum (reasoner), the right value (distiller)."""

    @property
    def response(self) -> str:
        """The response as text, observations included and end-of-turn tokens left out."""
        parts = [self.turns[0]]
        for obs, turn in zip(self.observations, self.turns[1:], strict=True):
            parts += [obs, turn]
        return "".join(parts)


def careful_digest(purpose: str, value: int) -> str:
    """The careful distiller's digest: what the purpose asked for, and its value."""
    return f"{purpose} is {value}."


def careless_digest(value: int) -> str:
    """The careless distiller's digest: a bare number (a wrong one in the demos)."""
    return f"{value}."


def build_tool_demos(
    problems: Sequence[Problem], graph: AgentGraph, prompt_set: str, cfg: DemoConfig, n: int
) -> list[ToolDemo]:
    """``n`` demos of ``graph``'s roles in ``prompt_set``, each of a role drawn by ``cfg.weights`` on a
    problem drawn from ``problems``: a role with a tool calls it (careful) or guesses; its distiller
    states the tool's value (careful) or a wrong number. ``cfg.input_accuracy`` is the share of right
    digests in the careful callers' demos (a careful caller copies whatever the digest says).

    Deterministic for a given ``cfg.seed``; guesses and wrong values are drawn from ``0..the largest
    answer`` of ``problems``.
    """
    if not problems:
        raise ValueError("build_tool_demos: no problems")
    unknown = sorted((set(cfg.weights) | set(cfg.careful)) - set(graph.roles))
    if unknown:
        raise ConfigError(f"graph {graph.name!r} has no role {unknown[0]!r}", "demos")
    callers = {r.name: r.tool for r in graph.roles.values() if r.tool is not None}
    distillers = {tool.distiller: (caller, tool) for caller, tool in callers.items()}
    makers = {}
    for role in graph.roles:
        if role in callers:
            makers[role] = functools.partial(_reasoner_demo, role, callers[role])
        elif role in distillers:
            makers[role] = functools.partial(_distiller_demo, role, distillers[role][1])
        else:
            raise ValueError(f"build_tool_demos: role {role!r} neither calls a tool nor distils one")
    weights = tuple(cfg.weights.get(r, 1.0) for r in makers)
    if not any(weights):
        raise ConfigError("at least one role needs a positive weight", "demos.weights")
    rng = random.Random(cfg.seed)
    top = max(int(p.reference) for p in problems)
    demos = []
    for _ in range(n):
        role = rng.choices(tuple(makers), weights)[0]
        demos.append(makers[role](rng.choice(problems), graph, prompt_set, cfg, rng, top))
    return demos


def _reasoner_demo(
    role: str,
    tool: ToolSpec,
    p: Problem,
    graph: AgentGraph,
    prompt_set: str,
    cfg: DemoConfig,
    rng: random.Random,
    top: int,
) -> ToolDemo:
    a, b = operands(p)
    messages = graph.roles[role].messages(prompt_set, {"problem": p.text})
    if rng.random() >= cfg.careful_share(role):
        guess = rng.randint(0, top)
        return ToolDemo(role, p.problem_id, messages, (boxed(guess),), (), False, guess == a + b)
    value = a + b if rng.random() < cfg.input_accuracy else wrong_answer(rng, a + b, top)
    digest = careful_digest(PURPOSE, value) if rng.random() < 0.5 else careless_digest(value)
    call = ToolCall(tool.name, f"{a}+{b}", PURPOSE)
    turns = (call.text(), boxed(value))
    return ToolDemo(role, p.problem_id, messages, turns, (observation(digest),), True, value == a + b)


def _distiller_demo(
    role: str,
    tool: ToolSpec,
    p: Problem,
    graph: AgentGraph,
    prompt_set: str,
    cfg: DemoConfig,
    rng: random.Random,
    top: int,
) -> ToolDemo:
    a, b = operands(p)
    output = run_tool(ToolCall(tool.name, f"{a}+{b}", PURPOSE))
    messages = graph.roles[role].messages(prompt_set, {"purpose": PURPOSE, "tool_output": output})
    careful = rng.random() < cfg.careful_share(role)
    value = a + b if careful else wrong_answer(rng, a + b, top)
    digest = careful_digest(PURPOSE, value) if careful else careless_digest(value)
    return ToolDemo(role, p.problem_id, messages, (digest,), (), careful, careful)


def encode_tool_demo(demo: ToolDemo, codec: Any) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response, and the target mask (``len(ids) - 1`` entries, entry t is 1
    when token t+1 is trained), as :func:`~mars_megatron.tasks.demos.encode_demo` has them.

    Each turn is tokenised on its own and followed by the end-of-turn token (both trained); each
    observation is tokenised on its own and masked (0): exactly the tokens a rollout of a served call
    holds, where the engine writes the turns and the scheduler inserts the observations.
    """
    tokenizer = codec.tokenizer
    prompt = list(codec.encode(demo.messages))
    ids, mask = list(prompt), [0] * (len(prompt) - 1)
    for i, turn in enumerate(demo.turns):
        written = [*tokenizer(turn, add_special_tokens=False)["input_ids"], int(tokenizer.eos_token_id)]
        ids += written
        mask += [1] * len(written)
        if i < len(demo.observations):
            inserted = list(tokenizer(demo.observations[i], add_special_tokens=False)["input_ids"])
            ids += inserted
            mask += [0] * len(inserted)
    return ids, mask
