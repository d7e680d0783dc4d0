"""Tests of respo_jax.objectives against the paper's closed forms and a float64 NumPy reference.

The reference below is written directly from the equations (no log-space tricks), so it checks the
stable JAX implementation rather than repeating it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from respo_jax.objectives import (
    AGGREGATION_MODES,
    OBJECTIVES,
    combine_loss_terms,
    get_objective,
    grpo_objective,
    gspo_objective,
    power_mean_kernel,
    reshaping_kernel,
    respo_kernel,
    respo_objective,
    sequence_log_ratio,
    vespo_kernel,
    vespo_objective,
)

E_HALF = math.e / 2.0
PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None)

# ----------------------------------------------------------------------------- float64 reference


def ref_phi0(w, alpha, beta):
    """Eq. 9 power mean, with its alpha = 1 limit W^beta (App. A.4)."""
    if alpha == 1.0:
        return w**beta
    return ((1.0 - beta) + beta * w ** (alpha - 1.0)) ** (1.0 / (alpha - 1.0))


def ref_reshaped(w, alpha, beta, lam):
    """Eq. 12: phi = phi0 exp(lam (1 - phi0))."""
    phi0 = ref_phi0(w, alpha, beta)
    return phi0 * np.exp(lam * (1.0 - phi0))


def ref_respo_plus(w):
    return (1.0 + w) / 2.0 * np.exp(1.0 - w)


def ref_respo_minus(w):
    return np.sqrt(w) * np.exp(2.0 * (1.0 - np.sqrt(w)))


def ref_vespo(w, beta, lam):
    return w**beta * np.exp(lam * (1.0 - w))


def ref_log_w(name, logp, old_logp, mask):
    """log W: the masked sum of token log-ratios (VESPO: each clamped to +-20 first), clamped to +-20."""
    diff = np.where(mask > 0, logp - old_logp, 0.0)
    if name == "vespo":
        diff = np.clip(diff, -20.0, 20.0)
    return np.clip(diff.sum(axis=1), -20.0, 20.0)


def ref_token_loss_and_coefficient(name, hp, logp, old_logp, adv, mask):
    """Per-token loss and gradient coefficient c (d token_loss / d logp = -c A), float64."""
    valid = mask > 0
    diff = np.where(valid, logp - old_logp, 0.0)
    w = np.exp(ref_log_w(name, logp, old_logp, mask))
    a = adv[:, None]
    if name in ("respo", "vespo"):
        if name == "respo":
            pos = ref_reshaped(w, hp["alpha"][0], hp["beta"][0], hp["lam"][0])
            neg = ref_reshaped(w, hp["alpha"][1], hp["beta"][1], hp["lam"][1])
        else:
            pos = ref_vespo(w, hp["beta"][0], hp["lam"][0])
            neg = ref_vespo(w, hp["beta"][1], hp["lam"][1])
        phi = np.where(adv >= 0, pos, neg)[:, None] * np.ones_like(logp)
        return -phi * a * logp, phi
    token_ratio = np.exp(np.clip(diff, -20.0, 20.0))
    if name == "cispo":
        weight = np.minimum(token_ratio, hp["eps_max"])
        return -weight * a * logp, weight
    if name == "sapo":
        tau = np.where(a > 0, hp["tau_pos"], hp["tau_neg"])
        s = 1.0 / (1.0 + np.exp(-tau * (token_ratio - 1.0)))
        return -s * 4.0 / tau * a, 4.0 * s * (1.0 - s) * token_ratio
    lo, hi = 1.0 - hp["eps_low"], 1.0 + hp["eps_high"]
    capped = np.zeros_like(logp, dtype=bool)
    if name in ("grpo", "dr_grpo"):
        ratio = token_ratio
        assert np.min(np.abs(ratio[valid] - lo)) > 1e-4 and np.min(np.abs(ratio[valid] - hi)) > 1e-4
    else:  # gspo, luspo: one ratio per sequence, broadcast over its tokens
        lengths = mask.sum(axis=1)
        mean_diff = np.where(lengths > 0, diff.sum(axis=1) / np.maximum(lengths, 1.0), 0.0)
        capped = (mean_diff > hp["log_ratio_cap"])[:, None] * np.ones_like(logp, dtype=bool)
        ratio = np.exp(np.minimum(mean_diff, hp["log_ratio_cap"]))[:, None] * np.ones_like(logp)
        assert np.min(np.abs(ratio[valid] - lo)) > 1e-5 and np.min(np.abs(ratio[valid] - hi)) > 1e-5
    surrogate = np.minimum(ratio * a, np.clip(ratio, lo, hi) * a)
    # d/dr min(r A, clip(r) A) is A where the unclipped term is the smaller one or r is inside the range.
    unclipped = ((ratio * a < np.clip(ratio, lo, hi) * a) | ((ratio >= lo) & (ratio <= hi))) & ~capped
    c = hp.get("clip_ratio_c")
    if c is not None:  # verl's dual clip: A < 0 and w > c gives the constant -c A
        dual = (a < 0) & (ratio > c)
        surrogate = np.where(dual, c * a, surrogate)
        unclipped &= ~dual
    return -surrogate, np.where(unclipped, ratio, 0.0)


def ref_denominator_per_token(mask, mode):
    lengths = mask.sum(axis=1, keepdims=True)
    n_responses = float((lengths > 0).sum())
    if mode == "token-mean":
        return np.full_like(mask, mask.sum())
    if mode == "seq-mean-token-mean":
        return n_responses * np.maximum(lengths, 1.0) * np.ones_like(mask)
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant L, here the padded width
        return np.full_like(mask, n_responses * mask.shape[1])
    return np.full_like(mask, n_responses)


def ref_loss_and_grad(name, hp, mode, logp, old_logp, adv, mask):
    logp, old_logp, adv, mask = (np.asarray(x, np.float64) for x in (logp, old_logp, adv, mask))
    token_loss, coefficient = ref_token_loss_and_coefficient(name, hp, logp, old_logp, adv, mask)
    denominator = ref_denominator_per_token(mask, mode)
    loss = np.sum(np.where(mask > 0, token_loss / denominator, 0.0))
    grad = np.where(mask > 0, -coefficient * adv[:, None] / denominator, 0.0)
    return loss, grad


# ----------------------------------------------------------------------------- test data


def make_batch(seed=3, batch=8, seq=9, drift=0.15):
    """Mixed-sign advantages, ragged responses, one empty response, log-ratios of several scales."""
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-3.0, -0.05, (batch, seq))
    old_logp = logp + rng.normal(0.0, drift, (batch, seq)) * rng.choice([0.3, 1.0, 3.0], (batch, 1))
    lengths = rng.integers(1, seq + 1, batch)
    lengths[3] = 0
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float64)
    adv = rng.normal(0.0, 1.0, batch)
    adv[5] = 0.0
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1
    return logp, old_logp, adv, mask


def make_gspo_batch(scale=1.0):
    """Sequence ratios on both sides of GSPO's narrow [1 - 3e-4, 1 + 4e-4] range, for both signs
    (``scale=6``: of LUSPO's [1 - 2e-3, 1 + 2.5e-3])."""
    rng = np.random.default_rng(3)
    batch, seq = 8, 6
    logp = rng.uniform(-2.0, -0.1, (batch, seq))
    lengths = np.array([6, 3, 5, 0, 4, 6, 2, 5])
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float64)
    mean_log_ratio = np.array([1e-4, -1e-4, 2e-3, 0.0, -2e-3, 2e-4, -0.05, 0.08]) * scale
    noise = rng.normal(0.0, 0.05, (batch, seq)) * mask
    noise -= noise.sum(axis=1, keepdims=True) / np.maximum(lengths, 1)[:, None] * mask
    old_logp = logp - (mean_log_ratio[:, None] + noise)
    adv = np.array([1.0, -0.7, 0.4, 1.0, -1.3, 0.9, 0.6, -0.2])
    return logp, old_logp, adv, mask


