"""Policy-loss pieces and their composition, against hand-computed values."""

import math

import pytest
import torch

from mars_megatron.algorithm import (
    KL_CLAMP,
    LossInputs,
    Sample,
    compute_loss,
    dmmpt_mask,
    entropy_estimate,
    entropy_from_logits,
    entropy_sums,
    kl_penalty,
    kl_per_token,
    loss_inputs,
    make_loss_fn,
    pois_old_logprobs,
    policy_loss,
    role_weights,
    tis_weights,
)
from mars_megatron.config import AlgorithmConfig, ConfigError
from mars_megatron.training.batches import make_micro_batches

ROLES = ("solver", "verifier", "corrector")

LN = math.log


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ------------------------------------------------------------------------------------ clipped surrogate
# old log-probs 0, so ratio r = exp(logprob). clip range [0.8, 1.28].
# row 0, A = +1: r = 1.1 → −1.1 (inside); r = 1.5 → max(−1.5, −1.28) = −1.28 (clipped); r = 0.5 → −0.5
#   (below the range but A > 0: the min keeps the unclipped term, gradient flows)
# row 1, A = −1: r = 0.9 → 0.9 (inside); r = 0.5 → max(0.5, 0.8) = 0.8 (clipped); r = 1.6 → 1.6 (above the
#   range but A < 0: unclipped), and this token is masked out.
RATIOS = [[1.1, 1.5, 0.5], [0.9, 0.5, 1.6]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [1.0, -1.0]


def test_policy_loss_values_and_stats():
    logprobs = t([[LN(r) for r in row] for row in RATIOS])
    old = torch.zeros_like(logprobs)
    loss, stats = policy_loss(logprobs, old, t(ADV), t([[1.0] * 3] * 2))
    assert loss.item() == pytest.approx(-1.1 - 1.28 - 0.5 + 0.9 + 0.8 + 1.6)  # 0.42
    loss, stats = policy_loss(logprobs, old, t(ADV), t(MASK))
    assert loss.item() == pytest.approx(-1.1 - 1.28 - 0.5 + 0.9 + 0.8)  # −1.18
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)  # (0,1) and (1,1) of 5 masked tokens
    assert stats["ratio_mean"].item() == pytest.approx((1.1 + 1.5 + 0.5 + 0.9 + 0.5) / 5)  # 0.9
    assert stats["ratio_max"].item() == pytest.approx(1.5)  # 1.6 is masked
    k3 = [r - 1 - LN(r) for r in (1.1, 1.5, 0.5, 0.9, 0.5)]
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 5)


def test_policy_loss_gradient_matches_analytic():
    logprobs = t([[LN(r) for r in row] for row in RATIOS]).requires_grad_()
    loss, _ = policy_loss(logprobs, torch.zeros_like(logprobs), t(ADV), t(MASK))
    loss.backward()
    # unclipped: d/dlogp = −A·r·mask; clipped: 0
    expected = [[-1.1, 0.0, -0.5], [0.9, 0.0, 0.0]]
    torch.testing.assert_close(logprobs.grad, t(expected))


def test_policy_loss_per_token_advantages_and_symmetric_clip():
    # A given per token; clip_high = clip_low = 0.2: r = 1.25 with A = 2 → −min(2.5, 2.4) = −2.4
    logprobs = t([[LN(1.25), LN(1.0)]])
    loss, stats = policy_loss(logprobs, torch.zeros_like(logprobs), t([[2.0, 3.0]]), t([[1, 1]]), 0.2, 0.2)
    assert loss.item() == pytest.approx(-2.4 - 3.0)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)


# -------------------------------------------------------------------------------------------------- KL
def test_kl_estimators_by_hand():
    # token 0: π = .5, π_ref = .25 → log ρ = ln .5; token 1: π = .5, π_ref = 1 → log ρ = ln 2
    logprobs, ref = t([[LN(0.5), LN(0.5)]]), t([[LN(0.25), 0.0]])
    both, first = t([[1, 1]]), t([[1, 0]])
    assert kl_penalty(logprobs, ref, both, "k1").item() == pytest.approx(LN(2) - LN(2))  # −ln ρ: 0
    assert kl_penalty(logprobs, ref, both, "k2").item() == pytest.approx(LN(2) ** 2)  # 2·½(ln 2)²
    # k3 = ρ − 1 − ln ρ: (.5 − 1 + ln 2) + (2 − 1 − ln 2) = 0.5
    assert kl_penalty(logprobs, ref, both, "k3").item() == pytest.approx(0.5)
    assert kl_penalty(logprobs, ref, first, "k3").item() == pytest.approx(LN(2) - 0.5)  # 0.19315
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logprobs, ref, both, "k4")


