"""Run every claim — the paper's derivations and the bridge to the JAX kernels — and report them.

`verify_all()` is the programmatic entry point; `main()` backs `python -m respo_jax.symbolic`.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence

from respo_jax.symbolic.bridge import BRIDGE_CLAIMS
from respo_jax.symbolic.claims import PAPER_CLAIMS, Claim

ALL_CLAIMS: tuple[Callable[[], Claim], ...] = PAPER_CLAIMS + BRIDGE_CLAIMS


def run_claim(claim_fn: Callable[[], Claim]) -> Claim:
    """Run one claim; an exception is a failed claim (named after the function), not a crash."""
    try:
        return claim_fn()
    except Exception as err:  # noqa: BLE001 - any error means the claim was not established
        name = claim_fn.__name__.removeprefix("claim_")
        last = traceback.extract_tb(err.__traceback__)[-1]
        detail = f"raised {type(err).__name__}: {err} (at {last.filename}:{last.lineno})"
        return Claim(
            name,
            (claim_fn.__doc__ or "").strip().splitlines()[0] if claim_fn.__doc__ else name,
            False,
            detail,
        )


def run_all(claim_fns: Sequence[Callable[[], Claim]] = ALL_CLAIMS) -> list[Claim]:
    """Every claim's outcome, in order."""
    return [run_claim(fn) for fn in claim_fns]


def verify_all(claim_fns: Sequence[Callable[[], Claim]] = ALL_CLAIMS) -> dict[str, bool]:
    """{claim_name: proved} for the paper claims (§3.3, App. A) and the JAX bridge."""
    return {claim.name: claim.proved for claim in run_all(claim_fns)}


def format_claim(claim: Claim, verbose: bool = False) -> str:
    """One line: status, name, statement (and the proof steps when `verbose`)."""
    line = f"[{'proved' if claim.proved else 'FAILED'}] {claim.name}: {claim.statement}"
    if verbose or not claim.proved:
        line += "".join(f"\n    {step}" for step in claim.detail.splitlines())
    return line


def main(argv: Sequence[str] | None = None, claim_fns: Sequence[Callable[[], Claim]] = ALL_CLAIMS) -> int:
    """Print one line per claim; return 0 if all are proved, 1 otherwise. `-v` adds the proof steps."""
    args = list(sys.argv[1:] if argv is None else argv)
    unknown = [a for a in args if a not in ("-v", "--verbose")]
    if unknown:
        print(f"unknown argument(s) {unknown}; usage: python -m respo_jax.symbolic [-v]", file=sys.stderr)
        return 2
    claims = run_all(claim_fns)
    for claim in claims:
        print(format_claim(claim, verbose=bool(args)))
    failed = [c.name for c in claims if not c.proved]
    print(
        f"{len(claims) - len(failed)}/{len(claims)} claims proved"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0
