"""Rewards of the paper: the DAPO strict-box training reward and overlong penalty (App. D.1), and the
Math-Verify evaluation scorer run in a persistent process pool (App. D.2). None of them evaluates model
output as code.
"""

from respo_jax.rewards.math_verify_pool import (
    EXPR,
    LATEX,
    Extraction,
    MathVerifyScorer,
    Outcome,
    ScorerStats,
    VerifyCall,
    math_verify_score,
)
from respo_jax.rewards.overlong import overlong_penalty
from respo_jax.rewards.strict_box import last_strict_box, strict_box_score, strict_box_scores

__all__ = [
    "EXPR",
    "LATEX",
    "Extraction",
    "MathVerifyScorer",
    "Outcome",
    "ScorerStats",
    "VerifyCall",
    "last_strict_box",
    "math_verify_score",
    "overlong_penalty",
    "strict_box_score",
    "strict_box_scores",
]
