"""Tool calls served inside a response (the tool_pair graph; ToolSpec in agents/graph.py), as the schedule
runs them (one synchronous round in this process, pipeline/local.py) with the real tokenizer, chat template,
sandboxed calculator and math-verify rewards; the policy is a rule-based engine over token ids."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.algorithm.advantages import assign_advantages, balance_roles
from mars_megatron.config import AgentsConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.models.presets import init_model
from mars_megatron.pipeline.local import Round, run_round
from mars_megatron.pipeline.scheduler import SeqState
from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams

GRAPH = load_graph("tool_pair")
PAIRS = [(372, 45), (18, 999), (250, 250)]
PROBLEMS = [Problem(f"add-{a}-{b}", f"Find {a}+{b}.", a + b, i) for i, (a, b) in enumerate(PAIRS)]


class ToolEngine:
    """A reasoner that calls the calculator when its seed is even (else guesses wrong) and copies the
    digest; a distiller that reports the calculator's sum when its seed is not divisible by 3 (else a
    wrong number). A reasoner that sees ``twice`` in its prompt calls again after the observation."""

    def __init__(self, codec: ChatCodec, twice: bool = False) -> None:
        self.codec, self.twice = codec, twice
        self.eos = int(codec.tokenizer.eos_token_id)

    def _text(self, context: str, seed: int) -> str:
        if "Write the sum." in context:  # the distiller, given the tool's output
            total = int(re.findall(r"= (\d+)", context)[-1])
            return f"the sum is {total}." if seed % 3 else "7."
        a, b = map(int, re.findall(r"Find (\d+)\+(\d+)\.", context)[0])
        digests = re.findall(r"RESULT (.*)", context)
        if digests and not (self.twice and len(digests) == 1):
            numbers = re.findall(r"\d+", digests[-1])
            return f"\\boxed{{{numbers[-1] if numbers else 0}}}"
        if digests or seed % 2 == 0:
            return f"use calc {a}+{b} for the sum"
        return f"\\boxed{{{a + b + 1}}}"

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        out = []
        for r in requests:
            text = self._text(self.codec.tokenizer.decode(list(r.prompt_ids)), r.sampling.seed)
            ids = [*self.codec.tokenizer(text, add_special_tokens=False)["input_ids"], self.eos]
            out.append(GenerationOutput(r.request_id, ids, [-0.5] * len(ids), "stop"))
        return out


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> ChatCodec:
    return ChatCodec.from_pretrained(init_model("tiny-moe", tmp_path_factory.mktemp("m") / "hf"))


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(CheckerConfig(num_workers=1)) as c:
        yield c


def _round(codec: ChatCodec, checker, *, twice: bool = False, max_tokens: int = 48) -> Round:
    return run_round(
        PROBLEMS,
        engines=dict.fromkeys(GRAPH.roles, ToolEngine(codec, twice)),
        codec=codec,
        checker=checker,
        graph=GRAPH,
        agents=AgentsConfig(graph="tool_pair", prompts="compact", group_size=4),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        seed=5,
    )


def test_a_call_is_served_inside_the_response_and_masked_out_of_its_loss(codec: ChatCodec, checker) -> None:
    r = _round(codec, checker)
    reasoners = [q for q in r.samples if q.role == "reasoner"]
    distillers = [q for q in r.samples if q.role == "distiller"]
    callers = [q for q in reasoners if q.tool_calls]
    assert len(reasoners) == 4 * len(PROBLEMS) and 0 < len(callers) < len(reasoners)
    assert len(distillers) == len(callers)  # one digest per call
    for q in callers:
        mask = q.loss_mask.tolist()
        assert mask is not None and 0 in mask and mask[0] == 1 and mask[-1] == 1
        observed = [t for t, m in zip(q.response_ids, mask, strict=True) if m == 0]
        assert codec.tokenizer.decode(observed).startswith("\nRESULT ")
        first_turn_end = mask.index(0) - 1
        assert q.response_ids[first_turn_end] == codec.tokenizer.eos_token_id  # the turn that called, trained
        assert "use calc" in q.text and "RESULT" in q.text
        assert q.segment_versions[-1].end == q.response_len and q.behaviour_logprobs is not None
        (digest,) = [d for d in distillers if d.parent_id == q.sample_id]
        a, b = map(int, re.findall(r"\d+", q.problem_id))
        assert f"{a}+{b} = {a + b}" in codec.decode(digest.prompt_ids)  # the calculator's output
        assert set(digest.loss_mask.tolist()) == {1}  # its gradient covers its own tokens only
        # the answer copies the digest; the digest is rewarded by the outcome of the answer it served
        assert q.reward == float(f"the sum is {a + b}." == digest.text)
        assert digest.reward == q.reward
    assert all(q.tool_calls == 0 and set(q.loss_mask.tolist()) == {1} for q in reasoners if q not in callers)
    # the digests of one group of responses form one group; every group's members share their position
    groups = {d.group_id for d in distillers}
    assert len(groups) == len({q.group_id for q in callers})
    assert r.metrics["samples/distiller"] == len(distillers) and "reward/distiller" in r.metrics
    r.scheduler.check()


def test_calls_beyond_max_calls_are_not_served(codec: ChatCodec, checker) -> None:
    """A reasoner that asks again after its one allowed call ends its response with that request."""
    r = _round(codec, checker, twice=True)
    callers = [q for q in r.samples if q.role == "reasoner" and q.tool_calls]
    assert callers and all(q.tool_calls == 1 and q.text.rstrip().endswith("for the sum") for q in callers)
    assert all(q.reward == 0.0 for q in callers)


def test_no_budget_left_after_the_observation_cuts_the_response(codec: ChatCodec, checker) -> None:
    r = _round(codec, checker, max_tokens=16)
    callers = [q for q in r.samples if q.role == "reasoner" and q.tool_calls]
    assert callers and all(q.finish_reason == "length" and q.reward == 0.0 for q in callers)
    assert all(q.response_len <= 16 + 16 for q in callers)


def test_balanced_sampling_keeps_as_many_digests_as_responses(codec: ChatCodec, checker) -> None:
    samples, _ = assign_advantages(_round(codec, checker).samples, filter_zero_variance=False)
    reasoners = [s for s in samples if s.role == "reasoner"]
    doubled = samples + [s for s in samples if s.role == "distiller"] * 12  # many digests per response
    kept, stats = balance_roles(doubled, ["reasoner", "distiller"])
    assert sum(s.role == "distiller" for s in kept) == len(reasoners)
    assert [s for s in kept if s.role == "reasoner"] == reasoners
    dropped = [s for s in doubled if s.role == "distiller" and s not in kept]
    assert max(abs(s.advantage or 0) for s in dropped) <= min(
        abs(s.advantage or 0) for s in kept if s.role == "distiller"
    )
    assert stats["balance/dropped/distiller"] == len(doubled) - len(kept)
    assert balance_roles(samples, [])[0] == samples


def test_a_schedule_saved_while_a_digest_is_written_resumes(codec: ChatCodec) -> None:
    """Save with a response parked on its call and the digest not yet written; the restored scheduler
    serves the call and ends where the original does, masks included."""
    from mars_megatron.pipeline.agents import prompt_builder, record_outputs
    from mars_megatron.pipeline.scheduler import Limits, Scheduler

    limits = Limits(48, 48, dict.fromkeys(GRAPH.roles, 0), 1, 1)
    agents = AgentsConfig(graph="tool_pair", prompts="compact", group_size=2)
    prompts = prompt_builder(GRAPH, "compact", codec.encode)
    engine = ToolEngine(codec)

    def step(s: Scheduler) -> list[str]:
        jobs = s.take_segments()
        params = [SamplingParams(max_tokens=j.max_tokens, seed=0) for j in jobs]
        reqs = [
            GenerationRequest(j.sample_id, tuple(j.context()), p) for j, p in zip(jobs, params, strict=True)
        ]
        done = record_outputs(s, jobs, engine.generate(reqs), codec.decode, encode_text=codec.encode_text)
        for sid in done:
            s.on_scored(sid, 1.0)
        return done

    s = Scheduler(agents, limits, prompts, GRAPH, seed=0)
    s.add_problems(PROBLEMS[:1])
    step(s)  # seed 0: both reasoners call
    parked = [sid for sid in s.samples if s.state(sid) is SeqState.TOOL]
    assert len(parked) == 2
    restored = Scheduler(agents, limits, prompts, GRAPH, seed=0)
    restored.load_state_dict(s.state_dict())
    for x in (s, restored):
        while step(x):
            pass
    assert {k: (q.response_ids.tolist(), q.loss_mask.tolist()) for k, q in s.samples.items()} == {
        k: (q.response_ids.tolist(), q.loss_mask.tolist()) for k, q in restored.samples.items()
    }
    assert all(restored.samples[sid].tool_calls == 1 for sid in parked)
