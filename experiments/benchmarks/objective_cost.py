"""What the ReSPO objective itself costs, as a fraction of a whole train step.

Two measurements. *Isolated*: the jitted value-and-gradient of the objective with respect to the
log-probs on the step's [batch, response_len] arrays (everything the objective adds to the step:
log W, the kernel φ of Eq. 12, the token-mean loss, the diagnostics, and the backward into logp).
*In step* (slower, optional): the trainer's step with ReSPO against the same step with a bare
token-mean −log π loss, alternated; the difference is the objective's share, but it is usually below
the run-to-run noise of a multi-second step, so the isolated number is the headline.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import train_step
from experiments.benchmarks.common import alternate, median, speedup, summarize
from respo_jax.models import qwen3
from respo_jax.objectives import get_objective
from respo_jax.training.step import make_optimizer, make_policy_step
from respo_jax.programs import Program


def _objective_grad_fn(objective) -> Callable:
    """jit of (logp, old_logp, advantages, mask) -> (loss, d loss / d logp, metrics)."""

    def loss_and_grad(logp, old_logp, advantages, mask):
        (loss, metrics), grad = jax.value_and_grad(
            lambda lp: objective(lp, old_logp, advantages, mask), has_aux=True)(logp)
        return loss, grad, metrics

    return Program(loss_and_grad, "objective_loss_and_grad")


def isolated_seconds(batch: dict, rounds: int = 7, calls_per_round: int = 50) -> dict:
    """Median seconds of one jitted objective value-and-grad on the batch's response arrays."""
    rng = np.random.default_rng(1)
    mask = jnp.asarray(batch["response_mask"])
    old_logp = jnp.asarray(batch["old_logp"])
    logp = old_logp + 0.05 * jnp.asarray(rng.standard_normal(mask.shape), jnp.float32) * mask
    advantages = jnp.asarray(batch["advantages"])
    fn = _objective_grad_fn(get_objective("respo", **train_step.RESPO))

    def call():
        for _ in range(calls_per_round):
            out = fn(logp, old_logp, advantages, mask)
        jax.block_until_ready(out)

    times = alternate({"objective": call}, rounds=rounds, warmup=1)["objective"]
    per_call = [t / calls_per_round for t in times]
    return summarize(per_call)


def _token_mean_nll(logp, old_logp, advantages, mask):
    """The cheapest objective with the same interface: token-mean of −log π (no kernel, no metrics)."""
    return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0), {}


def in_step(case: train_step.TrainCase, rounds: int = 3, seed: int = 0) -> dict:
    """The trainer's step with ReSPO vs with a bare token-mean NLL, alternated on the same batch."""
    batch = train_step.make_batch(case, seed)
    model = qwen3.Qwen3ForCausalLM(case.config, rngs=nnx.Rngs(seed))
    respo_call, _ = train_step.jax_side(model, batch)
    graphdef, params = nnx.split(qwen3.Qwen3ForCausalLM(case.config, rngs=nnx.Rngs(seed)))
    tx = make_optimizer(**train_step.OPTIMIZER)
    bare_step = make_policy_step(graphdef, _token_mean_nll, tx)
    state = {"params": params, "opt_state": tx.init(params)}
    policy_batch = respo_call.batch

    def bare_call():
        state["params"], state["opt_state"], _ = bare_step(state["params"], state["opt_state"], policy_batch)
        jax.block_until_ready((state["params"], state["opt_state"]))

    times = alternate({"respo": respo_call, "token_mean_nll": bare_call}, rounds=rounds, warmup=1)
    respo_s, bare_s = median(times["respo"]), median(times["token_mean_nll"])
    return {"respo": summarize(times["respo"]), "token_mean_nll": summarize(times["token_mean_nll"]),
            "fraction": (respo_s - bare_s) / respo_s,
            "ratio_respo_over_nll": 1.0 / speedup(times["respo"], times["token_mean_nll"])}


def run(case: str | train_step.TrainCase, step_seconds: float, with_in_step: bool = False,
        seed: int = 0) -> dict:
    """{"objective_seconds", "step_seconds", "objective_fraction", ("in_step")}: the objective's
    isolated cost relative to `step_seconds` (the median of the measured train step of `case`)."""
    case = train_step.CASES[case] if isinstance(case, str) else case
    started = time.perf_counter()
    isolated = isolated_seconds(train_step.make_batch(case, seed))
    out = {"case": case.name, "objective": "respo", "objective_seconds": isolated["median_s"],
           "objective_timing": isolated, "step_seconds": step_seconds,
           "objective_fraction": isolated["median_s"] / step_seconds}
    if with_in_step:
        out["in_step"] = in_step(case, seed=seed)
    out["wall_s"] = time.perf_counter() - started
    return out
