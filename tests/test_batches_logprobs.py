"""training.batches (padding sequences into micro-batches) and training.logprobs (vocab-parallel
log-probs): pure maths checked against hand-computed values and torch.log_softmax, plus one 2-rank
gloo run that splits the vocabulary between tensor-parallel ranks."""

from __future__ import annotations

import math

import pytest
import torch

from mars_megatron.algorithm.tensors import MicroBatch
from mars_megatron.training import parallel
from mars_megatron.training.batches import make_micro_batches, padded_length
from mars_megatron.training.logprobs import vocab_parallel_logprobs
from tests import engine_workers


# ------------------------------------------------------------------------------------ make_micro_batches
def test_micro_batches_pad_shift_and_mask_by_hand() -> None:
    mbs = make_micro_batches([[11, 12, 13], [14], [15, 16]], 2)
    assert len(mbs) == 2
    first, last = mbs
    assert first.tokens.tolist() == [[11, 12, 13], [14, 0, 0]]
    assert first.targets.tolist() == [[12, 13, 0], [0, 0, 0]]
    assert first.loss_mask.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert first.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert first.lengths == (3, 1)
    # the last micro-batch holds the remainder but keeps the step's common length
    assert last.tokens.tolist() == [[15, 16, 0]]
    assert last.targets.tolist() == [[16, 0, 0]]
    assert last.loss_mask.tolist() == [[1.0, 0.0, 0.0]]
    assert last.position_ids.tolist() == [[0, 1, 2]]
    assert last.lengths == (2,)


def test_micro_batch_dtypes_and_independent_tensors() -> None:
    (mb,) = make_micro_batches([(5, 6), (7, 8)], 4)
    assert isinstance(mb, MicroBatch)
    assert (mb.tokens.dtype, mb.targets.dtype, mb.position_ids.dtype) == (torch.long,) * 3
    assert mb.loss_mask.dtype == torch.float32
    assert mb.tokens.shape == mb.targets.shape == mb.loss_mask.shape == mb.position_ids.shape == (2, 2)
    mb.position_ids[0, 0] = 99  # a real tensor per row, not an expanded view of one row
    assert mb.position_ids[1, 0].item() == 0


def test_micro_batches_round_length_up_to_multiple() -> None:
    mbs = make_micro_batches([[1, 2, 3, 4, 5], [6, 7]], 1, multiple=4)
    assert [mb.tokens.shape for mb in mbs] == [(1, 8), (1, 8)]
    assert mbs[0].tokens.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert mbs[0].loss_mask.sum().item() == 4
    assert mbs[1].loss_mask.tolist() == [[1, 0, 0, 0, 0, 0, 0, 0]]
    assert padded_length([[1, 2, 3, 4, 5], [6, 7]], 4) == 8
    assert padded_length([[1, 2, 3, 4]], 4) == 4
    assert padded_length([[1]]) == 1


def test_micro_batches_explicit_seq_length() -> None:
    (mb,) = make_micro_batches([[1, 2], [3]], 2, multiple=2, seq_length=6)
    assert mb.tokens.tolist() == [[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0]]
    assert mb.loss_mask.sum().item() == 1


def test_single_token_sequence_has_no_target() -> None:
    (mb,) = make_micro_batches([[42]], 1)
    assert mb.tokens.tolist() == [[42]]
    assert mb.loss_mask.tolist() == [[0.0]]
    assert mb.lengths == (1,)


@pytest.mark.parametrize(
    ("seqs", "kwargs", "match"),
    [
        ([], {}, "no sequences"),
        ([[1, 2], []], {}, "sequence 1 is empty"),
        ([[1, 2, 3]], {"seq_length": 2}, "fit every sequence"),
        ([[1, 2, 3]], {"seq_length": 5, "multiple": 2}, "multiple of 2"),
    ],
    ids=["no-sequences", "empty-sequence", "too-long", "length-not-multiple"],
)
def test_micro_batch_errors(seqs: list, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_micro_batches(seqs, 2, **kwargs)


# ---------------------------------------------------------------------------- vocab_parallel_logprobs
def _reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_full_vocab_equals_log_softmax_gather() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    got = vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=11)
    assert got.shape == (2, 5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(logits, targets), rtol=0, atol=1e-6)


