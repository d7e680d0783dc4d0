"""Sequence-weight kernels of ReSPO and VESPO (paper §3.3, App. A, App. B).

Every kernel is an elementwise map of the *sequence log-weight* ``log_w = log W`` (any shape) and is
computed in log space, so that W = exp(±20) and beyond neither overflows nor produces NaN. The
objectives apply these kernels under ``stop_gradient``; the gradients here are only used by tests and
by the symbolic checks (slopes at W = 1).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# The clamp of App. B / the verl recipe: |log W| <= 20 keeps W and every kernel finite in float32.
LOG_W_CLAMP = 20.0

# Above this log phi0 the tilt exp(lam * (1 - phi0)) underflows to exactly 0 in float32 for every
# lam >= 1e-30, so the reshaped kernel is set to 0 there without evaluating exp(phi0) (which would
# overflow and turn inf - inf into NaN).
_LOG_PHI0_CUTOFF = 80.0

RESPO_ALPHA = (2.0, 1.0)
RESPO_BETA = (0.5, 0.5)
RESPO_LAMBDA = (2.0, 2.0)
VESPO_BETA = (2.0, 3.0)
VESPO_LAMBDA = (3.0, 2.0)


def _as_float_array(x) -> jax.Array:
    """Float array of at least float32 precision (float64 stays float64 when x64 is enabled)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.float32)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _concrete_float(name: str, value) -> float:
    """Kernel hyperparameters are static Python numbers: they select branches of the formula."""
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError) as err:
        raise TypeError(f"{name} must be a concrete real number, got {value!r}") from err


def check_kernel_params(alpha: float, beta: float, lam: float | None = None) -> None:
    """Raise ValueError for (alpha, beta, lam) outside the family of Eq. 9 / Eq. 12 (lam=None: no tilt)."""
    for name, value in (("alpha", alpha), ("beta", beta), ("lam", lam)):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    if alpha != 1.0 and not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"beta must lie in [0, 1] for alpha != 1 (the power mean of Eq. 9 mixes behaviour and target "
            f"with weights 1 - beta and beta); got beta={beta} with alpha={alpha}"
        )
    if lam is not None and lam < 0.0:
        raise ValueError(
            f"lam must be >= 0 (the tilt of Eq. 12 controls variance only for lam >= 0), got {lam}"
        )


def log_power_mean_kernel(log_w, alpha: float, beta: float) -> jax.Array:
    """log phi0(W) of the power-mean kernel, Eq. 9 / App. A.1, from ``log_w`` (any shape).

    phi0(W) = [1 + beta (W^(alpha-1) - 1)]^(1/(alpha-1)), with the continuous alpha -> 1 limit
    W^beta (App. A.4). With z = (alpha - 1) log W the bracket is (1 - beta) + beta e^z; near z = 0 it
    is evaluated as log1p(beta expm1(z)) so that alpha close to 1 stays accurate, elsewhere as a
    logaddexp so that large |log W| cannot overflow.
    """
    alpha = _concrete_float("alpha", alpha)
    beta = _concrete_float("beta", beta)
    check_kernel_params(alpha, beta)
    log_w = _as_float_array(log_w)
    if alpha == 1.0:
        return beta * log_w
    if beta == 0.0:
        return jnp.zeros_like(log_w)
    if beta == 1.0:
        return log_w
    z = (alpha - 1.0) * log_w
    near_zero = jnp.abs(z) <= 1.0
    z_small = jnp.where(near_zero, z, 0.0)
    log_bracket_small = jnp.log1p(beta * jnp.expm1(z_small))
    log_bracket_large = jnp.logaddexp(math.log1p(-beta), math.log(beta) + z)
    log_bracket = jnp.where(near_zero, log_bracket_small, log_bracket_large)
    return log_bracket / (alpha - 1.0)


def power_mean_kernel(log_w, alpha: float, beta: float) -> jax.Array:
    """phi0(W), the unconstrained power-mean kernel of Eq. 9 (alpha -> 1: W^beta), same shape as ``log_w``."""
    return jnp.exp(log_power_mean_kernel(log_w, alpha, beta))


def _log_tilt(log_base: jax.Array, log_tilt_arg: jax.Array, lam: float) -> jax.Array:
    """log[base * exp(lam (1 - t))] with t = exp(log_tilt_arg), stable for any log_tilt_arg."""
    if lam == 0.0:
        return log_base
    capped = jnp.minimum(log_tilt_arg, _LOG_PHI0_CUTOFF)
    log_phi = log_base - lam * jnp.expm1(capped)
    return jnp.where(log_tilt_arg > _LOG_PHI0_CUTOFF, -jnp.inf, log_phi)


