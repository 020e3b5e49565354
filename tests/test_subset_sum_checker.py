"""The subset-sum task's programmatic checker: every valid answer accepted and nothing else, on hand-made
cases and exhaustively on small lists; its reference format on the reward path (AnswerChecker) and the data
path (load_problems names the line of a bad reference)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from mars_megatron.evaluation.data import load_problems
from mars_megatron.rewards import AnswerChecker, CheckerConfig, answer_rewards
from mars_megatron.rewards.answers import check_reference
from mars_megatron.rewards.subset_sum import SubsetSum, check_answer, parse_answer, parse_reference, reachable


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(CheckerConfig(num_workers=1)) as c:
        yield c


# ------------------------------------------------------------------------------------------------ checker
def _right_by_enumeration(numbers: tuple[int, ...], target: int) -> set[tuple[int, ...]]:
    """Every right answer as a sorted tuple: the non-empty index subsets of the list that reach the target."""
    right = set()
    for k in range(1, len(numbers) + 1):
        for idx in itertools.combinations(range(len(numbers)), k):
            if sum(numbers[i] for i in idx) == target:
                right.add(tuple(sorted(numbers[i] for i in idx)))
    return right


@pytest.mark.parametrize(
    ("numbers", "target"), [((2, 2, 5, 7, 9), 11), ((1, 3, 4, 6, 8), 12), ((0, 3, 3, 3, 6), 6), ((5,), 5)]
)
def test_the_rule_accepts_every_valid_answer_and_nothing_else(numbers: tuple[int, ...], target: int) -> None:
    """Exhaustive over every answer of 1..4 numbers drawn from 0..13 (in every order): the rule agrees with
    an enumeration of the list's index subsets (multiplicity respected, 0 included, order ignored)."""
    problem = SubsetSum(numbers, target)
    right = _right_by_enumeration(numbers, target)
    assert right  # a reference's target is always reachable
    accepted = set()
    for k in range(1, 5):
        for chosen in itertools.product(range(14), repeat=k):
            ok = problem.is_solution(chosen)
            assert ok == (tuple(sorted(chosen)) in right), chosen
            if ok:
                accepted.add(tuple(sorted(chosen)))
    assert accepted == {r for r in right if len(r) <= 4}
    assert not problem.is_solution(())


def test_hand_made_answers_through_the_answer_checker(checker: AnswerChecker) -> None:
    """The real reward path: AnswerChecker.check_many dispatches a subset_sum reference to the rule, in order
    with ordinary references checked by math-verify in the same batch."""
    ref = "subset_sum: 1 3 4 6 8 = 12"
    cases = [
        ("\\boxed{4+8}", True, "ok"),
        ("12-4=8. \\boxed{8+4}", True, "ok"),
        ("\\boxed{1 + 3 + 8}", True, "ok"),  # three numbers: any subset counts
        ("\\boxed{8, 3, 1}", True, "ok"),
        ("\\boxed{4 8}", True, "ok"),
        ("<think>\\boxed{5+7}</think> so \\boxed{4+8}", True, "ok"),  # thinking stripped
        ("\\boxed{4+8} or rather \\boxed{5+7}", False, "ok"),  # the last box counts
        ("\\boxed{5+7}", False, "ok"),  # sums to 12, but neither is in the list
        ("\\boxed{6+6}", False, "ok"),  # 6 used twice, the list holds it once
        ("\\boxed{4+6}", False, "ok"),  # wrong sum
        ("\\boxed{1+3+4+6+8}", False, "ok"),  # every number: 22
        ("\\boxed{12}", False, "ok"),  # the target itself is not in the list
        ("\\boxed{4+8=12}", False, "parse_error"),  # junk in the box
        ("\\boxed{4++8}", False, "parse_error"),
        ("\\boxed{-4+16}", False, "parse_error"),
        ("\\boxed{x}", False, "parse_error"),
        ("\\boxed{}", False, "no_answer"),  # empty
        ("4+8", False, "no_answer"),  # no \boxed
        ("", False, "no_answer"),
    ]
    results = checker.check_many(
        [(text, ref) for text, _, _ in cases] + [("\\boxed{7}", 7), ("\\boxed{8}", "7")]
    )
    assert [(r.correct, r.status) for r in results[: len(cases)]] == [(ok, s) for _, ok, s in cases]
    assert [r.correct for r in results[len(cases) :]] == [True, False]
    duplicates = "subset_sum: 2 2 5 7 9 = 11"
    paid = answer_rewards(
        [("\\boxed{2+2+7}", duplicates), ("\\boxed{2+9}", duplicates), ("\\boxed{2+2+2+5}", duplicates)],
        checker,
    )
    assert paid == [1.0, 1.0, 0.0]  # two 2s in the list: both usable, a third is not


def test_answer_formats() -> None:
    assert (
        parse_answer("4+8") == (4, 8) and parse_answer(" 4 , 8 ") == (4, 8) and parse_answer("4 8") == (4, 8)
    )
    assert parse_answer("007") == (7,)
    for junk in ("4+", "+4", "4;8", "4.0+8", "four", "4+8=12", "4\\,+8", "1" * 8, "+".join(["1"] * 65)):
        assert parse_answer(junk) is None, junk
    assert check_answer("x", SubsetSum((1, 2), 3)) is None


def test_references_are_validated_with_a_clear_error(tmp_path: Path) -> None:
    assert parse_reference("subset_sum: 1 3 4 6 8 = 12") == SubsetSum((1, 3, 4, 6, 8), 12)
    assert parse_reference("  subset_sum:2  2 =4 ") == SubsetSum((2, 2), 4)
    assert SubsetSum((1, 3, 4, 6, 8), 12).text == "subset_sum: 1 3 4 6 8 = 12"
    for bad, message in [
        ("subset_sum: 1 3 = 5", "no non-empty subset of 1 3 sums to 5"),
        ("subset_sum: 1 3 = 0", "no non-empty subset of 1 3 sums to 0"),
        ("subset_sum: = 3", "malformed subset_sum reference"),
        ("subset_sum: 1, 2 = 3", "malformed subset_sum reference"),
        ("subset_sum: 1 -2 = 3", "malformed subset_sum reference"),
        ("subset_sum: 1 2 = x", "malformed subset_sum reference"),
        ("subset_sum: 1 2 3", "malformed subset_sum reference"),
        ("subset_sum: 2000000 = 2000000", "must be in 0..1000000"),
        ("subset_sum: " + " ".join(["1"] * 65) + " = 3", "expected 1..64 numbers"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_reference(bad)
    assert check_reference("subset_sum: 1 2 = 3") == "subset_sum: 1 2 = 3"  # kept as it is, not $...$
    assert check_reference("12") == "$12$"  # ordinary answers unchanged
    assert reachable((3, 3), 6) and not reachable((3,), 6) and reachable((0,), 0) and not reachable((), 0)
    # the data loader names the file and line of a bad reference and keeps the good lines
    path = tmp_path / "data.jsonl"
    lines = [
        {"qid": "a", "problem": "Pick from 1,2 to sum 3.", "answer": "subset_sum: 1 2 = 3"},
        {"qid": "b", "problem": "Pick from 1,2 to sum 4.", "answer": "subset_sum: 1 2 = 4"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.warns(UserWarning, match="no non-empty subset"):
        dataset = load_problems(path)
    assert [p.problem_id for p in dataset.problems] == ["a"]
    assert dataset.skipped == [
        f"{path}:2: bad reference answer in 'answer': subset_sum: no non-empty subset of 1 2 sums to 4, "
        "so no answer could be right"
    ]
