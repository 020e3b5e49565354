"""Input selection and the record's place in the trajectory tree (agents/selection.py, trajectory.py)."""

import random

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.sample import Sample, group_id
from mars_megatron.agents.selection import select_inputs
from mars_megatron.agents.trajectory import PromptInputs, chain
from mars_megatron.config import AgentsConfig, ConfigError


def record(
    sid: str, position: str, reward: float | None, verdict: bool | None = None, **kw: object
) -> Sample:
    return Sample([1], [2], position, "prob", sample_id=sid, text="out", reward=reward, verdict=verdict, **kw)


SOLUTIONS = [
    record("s1", "solver", 1.0),
    record("s2", "solver", 0.0),
    record("s3", "solver", 1.0),
    record("s4", "solver", 0.0),
]
REPORTS = [
    record("v1", "verifier_1", 1.0, False),  # errors found, rightly
    record("v2", "verifier_1", 0.0, False),  # errors claimed on a correct solution
    record("v3", "verifier_1", 1.0, True),  # said Correct: branch ends
    record("v4", "verifier_1", 0.0, None),  # unparseable: found nothing
]


def ids(records: list[Sample]) -> list[str]:
    return [r.sample_id for r in records]


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_preferring_negatives_takes_incorrect_solutions_first(seed: int) -> None:
    chosen = select_inputs(SOLUTIONS, 2, "adaptive", random.Random(seed), prefer="negative")
    assert sorted(ids(chosen)) == ["s2", "s4"]
    chosen = select_inputs(SOLUTIONS[:3], 2, "adaptive", random.Random(seed), prefer="negative")
    assert ids(chosen)[0] == "s2" and ids(chosen)[1] in {"s1", "s3"}


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_preferring_positives_takes_rightly_found_errors(seed: int) -> None:
    rng = random.Random(seed)
    pick = {"when": "rejected", "prefer": "positive"}
    assert ids(select_inputs(REPORTS, 2, "adaptive", rng, **pick)) == ["v1", "v2"]  # type: ignore[arg-type]
    assert ids(select_inputs(REPORTS, 1, "adaptive", rng, **pick)) == ["v1"]  # type: ignore[arg-type]
    assert ids(select_inputs(REPORTS, 5, "adaptive", rng, **pick)) == ["v1", "v2"]  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["random", "balanced", "adaptive", "custom"])
def test_rejected_never_takes_a_passing_or_unparseable_verdict(strategy: str) -> None:
    assert select_inputs(REPORTS[2:], 2, strategy, random.Random(0), when="rejected") == []  # type: ignore[arg-type]
    assert select_inputs(SOLUTIONS, 2, strategy, random.Random(0), when="rejected") == []  # type: ignore[arg-type]
    accepted = select_inputs(REPORTS, 4, strategy, random.Random(0), when="accepted")  # type: ignore[arg-type]
    assert ids(accepted) == ["v3"]


@pytest.mark.parametrize("seed", range(5))
def test_balanced_takes_one_of_each(seed: int) -> None:
    chosen = select_inputs(SOLUTIONS, 2, "balanced", random.Random(seed))
    assert ids(chosen)[0] in {"s1", "s3"} and ids(chosen)[1] in {"s2", "s4"}
    chosen = select_inputs(SOLUTIONS, 4, "balanced", random.Random(seed))
    assert sorted(ids(chosen)) == ["s1", "s2", "s3", "s4"]


def test_balanced_fills_up_from_the_other_pool() -> None:
    only_correct = [SOLUTIONS[0], SOLUTIONS[2], record("s5", "solver", 1.0)]
    chosen = select_inputs(only_correct, 2, "balanced", random.Random(0))
    assert len(chosen) == 2 and set(ids(chosen)) <= {"s1", "s3", "s5"}
    # k odd: the extra input is reward 0; 3 of 4 inputs = 1 correct + 2 incorrect
    chosen = select_inputs(SOLUTIONS, 3, "balanced", random.Random(0))
    assert [r.reward for r in chosen] == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(("share", "rewards"), [(0.0, [0.0, 0.0]), (1.0, [1.0, 1.0]), (0.5, [1.0, 0.0])])
