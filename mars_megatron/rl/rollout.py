"""One step of MarsRL's grouped agentic rollout: Solver → Verifier1 → Corrector1 → Verifier2 → Corrector2.

Every position decodes all of its requests in one engine call per policy (so the engine batches them),
scores them with the agent-specific rewards, and then picks the inputs of the next position
(:func:`~mars_megatron.agents.trajectory.select_inputs`). The output is the trainer's sample records.

Randomness comes only from ``(seed, step)``: each request carries its own sampling seed and the input
selection uses its own generator, so a resumed run redoes a step exactly as the uninterrupted run did.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from mars_megatron.agents.prompts import PromptSet
from mars_megatron.agents.roles import Message, Role
from mars_megatron.agents.trajectory import Position, RolloutRecord, TrainingConfig, select_inputs
from mars_megatron.agents.verdict import bug_report, parse_verdict
from mars_megatron.algorithm.sample import Sample, Segment
from mars_megatron.evaluation.data import Problem
from mars_megatron.rewards.agent_rewards import Checker, answer_rewards, verifier_reward
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, RolloutEngine, SamplingParams

RewardMode = Literal["agent", "shared"]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (stable across processes and Python versions, unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class RolloutSettings:
    agents: TrainingConfig
    sampling: SamplingParams
    """Temperature, top-p/k and the response cap; the seed is set per request."""
    reward: RewardMode = "agent"


@dataclass(eq=False)
class Node:
    """One decoded agent output and what the next positions need of it."""

    record: RolloutRecord
    problem: Problem
    prompt_ids: tuple[int, ...]
    output: GenerationOutput
    version: int
    judged: Node | None = None
    """Verifier: the solution it judged. Corrector: the solution it revised."""
    children: list[Node] = field(default_factory=list)
    agent_reward: float = 0.0

    @property
    def text(self) -> str:
        return self.record.output_text


@dataclass
class RolloutResult:
    samples: list[Sample]
    """Every output of the step, with its training reward (agent-specific or shared)."""
    nodes: list[Node]
    metrics: dict[str, float]


class AgenticRollout:
    """Runs the grouped rollout of one step on the engines of each role's policy."""

    def __init__(
        self,
        engines: Mapping[Role, RolloutEngine],
        codec: ChatCodec,
        checker: Checker,
        prompts: PromptSet,
        settings: RolloutSettings,
        version_of: Callable[[Role], int],
    ) -> None:
        missing = [role.value for role in Role if role not in engines]
        if missing:
            raise ValueError(f"AgenticRollout: no engine for role(s) {missing}")
        self.engines = engines
        self.codec = codec
        self.checker = checker
        self.prompts = prompts
        self.settings = settings
        self.version_of = version_of

    # ------------------------------------------------------------------------------------------ messages
    def _messages(self, role: Role, problem: Problem, parent: Node | None) -> list[Message]:
        if role is Role.SOLVER:
            return self.prompts.solver_messages(problem.text)
        assert parent is not None
        if role is Role.VERIFIER:
            return self.prompts.verifier_messages(problem.text, parent.text)
        assert parent.judged is not None  # a Corrector's input is a Verifier report on a solution
        return self.prompts.corrector_messages(problem.text, parent.judged.text, bug_report(parent.text))

    # ---------------------------------------------------------------------------------------------- step
    def run(self, problems: Sequence[Problem], *, step: int, seed: int) -> RolloutResult:
        agents = self.settings.agents
        rng = random.Random(derive_seed(seed, step, "select"))
        by_position: dict[Position, list[Node]] = {}
        previous: list[Node] = []
        for index, position in enumerate(agents.positions):
            role = position.role
            if position is Position.SOLVER:
                parents: list[tuple[Problem, Node | None]] = [(p, None) for p in problems]
            else:
                parents = []
                for problem in problems:
                    candidates = [n for n in previous if n.problem.problem_id == problem.problem_id]
                    by_id = {n.record.sample_id: n for n in candidates}
                    chosen = select_inputs(
                        [n.record for n in candidates], agents.inputs_per_agent, agents.strategy, role, rng
                    )
                    parents += [(problem, by_id[r.sample_id]) for r in chosen]
            if not parents:  # every branch ended (all Verifiers said Correct)
                break
            nodes = self._decode(position, parents, step=step, seed=seed, position_index=index)
            self._score(role, nodes)
            by_position[position] = nodes
            previous = nodes
        all_nodes = [n for nodes in by_position.values() for n in nodes]
        if self.settings.reward == "shared":
            training_reward = {id(n): _outcome(n) for n in all_nodes}
        else:
            training_reward = {id(n): n.agent_reward for n in all_nodes}
        samples = [self._sample(n, training_reward[id(n)]) for n in all_nodes]
        return RolloutResult(samples, all_nodes, _metrics(by_position, problems, training_reward))

    def _decode(
        self,
        position: Position,
        parents: list[tuple[Problem, Node | None]],
        *,
        step: int,
        seed: int,
        position_index: int,
    ) -> list[Node]:
        role = position.role
        base = self.settings.sampling
        requests: list[GenerationRequest] = []
        meta: list[tuple[Problem, Node | None, list[Message], tuple[int, ...]]] = []
        for problem, parent in parents:
            messages = self._messages(role, problem, parent)
            prompt_ids = self.codec.encode(messages)
            for _ in range(self.settings.agents.group_size):
                i = len(requests)
                sampling = SamplingParams(
                    max_tokens=base.max_tokens,
                    temperature=base.temperature,
                    top_p=base.top_p,
                    top_k=base.top_k,
                    seed=derive_seed(seed, step, position_index, i),
                    stop_token_ids=base.stop_token_ids,
                )
                requests.append(GenerationRequest(f"{step}:{position.value}:{i}", prompt_ids, sampling))
                meta.append((problem, parent, messages, prompt_ids))
        outputs = self.engines[role].generate(requests)
        version = self.version_of(role)
        nodes = []
        for request, output, (problem, parent, messages, prompt_ids) in zip(
            requests, outputs, meta, strict=True
        ):
            record = RolloutRecord(
                sample_id=request.request_id,
                problem_id=problem.problem_id,
                position=position,
                messages=messages,
                output_text=self.codec.decode(output.token_ids),
                parent_id=parent.record.sample_id if parent is not None else None,
            )
            judged = None
            if role is Role.VERIFIER:
                judged = parent
            elif role is Role.CORRECTOR:
                judged = parent.judged if parent is not None else None
            node = Node(record, problem, prompt_ids, output, version, judged=judged)
            if parent is not None:
                parent.children.append(node)
            nodes.append(node)
        return nodes

    def _score(self, role: Role, nodes: list[Node]) -> None:
        if role is Role.VERIFIER:
            for n in nodes:
                assert n.judged is not None
                n.record.verdict = parse_verdict(n.text)
                n.agent_reward = verifier_reward(n.record.verdict, n.judged.agent_reward > 0)
        else:
            rewards = answer_rewards([(n.text, n.problem.reference) for n in nodes], self.checker)
            for n, r in zip(nodes, rewards, strict=True):
                n.agent_reward = r
        for n in nodes:
            n.record.reward = n.agent_reward  # selection of the next inputs reads the agent reward

    def _sample(self, node: Node, reward: float) -> Sample:
        tokens = node.output.token_ids
        return Sample.from_record(
            node.record,
            node.prompt_ids,
            tokens,
            reward=reward,
            behaviour_logprobs=[min(lp, 0.0) for lp in node.output.logprobs],
            segment_versions=[Segment(0, len(tokens), node.version)],
        )


