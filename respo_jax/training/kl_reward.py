"""The frozen reference policy π_ref and the KL penalty in the reward (`objective.kl_in_reward`, verl's
``apply_kl_penalty``): each response's score loses β Σ_t kl(log π_old, log π_ref) before the group
advantages are computed, β optionally adapted towards a target KL (`objective.kl_target`, verl's
adaptive controller).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from respo_jax.objectives import group_advantages
from respo_jax.objectives.regularizers import adaptive_kl_coef, response_kl
from respo_jax.training.config import ObjectiveConfig
from respo_jax.training.placement import RowPlacer
from respo_jax.programs import Program
from respo_jax.training.rows import TrainingRows


# The group advantages and the reward's KL as one program each (rewards are checked finite where they
# are scored, `respo_jax.rewards.scoring`). Why: run eagerly, each jnp op of a host-side function is a
# program of its own, compiled in a cold start and read from the compilation cache in every later launch.
def advantages_program(replicated: NamedSharding | None = None) -> Program:
    """(rewards [prompts, G], normalize_by_std) -> advantages [prompts, G] (`group_advantages`), on
    `replicated` (a mesh's replicated sharding; None: the one-device mesh)."""
    return Program(group_advantages, "group_advantages", in_shardings=replicated, out_shardings=replicated,
                   static_argnums=(1,))


def response_kl_program(rows: NamedSharding) -> Program:
    """(old_logp, ref_logp, mask [batch, seq], estimator) -> (Σ_t kl, token-mean kl) [batch]
    (`response_kl`), on the update batches' row sharding `rows`."""
    return Program(response_kl, "response_kl", in_shardings=rows, out_shardings=rows, static_argnums=(3,))


def reference_policy(objective: ObjectiveConfig, params):
    """The reference policy's parameters when RL starts: objective.reference_checkpoint's, else a copy of
    `params` (after any warm-up), on the parameters' shardings."""
    if objective.reference_checkpoint:
        from respo_jax.training.checkpoint import restore_params

        return restore_params(objective.reference_checkpoint, params)[0]
    return jax.tree.map(jnp.copy, params)


def kl_penalized_advantages(batch: TrainingRows, minibatches: list[np.ndarray], policy_batches: list,
                            beta: float, objective: ObjectiveConfig, scale_advantages: bool, group_size: int,
                            placer: RowPlacer, kl: Program, advantages: Program
                            ) -> tuple[list, TrainingRows, dict, float]:
    """The mini-batches `policy_batches` ([(PolicyBatch with old_logp and ref_logp, micro-batch rows)],
    the rows of each in `minibatches`) with the advantages of the penalized scores, the rows with their
    new advantages, the metrics kl_reward (the batch mean of each response's token-mean KL) and
    kl_reward_coef (the β used), and the next β (the adaptive controller's, or β). `kl` is a
    `response_kl_program`, `advantages` an `advantages_program`."""
    kl_sum = np.zeros(batch.lengths.shape[0], np.float64)
    kl_mean = np.zeros_like(kl_sum)
    for rows, (policy, _) in zip(minibatches, policy_batches):
        kl_sum[rows], kl_mean[rows] = placer.fetch(kl(policy.old_logp, policy.ref_logp, policy.response_mask,
                                                      objective.kl_estimator))
    real = batch.real_rows
    scores = batch.scores[:real] - beta * kl_sum[:real]
    grouped = jnp.asarray(scores.reshape(-1, group_size), jnp.float32)
    penalized = np.asarray(advantages(grouped, scale_advantages)).reshape(-1)
    penalized = np.concatenate([penalized, np.zeros(batch.advantages.shape[0] - real, np.float32)])
    placed = []
    for rows, (policy, micro) in zip(minibatches, policy_batches):
        local = penalized[rows][placer.rows(len(rows))]
        placed.append((policy.replace(advantages=placer.place(local, len(rows))), micro))
    current = float(kl_mean[:real].mean()) if real else 0.0
    next_beta = beta
    if objective.kl_target and real:
        next_beta = adaptive_kl_coef(beta, current, real, objective.kl_target, objective.kl_horizon)
    metrics = {"kl_reward": current, "kl_reward_coef": beta}
    return placed, dataclasses.replace(batch, advantages=penalized), metrics, next_beta
