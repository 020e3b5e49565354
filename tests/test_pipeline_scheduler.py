"""The agentic pipeline's scheduler: streaming, whole groups, the staleness bound, zero staleness = sync,
and nothing lost or trained twice when work is lost. Driven by the simulator and by a small driver here
that completes work in a random order (the scheduler must not depend on timing)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.config import AgentsConfig, load_config
from mars_megatron.evaluation.data import Problem
from mars_megatron.pipeline.scheduler import Batch, Limits, Scheduler, SeqState
from mars_megatron.pipeline.simulate import Costs, Lengths, SimResult, Simulation, simple_prompts
from mars_megatron.seeds import derive_seed

GRAPH = load_graph("marsrl")
ROLES = tuple(GRAPH.roles)
LENGTHS = Lengths({"solver": 12, "verifier": 6, "corrector": 12}, sigma=0.8, prompt_tokens=4)
ACCURACY = {"solver": 0.5, "verifier": 0.7, "corrector": 0.5}


def problems(n: int, start: int = 0) -> list[Problem]:
    return [Problem(f"p{i}", f"q{i}", "1", i + 1) for i in range(start, start + n)]


def scheduler(bound: int, *, segment: int = 8, per_update: int = 2, batch_groups: int = 4, g: int = 2,
              steps: int = 5, n: int = 12, seed: int = 0, whole: bool = False) -> Scheduler:  # fmt: skip
    limits = Limits(64, segment, dict.fromkeys(ROLES, bound), per_update, batch_groups, whole)
    s = Scheduler(AgentsConfig(group_size=g, inputs_per_agent=2, max_steps=steps), limits,
                  simple_prompts(LENGTHS), GRAPH, seed=seed)  # fmt: skip
    s.add_problems(problems(n))
    return s


def simulate(s: Scheduler, updates: int = 6, **kwargs) -> tuple[Simulation, SimResult]:
    kwargs.setdefault("workers", 2)
    kwargs.setdefault("worker_batch", 3)
    sim = Simulation(s, costs=Costs(1.0, 0.1, 0.05, 0.5), lengths=LENGTHS, accuracy=ACCURACY, **kwargs)
    return sim, sim.run(updates)


def drive(s: Scheduler, rng: random.Random, on_batch: Callable[[Batch], None] = lambda b: None,
          lose: float = 0.0, updates: int | None = None) -> list[Batch]:  # fmt: skip
    """Complete segments and scores in a random order, one at a time; lose some (requeue) when asked;
    train (instantly) whenever an update is due. Lengths and rewards are functions of the sample."""
    batches, out, scoring = [], [], []
    for _ in range(10_000):
        if s.update_ready():
            batch = s.take_batch()
            assert batch is not None
            on_batch(batch)
            batches.append(batch)
            s.on_trained()
            s.release(batch)
            if updates is not None and len(batches) == updates:
                s.requeue([j.sample_id for j in out] + scoring)  # what a crash would lose
                return batches
            continue
        out += s.take_segments(rng.randint(1, 4))
        if not out and not scoring:
            if s.idle():
                break
            raise AssertionError(f"stuck: {s.stats()}")
        if scoring and (not out or rng.random() < 0.5):
            sid = scoring.pop(rng.randrange(len(scoring)))
            if rng.random() < lose:
                s.requeue([sid])
                scoring.append(sid)
                continue
            seq = s.samples[sid]
            reward = float(derive_seed(sid, "r") % 2)
            verdict = None if seq.role != "verifier" else bool(derive_seed(sid, "v") % 3)
            s.on_scored(sid, reward, verdict)
            continue
        job = out.pop(rng.randrange(len(out)))
        if rng.random() < lose:
            s.requeue([job.sample_id])
            continue
        target = 1 + derive_seed(job.sample_id) % 20
        n = min(job.max_tokens, target - len(job.prefix))
        if s.on_segment(job.sample_id, [7] * n, [-0.5] * n, stopped=len(job.prefix) + n >= target):
            scoring.append(job.sample_id)
    return batches


# ------------------------------------------------------------------------------------------- streaming
def test_outputs_reach_training_before_their_trajectories_finish() -> None:
    seen_early = []

    def on_batch(batch: Batch) -> None:
        for seq in batch.samples:
            assert s.state(seq.sample_id) is SeqState.DONE
        problems_in_batch = {q.problem_id for q in batch.samples}
        pending = [q for q in s.samples.values() if s.state(q.sample_id) is not SeqState.DONE]
        seen_early.extend(q for q in pending if q.problem_id in problems_in_batch)

    s = scheduler(1, batch_groups=2)
    drive(s, random.Random(0), on_batch)
    assert seen_early, "every batch waited for whole trajectories"
    assert {q.position for q in seen_early} - {"solver"}  # later agents still running


def test_groups_are_trained_whole_and_once() -> None:
    s = scheduler(2, segment=4)
    batches = drive(s, random.Random(1))
    ids = [q.sample_id for b in batches for q in b.samples]
    assert len(ids) == len(set(ids)) and len(ids) > 0
    for b in batches:
        for group in b.groups:
            assert len(group) == 2 and len({q.group_id for q in group}) == 1
    # every sample of every admitted problem was trained (none dropped with these settings)
    assert len(ids) == s.trained and s.idle()
    s.check()


@pytest.mark.parametrize("bound", [1, 2])
def test_staleness_bound_is_never_exceeded(bound: int) -> None:
    s = scheduler(bound, segment=3, batch_groups=2)
    mixed = []

    def on_batch(batch: Batch) -> None:
        for q in batch.samples:
            assert all(batch.version - seg.version <= bound for seg in q.segment_versions), q.sample_id
            if len({seg.version for seg in q.segment_versions}) > 1:
                mixed.append(q)

    drive(s, random.Random(bound), on_batch)
    assert mixed, "no sample carried over a weight update: the bound was never tested"
    _, result = simulate(scheduler(bound, segment=3, batch_groups=2))
    assert result.updates == 6 and 0 < max(result.staleness) <= bound


def test_an_update_waits_for_a_sequence_it_would_make_too_stale() -> None:
    """Bound 1: an update may not start while a sequence begun a version earlier is unscored."""
    s = scheduler(1, segment=2, batch_groups=1, per_update=3, steps=1, g=1)
    waited = []
    rng = random.Random(3)

    def on_batch(batch: Batch) -> None:
        first = {sid: s.first_version(sid) for sid in s.samples if s.state(sid) is not SeqState.DONE}
        open_old = [sid for sid, v in first.items() if v is not None and v <= batch.version - 1]
        assert not open_old
        waited.append(batch.version)

    drive(s, rng, on_batch)
    assert len(waited) > 3
    s.check()


# ----------------------------------------------------------------------------------- zero staleness = sync
def _data(batches: list[Batch]) -> list[tuple[int, list[tuple[str, int, float | None]]]]:
    """Each update's samples in batch order (one order whatever the timing, so packing is the same)."""
    return [(b.version, [(q.sample_id, len(q.response_ids), q.reward) for q in b.samples]) for b in batches]


