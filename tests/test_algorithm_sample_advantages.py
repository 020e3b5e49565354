"""Sample validation and GRPO advantages, against hand-computed values."""

import dataclasses
import math

import pytest

from mars_megatron.agents.sample import group_id
from mars_megatron.algorithm import (
    Sample,
    Segment,
    assign_advantages,
    grpo_advantages,
    zero_variance_groups,
)

ROLES = ("solver", "verifier", "corrector")


def sample(reward=None, position="solver", parent=None, problem="p1", **kwargs) -> Sample:
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=kwargs.pop("response_ids", [4, 5, 6, 7]),
        position=position,
        problem_id=problem,
        group_id=group_id(problem, position, parent),
        reward=reward,
        **kwargs,
    )


# ------------------------------------------------------------------------------------------ Sample
def test_sample_helpers():
    s = sample(segment_versions=[Segment(0, 2, 3), Segment(2, 4, 5)])
    assert s.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7] and s.length == 7
    assert s.response_len == 4
    assert s.loss_mask.tolist() == [1, 1, 1, 1]  # derived: all ones
    assert s.role == "solver"
    assert s.oldest_version == 3
    assert s.staleness(7) == 4  # 7 - 3
    assert s.staleness(3) == 0


def test_sample_group_id_is_derived_from_its_place_in_the_tree():
    s = Sample([1], [2, 3], "verifier_1", "p9", sample_id="s1", parent_id="sol3", reward=1.0)
    assert (s.group_id, s.problem_id, s.reward, s.role) == ("p9/verifier_1/sol3", "p9", 1.0, "verifier")
    again = Sample([1], [2], "verifier_1", "p9", trajectory_id="p9@4", parent_id="sol3")
    assert again.group_id == "p9@4/verifier_1/sol3"  # a later admission of the problem: another group


def test_a_record_grows_segment_by_segment_and_stays_valid():
    """The scheduler's in-flight record: empty while nothing is decoded, every per-token list as long as
    the response after each segment, log-probs clamped to <= 0, checked again when finished."""
    s = Sample([1, 2], [], "solver", "p", behaviour_logprobs=[], sample_id="s")
    assert s.response_len == 0 and s.loss_mask.tolist() == [] and s.finish_reason is None
    s.add_segment([5, 6], [-0.5, 1e-7], version=2)
    s.add_segment([7], [-0.25], version=3)
    assert s.response_ids.tolist() == [5, 6, 7] and s.loss_mask.tolist() == [1, 1, 1]
    assert s.behaviour_logprobs.tolist() == [-0.5, 0.0, -0.25]
    assert [(g.start, g.end, g.version) for g in s.segment_versions] == [(0, 2, 2), (2, 3, 3)]
    s.finish("length")
    assert s.truncated and s.oldest_version == 2
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        s.add_segment([8, 9], [-0.1], version=3)
    with pytest.raises(ValueError, match="finish_reason"):
        s.finish("eos")
    with pytest.raises(ValueError, match="NaN log-prob"):  # each segment's values are checked as it is added
        s.add_segment([8], [math.nan], version=3)


def test_token_ids_outside_int32_are_refused_not_wrapped():
    """The record keeps ids as int32 (half the bytes of every hop): an id an int64 array or a Python
    int carries beyond that would wrap silently in a cast, so it is refused, naming the range."""
    import numpy as np

    s = Sample([1, 2], [], "solver", "p", behaviour_logprobs=[], sample_id="s")
    s.add_segment(np.array([151_935], dtype=np.int64), [-0.5], version=0)  # Qwen3's last id: kept
    assert s.response_ids.dtype == np.int32 and s.response_ids.tolist() == [151_935]
    for bad in (np.array([2**31], dtype=np.int64), np.array([-1], dtype=np.int64), [2**40]):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 2147483647\]"):
            s.add_segment(bad, [-0.5], version=0)
    assert s.response_ids.tolist() == [151_935]  # nothing appended by a refused segment


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"loss_mask": [1, 1, 1]}, "loss_mask"),
        ({"loss_mask": [1, 2, 1, 1]}, "loss_mask"),
        ({"behaviour_logprobs": [-0.1, -0.2]}, "behaviour_logprobs"),
        ({"behaviour_logprobs": [-0.1, 0.2, -0.1, -0.1]}, "behaviour_logprobs"),
        ({"segment_versions": [Segment(0, 2, 1), Segment(3, 4, 2)]}, "segment_versions"),
        ({"segment_versions": [Segment(0, 3, 1)]}, "segment_versions"),
        ({"reward": math.nan}, "reward"),
    ],
)
def test_sample_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"Sample\.{field}"):
        sample(**kwargs)


