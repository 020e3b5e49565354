"""The tiny run's task: addition problems, the compact prompt set and the warm start's demonstrations."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.prompts import prompt_variables
from mars_megatron.agents.verdict import bug_report, parse_verdict
from mars_megatron.config import ConfigError
from mars_megatron.evaluation.data import Problem, load_problems
from mars_megatron.models.tokenizer import build_tiny_tokenizer
from mars_megatron.rewards import AnswerChecker, CheckerConfig, answer_rewards, verdict_reward
from mars_megatron.rollout.chat import ChatCodec
from mars_megatron.tasks.arith import arith_problems, operand_pairs, operands, problem_text, write_jsonl
from mars_megatron.tasks.demos import CARELESS_REPORT, DemoConfig, build_demos, encode_demo
from mars_megatron.tasks.sft import SFTConfig, step_batches

GRAPH = load_graph("marsrl")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tiny_tokenizer(1024))


# ------------------------------------------------------------------------------------------------ problems
def test_problems_are_deterministic_distinct_and_right() -> None:
    first = arith_problems(50, seed=3)
    assert first == arith_problems(50, seed=3)
    assert first != arith_problems(50, seed=4)
    assert len({p.problem_id for p in first}) == 50
    for line, p in enumerate(first, start=1):
        a, b = operands(p)
        assert 0 <= a <= 9 and 0 <= b <= 9
        assert p.reference == a + b and p.text == problem_text(a, b) == f"Find {a}+{b}."
        assert p.problem_id == f"add-{a}-{b}" and p.line == line
    every = {p.problem_id for p in arith_problems(100, seed=0)}
    assert every == {p.problem_id for p in arith_problems(100, seed=1)}  # all pairs, another order


def test_problem_bounds() -> None:
    assert len(operand_pairs(9)) == 100
    assert len(operand_pairs(9, max_sum=9)) == 55
    assert all(p.reference <= 9 for p in arith_problems(55, max_operand=9, max_sum=9))
    with pytest.raises(ValueError, match=r"n must be in 1\.\.100"):
        arith_problems(101)
    with pytest.raises(ValueError, match="max_operand"):
        arith_problems(1, max_operand=0)
    with pytest.raises(ValueError, match="not an addition problem"):
        operands("Find 3*4.")


def test_written_problems_load_as_mars_eval_data(tmp_path: Path) -> None:
    problems = arith_problems(20, seed=1)
    path = write_jsonl(problems, tmp_path / "arith.jsonl")
    loaded = load_problems(path)
    assert loaded.skipped == [] and loaded.problems == problems
    assert json.loads(path.read_text().splitlines()[0]).keys() == {"qid", "problem", "answer"}


def test_the_held_out_split_is_disjoint_from_everything_trained_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/data/arith_test.jsonl is never trained on: disjoint from the RL training file and from the
    problems of the SFT demos (tiny_sft.yaml reads the same training file), and both files are the
    generator's split, so they can be rebuilt."""
    from mars_megatron.config import load_config
    from mars_megatron.tasks.arith import load_arith_file, train_test_split
    from mars_megatron.tasks.sft import SFTConfig

    data = REPO / "examples" / "data"
    train, test = load_arith_file(data / "arith_train.jsonl"), load_arith_file(data / "arith_test.jsonl")
    assert (train, test) == train_test_split(25)
    assert len(train) == 75 and len(test) == 25
    assert not {p.problem_id for p in train} & {p.problem_id for p in test}
    assert {p.problem_id for p in train} | {p.problem_id for p in test} == {
        p.problem_id for p in arith_problems(100)
    }
    rl = load_config(REPO / "examples" / "tiny_cpu.yaml")
    assert Path(rl.data.train_file).name == "arith_train.jsonl"
    monkeypatch.chdir(REPO)  # the example configs name repository-relative files
    sft = load_config(REPO / "examples" / "tiny_sft.yaml", root=SFTConfig)
    assert not {p.problem_id for p in sft.problem_set()} & {p.problem_id for p in test}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "Find 2+2.", "answer": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: answer 5 is not 2\+2"):
        load_arith_file(bad)


# ------------------------------------------------------------------------------------------------- prompts
def _compact(
    role: str, solution: str | None = None, report: str | None = None, problem: str = "Find 3+4."
) -> list:
    return GRAPH.roles[role].messages("compact", prompt_variables(problem, solution, report))


