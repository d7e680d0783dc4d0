"""Rollout correction: verl's truncated / masked importance weights between the sampler's
log-probs and log π_old against a float64 NumPy transcription of verl's formulas
(``verl/trainer/ppo/mismatch_helper.py``, ``compute_rollout_importance_weights``) on held-out cases,
the weights composing with every objective and the config's one-line errors. A short run with it on is
in tests/test_dynamic_sampling.py (one run of both options)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.train import DEFAULT_CONFIG, load_config
from respo_jax.objectives import OBJECTIVES, RolloutCorrection, get_objective, rollout_correction_weights
from respo_jax.training.config import ConfigError, apply_overrides

SAFETY_BOUND = 20.0  # verl's


def verl_weights(old_logp, rollout_logp, mask, level, mode, upper, lower=None):
    """verl's rollout IS weights and metrics in float64 (mismatch_helper.compute_rollout_importance_weights
    and compute_is_metrics, without the veto; sequence min/max over non-empty rows)."""
    old_logp, rollout_logp, mask = (np.asarray(a, np.float64) for a in (old_logp, rollout_logp, mask))
    lower = 1.0 / upper if lower is None else lower
    valid = mask > 0
    log_ratio = np.where(valid, old_logp - rollout_logp, 0.0)
    rows = valid.any(axis=1)
    if level == "token":
        weights = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
        high = (weights > upper)[valid].mean()
        low = (weights < lower)[valid].mean()
        largest, smallest = weights[valid].max(), weights[valid].min()
    else:
        log_sum = (log_ratio * mask).sum(axis=1)
        weights = np.repeat(np.exp(np.clip(log_sum, -SAFETY_BOUND, SAFETY_BOUND))[:, None], mask.shape[1], 1)
        high = (log_sum[rows] > np.log(upper)).mean()
        low = (log_sum[rows] < np.log(lower)).mean()
        largest = np.exp(min(log_sum[rows].max(), SAFETY_BOUND))
        smallest = np.exp(log_sum[rows].min())
    mean = (weights * mask).sum() / mask.sum()
    if mode == "truncate":
        changed = weights > upper
        weights = np.minimum(weights, upper)
    else:
        keep = (weights >= lower) & (weights <= upper)
        changed = ~keep
        weights = weights * keep
    metrics = {"rollout_is_mean": mean, "rollout_is_max": largest, "rollout_is_min": smallest,
               "rollout_is_fraction_high": high, "rollout_is_fraction_low": low,
               "rollout_is_corrected_fraction": changed[valid].mean()}
    return weights * mask, metrics


def _case(seed: int, rows: int = 7, width: int = 9, scale: float = 0.6):
    """Sampler / trainer log-probs with padding (garbage there: NaN, inf), one empty row, a few log-ratios
    beyond verl's +-20 safety bound, and advantages of both signs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, rows)
    lengths[2] = 0
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float32)
    sampler = -rng.exponential(1.5, (rows, width)).astype(np.float32)
    old = (sampler + rng.normal(0.0, scale, (rows, width))).astype(np.float32)
    old[0, 0] = sampler[0, 0] + 25.0  # beyond the safety bound, both ways
    old[1, 0] = sampler[1, 0] - 30.0
    old = np.where(mask > 0, old, np.float32(np.nan))
    sampler = np.where(mask > 0, sampler, np.float32(np.inf))
    advantages = rng.normal(0.0, 1.0, rows).astype(np.float32)
    advantages[:2] = [1.5, -1.5]
    return old, sampler, mask, advantages


CORRECTIONS = [("token", "truncate", 2.0, None), ("token", "mask", 1.5, None), ("token", "mask", 3.0, 0.6),
               ("sequence", "truncate", 2.0, None), ("sequence", "mask", 5.0, None),
               ("sequence", "mask", 4.0, 0.1)]


@pytest.mark.parametrize("level, mode, upper, lower", CORRECTIONS)
@pytest.mark.parametrize("seed", [11, 12])
def test_weights_and_metrics_equal_verls_formulas_in_float64(level, mode, upper, lower, seed):
    old, sampler, mask, _ = _case(seed, scale=0.6 if level == "token" else 0.25)
    correction = RolloutCorrection(level=level, mode=mode, threshold=upper, threshold_lower=lower)
    weights, metrics = jax.jit(rollout_correction_weights, static_argnums=3)(old, sampler, mask, correction)
    want, want_metrics = verl_weights(old, sampler, mask, level, mode, upper, lower)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=2e-5, atol=1e-7)
    assert np.all(np.asarray(weights)[mask == 0] == 0)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=2e-5, atol=1e-7, err_msg=key)
    # the held-out cases do exercise the bounds
    assert 0 < want_metrics["rollout_is_corrected_fraction"] < 1


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_weights_multiply_each_tokens_loss_term_of_every_objective_denominator_unchanged(name):
    """loss(w) = Σ w·ℓ / D with the unweighted objective's per-token ℓ and its denominator D, so the
    gradient of every token is w times the unweighted one, for every aggregation mode."""
    old, sampler, mask, advantages = _case(3)
    old, sampler = np.nan_to_num(old, nan=-1.0), np.nan_to_num(sampler, posinf=-1.0)
    logp = old + np.random.default_rng(4).normal(0.0, 0.05, old.shape).astype(np.float32)
    weights, _ = rollout_correction_weights(old, sampler, mask, RolloutCorrection(threshold=2.0))
    objective = get_objective(name)

    def loss(x, w):
        return objective.evaluate(x, old, advantages, mask, token_weight=w).terms.loss()

    plain = jax.grad(loss)(jnp.asarray(logp), None)
    weighted = jax.grad(loss)(jnp.asarray(logp), weights)
    np.testing.assert_allclose(np.asarray(weighted), np.asarray(weights) * np.asarray(plain), rtol=1e-5,
                               atol=1e-8)
    ones = objective.evaluate(logp, old, advantages, mask, token_weight=jnp.ones_like(mask))
    unweighted = objective.evaluate(logp, old, advantages, mask)
    assert float(ones.terms.total) == pytest.approx(float(unweighted.terms.total), rel=1e-6, abs=1e-7)
    assert float(ones.terms.denominator) == float(unweighted.terms.denominator)


@pytest.mark.parametrize("override, message", [
    ("objective.rollout_correction.level=tokens", "level='tokens': expected one of ('token', 'sequence')"),
    ("objective.rollout_correction.mode=clip", "mode='clip': expected one of ('truncate', 'mask')"),
    ("objective.rollout_correction.threshold=0", "threshold=0: expected a finite number > 0"),
    ("objective.rollout_correction.threshold_lower=0.5", "only mode 'mask' has a lower bound"),
    ("objective.rollout_correction.treshold=2", "unknown key(s) ['treshold']"),
    ("rollout.max_generation_batches=0", "expected an integer >= 1"),
])
def test_bad_values_are_one_line_errors_naming_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(load_config(DEFAULT_CONFIG), [override])
    text = str(info.value)
    assert text.startswith(override.split(".")[0] + "." + override.split(".")[1]) and "\n" not in text, text
    assert message in text, text


def test_a_lower_bound_above_the_upper_one_is_refused():
    expected = (r"^objective\.rollout_correction=.*threshold_lower=2\.5: expected a number below "
                r"threshold=2\.0$")
    with pytest.raises(ConfigError, match=expected):
        apply_overrides(load_config(DEFAULT_CONFIG), ['objective.rollout_correction={"mode": "mask", '
                                                      '"threshold": 2.0, "threshold_lower": 2.5}'])
