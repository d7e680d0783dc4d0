"""SymPy proofs of the paper's derivations (§3.3, App. A), tied to the JAX kernels.

    from respo_jax.symbolic import verify_all
    verify_all()            # {claim_name: True/False}, paper claims then the JAX bridge
    python -m respo_jax.symbolic -v

Modules: `kernels_sym` (the closed forms in SymPy), `claims` (proves the statements about them), `bridge`
(checks that `respo_jax.objectives.kernels` computes those same closed forms in float32), `verify`
(`verify_all`, the command `python -m respo_jax.symbolic`, `__main__`).
"""

from respo_jax.symbolic.bridge import BRIDGE_CLAIMS
from respo_jax.symbolic.claims import PAPER_CLAIMS, Claim
from respo_jax.symbolic.verify import ALL_CLAIMS, format_claim, main, run_all, run_claim, verify_all

__all__ = [
    "ALL_CLAIMS",
    "BRIDGE_CLAIMS",
    "PAPER_CLAIMS",
    "Claim",
    "format_claim",
    "main",
    "run_all",
    "run_claim",
    "verify_all",
]
