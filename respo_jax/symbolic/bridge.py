"""Bridge from the proved closed forms to the JAX kernels of `respo_jax.objectives.kernels`.

The claims in `claims.py` are about the SymPy expressions of `kernels_sym.py`. This module lambdifies
those same expressions (NumPy, float64) and checks that the float32 JAX kernels compute them on a grid
of log W ∈ [−20, 20] (the clamp of App. B), for ReSPO, VESPO and the general (α, β, λ) family — so the
proved formulas are the trained ones.

Tolerance. A float32 kernel cannot be more accurate than float32 rounding amplified by the problem's
condition number, so each point must satisfy |φ₃₂ − φ₆₄| ≤ ATOL + RTOL·κ(x)·|φ₆₄| with
κ(x) = 1 + |log φ| + |x·d log φ/dx| taken from the symbolic expression (rounding of log φ before its
final exp, and of the products (α−1)·x, λ·W inside it). RTOL = 4e-6 is ≈ 32 float32 ulps per unit of
κ; ATOL = 1e-30 only absorbs values that underflow float32. The measured errors are ≈ 2 ulps·κ, and
a change of λ, β or α in the third digit, or a swapped branch, exceeds the bound by orders of magnitude.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np
import sympy as sp

from respo_jax.symbolic import kernels_sym as ks
from respo_jax.symbolic.claims import Claim

LOG_W_GRID = np.linspace(-20.0, 20.0, 4001, dtype=np.float32)  # [n] float32, step 0.01
RTOL = 4e-6
ATOL = 1e-30
# The reported (not tested) plain relative error is taken where float32 still has full relative
# precision after the kernel's intermediate products, i.e. away from underflow.
REL_ERR_FLOOR = 1e-20
# (α, β, λ) points of the general family: both tail regimes (α < 1, α > 1), the α = 1 extension with
# β > 1 (allowed there), λ = 0 (no tilt), and ReSPO's own points. All values are exact in binary.
FAMILY_POINTS: tuple[tuple[float, float, float], ...] = (
    (2.0, 0.5, 2.0),
    (1.0, 0.5, 2.0),
    (0.5, 0.5, 1.0),
    (0.5, 0.875, 3.0),
    (1.5, 0.25, 0.5),
    (3.0, 0.75, 3.0),
    (1.0, 3.0, 2.0),
    (2.0, 0.5, 0.0),
)
# Advantage rows used for the two-branch kernels: A ≥ 0 selects φ⁺ (A = 0 included), A < 0 selects φ⁻.
POSITIVE_ADVANTAGES = (1.0, 1e-6, 0.0)
NEGATIVE_ADVANTAGES = (-1e-6, -1.0)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One JAX-vs-closed-form comparison over the grid; `ok` iff finite and within tolerance everywhere."""

    label: str
    max_rel_err: float  # max |a − r|/magnitude where magnitude > REL_ERR_FLOOR (reported, not the criterion)
    max_err_over_tol: float  # max |a − r| / (ATOL + RTOL·κ·|r|); ≤ 1 passes
    nonfinite: int  # points where the JAX value is NaN/inf

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.max_err_over_tol <= 1.0

    def summary(self) -> str:
        return (
            f"{self.label}: max rel err {self.max_rel_err:.1e}, max err/tol {self.max_err_over_tol:.2g}"
            + (f", {self.nonfinite} non-finite" if self.nonfinite else "")
        )


@dataclasses.dataclass(frozen=True)
class Reference:
    """float64 NumPy functions of x = log W lambdified from one SymPy kernel φ(W)."""

    value: Callable[[np.ndarray], np.ndarray]  # φ(e^x)
    slope: Callable[[np.ndarray], np.ndarray]  # dφ/dx
    log_value: Callable[[np.ndarray], np.ndarray]  # log φ(e^x), finite where φ underflows
    log_slope: Callable[[np.ndarray], np.ndarray]  # d log φ / dx

    def kappa(self, x: np.ndarray) -> np.ndarray:
        """Condition number κ(x) = 1 + |log φ| + |x·d log φ/dx| of the float32 evaluation."""
        return 1.0 + np.abs(self.log_value(x)) + np.abs(x * self.log_slope(x))


@functools.lru_cache(maxsize=None)
def reference(expr_in_w: sp.Expr) -> Reference:
    """Lambdify φ(W) (a SymPy expression in `kernels_sym.W`) as float64 functions of x = log W."""
    x = ks.LOG_W
    phi = expr_in_w.subs(ks.W, sp.exp(x))
    # All factors are positive for W > 0 (β ∈ [0, 1] when α ≠ 1), so splitting the log is exact.
    log_phi = sp.expand_log(sp.log(phi), force=True)

    def vectorized(expr):
        fn = sp.lambdify(x, expr, "numpy")
        return lambda v: np.broadcast_to(np.asarray(fn(np.asarray(v, np.float64)), np.float64), np.shape(v))

    return Reference(
        value=vectorized(phi),
        slope=vectorized(sp.diff(phi, x)),
        log_value=vectorized(log_phi),
        log_slope=vectorized(sp.diff(log_phi, x)),
    )


