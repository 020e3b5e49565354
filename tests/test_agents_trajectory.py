"""Inference loop driven by scripted outputs, and training-trajectory input selection."""

import random

import pytest

from mars_megatron.agents.loop import InferenceLoop, LoopResult, choose_fallback
from mars_megatron.agents.roles import Role
from mars_megatron.agents.sample import Sample
from mars_megatron.agents.selection import select_inputs
from mars_megatron.agents.trajectory import Position, group_id, next_position, positions
from mars_megatron.config import AgentsConfig, ConfigError, EvalConfig

CORRECT = "**Final Verdict**: fine.\n\n**List of Findings**: None\n\n**Correctness**: Correct"
WRONG = (
    "**Final Verdict**: broken.\n\n**List of Findings**: Critical Error in step 2.\n\n**Correctness**: Wrong"
)


def run(loop: InferenceLoop, script: list[tuple[Role, str] | tuple[Role, str, bool]]) -> LoopResult:
    """Feed scripted outputs, checking each request has the role the script expects."""
    for step in script:
        role, text, truncated = (*step, False) if len(step) == 2 else step
        request = loop.next_request()
        assert request is not None, f"loop ended early, before {role}"
        assert request.role is role
        loop.observe(text, truncated=truncated)
    assert loop.next_request() is None, "loop wanted more requests than scripted"
    return loop.result()


S, V, C = Role.SOLVER, Role.VERIFIER, Role.CORRECTOR


def test_accepts_after_consecutive_correct() -> None:
    result = run(
        InferenceLoop("p"),
        [(S, "<think>t</think>ans 1"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, CORRECT)],
    )
    assert result.accepted and result.stop_reason == "accepted"
    assert result.solution == "ans 1"
    assert result.correct_votes == 4
    assert result.calls == {S: 1, V: 4, C: 0}
    assert [step.verdict for step in result.history] == [None, True, True, True, True]


def test_wrong_resets_streak_and_triggers_corrector() -> None:
    loop = InferenceLoop("p")
    run_prefix = [(S, "ans 1"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, WRONG)]
    for role, text in run_prefix:
        assert loop.next_request().role is role
        loop.observe(text)
    request = loop.next_request()
    assert request.role is C
    assert request.messages[1] == {"role": "assistant", "content": "ans 1"}
    assert "Critical Error in step 2." in request.messages[2]["content"]
    assert "**Correctness**" not in request.messages[2]["content"]
    result = run(
        loop, [(C, "<think>fix</think>ans 2"), (V, CORRECT), (V, CORRECT), (V, CORRECT), (V, CORRECT)]
    )
    assert result.accepted and result.solution == "ans 2"
    assert result.calls == {S: 1, V: 8, C: 1}


def test_verifier_after_correction_sees_new_solution() -> None:
    loop = InferenceLoop("p")
    for text in ("ans 1", WRONG, "ans 2"):
        loop.observe(text)
    request = loop.next_request()
    assert request.role is V
    assert "ans 2" in request.messages[1]["content"] and "ans 1" not in request.messages[1]["content"]


def test_solver_retried_when_truncated() -> None:
    script = [(S, "<think>cut", True)] * 3 + [(S, "ans")] + [(V, CORRECT)] * 4
    result = run(InferenceLoop("p", EvalConfig(solver_retries=3)), script)
    assert result.accepted and result.calls[S] == 4


def test_solver_gives_up_after_retries() -> None:
    result = run(InferenceLoop("p", EvalConfig(solver_retries=2)), [(S, "<think>cut", True)] * 3)
    assert not result.accepted and result.stop_reason == "solver_truncated"
    assert result.solution == "" and result.calls == {S: 3, V: 0, C: 0}


