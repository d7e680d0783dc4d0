"""Gradient starvation at CPU scale, second study: each method at its own step size, controls
that attribute the effect, sampled held-out accuracy, and a long-response regime.

The first study's setting (`gradient_starvation.py`: the tiny model, the scratchpad task, M = 4 x G = 8,
the same 300-step base model) with:
- lr in {2.5e-5, 5e-5, 1e-4} at 1,024 / 512 / 256 policy updates (lr x updates fixed), N in {1, 32}
  (at N = 1 only GRPO, standing for GRPO = VESPO = ReSPO = REINFORCE there since W = 1, and GSPO), report
  seeds 0-2 and selection seed 3, on which each (objective, N) gets its lr by the rule in
  `respo_jax.training.sweep.select_learning_rate`;
- three controls, registered here with `kernel_objective` (no package edit), at N = 32 at the common lr
  (1e-4) and at their own selected lr: `reinforce` (phi = 1: no trust region, no reshaping),
  `respo_vespo` (ReSPO's phi+ with VESPO's phi-, (beta, lam) = (3, 2) of Tab. 3) and `vespo_respo` (VESPO's
  phi+, (2, 3), with ReSPO's phi-);
- held-out greedy accuracy and sampled pass@1 (T = 1, top-p 0.7, 8 samples) on 512 test problems;
- the long-response regime (`scratchpad_long`, 12-16 operands, responses of ~80-160 tokens) at N in
  {8, 32}, each objective at its selected lr of N = 32, one seed (three do not fit the CPU budget).

`get_quick_config()` is `--quick` (about ten minutes): every part of the study on a small scale.
"""

import jax.numpy as jnp

from respo_jax.objectives import kernel_objective, register_objective
from respo_jax.objectives.kernels import respo_kernel, vespo_kernel
from experiments.configs.gradient_starvation import get_config as first_study_config
from respo_jax.training.config import derive
from respo_jax.training.sweep import StarvationConfig


def reinforce_phi(log_w, advantages):
    """phi = 1 for every response: plain REINFORCE on stale data (no trust region, no reshaping)."""
    return jnp.ones_like(log_w)


def respo_pos_vespo_neg_phi(log_w, advantages):
    """ReSPO's phi+ (its paper kernel) for A >= 0, VESPO's phi- = W^3 e^(2 (1 - W)) for A < 0."""
    one = jnp.ones_like(log_w)
    return jnp.where(advantages >= 0, respo_kernel(log_w, one), vespo_kernel(log_w, -one))


def vespo_pos_respo_neg_phi(log_w, advantages):
    """The mirror: VESPO's phi+ = W^2 e^(3 (1 - W)) for A >= 0, ReSPO's phi- for A < 0."""
    one = jnp.ones_like(log_w)
    return jnp.where(advantages >= 0, vespo_kernel(log_w, one), respo_kernel(log_w, -one))


CONTROLS = {"reinforce": reinforce_phi, "respo_vespo": respo_pos_vespo_neg_phi,
            "vespo_respo": vespo_pos_respo_neg_phi}


def register_controls() -> None:
    """Registers the controls (token-mean, as ReSPO; again on a reload of this file: replace=True)."""
    for name, kernel in CONTROLS.items():
        register_objective(name, kernel_objective(kernel), replace=True)


def get_config() -> StarvationConfig:
    register_controls()
    return derive(
        first_study_config(),  # its model, task, M x G, base model and common lr (1e-4)
        # prompt_bucket: the padding the committed cells ran with (the package default is now 256)
        rollout={"prompt_bucket": 128},
        run={"eval_problems": 512, "eval_samples": 8},  # sampled pass@1 at the defaults T = 1, top-p 0.7
        sweep={"reuse": "1,32", "runs_dir": "experiments/results/gradient_starvation_v2/runs",
               "out_dir": "experiments/results/gradient_starvation_v2", "learning_rates": "2.5e-5,5e-5,1e-4",
               "on_policy_objectives": "grpo,gspo", "selection_seed": 3, "controls": ",".join(CONTROLS),
               "long_difficulty": "scratchpad_long", "long_max_new_tokens": 200, "long_seeds": "0"},
    )


def get_quick_config() -> StarvationConfig:
    return derive(
        get_config(),
        warmup={"steps": 150},
        run={"eval_problems": 64, "eval_samples": 4},
        sweep={"objectives": "grpo,respo", "reuse": "1,4", "seeds": "0", "policy_updates": 8,
               "learning_rates": "5e-5,1e-4", "on_policy_objectives": "grpo", "selection_seed": 1,
               "controls": "reinforce", "long_reuse": "4", "runs_dir": "runs/gradient_starvation_v2_quick",
               "out_dir": "runs/gradient_starvation_v2_quick/results"},
    )
