"""mars_megatron.training.packing: plans (pure) and packed tensors, checked against a real megatron model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mars_megatron.training.packing import PackPlan, build_pack, build_plan_pack, plan_packs

CAP = 69_632


def long_tail(seed: int, n: int = 1024) -> list[int]:
    """The TARGETS.md packing workload (same generator as tools/bench/packing.py)."""
    rng = random.Random(seed)
    return [
        rng.randint(200, 2000) + min(max(round(rng.lognormvariate(math.log(15_000), 0.6)), 500), 65_536)
        for _ in range(n)
    ]


def check_plan(plan: PackPlan, lengths: list[int], cap: int) -> None:
    flat = [i for p in plan.packs for i in p]
    assert sorted(flat) == list(range(len(lengths)))  # every sample exactly once
    assert sum(plan.pack_loads) == sum(min(x, cap) for x in lengths)  # tokens preserved
    assert max(plan.pack_loads) <= cap
    assert sorted(k for r in plan.rank_packs for k in r) == list(range(len(plan.packs)))


# --------------------------------------------------------------------------------------------- plans
def test_small_plan_by_hand() -> None:
    plan = plan_packs([5, 3, 9, 2], 8)
    assert plan.truncated == (2,)
    assert plan.packed_lengths == (5, 3, 8, 2)
    assert sorted(sorted(p) for p in plan.packs) == [[0, 1], [2], [3]]
    assert plan.lower_bound == 3 and plan.num_packs == 3
    check_plan(plan, [5, 3, 9, 2], 8)


def test_oversize_truncated_into_own_pack() -> None:
    lengths = [100, 30, 250, 40, 20, 101]
    plan = plan_packs(lengths, 100, dp=2)
    assert plan.truncated == (2, 5)
    assert (2,) in plan.packs and (5,) in plan.packs
    assert plan.packed_lengths[2] == 100
    check_plan(plan, lengths, 100)


def test_constructor_rejects_bad_plans() -> None:
    with pytest.raises(AssertionError):  # sample 1 lost
        PackPlan(capacity=10, lengths=(3, 4), packed_lengths=(3, 4), packs=((0,),), rank_packs=((0,),))
    with pytest.raises(AssertionError):  # over the capacity
        PackPlan(capacity=6, lengths=(3, 4), packed_lengths=(3, 4), packs=((0, 1),), rank_packs=((0,),))


@pytest.mark.parametrize("seed", range(5))
def test_random_long_tail_plans_are_valid_and_deterministic(seed: int) -> None:
    lengths = long_tail(seed, 512)
    lengths[3] = CAP + 5000  # one oversize sample
    plan = plan_packs(lengths, CAP, dp=8)
    check_plan(plan, lengths, CAP)
    assert (3,) in plan.packs and plan.truncated == (3,)
    assert plan.num_packs <= plan.lower_bound + 2
    assert plan == plan_packs(lengths, CAP, dp=8)


@pytest.mark.parametrize("seed", range(3))
def test_at_most_lower_bound_plus_one_packs(seed: int) -> None:
    plan = plan_packs(long_tail(seed), CAP, dp=8)
    assert plan.num_packs <= plan.lower_bound + 1


def test_dp_balance_on_targets_workload() -> None:
    plan = plan_packs(long_tail(0), CAP, dp=8)
    assert plan.balance <= 1.01
    check_plan(plan, long_tail(0), CAP)


def test_pad_ranks_gives_equal_pack_counts() -> None:
    lengths = long_tail(2, 300)
    plan = plan_packs(lengths, CAP, dp=8, pad_ranks=True)
    counts = {len(r) for r in plan.rank_packs}
    assert len(counts) == 1
    assert plan.num_padding_packs == len(plan.packs) - plan.num_packs
    assert all(p == () for p in plan.packs[plan.num_packs :])
    unpadded = plan_packs(lengths, CAP, dp=8)
    assert plan.num_packs == unpadded.num_packs


# -------------------------------------------------------------------------------------------- tensors
def test_pack_tensors_by_hand() -> None:
    pack = build_pack([[5, 6, 7], [8, 9]], multiple=4)
    assert pack.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert pack.targets.tolist() == [[6, 7, 0, 9, 0, 0, 0, 0]]
    assert pack.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert pack.cu_seqlens.tolist() == [0, 3, 5, 8] and pack.cu_seqlens.dtype == torch.int32
    assert pack.sample_spans == ((0, 3), (3, 5))
    run_on = build_pack([[5, 6, 7], [8, 9]], multiple=4, restart_positions=False)
    assert run_on.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    mask = pack.attention_mask()
    assert mask.shape == (1, 1, 8, 8) and mask.dtype == torch.bool
    allowed = (~mask[0, 0]).int().tolist()
    assert allowed[4] == [0, 0, 0, 1, 1, 0, 0, 0]  # token 4 sees only sample 1, causally
    assert allowed[2] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert allowed[7] == [0, 0, 0, 0, 0, 1, 1, 1]  # the pad sample is its own block
    assert [t.tolist() for t in pack.unpack(torch.arange(8)[None])] == [[0, 1, 2], [3, 4]]


def _mask_by_rule(lengths: list[int]) -> torch.Tensor:
    """The block-diagonal causal mask written out by its definition, position by position."""
    segment = [i for i, n in enumerate(lengths) for _ in range(n)]
    size = len(segment)
    rows = [[not (segment[q] == segment[k] and k <= q) for k in range(size)] for q in range(size)]
    return torch.tensor(rows)[None, None]


@pytest.mark.parametrize("seed", range(4))
def test_attention_mask_is_the_block_diagonal_causal_mask(seed: int) -> None:
    """The mask is built from cu_seqlens alone (so that a GPU builds it where it is used): it must equal
    the rule written out, for packs of one token, of many, with and without a pad segment."""
    rng = random.Random(seed)
    seqs = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 6))]
    pack = build_pack(seqs, multiple=rng.choice([1, 4, 8]))
    lengths = pack.cu_seqlens.diff().tolist()
    mask = pack.attention_mask()
    assert mask.dtype == torch.bool and mask.device.type == "cpu"
    assert torch.equal(mask, _mask_by_rule(lengths))


@pytest.mark.gpu
def test_attention_mask_is_made_on_the_gpu() -> None:
    """On a GPU the mask is made there (only cu_seqlens crosses) and equals the host's, at 4k."""
    seqs = [[1] * n for n in (1000, 1500, 1, 1500)]
    pack = build_pack(seqs, multiple=4096)
    before = torch.cuda.memory_allocated()
    mask = pack.attention_mask("cuda")
    assert mask.is_cuda and mask.shape == (1, 1, 4096, 4096)
    assert torch.cuda.memory_allocated() - before >= 4096 * 4096  # the T*T booleans live on the device
    assert torch.equal(mask.cpu(), pack.attention_mask())