def f32(*arrays):
    return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


OBJECTIVE_CASES = [
    ("respo", {}),
    ("respo", {"alpha": (1.5, 0.5), "beta": (0.3, 0.7), "lam": (1.0, 3.0)}),
    ("respo", {"alpha": (3.0, 1.0), "beta": (0.8, 1.5), "lam": (0.0, 0.5)}),
    ("vespo", {}),
    ("vespo", {"beta": (0.5, 1.0), "lam": (1.0, 0.0)}),
    ("grpo", {}),
    ("grpo", {"eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": None}),
    ("grpo", {"clip_ratio_c": 1.25}),
    ("gspo", {}),
    ("gspo", {"log_ratio_cap": 1e-3}),
    ("cispo", {}),
    ("cispo", {"eps_max": 1.1}),
    ("sapo", {}),
    ("sapo", {"tau_pos": 3.0, "tau_neg": 0.5}),
    ("luspo", {}),
    ("dr_grpo", {}),
]


def batch_for(name, seed=3):
    if name in ("gspo", "luspo"):
        return make_gspo_batch(scale=6.0 if name == "luspo" else 1.0)
    return make_batch(seed=seed)


def _case_modes():
    """Every aggregation mode for the paper's objectives at their defaults; the others in their own mode."""
    pairs = []
    for case in OBJECTIVE_CASES:
        name, hparams = case
        every_mode = name in ("respo", "grpo") and not hparams
        modes = AGGREGATION_MODES if every_mode else (OBJECTIVES[name].aggregation,)
        pairs += [(case, mode) for mode in modes]
    return pairs


