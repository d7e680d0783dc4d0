"""Qwen3-30B-A3B-Base (MoE) with ReSPO on DAPO-Math-17k, as in the paper (§4.1, App. D.1): responses up to
8,192 tokens with DAPO's soft overlong penalty (0 through 4,096 tokens, linear to -1 at 8,192).

    python -m experiments.train --config experiments/configs/qwen3_30b_a3b_dapo.py \
        model.checkpoint_dir=/ckpt/Qwen3-30B-A3B-Base task.data_dir=/data \
        task.tokenizer_dir=/ckpt/Qwen3-30B-A3B-Base [rollout.reuse=16]
"""

from experiments.configs._paper_dapo import paper_dapo_config
from respo_jax.training.config import ExperimentConfig


# Rollout engine (see _paper_dapo.py): Qwen3-30B-A3B's bfloat16 K/V is 48 layers x 4 kv heads x 128 x 2
# x 2 B = 96 KiB per token, so 32 GiB hold ~350k tokens: 128 slots at ~2.7k tokens each (a slot holds
# ~2.9k on average at the 8,192 cap, fewer with the overlong penalty shortening responses).
def get_config() -> ExperimentConfig:
    return paper_dapo_config(max_new_tokens=8_192, out_dir="runs/qwen3_30b_a3b_dapo", max_slots=128,
                             kv_cache_bytes=32 * 2**30, task={"overlong_buffer_length": 4_096})
