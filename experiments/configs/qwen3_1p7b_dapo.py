"""Qwen3-1.7B-Base with ReSPO on DAPO-Math-17k, as in the paper (§4.1, Tab. 2): responses up to 15,360 tokens.

    python -m experiments.train --config experiments/configs/qwen3_1p7b_dapo.py \
        model.checkpoint_dir=/ckpt/Qwen3-1.7B-Base task.data_dir=/data \
        task.tokenizer_dir=/ckpt/Qwen3-1.7B-Base [rollout.reuse=16] [objective.name=vespo]
"""

from experiments.configs._paper_dapo import paper_dapo_config
from respo_jax.training.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    return paper_dapo_config(max_new_tokens=15_360, out_dir="runs/qwen3_1p7b_dapo")
