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

from respo_jax.training.config import derive
from respo_jax.training.sweep import StarvationConfig


def get_config() -> StarvationConfig:
    """`StarvationConfig()` (whose sweep section is this study's grid) with the study's model, task and
    step sizes."""
    return derive(
        StarvationConfig(),
        model={"scan_layers": False},
        task={"difficulty": "scratchpad"},
        rollout={"prompts_per_minibatch": 4, "max_new_tokens": 64},
        optim={"learning_rate": 1e-4},
        warmup={"steps": 300},
        run={"eval_problems": 256, "progress": False},
    )


def get_quick_config() -> StarvationConfig:
    return derive(get_config(), warmup={"steps": 150},
                  sweep={"reuse": "1,8", "seeds": "0", "policy_updates": 32,
                         "runs_dir": "runs/gradient_starvation_quick",
                         "out_dir": "runs/gradient_starvation_quick/results"})
