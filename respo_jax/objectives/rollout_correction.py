"""Rollout correction: importance weights between the sampler's log-probs and the recomputed log π_old.

The sampler and the trainer compute log-probs with different programs (and, under top-p / top-k, of
different distributions: the sampler's is the truncated, renormalized one it drew from), so the
responses are slightly off-policy for π_old. verl's rollout correction (``mismatch_helper.py``,
``compute_rollout_importance_weights``; now ``rollout_corr_helper.py``) re-weights each token's loss
term by the ratio ρ = π_old / π_sampler, kept bounded:

  level "token":    ρ_t = exp(clamp(log π_old_t - log π_sampler_t, ±20))
  level "sequence": ρ_t = exp(clamp(Σ_t (log π_old_t - log π_sampler_t), ±20)) for every token of the row
  mode "truncate":  w = min(ρ, threshold)                                   (TIS)
  mode "mask":      w = ρ if threshold_lower <= ρ <= threshold else 0          (verl's "clip"/CIS mode;
                    threshold_lower defaults to 1 / threshold)

w is stop-gradient and 0 on padding; it multiplies each token's loss term before aggregation, the
aggregation's denominator unchanged (verl: ``pg_losses * rollout_is_weights``, then ``agg_loss`` with the
same response mask), so it composes with every objective. The metrics describe ρ before truncation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from respo_jax.objectives.aggregation import safe_divide
from respo_jax.objectives.validation import check_config_keys

# verl's SAFETY_BOUND: log-ratios are clamped to +-20 before exp() (exp(20) ~ 4.9e8).
SAFETY_BOUND = 20.0
LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """A configured rollout correction (hashable: a static argument of the jitted update).

    level: "token" or "sequence"; mode: "truncate" or "mask"; threshold: the upper bound (> 0, verl's
    default 2); threshold_lower: the lower bound of mask mode (None: 1 / threshold; truncate mode has
    none, as in verl)."""

    level: str = "token"
    mode: str = "truncate"
    threshold: float = 2.0
    threshold_lower: float | None = None

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r}: expected one of {LEVELS}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {MODES}")
        for name in ("threshold", "threshold_lower"):
            value = getattr(self, name)
            if value is None and name == "threshold_lower":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a finite number > 0")
        if self.threshold_lower is not None:
            if self.mode != "mask":
                raise ValueError(f"threshold_lower={self.threshold_lower!r}: only mode 'mask' has a lower "
                                 "bound (truncate caps the weight above only, as verl's TIS)")
            if not self.threshold_lower < self.threshold:
                raise ValueError(f"threshold_lower={self.threshold_lower!r}: expected a number below "
                                 f"threshold={self.threshold!r}")

    @property
    def lower(self) -> float:
        """The lower bound: mask mode's threshold_lower (default 1 / threshold); the metrics' low mark."""
        return 1.0 / self.threshold if self.threshold_lower is None else float(self.threshold_lower)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "RolloutCorrection | None":
        """The correction a config dict describes; None for {} (off). Unknown keys raise ValueError."""
        if not values:
            return None
        check_config_keys(cls, values)
        return cls(**values)


def rollout_correction_weights(old_logp, sampler_logp, mask, correction: RolloutCorrection):
    """(weights, metrics): the importance weights of the module docstring and their statistics.

    old_logp, sampler_logp, mask: [batch, seq] (mask 0/1; padding may hold anything) ->
    weights: [batch, seq] float32, stop-gradient, 0 on padding. metrics (scalars, of ρ before truncation
    or masking, over response tokens; at level "sequence" max/min/fractions over non-empty responses):
      rollout_is_mean                  mean of ρ over response tokens (ρ clamped at exp(20))
      rollout_is_max, rollout_is_min   largest / smallest ρ
      rollout_is_fraction_high / _low  share with ρ > threshold / ρ < the lower bound
      rollout_is_corrected_fraction    share of response tokens whose weight the truncation (ρ > threshold)
                                       or the mask (outside [lower, threshold]) changes
    """
    mask = jnp.asarray(mask, jnp.float32)
    valid = mask > 0
    log_ratio = jnp.where(valid, jnp.asarray(old_logp, jnp.float32) - jnp.asarray(sampler_logp, jnp.float32),
                          0.0)
    tokens = jnp.sum(mask)
    non_empty = jnp.sum(mask, axis=-1) > 0
    upper, lower = correction.threshold, correction.lower
    if correction.level == "token":
        rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
        rho_max = jnp.max(jnp.where(valid, rho, -jnp.inf))
        rho_min = jnp.min(jnp.where(valid, rho, jnp.inf))
        high = safe_divide(jnp.sum(jnp.where(valid & (rho > upper), 1.0, 0.0)), tokens)
        low = safe_divide(jnp.sum(jnp.where(valid & (rho < lower), 1.0, 0.0)), tokens)
    else:
        log_seq = jnp.sum(log_ratio, axis=-1)  # [batch]
        rho = jnp.broadcast_to(jnp.exp(jnp.clip(log_seq, -SAFETY_BOUND, SAFETY_BOUND))[:, None], mask.shape)
        rho_max = jnp.exp(jnp.minimum(jnp.max(jnp.where(non_empty, log_seq, -jnp.inf)), SAFETY_BOUND))
        rho_min = jnp.exp(jnp.min(jnp.where(non_empty, log_seq, jnp.inf)))
        rows = jnp.sum(non_empty)
        high = safe_divide(jnp.sum(non_empty & (log_seq > math.log(upper))), rows)
        low = safe_divide(jnp.sum(non_empty & (log_seq < math.log(lower))), rows)
    if correction.mode == "truncate":
        changed = rho > upper
        weights = jnp.minimum(rho, upper)
    else:
        keep = (rho >= lower) & (rho <= upper)
        changed = ~keep
        weights = jnp.where(keep, rho, 0.0)
    weights = jax.lax.stop_gradient(jnp.where(valid, weights, 0.0))
    any_token = tokens > 0
    metrics = {
        "rollout_is_mean": safe_divide(jnp.sum(jnp.where(valid, rho, 0.0)), tokens),
        "rollout_is_max": jnp.where(any_token, rho_max, 0.0),
        "rollout_is_min": jnp.where(any_token, rho_min, 0.0),
        "rollout_is_fraction_high": high,
        "rollout_is_fraction_low": low,
        "rollout_is_corrected_fraction": safe_divide(jnp.sum(jnp.where(valid & changed, 1.0, 0.0)), tokens),
    }
    return weights, {key: jax.lax.stop_gradient(value) for key, value in metrics.items()}