def test_zero_staleness_is_the_synchronous_loop_whatever_the_timing() -> None:
    """Bound 0 drains: each update trains exactly the trajectories of the problems admitted for its
    version, all of them, whatever the order work completes in or the segment size."""
    runs = [drive(scheduler(0, segment=seg), random.Random(k)) for k, seg in [(0, 64), (1, 64), (2, 5)]]
    assert _data(runs[0]) == _data(runs[1])  # same samples, tokens and rewards in every update
    members = [[sorted(q.sample_id for q in b.samples) for b in batches] for batches in runs]
    assert members[0] == members[2]  # segmenting changes sampling seeds, not the schedule
    for batches in runs:
        assert len(batches) == 6
        for k, b in enumerate(batches):
            assert b.version == k
            assert {q.problem_id for q in b.samples} == {f"p{2 * k}", f"p{2 * k + 1}"}
    sims = [simulate(scheduler(0), workers=w, worker_batch=wb)[0] for w, wb in [(1, 1), (3, 4)]]
    assert _data(sims[0].batches) == _data(sims[1].batches)


def test_whole_trajectories_hold_groups_until_their_tree_is_scored() -> None:
    """The shared reward needs every output of a trajectory tree: with ``whole_trajectories`` no group
    is trained while a sequence of its problem is unscored, and the staleness bound still holds."""
    s = scheduler(1, segment=3, batch_groups=2, whole=True)

    def on_batch(batch: Batch) -> None:
        keys = {q.trajectory_id for q in batch.samples}
        assert all(
            s.state(q.sample_id) is SeqState.DONE for q in s.samples.values() if q.trajectory_id in keys
        )
        for q in batch.samples:
            assert all(batch.version - seg.version <= 1 for seg in q.segment_versions), q.sample_id

    batches = drive(s, random.Random(4), on_batch)
    assert len(batches) > 3 and s.idle() and s.trained == s.counters["spawned"]
    s.check()


# --------------------------------------------------------------------------------------- lost work
def test_lost_segments_and_scores_are_requeued_nothing_lost_or_twice() -> None:
    s = scheduler(1, segment=4)
    batches = drive(s, random.Random(5), lose=0.2)
    assert s.counters["requeued"] > 0
    ids = [q.sample_id for b in batches for q in b.samples]
    assert len(ids) == len(set(ids)) == s.trained
    clean = scheduler(1, segment=4)
    drive(clean, random.Random(5))
    assert s.counters["problems"] == clean.counters["problems"] == 12
    assert s.idle() and clean.idle()


# ------------------------------------------------------------------------------------------ bad input
def test_bad_calls_name_the_sample_or_field() -> None:
    s = scheduler(1)
    job = s.take_segments(1)[0]
    with pytest.raises(ValueError, match=f"{job.sample_id}: 2 tokens but 1 log-probs"):
        s.on_segment(job.sample_id, [1, 2], [-0.1], stopped=False)
    with pytest.raises(KeyError, match="unknown sample id 'nope'"):
        s.on_segment("nope", [], [], stopped=True)
    with pytest.raises(ValueError, match="expected state scoring, it is decoding"):
        s.on_scored(job.sample_id, 1.0)
    with pytest.raises(RuntimeError, match="no update is running"):
        s.on_trained()