def _kl_value_and_grad(log_rho: float, kind: str, **kwargs) -> tuple[float, float]:
    """KL of one token whose log ρ = ref − logprob is ``log_rho``, and its gradient d/d logprob."""
    logprobs = t([[0.0]]).requires_grad_()
    kl = kl_per_token(logprobs, t([[log_rho]]), kind, **kwargs)
    kl.sum().backward()
    return kl.item(), logprobs.grad.item()


@pytest.mark.parametrize(
    ("kind", "log_rho", "value", "grad"),
    [
        # far outside the band: clamped to ±10, no gradient (before the clamp: k3 = e^20 − 21 ≈ 4.9e8,
        # gradient −(e^20 − 1) ≈ −4.9e8; k2 = 200; k1 = −20)
        ("k3", 20.0, KL_CLAMP, 0.0),
        ("k2", 20.0, KL_CLAMP, 0.0),
        ("k1", 20.0, -KL_CLAMP, 0.0),
        ("k1", -20.0, KL_CLAMP, 0.0),
        ("k3", -20.0, KL_CLAMP, 0.0),  # e^−20 + 19 ≈ 19 > 10
        ("k3", 1e6, KL_CLAMP, 0.0),  # past the log-ratio bound as well
        # inside the band: the exact estimators, d/dlogp k1 = 1, k2 = −log ρ, k3 = −(ρ − 1)
        ("k3", 0.5, math.exp(0.5) - 1.5, -(math.exp(0.5) - 1.0)),
        ("k2", 0.5, 0.125, -0.5),
        ("k1", 0.5, -0.5, 1.0),
        ("k3", 2.0, math.exp(2.0) - 3.0, -(math.exp(2.0) - 1.0)),  # 4.39: still inside
        ("k3", 3.0, KL_CLAMP, 0.0),  # e^3 − 4 = 16.1: a moderate log-ratio already reaches the bound
    ],
)
def test_kl_per_token_is_clamped(kind: str, log_rho: float, value: float, grad: float):
    got_value, got_grad = _kl_value_and_grad(log_rho, kind)
    assert got_value == pytest.approx(value, rel=1e-12)
    assert math.isfinite(got_grad) and got_grad == pytest.approx(grad, rel=1e-12, abs=0.0)


def test_kl_clamp_is_a_setting():
    # log ρ = 2: k3 = e^2 − 3 = 4.389, under the default bound, over a bound of 4
    assert _kl_value_and_grad(2.0, "k3")[0] == pytest.approx(math.exp(2.0) - 3.0)
    assert _kl_value_and_grad(2.0, "k3", clamp=4.0) == (4.0, 0.0)
    with pytest.raises(ValueError, match="clamp"):
        kl_per_token(t([[0.0]]), t([[0.0]]), "k3", clamp=0.0)
    # through the objective: one wild token adds kl_coef · kl_clamp, with a finite, zero KL gradient
    logprobs = t([[0.0, 0.0]]).requires_grad_()
    inputs = LossInputs(advantages=t([1.0]), mask=t([[1, 1]]), ref_logprobs=t([[20.0, 0.5]]))
    for clamp in (KL_CLAMP, 4.0):
        logprobs.grad = None
        loss, count, stats = compute_loss(logprobs, inputs, AlgorithmConfig(kl_coef=0.1, kl_clamp=clamp))
        assert count.item() == 2
        k3 = math.exp(0.5) - 1.5
        assert loss.item() == pytest.approx(-2.0 + 0.1 * (clamp + k3))  # POIS: −A per token, + β·KL
        assert stats["kl"].item() == pytest.approx((clamp + k3) / 2)
        loss.backward()
        # d/dlogp: −A (POIS) + β·(0 for the clamped token, −(e^.5 − 1) for the other)
        torch.testing.assert_close(logprobs.grad, t([[-1.0, -1.0 - 0.1 * (math.exp(0.5) - 1.0)]]))


