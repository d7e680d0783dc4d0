"""The benchmark suite (`python -m experiments.benchmarks`, `__main__`) and its side-by-side benchmarks.

  common                  measurement plumbing: A/B alternation, sides in their own processes, timings
  matmul_peak             the machine's measured matmul peak
  roofline                model FLOPs of a train and a decode step, and MFU against that peak
  train_step              respo-jax's jitted policy step vs transformers + PyTorch on the same model
  objective_cost          what the ReSPO objective costs within a train step
  scaling                 how the train step scales; dropless MoE against the dense alternative
  lm_head                 the LM head's log-probs, chunked kernel vs the whole-vocabulary form
  decode_vs_transformers  the JAX sampler's generation throughput vs `transformers.generate`
  rollout_engine          the rollout engine on the paper's length distribution
  rl_iteration            end-to-end RL iterations: respo-jax's trainer vs TRL's GRPOTrainer
  async_timeline          when rollout and trainer devices are busy under asynchronous rollouts
  accelerator             the paper's Qwen3-1.7B shapes in bfloat16 on a GPU/TPU
"""
