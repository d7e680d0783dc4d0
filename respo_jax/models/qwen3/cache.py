"""Preallocated key/value cache for incremental decoding.

A forward with ``cache=c`` writes its ``s`` new tokens into slots ``[c.index, c.index + s)`` with
``dynamic_update_slice`` (fixed shapes: one compiled decode step serves every position), marks the
real ones valid, and attends causally over valid slots up to each query's own slot. Left-padded
prompts therefore keep their pads as invalid slots; positions are passed explicitly.

The forward uses a cache through four methods, the interface `paged_attention.PagedKVCache` (the
rollout engine's paged pool) shares: ``view`` (what every layer needs, computed once per forward),
``update`` (write a layer's new K/V), ``attend`` (a layer's queries over its cached keys) and
``advance`` (the cache after the forward).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from respo_jax.models.qwen3.attention import attention_mask_from_slots, dot_product_attention
from respo_jax.models.qwen3.config import Qwen3Config
from respo_jax.models.qwen3.layers import BATCH, constrain

# Logical axes of the cache's k and v (``respo_jax.sharding.ShardingRules``): the batch is split like
# the activations' batch, kv heads like the attention weights, the slots by ``cache_sequence``.
CACHE_AXES = ("layers", "batch", "cache_sequence", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class DenseView:
    """One forward's slots: valid [batch, max_len] bool after the write; mask [batch, seq, max_len]
    bool (causal over valid slots)."""

    valid: jax.Array
    mask: jax.Array


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

    def view(self, positions: jax.Array, token_mask: jax.Array, cfg: Qwen3Config) -> DenseView:
        """token_mask: [batch, seq] bool (real tokens); positions are not needed (slots are the index)."""
        del positions
        valid = jax.lax.dynamic_update_slice(self.valid, token_mask, (0, self.index))
        valid = constrain(valid, (BATCH, "cache_sequence"), cfg)
        query_slots = self.index + jnp.arange(token_mask.shape[1], dtype=jnp.int32)
        return DenseView(valid=valid, mask=attention_mask_from_slots(query_slots, valid))

    def update(self, layer, k: jax.Array, v: jax.Array, view: DenseView, cfg: Qwen3Config) -> KVCache:
        """Write k, v [batch, seq, kv_heads, head_dim] of layer `layer` at slots [index, index + seq)."""
        start = (layer, 0, self.index, 0, 0)

        def write(cached, new):
            cached = jax.lax.dynamic_update_slice(cached, new[None].astype(cached.dtype), start)
            return constrain(cached, CACHE_AXES, cfg)

        return self.replace(k=write(self.k, k), v=write(self.v, v))

    def attend(self, layer, q: jax.Array, view: DenseView, scale: float) -> jax.Array:
        """q: [batch, seq, heads, head_dim] over every slot of layer `layer` (masked) -> q's shape."""
        keys = jax.lax.dynamic_index_in_dim(self.k, layer, 0, keepdims=False).astype(q.dtype)
        values = jax.lax.dynamic_index_in_dim(self.v, layer, 0, keepdims=False).astype(q.dtype)
        return dot_product_attention(q, keys, values, view.mask, scale)

    def advance(self, view: DenseView) -> KVCache:
        """The cache after a forward of `seq` tokens: their slots valid where real, index + seq."""
        return self.replace(valid=view.valid, index=self.index + view.mask.shape[1])


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for ``batch`` sequences of at most ``max_len`` tokens (prompt + generation)."""
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"cache needs batch > 0 and max_len > 0, got batch={batch}, max_len={max_len}")
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   valid=jnp.zeros((batch, max_len), jnp.bool_), index=jnp.zeros((), jnp.int32))