def compare(
    label: str, actual, expected: np.ndarray, scale: np.ndarray, magnitude: np.ndarray | None = None
) -> Comparison:
    """Compare `actual` (JAX, any float dtype) with `expected` (float64); tolerance ATOL + RTOL·scale.

    actual, expected, scale, magnitude: same shape. The reported relative error divides by
    `magnitude` (default |expected|), the size the error should be judged against.
    """
    actual = np.asarray(actual, np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"{label}: JAX kernel returned shape {actual.shape}; expected {expected.shape}")
    finite = np.isfinite(actual)
    err = np.abs(np.where(finite, actual, 0.0) - expected)
    magnitude = np.abs(expected) if magnitude is None else np.asarray(magnitude)
    significant = magnitude > REL_ERR_FLOOR
    rel = err[significant] / magnitude[significant]
    return Comparison(
        label=label,
        max_rel_err=float(rel.max()) if rel.size else 0.0,
        max_err_over_tol=float(np.max(err / (ATOL + RTOL * scale))),
        nonfinite=int(np.sum(~finite)),
    )


def _compare_values(label: str, actual, expr_in_w: sp.Expr, log_w: np.ndarray) -> Comparison:
    ref = reference(expr_in_w)
    x = log_w.astype(np.float64)  # the exact float32 grid values, so input rounding is not an error
    expected = ref.value(x)
    return compare(label, actual, expected, ref.kappa(x) * np.abs(expected))


def _objectives_kernels():
    from respo_jax.objectives import kernels  # imported lazily: the SymPy claims need no JAX

    return kernels


def _exact(value: float) -> sp.Rational:
    return sp.Rational(value)  # exact for the binary fractions used here


def check_power_mean_family(
    kernel=None, points: Sequence[tuple[float, float, float]] = FAMILY_POINTS
) -> list[Comparison]:
    """`power_mean_kernel(log_w, α, β)` vs Eq. 9 at each (α, β) of `points`."""
    kernel = kernel or _objectives_kernels().power_mean_kernel
    import jax.numpy as jnp

    seen, out = set(), []
    for alpha, beta, _ in points:
        if (alpha, beta) in seen:
            continue
        seen.add((alpha, beta))
        actual = kernel(jnp.asarray(LOG_W_GRID), alpha, beta)
        expr = ks.power_mean_kernel(ks.W, _exact(alpha), _exact(beta))
        out.append(_compare_values(f"φ₀(α={alpha}, β={beta})", actual, expr, LOG_W_GRID))
    return out


def check_reshaping_family(
    kernel=None, points: Sequence[tuple[float, float, float]] = FAMILY_POINTS
) -> list[Comparison]:
    """`reshaping_kernel(log_w, α, β, λ)` vs Eq. 12 at each point of `points`."""
    kernel = kernel or _objectives_kernels().reshaping_kernel
    import jax.numpy as jnp

    out = []
    for alpha, beta, lam in points:
        actual = kernel(jnp.asarray(LOG_W_GRID), alpha, beta, lam)
        expr = ks.reshaping_kernel(ks.W, _exact(alpha), _exact(beta), _exact(lam))
        out.append(_compare_values(f"φ(α={alpha}, β={beta}, λ={lam})", actual, expr, LOG_W_GRID))
    return out


def check_two_branch(
    kernel, positive: sp.Expr, negative: sp.Expr, name: str
) -> tuple[list[Comparison], list[Comparison]]:
    """One call `kernel(log_w [1, n], advantages [k, 1]) -> [k, n]` with mixed signs; each row is
    compared with φ⁺ (A ≥ 0) or φ⁻ (A < 0). Returns (positive-row comparisons, negative-row ones)."""
    import jax.numpy as jnp

    advantages = np.array(POSITIVE_ADVANTAGES + NEGATIVE_ADVANTAGES, np.float32)[:, None]  # [k, 1]
    actual = np.asarray(kernel(jnp.asarray(LOG_W_GRID)[None, :], jnp.asarray(advantages)))
    expected_shape = (advantages.shape[0], LOG_W_GRID.shape[0])
    if actual.shape != expected_shape:
        raise ValueError(f"{name}: kernel returned shape {actual.shape}; expected {expected_shape}")
    rows = [
        _compare_values(
            f"{name}(A={a:g}) vs {'φ⁺' if a >= 0 else 'φ⁻'}",
            actual[i],
            positive if a >= 0 else negative,
            LOG_W_GRID,
        )
        for i, a in enumerate(advantages[:, 0])
    ]
    n_pos = len(POSITIVE_ADVANTAGES)
    return rows[:n_pos], rows[n_pos:]


def check_respo(kernel=None) -> tuple[list[Comparison], list[Comparison]]:
    """`respo_kernel` with its defaults vs φ⁺ = (1+W)/2·e^(1−W) and φ⁻ = √W·e^(2(1−√W))."""
    kernel = kernel or _objectives_kernels().respo_kernel
    return check_two_branch(kernel, ks.respo_positive(), ks.respo_negative(), "respo_kernel")


