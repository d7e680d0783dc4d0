"""Tests of the kernels of respo_jax.objectives (ReSPO, VESPO, power mean, reshaping, the sequence log
ratio) against the paper's closed forms and the float64 reference of tests/objective_refs.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from respo_jax.objectives import (
    power_mean_kernel,
    reshaping_kernel,
    respo_kernel,
    sequence_log_ratio,
    vespo_kernel,
)
from objective_refs import (
    E_HALF,
    PROPERTY_SETTINGS,
    f32,
    ref_phi0,
    ref_reshaped,
    ref_respo_minus,
    ref_respo_plus,
    ref_vespo,
)


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
