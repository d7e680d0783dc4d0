"""The jitted policy update: forward → objective → backward → Optax, compiled as one XLA program.

Parameters and optimizer state are plain pytrees (`nnx.split`), so the step is a pure function
`(params, opt_state, batch) -> (params, opt_state, metrics)` that jit compiles once per batch shape
(the trainer buckets shapes, `respo_jax.training.batch`) and whose buffers are donated (updated in
place). A mini-batch larger than memory allows runs as micro-batches whose gradients are accumulated
inside the same program. Each step also reports whether the updated parameters are all finite, a
reduction fused into the same program, so the loop can stop a diverging run before it checkpoints NaN
at no extra device round trip.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from respo_jax.models import qwen3
from respo_jax.models.qwen3.model import LOGPROB_CHUNK_TOKENS, forward_chunk_tokens
from respo_jax.objectives import (PolicyObjective, RolloutCorrection, decoupled_weights, get_objective,
                                  rollout_correction_weights)
from respo_jax.objectives.aggregation import aggregation_terms, safe_divide
from respo_jax.objectives.off_policy_masks import mask_weights, masked_fraction
from respo_jax.objectives.regularizers import Regularizers, kl_penalty
from respo_jax.training.batch import PolicyBatch, response_logprobs, split_microbatches, split_rows
from respo_jax.programs import Program, jit_program

if TYPE_CHECKING:
    from respo_jax.training.config import ExperimentConfig


# The metrics key of log π_old taken from the update's own forward (`make_policy_step`).
OLD_LOGPROBS_KEY = "old_logprobs"


class NonFiniteError(FloatingPointError):
    """Training produced NaN or inf (loss, gradient norm or parameters); the run stops before any
    checkpoint is written, so the last checkpoint on disk is the last good state."""


def tree_all_finite(tree) -> jax.Array:
    """True when every floating-point leaf of `tree` is finite: a scalar bool (jittable)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def learning_rate_schedule(learning_rate: float, warmup_steps: int, updates_per_step: int = 1):
    """``lr(count)`` of the ``count``-th optimizer update (0-based): a linear warm-up from 0 over
    ``warmup_steps`` schedule steps, then constant (verl's ``get_constant_schedule_with_warmup``).

    A schedule step is ``updates_per_step`` updates: 1 steps per policy update; N (the rollout-reuse
    ratio) steps per rollout batch, as verl steps its scheduler once per ``update_actor``, so every update
    of rollout batch k runs at lr * min(1, k / warmup_steps) and the first batch at lr 0.
    """
    if updates_per_step < 1 or warmup_steps < 0:
        raise ValueError(f"updates_per_step must be >= 1 and warmup_steps >= 0; got {updates_per_step}, "
                         f"{warmup_steps}")

    def schedule(count):
        step = jnp.asarray(count) // updates_per_step
        if warmup_steps == 0:
            return jnp.full(jnp.shape(step), learning_rate, jnp.float32)
        return learning_rate * jnp.minimum(1.0, step.astype(jnp.float32) / warmup_steps)

    return schedule


def make_optimizer(
    learning_rate: float, weight_decay: float, b1: float, b2: float, max_grad_norm: float, warmup_steps: int,
    updates_per_step: int = 1,
) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and the warm-up of ``learning_rate_schedule``. Adam's moments and
    step count advance on every update, also while the learning rate is 0 (as torch's AdamW does)."""
    schedule = learning_rate_schedule(learning_rate, warmup_steps, updates_per_step)
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay),
    )