def _name_modes():
    """(objective, mode) pairs for the accumulation and empty-batch checks: every mode once, every
    objective in its own mode."""
    pairs = [("respo", mode) for mode in AGGREGATION_MODES]
    return pairs + [(name, OBJECTIVES[name].aggregation) for name in sorted(OBJECTIVES) if name != "respo"]


def _case_id(case):
    name, hp = case
    return name + ("" if not hp else "-" + "-".join(f"{k}{v}" for k, v in hp.items()))


# ----------------------------------------------------------------------------- kernels: closed forms


def test_respo_kernel_is_one_on_policy_for_both_branches():
    phi = respo_kernel(jnp.zeros(2), jnp.array([1.0, -1.0]))
    np.testing.assert_allclose(np.asarray(phi), [1.0, 1.0], rtol=1e-7)


def test_respo_positive_branch_keeps_e_over_two_as_w_vanishes():
    phi = respo_kernel(jnp.array([-jnp.inf, -60.0, -20.0]), 1.0)
    np.testing.assert_allclose(np.asarray(phi), [E_HALF] * 3, rtol=1e-6)


def test_respo_negative_branch_peaks_at_a_quarter_with_e_over_two():
    w = np.linspace(0.01, 3.0, 2991)
    phi = np.asarray(respo_kernel(jnp.log(jnp.asarray(w, jnp.float32)), -1.0))
    assert abs(w[np.argmax(phi)] - 0.25) < 2e-3
    np.testing.assert_allclose(phi.max(), E_HALF, rtol=1e-6)
    slope_at_peak = jax.grad(lambda x: respo_kernel(jnp.log(x), -1.0))(0.25)
    assert abs(float(slope_at_peak)) < 1e-5


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_respo_branches_share_slope_minus_half_at_on_policy(advantage):
    slope = jax.grad(lambda w: respo_kernel(jnp.log(w), advantage))(1.0)
    np.testing.assert_allclose(float(slope), -0.5, rtol=1e-6)


def test_respo_positive_branch_is_flat_at_zero_and_both_tails_required_by_section_3_2():
    # phi+'(W) = -W/2 e^(1 - W): zero at W = 0 (lambda+ = 2 was chosen for this), negative for W > 0.
    for w in (1e-2, 1e-4):
        slope = jax.grad(lambda x: respo_kernel(jnp.log(x), 1.0))(w)
        np.testing.assert_allclose(float(slope), -w / 2 * math.e ** (1 - w), rtol=2e-3)
    far = jnp.array([-1e4, 1e4])
    np.testing.assert_array_equal(np.asarray(respo_kernel(far[1:], 1.0)), [0.0])  # phi+(inf) = 0
    np.testing.assert_array_equal(np.asarray(respo_kernel(far, -1.0)), [0.0, 0.0])  # phi-(0) = phi-(inf) = 0


def test_respo_kernel_matches_closed_forms_on_a_grid():
    log_w = np.linspace(-20.0, 20.0, 801)
    w = np.exp(log_w)
    np.testing.assert_allclose(np.asarray(respo_kernel(log_w, 1.0)), ref_respo_plus(w), rtol=2e-5, atol=1e-30)
    np.testing.assert_allclose(
        np.asarray(respo_kernel(log_w, -1.0)), ref_respo_minus(w), rtol=2e-5, atol=1e-30
    )
    # The branch follows the sign of each advantage, with A = 0 on the positive side.
    adv = np.where(np.arange(log_w.size) % 3 == 0, -1.0, np.where(np.arange(log_w.size) % 3 == 1, 0.0, 2.0))
    expected = np.where(adv >= 0, ref_respo_plus(w), ref_respo_minus(w))
    np.testing.assert_allclose(np.asarray(respo_kernel(log_w, adv)), expected, rtol=2e-5, atol=1e-30)


def test_vespo_kernel_matches_closed_form_with_published_defaults():
    log_w = np.linspace(-20.0, 20.0, 401)
    w = np.exp(log_w)
    np.testing.assert_allclose(
        np.asarray(vespo_kernel(log_w, 1.0)), ref_vespo(w, 2.0, 3.0), rtol=2e-5, atol=1e-30
    )
    np.testing.assert_allclose(
        np.asarray(vespo_kernel(log_w, -1.0)), ref_vespo(w, 3.0, 2.0), rtol=2e-5, atol=1e-30
    )
    np.testing.assert_allclose(np.asarray(vespo_kernel(0.0, 1.0)), 1.0, rtol=1e-7)


@pytest.mark.parametrize(
    "alpha, beta",
    [
        (2.0, 0.5),
        (2.0, 0.2),
        (0.0, 0.3),
        (3.0, 0.7),
        (0.5, 0.5),
        (-1.0, 0.4),
        (1.0, 0.5),
        (1.0, 2.5),
        (2.0, 1.0),
    ],
)
def test_power_mean_kernel_matches_equation_9(alpha, beta):
    log_w = np.linspace(-15.0, 15.0, 301)
    expected = ref_phi0(np.exp(log_w), alpha, beta)
    np.testing.assert_allclose(np.asarray(power_mean_kernel(log_w, alpha, beta)), expected, rtol=3e-5)