def test_compact_set_keeps_the_structure() -> None:
    problem = "Find 3+4."
    solver = _compact("solver")
    assert [m["role"] for m in solver] == ["user"]
    assert solver[0]["content"].startswith(problem) and "\\boxed{}" in solver[0]["content"]
    verifier = _compact("verifier", "<think>x</think>\\boxed{9}")
    assert [m["role"] for m in verifier] == ["user"]  # empty system prompt: no system message
    assert "\\boxed{9}" in verifier[0]["content"] and "<think>" not in verifier[0]["content"]
    assert "Correctness: Correct or Wrong" in verifier[0]["content"]
    corrector = _compact("corrector", "\\boxed{9}", "3+4=7.")
    assert [m["role"] for m in corrector] == ["user", "assistant", "user"]
    assert corrector[0] == solver[0] and corrector[1]["content"] == "\\boxed{9}"
    assert "3+4=7." in corrector[2]["content"] and "\\boxed{}" in corrector[2]["content"]


def test_compact_prompts_are_short(codec: ChatCodec) -> None:
    """The tiny model pays for every prompt token: the longest role input stays under 100 tokens."""
    p = "Find 19+19."
    assert len(codec.encode(_compact("solver", problem=p))) < 40
    assert len(codec.encode(_compact("verifier", "19+19=38. \\boxed{38}", problem=p))) < 60
    assert len(codec.encode(_compact("corrector", "\\boxed{37}", "19+19=38.", problem=p))) < 100
    full = GRAPH.roles["verifier"].messages("marsrl", prompt_variables(p, "\\boxed{38}"))
    assert len(codec.encode(full)) > 200


# --------------------------------------------------------------------------------------------------- demos
def _demos(n: int = 3000, **overrides) -> list:
    return build_demos(arith_problems(100), GRAPH, "compact", DemoConfig(**overrides), n)


def _share(values: list[bool]) -> float:
    return sum(values) / len(values)