def test_sample_empty_prompt_and_bad_segment():
    with pytest.raises(ValueError, match="prompt_ids"):
        Sample([], [1], "solver", "p", "g")
    with pytest.raises(ValueError, match="version"):
        Segment(0, 1, -1)
    with pytest.raises(ValueError, match="segment_versions"):
        sample().staleness(3)  # unknown versions


# --------------------------------------------------------------------------------------------- GRPO
def test_grpo_three_samples_by_hand():
    # rewards 1, 0, 0: mean 1/3; population var = ((2/3)² + 2·(1/3)²)/3 = 2/9, std = √2/3
    # A = (2/3)/(√2/3) = √2 and (−1/3)/(√2/3) = −1/√2
    out = grpo_advantages({"g": [1.0, 0.0, 0.0]}, eps=0.0)
    assert out["g"] == pytest.approx([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])
    # with eps = 1e-6 the denominator is √2/3 + 1e-6
    eps_out = grpo_advantages({"g": [1.0, 0.0, 0.0]})
    assert eps_out["g"][0] == pytest.approx((2 / 3) / (math.sqrt(2) / 3 + 1e-6), rel=1e-12)
    # without std normalisation: r − mean
    assert grpo_advantages({"g": [1.0, 0.0, 0.0]}, normalize_std=False)["g"] == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3]
    )


def test_zero_variance_groups_give_zeros():
    rewards = {"all1": [1.0, 1.0, 1.0], "one": [0.0], "mixed": [1.0, 0.0]}
    out = grpo_advantages(rewards)
    assert out["all1"] == [0.0, 0.0, 0.0]
    assert out["one"] == [0.0]
    assert out["mixed"] == pytest.approx([1.0, -1.0], rel=1e-5)  # mean .5, std .5
    assert zero_variance_groups(rewards) == {"all1", "one"}
    with pytest.raises(ValueError, match="no rewards"):
        grpo_advantages({"g": []})


def test_assign_advantages_filters_and_keeps_roles_apart():
    # Same problem, Solver group [1, 0] and Verifier group (input sol) [1, 1]: separate group ids.
    samples = [
        sample(1.0, sample_id="a"),
        sample(1.0, "verifier_1", parent="a", sample_id="v1"),
        sample(0.0, sample_id="b"),
        sample(1.0, "verifier_1", parent="a", sample_id="v2"),
    ]
    kept, stats = assign_advantages(samples, filter_zero_variance=False)
    assert [s.sample_id for s in kept] == ["a", "v1", "b", "v2"]
    # Solver: mean .5, std .5 → ±.5/(.5 + 1e-6); the Verifier group is not mixed in (it would shift the mean)
    assert [s.advantage for s in kept] == pytest.approx([0.5 / 0.500001, 0.0, -0.5 / 0.500001, 0.0])
    assert all(k is s for k, s in zip(kept, samples, strict=True))  # annotated in place: the same records
    assert stats["groups"] == 2 and stats["filtered_groups"] == 0
    assert stats["mean_reward/solver"] == 0.5 and stats["mean_reward/verifier"] == 1.0

    fresh = [dataclasses.replace(s, advantage=None) for s in samples]
    kept, stats = assign_advantages(fresh, filter_zero_variance=True)
    assert [s.sample_id for s in kept] == ["a", "b"]
    assert [s.advantage for s in fresh[1::2]] == [None, None]  # a filtered group is left unannotated
    assert stats["filtered_groups"] == 1 and stats["kept_samples"] == 2 and stats["samples"] == 4


def test_assign_advantages_rejects_mixed_group_and_missing_reward():
    a = sample(1.0)
    b = Sample([1], [2], "verifier_1", "p1", a.group_id, reward=0.0)
    with pytest.raises(ValueError, match="mixes positions"):
        assign_advantages([a, b], filter_zero_variance=False)
    with pytest.raises(ValueError, match="no reward"):
        assign_advantages([sample(None)], filter_zero_variance=False)