def log_reshaping_kernel(log_w, alpha: float, beta: float, lam: float) -> jax.Array:
    """log phi(W) of the reshaped kernel phi = phi0 exp(lam (1 - phi0)), Eq. 12; ``log_w`` any shape."""
    lam = _concrete_float("lam", lam)
    check_kernel_params(_concrete_float("alpha", alpha), _concrete_float("beta", beta), lam)
    log_phi0 = log_power_mean_kernel(log_w, alpha, beta)
    return _log_tilt(log_phi0, log_phi0, lam)


def reshaping_kernel(log_w, alpha: float, beta: float, lam: float) -> jax.Array:
    """phi(W) = phi0(W) exp(lam (1 - phi0(W))), Eq. 12: the power mean with an exponential variance tilt."""
    return jnp.exp(log_reshaping_kernel(log_w, alpha, beta, lam))


def _check_pair(name: str, value) -> tuple[float, float]:
    try:
        positive, negative = value
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a (positive-branch, negative-branch) pair, got {value!r}") from err
    return _concrete_float(f"{name}[0]", positive), _concrete_float(f"{name}[1]", negative)


def respo_kernel(
    log_w,
    advantages,
    alpha: tuple[float, float] = RESPO_ALPHA,
    beta: tuple[float, float] = RESPO_BETA,
    lam: tuple[float, float] = RESPO_LAMBDA,
) -> jax.Array:
    """ReSPO's two-branch kernel phi(W; A) (Eq. 12 per sign, §3.3.4-3.3.5).

    ``log_w`` and ``advantages`` broadcast together; tuples are (A >= 0 branch, A < 0 branch).
    Defaults give phi+(W) = (1 + W)/2 e^(1 - W) and phi-(W) = sqrt(W) e^(2 (1 - sqrt(W))). Both
    branches are evaluated and one is selected by the sign mask, as App. B describes.
    """
    alpha_pos, alpha_neg = _check_pair("alpha", alpha)
    beta_pos, beta_neg = _check_pair("beta", beta)
    lam_pos, lam_neg = _check_pair("lam", lam)
    log_w = _as_float_array(log_w)
    log_phi_pos = log_reshaping_kernel(log_w, alpha_pos, beta_pos, lam_pos)
    log_phi_neg = log_reshaping_kernel(log_w, alpha_neg, beta_neg, lam_neg)
    return jnp.exp(jnp.where(jnp.asarray(advantages) >= 0, log_phi_pos, log_phi_neg))


def log_vespo_branch(log_w, beta: float, lam: float) -> jax.Array:
    """log of VESPO's kernel W^beta e^(lam (1 - W)) (the tilt acts on W itself, not on W^beta)."""
    beta = _concrete_float("beta", beta)
    lam = _concrete_float("lam", lam)
    check_kernel_params(1.0, beta, lam)
    log_w = _as_float_array(log_w)
    return _log_tilt(beta * log_w, log_w, lam)


def vespo_kernel(
    log_w,
    advantages,
    beta: tuple[float, float] = VESPO_BETA,
    lam: tuple[float, float] = VESPO_LAMBDA,
) -> jax.Array:
    """VESPO's sign-specific kernel phi(W) = W^beta e^(lam (1 - W)).

    Defaults are the paper's Tab. 3: (beta, lam) = (2, 3) for A >= 0 and (3, 2) for A < 0.
    """
    beta_pos, beta_neg = _check_pair("beta", beta)
    lam_pos, lam_neg = _check_pair("lam", lam)
    log_w = _as_float_array(log_w)
    log_phi_pos = log_vespo_branch(log_w, beta_pos, lam_pos)
    log_phi_neg = log_vespo_branch(log_w, beta_neg, lam_neg)
    return jnp.exp(jnp.where(jnp.asarray(advantages) >= 0, log_phi_pos, log_phi_neg))


def sequence_log_ratio(
    logp, old_logp, mask, clamp: float = LOG_W_CLAMP, token_clamp: float | None = None
) -> jax.Array:
    """log W_i = sum_t mask (logp - old_logp) in float32, not length-normalized, clamped to +-clamp.

    logp, old_logp, mask: [batch, seq]  ->  log_w: [batch].
    ``token_clamp``: clamp each token's log-ratio to +-token_clamp before the sum (VESPO's code does this
    with 20; ReSPO's recipe sums the raw token log-ratios: None).
    Positions with mask == 0 are excluded with ``where`` (not multiplied by 0), so padding may hold any
    value, even inf, without leaking into W.
    """
    logp = jnp.asarray(logp).astype(jnp.float32)
    old_logp = jnp.asarray(old_logp).astype(jnp.float32)
    valid = jnp.asarray(mask) > 0
    token_log_ratio = logp - old_logp
    if token_clamp is not None:
        token_log_ratio = jnp.clip(token_log_ratio, -token_clamp, token_clamp)
    log_w = jnp.sum(jnp.where(valid, token_log_ratio, 0.0), axis=-1)
    return jnp.clip(log_w, -clamp, clamp)
