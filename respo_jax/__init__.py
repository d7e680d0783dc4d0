"""respo-jax: off-policy RL for LLM reasoning in JAX, built around ReSPO (Reshaped Sequence Policy Optimization).

Subpackages (import the one you need; nothing heavy is imported here):
  objectives  pure policy objectives (ReSPO, VESPO, GSPO, GRPO), group advantages, loss aggregation
  models      Qwen3 (dense and MoE) in Flax NNX with Hugging Face safetensors in and out
  sampling    a jitted JAX sampler with a KV cache that returns exact sampling log-probs
  rewards     DAPO strict-box verifier, overlong penalty, Math-Verify evaluator
  data        benchmark/training datasets, prompts, tokenizers, a synthetic verifiable task
  symbolic    SymPy proofs of the paper's derivations (App. A), tied to the JAX kernels
"""

__version__ = "0.1.0"