def test_power_mean_special_cases_arithmetic_harmonic_and_continuous_alpha_one_limit():
    w = np.array([0.1, 0.5, 2.0, 7.0])
    log_w = np.log(w)
    np.testing.assert_allclose(np.asarray(power_mean_kernel(log_w, 2.0, 0.5)), (1 + w) / 2, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(power_mean_kernel(log_w, 0.0, 0.5)), 2 * w / (1 + w), rtol=1e-6)
    for near_one in (1.0 - 1e-4, 1.0 + 1e-4, 1.0 + 1e-6):
        np.testing.assert_allclose(np.asarray(power_mean_kernel(log_w, near_one, 0.5)), np.sqrt(w), rtol=2e-4)


@pytest.mark.parametrize(
    "alpha, beta, lam", [(2.0, 0.5, 2.0), (1.0, 0.5, 2.0), (1.5, 0.3, 1.0), (0.5, 0.7, 3.0), (3.0, 0.9, 0.0)]
)
def test_reshaping_kernel_matches_equation_12(alpha, beta, lam):
    log_w = np.linspace(-12.0, 6.0, 181)
    expected = ref_reshaped(np.exp(log_w), alpha, beta, lam)
    np.testing.assert_allclose(
        np.asarray(reshaping_kernel(log_w, alpha, beta, lam)), expected, rtol=5e-5, atol=1e-37
    )


@PROPERTY_SETTINGS
@given(
    log_w=st.lists(st.floats(-1e4, 1e4), min_size=16, max_size=16),  # one shape: no recompiles
    alpha=st.floats(-1.0, 3.0),
    beta=st.floats(0.0, 1.0),
    lam=st.floats(0.05, 5.0),
)
def test_reshaping_kernel_is_finite_nonnegative_and_below_its_maximum(log_w, alpha, beta, lam):
    phi = np.asarray(reshaping_kernel(np.asarray(log_w, np.float32), alpha, beta, lam), np.float64)
    assert np.all(np.isfinite(phi)) and np.all(phi >= 0.0)
    # max over phi0 > 0 of phi0 exp(lam (1 - phi0)) is reached at phi0 = 1/lam.
    assert np.all(phi <= math.exp(lam - 1.0) / lam * (1 + 1e-5))
    grads = jax.vmap(jax.grad(lambda x: reshaping_kernel(x, alpha, beta, lam)))(
        jnp.asarray(log_w, jnp.float32)
    )
    assert np.all(np.isfinite(np.asarray(grads)))


def test_kernels_reject_invalid_hyperparameters():
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\] for alpha != 1"):
        power_mean_kernel(0.0, 2.0, 1.5)
    with pytest.raises(ValueError, match="lam must be >= 0"):
        reshaping_kernel(0.0, 2.0, 0.5, -1.0)
    with pytest.raises(ValueError, match="alpha must be a"):
        respo_kernel(0.0, 1.0, alpha=2.0)


def test_sequence_log_ratio_sums_unnormalized_masks_padding_and_clamps():
    rng = np.random.default_rng(1)
    logp = rng.normal(-1.0, 0.3, (4, 5))
    old = rng.normal(-1.0, 0.3, (4, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], np.float64)
    logp_padded = np.where(mask > 0, logp, np.inf)  # garbage in padding must not leak
    expected = np.sum((logp - old) * mask, axis=1)
    np.testing.assert_allclose(
        np.asarray(sequence_log_ratio(*f32(logp_padded, old, mask))), expected, rtol=1e-5
    )
    big = np.full((2, 4), 2500.0) * np.array([[1.0], [-1.0]])  # log W = +-1e4 before the clamp
    clamped = sequence_log_ratio(*f32(big, np.zeros((2, 4)), np.ones((2, 4))))
    np.testing.assert_array_equal(np.asarray(clamped), [20.0, -20.0])


# ----------------------------------------------------------------------------- objectives: values, gradients


@pytest.mark.parametrize("case, mode", _case_modes(), ids=lambda x: x if isinstance(x, str) else _case_id(x))
def test_objective_loss_and_gradient_match_float64_reference(case, mode):
    name, hparams = case
    objective = get_objective(name, aggregation=mode, **hparams)
    batch = batch_for(name, seed=3 + len(hparams))
    logp, old_logp, adv, mask = f32(*batch)
    ref_loss, ref_grad = ref_loss_and_grad(name, dict(objective.hparams), mode, *batch)

    def loss_fn(x):
        return objective(x, old_logp, adv, mask)[0]

    loss, grad = jax.value_and_grad(loss_fn)(logp)
    jit_loss, jit_grad = jax.jit(jax.value_and_grad(loss_fn))(logp)
    for got_loss, got_grad in ((loss, grad), (jit_loss, jit_grad)):
        np.testing.assert_allclose(float(got_loss), ref_loss, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_grad), ref_grad, rtol=1e-4, atol=1e-7)
    assert np.any(np.abs(ref_grad) > 1e-3)  # the reference is not trivially zero


