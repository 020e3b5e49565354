"""A batch cut into data-parallel shares on the driver (mars_megatron/rl/shares.py): each rank gets exactly
the samples of the packs the whole-batch plan gives it, nothing else, and the driver plans once."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from mars_megatron.agents.graph_file import load_graph
from mars_megatron.agents.sample import Sample, Segment
from mars_megatron.config import TrainConfig
from mars_megatron.pipeline.facades import TrainerGroup, TrainerRanks
from mars_megatron.rl.shares import MiniBatchShare, shard_batch, split_groups
from mars_megatron.training.packing import PackSpec, build_pack, build_plan_pack

POSITIONS = ("solver", "verifier_1", "corrector_1")


def _batch(problems: int, group: int, rng: random.Random, *, routing: bool = False) -> list[Sample]:
    """GRPO groups of ``group`` samples per problem and position, lengths 5-300, with engine log-probs and
    (``routing``) R3 arrays, so a share's size says what was sent."""
    out = []
    for p in range(problems):
        for position in POSITIONS:
            for g in range(group):
                response = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 300))]
                tokens = 3 + len(response)
                out.append(
                    Sample(
                        [1, 2, 3],
                        response,
                        position,
                        f"p{p}",
                        sample_id=f"p{p}/{position}/{g}",
                        advantage=0.5,
                        behaviour_logprobs=[-1.0] * len(response),
                        segment_versions=[Segment(0, len(response), 0)],
                        routed_experts=np.zeros((tokens - 1, 4, 2), np.uint8) if routing else None,
                    )
                )
    return out


@pytest.mark.parametrize(("dp", "updates"), [(1, 1), (3, 1), (4, 2)])
def test_each_rank_gets_exactly_its_packs_of_the_whole_batch_plan(dp: int, updates: int) -> None:
    rng = random.Random(dp * 10 + updates)
    samples = _batch(12, 4, rng)
    spec = PackSpec(dp=dp, seq_multiple=4)
    shares = shard_batch(samples, spec, 512, updates)
    assert len(shares) == dp
    minis = split_groups(samples, updates)
    for u, mini in enumerate(minis):
        plan = spec.plan([len(s.tokens) for s in mini], 512)  # what every rank planned before
        seen: list[str] = []
        for rank, share in enumerate(shares):
            m = share.minis[u]
            assert m.packs == tuple(plan.packs[k] for k in plan.rank_packs[rank])
            assert m.roles == tuple(s.role for s in mini) and len(m) == len(mini)
            assert all(m[i] is mini[i] for pack in m.packs for i in pack)  # the record itself, no copy
            seen += [s.sample_id for s in m.own()]
            # the packs a rank builds from its share are the ones it built from the whole batch
            for ids, k in zip(m.packs, plan.rank_packs[rank], strict=True):
                mine = build_pack([m[i].tokens for i in ids], sample_ids=ids, max_len=512, multiple=512)
                whole = build_plan_pack(plan, [s.tokens for s in mini], k, multiple=512)
                assert mine.sample_ids == whole.sample_ids and mine.sample_spans == whole.sample_spans
                assert mine.tokens.equal(whole.tokens) and mine.loss_mask.equal(whole.loss_mask)
        assert sorted(seen) == sorted(s.sample_id for s in mini)  # every sample on exactly one rank
        assert len({len(share.minis[u].packs) for share in shares}) == 1  # same schedule on every rank
    assert all(share.engine_logprobs for share in shares)


def test_a_rank_receives_its_share_not_the_batch() -> None:
    """What is sent (pickled as Ray pickles it) per rank is about the whole batch over DP; before, every
    rank received the whole batch."""
    samples = _batch(16, 8, random.Random(5), routing=True)
    dp = 4
    shares = shard_batch(samples, PackSpec(dp=dp, seq_multiple=1), 1024, 1)
    whole = len(pickle.dumps(samples, protocol=5))
    sent = [len(pickle.dumps(share, protocol=5)) for share in shares]
    own = [len(pickle.dumps(share.own(), protocol=5)) for share in shares]
    for s, o in zip(sent, own, strict=True):
        # the share is its samples, plus a bounded amount per sample of the batch whatever the tokens
        # (each one's role, the pack indices): 129 B here, where a sample is 10 tokens; a paper sample
        # is 40k tokens and their routing
        assert s - o <= 160 * len(samples)
    assert max(sent) <= 1.1 * whole / dp + 160 * len(samples)
    assert sum(sent) <= whole + dp * 160 * len(samples)  # the batch once, not DP times


def test_truncated_samples_are_counted_for_the_whole_mini_batch() -> None:
    samples = _batch(4, 2, random.Random(1))
    shares = shard_batch(samples, PackSpec(dp=2, seq_multiple=1), 64, 1)
    long = sum(len(s.tokens) > 64 for s in samples)
    assert long > 0 and all(share.minis[0].truncated == long for share in shares)


def test_a_share_refuses_packs_that_do_not_match_its_samples() -> None:
    s = _batch(1, 1, random.Random(0))
    with pytest.raises(ValueError, match="holds"):
        MiniBatchShare(roles=("solver",) * 3, samples={0: s[0]}, packs=((0, 1),), capacity=512)
    with pytest.raises(ValueError, match="outside its mini-batch"):
        MiniBatchShare(roles=("solver",), samples={0: s[0], 3: s[1]}, packs=((0, 3),), capacity=512)
    with pytest.raises(ValueError, match="empty batch"):
        shard_batch([], PackSpec(dp=2, seq_multiple=1), 512, 1)


def test_the_trainer_group_sends_replicas_the_same_share() -> None:
    """Ranks of one data-parallel replica (here TP=2: ranks 0, 1 and 2, 3) get one share object, so Ray
    stores it once; policies without samples are left out."""
    ranks = TrainerRanks(
        writer_rank=1, dp_ranks=(0, 0, 1, 1), spec=PackSpec(dp=2, seq_multiple=2), backend="gloo"
    )
    train = TrainConfig(pack_length=512, updates_per_batch=1)
    group = TrainerGroup(None, None, ["solver", "verifier"], load_graph("marsrl"), train, ranks)  # type: ignore[arg-type]
    samples = [s for s in _batch(6, 4, random.Random(2)) if s.role == "solver"]
    per_dp = group.shares({"solver": samples, "verifier": []})
    assert len(per_dp) == 2 and all(set(d) == {"solver"} for d in per_dp)
    ids = [{s.sample_id for s in d["solver"].own()} for d in per_dp]
    assert not ids[0] & ids[1] and ids[0] | ids[1] == {s.sample_id for s in samples}
