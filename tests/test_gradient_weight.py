"""response_gradient_weight: jax.grad of each registered objective against the paper's closed forms and
the objectives' own definitions, written here in float64 NumPy."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

from respo_jax.objectives import (
    get_objective,
    plot_gradient_weights,
    respo_objective,
    response_gradient_weight,
    weight_table,
)

LOG_W = np.linspace(-20.0, 20.0, 161)
# Keep clip boundaries (and the dual clip at 3) off the grid: the weight jumps there.
SMALL_LOG_W = np.linspace(-3.0, 3.0, 121) + 1e-3


def respo_reference(w, sign):
    if sign > 0:
        return (1.0 + w) / 2.0 * np.exp(1.0 - w)
    return np.sqrt(w) * np.exp(2.0 * (1.0 - np.sqrt(w)))


def vespo_reference(w, sign):
    beta, lam = (2.0, 3.0) if sign > 0 else (3.0, 2.0)
    return w**beta * np.exp(lam * (1.0 - w))


def clipped_reference(ratio, sign, eps_low, eps_high, dual=None):
    """PPO clip on a ratio: the ratio where min(r A, clip(r) A) takes the unclipped branch, else 0."""
    if sign > 0:
        return np.where(ratio > 1.0 + eps_high, 0.0, ratio)
    inside = ratio >= 1.0 - eps_low
    if dual is not None:
        inside &= ratio <= dual
    return np.where(inside, ratio, 0.0)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("length", [1, 7])
def test_reshaped_objectives_weight_is_their_kernel_of_the_whole_sequence(sign, length):
    w = np.exp(LOG_W)
    np.testing.assert_allclose(response_gradient_weight("respo", LOG_W, sign, length),
                               respo_reference(w, sign), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(response_gradient_weight("vespo", LOG_W, 2.5 * sign, length),
                               vespo_reference(w, sign), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_grpo_weight_is_the_token_ratio_inside_the_clip_and_zero_beyond(sign):
    w = np.exp(SMALL_LOG_W)
    np.testing.assert_allclose(response_gradient_weight("grpo", SMALL_LOG_W, sign),
                               clipped_reference(w, sign, 0.2, 0.2, dual=3.0), rtol=1e-5, atol=1e-7)
    # Clip-higher, no dual clip, and four tokens: each token's ratio is W^(1/4).
    grpo = get_objective("grpo", eps_high=0.28, clip_ratio_c=None)
    np.testing.assert_allclose(response_gradient_weight(grpo, SMALL_LOG_W, sign, length=4),
                               clipped_reference(w**0.25, sign, 0.2, 0.28), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gspo_clips_the_length_normalized_ratio(sign):
    length = 500  # the sequence clip [1 - 3e-4, 1 + 4e-4] on s = W^(1/T) spans about [0.86, 1.22] in W
    log_w = np.linspace(-0.5, 0.5, 101) + 1e-4
    s = np.exp(log_w / length)
    np.testing.assert_allclose(response_gradient_weight("gspo", log_w, sign, length),
                               clipped_reference(s, sign, 3e-4, 4e-4), rtol=1e-5, atol=1e-7)
    inside = np.abs(log_w) < 0.1
    assert np.all(response_gradient_weight("gspo", log_w[inside], sign, length) > 0.99)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_token_level_soft_objectives(sign):
    for length in (1, 3):
        w = np.exp(LOG_W / length)
        np.testing.assert_allclose(response_gradient_weight("cispo", LOG_W, sign, length),
                                   np.minimum(w, 5.0), rtol=2e-5, atol=1e-7)
        # SAPO's gate saturates in float32 far out; compare where 4 s (1 - s) w is resolved.
        w = np.exp(SMALL_LOG_W / length)
        tau = 1.0 if sign > 0 else 1.05
        gate = 1.0 / (1.0 + np.exp(-tau * (w - 1.0)))
        np.testing.assert_allclose(response_gradient_weight("sapo", SMALL_LOG_W, sign, length),
                                   4.0 * gate * (1.0 - gate) * w, rtol=1e-5, atol=1e-5)  # 1 - s in float32


def test_length_scaling_aggregations_scale_the_weight():
    """LUSPO (seq-mean-token-sum) weighs a response by its T tokens, Dr.GRPO by T / L."""
    log_w = np.linspace(-0.4, 0.4, 41) + 1e-4
    length = 6
    luspo = response_gradient_weight("luspo", log_w, 1.0, length)
    s = np.exp(log_w / length)
    np.testing.assert_allclose(luspo, length * clipped_reference(s, 1.0, 2e-3, 2.5e-3), rtol=1e-5, atol=1e-6)
    dr_grpo = get_objective("dr_grpo", loss_scale_factor=10.0)
    np.testing.assert_allclose(response_gradient_weight(dr_grpo, log_w, -1.0, length),
                               length / 10.0 * clipped_reference(s, -1.0, 0.2, 0.2), rtol=1e-5, atol=1e-6)


def test_every_objective_weighs_on_policy_responses_one_and_matches_its_coefficient_output():
    """omega from jax.grad equals the sequence coefficient `evaluate` reports (token-mean objectives)."""
    for name in ("respo", "vespo", "grpo", "cispo"):
        assert response_gradient_weight(name, 0.0, 1.0) == pytest.approx(1.0, abs=1e-6)
        assert response_gradient_weight(name, 0.0, -1.0) == pytest.approx(1.0, abs=1e-6)
        objective = get_objective(name)
        log_w = np.array([-3.0, -0.5, 0.1, 2.5])
        advantages = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
        old_logp = np.full((4, 1), -21.0, np.float32)
        out = objective.evaluate((old_logp + log_w[:, None]).astype(np.float32), old_logp, advantages,
                                 np.ones((4, 1), np.float32))
        np.testing.assert_allclose(response_gradient_weight(objective, log_w, advantages),
                                   np.asarray(out.responses["phi"]), rtol=1e-5, atol=1e-7)


def test_shapes_and_bad_input():
    grid = np.zeros((2, 3))
    assert response_gradient_weight(respo_objective, grid, np.array([[1.0], [-1.0]])).shape == (2, 3)
    assert response_gradient_weight("respo", np.zeros(0), 1.0).shape == (0,)
    with pytest.raises(ValueError, match="non-zero"):
        response_gradient_weight("respo", [0.0, 1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="length must be an int >= 1"):
        response_gradient_weight("respo", [0.0], 1.0, length=0)
    with pytest.raises(ValueError, match="NaN"):
        response_gradient_weight("respo", [np.nan], 1.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        response_gradient_weight("respo", np.zeros(3), np.ones(2))
    with pytest.raises(KeyError, match="unknown objective"):
        response_gradient_weight("respoo", [0.0], 1.0)
    with pytest.raises(TypeError, match="PolicyObjective"):
        response_gradient_weight(object(), [0.0], 1.0)


def test_plot_draws_every_objective_from_the_computed_weights():
    objectives = {"GRPO": "grpo", "GSPO": "gspo", "ReSPO": respo_objective}
    fig = plot_gradient_weights(objectives, lengths={"GSPO": 500}, num=51)
    assert isinstance(fig, matplotlib.figure.Figure)
    axes = fig.get_axes()
    assert len(axes) == 4
    for ax in axes:
        assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] == [
            "GRPO", "GSPO (T=500)", "ReSPO"]
    x, y = axes[2].get_lines()[2].get_data()  # row A < 0, against W, ReSPO
    np.testing.assert_allclose(y, respo_reference(x, -1.0), rtol=2e-5, atol=1e-7)
    with pytest.raises(ValueError, match="not among the objectives"):
        plot_gradient_weights(objectives, lengths={"VESPO": 3})
    with pytest.raises(ValueError, match="no objectives"):
        plot_gradient_weights({})


def test_weight_table_lists_both_signs_of_every_objective():
    table = weight_table({"ReSPO": "respo", "GRPO": "grpo"}, [-1.0, 0.0])
    lines = table.splitlines()
    assert lines[0] == "| objective | sign | log W = -1 | log W = 0 |"
    assert len(lines) == 2 + 4
    respo_pos = respo_reference(np.exp(-1.0), 1.0)
    assert lines[2] == f"| ReSPO | A > 0 | {respo_pos:.4g} | 1 |"
    assert lines[5] == "| GRPO | A < 0 | 0 | 1 |"  # W = e^-1 is below GRPO's 1 - eps for A < 0
