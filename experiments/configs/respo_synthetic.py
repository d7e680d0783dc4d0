"""Default main job: ReSPO on the synthetic arithmetic task with a tiny Qwen3, on CPU, in minutes.

Shape of paper §4.1 at CPU scale: M prompts per mini-batch, G responses per prompt, a rollout batch
reused for N mini-batch updates (off-policy drift grows with N), strict-box reward, token-mean loss.
The base is `ExperimentConfig()` (the tiny model, the easy synthetic task, ReSPO, M = G = 8, N = 4);
this file says what differs.
"""

from respo_jax.training.config import ExperimentConfig, derive


def get_config() -> ExperimentConfig:
    return derive(
        ExperimentConfig(),
        model={"scan_layers": False},  # unrolled: faster on CPU
        # Every prompt of the task is 12 tokens: the rollout's default bucket (sized for DAPO-Math's prompts)
        # would pad each sequence to 262 positions instead of 22, in the sampler and in every update.
        rollout={"max_new_tokens": 6, "prompt_bucket": 16},
        optim={"learning_rate": 2e-4},
        warmup={"steps": 80},
        # A CPU run of minutes: checkpoints by count (run.checkpoint_every) or at a signal, not by the clock.
        run={"iterations": 300, "checkpoint_every_minutes": 0.0},
    )
