"""Gradient starvation at CPU scale: {GRPO, GSPO, VESPO, ReSPO} x N in {1, 8, 32} x 3 seeds, matched.

The paper's protocol (§4.1) shrunk to two CPU cores: every cell runs the same number of policy updates
from one shared base model, with mini-batches of M prompts x G responses, a rollout batch of N*M
prompts reused for N consecutive updates, strict-box reward, no KL. The task is multi-step arithmetic
with its work written out (`scratchpad`: responses of 16-46 tokens, positive ones ~27 on the base model)
and a disjoint held-out test split. How these values were chosen (one pilot, the same for every method):
README, "Gradient starvation at CPU scale".

`get_quick_config()` is the reduced sweep of `--quick` (minutes): all four objectives, N in {1, 8},
one seed, a short run.
"""

import dataclasses

from respo_jax.training.config import ModelConfig, OptimConfig, RolloutConfig, RunConfig, TaskConfig, WarmupConfig
from respo_jax.training.sweep import StarvationConfig, SweepConfig


def get_config() -> StarvationConfig:
    return StarvationConfig(
        model=ModelConfig(preset="tiny", scan_layers=False),
        task=TaskConfig(name="synthetic", difficulty="scratchpad", seed=0),
        rollout=RolloutConfig(prompts_per_minibatch=4, group_size=8, max_new_tokens=64),
        optim=OptimConfig(learning_rate=1e-4, max_grad_norm=1.0),
        warmup=WarmupConfig(steps=300, batch_size=64, learning_rate=3e-3),
        run=RunConfig(eval_problems=256, progress=False),
        sweep=SweepConfig(objectives="grpo,gspo,vespo,respo", reuse="1,8,32", seeds="0,1,2",
                          policy_updates=256, runs_dir="runs/gradient_starvation",
                          out_dir="experiments/results/gradient_starvation"),
    )


def get_quick_config() -> StarvationConfig:
    config = get_config()
    return dataclasses.replace(
        config,
        warmup=dataclasses.replace(config.warmup, steps=150),
        sweep=dataclasses.replace(config.sweep, reuse="1,8", seeds="0", policy_updates=32,
                                  runs_dir="runs/gradient_starvation_quick",
                                  out_dir="runs/gradient_starvation_quick/results"),
    )