def test_custom_takes_its_share_of_positives(share: float, rewards: list[float]) -> None:
    chosen = select_inputs(SOLUTIONS, 2, "custom", random.Random(0), positive_share=share)
    assert [r.reward for r in chosen] == rewards
    # custom at 0.5 is balanced, draw for draw
    if share == 0.5:
        assert ids(chosen) == ids(select_inputs(SOLUTIONS, 2, "balanced", random.Random(0)))


def test_random_is_seeded_and_uniform() -> None:
    first = select_inputs(SOLUTIONS, 2, "random", random.Random(123))
    again = select_inputs(SOLUTIONS, 2, "random", random.Random(123))
    assert ids(first) == ids(again) and len(set(ids(first))) == 2
    # pinned: random.Random(123).sample(["s1", "s2", "s3", "s4"], 2)
    assert ids(first) == ids(random.Random(123).sample(SOLUTIONS[:4], 2)) == ["s1", "s2"]
    seen = set()
    for seed in range(200):
        seen.update(ids(select_inputs(SOLUTIONS, 1, "random", random.Random(seed))))
    assert seen == {"s1", "s2", "s3", "s4"}


def test_select_inputs_rejects_bad_calls() -> None:
    with pytest.raises(ValueError, match="no reward"):
        select_inputs([record("s9", "solver", None)], 1, "random", random.Random(0))
    with pytest.raises(ValueError, match="strategy"):
        select_inputs(SOLUTIONS, 1, "greedy", random.Random(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="when"):
        select_inputs(SOLUTIONS, 1, "random", random.Random(0), when="sometimes")  # type: ignore[arg-type]


def test_agents_config_defaults_and_bounds() -> None:
    config = AgentsConfig()
    assert (config.graph, config.group_size, config.inputs_per_agent, config.max_steps, config.strategy) == (
        "marsrl",
        8,
        2,
        None,
        "adaptive",
    )
    for bad in ({"max_steps": 0}, {"group_size": 0}, {"strategy": "greedy"}):
        with pytest.raises(ConfigError) as error:
            AgentsConfig(**bad)
        assert error.value.path == next(iter(bad))


def test_sample_groups_by_input_and_takes_its_role_from_the_position() -> None:
    a = Sample([1], [2], "corrector_1", "prob", sample_id="x1", parent_id="v1")
    b = Sample([1], [2], "corrector_1", "prob", sample_id="x2", parent_id="v1")
    c = Sample([1], [2], "corrector_1", "prob", sample_id="x3", parent_id="v2")
    assert a.role == "corrector" and a.group_id == b.group_id != c.group_id
    assert Sample([1], [2], "verifier_2", "p", role="judge").role == "judge"
    assert group_id("prob", "solver", None) == "prob/solver/-"
    assert not a.found_errors


def test_prompt_inputs_follow_the_chain_to_the_latest_solution_and_its_report() -> None:
    graph = load_graph("marsrl")
    s = record("s", "solver", 0.0)
    v1 = record("v1", "verifier_1", 1.0, False, parent_id="s")
    c1 = record("c1", "corrector_1", 1.0, parent_id="v1")
    v2 = record("v2", "verifier_2", 1.0, True, parent_id="c1")
    samples = {q.sample_id: q for q in (s, v1, c1, v2)}
    assert ids(chain(v2, samples)) == ["s", "v1", "c1", "v2"]
    assert PromptInputs.of(None, samples, graph) == PromptInputs()
    assert PromptInputs.of(s, samples, graph) == PromptInputs(s, s, None)
    assert PromptInputs.of(v1, samples, graph) == PromptInputs(v1, s, v1)  # a revision of s, with v1's report
    assert PromptInputs.of(c1, samples, graph) == PromptInputs(c1, c1, None)  # v1 judged s, not c1
    assert PromptInputs.of(v2, samples, graph) == PromptInputs(v2, c1, v2)
