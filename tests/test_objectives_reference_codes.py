"""Held-out float64 checks of the baselines as verl runs them and of TRL's objectives.

Each reference below is written from the published formula in the form its reference code states it
(verl's ``compute_policy_loss_vanilla`` / ``compute_policy_loss_gspo``, TRL's ``GRPOTrainer._compute_loss``),
not from our token-coefficient form. Where the formula has no stop-gradient its gradient is taken by
central finite differences of the float64 value, so the gradient check shares nothing with the
implementation; CISPO's detached weight has an analytic gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from respo_jax.objectives import get_objective

H = 1e-6  # finite-difference step in log-prob units


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def finite_difference_grad(value_fn, logp, mask):
    """d value / d logp by central differences, only at response tokens (padding gets 0)."""
    grad = np.zeros_like(logp)
    for i, t in zip(*np.nonzero(mask)):
        plus, minus = logp.copy(), logp.copy()
        plus[i, t] += H
        minus[i, t] -= H
        grad[i, t] = (value_fn(plus) - value_fn(minus)) / (2 * H)
    return grad


def run(objective, logp, old_logp, adv, mask):
    args = [jnp.asarray(x, jnp.float32) for x in (old_logp, adv, mask)]
    (loss, metrics), grad = jax.value_and_grad(objective, has_aux=True)(jnp.asarray(logp, jnp.float32), *args)
    return float(loss), np.asarray(grad, np.float64), metrics


def ragged_batch(seed, batch=6, seq=7, scale=0.7, empty_row=False):
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-3.0, -0.1, (batch, seq))
    old_logp = logp - rng.normal(0.0, scale, (batch, seq))
    lengths = rng.integers(2, seq + 1, batch)
    if empty_row:
        lengths[-1] = 0
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float64)
    adv = rng.normal(0.0, 1.0, batch)
    adv[0], adv[1] = 1.3, -1.1
    return logp, old_logp, adv, mask


# ----------------------------------------------------------------------------- GRPO with the dual clip


def verl_vanilla_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.2, clip_ratio_c=3.0):
    """verl's compute_policy_loss_vanilla with token-mean agg_loss, in float64."""
    ratio = np.exp(np.clip(logp - old_logp, -20.0, 20.0))
    a = adv[:, None]
    pg_losses1 = -a * ratio
    pg_losses2 = -a * np.clip(ratio, 1 - eps_low, 1 + eps_high)
    clip_pg_losses1 = np.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -a * clip_ratio_c
    clip_pg_losses2 = np.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = np.where(a < 0, clip_pg_losses2, clip_pg_losses1)
    return np.sum(pg_losses * mask) / np.sum(mask)


def test_grpo_dual_clip_matches_verl_vanilla_in_float64():
    logp, old_logp, adv, mask = ragged_batch(seed=5, scale=0.9)
    ratio = np.exp(logp - old_logp)[mask > 0]
    for kink in (0.8, 1.2, 3.0):  # finite differences need distance from every kink
        assert np.min(np.abs(ratio - kink)) > 1e-4
    negative_tokens = (adv[:, None] < 0) & (mask > 0)
    assert np.any(negative_tokens & (np.exp(logp - old_logp) > 3.0))  # the dual clip binds somewhere

    loss, grad, metrics = run(get_objective("grpo"), logp, old_logp, adv, mask)
    ref_loss = verl_vanilla_loss(logp, old_logp, adv, mask)
    ref_grad = finite_difference_grad(lambda x: verl_vanilla_loss(x, old_logp, adv, mask), logp, mask)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    dual = negative_tokens & (np.exp(logp - old_logp) > 3.0)
    np.testing.assert_allclose(float(metrics["clip_fraction_dual"]), dual.sum() / mask.sum(), rtol=1e-6)
    assert not np.any(grad[dual])

    # clip_ratio_c=None is plain PPO clipping: a different loss on the same batch.
    plain, _, _ = run(get_objective("grpo", clip_ratio_c=None), logp, old_logp, adv, mask)
    expected_plain = verl_vanilla_loss(logp, old_logp, adv, mask, clip_ratio_c=np.inf)
    np.testing.assert_allclose(plain, expected_plain, rtol=1e-5)
    assert abs(plain - loss) > 1e-3


# ----------------------------------------------------------------------------- GSPO, Eq. 2, with the cap