def test_padded_vocab_entries_are_excluded_by_hand() -> None:
    # ids 0..2 are real with probabilities 1/6, 2/6, 3/6; id 3 is vocabulary padding (vocab_size 3) and
    # carries the largest logit, so counting it would change every value.
    row = [0.0, math.log(2), math.log(3), 5.0]
    logits = torch.tensor([row, row, row])
    targets = torch.tensor([0, 1, 2])
    got = vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=3)
    expected = torch.tensor([math.log(1 / 6), math.log(2 / 6), math.log(3 / 6)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_large_logits_stay_finite() -> None:
    # exp(1000) overflows float32: the max-shift must keep the result exact (p = 1 / (1 + e))
    logits = torch.tensor([[1000.0, 1001.0]])
    got = vocab_parallel_logprobs(logits, torch.tensor([0]), vocab_start=0, vocab_size=2)
    torch.testing.assert_close(got, torch.tensor([-math.log(1 + math.e)]), rtol=0, atol=1e-6)


def test_low_precision_logits_are_computed_in_fp32() -> None:
    logits = torch.tensor([[0.0, math.log(3)]], dtype=torch.bfloat16)
    got = vocab_parallel_logprobs(logits, torch.tensor([1]), vocab_start=0, vocab_size=2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(logits, torch.tensor([1])), rtol=0, atol=1e-6)


def test_gradients_match_log_softmax_and_padding_gets_none() -> None:
    g = torch.Generator().manual_seed(1)
    vocab, padded = 6, 8
    logits = (torch.randn(3, 4, padded, generator=g) * 2).requires_grad_(True)
    targets = torch.randint(0, vocab, (3, 4), generator=g)
    upstream = torch.randn(3, 4, generator=g)
    (vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=vocab) * upstream).sum().backward()

    real = logits.detach()[..., :vocab].clone().requires_grad_(True)
    (_reference(real, targets) * upstream).sum().backward()
    assert logits.grad is not None and real.grad is not None
    torch.testing.assert_close(logits.grad[..., :vocab], real.grad, rtol=0, atol=1e-6)
    assert torch.equal(logits.grad[..., vocab:], torch.zeros(3, 4, padded - vocab))
    # by hand: d log p(t) / d logit_j = [j == t] - p_j, so each row's gradient sums to zero
    torch.testing.assert_close(real.grad.sum(-1), torch.zeros(3, 4), rtol=0, atol=1e-6)


@pytest.mark.multiproc
def test_two_tp_ranks_split_vocab_match_one_process() -> None:
    """Rank 0 holds ids 0..4, rank 1 ids 5..9 of which 8 and 9 are padding (vocab_size 8)."""
    g = torch.Generator().manual_seed(2)
    vocab, padded = 8, 10
    logits = torch.randn(3, 5, padded, generator=g) * 2
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    targets[0, :2] = torch.tensor([0, 7])  # both halves' edges are targets
    assert (targets < 5).any() and (targets >= 5).any()
    upstream = torch.randn(3, 5, generator=g)

    single = logits.clone().requires_grad_(True)
    expected = vocab_parallel_logprobs(single, targets, vocab_start=0, vocab_size=vocab)
    (expected * upstream).sum().backward()
    assert single.grad is not None
    torch.testing.assert_close(expected, _reference(logits[..., :vocab], targets), rtol=0, atol=1e-6)

    results = parallel.launch(engine_workers.tp_logprobs, 2, logits, targets, vocab, upstream, timeout_s=300)
    for values, grad in results:
        torch.testing.assert_close(values, expected.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, single.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(results[0][1][..., vocab:], torch.zeros(3, 5, padded - vocab))


def test_chunked_values_and_gradients_match_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 3 tokens (of 10) with vocabulary padding: values and gradients as log_softmax gives."""
    from mars_megatron.training import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_TOKENS", 3)
    g = torch.Generator().manual_seed(2)
    vocab, padded = 7, 9
    logits = (torch.randn(2, 5, padded, generator=g) * 3).requires_grad_(True)
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    upstream = torch.randn(2, 5, generator=g)
    got = vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=vocab)
    (got * upstream).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = _reference(ref_logits[..., :vocab], targets)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-6)
    assert logits.grad[..., vocab:].abs().max() == 0  # padding gets no gradient


def test_backward_keeps_only_the_logits_and_per_token_statistics() -> None:
    """What autograd saves for the backward pass: the bf16 logits themselves (not fp32 copies, shifted
    logits or exponentials) and a few numbers per token."""
    tokens, vocab = 64, 1024
    logits = torch.randn(tokens, vocab).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_logprobs(logits, targets, vocab_start=0, vocab_size=vocab).sum().backward()
    per_logit = [t for t in saved if t.numel() >= tokens * vocab]
    assert len(per_logit) == 1 and per_logit[0].dtype == torch.bfloat16  # the input, not a copy
    assert sum(t.numel() * t.element_size() for t in saved if t.numel() < tokens * vocab) <= 32 * tokens
