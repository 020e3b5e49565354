"""Drives many inference loops of an agent graph (one per problem × sample) concurrently.

Each round collects the next request of every active loop, sends them in one ``generate`` call per
engine and feeds the outputs back; loops that finish are checked against the reference (every solution
the loop made, so each verdict can be scored against what it judged; the chosen one is the system's
answer, the loop's first output of its start role the answer of that role alone) and handed to
``on_result`` at once, so a crash loses only unfinished loops. Every agent call has its own seed,
derived from (base seed, problem, sample, step), so results do not depend on batching order or on a run
being resumed.

Roles may be answered by different models (``algorithm.policies``: per role, or the graph's grouping):
``engine`` and ``codec`` are then mappings from the graph's role names to that role's engine and
tokenizer, and a round calls the distinct engines
side by side (threads: an engine call is I/O or native code that releases the GIL).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mars_megatron.agents.graph import AgentGraph
from mars_megatron.agents.loop import InferenceLoop, LoopResult, Request
from mars_megatron.agents.roles import Message
from mars_megatron.config import EvalConfig
from mars_megatron.evaluation import sampling
from mars_megatron.evaluation.data import Problem
from mars_megatron.rewards.answers import extract_boxed
from mars_megatron.rewards.checker import CheckResult

if TYPE_CHECKING:
    from mars_megatron.rewards.functions import FunctionPools
from mars_megatron.rollout.chat import PromptTooLongError
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, RolloutEngine


class Codec(Protocol):
    def encode(self, messages: Sequence[Message]) -> tuple[int, ...]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    # Only graphs whose roles call tools need these (:func:`prompt_tokens`).
    def encode_text(self, text: str) -> tuple[int, ...]: ...

    @property
    def end_of_turn(self) -> int: ...


PerRole = Mapping[str, Any]
"""Role name -> what answers it (an engine or a codec)."""


def per_role(value: Any, roles: Sequence[str]) -> dict[str, Any]:
    """``value`` for every role of ``roles``, or the mapping given (which must name every one)."""
    if isinstance(value, Mapping):
        missing = [r for r in roles if r not in value]
        if missing:
            raise ValueError(f"no engine or codec for role(s) {', '.join(missing)}")
        return {r: value[r] for r in roles}
    return dict.fromkeys(roles, value)


class Checker(Protocol):
    def check_many(self, pairs: list[tuple[str, str | int | float]]) -> list[CheckResult]: ...


class EngineFailure(RuntimeError):
    """The engine raised; results finished before it were already handed out."""


def step_seed(base: int, problem_id: str, sample: int, step: int) -> int:
    """A stable 31-bit seed per agent call (fits every engine's seed type)."""
    digest = hashlib.sha256(f"{base}\0{problem_id}\0{sample}\0{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**31


@dataclass
class _Slot:
    problem: Problem
    sample: int
    loop: InferenceLoop
    calls: list[dict[str, Any]] = field(default_factory=list)  # engine-side facts per observed step


class EvalRunner:
    """Runs (problem, sample) jobs through ``graph``'s loop; see the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine | PerRole,
        codec: Codec | PerRole,
        checker: Checker,
        *,
        graph: AgentGraph,
        config: EvalConfig | None = None,
        prompts: str | None = None,
        max_concurrent: int = 256,
        on_result: Callable[[dict[str, Any]], None] = lambda record: None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.graph = graph
        self.engines: dict[str, RolloutEngine] = per_role(engine, list(graph.roles))
        self.codecs: dict[str, Codec] = per_role(codec, list(graph.roles))
        self.checker = checker
        start = graph.roles[graph.start_role]
        self.function = start.function if start.reward == "function" else None
        """A start role rewarded by the user's function: solutions are judged by it, right when it gives
        the full score (>= 1), in its own process (as in training)."""
        self._functions: FunctionPools | None = None
        # the evaluation section: sampling and overrides of the loop's budgets; a null max_tokens is the
        # default rollout's response budget (callers that have a run's rollout resolve it first)
        self.config = sampling.with_response_budget(config or EvalConfig())
        self.prompts = prompts
        self.max_concurrent = max_concurrent
        self.on_result = on_result

    def run(self, jobs: Sequence[tuple[Problem, int]]) -> int:
        """Run every job to completion; returns how many results were handed out."""
        pending = deque(jobs)
        active: list[_Slot] = []
        handed_out = 0
        with ThreadPoolExecutor(max_workers=len({id(e) for e in self.engines.values()})) as pool:
            while pending or active:
                while pending and len(active) < self.max_concurrent:
                    problem, sample = pending.popleft()
                    loop = InferenceLoop(problem.text, self.graph, self.config, self.prompts)
                    active.append(_Slot(problem, sample, loop))
                requests, waiting = self._requests(active)
                if requests:
                    outputs = self._generate(pool, requests, waiting)
                    for (slot, role), request, output in zip(waiting, requests, outputs, strict=True):
                        truncated = output.finish_reason == "length"
                        slot.calls.append(_call(request, len(output.token_ids), output.finish_reason))
                        slot.loop.observe(self.codecs[role].decode(output.token_ids), truncated)
                finished = [slot for slot in active if slot.loop.done]
                active = [slot for slot in active if not slot.loop.done]
                for record in self._records(finished):
                    self.on_result(record)
                    handed_out += 1
        return handed_out

    def _generate(
        self, pool: ThreadPoolExecutor, requests: list[GenerationRequest], waiting: list[tuple[_Slot, str]]
    ) -> list[Any]:
        """One ``generate`` call per distinct engine (side by side), outputs back in request order."""
        groups: dict[int, list[int]] = {}
        for i, (_, role) in enumerate(waiting):
            groups.setdefault(id(self.engines[role]), []).append(i)
        by_id = {id(e): e for e in self.engines.values()}
        try:
            return generate_shares(pool, [(by_id[key], indices) for key, indices in groups.items()], requests)
        except Exception as e:
            raise EngineFailure(f"engine failed: {type(e).__name__}: {e}") from e

    def _requests(self, active: list[_Slot]) -> tuple[list[GenerationRequest], list[tuple[_Slot, str]]]:
        """The next request of every active loop; a prompt over the input budget is observed as an
        empty truncated output at once (the agent could not run), which may finish its loop."""
        requests: list[GenerationRequest] = []
        waiting: list[tuple[_Slot, str]] = []
        for slot in active:
            while (request := slot.loop.next_request()) is not None:
                step = len(slot.calls)
                seed = step_seed(self.config.seed, slot.problem.problem_id, slot.sample, step)
                try:
                    prompt_ids = prompt_tokens(self.codecs[request.role], request)
                except PromptTooLongError as e:
                    slot.calls.append(
                        {
                            "prompt_tokens": e.num_tokens,
                            "output_tokens": 0,
                            "seed": seed,
                            "finish_reason": "length",
                            "prompt_too_long": True,
                        }
                    )
                    slot.loop.observe("", truncated=True)
                    continue
                request_id = f"{slot.problem.problem_id}/{slot.sample}/{step}/{request.role}"
                requests.append(GenerationRequest(request_id, prompt_ids, sampling.params(self.config, seed)))
                waiting.append((slot, request.role))
                break
        return requests, waiting

    def _records(self, finished: list[_Slot]) -> list[dict[str, Any]]:
        """Check every solution of each finished loop and its start role's first output in one batch."""
        if not finished:
            return []
        results = [slot.loop.result() for slot in finished]
        pairs: list[tuple[str, str | int | float]] = []
        spans: list[tuple[int, int]] = []
        for slot, result in zip(finished, results, strict=True):
            start = len(pairs)
            pairs.append((first_text(result, self.graph.start_role), slot.problem.reference))
            pairs += [(text, slot.problem.reference) for text in result.solutions]
            spans.append((start, len(pairs)))
        checks = (
            self._function_checks(finished, spans, pairs) if self.function else self.checker.check_many(pairs)
        )
        return [
            _record(slot, result, self.graph.start_role, checks[start], checks[start + 1 : end])
            for slot, result, (start, end) in zip(finished, results, spans, strict=True)
        ]

    def _function_checks(
        self, finished: list[_Slot], spans: list[tuple[int, int]], pairs: list[tuple[str, Any]]
    ) -> list[CheckResult]:
        from mars_megatron.rewards.functions import FunctionPools, RewardRequest

        assert self.function is not None
        if self._functions is None:
            self._functions = FunctionPools()
        role = self.graph.start_role
        requests = [
            RewardRequest(slot.problem.text, slot.problem.reference, pairs[i][0], role,
                          dict(slot.problem.extra), problem_id=slot.problem.problem_id)
            for slot, (start, end) in zip(finished, spans, strict=True)
            for i in range(start, end)
        ]  # fmt: skip
        outcomes = self._functions.get(self.function.target, self.function.timeout_s).score(requests)
        status = {None: "ok", "timeout": "timeout"}
        return [
            CheckResult(o.reason is None and o.score >= 1.0, status.get(o.reason, "parse_error"))
            for o in outcomes
        ]

    def close(self) -> None:
        """Stop a reward function's process (when solutions were judged by one)."""
        if self._functions is not None:
            self._functions.close()


def prompt_tokens(codec: Codec, request: Request) -> tuple[int, ...]:
    """The engine prompt of ``request``: its chat, then (a role going on after a served tool call) its own
    turns, each closed by the end-of-turn token, and the observations between them, as training lays a
    served call out (``ToolSpec`` in agents/graph.py)."""
    ids = list(codec.encode(request.messages))
    for text, turn in request.continuation:
        ids += codec.encode_text(text)
        if turn:
            ids.append(codec.end_of_turn)
    return tuple(ids)


def generate_shares(
    pool: ThreadPoolExecutor,
    shares: Sequence[tuple[RolloutEngine, Sequence[int]]],
    requests: Sequence[GenerationRequest],
) -> list[GenerationOutput]:
    """Each engine generates its share of ``requests`` (their indices), side by side on ``pool``; the
    outputs come back in request order. An engine's exception is raised here."""
    futures = [
        (indices, pool.submit(engine.generate, [requests[i] for i in indices])) for engine, indices in shares
    ]
    outputs: list[Any] = [None] * len(requests)
    for ix, future in futures:
        for i, output in zip(ix, future.result(), strict=True):
            outputs[i] = output
    return outputs


def _call(request: GenerationRequest, output_tokens: int, finish_reason: str) -> dict[str, Any]:
    return {
        "prompt_tokens": len(request.prompt_ids),
        "output_tokens": output_tokens,
        "seed": request.sampling.seed,
        "finish_reason": finish_reason,
        "prompt_too_long": False,
    }


def first_text(result: LoopResult, start_role: str) -> str:
    """The loop's first output of its start role (truncated or not): that role's answer alone."""
    return next(step.text for step in result.history if step.role == start_role and not step.partial)


def _record(
    slot: _Slot, result: LoopResult, start_role: str, first: CheckResult, solutions: Sequence[CheckResult]
) -> dict[str, Any]:
    """One results.jsonl line: every agent output in order (with the index of the solution it made or
    judged), the answer, and the checks of the start role's first output (fields named after the role:
    ``solver_correct`` in MarsRL), of every solution and of the system's answer."""
    steps = [
        {
            "role": step.role,
            "text": step.text,
            "truncated": step.truncated,
            "verdict": step.verdict,
            "solution": step.solution,
            **call,
        }
        for step, call in zip(result.history, slot.calls, strict=True)
    ]
    system = solutions[result.chosen]
    return {
        "problem_id": slot.problem.problem_id,
        "sample": slot.sample,
        "line": slot.problem.line,
        "reference": slot.problem.reference,
        "steps": steps,
        "solutions_correct": [check.correct for check in solutions],
        "final_solution": result.solution,
        "final_answer": extract_boxed(result.solution),
        "accepted": result.accepted,
        "stop_reason": result.stop_reason,
        "correct_votes": result.correct_votes,
        "system_correct": system.correct,
        "system_check": system.status,
        f"{start_role}_answer": extract_boxed(first_text(result, start_role)),
        f"{start_role}_correct": first.correct,
        f"{start_role}_check": first.status,
    }