def gspo_eq2_loss(logp, old_logp, adv, mask, eps_low=3e-4, eps_high=4e-4, cap=10.0):
    """-(1/G) sum_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(min(mean_t log-ratio, cap)): Eq. 2 with
    verl's cap."""
    lengths = mask.sum(axis=1)
    non_empty = lengths > 0
    mean_log_ratio = np.where(non_empty, ((logp - old_logp) * mask).sum(axis=1) / np.maximum(lengths, 1), 0.0)
    s = np.exp(np.minimum(mean_log_ratio, cap))
    per_sequence = np.minimum(s * adv, np.clip(s, 1 - eps_low, 1 + eps_high) * adv)
    return -per_sequence[non_empty].mean()


def test_gspo_default_aggregation_and_cap_match_equation_2_in_float64():
    rng = np.random.default_rng(11)
    batch, seq = 8, 6
    logp = rng.uniform(-2.0, -0.1, (batch, seq))
    lengths = np.array([6, 3, 5, 0, 4, 6, 2, 5])
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float64)
    # Mean log-ratios inside and on both sides of [1 - 3e-4, 1 + 4e-4], and two beyond the cap of 10.
    mean_log_ratio = np.array([1e-4, -2e-3, 2e-3, 0.0, -5e-2, 12.0, 8e-2, 11.0])
    adv = np.array([1.0, -0.7, 0.4, 1.0, 1.3, 0.9, -0.6, -0.2])
    noise = rng.normal(0.0, 0.05, (batch, seq)) * mask
    noise -= noise.sum(axis=1, keepdims=True) / np.maximum(lengths, 1)[:, None] * mask
    old_logp = logp - (mean_log_ratio[:, None] + noise)

    objective = get_objective("gspo")
    assert objective.aggregation == "seq-mean-token-mean"
    loss, grad, metrics = run(objective, logp, old_logp, adv, mask)
    ref_loss = gspo_eq2_loss(logp, old_logp, adv, mask)
    ref_grad = finite_difference_grad(lambda x: gspo_eq2_loss(x, old_logp, adv, mask), logp, mask)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert not np.any(grad[7]) and not np.any(grad[5])  # capped (A < 0) and clipped (A > 0): no gradient
    assert np.any(np.abs(grad[6]) > 1e-2)  # A < 0 above the range, under the cap: unclipped
    np.testing.assert_allclose(float(metrics["clip_fraction_cap"]), (6 + 5) / mask.sum(), rtol=1e-6)


# ----------------------------------------------------------------------------- TRL's objectives


def trl_cispo(logp, old_logp, adv, mask, eps_max=5.0):
    """TRL's loss_type="cispo": -min(coef_1, epsilon_high).detach() A log pi, summed / active tokens.
    Returns (loss, analytic gradient)."""
    clamped = np.minimum(np.exp(logp - old_logp), eps_max)
    tokens = mask.sum()
    loss = np.sum(-clamped * adv[:, None] * logp * mask) / tokens
    return loss, -clamped * adv[:, None] * mask / tokens


@pytest.mark.parametrize("eps_max", [5.0, 1.3])
def test_cispo_matches_trl_in_float64(eps_max):
    logp, old_logp, adv, mask = ragged_batch(seed=8, scale=0.9, empty_row=True)
    ratio = np.exp(logp - old_logp)[mask > 0]
    assert np.any(ratio > eps_max) and np.any(ratio < eps_max)  # some weights truncated, some not
    loss, grad, metrics = run(get_objective("cispo", eps_max=eps_max), logp, old_logp, adv, mask)
    ref_loss, ref_grad = trl_cispo(logp, old_logp, adv, mask, eps_max)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), np.mean(ratio > eps_max), rtol=1e-6)


