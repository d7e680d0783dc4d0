"""Regularizers added to a policy objective: KL to a frozen reference policy and an entropy bonus, as verl
(``core_algos.kl_penalty``, ``agg_loss``), TRL, Tunix and OpenRLHF add them.

KL penalty per token (verl's ``kl_penalty_forward``; logp = log π_θ, ref = log π_ref of the sampled token):

  k1   logp - ref                                               (verl "kl", "k1")
  abs  |logp - ref|                                             (verl "abs")
  k2   (logp - ref)^2 / 2                                       (verl "mse", "k2")
  k3   x = clamp(ref - logp, ±20); clamp(e^x - x - 1, ±10)      (verl "low_var_kl", "k3"; Schulman's
                                                                 unbiased, low-variance estimator of
                                                                 KL(π_θ ‖ π_ref))
  <e>+ the value of <e> with the gradient of k2 (verl's straight-through "k3+": an unbiased gradient of
       KL(π_θ ‖ π_ref) under on-policy samples)

In the loss (verl ``use_kl_loss``): loss += kl_coef · agg(kl, mask), aggregated with the objective's own
mode and denominator. In the reward (verl ``use_kl_in_reward``): score_i -= β Σ_t kl(log π_old, ref),
β fixed or adapted once per rollout batch by verl's ``AdaptiveKLController`` (Ziegler et al., 2019):

  e = clip(KL / target - 1, -0.2, 0.2);   β ← β · (1 + e · n / horizon)

with KL the batch mean over responses of the per-response token mean of kl and n the responses.

Entropy bonus (verl ``entropy_coeff``): loss -= entropy_coef · agg(H, mask), H the entropy of the policy's
full distribution at each response token (differentiable; the chunked LM head computes it without
[tokens, vocab] logits, ``respo_jax.models.qwen3.lm_head``).

Both terms are sums over responses divided by the objective's mini-batch denominator, so they stay exact
under micro-batching (``aggregation``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from respo_jax.objectives.aggregation import aggregation_terms, safe_divide
from respo_jax.objectives.off_policy_masks import OffPolicyMask

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
# verl's clamps in "low_var_kl": the log-ratio before exp(), and the estimate itself.
K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
# AdaptiveKLController's bound on the proportional error.
ADAPTIVE_KL_ERROR_CLIP = 0.2


def check_kl_estimator(name: str) -> str:
    """The estimator name, or ValueError: one of KL_ESTIMATORS, optionally with the straight-through "+"."""
    if not isinstance(name, str) or name.rstrip("+") not in KL_ESTIMATORS or name.count("+") > 1:
        raise ValueError(f"unknown KL estimator {name!r}; expected one of {KL_ESTIMATORS}, each optionally "
                         "with a '+' (straight-through: its value, the gradient of k2)")
    return name


def _kl_forward(logp, ref_logp, estimator: str):
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return jnp.abs(diff)
    if estimator == "k2":
        return 0.5 * jnp.square(diff)
    x = jnp.clip(-diff, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(x) - x - 1.0, -K3_CLAMP, K3_CLAMP)


def kl_penalty(logp, ref_logp, estimator: str = "k3"):
    """Per-token KL estimate of the module docstring: logp, ref_logp: [batch, seq] float -> [batch, seq]
    float32 (differentiable in logp; the reference is a constant)."""
    check_kl_estimator(estimator)
    logp = jnp.asarray(logp, jnp.float32)
    ref_logp = jax.lax.stop_gradient(jnp.asarray(ref_logp, jnp.float32))
    value = _kl_forward(logp, ref_logp, estimator.rstrip("+"))
    if not estimator.endswith("+"):
        return value
    surrogate = 0.5 * jnp.square(logp - ref_logp)
    return surrogate - jax.lax.stop_gradient(surrogate) + jax.lax.stop_gradient(value)


def adaptive_kl_coef(value: float, current_kl: float, n_steps: int, target: float, horizon: float) -> float:
    """verl's ``AdaptiveKLController.update``: the next coefficient after a batch of ``n_steps`` responses
    whose mean KL was ``current_kl`` (host floats)."""
    error = float(np.clip(current_kl / target - 1.0, -ADAPTIVE_KL_ERROR_CLIP, ADAPTIVE_KL_ERROR_CLIP))
    return float(value) * (1.0 + error * n_steps / horizon)


def response_kl(old_logp, ref_logp, mask, estimator: str = "k3"):
    """(Σ_t kl [batch], token mean of kl per response [batch]) of log π_old against the reference under
    ``mask: [batch, seq]``: the reward penalty's sum and the controller's per-response KL."""
    kl = jnp.where(mask > 0, kl_penalty(old_logp, ref_logp, estimator), 0.0)
    total = jnp.sum(kl, axis=-1)
    return total, safe_divide(total, jnp.sum(mask, axis=-1))


@dataclasses.dataclass(frozen=True)
class Regularizers:
    """The terms added to the objective in the update step (hashable: a static part of the jitted step).

    kl_coef: weight of the KL to the reference in the loss (0: none); kl_estimator: one of
    KL_ESTIMATORS (+ "+"); entropy_coef: weight of the entropy bonus (0: none); mask: an
    ``OffPolicyMask`` or None."""

    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    mask: OffPolicyMask | None = None

    def __post_init__(self):
        check_kl_estimator(self.kl_estimator)
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name}={value!r}: expected a finite number >= 0")

    @property
    def active(self) -> bool:
        return bool(self.kl_coef or self.entropy_coef or self.mask is not None)

    def loss_total(self, logp, ref_logp, entropy, mask, aggregation: str, loss_scale_factor: float | None):
        """kl_coef · Σ agg(kl) - entropy_coef · Σ agg(H) of one (micro-)batch, before the division by the
        mini-batch denominator: ``logp, ref_logp, entropy, mask: [batch, seq]`` (ref_logp / entropy None
        where the term is off)."""
        total = jnp.float32(0.0)
        if self.kl_coef and ref_logp is not None:
            kl = kl_penalty(logp, ref_logp, self.kl_estimator)
            total = total + self.kl_coef * aggregation_terms(kl, mask, aggregation, loss_scale_factor).total
        if self.entropy_coef and entropy is not None:
            bonus = aggregation_terms(entropy, mask, aggregation, loss_scale_factor).total
            total = total - self.entropy_coef * bonus
        return total