# ------------------------------------------------------------------------------------ TIS and POIS
def test_tis_weights_capped_and_detached():
    old = t([[LN(0.5), LN(0.25), LN(0.5)]]).requires_grad_()
    behaviour = t([[LN(0.25), LN(0.5), LN(0.5)]])
    w = tis_weights(old, behaviour, cap=1.5)
    torch.testing.assert_close(w, t([[1.5, 0.5, 1.0]]))  # exp(old − behaviour) = 2 → capped, .5, 1
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, behaviour, cap=0.0)


def test_pois_ratio_one_and_plain_policy_gradient():
    logprobs = t([[LN(0.3), LN(0.9)], [LN(0.6), LN(0.1)]]).requires_grad_()
    adv, mask = t([2.0, -1.0]), t([[1, 1], [1, 0]])
    loss, stats = policy_loss(logprobs, pois_old_logprobs(logprobs), adv, mask)
    assert stats["ratio_mean"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0
    assert loss.item() == pytest.approx(-2.0 - 2.0 + 1.0)  # −A per masked token
    loss.backward()
    # plain PG: d/dlogp [−A·logp·mask] = −A·mask
    torch.testing.assert_close(logprobs.grad, t([[-2.0, -2.0], [1.0, 0.0]]))


# ------------------------------------------------------------------------------------------ DMMPT
def test_dmmpt_masks_mastered_positive_tokens_below_target_only():
    logprobs = t([[LN(0.995), LN(0.5), LN(0.999)], [LN(0.995), LN(0.2), LN(0.999)], [LN(0.995)] * 3])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    adv = t([1.0, -1.0, 0.0])
    kwargs = {"prob_threshold": 0.99, "entropy_target": 0.3}
    # entropy .1 < .3: drop p > .99 tokens of the A > 0 row (col 0; col 2 already masked);
    # the negative row and the zero-advantage row keep everything.
    out = dmmpt_mask(logprobs, mask, adv, 0.1, **kwargs)
    torch.testing.assert_close(out, t([[0, 1, 0], [1, 1, 1], [1, 1, 1]]))
    assert dmmpt_mask(logprobs, mask, adv, 0.3, **kwargs) is mask  # at the target: no masking
    assert dmmpt_mask(logprobs, mask, adv, torch.tensor(0.5), **kwargs) is mask


def test_dmmpt_decision_given_overrides_the_micro_batch_entropy():
    """The update's decision (from the whole batch's entropy) is what the loss applies, whatever this
    pack's or rank's own entropy says: packs and context-parallel ranks of one update cannot disagree."""
    config = AlgorithmConfig(dmmpt=True, dmmpt_prob_threshold=0.99, dmmpt_entropy_target=0.3)
    # this pack's estimate mean(−ln p) = (−ln .995 − ln .2)/2 ≈ .807 ≥ .3: on its own, DMMPT is off
    logprobs = t([[LN(0.995), LN(0.2)]])
    high = {"advantages": t([1.0]), "mask": t([[1, 1]])}
    _, count, stats = compute_loss(logprobs, LossInputs(**high), config)
    assert count.item() == 2 and stats["dmmpt_active"].item() == 0.0
    # the batch decided "on": the mastered token (p = .995 > .99, A > 0) leaves the loss and the count
    loss, count, stats = compute_loss(logprobs, LossInputs(**high, dmmpt_active=True), config)
    assert count.item() == 1 and loss.item() == pytest.approx(-1.0)
    assert stats["dmmpt_active"].item() == 1.0 and stats["dmmpt_masked_fraction"].item() == 0.5
    # the decision wins over a given entropy too (the trainer passes both: entropy is reported)
    inputs = LossInputs(**high, entropy=5.0, dmmpt_active=True)
    _, count, stats = compute_loss(logprobs, inputs, config)
    assert count.item() == 1 and stats["entropy"].item() == 5.0
    # a low-entropy pack (≈ .005 < .3 would mask both tokens) under a batch decision of "off"
    low = t([[LN(0.995), LN(0.995)]])
    _, count, _ = compute_loss(low, LossInputs(**high), config)
    assert count.item() == 0
    _, count, stats = compute_loss(low, LossInputs(**high, dmmpt_active=False), config)
    assert count.item() == 2 and stats["dmmpt_active"].item() == 0.0
    # a context-parallel rank's share keeps the decision (LossInputs.select)
    packed = LossInputs(advantages=t([[1.0, 1.0]]), mask=t([[1, 1]]), dmmpt_active=True)
    share = packed.select(torch.tensor([1]))
    assert share.dmmpt_active is True
    _, count, _ = compute_loss(t([[LN(0.2)]]), share, config)
    assert count.item() == 1  # p = .2: not mastered, kept; the decision did not make it mask more


def test_entropy_sums_add_up_to_the_batch_estimate():
    a, mask_a = t([[LN(0.5), LN(0.25), LN(0.01)]]), t([[1, 1, 0]])
    b, mask_b = t([[LN(0.125)]]), t([[1]])
    parts = [entropy_sums(a, mask_a), entropy_sums(b, mask_b)]
    total, count = (sum(p[i].item() for p in parts) for i in range(2))
    assert count == 3 and total / count == pytest.approx((LN(2) + LN(4) + LN(8)) / 3)  # = 2 ln 2
    assert parts[0][0].item() / parts[0][1].item() == pytest.approx(entropy_estimate(a, mask_a).item())


def test_entropy_exact_and_estimate():
    # p = (.5, .25, .25): H = .5 ln 2 + 2·.25 ln 4 = 1.5 ln 2
    logits = torch.log(t([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([1.5 * LN(2), LN(3)]).float())
    # sampled tokens with p = .5 and .25: mean(−ln p) = (ln 2 + 2 ln 2)/2 = 1.5 ln 2; masked token ignored
    est = entropy_estimate(t([[LN(0.5), LN(0.25), LN(0.01)]]), t([[1, 1, 0]]))
    assert est.item() == pytest.approx(1.5 * LN(2))


# ----------------------------------------------------------------------------------- role weights
def make_sample(position, prompt=(1, 2, 3), response=(4, 5), advantage=1.0, **kwargs) -> Sample:
    return Sample(list(prompt), list(response), position, "p", "g" + position, advantage=advantage, **kwargs)


def test_role_weights_rows():
    samples = [
        make_sample("solver"),
        make_sample("verifier_2"),
        make_sample("corrector_1"),
    ]
    w = role_weights(samples, {"verifier": 0.5, "corrector": 2.0}, seq_len=2)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [0.5, 0.5], [2.0, 2.0]]))


