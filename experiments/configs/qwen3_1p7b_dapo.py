"""Qwen3-1.7B-Base with ReSPO on DAPO-Math-17k, as in the paper (§4.1, Tab. 2): responses up to 15,360 tokens.

    python -m experiments.train --config experiments/configs/qwen3_1p7b_dapo.py \
        model.checkpoint_dir=/ckpt/Qwen3-1.7B-Base task.data_dir=/data \
        task.tokenizer_dir=/ckpt/Qwen3-1.7B-Base [rollout.reuse=16] [objective.name=vespo]
"""

from experiments.configs._paper_dapo import paper_dapo_config
from respo_jax.training.config import ExperimentConfig


# Rollout engine (see _paper_dapo.py): Qwen3-1.7B's bfloat16 K/V is 28 layers x 8 kv heads x 128 x 2 x
# 2 B = 112 KiB per token, so 32 GiB hold ~300k tokens: 64 slots at ~4.7k tokens each (a slot holds
# ~5.5k on average at this cap: admission waits now and then rather than over-allocating).
def get_config() -> ExperimentConfig:
    return paper_dapo_config(max_new_tokens=15_360, out_dir="runs/qwen3_1p7b_dapo", max_slots=64,
                             kv_cache_bytes=32 * 2**30)
