"""Group-relative advantages (GRPO's estimator, used by every objective in the paper; App. B).

Each prompt's G responses are scored against their own group: A = (r - mean) / (std + eps) with the
unbiased (ddof = 1) standard deviation and eps = 1e-6. A group of identical rewards, or a group of a
single response, carries no relative signal and gets advantage exactly 0. Dr.GRPO drops the division
by the standard deviation (``normalize_by_std=False``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from respo_jax.objectives.validation import is_concrete

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards, normalize_by_std: bool = True, eps: float = ADVANTAGE_EPS) -> jax.Array:
    """Advantages ``[prompts, G]`` float32 from ``rewards: [prompts, G]`` (G responses per prompt).

    normalize_by_std=True: (r - mean) / (std_ddof1 + eps) (GRPO); False: r - mean (Dr.GRPO).
    """
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape [prompts, G]; got shape {tuple(rewards.shape)}")
    if not (
        jnp.issubdtype(rewards.dtype, jnp.floating)
        or jnp.issubdtype(rewards.dtype, jnp.integer)
        or rewards.dtype == jnp.bool_
    ):
        raise ValueError(f"rewards must be real numbers; got dtype {rewards.dtype}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if is_concrete(rewards) and not np.all(np.isfinite(np.asarray(rewards, np.float64))):
        raise ValueError("rewards contain NaN or inf")
    rewards = rewards.astype(jnp.float32)
    group_size = rewards.shape[1]
    if group_size < 2:
        return jnp.zeros_like(rewards)
    mean = jnp.mean(rewards, axis=1, keepdims=True)
    identical = jnp.max(rewards, axis=1, keepdims=True) == jnp.min(rewards, axis=1, keepdims=True)
    centered = jnp.where(identical, 0.0, rewards - mean)
    if not normalize_by_std:
        return centered
    std = jnp.sqrt(jnp.sum(centered**2, axis=1, keepdims=True) / (group_size - 1))
    return centered / (std + eps)
