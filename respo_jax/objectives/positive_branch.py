"""App. E.3's positive-branch statistics of a batch of responses, defined once.

The policy update computes them per mini-batch inside its jitted step (`policy_losses.sequence_metrics`,
jax.numpy), and the trainer's metrics record pools them over a whole rollout batch on the host
(`respo_jax.training.iteration_metrics`, `respo_jax.eval.positive_branch.pooled_diagnostics`, float64
NumPy): the same definitions in both places. Over the positive responses (A_i > 0, at least one token)
and the low-weight region log W_i < -1:

    positive_low_w_share          p = #{positive, log W < -1} / #{positive}
    positive_low_w_mass_share     m = sum_{positive, log W < -1} |A_i| c_i / sum_{positive} |A_i| c_i
    positive_low_w_amplification  m / p (> 1: the kernel gives the region more than its share)
    positive_log_w_mean           mean log W of the positive responses
    positive_length_mean          mean length of the positive responses

c_i is the response's gradient coefficient (phi(W_i) for ReSPO and VESPO). Every ratio with an empty
denominator is 0.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from respo_jax.objectives.aggregation import safe_divide

# The low-weight region of App. E.3's Tab. 5: log W < LOW_LOG_W.
LOW_LOG_W = -1.0


def _masked_sum(xp, values, where):
    if xp is np:  # on the host: the sum of exactly the selected values
        return values[where].sum()
    return jnp.sum(jnp.where(where, values, 0.0))


def _count(xp, where):
    return where.sum() if xp is np else jnp.sum(where.astype(jnp.float32))


def _divide(xp, total, denominator):
    if xp is np:
        return float(total / denominator) if denominator > 0 else 0.0
    return safe_divide(total, denominator)


def positive_branch_statistics(log_w, advantage, coefficient, length, xp=jnp) -> dict:
    """The App. E.3 keys of a batch (module docstring) from `[responses]` arrays: clamped log W, advantage
    A, gradient coefficient c and length in tokens. xp=jnp: traceable scalars (the jitted update);
    xp=np: Python floats computed in float64 (the host's pooled record)."""
    if xp is np:
        log_w, advantage, coefficient, length = (np.asarray(x, np.float64)
                                                 for x in (log_w, advantage, coefficient, length))
    positive = (advantage > 0) & (length > 0)
    low = positive & (log_w < LOW_LOG_W)
    mass = coefficient * xp.abs(advantage)
    positives = _count(xp, positive)
    share = _divide(xp, _count(xp, low), positives)
    mass_share = _divide(xp, _masked_sum(xp, mass, low), _masked_sum(xp, mass, positive))
    return {
        "positive_low_w_share": share,
        "positive_low_w_mass_share": mass_share,
        "positive_low_w_amplification": _divide(xp, mass_share, share),
        "positive_log_w_mean": _divide(xp, _masked_sum(xp, log_w, positive), positives),
        "positive_length_mean": _divide(xp, _masked_sum(xp, length, positive), positives),
    }
