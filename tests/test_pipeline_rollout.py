"""MarsRL's grouped agentic rollout as the schedule runs it (one synchronous round in this process,
mars_megatron/pipeline/local.py) with real tokenizer, chat template and math-verify rewards. The policy
is a rule-based engine over token ids (the logic under test is the expansion, selection and reward
bookkeeping; the transformers/vLLM engines are tested elsewhere and run this code end to end on Ray in
tests/test_rl_loop.py and tests/test_pipeline_loop.py)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.sample import Sample, group_id
from mars_megatron.config import AgentsConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.models.presets import init_model
from mars_megatron.pipeline.local import Round, run_round
from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams
from mars_megatron.seeds import derive_seed

PROBLEMS = [Problem(f"add-{a}-{b}", f"Find {a}+{b}.", a + b, i) for i, (a, b) in enumerate([(3, 4), (9, 8)])]


class RuleEngine:
    """Answers like a noisy adder: the Solver is right when its request seed is even; the Verifier
    recomputes correctly (so judges right) unless the seed is divisible by 3; the Corrector is right
    when the seed is divisible by 5. Decodes from and encodes to real token ids."""

    def __init__(self, codec: ChatCodec) -> None:
        self.codec = codec
        self.calls: list[list[str]] = []

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
        self.calls.append([r.request_id for r in requests])
        out = []
        for r in requests:
            prompt = self.codec.decode(r.prompt_ids)
            ids = self.codec.tokenizer(self._text(prompt, r.sampling.seed))["input_ids"]
            out.append(GenerationOutput(r.request_id, list(ids), [-0.5] * len(ids), "stop"))
        return out


GRAPH = load_graph("marsrl")
ROLES = tuple(GRAPH.roles)


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> ChatCodec:
    return ChatCodec.from_pretrained(init_model("tiny-moe", tmp_path_factory.mktemp("m") / "hf"))


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(CheckerConfig(num_workers=1)) as c:
        yield c


def _round(codec: ChatCodec, checker, *, reward="agent", strategy="adaptive", max_steps=5, seed=11,
           engine: RuleEngine | None = None, max_batch: int = 64) -> Round:  # fmt: skip
    return run_round(
        PROBLEMS,
        engines=dict.fromkeys(ROLES, engine or RuleEngine(codec)),
        codec=codec,
        checker=checker,
        graph=GRAPH,
        agents=AgentsConfig(
            prompts="compact", group_size=4, inputs_per_agent=2, max_steps=max_steps, strategy=strategy
        ),
        sampling=SamplingParams(max_tokens=16, temperature=1.0),
        seed=seed,
        reward=reward,
        max_batch=max_batch,
        version=7,
    )


def test_grouped_expansion_and_agent_rewards(codec: ChatCodec, checker) -> None:
    engine = RuleEngine(codec)
    result = _round(codec, checker, engine=engine, max_batch=10)
    seqs = {q.sample_id: q for q in result.batch.samples}
    problem = result.scheduler.problem
    by_pos = Counter(q.position for q in seqs.values())
    assert by_pos["solver"] == 2 * 4  # G per problem
    assert by_pos["verifier_1"] == 2 * 2 * 4  # two inputs per problem, G each
    assert by_pos["corrector_1"] > 0 and by_pos["verifier_2"] > 0
    assert all(len(call) <= 10 for call in engine.calls)  # the engine's batches respect max_batch
    assert sorted(i for call in engine.calls for i in call) == sorted(seqs)  # every output decoded once
    for q in seqs.values():
        parent = seqs.get(q.parent_id) if q.parent_id else None
        answer = f"{{{problem(q).reference}}}" in q.text
        if q.position == "solver":
            assert q.reward == float(answer) and parent is None
        elif q.role == "verifier":
            assert q.judged_id == q.parent_id and parent.position in ("solver", "corrector_1")
            assert q.verdict is not None
            assert q.reward == float(q.verdict == (parent.reward == 1.0))
        else:  # Corrector: its input is a Verifier that found errors, on the solution it revises
            assert parent.verdict is False and q.judged_id == parent.judged_id
            assert q.reward == float(answer)
        assert problem(q).text in codec.decode(q.prompt_ids)
    groups = Counter(s.group_id for s in result.samples)
    assert set(groups.values()) == {4}
    for s in result.samples:
        q = seqs[s.sample_id]
        assert s.reward == q.reward and s.role == q.role and s.prompt_ids.tolist() == q.prompt_ids.tolist()
        assert s.group_id == group_id(q.trajectory_id, q.position, q.parent_id)
        assert s.behaviour_logprobs.tolist() == [-0.5] * s.response_len
        assert [(seg.start, seg.end, seg.version) for seg in s.segment_versions] == [(0, s.response_len, 7)]
    m = result.metrics
    solvers = [q.reward for q in seqs.values() if q.position == "solver"]
    assert m["samples/solver"] == 8 and m["reward/solver"] == pytest.approx(sum(solvers) / 8)
    assert m["problems"] == 2
    for role in ("solver", "verifier", "corrector"):
        assert f"reward/{role}" in m and f"samples/{role}" in m
    for role in ("verifier", "corrector"):  # split by whether the judged solution was right
        mine = [q for q in seqs.values() if q.role == role]
        assert m[f"{role}/on_right_samples"] + m[f"{role}/on_wrong_samples"] == len(mine)
        wrong = [q.reward for q in mine if seqs[q.judged_id].reward == 0]
        assert m[f"{role}/on_wrong"] == pytest.approx(sum(wrong) / len(wrong))


def test_adaptive_verifier_takes_incorrect_solutions_first(codec: ChatCodec, checker) -> None:
    result = _round(codec, checker, max_steps=2, seed=5)
    seqs = {q.sample_id: q for q in result.batch.samples}
    for problem in PROBLEMS:
        mine = [q for q in seqs.values() if q.problem_id == problem.problem_id]
        wrong = sum(q.reward == 0 for q in mine if q.position == "solver")
        judged = {q.parent_id for q in mine if q.position == "verifier_1"}
        assert len(judged) == 2
        assert sum(seqs[j].reward == 0 for j in judged) == min(2, wrong)


def test_rollout_is_a_function_of_the_seed(codec: ChatCodec, checker) -> None:
    def texts(seed: int, max_batch: int) -> list[tuple[str, str]]:
        return sorted(
            (q.sample_id, q.text)
            for q in _round(codec, checker, seed=seed, max_batch=max_batch).batch.samples
        )

    assert texts(9, 64) == texts(9, 3)  # whatever the engine batches
    assert texts(9, 64) != texts(10, 64)
    assert derive_seed(1, 2) != derive_seed(2, 1) and derive_seed(1, 2) == derive_seed(1, 2)


def test_shared_reward_is_the_trajectory_outcome(codec: ChatCodec, checker) -> None:
    agent = _round(codec, checker, seed=2)
    shared = _round(codec, checker, seed=2, reward="shared")
    assert [q.text for q in agent.batch.samples] == [q.text for q in shared.batch.samples]
    # the agent-specific rewards are still what is reported, the training rewards differ
    assert agent.metrics["reward/verifier"] == shared.metrics["reward/verifier"]
    assert "train_reward/verifier" in shared.metrics and "train_reward/verifier" not in agent.metrics
    reward = {s.sample_id: s.reward_trained_on for s in shared.samples}
    seqs = {q.sample_id: q for q in shared.batch.samples}
    children: dict[str, list[Sample]] = {}
    for q in seqs.values():
        if q.parent_id:
            children.setdefault(q.parent_id, []).append(q)

    def outcome(q: Sample) -> float:  # written out independently of the implementation
        kids = children.get(q.sample_id)
        if kids:
            return sum(outcome(c) for c in kids) / len(kids)
        return seqs[q.judged_id].reward if q.role == "verifier" else q.reward

    for q in seqs.values():
        assert reward[q.sample_id] == pytest.approx(outcome(q))
        if q.role == "verifier" and q.sample_id not in children:
            assert reward[q.sample_id] == seqs[q.judged_id].reward
    assert any(reward[q.sample_id] != q.reward for q in seqs.values())


def test_missing_engine_or_problems_is_an_error(codec: ChatCodec, checker) -> None:
    args = dict(codec=codec, checker=checker, graph=GRAPH, agents=AgentsConfig(prompts="compact"),
                sampling=SamplingParams(max_tokens=4), seed=0)  # fmt: skip
    with pytest.raises(ValueError, match="no engine for role"):
        run_round(PROBLEMS, engines={}, **args)
    with pytest.raises(ValueError, match="no problems"):
        run_round([], engines=dict.fromkeys(ROLES, RuleEngine(codec)), **args)