def test_gspo_and_grpo_test_data_exercise_both_clipped_and_unclipped_tokens():
    for objective, batch in ((gspo_objective, make_gspo_batch()), (grpo_objective, make_batch())):
        _, metrics = objective(*f32(*batch))
        assert 0.0 < float(metrics["clip_fraction_low"]) and 0.0 < float(metrics["clip_fraction_high"])
        assert float(metrics["clip_fraction"]) < 1.0


def test_registry_defaults_are_the_papers_table_3_and_the_reference_codes():
    assert dict(respo_objective.hparams) == {"alpha": (2.0, 1.0), "beta": (0.5, 0.5), "lam": (2.0, 2.0)}
    assert dict(vespo_objective.hparams) == {"beta": (2.0, 3.0), "lam": (3.0, 2.0)}
    assert dict(grpo_objective.hparams) == {"eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": 3.0}
    assert dict(gspo_objective.hparams) == {"eps_low": 3e-4, "eps_high": 4e-4, "log_ratio_cap": 10.0}
    assert gspo_objective.aggregation == "seq-mean-token-mean"
    assert dict(get_objective("cispo").hparams) == {"eps_max": 5.0}
    assert dict(get_objective("sapo").hparams) == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert get_objective("sapo").aggregation == "seq-mean-token-mean"
    luspo = get_objective("luspo")
    assert dict(luspo.hparams) == {"eps_low": 2e-3, "eps_high": 2.5e-3, "log_ratio_cap": 10.0}
    assert luspo.aggregation == "seq-mean-token-sum"
    dr_grpo = get_objective("dr_grpo")
    assert dict(dr_grpo.hparams)["clip_ratio_c"] is None and dr_grpo.aggregation == "seq-mean-token-sum-norm"
    assert dr_grpo.scale_advantages is False and grpo_objective.scale_advantages is True
    assert respo_objective == get_objective("respo") and respo_objective.aggregation == "token-mean"
    custom = get_objective("grpo", eps_high=0.28, aggregation="seq-mean-token-sum")
    assert custom.config == {"eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": 3.0,
                             "aggregation": "seq-mean-token-sum", "loss_scale_factor": None,
                             "scale_advantages": True}
    assert get_objective("grpo", **custom.config) == custom
    assert set(OBJECTIVES) == {"respo", "vespo", "grpo", "gspo", "cispo", "sapo", "luspo", "dr_grpo"}


def test_respo_gradient_is_phi_times_advantage_over_token_count():
    """The issue's contract: d loss / d logp[i, t] = -phi(W_i) A_i mask[i, t] / sum(mask) under token-mean."""
    logp, old_logp, adv, mask = f32(*make_batch(seed=7))
    grad = jax.grad(lambda x: respo_objective(x, old_logp, adv, mask)[0])(logp)
    phi = respo_kernel(sequence_log_ratio(logp, old_logp, mask), adv)
    expected = -(phi * adv)[:, None] * mask / jnp.sum(mask)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-6, atol=1e-9)


def test_objectives_are_hashable_static_arguments_of_jit():
    logp, old_logp, adv, mask = f32(*make_batch())

    @jax.jit
    def step(x):
        return {name: get_objective(name)(x, old_logp, adv, mask)[0] for name in OBJECTIVES}

    eager = {name: float(get_objective(name)(logp, old_logp, adv, mask)[0]) for name in OBJECTIVES}
    jitted = {name: float(v) for name, v in step(logp).items()}
    for name in OBJECTIVES:
        np.testing.assert_allclose(jitted[name], eager[name], rtol=1e-6)
    static_loss = jax.jit(lambda obj, x: obj(x, old_logp, adv, mask)[0], static_argnums=0)
    np.testing.assert_allclose(float(static_loss(vespo_objective, logp)), eager["vespo"], rtol=1e-6)
    assert hash(get_objective("grpo", eps_high=0.28)) == hash(get_objective("grpo", eps_high=0.28))


# ----------------------------------------------------------------------------- micro-batch accumulation


