"""Model implementations (Flax NNX). ``from respo_jax.models import qwen3``."""
