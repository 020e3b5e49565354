"""Context parallelism's pure parts: which positions each CP rank holds (by hand, and as a partition that
balances causal attention work), the mask rows a rank attends with, per-sample padding of THD packs,
the loss inputs a rank takes, and the config rules. Megatron runs of CP layouts: tests/test_engine.py,
tests/test_rl_train.py (CPU) and tests/test_gpu.py (TE ring attention over THD)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mars_megatron.algorithm.objective import LossInputs
from mars_megatron.algorithm.tensors import MicroBatch
from mars_megatron.config import ConfigError, ParallelConfig, load_config
from mars_megatron.training import parallel
from mars_megatron.training.context_parallel import local_mask, rank_indices, thd_index, zigzag_index
from mars_megatron.training.packing import build_pack, build_plan_pack, plan_packs


def test_zigzag_by_hand() -> None:
    # 8 tokens, cp 2: four chunks of 2; rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_index(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert zigzag_index(6, 1, 0).tolist() == list(range(6))


def test_thd_splits_every_sample() -> None:
    # samples of 4 and 8 tokens: chunks of 1 and of 2
    assert thd_index([0, 4, 12], 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert thd_index([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ranks_partition_the_sequence_with_equal_causal_work(cp: int) -> None:
    length = 2 * cp * 5
    for cu in (None, [0, 2 * cp, 2 * cp * 4, length]):
        parts = rank_indices(length, cp, cu_seqlens=cu)
        assert sorted(torch.cat(parts).tolist()) == list(range(length))
        assert all(len(p) == length // cp for p in parts)
        if cu is None:  # query t attends t + 1 keys: every rank gets the same number of score entries
            assert len({int((p + 1).sum()) for p in parts}) == 1


def test_bad_lengths_and_ranks_are_named() -> None:
    with pytest.raises(ValueError, match="10 tokens does not split into 2\\*cp = 4 chunks"):
        zigzag_index(10, 2, 0)
    with pytest.raises(ValueError, match="segment 1 of the pack is 6 tokens, not a multiple of 2\\*cp = 4"):
        thd_index([0, 4, 10], 2, 0)
    with pytest.raises(ValueError, match="CP rank 2 out of range for cp = 2"):
        zigzag_index(8, 2, 2)


def test_local_mask_is_the_full_mask_at_rank_rows_and_gathered_columns() -> None:
    pack = build_pack([[1, 2, 3, 4, 5], [6, 7, 8]], multiple=8)
    full = pack.attention_mask()
    parts = rank_indices(8, 2)
    gathered = torch.cat(parts).tolist()
    for rank in range(2):
        got = local_mask(full, parts, rank)
        assert got.shape == (1, 1, 4, 8)
        for i, q in enumerate(parts[rank].tolist()):
            for j, k in enumerate(gathered):
                assert bool(got[0, 0, i, j]) == bool(full[0, 0, q, k])


def test_sample_multiple_pads_each_sample_inside_the_pack() -> None:
    pack = build_pack([[5, 6, 7], [8, 9]], multiple=8, sample_multiple=4)
    assert pack.tokens.tolist() == [[5, 6, 7, 0, 8, 9, 0, 0]]
    assert pack.cu_seqlens.tolist() == [0, 4, 8]  # the pads belong to their sample's segment
    assert pack.sample_spans == ((0, 3), (4, 6))  # spans are the real tokens
    assert pack.loss_mask.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]


def test_plan_counts_padded_rooms() -> None:
    lengths = [5, 3, 9, 2]
    plan = plan_packs(lengths, 8, sample_multiple=4)
    assert plan.packed_lengths == (8, 4, 8, 4)  # 9 is truncated to the capacity
    assert plan.truncated == (2,)
    assert all(load <= 8 for load in plan.pack_loads)
    seqs = [[i + 1] * n for i, n in enumerate(lengths)]
    for k in range(len(plan.packs)):
        pack = build_plan_pack(plan, seqs, k, multiple=8)
        assert all((b - a) % 4 == 0 for a, b in itertools.pairwise(pack.cu_seqlens.tolist()))
    with pytest.raises(ValueError, match="capacity \\(10\\) must be a multiple of sample_multiple \\(4\\)"):
        plan_packs(lengths, 10, sample_multiple=4)


def test_a_rank_takes_its_columns_of_micro_batch_and_loss_inputs() -> None:
    mb = MicroBatch.from_pack(build_pack([[1, 2, 3, 4], [5, 6, 7, 8]], multiple=8))
    idx = zigzag_index(8, 2, 1)
    local = mb.select(idx)
    assert local.tokens.tolist() == [[3, 4, 5, 6]] and local.targets.tolist() == [[4, 0, 6, 7]]
    assert local.pack is mb.pack and local.lengths == mb.lengths
    with pytest.raises(ValueError, match="already one context-parallel rank's share"):
        local.select(idx)
    inputs = LossInputs(advantages=torch.arange(8.0)[None], mask=torch.ones(1, 8), entropy=0.5)
    taken = inputs.select(idx)
    assert taken.advantages.tolist() == [[2.0, 3.0, 4.0, 5.0]] and taken.entropy == 0.5
    assert taken.old_logprobs is None
    with pytest.raises(ValueError, match="per-token advantages"):
        LossInputs(advantages=torch.ones(2), mask=torch.ones(2, 8)).select(idx)


def test_world_size_and_pack_length_rules() -> None:
    layout = ParallelConfig(tp=2, cp=2, ep=2)
    assert parallel.min_world_size(layout) == 4
    assert layout.check_world_size(8) == 2  # dp = 8 / (tp * cp)
    assert layout.seq_multiple == 8  # tp (sequence parallel) * 2 * cp
    with pytest.raises(ConfigError, match="not divisible by tp\\*cp\\*pp = 2\\*2\\*1 = 4"):
        layout.check_world_size(6)
    with pytest.raises(ConfigError, match="cp"):
        ParallelConfig(cp=0)
    with pytest.raises(ConfigError, match=r"train.pack_length.*not divisible by 8 \(2\*parallel.cp"):
        load_config(None, ["parallel.tp=2", "parallel.cp=2", "train.pack_length=4100",
                           "rollout.max_response_tokens=64"])  # fmt: skip
    cfg = load_config(None, ["parallel.cp=2", "train.pack_length=4096", "rollout.max_response_tokens=64"])
    assert cfg.parallel.cp == 2
