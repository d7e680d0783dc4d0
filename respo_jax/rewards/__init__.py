"""Rewards of the paper: the DAPO strict-box training reward and overlong penalty (App. D.1), and the
Math-Verify evaluation scorer run in a persistent process pool (App. D.2), and the registry of training
rewards by name (`task.reward`, `register_reward`). None of them evaluates model output as code.

Modules:
  strict_box          the strict-box verifier (App. D.1): the last `\\boxed{}` against the answer
  overlong            DAPO's overlong penalty
  math_verify_pool    Math-Verify scoring in a persistent, recycled process pool with per-call timeouts
  math_verify_worker  the pool's worker process
  registry            training rewards by name (`REWARDS`, `register_reward`, `get_reward`)
  scoring             scoring a batch with a registered reward, slow ones in worker processes
  reward_worker       the worker process of a slow reward
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
from respo_jax.rewards.registry import (
    BUILTIN_REWARDS,
    RewardSpec,
    get_reward,
    register_reward,
    reward_names,
    unregister_reward,
)
from respo_jax.rewards.scoring import FAILED, SCORED, TIMED_OUT, RewardScorer
from respo_jax.rewards.strict_box import last_strict_box, strict_box_score, strict_box_scores

__all__ = [
    "BUILTIN_REWARDS",
    "FAILED",
    "RewardScorer",
    "RewardSpec",
    "SCORED",
    "TIMED_OUT",
    "get_reward",
    "register_reward",
    "reward_names",
    "unregister_reward",
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
