"""Policy objectives of respo-jax as pure functions of log-probs (paper §3, App. B): ReSPO, its baselines
VESPO, GSPO, GRPO as verl runs them, and TRL's CISPO, SAPO, LUSPO, Dr.GRPO.

from respo_jax.objectives import get_objective, group_advantages
objective = get_objective("respo")                   # any key of OBJECTIVES; hparams as kwargs
loss, metrics = objective(logp, old_logp, advantages, mask)

New objectives are registered without editing the package (``registry``: ``register_objective`` with
``kernel_objective`` / ``reshaping_objective``); ``response_gradient_weight`` measures any objective's
per-response gradient weight (Fig. 1) by differentiating it. ``regularizers`` (KL to a reference
policy, entropy bonus) and ``off_policy_masks`` (DeepSeek-V3.2, geometric-mean, M2PO) add to any objective.

Modules:
  kernels             the sequence-weight kernels phi(W; A) of ReSPO, VESPO and the Eq. 12 family
  policy_losses       the objectives by name (``OBJECTIVES``, ``get_objective``) and their per-token losses
  aggregation         the loss aggregation modes, exact over micro-batches
  advantages          GRPO / Dr.GRPO group advantages
  positive_branch     App. E.3's positive-branch statistics, for the jitted step and the pooled record
  registry            user objectives (``register_objective``, ``kernel_objective``, ``reshaping_objective``)
  gradient_weight     any objective's per-response gradient weight (Fig. 1)
  regularizers        KL to a reference policy, entropy bonus
  off_policy_masks    masks of stale tokens or sequences (DeepSeek-V3.2, geometric mean, M2PO)
  rollout_correction  verl's truncated / masked importance weights between sampler and trainer
  decoupled           AReaL's decoupled objective: ratio and clip on pi / pi_prox, weighted by
                      pi_prox / pi_behav
  validation          input checks (shapes, dtypes; values when concrete), so bad input fails loudly
"""

from respo_jax.objectives.advantages import group_advantages
from respo_jax.objectives.aggregation import (
    AGGREGATION_MODES,
    LossTerms,
    aggregate_loss,
    aggregation_terms,
    combine_loss_terms,
    loss_denominator,
)
from respo_jax.objectives.gradient_weight import (
    plot_gradient_weights,
    response_gradient_weight,
    weight_table,
)
from respo_jax.objectives.kernels import (
    log_power_mean_kernel,
    log_reshaping_kernel,
    power_mean_kernel,
    reshaping_kernel,
    respo_kernel,
    sequence_log_ratio,
    vespo_kernel,
)
from respo_jax.objectives.policy_losses import (
    COMMON_KEYS,
    OBJECTIVES,
    ObjectiveOutput,
    ObjectiveSpec,
    PolicyObjective,
    TokenLoss,
    get_objective,
    grpo_objective,
    gspo_objective,
    respo_objective,
    vespo_objective,
)
from respo_jax.objectives.registry import (
    BUILTIN_OBJECTIVES,
    kernel_objective,
    register_objective,
    reshaping_objective,
    unregister_objective,
)
from respo_jax.objectives.decoupled import decoupled_weights
from respo_jax.objectives.off_policy_masks import MASK_KINDS, OffPolicyMask, mask_weights
from respo_jax.objectives.regularizers import KL_ESTIMATORS, Regularizers, kl_penalty
from respo_jax.objectives.rollout_correction import RolloutCorrection, rollout_correction_weights

__all__ = [
    "decoupled_weights",
    "AGGREGATION_MODES",
    "BUILTIN_OBJECTIVES",
    "COMMON_KEYS",
    "KL_ESTIMATORS",
    "MASK_KINDS",
    "LossTerms",
    "OBJECTIVES",
    "ObjectiveOutput",
    "ObjectiveSpec",
    "OffPolicyMask",
    "PolicyObjective",
    "Regularizers",
    "RolloutCorrection",
    "TokenLoss",
    "aggregate_loss",
    "aggregation_terms",
    "combine_loss_terms",
    "get_objective",
    "group_advantages",
    "kernel_objective",
    "kl_penalty",
    "grpo_objective",
    "gspo_objective",
    "log_power_mean_kernel",
    "log_reshaping_kernel",
    "loss_denominator",
    "mask_weights",
    "plot_gradient_weights",
    "power_mean_kernel",
    "register_objective",
    "reshaping_kernel",
    "reshaping_objective",
    "respo_kernel",
    "respo_objective",
    "response_gradient_weight",
    "rollout_correction_weights",
    "sequence_log_ratio",
    "unregister_objective",
    "vespo_kernel",
    "vespo_objective",
    "weight_table",
]
