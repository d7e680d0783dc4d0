"""Tests of group_advantages against a float64 NumPy reference (GRPO, Dr.GRPO; paper App. B)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from respo_jax.objectives import group_advantages


def ref_group_advantages(rewards, normalize_by_std=True):
    rewards = np.asarray(rewards, np.float64)
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    if not normalize_by_std:
        return centered
    return centered / (rewards.std(axis=1, ddof=1, keepdims=True) + 1e-6)


def test_matches_unbiased_std_reference_with_epsilon():
    rng = np.random.default_rng(0)
    rewards = rng.choice([-1.0, 1.0], (6, 8))
    rewards[0] = [1, -1, -1, -1, -1, -1, -1, -1]
    rewards[1] = 1.0
    got = np.asarray(group_advantages(rewards))
    np.testing.assert_allclose(got, ref_group_advantages(rewards), rtol=1e-6, atol=1e-7)
    # One correct answer out of eight: A = 7/8 / std_ddof1 with std = sqrt(1/2) for +-1 rewards.
    np.testing.assert_allclose(got[0, 0], 1.75 / (np.sqrt(0.5) + 1e-6), rtol=1e-6)
    assert got.dtype == np.float32 and got.shape == (6, 8)


def test_dr_grpo_only_centers():
    rewards = np.array([[0.0, 1.0, 1.0, 0.5], [2.0, -2.0, 0.0, 0.0]])
    np.testing.assert_allclose(
        np.asarray(group_advantages(rewards, normalize_by_std=False)),
        ref_group_advantages(rewards, False),
        rtol=1e-6,
    )


@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_identical_rewards_and_single_response_groups_give_exact_zeros(normalize_by_std):
    identical = np.array([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [-7.3, -7.3, -7.3]])
    assert not np.any(np.asarray(group_advantages(identical, normalize_by_std)))
    single = np.array([[1.0], [-1.0], [0.3]])
    out = np.asarray(group_advantages(single, normalize_by_std))
    assert out.shape == (3, 1) and not np.any(out)


def test_accepts_integer_rewards_and_runs_under_jit():
    rewards = np.array([[1, 0, 0, 1], [0, 0, 0, 0]], np.int32)
    expected = ref_group_advantages(rewards.astype(np.float64))
    np.testing.assert_allclose(np.asarray(group_advantages(rewards)), expected, rtol=1e-6)
    jitted = jax.jit(group_advantages, static_argnums=1)(jnp.asarray(rewards, jnp.float32), True)
    np.testing.assert_allclose(np.asarray(jitted), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "rewards, message",
    [
        (np.zeros(4), r"rewards must have shape \[prompts, G\]; got shape \(4,\)"),
        (np.array([[1.0, np.nan]]), "rewards contain NaN or inf"),
        (np.array([[1 + 1j, 0]]), "rewards must be real numbers"),
    ],
)
def test_bad_rewards_raise(rewards, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards)


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(
    rewards=st.lists(st.floats(-100.0, 100.0), min_size=8, max_size=8),
    scale=st.floats(0.5, 20.0),
    shift=st.floats(-50.0, 50.0),
)
def test_property_zero_mean_unit_std_and_affine_invariance(rewards, scale, shift):
    rewards = np.asarray(rewards).reshape(2, 4)
    adv = np.asarray(group_advantages(rewards), np.float64)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-4)
    spread = rewards.std(axis=1, ddof=1)
    for row in range(2):
        if spread[row] > 1e-2:  # eps = 1e-6 is negligible: unit sample std, unchanged by r -> a r + b
            np.testing.assert_allclose(adv[row].std(ddof=1), 1.0, rtol=1e-3)
            moved = np.asarray(group_advantages(rewards[row : row + 1] * scale + shift))
            np.testing.assert_allclose(moved[0], adv[row], rtol=1e-3, atol=1e-3)
        elif spread[row] == 0.0:
            assert not np.any(adv[row])
