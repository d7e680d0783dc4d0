"""Policy objectives ReSPO, VESPO, GSPO and GRPO as pure functions of per-token log-probs (paper §3, App. B).

Each objective is registered by name with its token-level loss and its hyperparameter defaults:

    objective = get_objective("respo")                      # or "vespo", "gspo", "grpo"; hparams as kwargs
    loss, metrics = objective(logp, old_logp, advantages, mask)
    (total, denominator), metrics = objective.loss_terms(logp, old_logp, advantages, mask)

``logp, old_logp, mask: [batch, seq]`` float (mask entries 0/1), ``advantages: [batch]``. The loss is a
scalar to minimize. Every objective has the form  token_loss[i, t] = -A_i * r[i, t]  where the
surrogate ``r`` has gradient  d r[i, t] / d logp[i, t] = c[i, t]  (the *gradient coefficient*), so

    d loss / d logp[i, t] = -c[i, t] * A_i * mask[i, t] / D      (token-mean: D = total response tokens)

  ReSPO   c = phi(W_i; A_i), Eq. 12 per sign (stop-gradient), r = phi * log pi (REINFORCE form, Alg. 1)
  VESPO   c = W_i^beta exp(lam (1 - W_i)) per sign, same form
  GRPO    c = w_it if the PPO clip is inactive else 0, w_it = pi/pi_old per token,
          clip range [1 - eps_low, 1 + eps_high]
          (eps_high > eps_low is DAPO's decoupled "clip-higher")
  GSPO    c = s_i if the clip is inactive else 0, s_i = exp(mean_t log-ratio), in the token-level form
          s_it = sg(s_i) pi / sg(pi) so that every aggregation mode applies

Micro-batch accumulation: divide each micro-batch by the mini-batch denominator,
``objective(..., denominator=objective.denominator(full_mask))``; the summed gradients then equal the
full-batch gradient exactly (see ``aggregation``).

Metrics (scalars, all stop-gradient; the App. E.3 diagnostics use the same definitions):
  token_count, response_count     response tokens, non-empty responses
  log_w_mean / _min / _max        clamped log W over non-empty responses (0 when there are none)
  positive_low_w_fraction         share of positive (A > 0) responses with log W < -1
  coef_mean_pos / _neg            mean sequence coefficient (token mean of c) over A > 0 / A < 0 responses
  coef_mass_pos / _neg            sum of coefficient * |A| over A > 0 / A < 0 responses
  positive_low_w_mass_share       share of coef_mass_pos carried by positive responses with log W < -1
  clip_fraction(_low / _high)     GRPO, GSPO: share of response tokens whose gradient the clip removes
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from respo_jax.objectives import kernels
from respo_jax.objectives.aggregation import (
    LossTerms,
    aggregation_terms,
    check_aggregation_mode,
    loss_denominator,
    safe_divide,
)
from respo_jax.objectives.validation import check_policy_inputs

sg = jax.lax.stop_gradient

# verl's clamp on token log-ratios before exponentiating (GRPO, GSPO): keeps exp() finite in float32.
TOKEN_LOG_RATIO_CLAMP = 20.0


class TokenLoss(NamedTuple):
    """What an objective contributes before aggregation."""

    loss: jax.Array  # [batch, seq] per-token loss, differentiable in logp
    coefficient: jax.Array  # [batch, seq] gradient coefficient c (stop-gradient)
    metrics: dict[str, jax.Array]  # objective-specific scalars (e.g. clip fractions)


def _broadcast_rows(row_values: jax.Array, like: jax.Array) -> jax.Array:
    return jnp.broadcast_to(row_values[:, None], like.shape)


def _token_fraction(flags: jax.Array, mask: jax.Array) -> jax.Array:
    return safe_divide(jnp.sum(jnp.where(mask > 0, flags.astype(jnp.float32), 0.0)), jnp.sum(mask))


def respo_token_loss(logp, old_logp, advantages, mask, log_w, *, alpha, beta, lam) -> TokenLoss:
    """ReSPO, Alg. 1: -sg(phi(W_i; A_i)) A_i log pi[i, t] with the two-branch kernel of Eq. 12."""
    phi = sg(kernels.respo_kernel(log_w, advantages, alpha=alpha, beta=beta, lam=lam))
    loss = -(phi * advantages)[:, None] * logp
    return TokenLoss(loss=loss, coefficient=_broadcast_rows(phi, logp), metrics={})


def vespo_token_loss(logp, old_logp, advantages, mask, log_w, *, beta, lam) -> TokenLoss:
    """VESPO: -sg(W^beta e^(lam (1 - W))) A_i log pi[i, t], sign-specific (beta, lam)."""
    phi = sg(kernels.vespo_kernel(log_w, advantages, beta=beta, lam=lam))
    loss = -(phi * advantages)[:, None] * logp
    return TokenLoss(loss=loss, coefficient=_broadcast_rows(phi, logp), metrics={})


def _clip_flags(ratio, advantages_like, eps_low, eps_high):
    """Where min(r A, clip(r) A) takes the clipped (constant) branch: A >= 0 above, A < 0 below the range."""
    high = (advantages_like >= 0) & (ratio > 1.0 + eps_high)
    low = (advantages_like < 0) & (ratio < 1.0 - eps_low)
    return low, high


def grpo_token_loss(logp, old_logp, advantages, mask, log_w, *, eps_low, eps_high) -> TokenLoss:
    """GRPO/PPO, Eq. 1: -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A) per token, w = pi / pi_old."""
    log_ratio = jnp.clip(logp - old_logp, -TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    adv = _broadcast_rows(advantages, logp)
    low, high = _clip_flags(sg(ratio), adv, eps_low, eps_high)
    clipped = low | high
    surrogate = jnp.where(clipped, sg(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)), ratio)
    coefficient = sg(jnp.where(clipped, 0.0, ratio))
    metrics = {
        "clip_fraction": _token_fraction(clipped, mask),
        "clip_fraction_low": _token_fraction(low, mask),
        "clip_fraction_high": _token_fraction(high, mask),
    }
    return TokenLoss(loss=-adv * surrogate, coefficient=coefficient, metrics=metrics)


def gspo_token_loss(logp, old_logp, advantages, mask, log_w, *, eps_low, eps_high) -> TokenLoss:
    """GSPO, Eq. 2, in token-level form s_it = sg(s_i) pi / sg(pi) with s_i = exp(mean_t log-ratio).

    The clip acts on the sequence ratio s_i, so a clipped response loses the gradient of all its tokens.
    """
    lengths = jnp.sum(mask, axis=-1)
    mean_log_ratio = safe_divide(jnp.sum(jnp.where(mask > 0, logp - old_logp, 0.0), axis=-1), lengths)
    seq_ratio = sg(jnp.exp(jnp.clip(mean_log_ratio, -TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)))
    low, high = _clip_flags(seq_ratio, advantages, eps_low, eps_high)
    clipped = _broadcast_rows(low | high, logp)
    token_ratio = seq_ratio[:, None] * jnp.exp(logp - sg(logp))
    bounded = _broadcast_rows(jnp.clip(seq_ratio, 1.0 - eps_low, 1.0 + eps_high), logp)
    surrogate = jnp.where(clipped, bounded, token_ratio)
    coefficient = jnp.where(clipped, 0.0, _broadcast_rows(seq_ratio, logp))
    metrics = {
        "clip_fraction": _token_fraction(clipped, mask),
        "clip_fraction_low": _token_fraction(_broadcast_rows(low, logp), mask),
        "clip_fraction_high": _token_fraction(_broadcast_rows(high, logp), mask),
    }
    return TokenLoss(
        loss=-_broadcast_rows(advantages, logp) * surrogate, coefficient=coefficient, metrics=metrics
    )


def sequence_metrics(log_w, advantages, mask, coefficient) -> dict[str, jax.Array]:
    """Diagnostics shared by every objective (paper App. E.3); see the module docstring for the keys."""
    lengths = jnp.sum(mask, axis=-1)
    non_empty = lengths > 0
    response_count = jnp.sum(non_empty.astype(jnp.float32))
    seq_coef = safe_divide(jnp.sum(jnp.where(mask > 0, coefficient, 0.0), axis=-1), lengths)
    seq_mass = seq_coef * jnp.abs(advantages)
    positive = non_empty & (advantages > 0)
    negative = non_empty & (advantages < 0)
    low_w = log_w < -1.0

    def masked_sum(values, where):
        return jnp.sum(jnp.where(where, values, 0.0))

    def count(where):
        return jnp.sum(where.astype(jnp.float32))

    has_any = response_count > 0
    mass_pos = masked_sum(seq_mass, positive)
    return {
        "token_count": jnp.sum(mask),
        "response_count": response_count,
        "log_w_mean": safe_divide(masked_sum(log_w, non_empty), response_count),
        "log_w_min": jnp.where(has_any, jnp.min(jnp.where(non_empty, log_w, jnp.inf)), 0.0),
        "log_w_max": jnp.where(has_any, jnp.max(jnp.where(non_empty, log_w, -jnp.inf)), 0.0),
        "positive_low_w_fraction": safe_divide(count(positive & low_w), count(positive)),
        "coef_mean_pos": safe_divide(masked_sum(seq_coef, positive), count(positive)),
        "coef_mean_neg": safe_divide(masked_sum(seq_coef, negative), count(negative)),
        "coef_mass_pos": mass_pos,
        "coef_mass_neg": masked_sum(seq_mass, negative),
        "positive_low_w_mass_share": safe_divide(masked_sum(seq_mass, positive & low_w), mass_pos),
    }


# ----------------------------------------------------------------------------- hyperparameters


def _real(objective: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"{objective}: {name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{objective}: {name} must be finite, got {value}")
    return value


def _pair(objective: str, name: str, value) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(
            f"{objective}: {name} must be a (positive-branch, negative-branch) pair, got {value!r}"
        )
    return (_real(objective, f"{name}[0]", value[0]), _real(objective, f"{name}[1]", value[1]))


def _check_respo(h: dict) -> dict:
    out = {key: _pair("respo", key, h[key]) for key in ("alpha", "beta", "lam")}
    for branch, side in enumerate(("positive", "negative")):
        alpha, beta, lam = out["alpha"][branch], out["beta"][branch], out["lam"][branch]
        try:
            kernels.check_kernel_params(alpha, beta, lam)
        except ValueError as err:
            raise ValueError(f"respo, {side} branch: {err}") from None
    return out


def _check_vespo(h: dict) -> dict:
    out = {key: _pair("vespo", key, h[key]) for key in ("beta", "lam")}
    for branch, side in enumerate(("positive", "negative")):
        if out["beta"][branch] < 0:
            raise ValueError(
                f"vespo, {side} branch: beta must be >= 0 (phi -> inf as W -> 0 otherwise), "
                f"got {out['beta'][branch]}"
            )
        if out["lam"][branch] < 0:
            raise ValueError(f"vespo, {side} branch: lam must be >= 0, got {out['lam'][branch]}")
    return out


def _checker_for_clip(objective: str) -> Callable[[dict], dict]:
    def check(h: dict) -> dict:
        eps_low = _real(objective, "eps_low", h["eps_low"])
        eps_high = _real(objective, "eps_high", h["eps_high"])
        if not 0.0 < eps_low < 1.0:
            raise ValueError(f"{objective}: eps_low must lie in (0, 1), got {eps_low}")
        if not eps_high > 0.0:
            raise ValueError(f"{objective}: eps_high must be > 0, got {eps_high}")
        return {"eps_low": eps_low, "eps_high": eps_high}

    return check


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """A registered objective: its token-level loss, hyperparameter defaults and their check."""

    token_loss: Callable[..., TokenLoss]
    defaults: Mapping[str, Any]
    check: Callable[[dict], dict]


OBJECTIVES: dict[str, ObjectiveSpec] = {
    "respo": ObjectiveSpec(
        respo_token_loss,
        {"alpha": kernels.RESPO_ALPHA, "beta": kernels.RESPO_BETA, "lam": kernels.RESPO_LAMBDA},
        _check_respo,
    ),
    "vespo": ObjectiveSpec(
        vespo_token_loss,
        {"beta": kernels.VESPO_BETA, "lam": kernels.VESPO_LAMBDA},
        _check_vespo,
    ),
    "grpo": ObjectiveSpec(
        grpo_token_loss,
        {"eps_low": 0.2, "eps_high": 0.2},
        _checker_for_clip("grpo"),
    ),
    "gspo": ObjectiveSpec(
        gspo_token_loss,
        {"eps_low": 3e-4, "eps_high": 4e-4},
        _checker_for_clip("gspo"),
    ),
}


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """A configured objective; hashable, so it can be a static argument of ``jax.jit``."""

    name: str
    hparams: tuple[tuple[str, Any], ...]
    aggregation: str = "token-mean"

    @property
    def config(self) -> dict[str, Any]:
        """Hyperparameters including the aggregation mode, as passed to ``get_objective``."""
        return {**dict(self.hparams), "aggregation": self.aggregation}

    def denominator(self, mask) -> jax.Array:
        """Aggregation denominator of ``mask: [batch, seq]``; pass the mini-batch's to each micro-batch."""
        return loss_denominator(mask, self.aggregation)

    def loss_terms(self, logp, old_logp, advantages, mask) -> tuple[LossTerms, dict[str, jax.Array]]:
        """(LossTerms(total, denominator), metrics): the loss before division, additive over micro-batches."""
        check_policy_inputs(logp, old_logp, advantages, mask)
        mask = jnp.asarray(mask, jnp.float32)
        valid = mask > 0
        # Padding may hold anything (even inf); zero it so neither value nor gradient can see it.
        logp = jnp.where(valid, jnp.asarray(logp).astype(jnp.float32), 0.0)
        old_logp = sg(jnp.where(valid, jnp.asarray(old_logp).astype(jnp.float32), 0.0))
        advantages = sg(jnp.asarray(advantages).astype(jnp.float32))
        log_w = sg(kernels.sequence_log_ratio(logp, old_logp, mask))
        token = OBJECTIVES[self.name].token_loss(
            logp, old_logp, advantages, mask, log_w, **dict(self.hparams)
        )
        terms = aggregation_terms(token.loss, mask, self.aggregation)
        metrics = sequence_metrics(log_w, advantages, mask, sg(token.coefficient))
        metrics.update(token.metrics)
        return terms, {key: sg(value) for key, value in metrics.items()}

    def __call__(
        self, logp, old_logp, advantages, mask, denominator=None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, metrics); ``denominator``: the mini-batch's, when this call is one micro-batch."""
        terms, metrics = self.loss_terms(logp, old_logp, advantages, mask)
        return terms.loss(denominator), metrics


def get_objective(name: str, **hparams) -> PolicyObjective:
    """The objective ``name`` ("respo", "vespo", "gspo", "grpo") with ``hparams`` overriding its defaults.

    ``aggregation`` ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum") applies to every
    objective. Unknown names raise KeyError; unknown or invalid hyperparameters raise ValueError.
    """
    if name not in OBJECTIVES:
        raise KeyError(f"unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}")
    spec = OBJECTIVES[name]
    aggregation = check_aggregation_mode(hparams.pop("aggregation", "token-mean"))
    unknown = sorted(set(hparams) - set(spec.defaults))
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {unknown} for objective {name!r}; "
            f"expected some of {sorted(spec.defaults) + ['aggregation']}"
        )
    values = spec.check({**spec.defaults, **hparams})
    return PolicyObjective(name=name, hparams=tuple(sorted(values.items())), aggregation=aggregation)


respo_objective = get_objective("respo")
vespo_objective = get_objective("vespo")
gspo_objective = get_objective("gspo")
grpo_objective = get_objective("grpo")