@pytest.mark.parametrize("name, mode", _name_modes())
def test_micro_batch_accumulation_equals_full_batch(name, mode):
    objective = get_objective(name, aggregation=mode)
    logp, old_logp, adv, mask = f32(*batch_for(name, seed=11))
    full_loss, full_grad = jax.value_and_grad(lambda x: objective(x, old_logp, adv, mask)[0])(logp)
    denominator = objective.denominator(mask)
    splits = [slice(0, 4), slice(4, 8)]  # ragged token counts; the first holds the empty response
    losses, grads, terms = [], [], []
    for rows in splits:
        mb = (old_logp[rows], adv[rows], mask[rows])
        loss, grad = jax.value_and_grad(lambda x: objective(x, *mb, denominator=denominator)[0])(logp[rows])
        losses.append(loss)
        grads.append(grad)
        terms.append(objective.loss_terms(logp[rows], *mb)[0])
    np.testing.assert_allclose(float(sum(losses)), float(full_loss), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(np.concatenate(grads), np.asarray(full_grad), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(float(combine_loss_terms(terms)), float(full_loss), rtol=1e-6, atol=1e-8)
    # Without the mini-batch denominator the micro-batch losses are *not* the full-batch loss.
    local = sum(float(objective(logp[r], old_logp[r], adv[r], mask[r])[0]) for r in splits)
    assert not np.isclose(local, float(full_loss), rtol=1e-3)


# ----------------------------------------------------------------------------- metrics


def ref_metrics(name, hp, logp, old_logp, adv, mask):
    logp, old_logp, adv, mask = (np.asarray(x, np.float64) for x in (logp, old_logp, adv, mask))
    _, coefficient = ref_token_loss_and_coefficient(name, hp, logp, old_logp, adv, mask)
    lengths = mask.sum(axis=1)
    non_empty = lengths > 0
    log_w = ref_log_w(name, logp, old_logp, mask)[non_empty]
    seq_coef = (coefficient * mask).sum(axis=1)[non_empty] / lengths[non_empty]
    a = adv[non_empty]
    pos, neg, low = a > 0, a < 0, log_w < -1.0
    mass = seq_coef * np.abs(a)
    return {
        "token_count": mask.sum(),
        "response_count": non_empty.sum(),
        "log_w_mean": log_w.mean(),
        "log_w_min": log_w.min(),
        "log_w_max": log_w.max(),
        "positive_low_w_fraction": (pos & low).sum() / pos.sum(),
        "coef_mean_pos": seq_coef[pos].mean(),
        "coef_mean_neg": seq_coef[neg].mean(),
        "coef_mass_pos": mass[pos].sum(),
        "coef_mass_neg": mass[neg].sum(),
        "positive_low_w_mass_share": mass[pos & low].sum() / mass[pos].sum(),
    }


@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=_case_id)
def test_metrics_match_float64_reference(case):
    name, hparams = case
    objective = get_objective(name, **hparams)
    batch = batch_for(name) if name in ("gspo", "luspo") else make_batch(drift=0.6)
    _, metrics = objective(*f32(*batch))
    expected = ref_metrics(name, dict(objective.hparams), *batch)
    assert 0.0 < expected["positive_low_w_fraction"] < 1.0 or name in ("gspo", "luspo")
    for key, value in expected.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_metrics_on_a_hand_built_batch():
    # Three one-token responses: log W = -2 (A = +1), 0 (A = +2), 1 (A = -1.5); one empty response.
    old_logp = np.array([[-1.0], [-1.0], [-1.0], [-1.0]])
    logp = old_logp + np.array([[-2.0], [0.0], [1.0], [5.0]])
    mask = np.array([[1.0], [1.0], [1.0], [0.0]])
    adv = np.array([1.0, 2.0, -1.5, 3.0])
    _, m = respo_objective(*f32(logp, old_logp, adv, mask))
    phi_low, phi_neg = ref_respo_plus(math.exp(-2.0)), ref_respo_minus(math.e)
    expected = {
        "token_count": 3.0,
        "response_count": 3.0,
        "log_w_mean": -1.0 / 3.0,
        "log_w_min": -2.0,
        "log_w_max": 1.0,
        "positive_low_w_fraction": 0.5,
        "coef_mean_pos": (phi_low + 1.0) / 2.0,
        "coef_mean_neg": phi_neg,
        "coef_mass_pos": phi_low * 1.0 + 1.0 * 2.0,
        "coef_mass_neg": phi_neg * 1.5,
        "positive_low_w_mass_share": phi_low / (phi_low + 2.0),
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(float(m[key]), value, rtol=1e-5, err_msg=key)


def test_grpo_clip_fractions_count_tokens_whose_gradient_is_clipped():
    # Token ratios 1.5 (A>0: clipped high), 0.5 (A>0: not clipped), 0.5 (A<0: clipped low), 1.5 (A<0: not).
    log_ratio = np.log(np.array([[1.5, 0.5], [0.5, 1.5]]))
    old_logp = np.full((2, 2), -1.0)
    _, m = grpo_objective(*f32(old_logp + log_ratio, old_logp, np.array([1.0, -1.0]), np.ones((2, 2))))
    assert float(m["clip_fraction_high"]) == 0.25 and float(m["clip_fraction_low"]) == 0.25
    assert float(m["clip_fraction"]) == 0.5
    np.testing.assert_allclose(float(m["coef_mean_pos"]), 0.25, rtol=1e-6)  # (0 + 0.5) / 2
    np.testing.assert_allclose(float(m["coef_mean_neg"]), 0.75, rtol=1e-6)  # (0 + 1.5) / 2


# ----------------------------------------------------------------------------- empty and extreme inputs


@pytest.mark.parametrize("name, mode", _name_modes())
def test_all_empty_responses_give_zero_loss_zero_gradient_and_finite_metrics(name, mode):
    objective = get_objective(name, aggregation=mode)
    logp, old_logp, adv, _ = f32(*make_batch())
    mask = jnp.zeros_like(logp)
    (loss, metrics), grad = jax.value_and_grad(objective, has_aux=True)(logp, old_logp, adv, mask)
    assert float(loss) == 0.0
    assert not np.any(np.asarray(grad))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["token_count"]) == 0.0


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_extreme_log_w_gives_finite_loss_gradient_and_metrics(name):
    # +-1e4 in log W before the clamp, spread over the tokens, for both advantage signs.
    seq = 4
    old_logp = np.full((4, seq), -1.0)
    logp = old_logp + np.array([[2500.0], [-2500.0], [2500.0], [-2500.0]])
    adv = np.array([1.0, 1.0, -1.0, -1.0])
    inputs = f32(logp, old_logp, adv, np.ones((4, seq)))
    (loss, metrics), grad = jax.value_and_grad(get_objective(name), has_aux=True)(*inputs)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["log_w_max"]) == 20.0 and float(metrics["log_w_min"]) == -20.0


