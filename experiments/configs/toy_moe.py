"""A tiny Qwen3-MoE (8 experts, top-2) on the synthetic task: the sharded / expert-parallel path at CPU
scale, with Routing Replay and the router load-balancing loss on.

    python -m experiments.train --config experiments/configs/toy_moe.py
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train \
        --config experiments/configs/toy_moe.py mesh.data=2 mesh.expert=4

Every batch (M·G = 16 responses per mini-batch in two micro-batches of 8, 32 warm-up sequences) splits
evenly over up to 8 data-parallel devices (data × fsdp × expert); experts over up to 8 `expert` devices,
heads over 2 `tensor`.
"""

from respo_jax.training.config import ExperimentConfig, derive


def get_config() -> ExperimentConfig:
    return derive(
        ExperimentConfig(),
        model={"preset": "tiny-moe", "scan_layers": False},
        # Prompts padded to 32 tokens; 16 responses of 32 + 6 tokens per mini-batch split into two
        # micro-batches of 8 (320 tokens at most each), so accumulation runs on every mesh.
        rollout={"prompts_per_minibatch": 2, "reuse": 2, "max_new_tokens": 6, "routing_replay": True,
                 "prompt_bucket": 32, "max_tokens_per_microbatch": 320},
        objective={"load_balancing_weight": 0.001},
        optim={"learning_rate": 2e-4},
        warmup={"steps": 40, "batch_size": 32},
        run={"iterations": 20, "out_dir": "runs/toy_moe", "eval_problems": 16},
    )
