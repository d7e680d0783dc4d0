"""The jitted policy update: forward → objective → backward → Optax, compiled as one XLA program.

Parameters and optimizer state are plain pytrees (`nnx.split`), so the step is a pure function
`(params, opt_state, batch) -> (params, opt_state, metrics)` that jit compiles once per batch shape and
whose buffers are donated (updated in place).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from respo_jax.training.batch import PolicyBatch, response_logprobs


def make_optimizer(
    learning_rate: float, weight_decay: float, b1: float, b2: float, max_grad_norm: float, warmup_steps: int
) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and an optional linear warm-up of the learning rate."""
    schedule = (
        optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps > 0 else learning_rate
    )
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay),
    )


def make_policy_step(graphdef: nnx.GraphDef, objective: Callable, tx: optax.GradientTransformation):
    """Builds `step(params, opt_state, batch) -> (params, opt_state, metrics)` for a `PolicyBatch`.

    `objective(logp, old_logp, advantages, mask) -> (loss, metrics)` is any registered objective
    (`respo_jax.objectives.get_objective`), jitted together with the model and the Optax update.
    """

    def loss_fn(params, batch: PolicyBatch):
        model = nnx.merge(graphdef, params)
        logp = response_logprobs(model, batch.input_ids, batch.positions, batch.attention_mask, batch.prompt_len)
        loss, metrics = objective(logp, batch.old_logp, batch.advantages, batch.response_mask)
        mask = batch.response_mask
        tokens = jnp.maximum(jnp.sum(mask), 1.0)
        # k3 estimator of KL(π_old || π_θ) over the response tokens, and the entropy proxy -E[log π].
        log_ratio = jnp.where(mask > 0, batch.old_logp - logp, 0.0)
        metrics = dict(metrics)
        metrics["approx_kl"] = jnp.sum((jnp.exp(log_ratio) - 1.0 - log_ratio) * mask) / tokens
        metrics["neg_logp"] = -jnp.sum(logp * mask) / tokens
        return loss, metrics

    def step(params, opt_state, batch: PolicyBatch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def make_logprob_fn(graphdef: nnx.GraphDef):
    """Jitted `log π(response | prompt)` of a batch under `params`: [batch, response_len] float32."""

    @jax.jit
    def logprobs(params, batch: PolicyBatch):
        model = nnx.merge(graphdef, params)
        logp = response_logprobs(model, batch.input_ids, batch.positions, batch.attention_mask, batch.prompt_len)
        return jnp.where(batch.response_mask > 0, logp, 0.0)

    return logprobs


def make_sft_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """Supervised next-token step on `(input_ids, positions, attention_mask, loss_mask)`, all [batch, seq];
    loss_mask marks the target tokens (the response) to be predicted."""

    def loss_fn(params, input_ids, positions, attention_mask, loss_mask):
        model = nnx.merge(graphdef, params)
        logp = model.token_logprobs(
            input_ids[:, :-1], input_ids[:, 1:], positions=positions[:, :-1], attention_mask=attention_mask[:, :-1]
        )
        weights = loss_mask[:, 1:]
        return -jnp.sum(logp * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    def step(params, opt_state, input_ids, positions, attention_mask, loss_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, input_ids, positions, attention_mask, loss_mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