# ------------------------------------------------------------------------------------- composition
def test_compute_loss_tis_kl_role_weights_by_hand():
    half = LN(0.5)
    logprobs = t([[half, half], [half, half]]).requires_grad_()
    inputs = LossInputs(
        advantages=t([1.0, -1.0]),
        mask=t([[1, 1], [1, 0]]),
        old_logprobs=t([[half, half], [half, half]]),  # ratio 1
        behaviour_logprobs=t([[LN(0.25), half], [0.0, half]]),  # TIS w = [[2→1.5, 1], [.5, 1]]
        ref_logprobs=t([[LN(0.25), half], [0.0, half]]),  # k3 = [[ln2 − .5, 0], [1 − ln 2, 0]]
        token_weights=t([[1.0, 1.0], [0.5, 0.5]]),  # solver, verifier at 0.5
    )
    config = AlgorithmConfig(importance="tis", tis_cap=1.5, kl_coef=0.1, kl_kind="k3")
    loss, count, stats = compute_loss(logprobs, inputs, config)
    # surrogate −A·w: [[−1.5, −1], [.5, 1]]; + .1·k3: [[−1.5 + .1(ln2 − .5), −1], [.5 + .1(1 − ln2), 1]]
    # role weights: row 1 × .5; mask drops (1, 1)
    expected = (-1.5 + 0.1 * (LN(2) - 0.5)) - 1.0 + 0.5 * (0.5 + 0.1 * (1 - LN(2)))
    assert loss.item() == pytest.approx(expected)  # −2.2153…
    assert count.item() == 3
    assert stats["tis_weight_mean"].item() == pytest.approx((1.5 + 1 + 0.5) / 3)
    assert stats["kl"].item() == pytest.approx((LN(2) - 0.5 + 1 - LN(2)) / 3)