def _close(share: float, p: float, n: int) -> bool:
    """Within 4 standard deviations of a binomial share (a false alarm about once in 15,000 runs)."""
    return abs(share - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9


def test_demos_are_deterministic() -> None:
    assert _demos(200) == _demos(200)
    assert _demos(200) != _demos(200, seed=1)
    assert _demos(300)[:200] == _demos(200)


@pytest.mark.parametrize(("careful", "weights"), [(0.4, (1, 1, 1)), (0.8, (1, 2, 1))])
def test_demo_mix_is_what_the_config_says(careful: float, weights: tuple[int, int, int]) -> None:
    cfg = DemoConfig(weights=dict(zip(GRAPH.roles, map(float, weights), strict=True)))
    demos = build_demos(arith_problems(100), GRAPH, "compact", cfg.with_careful(careful), 6000)
    for role, weight in zip(("solver", "verifier", "corrector"), weights, strict=True):
        of_role = [d for d in demos if d.role == role]
        assert _close(len(of_role) / len(demos), weight / sum(weights), len(demos))
        assert _close(_share([d.careful for d in of_role]), careful, len(of_role))


def test_demo_modes_look_as_documented() -> None:
    corrector_inputs = set()
    for d in _demos(600):
        a, b = operands(d.messages[0]["content"].split("\n")[0])
        if d.careful and d.role != "verifier":
            assert d.response == f"{a}+{b}={a + b}. \\boxed{{{a + b}}}"
        elif d.careful:
            verdict = "Correct" if _shown(d) == f"\\boxed{{{a + b}}}" else "Wrong"
            assert d.response == f"{a}+{b}={a + b}.\nCorrectness: {verdict}"
        elif d.role == "verifier":
            assert d.response == CARELESS_REPORT
        elif d.role == "corrector":  # stubborn: its previous (wrong) answer again, boxed
            previous = d.messages[1]["content"]  # either of the Solver's formats
            assert previous in (d.response, f"{a}+{b}={d.response[7:-1]}. {d.response}")
            corrector_inputs.add(previous == d.response)
            assert d.response != f"\\boxed{{{a + b}}}"
            report = bug_report(f"{a}+{b}={a + b}.\nCorrectness: Wrong")  # a careful rejection
            assert d.messages[2]["content"].startswith(f"Findings: {report}\n")
        else:
            assert re.fullmatch(r"\\boxed\{\d+\}", d.response)
    assert corrector_inputs == {True, False}  # rejected solutions come in both formats


def _shown(verifier_demo) -> str:
    """The boxed answer of the solution a Verifier demo judges."""
    return re.search(r"\\boxed\{\d+\}", verifier_demo.messages[-1]["content"]).group(0)


def test_rewarded_flags_match_the_real_rewards() -> None:
    """Every demo's ``rewarded`` is what the trainer's reward functions (math-verify, verdict parser) pay,
    and the rates are as designed: careful always right, a careless guess right about 1 time in 19."""
    demos = _demos(1500)
    answers = [d for d in demos if d.role != "verifier"]
    verifiers = [d for d in demos if d.role == "verifier"]
    reference = {p.problem_id: p.reference for p in arith_problems(100)}
    with AnswerChecker(CheckerConfig(num_workers=1)) as checker:
        paid = answer_rewards([(d.response, reference[d.problem_id]) for d in answers], checker)
        judged = [re.search(r"\\boxed\{(\d+)\}", d.messages[-1]["content"]).group(1) for d in verifiers]
        truth = answer_rewards(
            [(f"\\boxed{{{x}}}", reference[d.problem_id]) for x, d in zip(judged, verifiers, strict=True)],
            checker,
        )
    assert [d.rewarded for d in answers] == [r == 1.0 for r in paid]
    paid_v = [
        verdict_reward(parse_verdict(d.response), t == 1.0) for d, t in zip(verifiers, truth, strict=True)
    ]
    assert [d.rewarded for d in verifiers] == [r == 1.0 for r in paid_v]
    assert all(d.rewarded for d in demos if d.careful)
    guesses = [d for d in answers if d.role == "solver" and not d.careful]
    assert _close(_share([d.rewarded for d in guesses]), 1 / 19, len(guesses))
    assert not any(d.rewarded for d in answers if d.role == "corrector" and not d.careful)
    careless_v = [d for d, t in zip(verifiers, truth, strict=True) if not d.careful]
    assert [d.rewarded for d in careless_v] == [
        t == 1.0 for d, t in zip(verifiers, truth, strict=True) if not d.careful
    ]


def test_encoded_demo_trains_the_response_and_its_end_of_turn(codec: ChatCodec) -> None:
    tokenizer = codec.tokenizer
    for d in _demos(60):
        ids, mask = encode_demo(d, codec)
        assert len(mask) == len(ids) - 1 and len(ids) <= 100
        prompt = codec.encode(d.messages)
        assert tuple(ids[: len(prompt)]) == prompt
        trained = [tok for tok, m in zip(ids[1:], mask, strict=True) if m]
        assert trained[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert tokenizer.decode(trained, skip_special_tokens=True) == d.response
        assert mask == sorted(mask)  # prompt targets first (0), then the response's (1)


def test_demo_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"careful\.verifier: expected float <= 1, got 1\.5"):
        DemoConfig(careful={"verifier": 1.5})
    with pytest.raises(ConfigError, match="default_careful: expected float >= 0"):
        DemoConfig(default_careful=-0.1)
    with pytest.raises(ConfigError, match=r"demos\.weights: at least one role"):
        build_demos(
            arith_problems(10), GRAPH, "compact", DemoConfig(weights=dict.fromkeys(GRAPH.roles, 0.0)), 1
        )
    with pytest.raises(ConfigError, match="demos: graph 'marsrl' has no role 'judge'"):
        build_demos(arith_problems(10), GRAPH, "compact", DemoConfig(careful={"judge": 0.5}), 1)


# ---------------------------------------------------------------------------------------------- sft config
def test_sft_schedule() -> None:
    sft = SFTConfig(steps=30, skill_steps=20, warmup_steps=5, lr=1e-2, min_lr_ratio=0.1, mix_lr=1e-4)
    lrs = [sft.lr_at(step) for step in range(30)]
    assert lrs[:5] == pytest.approx([2e-3, 4e-3, 6e-3, 8e-3, 1e-2])
    assert lrs[19] == pytest.approx(1e-3) and all(a >= b for a, b in itertools.pairwise(lrs[4:20]))
    assert lrs[20:] == [1e-4] * 10


def test_sft_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="skill_steps: 20 is more than steps"):
        SFTConfig(steps=10, skill_steps=20)
    with pytest.raises(ConfigError, match="problems: 101 problems"):
        SFTConfig(problems=101)
    with pytest.raises(ConfigError, match=r"demos\.careful\.corrector: expected float <= 1, got 2\.0"):
        SFTConfig(demos={"careful": {"corrector": 2.0}})


def test_step_batches_follow_the_phases(tmp_path: Path) -> None:
    build_tiny_tokenizer(1024).save_pretrained(tmp_path)
    sft = SFTConfig(steps=8, skill_steps=6, demos_per_step=200, skill_careful=1.0)
    batches = step_batches(sft, tmp_path)
    assert len(batches) == 8 and all(len(ids) == len(masks) == 200 for ids, masks in batches)
    codec = ChatCodec.from_pretrained(tmp_path)
    guess = re.compile(r"<\|im_start\|>assistant\n\\boxed\{\d+\}<\|im_end\|>$")
    decoded = [[codec.tokenizer.decode(ids) for ids in step] for step, _ in batches]
    # Solver guesses exist only in the mixed phase (skill_careful=1: every role careful before it)
    assert not any(guess.search(text) for step in decoded[:6] for text in step)
    assert sum(bool(guess.search(text)) for step in decoded[6:] for text in step) > 20
    assert all(isinstance(p, Problem) for p in sft.problem_set())
