"""The subset-sum task: its problems and held-out split (disjoint by list, the shipped files), and the warm
start's demonstrations (modes, rewarded flags against the real checker, the careful walk's reach). The
checker itself: tests/test_subset_sum_checker.py."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.verdict import bug_report, parse_verdict
from mars_megatron.config import ConfigError, load_config
from mars_megatron.models.tokenizer import build_tiny_tokenizer
from mars_megatron.rewards import AnswerChecker, CheckerConfig, answer_rewards, verdict_reward
from mars_megatron.rewards.subset_sum import parse_answer
from mars_megatron.tasks import subset_sum as task
from mars_megatron.tasks.demos import DemoConfig, encode_demo
from mars_megatron.tasks.sft import SFTConfig, step_batches
from mars_megatron.tasks.subset_demos import (
    CARELESS_REPORT,
    attempt,
    build_subset_demos,
    careful_report,
    first_try,
    next_try,
)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
GRAPH = load_graph("marsrl")


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(CheckerConfig(num_workers=1)) as c:
        yield c


# ------------------------------------------------------------------------------------------- the problems
def test_the_split_is_disjoint_by_list_and_the_shipped_files_are_it(tmp_path: Path) -> None:
    train, test = task.train_test_split()
    assert (task.load_subset_file(DATA / task.TRAIN_FILE), task.load_subset_file(DATA / task.TEST_FILE)) == (
        train,
        test,
    )
    assert len(test) == 100 and len(train) > 700
    assert task.train_test_split() == (train, test)  # deterministic
    assert task.train_test_split(seed=1) != (train, test)
    lists = {
        split: {task.parse_problem(p).numbers for p in problems}
        for split, problems in (("train", train), ("test", test))
    }
    assert not lists["train"] & lists["test"]  # no held-out list is ever trained on, with any target
    every = [(n, t) for n in task.every_list() for t in task.pair_targets(n)]
    got = [(task.parse_problem(p).numbers, task.parse_problem(p).target) for p in train + test]
    assert len(set(got)) == len(got) and set(got) <= set(every)
    for line, p in enumerate(test, start=1):
        problem = task.parse_problem(p)
        assert (
            p.line == line
            and p.reference
            == problem.text
            == f"subset_sum: {' '.join(map(str, problem.numbers))} = {problem.target}"
        )
        assert len(problem.numbers) == 5 and list(problem.numbers) == sorted(set(problem.numbers))
        assert problem.target not in problem.numbers
        assert any(a + b == problem.target for a, b in itertools.combinations(problem.numbers, 2))
    assert test[0].text == task.problem_text(
        task.parse_problem(test[0]).numbers, task.parse_problem(test[0]).target
    )
    # the training config's held-out file is not trained on (mars train refuses an overlap too)
    rl = load_config(REPO / "examples" / "subset_cpu.yaml")
    assert (Path(rl.data.train_file).name, Path(rl.evaluation.test_file).name) == (
        task.TRAIN_FILE,
        task.TEST_FILE,
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"problem": "Pick from 1,2,3 to sum 4.", "answer": "subset_sum: 1 2 3 = 5"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: answer 'subset_sum: 1 2 3 = 5' is not"):
        task.load_subset_file(bad)


# ---------------------------------------------------------------------------------------------- the demos
def _demos(n: int, careful: float = 0.5, seed: int = 0) -> list:
    train, _ = task.train_test_split()
    return build_subset_demos(train, GRAPH, "compact", DemoConfig(default_careful=careful, seed=seed), n)


def test_demos_are_deterministic_and_tell_their_modes_apart_by_the_first_character() -> None:
    demos = _demos(600)
    assert demos == _demos(600) and demos != _demos(600, seed=1) and _demos(700)[:600] == demos
    for d in demos:
        assert d.response[0].isdigit() == d.careful, (
            d
        )  # careful: a subtraction; careless: \boxed or a verdict
    assert Counter(d.role for d in demos).keys() == {"solver", "verifier", "corrector"}


def test_demo_modes_look_as_documented() -> None:
    for d in _demos(900):
        problem = task.parse_problem(d.messages[0]["content"].split("\n")[0])
        if d.role == "solver":
            if d.careful:
                assert d.response == attempt(problem, problem.numbers[0])
            else:
                assert re.fullmatch(r"\\boxed\{(\d)\+(\d)\}", d.response)
                a, b = map(int, re.findall(r"\d", d.response))
                assert a != b and {a, b} <= set(problem.numbers)
        elif d.role == "verifier":
            judged = d.messages[-1]["content"].split("\n")[1].removeprefix("Solution: ")
            chosen = parse_answer(re.search(r"\\boxed\{(.*)\}", judged).group(1))
            assert d.response == (careful_report(problem, chosen) if d.careful else CARELESS_REPORT)
            if d.careful:  # the careful verdict is the checker's truth
                assert parse_verdict(d.response) == problem.is_solution(chosen)
        else:
            rejected = parse_answer(re.search(r"\\boxed\{(.*)\}", d.messages[1]["content"]).group(1))
            assert not problem.is_solution(rejected)  # a revision revises a wrong solution ...
            report = bug_report(careful_report(problem, rejected))  # ... that a careful report rejected
            assert d.messages[2]["content"].startswith(f"Findings: {report}\n")
            if d.careful:  # the next candidate, never the rejected answer again
                assert d.response == attempt(problem, next_try(problem, rejected[0]))
                assert parse_answer(re.search(r"\\boxed\{(.*)\}", d.response).group(1)) != rejected
            else:  # stubborn
                assert d.response == "\\boxed{" + "+".join(map(str, rejected)) + "}"


def test_rewarded_flags_match_the_real_rewards(checker: AnswerChecker) -> None:
    """Every demo's ``rewarded`` is what the trainer pays (the checker, the verdict parser), and the rates
    are as designed: the careful Solver right on about 38 % of the problems, careful Verifiers always."""
    demos = _demos(3000)
    reference = {p.problem_id: p.reference for p in task.train_test_split()[0]}
    answers = [d for d in demos if d.role != "verifier"]
    verifiers = [d for d in demos if d.role == "verifier"]
    paid = answer_rewards([(d.response, reference[d.problem_id]) for d in answers], checker)
    assert [d.rewarded for d in answers] == [r == 1.0 for r in paid]
    truth = answer_rewards([(d.messages[-1]["content"], reference[d.problem_id]) for d in verifiers], checker)
    paid_v = [
        verdict_reward(parse_verdict(d.response), t == 1.0) for d, t in zip(verifiers, truth, strict=True)
    ]
    assert [d.rewarded for d in verifiers] == [r == 1.0 for r in paid_v]
    assert all(d.rewarded for d in verifiers if d.careful)

    def rate(role: str, careful: bool) -> float:
        of = [d.rewarded for d in demos if d.role == role and d.careful == careful]
        return sum(of) / len(of)

    assert 0.3 < rate("solver", True) < 0.47 and rate("solver", False) < 0.16
    assert rate("corrector", True) > 0.5 and rate("corrector", False) == 0.0


def test_the_careful_walk_finds_every_answer() -> None:
    """The mechanism's upper bound: the careful Solver's try and the careful Corrector's next tries reach a
    right pair on every problem within four candidates, while the first try alone is right on 38 %."""
    train, test = task.train_test_split()
    first = 0
    for p in train + test:
        problem = task.parse_problem(p)
        tries = [first_try(problem)]
        while len(tries) < 4:
            tries.append(next_try(problem, tries[-1]))
        right = [problem.is_solution((a, problem.target - a)) for a in tries]
        assert any(right), p
        first += right[0]
    assert 0.35 < first / len(train + test) < 0.42


def test_subset_sft_config_builds_its_demos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the example configs name repository-relative files
    sft = load_config(REPO / "examples" / "subset_sft.yaml", root=SFTConfig)
    assert (
        sft.task == "subset_sum"
        and sft.prompts == load_config(REPO / "examples" / "subset_cpu.yaml").agents.prompts
    )
    assert sft.problem_set() == task.train_test_split()[0]
    build_tiny_tokenizer(1024).save_pretrained(tmp_path)
    small = SFTConfig(task="subset_sum", steps=3, skill_steps=2, demos_per_step=20)
    batches = step_batches(small, tmp_path)
    assert len(batches) == 3 and all(len(ids) == 20 for ids, _ in batches)
    from mars_megatron.rollout.chat import ChatCodec

    codec = ChatCodec.from_pretrained(tmp_path)
    demo = _demos(1)[0]
    ids, mask = encode_demo(demo, codec)
    assert (
        codec.tokenizer.decode([t for t, m in zip(ids[1:], mask, strict=True) if m], skip_special_tokens=True)
        == demo.response
    )
    with pytest.raises(ConfigError, match="task: expected one of"):
        SFTConfig(task="countdown")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no subset-sum demos for role 'verifier' \(report, verdict None\)"):
        build_subset_demos(task.train_test_split()[1], load_graph("imo_refine"), "compact", DemoConfig(), 50)