def test_packed_seq_params_thd() -> None:
    pytest.importorskip("megatron.core")
    params = build_pack([[1, 2, 3], [4]], multiple=2).packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 4] and params.cu_seqlens_kv.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 3


def test_plan_pack_truncates_as_planned() -> None:
    seqs = [[1] * 5, [2] * 12, [3] * 2]
    plan = plan_packs([len(s) for s in seqs], 8)
    k = plan.packs.index((1,))
    pack = build_plan_pack(plan, seqs, k, multiple=4)
    assert pack.tokens.tolist() == [[2] * 8] and pack.sample_ids == (1,)


# -------------------------------------------------------------------------- a real megatron model
@pytest.mark.multiproc
def test_packed_logits_match_unpacked_on_megatron_moe() -> None:
    from mars_megatron.training import parallel
    from tests.packing_workers import packed_vs_alone

    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 14, 6)]
    changed = [samples[0], torch.randint(0, 200, (14,), generator=g).tolist(), samples[2]]
    (r,) = parallel.launch(packed_vs_alone, 1, samples, changed, 4, timeout_s=300)
    assert r["length"] == 32  # 29 tokens + a 3-token pad sample
    assert max(r["diff_restart=True"]) < 1e-5, r
    assert max(r["diff_restart=False"]) < 1e-5, r
    d = r["changed_diff"]
    assert d[0] < 1e-5 and d[2] < 1e-5, r  # no attention across samples
    assert d[1] > 1e-3, r