def check_vespo(kernel=None) -> tuple[list[Comparison], list[Comparison]]:
    """`vespo_kernel` with its defaults vs W^β e^(λ(1−W)) at (β, λ)⁺ = (2, 3), (β, λ)⁻ = (3, 2)."""
    kernel = kernel or _objectives_kernels().vespo_kernel
    return check_two_branch(
        kernel,
        ks.vespo_kernel(ks.W, **ks.VESPO_POSITIVE),
        ks.vespo_kernel(ks.W, **ks.VESPO_NEGATIVE),
        "vespo_kernel",
    )


def check_respo_slopes(kernel=None) -> list[Comparison]:
    """jax.grad of `respo_kernel` w.r.t. log W vs the symbolic dφ/dx on the grid, per branch, and the
    matched on-policy slope dφ±/dx(0) = W·dφ±/dW(1) = −½ (claim 8)."""
    import jax
    import jax.numpy as jnp

    kernel = kernel or _objectives_kernels().respo_kernel
    x = LOG_W_GRID.astype(np.float64)
    out = []
    for sign, expr, label in (
        (1.0, ks.respo_positive(), "dφ⁺/dlogW"),
        (-1.0, ks.respo_negative(), "dφ⁻/dlogW"),
    ):
        ref = reference(expr)

        def branch(log_w, sign=sign):
            return kernel(log_w, jnp.float32(sign))

        grads = jax.vmap(jax.grad(branch))(jnp.asarray(LOG_W_GRID))
        # dφ/dx = φ·d log φ/dx: errors are judged against |φ|(1 + |d log φ/dx|), times κ for the bound.
        magnitude = np.abs(ref.value(x)) * (1.0 + np.abs(ref.log_slope(x)))
        out.append(compare(label, grads, ref.slope(x), ref.kappa(x) * magnitude, magnitude))
        at_one = np.asarray(jax.grad(branch)(jnp.float32(0.0)))[None]
        out.append(compare(f"{label} at W=1 vs −½", at_one, np.array([-0.5]), np.array([1.0])))
    return out


def _bridge_claim(name: str, statement: str, run: Callable[[], list[Comparison]]) -> Claim:
    comparisons = run()
    proved = bool(comparisons) and all(c.ok for c in comparisons)
    detail = "\n".join(c.summary() + (" [ok]" if c.ok else " [FAILED]") for c in comparisons)
    return Claim(name, statement, proved, detail)


_GRID_TEXT = f"{LOG_W_GRID.size} float32 points of log W ∈ [−20, 20], |err| ≤ {ATOL:g} + {RTOL:g}·κ·|φ|"


def bridge_power_mean_family(kernel=None) -> Claim:
    return _bridge_claim(
        "bridge_power_mean_family",
        f"objectives.kernels.power_mean_kernel equals Eq. 9 for (α, β) ∈ "
        f"{sorted({p[:2] for p in FAMILY_POINTS})} on {_GRID_TEXT}",
        lambda: check_power_mean_family(kernel),
    )


def bridge_reshaping_family(kernel=None) -> Claim:
    return _bridge_claim(
        "bridge_reshaping_family",
        f"objectives.kernels.reshaping_kernel equals Eq. 12 for (α, β, λ) ∈ {list(FAMILY_POINTS)} "
        f"on {_GRID_TEXT}",
        lambda: check_reshaping_family(kernel),
    )


def bridge_respo_positive(kernel=None) -> Claim:
    return _bridge_claim(
        "bridge_respo_positive",
        f"respo_kernel(log_w, A ≥ 0) equals φ⁺ = (1+W)/2·e^(1−W) on {_GRID_TEXT}",
        lambda: check_respo(kernel)[0],
    )


def bridge_respo_negative(kernel=None) -> Claim:
    return _bridge_claim(
        "bridge_respo_negative",
        f"respo_kernel(log_w, A < 0) equals φ⁻ = √W·e^(2(1−√W)) on {_GRID_TEXT}",
        lambda: check_respo(kernel)[1],
    )


def bridge_vespo_positive(kernel=None) -> Claim:
    return _bridge_claim(
        "bridge_vespo_positive",
        f"vespo_kernel(log_w, A ≥ 0) equals W²·e^(3(1−W)) on {_GRID_TEXT}",
        lambda: check_vespo(kernel)[0],
    )


def bridge_vespo_negative(kernel=None) -> Claim:
    return _bridge_claim(
        "bridge_vespo_negative",
        f"vespo_kernel(log_w, A < 0) equals W³·e^(2(1−W)) on {_GRID_TEXT}",
        lambda: check_vespo(kernel)[1],
    )


def bridge_respo_slopes(kernel=None) -> Claim:
    return _bridge_claim(
        "bridge_respo_slopes",
        "jax.grad of respo_kernel w.r.t. log W equals the symbolic dφ±/dlogW on the grid,"
        " and both are −½ at W = 1",
        lambda: check_respo_slopes(kernel),
    )


BRIDGE_CLAIMS: tuple[Callable[[], Claim], ...] = (
    bridge_power_mean_family,
    bridge_reshaping_family,
    bridge_respo_positive,
    bridge_respo_negative,
    bridge_vespo_positive,
    bridge_vespo_negative,
    bridge_respo_slopes,
)