def test_a_problem_met_again_is_a_new_trajectory_tree() -> None:
    """Epochs repeat problems: each admission gets its own sample and group ids."""
    s = scheduler(1, n=0)
    s.add_problems(problems(2) + problems(2))
    batches = drive(s, random.Random(7))
    ids = [q.sample_id for b in batches for q in b.samples]
    assert len(ids) == len(set(ids))
    assert {q.trajectory_id for b in batches for q in b.samples} == {"p0@0", "p1@1", "p0@2", "p1@3"}


@pytest.mark.parametrize("whole", [False, True], ids=["groups", "whole-trajectories"])
def test_a_saved_schedule_continues_like_the_original(whole: bool) -> None:
    """Save between updates (work out at workers is lost, as in a crash), restore in a fresh scheduler:
    both continue to the same batches, and nothing is trained twice across the restart."""
    import pickle

    original = scheduler(1, segment=4, whole=whole)
    before = drive(original, random.Random(11), updates=3)
    state = pickle.loads(pickle.dumps(original.state_dict()))
    restored = Scheduler(original.agents, original.limits, original.prompt_fn, GRAPH, seed=original.seed)
    restored.load_state_dict(state)
    assert restored.census() == original.census()
    assert restored.state_dict()["held"] == original.state_dict()["held"]
    assert not whole or original.state_dict()["held"]  # complete groups waited for their trees at the save
    after = [drive(x, random.Random(12)) for x in (original, restored)]
    assert _data(after[0]) == _data(after[1]) and after[0]
    ids = [q.sample_id for b in before + after[1] for q in b.samples]
    assert len(ids) == len(set(ids))
    assert restored.idle()


def test_routing_of_each_segments_call_replaces_the_sequences_and_is_saved() -> None:
    """An engine call's routing covers every position it fed (its prefill re-routed the earlier ones
    under the newest weights), so it replaces what the sequence held; wrong row counts name the sample;
    the routing survives a save."""
    import numpy as np

    s = scheduler(1, segment=4)
    job = s.take_segments(1)[0]
    p = len(job.prompt_ids)
    first = np.zeros((p + 4 - 1, 2, 2), dtype=np.uint8)
    assert not s.on_segment(job.sample_id, [5] * 4, [-0.5] * 4, stopped=False, routed_experts=first)
    assert s.samples[job.sample_id].routed_experts is first
    job = next(j for j in s.take_segments() if j.sample_id == job.sample_id)
    with pytest.raises(
        ValueError, match=rf"'{job.sample_id}': routed_experts has shape \(3, 2, 2\), expected"
    ):
        s.on_segment(job.sample_id, [6, 7], [-0.5] * 2, stopped=True, routed_experts=np.zeros((3, 2, 2)))
    second = np.ones((p + 6 - 1, 2, 2), dtype=np.uint8)
    assert s.on_segment(job.sample_id, [6, 7], [-0.5] * 2, stopped=True, routed_experts=second)
    assert s.samples[job.sample_id].routed_experts is second
    s.on_scored(job.sample_id, 1.0)
    assert s.samples[job.sample_id].routed_experts is second  # the record the trainer reads
    restored = Scheduler(s.agents, s.limits, s.prompt_fn, GRAPH, seed=s.seed)
    restored.load_state_dict(s.state_dict())
    assert np.array_equal(restored.samples[job.sample_id].routed_experts, second)


def test_limits_from_the_config() -> None:
    """The one place a run's schedule is derived from its config (which validated every setting)."""
    sync = Limits.from_config(
        load_config(None, ["rollout.max_response_tokens=64", "data.problems_per_step=3"]), GRAPH
    )
    assert sync == Limits(64, 64, dict.fromkeys(ROLES, 0), 3, 3, whole_trajectories=False)
    agentic = Limits.from_config(
        load_config(
            None,
            [
                "pipeline.mode=agentic",
                "pipeline.max_staleness=2",
                "pipeline.staleness_per_role={verifier: 0}",
                "pipeline.segment_tokens=16",
                "pipeline.batch_groups=5",
                "algorithm.reward=shared",
            ],
        ),
        GRAPH,
    )
    assert dict(agentic.max_staleness) == {"solver": 2, "verifier": 0, "corrector": 2}
    assert (agentic.segment_tokens, agentic.batch_groups, agentic.whole_trajectories) == (16, 5, True)


def test_a_saved_schedule_resumes_only_under_its_own_graph() -> None:
    """The checkpoint records its agent graph: its rollouts name that graph's positions and roles."""

    s = scheduler(1, segment=4)
    drive(s, random.Random(3), updates=1)
    state = s.state_dict()
    assert state["graph"] == "marsrl"
    other = load_graph("imo_refine")
    limits = Limits(64, 4, dict.fromkeys(other.roles, 1), 2, 4)
    fresh = Scheduler(s.agents, limits, s.prompt_fn, other, seed=s.seed)
    with pytest.raises(ValueError, match=r"graph 'marsrl', this run's agents\.graph is 'imo_refine'"):
        fresh.load_state_dict(state)
