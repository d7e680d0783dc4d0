"""The paper's shared training settings (§4.1, Tabs. 2-3) on DAPO-Math-17k, for the two model configs.

Not a runnable config itself (no get_config): `qwen3_1p7b_dapo.py` and `qwen3_30b_a3b_dapo.py` add what
differs per model. The objective's own registered settings apply: ReSPO, VESPO and GRPO aggregate with
token-mean (Tab. 2), GSPO with seq-mean-token-mean as verl's GSPO loss always does.
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


def paper_dapo_config(
    max_new_tokens: int, out_dir: str, overlong_buffer_length: int = 0, overlong_penalty_factor: float = 1.0
) -> ExperimentConfig:
    """M = 32 prompts x G = 8 responses per mini-batch, N = 8 mini-batches per rollout batch (16 / 32 by
    override: rollout.reuse=16), 1,024 policy updates whatever N; AdamW lr 1e-6, weight decay 0.1, grad
    clip 1.0, warm-up over the first 5% of rollout batches (first batch at lr 0), no KL term; bfloat16
    compute on float32 parameters. Paths are the user's: model.checkpoint_dir, task.data_dir,
    task.tokenizer_dir (a run without them stops at start-up naming them)."""
    return ExperimentConfig(
        model=ModelConfig(preset="", dtype="bfloat16", param_dtype="float32", remat=True),
        task=TaskConfig(
            name="dapo_math",
            chat_template=True,
            max_prompt_tokens=1024,
            overlong_buffer_length=overlong_buffer_length,
            overlong_penalty_factor=overlong_penalty_factor,
        ),
        rollout=RolloutConfig(
            prompts_per_minibatch=32, group_size=8, reuse=8, max_new_tokens=max_new_tokens,
            temperature=1.0, top_p=1.0, top_k=0,
        ),
        objective=ObjectiveConfig(name="respo"),
        optim=OptimConfig(
            learning_rate=1e-6, weight_decay=0.1, b1=0.9, b2=0.999, max_grad_norm=1.0,
            warmup_ratio=0.05, schedule_per="rollout",
        ),
        warmup=WarmupConfig(steps=0),
        run=RunConfig(policy_updates=1024, out_dir=out_dir, eval_problems=0, checkpoint_every=8),
    )
