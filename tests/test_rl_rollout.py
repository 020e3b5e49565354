"""MarsRL's grouped agentic rollout (mars_megatron/rl/rollout.py) with real tokenizer, chat template and
math-verify rewards. The policy is a rule-based engine over token ids (the logic under test is the
expansion, selection and reward bookkeeping; the transformers/vLLM engines are tested elsewhere and run
this code end to end in tests/test_rl_loop.py)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import pytest

from mars_megatron.agents.prompts import prompt_set
from mars_megatron.agents.roles import Role
from mars_megatron.agents.trajectory import Position, TrainingConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.models.presets import init_model
from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
from mars_megatron.rl.rollout import AgenticRollout, RolloutSettings, derive_seed
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams

PROBLEMS = [Problem(f"add-{a}-{b}", f"Find {a}+{b}.", a + b, i) for i, (a, b) in enumerate([(3, 4), (9, 8)])]


class RuleEngine:
    """Answers like a noisy adder: the Solver is right when its request seed is even; the Verifier
    recomputes correctly (so judges right) unless the seed is divisible by 3; the Corrector is right
    when the seed is divisible by 5. Decodes from and encodes to real token ids."""

    def __init__(self, codec: ChatCodec) -> None:
        self.codec = codec
        self.calls: list[int] = []

    def _text(self, prompt: str, seed: int) -> str:
        a, b = map(int, re.findall(r"Find (\d+)\+(\d+)\.", prompt)[0])
        if "Findings:" in prompt:  # Corrector
            return f"\\boxed{{{a + b if seed % 5 == 0 else a + b + 1}}}"
        if "Correctness" in prompt:  # Verifier
            shown = int(re.findall(r"Solution: \\boxed\{(\d+)\}", prompt)[-1])
            right = (shown == a + b) if seed % 3 else (shown != a + b)
            return f"{a}+{b}=?.\nCorrectness: {'Correct' if right else 'Wrong'}"
        return f"\\boxed{{{a + b if seed % 2 == 0 else a + b + 2}}}"

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        self.calls.append(len(requests))
        out = []
        for r in requests:
            prompt = self.codec.decode(r.prompt_ids)
            ids = self.codec.tokenizer(self._text(prompt, r.sampling.seed))["input_ids"]
            out.append(GenerationOutput(r.request_id, list(ids), [-0.5] * len(ids), "stop"))
        return out


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> ChatCodec:
    return ChatCodec.from_pretrained(init_model("tiny-moe", tmp_path_factory.mktemp("m") / "hf"))


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(CheckerConfig(num_workers=1)) as c:
        yield c


def _rollout(codec: ChatCodec, checker, *, reward: str = "agent", strategy: str = "adaptive", max_steps=5):
    engine = RuleEngine(codec)
    settings = RolloutSettings(
        agents=TrainingConfig(group_size=4, inputs_per_agent=2, max_steps=max_steps, strategy=strategy),
        sampling=SamplingParams(max_tokens=16, temperature=1.0),
        reward=reward,
    )
    engines = dict.fromkeys(Role, engine)
    return AgenticRollout(engines, codec, checker, prompt_set("compact"), settings, lambda role: 7), engine


def test_grouped_expansion_and_agent_rewards(codec: ChatCodec, checker) -> None:
    rollout, engine = _rollout(codec, checker)
    result = rollout.run(PROBLEMS, step=3, seed=11)
    nodes = {n.record.sample_id: n for n in result.nodes}
    by_pos = Counter(n.record.position for n in result.nodes)
    assert by_pos[Position.SOLVER] == 2 * 4  # G per problem
    assert by_pos[Position.VERIFIER_1] == 2 * 2 * 4  # two inputs per problem, G each
    assert len(engine.calls) == len(by_pos)  # one engine call per position, all problems batched
    for n in result.nodes:
        rec = n.record
        parent = nodes.get(rec.parent_id) if rec.parent_id else None
        if rec.position is Position.SOLVER:
            assert n.agent_reward == float(f"{{{n.problem.reference}}}" in n.text)
        elif rec.role.value == "verifier":
            assert parent is n.judged and parent.record.position.value in ("solver", "corrector_1")
            assert rec.verdict is not None
            assert n.agent_reward == float(rec.verdict == (parent.agent_reward == 1.0))
        else:  # Corrector: its input is a Verifier that found errors, on the solution it revises
            assert parent.record.found_errors and n.judged is parent.judged
            assert n.agent_reward == float(f"{{{n.problem.reference}}}" in n.text)
        # groups: same position, same parent => same group id; G members each
    groups = Counter(s.group_id for s in result.samples)
    assert set(groups.values()) == {4}
    for s in result.samples:
        node = nodes[s.sample_id]
        assert s.reward == node.agent_reward and s.role is node.record.role
        assert tuple(s.prompt_ids) == codec.encode(node.record.messages)
        assert s.behaviour_logprobs == [-0.5] * s.response_len
        assert [(seg.start, seg.end, seg.version) for seg in s.segment_versions] == [(0, s.response_len, 7)]
    m = result.metrics
    assert m["samples/solver"] == 8 and m["reward/solver"] == pytest.approx(
        sum(n.agent_reward for n in result.nodes if n.record.position is Position.SOLVER) / 8
    )
    for role in ("solver", "verifier", "corrector"):
        assert f"reward/{role}" in m and f"samples/{role}" in m
    for role in ("verifier", "corrector"):  # split by whether the judged solution was right
        mine = [n for n in result.nodes if n.record.role.value == role]
        assert m[f"{role}/on_right_samples"] + m[f"{role}/on_wrong_samples"] == len(mine)
        wrong = [n.agent_reward for n in mine if n.judged.agent_reward == 0]
        assert m[f"{role}/on_wrong"] == pytest.approx(sum(wrong) / len(wrong))


def test_adaptive_verifier_takes_incorrect_solutions_first(codec: ChatCodec, checker) -> None:
    rollout, _ = _rollout(codec, checker, max_steps=2)
    result = rollout.run(PROBLEMS, step=1, seed=5)
    nodes = {n.record.sample_id: n for n in result.nodes}
    for problem in PROBLEMS:
        solutions = [n for n in result.nodes if n.problem is problem and n.record.position is Position.SOLVER]
        wrong = sum(n.agent_reward == 0 for n in solutions)
        judged = {nodes[n.record.parent_id].record.sample_id for n in result.nodes
                  if n.problem is problem and n.record.position is Position.VERIFIER_1}  # fmt: skip
        assert len(judged) == 2
        assert sum(nodes[j].agent_reward == 0 for j in judged) == min(2, wrong)


def test_rollout_is_a_function_of_seed_and_step(codec: ChatCodec, checker) -> None:
    def texts(step: int, seed: int) -> list[str]:
        rollout, _ = _rollout(codec, checker)
        return [n.text for n in rollout.run(PROBLEMS, step=step, seed=seed).nodes]

    assert texts(2, 9) == texts(2, 9)
    assert texts(2, 9) != texts(3, 9)
    assert derive_seed(1, 2) != derive_seed(2, 1) and derive_seed(1, 2) == derive_seed(1, 2)


def test_shared_reward_is_the_trajectory_outcome(codec: ChatCodec, checker) -> None:
    agent, _ = _rollout(codec, checker)
    shared, _ = _rollout(codec, checker, reward="shared")
    a = agent.run(PROBLEMS, step=4, seed=2)
    s = shared.run(PROBLEMS, step=4, seed=2)
    assert [n.text for n in a.nodes] == [n.text for n in s.nodes]
    # the agent-specific rewards are still what is reported, the training rewards differ
    assert a.metrics["reward/verifier"] == s.metrics["reward/verifier"]
    reward = {x.sample_id: x.reward for x in s.samples}

    def outcome(node) -> float:  # written out independently of the implementation
        if node.children:
            return sum(outcome(c) for c in node.children) / len(node.children)
        return node.judged.agent_reward if node.record.role.value == "verifier" else node.agent_reward

    for n in s.nodes:
        assert reward[n.record.sample_id] == pytest.approx(outcome(n))
        if n.record.role.value == "verifier" and not n.children:
            assert reward[n.record.sample_id] == n.judged.agent_reward
    assert any(reward[n.record.sample_id] != n.agent_reward for n in s.nodes)


def test_missing_engine_is_an_error(codec: ChatCodec, checker) -> None:
    with pytest.raises(ValueError, match="no engine for role"):
        AgenticRollout({}, codec, checker, prompt_set("compact"), RolloutSettings(
            TrainingConfig(), SamplingParams(max_tokens=4)), lambda r: 0)  # fmt: skip
