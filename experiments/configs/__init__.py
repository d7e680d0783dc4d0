"""Experiment config files: each defines `get_config()` (some also `get_quick_config()`) returning its
config as its base with what differs (`respo_jax.config.derive`).

  respo_synthetic         the default run: ReSPO on the synthetic task, tiny Qwen3, CPU
  toy_moe                 a tiny Qwen3-MoE with Routing Replay (the sharded / expert-parallel path)
  async_staleness         respo_synthetic shortened, for the staleness grid
  gradient_starvation     the gradient-starvation sweep at CPU scale; gradient_starvation_v2 its second study
  qwen3_1p7b_dapo         the paper's Qwen3-1.7B-Base run on DAPO-Math-17k
  qwen3_30b_a3b_dapo      the paper's Qwen3-30B-A3B-Base (MoE) run; both from _paper_dapo's shared settings
  eval_paper              the paper's evaluation protocol
"""
