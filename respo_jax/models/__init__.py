"""Model implementations (Flax NNX). ``from respo_jax.models import qwen3``.

  qwen3  Qwen3 and Qwen3-MoE, matched to ``transformers``: config, layers, attention, MLP and MoE, the
         KV cache, the LM head's chunked log-probs, kernel choices, Hugging Face checkpoints
"""
