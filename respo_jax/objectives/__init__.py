"""Policy objectives of respo-jax as pure functions of log-probs (paper §3, App. B): ReSPO, its baselines
VESPO, GSPO, GRPO as verl runs them, and TRL's CISPO, SAPO, LUSPO, Dr.GRPO.

from respo_jax.objectives import get_objective, group_advantages
objective = get_objective("respo")                   # any key of OBJECTIVES; hparams as kwargs
loss, metrics = objective(logp, old_logp, advantages, mask)
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
    get_objective,
    grpo_objective,
    gspo_objective,
    respo_objective,
    vespo_objective,
)

__all__ = [
    "AGGREGATION_MODES",
    "COMMON_KEYS",
    "LossTerms",
    "OBJECTIVES",
    "ObjectiveOutput",
    "ObjectiveSpec",
    "PolicyObjective",
    "aggregate_loss",
    "aggregation_terms",
    "combine_loss_terms",
    "get_objective",
    "group_advantages",
    "grpo_objective",
    "gspo_objective",
    "log_power_mean_kernel",
    "log_reshaping_kernel",
    "loss_denominator",
    "power_mean_kernel",
    "reshaping_kernel",
    "respo_kernel",
    "respo_objective",
    "sequence_log_ratio",
    "vespo_kernel",
    "vespo_objective",
]
