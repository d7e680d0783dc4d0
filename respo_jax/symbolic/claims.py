"""Symbolic proofs of the paper's derivation claims (§3.3 and App. A), one function per claim.

Every claim is established by exact symbolic manipulation (diff / solve / simplify / limit / series)
on symbols whose assumptions are stated where they are created — never by evaluating at sampled
numbers (in particular `Expr.equals`, which falls back to random numeric points, is not used).
Each function returns a `Claim` whose `detail` lists the proof steps and which of them held, so a
failed claim says which step broke. Claims whose statement fixes a hyperparameter take it as a
keyword argument defaulting to the paper's value (Tab. 3), so a wrong value can be shown to fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy as sp

from respo_jax.symbolic import kernels_sym as ks


@dataclasses.dataclass(frozen=True)
class Claim:
    """The outcome of one claim: `proved` is True only if every proof step held.

    `detail` has one line per proof step (or per bridge comparison), each ending in [ok] or [FAILED].
    """

    name: str
    statement: str
    proved: bool
    detail: str


class _Proof:
    """Collects named proof steps; the claim is proved iff all of them hold."""

    def __init__(self, name: str, statement: str):
        self.name = name
        self.statement = statement
        self.steps: list[tuple[str, bool]] = []

    def step(self, description: str, fact) -> bool:
        ok = holds(fact)
        self.steps.append((description, ok))
        return ok

    def result(self) -> Claim:
        proved = bool(self.steps) and all(ok for _, ok in self.steps)
        detail = "\n".join(f"{d} [{'ok' if ok else 'FAILED'}]" for d, ok in self.steps)
        return Claim(self.name, self.statement, proved, detail)


def holds(value) -> bool:
    """True only for a definite truth (Python True or SymPy's true); None (unknown) is not a proof."""
    return value is True or value is sp.true


def _is_zero(expr) -> bool:
    """Exact test that `expr` simplifies to 0 (structural after simplification; no sampling)."""
    return sp.simplify(sp.sympify(expr)) == 0


def _same(a, b) -> bool:
    return _is_zero(sp.sympify(a) - sp.sympify(b))


# ---------------------------------------------------------------------------------------------
# Symbols and their assumptions (stated once, used by the claims below).
# ---------------------------------------------------------------------------------------------
W = ks.W  # importance weight W = π/μ, W > 0
W_REAL = sp.Symbol("W", real=True)  # the affine positive kernel extended to the real line (App. A.3)
MU = sp.Symbol("mu", positive=True)  # behaviour mass μ(o) > 0
PI = sp.Symbol("pi", positive=True)  # target mass π(o) > 0
TAU = sp.Symbol("tau", positive=True)  # reshaped (unnormalized) mass τ(o) > 0
# β ∈ (0, 1) is encoded as two positive symbols β, β̄ with β̄ = 1 − β, so SymPy knows both
# interpolation weights are positive; the relation β + β̄ = 1 is imposed where it is used.
BETA = sp.Symbol("beta", positive=True)
BETA_BAR = sp.Symbol("betabar", positive=True)
ALPHA = sp.Symbol("alpha", positive=True)
# α − 1 = s, real and nonzero (α ≠ 1), so x^(1/s) is a real power of a positive base.
S = sp.Symbol("s", real=True, nonzero=True)
S_POS = sp.Symbol("s", positive=True)  # α = 1 + s > 1, or α = 1 − s < 1 (with 0 < s < 1)
LAM = sp.Symbol("lambda", positive=True)  # tilt strength λ > 0
LAM_NN = sp.Symbol("lambda", nonnegative=True)  # KKT multiplier of an inequality constraint, λ ≥ 0
GAMMA = sp.Symbol("gamma", real=True)  # multiplier of the mass constraint
PHI0_NN = sp.Symbol("phi_0", nonnegative=True)  # φ₀ value, φ₀ ≥ 0


def claim_power_mean_first_order_condition() -> Claim:
    """Claim 1 (App. A.1, Eq. 9): the α-Bregman objective's minimizer is the power mean."""
    proof = _Proof(
        "power_mean_first_order_condition",
        "argmin_τ (1−β)D_f(τ‖μ) + βD_f(τ‖π), f(x)=x^α/(α(α−1)), is τ₀=[(1−β)μ^(α−1)+βπ^(α−1)]^(1/(α−1)),"
        " i.e. φ₀(W)=τ₀/μ=[1+β(W^(α−1)−1)]^(1/(α−1))",
    )
    alpha = 1 + S

    def f(x):
        return ks.alpha_bregman_generator(x, alpha)

    objective = BETA_BAR * ks.bregman_divergence(f, TAU, MU) + BETA * ks.bregman_divergence(f, TAU, PI)
    grad = sp.diff(objective, TAU)
    # τ ↦ u = τ^s is a bijection of (0, ∞) for s ≠ 0, and the first-order condition is linear in u.
    u = sp.Symbol("u", positive=True)
    grad_u = sp.powdenest(grad.subs(TAU, u ** (1 / S)))
    roots = sp.solve(grad_u, u)
    proof.step("first-order condition is linear in u=τ^(α−1) with one root", len(roots) == 1)
    u_star = roots[0] if roots else sp.nan
    paper_u = (1 - BETA) * MU**S + BETA * PI**S
    proof.step(
        "with β̄=1−β the root is u*=(1−β)μ^(α−1)+βπ^(α−1)", _same(u_star.subs(BETA_BAR, 1 - BETA), paper_u)
    )
    curvature = sp.simplify(sp.diff(objective, TAU, 2))
    proof.step(
        f"d²/dτ² = {curvature} > 0: strictly convex, so the root is the unique minimizer",
        curvature.is_positive,
    )
    # φ₀ = τ₀/μ with π = Wμ; compare logarithms (all bases positive, exponents real).
    tau0 = u_star ** (1 / S)
    phi0 = tau0.subs(PI, W * MU) / MU
    phi0_weights = ((BETA_BAR + BETA * W**S) / (BETA_BAR + BETA)) ** (1 / S)
    log_gap = sp.expand_log(sp.log(phi0), force=False) - sp.expand_log(sp.log(phi0_weights), force=False)
    proof.step(
        "τ₀/μ at π=Wμ equals [(β̄+βW^(α−1))/(β̄+β)]^(1/(α−1))", _is_zero(sp.expand_log(sp.factor(log_gap)))
    )
    proof.step(
        "with β̄=1−β this is ks.power_mean_kernel (Eq. 9)",
        _same(phi0_weights.subs(BETA_BAR, 1 - BETA), ks.power_mean_kernel(W, alpha, BETA)),
    )
    return proof.result()


def claim_alpha_to_one_limit() -> Claim:
    """Claim 2 (App. A.4, §3.3.2): α → 1 gives W^β, the KL generator's geometric mixture."""
    proof = _Proof(
        "alpha_to_one_limit",
        "lim_{α→1} φ₀(W) = W^β, and the KL generator's first-order condition gives τ=μ^(1−β)π^β (φ=W^β)",
    )
    phi0 = ks.power_mean_kernel(W, ALPHA, BETA)
    log_limit = sp.limit(sp.log(1 + BETA * (W ** (ALPHA - 1) - 1)) / (ALPHA - 1), ALPHA, 1)
    proof.step(f"lim_(α→1) log φ₀ = {log_limit} = β log W", _same(log_limit, BETA * sp.log(W)))
    proof.step("lim_(α→1) φ₀ = W^β", _same(sp.limit(phi0, ALPHA, 1), W**BETA))
    proof.step(
        "ks.power_mean_kernel at α=1 is W^β (the continuous extension)",
        _same(ks.power_mean_kernel(W, 1, BETA), W**BETA),
    )
    x = sp.Symbol("x", positive=True)
    generator_limit = sp.limit(ks.alpha_bregman_generator(x, ALPHA) - x / (ALPHA - 1), ALPHA, 1)
    proof.step(
        "f_α(x) − x/(α−1) (same Bregman divergence: affine terms cancel) → x log x − x, the KL generator",
        _same(generator_limit, ks.kl_generator(x)),
    )
    objective = BETA_BAR * ks.bregman_divergence(ks.kl_generator, TAU, MU) + BETA * ks.bregman_divergence(
        ks.kl_generator, TAU, PI
    )
    roots = sp.solve(sp.diff(objective, TAU), TAU)
    proof.step("KL first-order condition has one root", len(roots) == 1)
    tau_star = roots[0].subs(BETA_BAR, 1 - BETA) if roots else sp.nan
    proof.step("root is the geometric mixture μ^(1−β)π^β", _same(tau_star, MU ** (1 - BETA) * PI**BETA))
    proof.step(
        "KL objective strictly convex (d²/dτ² > 0)", sp.simplify(sp.diff(objective, TAU, 2)).is_positive
    )
    proof.step(
        "φ_KL = τ/μ at π=Wμ is W^β",
        _same(sp.powsimp(sp.expand_power_base(tau_star.subs(PI, W * MU) / MU)), W**BETA),
    )
    return proof.result()


def claim_kl_projection_exponential_tilt() -> Claim:
    """Claim 3 (App. A.2, Eq. 12): KL projection under the moment constraints is an exponential tilt."""
    proof = _Proof(
        "kl_projection_exponential_tilt",
        "argmin D_KL(τ‖τ₀) s.t. Στφ₀ ≤ C1, Στ ≤ C2 gives φ = φ₀·exp(λ(1−φ₀)) (normalized by φ(1)=1),"
        " and E_μ[φ²] = Στφ ≤ e^λ Στφ₀ for φ₀ ≥ 0, λ ≥ 0",
    )
    tau0 = sp.Symbol("tau_0", positive=True)
    phi0 = sp.Symbol("phi_0", positive=True)
    c1, c2 = sp.symbols("C_1 C_2", real=True)
    # Pointwise Lagrangian: generalized KL for unnormalized measures + multipliers λ ≥ 0, γ.
    lagrangian = TAU * sp.log(TAU / tau0) - TAU + tau0 + LAM_NN * (TAU * phi0 - c1) + GAMMA * (TAU - c2)
    roots = sp.solve(sp.diff(lagrangian, TAU), TAU)
    proof.step("first-order condition has one root", len(roots) == 1)
    tau_star = roots[0] if roots else sp.nan
    proof.step("root is τ* = τ₀·exp(−λφ₀ − γ)", _same(tau_star, tau0 * sp.exp(-LAM_NN * phi0 - GAMMA)))
    proof.step("d²/dτ² = 1/τ > 0: strictly convex", sp.diff(lagrangian, TAU, 2).is_positive)
    # φ = τ*/μ with τ₀ = μφ₀; φ₀(1) = 1 for every (α, β) fixes γ through the on-policy normalization φ(1) = 1.
    phi = sp.simplify(tau_star.subs(tau0, MU * phi0) / MU)
    proof.step("φ₀(1) = 1 for all α ≠ 1, β", _same(ks.power_mean_kernel(1, 1 + S, BETA), 1))
    gammas = sp.solve(sp.Eq(phi.subs(phi0, 1), 1), GAMMA)
    proof.step(f"φ(1)=1 gives γ = {gammas}", len(gammas) == 1 and _same(gammas[0], -LAM_NN))
    tilted = phi.subs(GAMMA, gammas[0] if gammas else sp.nan)
    proof.step("φ = φ₀·exp(λ(1−φ₀)) (ks.exponential_tilt)", _same(tilted, ks.exponential_tilt(phi0, LAM_NN)))
    # Proxy bound. E_μ[φ²] = Σ μφ² = Σ (μφ)φ = Σ τφ, since τ = μφ.
    phi_sym = sp.Symbol("phi", nonnegative=True)
    proof.step("μφ² = τφ with τ = μφ", _same(MU * phi_sym**2, (MU * phi_sym) * phi_sym))
    # Pointwise e^λφ₀ − φ = e^λφ₀(1 − e^(−λφ₀)), and each factor is ≥ 0.
    phi_nn = ks.exponential_tilt(PHI0_NN, LAM_NN)
    z = sp.Symbol("z", nonnegative=True)
    gap = sp.exp(LAM_NN) * PHI0_NN - phi_nn
    factored = sp.exp(LAM_NN) * PHI0_NN * (1 - sp.exp(-z))
    proof.step("e^λφ₀ − φ = e^λφ₀·(1 − e^(−z)) at z = λφ₀", _same(gap, factored.subs(z, LAM_NN * PHI0_NN)))
    proof.step("z = λφ₀ ≥ 0", (LAM_NN * PHI0_NN).is_nonnegative)
    h = 1 - sp.exp(-z)
    proof.step(
        "h(z) = 1 − e^(−z): h(0) = 0 and h′(z) = e^(−z) > 0, so h ≥ 0 on z ≥ 0",
        _is_zero(h.subs(z, 0)) and sp.diff(h, z).is_positive,
    )
    tau_nn = sp.Symbol("tau", nonnegative=True)
    proof.step(
        "τ·e^λ·φ₀ ≥ 0, so τ(e^λφ₀ − φ) = τe^λφ₀·h(λφ₀) ≥ 0 termwise and Στφ ≤ e^λΣτφ₀",
        (tau_nn * sp.exp(LAM_NN) * PHI0_NN).is_nonnegative,
    )
    return proof.result()


def claim_alpha_two_affine() -> Claim:
    """Claim 4 (§3.3.5): at α = 2 the power mean is affine in W."""
    proof = _Proof("alpha_two_affine", "α=2 gives φ₀⁺(W) = (1−β) + βW; β=½ gives the arithmetic mean (1+W)/2")
    proof.step(
        "φ₀(W; α=2) = (1−β) + βW", _same(ks.power_mean_kernel(W_REAL, 2, BETA), (1 - BETA) + BETA * W_REAL)
    )
    proof.step(
        "β=½: φ₀⁺ = (1+W)/2",
        _same(ks.power_mean_kernel(W_REAL, 2, sp.Rational(1, 2)), (1 + W_REAL) / 2),
    )
    proof.step(
        "φ₀ is affine: d²φ₀/dW² = 0", _is_zero(sp.diff(ks.power_mean_kernel(W_REAL, 2, BETA), W_REAL, 2))
    )
    return proof.result()


def claim_positive_stationary_maximum(beta_plus=sp.Rational(1, 2), lam_plus=sp.Integer(2)) -> Claim:
    """Claim 5 (§3.3.5, App. A.3): φ⁺′(0)=0 fixes λ⁺ = 1/(1−β⁺); W=0 is then the maximum on ℝ."""
    proof = _Proof(
        "positive_stationary_maximum",
        "φ⁺′(0) = 0 ⇔ λ⁺ = 1/(1−β⁺), = 2 at β⁺ = ½; W = 0 is the unique maximum of φ⁺ on the real line",
    )
    lam = sp.Symbol("lambda", real=True)
    phi_general = ks.reshaping_kernel(W_REAL, 2, BETA, lam)
    slope0 = sp.diff(phi_general, W_REAL).subs(W_REAL, 0)
    roots = sp.solve(slope0, lam)
    proof.step(f"φ⁺′(0) = 0 ⇔ λ ∈ {roots}", len(roots) == 1 and _same(roots[0], 1 / (1 - BETA)))
    # For any β ∈ (0,1) with λ = 1/(1−β): φ⁺′(W) = −(β²/β̄)·W·exp(·), so the sign is that of −W.
    phi0 = BETA_BAR + BETA * W_REAL  # the affine φ₀⁺ with β̄ = 1 − β (claim 4)
    slope = sp.diff(ks.exponential_tilt(phi0, 1 / BETA_BAR), W_REAL)
    positive_factor = sp.simplify(slope / (-W_REAL))
    proof.step(
        "with λ=1/(1−β): φ⁺′(W) = −W·c(W) with c(W) > 0 for every real W (β ∈ (0,1))",
        positive_factor.is_positive and _same(slope, -W_REAL * positive_factor),
    )
    lam_half = roots[0].subs(BETA, beta_plus) if roots else sp.nan
    proof.step(
        f"at β⁺ = {beta_plus}: λ⁺ = {lam_half} equals the chosen λ⁺ = {lam_plus}", _same(lam_half, lam_plus)
    )
    phi_plus = ks.reshaping_kernel(W_REAL, 2, beta_plus, lam_plus)
    slope_plus = sp.diff(phi_plus, W_REAL)
    stationary = sp.solveset(slope_plus, W_REAL, sp.S.Reals)
    proof.step(f"φ⁺′(W) = 0 on ℝ only at {stationary}", stationary == sp.FiniteSet(0))
    w_neg = sp.Symbol("w", negative=True)
    w_pos = sp.Symbol("w", positive=True)
    proof.step(
        "φ⁺′ > 0 for W < 0 and φ⁺′ < 0 for W > 0 (so W=0 is the global maximum on ℝ)",
        sp.simplify(slope_plus.subs(W_REAL, w_neg)).is_positive
        and sp.simplify(slope_plus.subs(W_REAL, w_pos)).is_negative,
    )
    return proof.result()


def claim_positive_branch_shape() -> Claim:
    """Claim 6 (§3.3.5): φ⁺(0) = e/2, φ⁺ strictly decreasing on W > 0, φ⁺(∞) = 0."""
    proof = _Proof(
        "positive_branch_shape", "φ⁺(W) = (1+W)/2·e^(1−W): φ⁺(0) = e/2, φ⁺′ < 0 for W > 0, φ⁺(∞) = 0"
    )
    phi_plus = ks.respo_positive(W)
    proof.step("φ⁺ = (1+W)/2·e^(1−W)", _same(phi_plus, (1 + W) / 2 * sp.exp(1 - W)))
    proof.step("φ⁺(0) = e/2", _same(phi_plus.subs(W, 0), sp.E / 2))
    slope = sp.simplify(sp.diff(phi_plus, W))
    proof.step(f"φ⁺′(W) = {slope} < 0 for W > 0", slope.is_negative)
    proof.step("lim_(W→∞) φ⁺ = 0", _same(sp.limit(phi_plus, W, sp.oo), 0))
    return proof.result()


def claim_negative_branch_shape(beta_minus=sp.Rational(1, 2), lam_minus=sp.Integer(2)) -> Claim:
    """Claim 7 (§3.3.5): φ⁻ vanishes at both tails and peaks at W* = ¼ with value e/2."""
    proof = _Proof(
        "negative_branch_shape",
        "φ⁻(W) = √W·e^(2(1−√W)): φ⁻(0) = φ⁻(∞) = 0, unique peak at W* = ¼ with φ⁻(¼) = e/2",
    )
    phi_minus = ks.reshaping_kernel(W, 1, beta_minus, lam_minus)
    proof.step("lim_(W→0⁺) φ⁻ = 0", _same(sp.limit(phi_minus, W, 0, "+"), 0))
    proof.step("lim_(W→∞) φ⁻ = 0", _same(sp.limit(phi_minus, W, sp.oo), 0))
    stationary = sp.solveset(sp.diff(phi_minus, W), W, sp.Interval.open(0, sp.oo))
    quarter = sp.Rational(1, 4)
    proof.step(f"φ⁻′(W) = 0 on W > 0 only at {stationary}", stationary == sp.FiniteSet(quarter))
    proof.step("φ⁻(¼) = e/2", _same(phi_minus.subs(W, quarter), sp.E / 2))
    # Sign of φ⁻′: W = u² (u > 0, increasing) turns the branch into ψ(u); u < ½ as u = 1/(2+d), u > ½ as ½+d.
    u = sp.Symbol("u", positive=True)
    d = sp.Symbol("d", positive=True)
    psi_slope = sp.diff(sp.powdenest(phi_minus.subs(W, u**2)), u)
    below = sp.simplify(psi_slope.subs(u, 1 / (2 + d)))
    above = sp.simplify(psi_slope.subs(u, sp.Rational(1, 2) + d))
    proof.step(
        "φ⁻ increases on (0, ¼) and decreases on (¼, ∞) (so ¼ is the maximum)",
        below.is_positive and above.is_negative,
    )
    return proof.result()


def claim_slope_matching(lam_minus=sp.Integer(2)) -> Claim:
    """Claim 8 (§3.3.5, App. A.3): equal slopes at W = 1 give λ⁻ = 2."""
    proof = _Proof(
        "slope_matching", "φ⁺′(1) = −½ and φ⁻′(1) = β⁻(1 − λ⁻); equating them at β⁻ = ½ gives λ⁻ = 2"
    )
    slope_plus = sp.diff(ks.respo_positive(W), W).subs(W, 1)
    proof.step(f"φ⁺′(1) = {sp.simplify(slope_plus)} = −½", _same(slope_plus, -sp.Rational(1, 2)))
    lam = sp.Symbol("lambda", real=True)
    slope_minus = sp.diff(ks.reshaping_kernel(W, 1, BETA, lam), W).subs(W, 1)
    proof.step("φ⁻′(1) = β(1 − λ) for the α=1 branch", _same(slope_minus, BETA * (1 - lam)))
    roots = sp.solve(sp.Eq(slope_minus.subs(BETA, sp.Rational(1, 2)), slope_plus), lam)
    proof.step(f"matching at β⁻ = ½ gives λ⁻ ∈ {roots}, chosen λ⁻ = {lam_minus}", roots == [lam_minus])
    return proof.result()


def claim_on_policy_limit() -> Claim:
    """Claim 9 (App. A.5): at W = 1 both branches (and every (α, β, λ) kernel) equal 1."""
    proof = _Proof("on_policy_limit", "φ⁺(1) = φ⁻(1) = 1, and φ(1) = 1 for every (α, β, λ)")
    proof.step("φ(1; α, β, λ) = 1 for α ≠ 1", _same(ks.reshaping_kernel(1, 1 + S, BETA, LAM), 1))
    proof.step("φ(1; α=1, β, λ) = 1", _same(ks.reshaping_kernel(1, 1, BETA, LAM), 1))
    proof.step("φ⁺(1) = 1", _same(ks.respo_positive(1), 1))
    proof.step("φ⁻(1) = 1", _same(ks.respo_negative(1), 1))
    return proof.result()


def claim_tail_regimes() -> Claim:
    """Claim 10 (§3.3.4): α selects the tail regime of φ for λ > 0."""
    proof = _Proof(
        "tail_regimes",
        "for λ>0: α>1 ⇒ φ(0)>0, φ(∞)=0; 0<α<1 ⇒ φ(0)=0, φ(∞)>0; α=1 ⇒ φ(0)=φ(∞)=0 (β∈(0,1))",
    )

    # Paper form with β̄ = 1 − β made explicit as a positive symbol (claim 4 shows 1+β(x−1) = β̄+βx).
    def phi(alpha_minus_one):
        phi0 = (BETA_BAR + BETA * W**alpha_minus_one) ** (1 / alpha_minus_one)
        return ks.exponential_tilt(phi0, LAM)

    above = phi(S_POS)  # α = 1 + s > 1
    at0 = sp.limit(above, W, 0, "+")
    proof.step(
        f"α>1: φ(0) = {at0} > 0",
        _same(at0, ks.exponential_tilt(BETA_BAR ** (1 / S_POS), LAM)) and at0.is_positive,
    )
    proof.step("α>1: φ(∞) = 0", _same(sp.limit(above, W, sp.oo), 0))
    below = phi(-S_POS)  # α = 1 − s < 1
    at_inf = sp.limit(below, W, sp.oo)
    proof.step("0<α<1: φ(0) = 0", _same(sp.limit(below, W, 0, "+"), 0))
    proof.step(f"0<α<1: φ(∞) = {at_inf} > 0", at_inf.is_positive)
    at_one = ks.reshaping_kernel(W, 1, BETA, LAM)
    proof.step("α=1: φ(0) = 0", _same(sp.limit(at_one, W, 0, "+"), 0))
    proof.step("α=1: φ(∞) = 0", _same(sp.limit(at_one, W, sp.oo), 0))
    return proof.result()


def claim_vespo_positive_starvation() -> Claim:
    """Claim 11 (§1, §3.3.2): VESPO's kernel vanishes at W → 0, starving lost positive responses."""
    proof = _Proof(
        "vespo_positive_starvation",
        "φ_VESPO(W) = W^β·e^(λ(1−W)) → 0 as W → 0 for every β > 0, while φ⁺_ReSPO(0) = e/2 > 0",
    )
    lam = sp.Symbol("lambda", real=True)
    vespo = ks.vespo_kernel(W, BETA, lam)
    proof.step("lim_(W→0⁺) W^β e^(λ(1−W)) = 0 for all β > 0, real λ", _same(sp.limit(vespo, W, 0, "+"), 0))
    vespo_plus = ks.vespo_kernel(W, **ks.VESPO_POSITIVE)
    proof.step(
        "paper VESPO⁺ (β=2, λ=3) vanishes quadratically: φ/W² → e³",
        _same(sp.limit(vespo_plus / W**2, W, 0, "+"), sp.exp(3)),
    )
    proof.step(
        "ReSPO φ⁺(0) = e/2 > 0", _same(ks.respo_positive(W).subs(W, 0), sp.E / 2) and (sp.E / 2).is_positive
    )
    return proof.result()


def claim_length_bias() -> Claim:
    """Claim 12 (App. A.6): GSPO's length normalization tempers W by 1/T."""
    proof = _Proof("length_bias", "W = exp(Tℓ̄) ⇒ s = W^(1/T) = exp(ℓ̄) and W₂/W₁ = exp((T₂−T₁)ℓ̄)")
    t, t1, t2 = sp.symbols("T T_1 T_2", positive=True)
    mean_log_ratio = sp.Symbol("lbar", real=True)

    def seq_weight(length):
        return sp.exp(length * mean_log_ratio)

    proof.step("W^(1/T) = exp(ℓ̄)", _same(seq_weight(t) ** (1 / t), sp.exp(mean_log_ratio)))
    proof.step(
        "W₂/W₁ = exp((T₂−T₁)ℓ̄)", _same(seq_weight(t2) / seq_weight(t1), sp.exp((t2 - t1) * mean_log_ratio))
    )
    roots = sp.solve(sp.Eq(sp.log(seq_weight(t2) / seq_weight(t1)), 0), mean_log_ratio)
    proof.step("at T₂ ≠ T₁ the ratio is 1 only on-policy (ℓ̄ = 0)", roots == [0])
    return proof.result()


def claim_gradient_identity() -> Claim:
    """Claim 13 (§3.3.1): the detached-φ surrogate's gradient is φ(W)·Â·∇log π."""
    proof = _Proof(
        "gradient_identity",
        "∇_θ[sg(φ(W))·Â·log π_θ] = φ(W)·Â·∇_θ log π_θ,"
        " the importance-sampled gradient W·Â·∇log π with W → φ(W)",
    )
    theta = sp.Symbol("theta", real=True)  # any one coordinate of the parameters
    theta_frozen = sp.Symbol("theta_0", real=True)  # where sg(·) froze its argument
    advantage = sp.Symbol("A", real=True)
    tokens = 3  # a response of three tokens; the identity is termwise in t
    token_logp = [sp.Function(f"l_{t}", real=True)(theta) for t in range(tokens)]
    old_logp = sp.symbols(f"m_0:{tokens}", real=True)
    log_pi = sum(token_logp)
    log_w = sum(lp - old for lp, old in zip(token_logp, old_logp))
    seq_w = sp.exp(log_w)
    phi = sp.Function("phi")  # any differentiable kernel

    surrogate = phi(seq_w.subs(theta, theta_frozen)) * advantage * log_pi
    grad = sp.diff(surrogate, theta).subs(theta_frozen, theta)
    proof.step(
        "d/dθ[φ(W(θ₀))·Â·Σ_t log π_t(θ)] at θ₀=θ equals φ(W)·Â·d log π/dθ",
        _same(grad, phi(seq_w) * advantage * sp.diff(log_pi, theta)),
    )
    proof.step(
        "the ratio surrogate W·Â has gradient W·Â·d log π/dθ (§3.3.1, ∇W = W∇log π)",
        _same(sp.diff(seq_w * advantage, theta), seq_w * advantage * sp.diff(log_pi, theta)),
    )
    undetached = sp.diff(phi(seq_w) * advantage * log_pi, theta)
    extra = sp.simplify(undetached - phi(seq_w) * advantage * sp.diff(log_pi, theta))
    dphi = sp.Subs(sp.Derivative(phi(sp.Symbol("y")), sp.Symbol("y")), sp.Symbol("y"), seq_w).doit()
    proof.step(
        "without sg the gradient gains Â·log π·φ′(W)·W·d log π/dθ (not identically 0), hence the detach",
        _same(extra, advantage * log_pi * dphi * seq_w * sp.diff(log_pi, theta)) and extra != 0,
    )
    return proof.result()


PAPER_CLAIMS: tuple[Callable[[], Claim], ...] = (
    claim_power_mean_first_order_condition,
    claim_alpha_to_one_limit,
    claim_kl_projection_exponential_tilt,
    claim_alpha_two_affine,
    claim_positive_stationary_maximum,
    claim_positive_branch_shape,
    claim_negative_branch_shape,
    claim_slope_matching,
    claim_on_policy_limit,
    claim_tail_regimes,
    claim_vespo_positive_starvation,
    claim_length_bias,
    claim_gradient_identity,
)