def _value_and_grad_fns():
    # Dr.GRPO's constant L as the trainer sets it (the generation budget); without one it would be the
    # padded width (verl's fallback), which padding columns change by design.
    def objective(name):
        return get_objective(name, loss_scale_factor=8.0) if name == "dr_grpo" else get_objective(name)

    return {name: jax.jit(jax.value_and_grad(objective(name), has_aux=True)) for name in sorted(OBJECTIVES)}


_JITTED = _value_and_grad_fns()


PADDED_SHAPE = (4, 6)
PROPERTY_SHAPES = [(1, 1), (2, 4), (3, 5)]


@st.composite
def policy_batches(draw, extreme=True, shapes=None):
    # A few shapes only, so the jitted objectives compile once per shape; masks vary the rest.
    batch, seq = draw(st.sampled_from(shapes or PROPERTY_SHAPES))
    size = batch * seq
    elements = st.floats(-3e3, 3e3) if extreme else st.floats(-3.0, 3.0)
    old_logp = np.asarray(draw(st.lists(st.floats(-50.0, 0.0), min_size=size, max_size=size))).reshape(
        batch, seq
    )
    delta = np.asarray(draw(st.lists(elements, min_size=size, max_size=size))).reshape(batch, seq)
    mask = np.asarray(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=size, max_size=size))).reshape(
        batch, seq
    )
    adv = np.asarray(
        draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 1e3, -1e3, 0.37]), min_size=batch, max_size=batch))
    )
    return old_logp + delta, old_logp, adv, mask


@PROPERTY_SETTINGS
@given(
    batch=st.one_of(policy_batches(), policy_batches(shapes=[PADDED_SHAPE])),
    name=st.sampled_from(sorted(OBJECTIVES)),
)
def test_property_loss_gradient_and_metrics_are_finite(batch, name):
    (loss, metrics), grad = _JITTED[name](*f32(*batch))
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(np.asarray(grad)))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    mask = batch[3]
    assert not np.any(np.asarray(grad)[mask == 0])  # padding receives no gradient


@PROPERTY_SETTINGS
@given(
    batch=policy_batches(extreme=False),
    name=st.sampled_from(sorted(OBJECTIVES)),
    pad_value=st.sampled_from([0.0, -7.0, 123.0, -np.inf]),
)
def test_property_loss_is_invariant_to_padding_columns_and_rows(batch, name, pad_value):
    logp, old_logp, adv, mask = batch
    batch_size, seq = logp.shape
    (loss, metrics), grad = _JITTED[name](*f32(logp, old_logp, adv, mask))

    def pad(x, value):  # extra response columns and extra (empty) response rows up to PADDED_SHAPE
        out = np.full(PADDED_SHAPE, value)
        out[:batch_size, :seq] = x
        return out

    padded = (
        pad(logp, pad_value),
        pad(old_logp, -pad_value),
        np.concatenate([adv, [1.0, -2.0, 0.5]])[:4],
        pad(mask, 0.0),
    )
    (padded_loss, padded_metrics), padded_grad = _JITTED[name](*f32(*padded))
    np.testing.assert_allclose(float(padded_loss), float(loss), rtol=1e-6, atol=1e-7)
    padded_grad = np.asarray(padded_grad)
    np.testing.assert_allclose(padded_grad[:batch_size, :seq], np.asarray(grad), rtol=1e-6, atol=1e-9)
    assert not np.any(padded_grad[batch_size:]) and not np.any(padded_grad[:, seq:])
    for key in metrics:
        np.testing.assert_allclose(
            float(padded_metrics[key]), float(metrics[key]), rtol=1e-6, atol=1e-7, err_msg=key
        )