def _outcome(node: Node) -> float:
    """The shared (trajectory-level) reward: whether the trajectory's final solution is right, averaged
    over the trajectories through ``node`` when it has several continuations.

    A solution's trajectory ends with it when nobody judged it; a Verifier's ends with the solution it
    judged when no Corrector revised it (it said Correct, or its branch was not selected).
    """
    if node.children:
        return sum(_outcome(c) for c in node.children) / len(node.children)
    if node.record.role is Role.VERIFIER:
        assert node.judged is not None
        return node.judged.agent_reward
    return node.agent_reward


@dataclass(frozen=True)
class Scored:
    """One scored agent output, as the per-role metrics see it."""

    position: Position
    reward: float
    """The agent-specific reward."""
    judged_right: bool | None
    """Verifier/Corrector: whether the solution it judged or revised was right; None for the Solver."""
    prompt_len: int
    response_len: int
    truncated: bool
    verdict: bool | None = None
    training_reward: float | None = None
    """The reward trained on, where it differs in kind (``algorithm.reward=shared``)."""


def role_metrics(outputs: Sequence[Scored]) -> dict[str, float]:
    """Agent-specific rewards per role and position (also under ``algorithm.reward=shared``, so runs
    compare on the same scale), sample counts, lengths and truncation. One definition for the
    synchronous rollout and the agentic pipeline's updates."""
    out: dict[str, float] = {}
    by_role: dict[Role, list[Scored]] = {}
    by_position: dict[Position, list[Scored]] = {}
    for o in outputs:
        by_role.setdefault(o.position.role, []).append(o)
        by_position.setdefault(o.position, []).append(o)
    for position, members in by_position.items():
        out[f"position_reward/{position.value}"] = _mean([o.reward for o in members])
        out[f"position_samples/{position.value}"] = float(len(members))
    for role in Role:
        members = by_role.get(role, [])
        out[f"samples/{role.value}"] = float(len(members))
        if not members:  # e.g. no Verifier found an error: logged as null, plotted as a gap
            out[f"reward/{role.value}"] = float("nan")
            continue
        out[f"reward/{role.value}"] = _mean([o.reward for o in members])
        if all(o.training_reward is not None for o in members):
            out[f"train_reward/{role.value}"] = _mean([o.training_reward or 0.0 for o in members])
        out[f"response_len/{role.value}"] = _mean([float(o.response_len) for o in members])
        out[f"truncated/{role.value}"] = _mean([float(o.truncated) for o in members])
    out["rollout/prompt_tokens"] = float(sum(o.prompt_len for o in outputs))
    out["rollout/response_tokens"] = float(sum(o.response_len for o in outputs))
    verifiers = by_role.get(Role.VERIFIER, [])
    if verifiers:
        out["verifier/unparsed"] = _mean([float(o.verdict is None) for o in verifiers])
    # Verifier and Corrector rewards depend on what they were given: split by whether the judged solution
    # was right, so a shift in the input mix is not mistaken for learning (or forgetting).
    for role in (Role.VERIFIER, Role.CORRECTOR):
        for truth, name in ((True, "on_right"), (False, "on_wrong")):
            members = [o for o in by_role.get(role, []) if o.judged_right is truth]
            out[f"{role.value}/{name}"] = _mean([o.reward for o in members]) if members else float("nan")
            out[f"{role.value}/{name}_samples"] = float(len(members))
    return out


def _metrics(
    by_position: Mapping[Position, list[Node]],
    problems: Sequence[Problem],
    training_reward: Mapping[int, float],
) -> dict[str, float]:
    outputs = [
        Scored(
            position,
            n.agent_reward,
            None if n.judged is None else n.judged.agent_reward > 0,
            len(n.prompt_ids),
            len(n.output.token_ids),
            n.output.finish_reason == "length",
            n.record.verdict,
            training_reward[id(n)],
        )
        for position, nodes in by_position.items()
        for n in nodes
    ]
    return {"problems": float(len(problems)), **role_metrics(outputs)}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