def trl_sapo(logp, old_logp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """TRL's loss_type="sapo": -sigmoid(tau (r - 1)) 4 / tau A, per-sequence token mean, mean over rows."""
    a = adv[:, None]
    tau = np.where(a > 0, tau_pos, tau_neg)
    per_token = -sigmoid(tau * (np.exp(logp - old_logp) - 1.0)) * 4.0 / tau * a
    return np.mean((per_token * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0))


def test_sapo_matches_trl_in_float64():
    logp, old_logp, adv, mask = ragged_batch(seed=9, scale=0.8)
    loss, grad, _ = run(get_objective("sapo"), logp, old_logp, adv, mask)
    np.testing.assert_allclose(loss, trl_sapo(logp, old_logp, adv, mask), rtol=1e-5)
    ref_grad = finite_difference_grad(lambda x: trl_sapo(x, old_logp, adv, mask), logp, mask)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
    # On-policy the soft gate's gradient is the plain policy gradient A / (G |o_i|).
    on_policy, on_grad, _ = run(get_objective("sapo"), logp, logp, adv, mask)
    expected = -adv[:, None] * mask / mask.sum(axis=1, keepdims=True) / len(adv)
    np.testing.assert_allclose(on_grad, expected, rtol=1e-5, atol=1e-8)


def trl_luspo(logp, old_logp, adv, mask, eps_low=2e-3, eps_high=2.5e-3):
    """TRL's loss_type="luspo" (importance_sampling_level="sequence"): GSPO's per-sequence loss times
    the sequence length, averaged over rows."""
    lengths = mask.sum(axis=1)
    s = np.exp(((logp - old_logp) * mask).sum(axis=1) / np.maximum(lengths, 1.0))
    per_sequence = -np.minimum(s * adv, np.clip(s, 1 - eps_low, 1 + eps_high) * adv)
    return np.mean(per_sequence * lengths)


def test_luspo_matches_trl_in_float64():
    logp, old_logp, adv, mask = ragged_batch(seed=10, scale=0.004)
    lengths = mask.sum(axis=1)
    s = np.exp(((logp - old_logp) * mask).sum(axis=1) / lengths)
    assert np.min(np.abs(s - (1 - 2e-3))) > 1e-5 and np.min(np.abs(s - (1 + 2.5e-3))) > 1e-5
    loss, grad, metrics = run(get_objective("luspo"), logp, old_logp, adv, mask)
    np.testing.assert_allclose(loss, trl_luspo(logp, old_logp, adv, mask), rtol=1e-5)
    ref_grad = finite_difference_grad(lambda x: trl_luspo(x, old_logp, adv, mask), logp, mask)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
    assert 0.0 < float(metrics["clip_fraction"]) < 1.0


def trl_dr_grpo(logp, old_logp, adv, mask, max_completion_length, eps=0.2):
    """TRL's loss_type="dr_grpo": -min(r A, clip(r) A) per token, summed / (batch * max_completion_length)."""
    ratio = np.exp(logp - old_logp)
    a = adv[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a)
    return np.sum(per_token * mask) / (logp.shape[0] * max_completion_length)


def test_dr_grpo_normalization_matches_trl_in_float64():
    logp, old_logp, adv, mask = ragged_batch(seed=12, scale=0.4)
    objective = get_objective("dr_grpo", loss_scale_factor=16)
    loss, grad, _ = run(objective, logp, old_logp, adv, mask)
    np.testing.assert_allclose(loss, trl_dr_grpo(logp, old_logp, adv, mask, 16), rtol=1e-5)
    ref_grad = finite_difference_grad(lambda x: trl_dr_grpo(x, old_logp, adv, mask, 16), logp, mask)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-7)
    # Any objective can use the normalization; without a constant it is the padded width (verl).
    grpo_norm = get_objective("grpo", clip_ratio_c=None, aggregation="seq-mean-token-sum-norm")
    width_loss, _, _ = run(grpo_norm, logp, old_logp, adv, mask)
    np.testing.assert_allclose(width_loss, trl_dr_grpo(logp, old_logp, adv, mask, logp.shape[1]), rtol=1e-5)
    with pytest.raises(ValueError, match="loss_scale_factor must be a number > 0"):
        get_objective("dr_grpo", loss_scale_factor=0)


# ----------------------------------------------------------------------------- VESPO's token clamp


def test_vespo_clamps_each_token_log_ratio_before_the_sum():
    old_logp = np.full((2, 3), -5.0)
    delta = np.array([[30.0, -15.0, 0.0], [30.0, -15.0, 0.0]])  # raw log W = 15; clamped tokens: 20 - 15 = 5
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = np.array([1.0, -1.0])
    inputs = [jnp.asarray(x, jnp.float32) for x in (old_logp + delta, old_logp, adv, mask)]
    vespo = get_objective("vespo").evaluate(*inputs).responses
    np.testing.assert_allclose(np.asarray(vespo["log_w"]), [5.0, 5.0])
    w = np.exp(5.0)
    expected_phi = [w**2 * np.exp(3 * (1 - w)), w**3 * np.exp(2 * (1 - w))]
    np.testing.assert_allclose(np.asarray(vespo["phi"]), expected_phi, rtol=1e-4, atol=1e-30)
    respo = get_objective("respo").evaluate(*inputs).responses  # the official ReSPO recipe sums raw ratios
    np.testing.assert_allclose(np.asarray(respo["log_w"]), [15.0, 15.0])
