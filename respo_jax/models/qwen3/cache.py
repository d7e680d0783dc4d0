"""Preallocated key/value cache for incremental decoding.

A forward with ``cache=c`` writes its ``s`` new tokens into slots ``[c.index, c.index + s)`` with
``dynamic_update_slice`` (fixed shapes: one compiled decode step serves every position), marks the
real ones valid, and attends causally over valid slots up to each query's own slot. Left-padded
prompts therefore keep their pads as invalid slots; positions are passed explicitly.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from respo_jax.models.qwen3.config import Qwen3Config

# Logical axes of the cache's k and v (``respo_jax.sharding.ShardingRules``): the batch is split like
# the activations' batch, kv heads like the attention weights, the slots by ``cache_sequence``.
CACHE_AXES = ("layers", "batch", "cache_sequence", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
    """k, v: [num_layers, batch, max_len, num_kv_heads, head_dim]; valid: [batch, max_len] bool (slot
    holds a real, non-pad token); index: int32 scalar, the next slot to write."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for ``batch`` sequences of at most ``max_len`` tokens (prompt + generation)."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"cache needs batch > 0 and max_len > 0, got batch={batch}, max_len={max_len}")
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   valid=jnp.zeros((batch, max_len), jnp.bool_), index=jnp.zeros((), jnp.int32))
