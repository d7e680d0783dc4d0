"""Default main job: ReSPO on the synthetic arithmetic task with a tiny Qwen3, on CPU, in minutes.

Shape of paper §4.1 at CPU scale: M prompts per mini-batch, G responses per prompt, a rollout batch
reused for N mini-batch updates (off-policy drift grows with N), strict-box reward, token-mean loss.
"""

from respo_jax.training.config import (
    ExperimentConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    WarmupConfig,
)


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig(preset="tiny", scan_layers=False),  # unrolled: faster on CPU
        task=TaskConfig(name="synthetic", difficulty="easy", seed=0),
        # Every prompt of the task is 12 tokens: the default bucket of 128 (sized for DAPO-Math's prompts)
        # would pad each sequence to 134 positions instead of 22, in the sampler and in every update.
        rollout=RolloutConfig(prompts_per_minibatch=8, group_size=8, reuse=4, max_new_tokens=6,
                              prompt_bucket=16),
        objective=ObjectiveConfig(name="respo"),
        optim=OptimConfig(learning_rate=2e-4, max_grad_norm=1.0),
        warmup=WarmupConfig(steps=80, batch_size=64, learning_rate=3e-3),
        # A CPU run of minutes: checkpoints by count (run.checkpoint_every) or at a signal, not by the clock.
        run=RunConfig(iterations=300, seed=0, out_dir="runs/respo_synthetic", checkpoint_every_minutes=0.0),
    )