def test_gives_up_after_consecutive_errors() -> None:
    config = EvalConfig(give_up_after=3, max_iterations=10)
    script = [(S, "a1"), (V, WRONG), (C, "a2"), (V, "no verdict here"), (C, "a3"), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.stop_reason == "gave_up" and not result.accepted
    assert result.solution == "a3"  # never judged Correct: the last solution
    assert result.calls == {S: 1, V: 3, C: 2}


def test_correct_resets_error_count() -> None:
    config = EvalConfig(give_up_after=2, max_iterations=5, accept_after=3)
    script = [(S, "a1"), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG), (C, "a3"), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.stop_reason == "gave_up" and result.calls[V] == 4


def test_truncated_verifier_counts_as_error() -> None:
    config = EvalConfig(accept_after=1, max_iterations=2)
    result = run(InferenceLoop("p", config), [(S, "a1"), (V, CORRECT, True), (C, "a2"), (V, CORRECT)])
    assert result.history[1].verdict is None
    assert result.accepted and result.solution == "a2"


def test_truncated_correction_is_dropped() -> None:
    config = EvalConfig(accept_after=1)
    result = run(InferenceLoop("p", config), [(S, "a1"), (V, WRONG), (C, "<think>cut", True), (V, CORRECT)])
    assert result.accepted and result.solution == "a1"


def test_max_iterations_falls_back_to_most_correct_votes() -> None:
    config = EvalConfig(max_iterations=5, accept_after=4)
    script = [(S, "a1"), (V, CORRECT), (V, CORRECT), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.stop_reason == "max_iterations" and not result.accepted
    assert result.solution == "a1" and result.correct_votes == 2
    assert result.calls[C] == 1  # no correction requested after the last verification


def test_fallback_tie_goes_to_latest() -> None:
    config = EvalConfig(max_iterations=4)
    script = [(S, "a1"), (V, CORRECT), (V, WRONG), (C, "a2"), (V, CORRECT), (V, WRONG)]
    result = run(InferenceLoop("p", config), script)
    assert result.solution == "a2" and result.correct_votes == 1


@pytest.mark.parametrize(
    ("votes", "expected"), [([0], 0), ([0, 0, 0], 2), ([2, 1, 0], 0), ([1, 3, 3, 0], 2), ([0, 1], 1)]
)
def test_choose_fallback(votes: list[int], expected: int) -> None:
    assert choose_fallback(votes) == expected


def test_loop_misuse_raises() -> None:
    loop = InferenceLoop("p", EvalConfig(solver_retries=0))
    with pytest.raises(RuntimeError):
        loop.result()
    loop.observe("<think>cut", truncated=True)
    assert loop.done
    with pytest.raises(RuntimeError):
        loop.observe("more")


@pytest.mark.parametrize("field", ["max_iterations", "accept_after", "give_up_after"])
def test_loop_budgets_are_checked_by_the_config_naming_the_field(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EvalConfig(**{field: 0})
    with pytest.raises(ConfigError, match="solver_retries"):
        EvalConfig(solver_retries=-1)


# --- training trajectories ---------------------------------------------------------------------


def record(sid: str, position: Position, reward: float | None, verdict: bool | None = None) -> Sample:
    return Sample([1], [2], position, "prob", sample_id=sid, text="out", reward=reward, verdict=verdict)


SOLUTIONS = [
    record("s1", Position.SOLVER, 1.0),
    record("s2", Position.SOLVER, 0.0),
    record("s3", Position.SOLVER, 1.0),
    record("s4", Position.SOLVER, 0.0),
    record("v0", Position.VERIFIER_1, 1.0, False),  # not a solution: never a Verifier input
]
REPORTS = [
    record("v1", Position.VERIFIER_1, 1.0, False),  # errors found, rightly
    record("v2", Position.VERIFIER_1, 0.0, False),  # errors claimed on a correct solution
    record("v3", Position.VERIFIER_1, 1.0, True),  # said Correct: branch ends
    record("v4", Position.VERIFIER_1, 0.0, None),  # unparseable: found nothing
]


def ids(records: list[Sample]) -> list[str]:
    return [r.sample_id for r in records]


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_verifier_prefers_incorrect_solutions(seed: int) -> None:
    chosen = select_inputs(SOLUTIONS, 2, "adaptive", Role.VERIFIER, random.Random(seed))
    assert sorted(ids(chosen)) == ["s2", "s4"]
    chosen = select_inputs(SOLUTIONS[:3], 2, "adaptive", Role.VERIFIER, random.Random(seed))
    assert ids(chosen)[0] == "s2" and ids(chosen)[1] in {"s1", "s3"}


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_corrector_prefers_rightly_found_errors(seed: int) -> None:
    rng = random.Random(seed)
    assert ids(select_inputs(REPORTS, 2, "adaptive", Role.CORRECTOR, rng)) == ["v1", "v2"]
    assert ids(select_inputs(REPORTS, 1, "adaptive", Role.CORRECTOR, rng)) == ["v1"]
    assert ids(select_inputs(REPORTS, 5, "adaptive", Role.CORRECTOR, rng)) == ["v1", "v2"]


@pytest.mark.parametrize("strategy", ["random", "balanced", "adaptive"])
def test_corrector_never_follows_a_correct_or_unparseable_verdict(strategy: str) -> None:
    chosen = select_inputs(REPORTS[2:], 2, strategy, Role.CORRECTOR, random.Random(0))
    assert chosen == []
    assert select_inputs(SOLUTIONS[:4], 2, strategy, Role.CORRECTOR, random.Random(0)) == []


@pytest.mark.parametrize("seed", range(5))
def test_balanced_takes_one_of_each(seed: int) -> None:
    chosen = select_inputs(SOLUTIONS, 2, "balanced", Role.VERIFIER, random.Random(seed))
    assert ids(chosen)[0] in {"s1", "s3"} and ids(chosen)[1] in {"s2", "s4"}
    chosen = select_inputs(SOLUTIONS, 4, "balanced", Role.VERIFIER, random.Random(seed))
    assert sorted(ids(chosen)) == ["s1", "s2", "s3", "s4"]


def test_balanced_fills_up_from_the_other_pool() -> None:
    only_correct = [SOLUTIONS[0], SOLUTIONS[2], record("s5", Position.SOLVER, 1.0)]
    chosen = select_inputs(only_correct, 2, "balanced", Role.VERIFIER, random.Random(0))
    assert len(chosen) == 2 and set(ids(chosen)) <= {"s1", "s3", "s5"}
    # k odd: the extra input is reward 0; 3 of 4 inputs = 1 correct + 2 incorrect
    chosen = select_inputs(SOLUTIONS, 3, "balanced", Role.VERIFIER, random.Random(0))
    assert [r.reward for r in chosen] == [1.0, 0.0, 0.0]


def test_random_is_seeded_and_uniform() -> None:
    first = select_inputs(SOLUTIONS, 2, "random", Role.VERIFIER, random.Random(123))
    again = select_inputs(SOLUTIONS, 2, "random", Role.VERIFIER, random.Random(123))
    assert ids(first) == ids(again) and len(set(ids(first))) == 2
    # pinned: random.Random(123).sample(["s1", "s2", "s3", "s4"], 2)
    assert ids(first) == ids(random.Random(123).sample(SOLUTIONS[:4], 2)) == ["s1", "s2"]
    seen = set()
    for seed in range(200):
        seen.update(ids(select_inputs(SOLUTIONS, 1, "random", Role.VERIFIER, random.Random(seed))))
    assert seen == {"s1", "s2", "s3", "s4"}


def test_select_inputs_rejects_bad_calls() -> None:
    with pytest.raises(ValueError, match="solver"):
        select_inputs(SOLUTIONS, 2, "random", Role.SOLVER, random.Random(0))
    with pytest.raises(ValueError, match="no reward"):
        select_inputs([record("s9", Position.SOLVER, None)], 1, "random", Role.VERIFIER, random.Random(0))
    with pytest.raises(ValueError, match="strategy"):
        select_inputs(SOLUTIONS, 1, "greedy", Role.VERIFIER, random.Random(0))  # type: ignore[arg-type]


def test_training_positions_and_config() -> None:
    config = AgentsConfig()
    assert (config.group_size, config.inputs_per_agent, config.max_steps, config.strategy) == (
        8,
        2,
        5,
        "adaptive",
    )
    assert [p.role for p in positions(config.max_steps)] == [S, V, C, V, C]
    assert next_position(Position.VERIFIER_1, config.max_steps) is Position.CORRECTOR_1
    assert next_position(Position.CORRECTOR_2, config.max_steps) is None
    assert positions(3)[-1] is Position.CORRECTOR_1 and next_position(Position.CORRECTOR_1, 3) is None
    for bad in ({"max_steps": 6}, {"max_steps": 0}, {"group_size": 0}, {"strategy": "greedy"}):
        with pytest.raises(ConfigError) as error:
            AgentsConfig(**bad)
        assert error.value.path == next(iter(bad))


def test_sample_groups_by_input() -> None:
    a = Sample([1], [2], Position.CORRECTOR_1, "prob", sample_id="x1", parent_id="v1")
    b = Sample([1], [2], Position.CORRECTOR_1, "prob", sample_id="x2", parent_id="v1")
    c = Sample([1], [2], Position.CORRECTOR_1, "prob", sample_id="x3", parent_id="v2")
    assert a.role is Role.CORRECTOR and a.group_id == b.group_id != c.group_id
    assert group_id("prob", Position.SOLVER, None) == "prob/solver/-"
    assert not a.found_errors