# ----------------------------------------------------------------------------- errors


def test_unknown_objective_and_hyperparameters_are_named():
    with pytest.raises(KeyError, match="unknown objective 'ppo'"):
        get_objective("ppo")
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['foo'\] for objective 'respo'"):
        get_objective("respo", foo=1)
    with pytest.raises(ValueError, match=r"\['clip'\] for objective 'grpo'"):
        get_objective("grpo", clip=0.2)
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        get_objective("vespo", aggregation="mean")


@pytest.mark.parametrize(
    "name, hparams, message",
    [
        ("respo", {"beta": (1.5, 0.5)}, r"respo, positive branch: beta must lie in \[0, 1\]"),
        ("respo", {"lam": (2.0, -1.0)}, "respo, negative branch: lam must be >= 0"),
        ("respo", {"alpha": 2.0}, r"alpha must be a \(positive-branch, negative-branch\) pair"),
        ("respo", {"alpha": (2.0, float("nan"))}, r"alpha\[1\] must be finite"),
        ("vespo", {"beta": (-1.0, 3.0)}, "vespo, positive branch: beta must be >= 0"),
        ("grpo", {"eps_low": 1.5}, r"grpo: eps_low must lie in \(0, 1\)"),
        ("gspo", {"eps_high": 0.0}, "gspo: eps_high must be > 0"),
        ("grpo", {"eps_high": "0.28"}, "grpo: eps_high must be a real number"),
    ],
)
def test_invalid_hyperparameter_values_are_rejected(name, hparams, message):
    with pytest.raises(ValueError, match=message):
        get_objective(name, **hparams)


def _bad_inputs():
    logp, old_logp, adv, mask = (np.asarray(x, np.float32) for x in make_batch())
    nan_logp = logp.copy()
    nan_logp[0, 0] = np.nan
    inf_old = old_logp.copy()
    inf_old[1, 0] = np.inf
    half_mask = mask.copy()
    half_mask[0, 0] = 0.5
    nan_adv = adv.copy()
    nan_adv[2] = np.nan
    return [
        ((logp, old_logp[:, :-1], adv, mask), r"old_logp has shape \(8, 8\); logp has \(8, 9\)"),
        ((logp, old_logp, adv, mask[:-1]), r"mask has shape \(7, 9\); logp has \(8, 9\)"),
        ((logp, old_logp, adv[:-1], mask), r"advantages has shape \(7,\); expected \[batch\] = \(8,\)"),
        ((logp[0], old_logp[0], adv, mask[0]), r"logp must have shape \[batch, seq\]; got shape \(9,\)"),
        ((logp, old_logp, adv, mask.astype(bool)), "mask must be a floating-point array; got dtype bool"),
        (
            (logp, old_logp, adv, mask.astype(np.int32)),
            "mask must be a floating-point array; got dtype int32",
        ),
        ((logp.astype(np.int32), old_logp, adv, mask), "logp must be a floating-point array"),
        (
            (nan_logp, old_logp, adv, mask),
            r"logp has 1 NaN/inf value\(s\) at response tokens .* first at \[0, 0\]",
        ),
        ((logp, inf_old, adv, mask), r"old_logp has 1 NaN/inf value\(s\) .* first at \[1, 0\]: inf"),
        ((logp, old_logp, adv, half_mask), r"mask entries must be 0 or 1; found \[0.5\]"),
        ((logp, old_logp, nan_adv, mask), r"advantages contain NaN/inf at rows \[2\]"),
        ((logp[:0], old_logp[:0], adv[:0], mask[:0]), r"logp is empty: shape \(0, 9\)"),
    ]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_bad_inputs_raise_clear_value_errors(name):
    objective = get_objective(name)
    for inputs, message in _bad_inputs():
        with pytest.raises(ValueError, match=message):
            objective(*inputs)


def test_shape_errors_are_raised_under_jit_and_padding_may_hold_non_finite_values():
    logp, old_logp, adv, mask = f32(*make_batch())
    with pytest.raises(ValueError, match=r"old_logp has shape \(8, 8\)"):
        jax.jit(respo_objective)(logp, old_logp[:, :-1], adv, mask)
    # Under grad the non-differentiated arguments are still concrete and still checked.
    bad_old = old_logp.at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"old_logp has 1 NaN/inf value\(s\)"):
        jax.grad(lambda x: respo_objective(x, bad_old, adv, mask)[0])(logp)
    garbage = jnp.where(mask > 0, logp, jnp.nan)
    loss, _ = respo_objective(garbage, jnp.where(mask > 0, old_logp, -jnp.inf), adv, mask)
    np.testing.assert_allclose(float(loss), float(respo_objective(logp, old_logp, adv, mask)[0]), rtol=1e-6)
