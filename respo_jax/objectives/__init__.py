"""Policy objectives of respo-jax: ReSPO, VESPO, GSPO, GRPO as pure functions of log-probs (paper §3, App. B).

from respo_jax.objectives import get_objective, group_advantages
objective = get_objective("respo")                   # "vespo", "gspo", "grpo"; hparams as kwargs
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
    OBJECTIVES,
    PolicyObjective,
    get_objective,
    grpo_objective,
    gspo_objective,
    respo_objective,
    vespo_objective,
)

__all__ = [
    "AGGREGATION_MODES",
    "LossTerms",
    "OBJECTIVES",
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