def sequence_approx_kl(logp, old_logp, mask) -> jnp.ndarray:
    """k1 estimate of KL(pi_old || pi_theta) per response, [batch]: the token mean of old_logp - logp
    (the official recipe's ``actor/approx_kl`` averages it over responses); 0 for empty responses."""
    lengths = jnp.sum(mask, axis=-1)
    total = jnp.sum(jnp.where(mask > 0, old_logp - logp, 0.0), axis=-1)
    return jnp.where(lengths > 0, total / jnp.maximum(lengths, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Where the update step's arguments live (`respo_jax.sharding`): `params` and `opt_state` (a
    NamedSharding per leaf, from the parameters' logical axes), `batch` (one NamedSharding for every
    `PolicyBatch` field: rows split by the "batch" rule, `batch.batch_sharding`) and `replicated`
    (metrics, scalars)."""

    params: Any
    opt_state: Any
    batch: Any
    replicated: NamedSharding


def make_policy_step(
    graphdef: nnx.GraphDef,
    objective: PolicyObjective,
    tx: optax.GradientTransformation,
    temperature: float = 1.0,
    chunk_size: int = LOGPROB_CHUNK_TOKENS,
    shardings: StepShardings | None = None,
    load_balancing_weight: float = 0.0,
    rollout_correction: RolloutCorrection | None = None,
    compiler_options: dict | None = None,
    regularizers: Regularizers | None = None,
    decoupled: bool = False,
) -> Program:
    """Builds `step(params, opt_state, batch, microbatch_rows=None) -> (params, opt_state, metrics)` for
    a `PolicyBatch` (one mini-batch), a `Program` (`respo_jax.programs`: jitted by
    `jit_program`, or at its first call).

    `objective` is any registered objective (`respo_jax.objectives.get_objective`), jitted together with
    the model and the Optax update; log-probs are taken at the rollout `temperature`, the vocabulary
    projected `chunk_size` tokens at a time. `metrics` holds scalars plus `metrics["responses"]`:
    per-response `[batch]` arrays "log_w" and "phi" (what the objective saw, for the rollout files and
    the App. E.3 diagnostics) and "approx_kl" (k1). Besides the objective's metrics: `loss`,
    `grad_norm` and `params_finite` (bool, updated parameters).

    `microbatch_rows` (static; `batch.microbatch_size` computes it from a token budget; None: one
    shot) splits the mini-batch into micro-batches of that many rows whose gradients are accumulated
    in a `lax.scan`, each micro-batch's loss total divided by the whole mini-batch's denominator: the
    accumulated gradient is the one-shot gradient for every aggregation mode
    (`respo_jax.objectives.aggregation`) while only one micro-batch's activations are alive. The loss
    and every metric are computed once from the log-probs of the whole mini-batch, so they are the
    one-shot values too (a min stays a min, a fraction a fraction).

    MoE models: a batch with `routing` replays the sampler's experts (Routing Replay);
    `metrics["load_balancing_loss"]` is the router load-balancing loss of the forward, added to the
    loss times `load_balancing_weight` (the reported `loss` is the objective's alone). With
    micro-batches it is the token-weighted mean of the micro-batches' losses (each is a product of
    means over its own tokens, so this is not exactly the one-shot value; the objective's gradient is).
    `shardings`: the program's in/out shardings (None: the one-device mesh; parameters and optimizer
    state donated), and every micro-batch is split over the batch devices like the mini-batch.

    `compiler_options`: XLA options of this program (`qwen3.kernels.update_compiler_options` of the
    platform, resolved by the trainer; None: the compiler's defaults).

    `rollout_correction`: each token's loss term is multiplied by the importance weight between
    `batch.old_logp` and `batch.sampler_logp` (`respo_jax.objectives.rollout_correction`; the batch must
    carry the sampler's log-probs), in the gradient and in the reported loss.

    `regularizers` (`respo_jax.objectives.regularizers`; None or inactive: none of this is traced):
    kl_coef > 0 adds kl_coef · agg(kl(log π_θ, batch.ref_logp)) to the loss (the batch carries the
    reference's log-probs); entropy_coef > 0 subtracts entropy_coef · agg(H), H the differentiable
    entropy of the policy's distribution from the same chunked head; both aggregated like the objective
    (its mode, the mini-batch denominator), so exact under micro-batching. An off-policy mask
    (`respo_jax.objectives.off_policy_masks`) multiplies the objective's token loss by its 0/1 weights,
    computed from the stop-gradient log-probs of the update; M2PO's batch-wide cutoff comes from the whole
    mini-batch (a forward pass before the micro-batch loop when it is split). Metrics: `kl_ref` (whenever
    the batch carries ref_logp), `entropy_bonus`, `off_policy_masked_fraction`.

    `decoupled` (AReaL's decoupled objective): `batch.old_logp` is π_prox's and each token's loss term is
    multiplied by π_prox / π_behaviour (`respo_jax.objectives.decoupled_weights`; the batch carries
    `behaviour_logp`).

    A batch whose `old_logp` is None (its own trace) is one whose π_old is `params`: log π_old is the
    stop-gradient of this update's own log-probs, so W = exp(log π_θ − sg(log π_θ)) = 1 with gradient
    ∇ log π_θ, what a separate forward pass would give up to round-off, without that pass. It is
    returned, with the token entropy of the same forward (a diagnostic), as
    `metrics[OLD_LOGPROBS_KEY] = {"old_logp", "token_entropy"}`, each [batch, response_len] (0 where
    masked), for the mini-batch's later uses and the metrics.
    """
    regs = regularizers if regularizers is not None and regularizers.active else None
    kl_estimator = "k3" if regularizers is None else regularizers.kl_estimator
    with_entropy = regs is not None and regs.entropy_coef > 0
    with_kl = regs is not None and regs.kl_coef > 0
    off_policy_mask = None if regs is None else regs.mask
    if off_policy_mask is not None and off_policy_mask.per_batch:
        mask_logprobs = make_logprob_fn(graphdef, temperature=temperature).fun  # traced inside the step

    def token_weight(part: PolicyBatch, logp=None, keep=None):
        """The rollout correction's weights times the off-policy mask's (`keep`, or from `logp`)."""
        weights = None
        if rollout_correction is not None:
            if part.sampler_logp is None:
                raise ValueError("rollout correction needs PolicyBatch.sampler_logp (the sampler's "
                                 "log-probs)")
            weights, _ = rollout_correction_weights(part.old_logp, part.sampler_logp, part.response_mask,
                                                    rollout_correction)
        if off_policy_mask is not None:
            if keep is None:
                keep = mask_weights(off_policy_mask, logp, part.old_logp, part.advantages, part.response_mask)
            weights = keep if weights is None else weights * keep
        if decoupled:
            if part.behaviour_logp is None:
                raise ValueError("the decoupled objective needs PolicyBatch.behaviour_logp")
            behaviour = decoupled_weights(part.old_logp, part.behaviour_logp, part.response_mask)
            weights = behaviour if weights is None else weights * behaviour
        return weights

    def logprobs_of(params, batch: PolicyBatch, old_from_forward: bool):
        """(logp, entropy or None), aux; the entropy also when log π_old comes from this forward (a
        diagnostic then, unless the entropy bonus differentiates it)."""
        model = nnx.merge(graphdef, params)
        return_entropy = with_entropy or old_from_forward
        values, aux = response_logprobs(
            model, batch.input_ids, batch.positions, batch.attention_mask, batch.prompt_len,
            temperature=temperature, chunk_size=chunk_size, routing=batch.routing, return_aux=True,
            prompt_group=batch.prompt_group, return_entropy=return_entropy, entropy_gradient=with_entropy)
        return (values if return_entropy else (values, None)), aux

    def regularizer_total(logp, entropy, part: PolicyBatch):
        if regs is None:
            return 0.0
        if with_kl and part.ref_logp is None:
            raise ValueError("a KL penalty needs PolicyBatch.ref_logp (the reference policy's log-probs)")
        return regs.loss_total(logp, part.ref_logp if with_kl else None, entropy, part.response_mask,
                               objective.aggregation, objective.loss_scale_factor)

    def place(part: PolicyBatch) -> PolicyBatch:
        return part if shardings is None else jax.lax.with_sharding_constraint(part, shardings.batch)

    def step(params, opt_state, batch: PolicyBatch, microbatch_rows: int | None = None):
        rows = batch.input_ids.shape[0]
        old_from_forward = batch.old_logp is None  # static: these parameters are π_old
        denominator = objective.denominator(batch.response_mask)
        input_tokens = jnp.maximum(jnp.sum(batch.attention_mask[:, :-1]), 1)

        def grad_of(part: PolicyBatch, keep=None):
            def loss_fn(p):
                (logp, entropy), aux = logprobs_of(p, part, old_from_forward)
                if old_from_forward:  # W = exp(logp - stop_gradient(logp)) = 1, its gradient ∇ logp
                    part_old = part.replace(old_logp=jax.lax.stop_gradient(logp))
                else:
                    part_old = part
                terms = objective.evaluate(logp, part_old.old_logp, part.advantages, part.response_mask,
                                           token_weight(part_old, logp, keep)).terms
                loss = safe_divide(terms.total + regularizer_total(logp, entropy, part), denominator)
                if aux is None:  # a dense model
                    return loss, (logp, entropy, None)
                aux = aux * jnp.sum(part.attention_mask[:, :-1]) / input_tokens  # this part's token share
                return loss + load_balancing_weight * aux, (logp, entropy, aux)

            (_, (logp, entropy, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return grads, logp, entropy, aux

        keep = None
        if microbatch_rows is None or microbatch_rows >= rows:
            grads, logp, entropy, aux = grad_of(batch)
        else:
            zeros = jax.tree.map(jnp.zeros_like, params)
            parts = split_microbatches(batch, microbatch_rows)
            if off_policy_mask is not None and off_policy_mask.per_batch:  # M2PO: the whole mini-batch's
                now = jax.lax.stop_gradient(mask_logprobs(params, batch, microbatch_rows))
                keep = mask_weights(off_policy_mask, now, now if old_from_forward else batch.old_logp,
                                    batch.advantages, batch.response_mask)
                parts = (parts, split_rows(keep, rows_per_microbatch=microbatch_rows))
            else:
                parts = (parts, None)

            def accumulate(total, args):
                part, part_keep = args
                grads, logp, entropy, aux = grad_of(place(part), part_keep)
                return jax.tree.map(jnp.add, total, grads), (logp, entropy, aux)

            grads, (logp, entropy, aux) = jax.lax.scan(accumulate, zeros, parts)
            logp, aux = logp.reshape(-1, logp.shape[-1])[:rows], None if aux is None else jnp.sum(aux)
            entropy = None if entropy is None else entropy.reshape(-1, entropy.shape[-1])[:rows]
        logp = jax.lax.stop_gradient(logp)
        if old_from_forward:  # kept for the metrics and the mini-batch's later uses, masked as recomputed
            valid = batch.response_mask > 0
            fresh = {"old_logp": jnp.where(valid, logp, 0.0),
                     "token_entropy": jnp.where(valid, jax.lax.stop_gradient(entropy), 0.0)}
            batch = batch.replace(old_logp=fresh["old_logp"])
        weights = token_weight(batch, logp, keep)
        out = objective.evaluate(logp, batch.old_logp, batch.advantages, batch.response_mask, weights)
        mask = batch.response_mask
        tokens = jnp.maximum(jnp.sum(mask), 1.0)
        kl = sequence_approx_kl(logp, batch.old_logp, mask)
        non_empty = jnp.sum(mask, axis=-1) > 0
        metrics = dict(out.metrics)
        metrics["approx_kl"] = jnp.sum(jnp.where(non_empty, kl, 0.0)) / jnp.maximum(jnp.sum(non_empty), 1.0)
        metrics["neg_logp"] = -jnp.sum(logp * mask) / tokens  # an entropy proxy
        metrics.update(regularizer_metrics(logp, entropy if with_entropy else None, batch, keep))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if aux is not None:
            metrics["load_balancing_loss"] = aux
        metrics = dict(metrics, loss=out.terms.loss(), grad_norm=optax.tree.norm(grads),
                       responses={**out.responses, "approx_kl": kl}, params_finite=tree_all_finite(params))
        if old_from_forward:
            metrics[OLD_LOGPROBS_KEY] = fresh
        return params, opt_state, metrics

    def regularizer_metrics(logp, entropy, batch: PolicyBatch, keep) -> dict:
        """kl_ref, entropy_bonus (each aggregated like the objective) and off_policy_masked_fraction."""
        metrics = {}
        mask = batch.response_mask

        def aggregated(values):
            terms = aggregation_terms(values, mask, objective.aggregation, objective.loss_scale_factor)
            return jax.lax.stop_gradient(terms.loss())

        if batch.ref_logp is not None:
            metrics["kl_ref"] = aggregated(kl_penalty(logp, batch.ref_logp, kl_estimator))
        if entropy is not None:
            metrics["entropy_bonus"] = aggregated(entropy)
        if off_policy_mask is not None:
            if keep is None:
                keep = mask_weights(off_policy_mask, logp, batch.old_logp, batch.advantages, mask)
            metrics["off_policy_masked_fraction"] = masked_fraction(keep, mask)
        return metrics

    if shardings is None:
        return Program(step, "policy_step", static_argnums=(3,), donate_argnums=(0, 1),
                       compiler_options=compiler_options)
    return Program(step, "policy_step", static_argnums=(3,), donate_argnums=(0, 1),
                   in_shardings=(shardings.params, shardings.opt_state, shardings.batch),
                   out_shardings=(shardings.params, shardings.opt_state, shardings.replicated),
                   compiler_options=compiler_options)


def make_logprob_fn(graphdef: nnx.GraphDef, temperature: float = 1.0, return_entropy: bool = False,
                    chunk_size: int | None = None, shardings: StepShardings | None = None) -> Program:
    """`logprobs(params, batch, microbatch_rows=None)` as a `Program`: log π(response | prompt) of a
    `PolicyBatch` under `params`, [batch, response_len] float32 (0 where masked), at the rollout
    `temperature`; `return_entropy`: also the entropy of the full distribution at each response token,
    `(logp, entropy)` — verl logs its token mean from this pass (actor/entropy). `microbatch_rows`
    (static) runs the batch that many rows at a time, so recomputing log π_old needs no more memory than
    one micro-batch. A batch with `routing` replays it (Routing Replay). `shardings`: its in/out
    shardings (outputs split like the batch; None: the one-device mesh). The head runs the model's
    `lm_head_forward_impl` kernel (no gradient is taken here), `chunk_size` tokens at a time (None: that
    kernel's `model.forward_chunk_tokens`)."""

    def logprobs(params, batch: PolicyBatch, microbatch_rows: int | None = None):
        def of(part: PolicyBatch):
            model = nnx.merge(graphdef, params)
            if shardings is not None:
                part = jax.lax.with_sharding_constraint(part, shardings.batch)
            chunk = chunk_size or forward_chunk_tokens(model.config.lm_head_forward_impl)
            return response_logprobs(model, part.input_ids, part.positions, part.attention_mask,
                                     part.prompt_len, temperature=temperature, return_entropy=return_entropy,
                                     chunk_size=chunk, routing=part.routing, forward_only=True,
                                     prompt_group=part.prompt_group)

        rows = batch.input_ids.shape[0]
        if microbatch_rows is None or microbatch_rows >= rows:
            out = of(batch)
        else:
            out = jax.lax.map(of, split_microbatches(batch, microbatch_rows))
            out = jax.tree.map(lambda x: x.reshape(-1, x.shape[-1])[:rows], out)
        valid = batch.response_mask > 0
        return jax.tree.map(lambda x: jnp.where(valid, x, 0.0), out)

    if shardings is None:
        return Program(logprobs, "logprobs", static_argnums=(2,))
    return Program(logprobs, "logprobs", static_argnums=(2,),
                   in_shardings=(shardings.params, shardings.batch), out_shardings=shardings.batch)


def old_logprobs_from_update(config: ExperimentConfig, old_logprobs_source: str) -> bool:
    """Whether the first update of a rollout batch takes log π_old from its own forward
    (`make_policy_step` with `old_logp=None`) instead of a separate pass: log π_old is recomputed
    (`old_logprobs_source`), rollouts are synchronous (the sampling parameters are the first update's)
    and nothing reads log π_old before that update (the KL in the reward does) or needs it of another
    policy (the decoupled objective's π_prox and behaviour are separate passes)."""
    objective = config.objective
    return (old_logprobs_source == "recompute" and config.rollout.async_steps == 0
            and not objective.kl_in_reward and not objective.decoupled)


def schedule_updates(config: ExperimentConfig) -> int:
    """Optimizer updates per learning-rate schedule step: N (`rollout.reuse`) with
    `optim.schedule_per="rollout"`, else 1 (`learning_rate_schedule`)."""
    return config.rollout.reuse if config.optim.schedule_per == "rollout" else 1


def run_optimizer(config: ExperimentConfig) -> optax.GradientTransformation:
    """The run's AdamW (`make_optimizer` with the `optim.*` fields and the run's warm-up length)."""
    opt = config.optim
    return make_optimizer(opt.learning_rate, opt.weight_decay, opt.b1, opt.b2, opt.max_grad_norm,
                          config.lr_warmup_steps, schedule_updates(config))


def run_step_programs(config: ExperimentConfig, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                      shardings: StepShardings, mesh, cache=None) -> tuple[Any, Program]:
    """A run's update step and its log π_old program, as the trainer and an ahead-of-time compile build
    them: `make_policy_step` with the configured objective (at `rollout.max_new_tokens`), rollout
    correction, regularizers and the update's compiler options for `mesh`'s platform, jitted by
    `jit_program` (`cache`: its exported-program cache, or None); and `make_logprob_fn` with the token
    entropy, at the rollout temperature."""
    r, objective = config.rollout, config.objective
    policy_step = jit_program(make_policy_step(
        graphdef, get_objective(objective.name, **objective.hparams).for_budget(r.max_new_tokens), tx,
        temperature=r.temperature, shardings=shardings, load_balancing_weight=objective.load_balancing_weight,
        rollout_correction=objective.correction(),
        compiler_options=qwen3.kernels.update_compiler_options(qwen3.kernels.platform(mesh)),
        regularizers=objective.regularizers(), decoupled=objective.decoupled), cache=cache)
    old_logprobs = make_logprob_fn(graphdef, temperature=r.temperature, return_entropy=True,
                                   shardings=shardings)
    return policy_step, old_logprobs


def make_sft_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, param_shardings=None,
                  opt_shardings=None, rows_sharding: NamedSharding | None = None) -> Program:
    """Supervised next-token step on `(input_ids, positions, attention_mask, loss_mask)`, all [batch, seq];
    loss_mask marks the target tokens (the response) to be predicted. Returns
    `(params, opt_state, loss, params_finite)`, a `Program` whose shardings are the parameters', the
    optimizer state's and the [batch, seq] inputs' `rows_sharding` (None: the one-device mesh)."""

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
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, tree_all_finite(params)

    if rows_sharding is None:
        return Program(step, "sft_step", donate_argnums=(0, 1))
    replicated = NamedSharding(rows_sharding.mesh, PartitionSpec())
    return Program(step, "sft_step", donate_argnums=(0, 1),
                   in_shardings=(param_shardings, opt_shardings) + (rows_sharding,) * 4,
                   out_shardings=(param_shardings, opt_shardings, replicated, replicated))
