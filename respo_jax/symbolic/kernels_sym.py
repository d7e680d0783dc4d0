"""SymPy closed forms of the reshaping kernels (paper §3.3, Eqs. 9 and 12; VESPO's kernel).

These are the expressions the claims in `claims.py` are proved about and that `bridge.py` lambdifies
to check the JAX kernels, so the code that is trained with and the formulas that are proved are the
same formulas. Every function takes SymPy expressions (or numbers) and returns a SymPy expression.
"""

from __future__ import annotations

import sympy as sp

# The sequence importance weight W = π(o)/μ(o) > 0 and its logarithm x = log W ∈ ℝ.
W = sp.Symbol("W", positive=True)
LOG_W = sp.Symbol("x", real=True)

# Paper Tab. 3: ReSPO (α, β, λ) per advantage sign, and VESPO (β, λ) per sign.
RESPO_POSITIVE = {"alpha": sp.Integer(2), "beta": sp.Rational(1, 2), "lam": sp.Integer(2)}
RESPO_NEGATIVE = {"alpha": sp.Integer(1), "beta": sp.Rational(1, 2), "lam": sp.Integer(2)}
VESPO_POSITIVE = {"beta": sp.Integer(2), "lam": sp.Integer(3)}
VESPO_NEGATIVE = {"beta": sp.Integer(3), "lam": sp.Integer(2)}


def alpha_bregman_generator(x, alpha):
    """f_α(x) = x^α / (α(α−1)), the generator of the α-Bregman divergence (App. A.1)."""
    return x**alpha / (alpha * (alpha - 1))


def kl_generator(x):
    """f(x) = x log x − x, the generator whose Bregman divergence is the (generalized) KL."""
    return x * sp.log(x) - x


def bregman_divergence(generator, p, q):
    """D_f(p‖q) = f(p) − f(q) − f′(q)(p − q) for one outcome (the summand of §3.3.2's D_f).

    `generator` maps a SymPy expression to f(expression).
    """
    x = sp.Dummy("x", positive=True)
    f_prime = sp.diff(generator(x), x)
    return generator(p) - generator(q) - f_prime.subs(x, q) * (p - q)


def power_mean_kernel(w, alpha, beta):
    """φ₀(W) = [1 + β(W^(α−1) − 1)]^(1/(α−1)) (Eq. 9), extended by W^β at α = 1 (App. A.4).

    With a symbolic α the general form is returned (valid for α ≠ 1); the α → 1 continuity is a
    claim proved in `claims.py`, not an assumption of this function.
    """
    alpha, beta = sp.sympify(alpha), sp.sympify(beta)  # keep exact rationals (no 1/(2-1) == 1.0)
    if alpha == 1:
        return w**beta
    return (1 + beta * (w ** (alpha - 1) - 1)) ** (sp.S.One / (alpha - 1))


def exponential_tilt(phi0, lam):
    """φ = φ₀·exp(λ(1 − φ₀)) — the KL projection of φ₀ under the moment constraints (Eq. 12)."""
    return phi0 * sp.exp(lam * (1 - phi0))


def reshaping_kernel(w, alpha, beta, lam):
    """The general (α, β, λ) ReSPO kernel φ(W) of Eq. 12."""
    return exponential_tilt(power_mean_kernel(w, alpha, beta), lam)


def respo_positive(w=W):
    """φ⁺(W) = (1+W)/2 · e^(1−W): Eq. 12 at α=2, β=½, λ=2 (§3.3.5)."""
    return reshaping_kernel(w, **RESPO_POSITIVE)


def respo_negative(w=W):
    """φ⁻(W) = √W · e^(2(1−√W)): Eq. 12 at α=1, β=½, λ=2 (§3.3.5)."""
    return reshaping_kernel(w, **RESPO_NEGATIVE)


def vespo_kernel(w, beta, lam):
    """VESPO's kernel W^β·e^(λ(1−W)) (Shen et al., 2026; §2)."""
    return w**beta * sp.exp(lam * (1 - w))
