"""Off-policy masks: responses or tokens whose policy has drifted too far from π_old are left out of the
policy-gradient term, three published answers to the drift that ReSPO re-weights instead.

Each compares the current policy π_θ (stop-gradient) with π_old, the policy the responses were sampled
from (``old_logp``), and gives a 0/1 weight per token that multiplies the objective's token loss before
aggregation, the denominator unchanged (as ``rollout_correction``'s weights; it composes with every
objective and with rollout correction). With r_t = π_θ(o_t) / π_old(o_t) and |o_i| the response length:

  deepseek_v32  DeepSeek-V3.2 (2025, §3.1 "Off-Policy Sequence Masking"): a response is dropped when its
                advantage is negative and its sampled-token KL estimate exceeds δ,
                    M_i = 0  if  A_i < 0  and  (1/|o_i|) Σ_t log(π_old(o_t) / π_θ(o_t)) > δ,  else 1.
  geometric     the geometric-mean sequence mask of SkyRL's off-policy correction (``geo_mask_low`` /
                ``geo_mask_high``; verl's rollout-correction "geometric" rejection):
                    ρ_i = exp((1/|o_i|) Σ_t log r_t);   M_i = 1  if  low <= ρ_i <= high,  else 0.
                (Those frameworks apply it to π_old / π_sampler; here it bounds the drift of reuse, π_θ /
                π_old — ``rollout_correction`` is the place for the sampler's mismatch.)
  m2po          M2PO (Zheng et al. 2025, "Prosperity before Collapse"; AReaL's ``m2_threshold``): the second
                moment of the token log-ratios over the batch's N response tokens,
                    M̂2 = (1/N) Σ_t (log r_t)^2,
                is brought to at most τ by masking the tokens of largest (log r_t)^2: with them sorted in
                decreasing order, the k first are masked, k the smallest count for which the mean of the
                remaining N - k is <= τ (k = 0 when M̂2 <= τ already). Tokens tied with the k-th largest
                value are masked with it.

The first two are per response, so a micro-batch computes them from its own rows exactly. M2PO's k is a
statistic of the whole mini-batch: the update step computes the mask from the log-probs of the whole
mini-batch (a forward pass before the micro-batch loop when the mini-batch is split), so the masked tokens
are the one-shot step's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from respo_jax.objectives.aggregation import safe_divide
from respo_jax.objectives.validation import check_config_keys

MASK_KINDS = ("deepseek_v32", "geometric", "m2po")
# The fields each kind takes, and SkyRL's / AReaL's defaults where they publish one.
_FIELDS = {"deepseek_v32": {"delta": None}, "geometric": {"low": 0.99, "high": 1.01},
           "m2po": {"threshold": 0.04}}


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a finite number > 0")
    return float(value)


@dataclasses.dataclass(frozen=True)
class OffPolicyMask:
    """A configured off-policy mask (hashable: a static argument of the jitted update).

    kind: one of MASK_KINDS; delta: deepseek_v32's KL threshold δ (required, > 0); low, high: geometric's
    bounds on ρ_i (0 < low < 1 < high; SkyRL's 0.99, 1.01); threshold: m2po's τ (> 0; AReaL's 0.04)."""

    kind: str
    delta: float | None = None
    low: float | None = None
    high: float | None = None
    threshold: float | None = None

    def __post_init__(self):
        if self.kind not in MASK_KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {MASK_KINDS}")
        allowed = _FIELDS[self.kind]
        for name in ("delta", "low", "high", "threshold"):
            value = getattr(self, name)
            if name not in allowed:
                if value is not None:
                    raise ValueError(f"{name}={value!r}: kind {self.kind!r} takes only {sorted(allowed)}")
                continue
            if value is None:
                if allowed[name] is None:
                    raise ValueError(f"kind {self.kind!r} needs {name} (no published default)")
                object.__setattr__(self, name, allowed[name])
            else:
                object.__setattr__(self, name, _positive(name, value))
        if self.kind == "geometric" and not self.low < 1.0 < self.high:
            raise ValueError(f"low={self.low!r}, high={self.high!r}: expected low < 1 < high")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "OffPolicyMask | None":
        """The mask a config dict describes; None for {} (off). Unknown keys raise ValueError."""
        if not values:
            return None
        check_config_keys(cls, values)
        if "kind" not in values:
            raise ValueError(f"needs a 'kind', one of {MASK_KINDS}")
        return cls(**values)

    @property
    def per_batch(self) -> bool:
        """Whether the mask of a token depends on other responses of the mini-batch (m2po)."""
        return self.kind == "m2po"


def _mean_log_ratio(logp, old_logp, mask):
    valid = mask > 0
    return safe_divide(jnp.sum(jnp.where(valid, logp - old_logp, 0.0), axis=-1), jnp.sum(mask, axis=-1))


def deepseek_v32_keep(logp, old_logp, advantages, mask, delta: float):
    """[batch] bool: DeepSeek-V3.2's M_i (module docstring); logp, old_logp, mask: [batch, seq]."""
    kl = -_mean_log_ratio(logp, old_logp, mask)
    return ~((advantages < 0) & (kl > delta))


def geometric_keep(logp, old_logp, mask, low: float, high: float):
    """[batch] bool: the geometric-mean mask M_i, compared in log space (log low <= mean log r <=
    log high)."""
    mean = _mean_log_ratio(logp, old_logp, mask)
    return (mean >= math.log(low)) & (mean <= math.log(high))


def m2po_cutoff(logp, old_logp, mask, threshold: float):
    """The M2PO cutoff of a whole mini-batch: tokens with (log r)^2 >= cutoff are masked (inf: none).

    logp, old_logp, mask: [batch, seq]. Sorted decreasing, v_1 >= ... >= v_N; the mean of the tokens left
    after masking k is (Σ_{j>k} v_j) / (N - k); k* is the least k where it is <= τ and the cutoff is v_k*.
    """
    valid = (mask > 0).reshape(-1)
    values = jnp.where(valid, jnp.square(logp - old_logp).reshape(-1), -jnp.inf)
    ordered = -jnp.sort(-values)  # decreasing; padding (-inf) last
    n = jnp.sum(valid)
    finite = jnp.where(jnp.isfinite(ordered), ordered, 0.0)
    suffix = jnp.sum(finite) - jnp.cumsum(finite)  # Σ_{j>k} v_j after masking k = index + 1 tokens
    k = jnp.arange(1, ordered.shape[0] + 1)
    fits = (suffix <= threshold * (n - k)) & (k <= n)
    first = jnp.argmax(fits)  # the least masking count (index k* - 1)
    total_fits = jnp.sum(finite) <= threshold * n
    return jnp.where(total_fits | ~jnp.any(fits), jnp.inf, ordered[first])


def mask_weights(spec: OffPolicyMask, logp, old_logp, advantages, mask):
    """[batch, seq] float32 0/1, stop-gradient (0 on padding): the mask's keep weights for these rows
    (m2po: its cutoff from these rows, so the caller passes the whole mini-batch)."""
    logp, old_logp = jax.lax.stop_gradient(logp), jnp.asarray(old_logp, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    valid = mask > 0
    if spec.kind == "deepseek_v32":
        keep = deepseek_v32_keep(logp, old_logp, advantages, mask, spec.delta)[:, None]
    elif spec.kind == "geometric":
        keep = geometric_keep(logp, old_logp, mask, spec.low, spec.high)[:, None]
    else:
        keep = jnp.square(logp - old_logp) < m2po_cutoff(logp, old_logp, mask, spec.threshold)
    return jax.lax.stop_gradient(jnp.where(valid & keep, 1.0, 0.0))


def masked_fraction(weights, mask):
    """The share of response tokens a mask removes (off_policy_masked_fraction)."""
    mask = jnp.asarray(mask, jnp.float32)
    return safe_divide(jnp.sum(jnp.where(mask > 0, 1.0 - weights, 0.0)), jnp.sum(mask))
