"""The float64 NumPy reference of respo_jax.objectives and the test data the objective tests share.

The reference is written directly from the paper's equations (no log-space tricks), so it checks the
stable JAX implementation rather than repeating it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from hypothesis import settings

from respo_jax.objectives import AGGREGATION_MODES, OBJECTIVES

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


def case_modes():
    """Every aggregation mode for the paper's objectives at their defaults; the others in their own mode."""
    pairs = []
    for case in OBJECTIVE_CASES:
        name, hparams = case
        every_mode = name in ("respo", "grpo") and not hparams
        modes = AGGREGATION_MODES if every_mode else (OBJECTIVES[name].aggregation,)
        pairs += [(case, mode) for mode in modes]
    return pairs


def name_modes():
    """(objective, mode) pairs for the accumulation and empty-batch checks: every mode once, every
    objective in its own mode."""
    pairs = [("respo", mode) for mode in AGGREGATION_MODES]
    return pairs + [(name, OBJECTIVES[name].aggregation) for name in sorted(OBJECTIVES) if name != "respo"]


def case_id(case):
    name, hp = case
    return name + ("" if not hp else "-" + "-".join(f"{k}{v}" for k, v in hp.items()))