def test_compute_loss_dmmpt_changes_token_count():
    logprobs = t([[LN(0.995), LN(0.5)]])
    inputs = LossInputs(advantages=t([1.0]), mask=t([[1, 1]]), entropy=0.1)
    config = AlgorithmConfig(dmmpt=True, dmmpt_prob_threshold=0.99, dmmpt_entropy_target=0.3)
    loss, count, stats = compute_loss(logprobs, inputs, config)
    assert count.item() == 1 and loss.item() == pytest.approx(-1.0)  # POIS: −A on the one kept token
    assert stats["dmmpt_masked_fraction"].item() == pytest.approx(0.5)
    # no entropy given: estimate mean(−ln p) = (−ln .995 − ln .5)/2 ≈ .349 ≥ .3, so nothing is masked
    _, count, _ = compute_loss(logprobs, LossInputs(advantages=t([1.0]), mask=t([[1, 1]])), config)
    assert count.item() == 2


def test_compute_loss_requires_fields():
    inputs = LossInputs(advantages=t([1.0]), mask=t([[1.0]]))
    with pytest.raises(ValueError, match="old_logprobs"):
        compute_loss(t([[-0.1]]), inputs, AlgorithmConfig(importance="none"))
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        compute_loss(
            t([[-0.1]]),
            LossInputs(t([1.0]), t([[1.0]]), old_logprobs=t([[-0.1]])),
            AlgorithmConfig(importance="tis"),
        )
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(t([[-0.1]]), inputs, AlgorithmConfig(kl_coef=0.1))


def test_loss_inputs_align_with_micro_batches_and_make_loss_fn():
    # prompt [1, 2, 3], response [4, 5]: position 2 predicts 4, position 3 predicts 5
    a = make_sample("solver", advantage=1.0, loss_mask=[1, 0], behaviour_logprobs=[-0.5, -0.25])
    b = make_sample(
        "verifier_1", prompt=(1, 2), response=(6, 7, 8), advantage=-2.0, behaviour_logprobs=[-1.0] * 3
    )
    config = AlgorithmConfig(role_weights={"verifier": 0.5}, importance="tis")
    (mb,) = make_micro_batches([a.tokens, b.tokens], micro_batch=2)
    inputs = loss_inputs([a, b], mb.tokens.shape[1], config, old_logprobs=[[-0.5, -0.1], [-1.0, -1.0, -1.0]])
    assert mb.targets[0, 2:4].tolist() == [4, 5] and mb.targets[1, 1:4].tolist() == [6, 7, 8]
    torch.testing.assert_close(inputs.mask, torch.tensor([[0.0, 0, 1, 0, 0], [0, 1, 1, 1, 0]]))
    torch.testing.assert_close(inputs.behaviour_logprobs[0], torch.tensor([0.0, 0, -0.5, -0.25, 0]))
    torch.testing.assert_close(inputs.token_weights[:, 0], torch.tensor([1.0, 0.5]))

    sink: list = []
    loss_fn = make_loss_fn(AlgorithmConfig(role_weights={"verifier": 0.5}), lambda _: inputs, sink)
    logprobs = torch.full(mb.tokens.shape, -1.0)
    loss, count = loss_fn(logprobs, mb)
    # POIS: −A per masked token × role weight: a → −1 (one token), b → 3 tokens × (2 × .5) = 3
    assert loss.item() == pytest.approx(2.0) and count.item() == 4 and len(sink) == 1
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        loss_inputs([make_sample("solver")], 5, AlgorithmConfig(importance="tis"))
    with pytest.raises(ValueError, match="advantage"):
        loss_inputs([make_sample("solver", advantage=None)], 5, config)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"kl_clamp": 0.0}, "kl_clamp"),
        ({"kl_kind": "k9"}, "kl_kind"),
        ({"importance": "ppo"}, "importance"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"dmmpt_prob_threshold": 1.0}, "dmmpt_prob_threshold"),
        ({"dmmpt_entropy_target": -1.0}, "dmmpt_entropy_target"),
        ({"role_weights": {"solver": -1.0}}, "role_weights.solver"),
    ],
)
def test_loss_settings_are_validated_by_the_config(kwargs, field):
    """The loss reads the ``algorithm`` section, whose checks name the field (no second set of checks)."""
    with pytest.raises(ConfigError) as error:
        AlgorithmConfig(**kwargs)
    assert error.value.path == field
