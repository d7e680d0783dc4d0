"""Tests of respo_jax.symbolic: every paper claim is proved, wrong statements are not, and the bridge
catches a JAX kernel that departs from the proved closed forms."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy as sp

from respo_jax.objectives import kernels as K
from respo_jax.symbolic import (
    ALL_CLAIMS,
    BRIDGE_CLAIMS,
    PAPER_CLAIMS,
    Claim,
    bridge,
    claims,
    main,
    run_claim,
    verify_all,
)
from respo_jax.symbolic import kernels_sym as ks

REPO_ROOT = Path(__file__).resolve().parents[1]

EXPECTED_PAPER_CLAIMS = [
    "power_mean_first_order_condition",
    "alpha_to_one_limit",
    "kl_projection_exponential_tilt",
    "alpha_two_affine",
    "positive_stationary_maximum",
    "positive_branch_shape",
    "negative_branch_shape",
    "slope_matching",
    "on_policy_limit",
    "tail_regimes",
    "vespo_positive_starvation",
    "length_bias",
    "gradient_identity",
]


# ------------------------------------------------------------------------------------------------
# The paper's claims (§3.3, App. A)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("claim_fn", PAPER_CLAIMS, ids=lambda fn: fn.__name__)
def test_paper_claim_is_proved(claim_fn):
    claim = claim_fn()
    assert isinstance(claim, Claim)
    assert claim.proved, f"{claim.name} not proved: {claim.detail}"
    assert "FAILED" not in claim.detail and "[ok]" in claim.detail


@pytest.mark.parametrize(
    "claim_fn, kwargs",
    [
        (claims.claim_positive_stationary_maximum, {"lam_plus": 3}),  # φ⁺′(0) ≠ 0
        (claims.claim_positive_stationary_maximum, {"beta_plus": sp.Rational(1, 3)}),  # needs λ⁺ = 3/2
        (claims.claim_negative_branch_shape, {"lam_minus": 3}),  # peak moves to W* = 1/9
        (claims.claim_negative_branch_shape, {"beta_minus": 1}),  # φ⁻ = W e^{2(1−W)} peaks at ½
        (claims.claim_slope_matching, {"lam_minus": 3}),  # slopes at W = 1 differ
    ],
)
def test_wrong_hyperparameters_are_not_proved(claim_fn, kwargs):
    claim = claim_fn(**kwargs)
    assert not claim.proved
    assert "FAILED" in claim.detail


def test_lambda_plus_follows_beta_plus_in_general():
    # λ⁺ = 1/(1−β⁺) is the general rule, not a coincidence at β⁺ = ½.
    assert claims.claim_positive_stationary_maximum(
        beta_plus=sp.Rational(1, 3), lam_plus=sp.Rational(3, 2)
    ).proved


def test_unknown_truth_is_not_a_proof():
    # SymPy answers None when it cannot decide; that must not count as proved.
    undecidable = sp.Symbol("t", real=True).is_positive
    assert undecidable is None
    assert claims.holds(undecidable) is False
    assert claims.holds(sp.true) and claims.holds(True) and not claims.holds(sp.false)


def test_claims_never_sample_numbers():
    # Expr.equals falls back to random numeric points; evalf/lambdify/N would also mean sampling.
    source = inspect.getsource(claims)
    for banned in (".equals(", "lambdify", ".evalf(", "sp.N(", "import random", "numpy"):
        assert banned not in source, banned


# ------------------------------------------------------------------------------------------------
# Bridge: closed forms vs the JAX kernels
# ------------------------------------------------------------------------------------------------
def test_reference_matches_independent_float64_formulas():
    x = np.linspace(-20.0, 20.0, 401)
    w = np.exp(x)
    cases = [
        (ks.respo_positive(), (1 + w) / 2 * np.exp(1 - w)),
        (ks.respo_negative(), np.sqrt(w) * np.exp(2 * (1 - np.sqrt(w)))),
        (ks.vespo_kernel(ks.W, 2, 3), w**2 * np.exp(3 * (1 - w))),
        (
            ks.power_mean_kernel(ks.W, sp.Rational(1, 2), sp.Rational(1, 4)),
            (1 + 0.25 * (w**-0.5 - 1)) ** -2.0,
        ),
    ]
    for expr, expected in cases:
        ref = bridge.reference(expr)
        np.testing.assert_allclose(ref.value(x), expected, rtol=1e-12, atol=1e-300)
        assert np.all(ref.kappa(x) >= 1.0) and np.all(np.isfinite(ref.kappa(x)))
    # d log φ⁺/dx = W(1/(1+W) − 1) = −W²/(1+W); it only enters κ ≥ 1, so an absolute tolerance suffices.
    np.testing.assert_allclose(
        bridge.reference(ks.respo_positive()).log_slope(x), -(w**2) / (1 + w), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("claim_fn", BRIDGE_CLAIMS, ids=lambda fn: fn.__name__)
def test_bridge_claim_holds_for_the_objectives_kernels(claim_fn):
    claim = claim_fn()
    assert claim.proved, claim.detail


def test_bridge_errors_are_within_float32_precision():
    comparisons = bridge.check_reshaping_family() + [c for pair in bridge.check_respo() for c in pair]
    for c in comparisons:
        assert c.nonfinite == 0
        assert c.max_err_over_tol < 0.25, c.summary()  # measured ≈ 0.05: a margin, not a tuned bound
        assert c.max_rel_err < 1e-4, c.summary()


def _respo(**kwargs):
    return lambda log_w, adv: K.respo_kernel(log_w, adv, **kwargs)


@pytest.mark.parametrize(
    "kernel, positive_ok, negative_ok",
    [
        (_respo(lam=(2.01, 2.0)), False, True),  # wrong λ⁺
        (_respo(lam=(2.0, 1.99)), True, False),  # wrong λ⁻
        (_respo(beta=(0.5, 0.51)), True, False),  # wrong β⁻
        (_respo(alpha=(2.0, 1.01)), True, False),  # α⁻ off the KL limit
        (lambda log_w, adv: K.respo_kernel(log_w, -adv), False, False),  # branches swapped
        (
            lambda log_w, adv: K.respo_kernel(log_w, jnp.where(adv == 0, -1.0, adv)),
            False,
            True,
        ),  # A = 0 sent to φ⁻
        (lambda log_w, adv: K.respo_kernel(log_w, adv) * (1 + 1e-4), False, False),  # 1e-4 relative bias
    ],
    ids=["lam_plus", "lam_minus", "beta_minus", "alpha_minus", "swapped", "zero_advantage", "bias_1e-4"],
)
def test_bridge_detects_perturbed_respo_kernel(kernel, positive_ok, negative_ok):
    assert bridge.bridge_respo_positive(kernel).proved is positive_ok
    assert bridge.bridge_respo_negative(kernel).proved is negative_ok


def test_bridge_detects_perturbed_vespo_and_family_kernels():
    swapped = lambda log_w, adv: K.vespo_kernel(log_w, adv, beta=(3.0, 2.0), lam=(2.0, 3.0))  # noqa: E731
    assert not bridge.bridge_vespo_positive(swapped).proved
    assert not bridge.bridge_vespo_negative(swapped).proved
    wrong_lam = lambda log_w, a, b, lam: K.reshaping_kernel(log_w, a, b, lam * 1.01)  # noqa: E731
    assert not bridge.bridge_reshaping_family(wrong_lam).proved
    wrong_beta = lambda log_w, a, b: K.power_mean_kernel(log_w, a, b * 1.01)  # noqa: E731
    assert not bridge.bridge_power_mean_family(wrong_beta).proved


def test_bridge_detects_nonfinite_values_and_lost_gradients():
    with_nan = lambda log_w, adv: jnp.where(log_w > 19.0, jnp.nan, K.respo_kernel(log_w, adv))  # noqa: E731
    claim = bridge.bridge_respo_positive(with_nan)
    assert not claim.proved and "non-finite" in claim.detail
    detached = lambda log_w, adv: jax.lax.stop_gradient(K.respo_kernel(log_w, adv))  # noqa: E731
    assert not bridge.bridge_respo_slopes(detached).proved


def test_compare_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        bridge.compare("x", np.zeros(3), np.zeros(4), np.ones(4))


# ------------------------------------------------------------------------------------------------
# verify_all and the command line
# ------------------------------------------------------------------------------------------------
def _raises():
    raise RuntimeError("boom")


def _unproved():
    return Claim("always_false", "a claim that does not hold", False, "step [FAILED]")


def test_verify_all_maps_names_to_outcomes_and_contains_failures():
    result = verify_all((claims.claim_on_policy_limit, _unproved, _raises))
    assert result == {"on_policy_limit": True, "always_false": False, "_raises": False}
    failed = run_claim(_raises)
    assert not failed.proved and "RuntimeError: boom" in failed.detail


def test_main_exit_status_and_one_line_per_claim(capsys):
    assert main([], claim_fns=(claims.claim_on_policy_limit, claims.claim_length_bias)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("[proved] on_policy_limit: ") and lines[1].startswith("[proved] length_bias: ")
    assert lines[-1] == "2/2 claims proved"
    assert main([], claim_fns=(claims.claim_on_policy_limit, _unproved)) == 1
    out = capsys.readouterr().out
    assert "[FAILED] always_false" in out and "failed: always_false" in out
    assert main(["--bogus"], claim_fns=()) == 2


@pytest.mark.slow
def test_module_entry_point_runs_every_claim():
    proc = subprocess.run(
        [sys.executable, "-m", "respo_jax.symbolic"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(ALL_CLAIMS) + 1
    assert all(line.startswith("[proved] ") for line in lines[:-1])
    names = [line.split("] ", 1)[1].split(":", 1)[0] for line in lines[:-1]]
    assert names[: len(EXPECTED_PAPER_CLAIMS)] == EXPECTED_PAPER_CLAIMS
    assert len(set(names)) == len(names) and all(
        n.startswith("bridge_") for n in names[len(EXPECTED_PAPER_CLAIMS) :]
    )
    assert lines[-1] == f"{len(ALL_CLAIMS)}/{len(ALL_CLAIMS)} claims proved"
