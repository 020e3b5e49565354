"""The driver's typed handles without Ray: which policy trains which record, the problem feed, and the
one conversion of a record (what a reward worker receives), scored by the real answer checker."""

from __future__ import annotations

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.sample import Sample
from mars_megatron.config import AgentsConfig, TrainConfig
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.agents import score_request
from mars_megatron.pipeline.facades import ProblemFeed, TrainerGroup, TrainerRanks
from mars_megatron.pipeline.scheduler import Limits, Scheduler
from mars_megatron.rewards.checker import AnswerChecker, CheckerConfig
from mars_megatron.rewards.scoring import score_requests
from mars_megatron.rl.data import ProblemStream
from mars_megatron.training.packing import PackSpec

GRAPH = load_graph("marsrl")
ROLES = tuple(GRAPH.roles)
ONE_RANK = TrainerRanks(writer_rank=0, dp_ranks=(0,), spec=PackSpec(dp=1, seq_multiple=1), backend="gloo")
VERDICT = "**Final Verdict**: broken.\n\n**List of Findings**: step 2.\n\n**Correctness**: Wrong"


def _record(position: str, sid: str) -> Sample:
    return Sample([1], [2], position, "p", sample_id=sid)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["shared"], {"shared": ["s", "v", "c"]}),
        (["solver", "verifier", "corrector"], {"solver": ["s"], "verifier": ["v"], "corrector": ["c"]}),
    ],
)
def test_trainer_group_splits_records_by_policy(names: list[str], expected: dict[str, list[str]]) -> None:
    group = TrainerGroup(None, None, names, GRAPH, TrainConfig(), ONE_RANK)  # type: ignore[arg-type]  # no ranks
    records = [
        _record("solver", "s"),
        _record("verifier_1", "v"),
        _record("corrector_1", "c"),
    ]
    split = group.split(records)
    assert {name: [s.sample_id for s in batch] for name, batch in split.items()} == expected
    assert set().union(*(group.roles_of(n) for n in names)) == set(ROLES)
    assert group.versions == dict.fromkeys(names, 0)


def test_a_graph_grouping_trains_each_group_of_roles_as_one_policy() -> None:
    """``algorithm.policies=graph``: the graph's ``policies`` section decides which model trains which
    role (here a thinker model for solver and corrector, a judge model for the verifier)."""
    import dataclasses

    policies = {"thinker": ("solver", "corrector"), "judge": ("verifier",)}
    grouped = dataclasses.replace(GRAPH, policies=policies)
    names = grouped.policy_names("graph")
    assert names == ["thinker", "judge"]
    group = TrainerGroup(None, None, names, grouped, TrainConfig(), ONE_RANK)  # type: ignore[arg-type]
    split = group.split([_record("solver", "s"), _record("verifier_1", "v"), _record("corrector_2", "c")])
    assert {name: [s.sample_id for s in batch] for name, batch in split.items()} == {
        "thinker": ["s", "c"],
        "judge": ["v"],
    }
    assert group.roles_of("thinker") == {"solver", "corrector"} and group.roles_of("judge") == {"verifier"}
    assert [grouped.policy_of(r, grouped.policy_names(mode)) for mode in ("shared", "per_role")
            for r in ("solver", "verifier")] == ["shared", "shared", "solver", "verifier"]  # fmt: skip


def test_problem_feed_takes_one_update_of_problems_and_resumes() -> None:
    problems = [Problem(f"p{i}", f"q{i}", "1", i + 1) for i in range(5)]
    feed = ProblemFeed(ProblemStream(problems, seed=3), per_update=2)
    first = feed.take() + feed.take()
    again = ProblemFeed(ProblemStream(problems, seed=3), per_update=2)
    again.take()
    state = again.stream.state_dict()
    resumed = ProblemFeed(ProblemStream(problems, seed=3), per_update=2)
    resumed.stream.load_state_dict(state)
    assert len(first) == 4 and resumed.take() == first[2:]


def test_a_score_request_comes_from_the_record_and_its_score_goes_back() -> None:
    """Solver (its answer against the reference) and Verifier (its verdict against whether the solution
    it judged was right, carried on the record as ``judged_right``)."""
    limits = Limits(8, 8, dict.fromkeys(ROLES, 0), 1, 1)
    s = Scheduler(AgentsConfig(group_size=1, inputs_per_agent=1, max_steps=2), limits, lambda *a: [1], GRAPH)
    s.add_problems([Problem("p0", "1 + 1?", "2", 1)])
    (job,) = s.take_segments()
    assert s.on_segment(job.sample_id, [5], [-0.5], stopped=True)
    s.samples[job.sample_id].text = r"so \boxed{3}"
    with AnswerChecker(CheckerConfig(num_workers=1)) as checker:
        solver = score_request(s, job.sample_id)
        assert (solver.reward, solver.verdict, solver.reference, solver.judged_right) == (
            "answer",
            None,
            "2",
            True,
        )
        ((sid, reward, verdict, _),) = score_requests([solver], checker)
        s.on_scored(sid, reward, verdict)
        (job,) = s.take_segments()
        verifier = s.samples[job.sample_id]
        assert verifier.judged_right is False  # the solution it judges was wrong
        assert s.on_segment(job.sample_id, [6], [-0.5], stopped=True)
        verifier.text = VERDICT
        ((sid, reward, verdict, _),) = score_requests([score_request(s, job.sample_id)], checker)
    assert (sid, reward, verdict) == (verifier.sample_id, 1.0, False)  # it rightly found errors
    s.on_scored(sid, reward, verdict)
    assert verifier.reward == 1.0 and verifier.verdict is False and verifier.found_errors
