"""Grouped-query self-attention of Qwen3: q/k/v projections, per-head RMSNorm on q and k, rotary
embeddings, and one masked score/value matmul pair over either the new tokens or the KV cache.

The mask is built once per forward from *slots* (sequence indices, or cache slots when decoding) and a
per-slot validity flag, so the same kernel serves training (causal + padding) and cached decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models.qwen3.config import Qwen3Config
from respo_jax.models.qwen3.layers import BATCH, HIDDEN, SEQ, RMSNorm, apply_rope, constrain, make_param, rows


def attention_mask_from_slots(query_slots: jax.Array, key_valid: jax.Array) -> jax.Array:
    """Causal + validity mask.

    query_slots: [seq] int (slot of each query token); key_valid: [batch, keys] bool (slot holds a real
    token) -> [batch, seq, keys] bool: key slot t is visible to query i iff valid and t <= slot(i).
    """
    key_slots = jnp.arange(key_valid.shape[1], dtype=jnp.int32)
    causal = key_slots[None, :] <= query_slots[:, None]
    return causal[None, :, :] & key_valid[:, None, :]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                          scale: float) -> jax.Array:
    """Grouped-query attention without repeating k/v.

    q: [batch, seq, heads, head_dim]; k, v: [batch, keys, kv_heads, head_dim]; mask: [batch, seq, keys]
    bool -> [batch, seq, heads, head_dim]. Scores and softmax are float32; a fully masked row (a pad
    query) gets uniform weights instead of NaN, as with transformers' finite mask value.
    """
    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, s, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


# Query rows per block of `causal_block_attention`. On CPU the small benchmark config (seq 511) is flat
# between 64 and 256; the tiny one (seq 127) is faster at 64 than at 128: two causal blocks skip a quarter
# of the score FLOPs (docs/results/benchmarks.md).
CAUSAL_BLOCK = 64
# The most query blocks a sequence is cut into. The blocks are unrolled in the program, so its compile
# time grows with their number (fewer, wider blocks also ran faster: docs/results/measurements.md).
MAX_CAUSAL_BLOCKS = 4


def causal_block_rows(seq: int, block: int = CAUSAL_BLOCK, max_blocks: int = MAX_CAUSAL_BLOCKS) -> int:
    """Query rows per block for a sequence of `seq` tokens: `block`, or the smallest multiple of it that
    cuts the sequence into at most `max_blocks` blocks (so a program's size stays bounded whatever the
    sequence length)."""
    if block < 1 or max_blocks < 1 or seq < 0:
        raise ValueError(f"need block >= 1, max_blocks >= 1 and seq >= 0; got {block}, {max_blocks}, {seq}")
    per_block = -(-seq // max_blocks)
    return max(block, -(-per_block // block) * block)


def causal_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                           block: int | None = None) -> jax.Array:
    """`dot_product_attention` of a sequence over itself (no cache: key t is query t), in query blocks
    that only score the keys a causal mask can let through: rows [start, end) against keys [0, end).
    Skips ~half of the score/value FLOPs and of the float32 [.., seq, keys] buffers, and runs each
    block as [batch, kv_heads, group·rows, head_dim] matmuls: attention forward + backward ~2× faster
    on CPU (docs/results/benchmarks.md). `block` rows per query block (None: `causal_block_rows`
    of the sequence, at most `MAX_CAUSAL_BLOCKS` blocks). Batch and kv_heads stay separate dimensions,
    so a mesh can split them (over data and tensor axes) without any resharding.

    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]; mask: [batch, seq, seq]
    bool and causal -> [batch, seq, heads, head_dim]. Rows with a visible key equal
    `dot_product_attention`; a fully masked row (a left-pad query) gets uniform weights over its
    block's keys [0, end) instead of all keys — a pad's output is never read by a real token.
    """
    b, s, h, d = q.shape
    if k.shape[1] != s or mask.shape[-2:] != (s, s):
        raise ValueError(f"causal_block_attention needs keys == queries; got q {q.shape}, k {k.shape}, "
                         f"mask {mask.shape}")
    block = causal_block_rows(s) if block is None else block
    if s <= block:
        return dot_product_attention(q, k, v, mask, scale)
    kv_heads = k.shape[2]
    group = h // kv_heads
    keys = k.transpose(0, 2, 1, 3)                                                  # [b, k, s, d]
    values = v.transpose(0, 2, 1, 3)
    queries = q.reshape(b, s, kv_heads, group, d).transpose(0, 2, 3, 1, 4)        # [b, k, g, s, d]
    outs = []
    for start in range(0, s, block):
        end = min(start + block, s)
        n = end - start
        q_block = queries[:, :, :, start:end].reshape(b, kv_heads, group * n, d)
        scores = jnp.einsum("bkqd,bktd->bkqt", q_block, keys[:, :, :end], preferred_element_type=jnp.float32)
        scores = (scores * scale).reshape(b, kv_heads, group, n, end)
        scores = jnp.where(mask[:, None, None, start:end, :end], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv_heads, group * n, end)
        outs.append(jnp.einsum("bkqt,bktd->bkqd", probs, values[:, :, :end]).reshape(b, kv_heads, group, n, d))
    out = jnp.concatenate(outs, axis=3)                                             # [b, k, g, s, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)


class Attention(nnx.Module):
    """Qwen3 attention weights: q_proj [embed, heads, head_dim], k_proj/v_proj [embed, kv_heads,
    head_dim], o_proj [heads, head_dim, embed], q_norm/k_norm [head_dim]."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        e, h, kvh, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        pd, std = cfg.param_dtype, cfg.initializer_range
        self.q_proj = make_param(rngs, (e, h, d), ("embed", "heads", "head_dim"), pd, std)
        self.k_proj = make_param(rngs, (e, kvh, d), ("embed", "kv_heads", "head_dim"), pd, std)
        self.v_proj = make_param(rngs, (e, kvh, d), ("embed", "kv_heads", "head_dim"), pd, std)
        self.o_proj = make_param(rngs, (h, d, e), ("heads", "head_dim", "embed"), pd, std)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", param_dtype=pd, dtype=cfg.dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", param_dtype=pd, dtype=cfg.dtype)
        self.config = cfg
        self.dtype = cfg.dtype
        self.scale = float(d) ** -0.5

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """The score/value part of a sequence over itself (no cache) with ``config.attention_impl``; over
        a cache the cache attends (`cache.KVCache.attend`, `paged_attention.PagedKVCache.attend`)."""
        if self.config.attention_impl == "dense":
            return dot_product_attention(q, k, v, mask, self.scale)
        return causal_block_attention(q, k, v, mask, self.scale)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x: [batch, seq, embed] -> q [batch, seq, heads, head_dim], k, v [batch, seq, kv_heads,
        head_dim]; q and k normalised per head and rotated."""
        dt, cfg = self.dtype, self.config
        tokens = rows(x)

        def heads(weight):  # [embed, heads, head_dim] -> [batch, seq, heads, head_dim]
            w = weight[...].astype(dt)
            return (tokens @ w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], *w.shape[1:])

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        q = constrain(q, (BATCH, SEQ, "heads", "head_dim"), cfg)
        k = constrain(k, (BATCH, SEQ, "kv_heads", "head_dim"), cfg)
        v = constrain(v, (BATCH, SEQ, "kv_heads", "head_dim"), cfg)
        return q, k, v

    def output(self, attn: jax.Array) -> jax.Array:
        """attn: [batch, seq, heads, head_dim] -> [batch, seq, embed] (a 2-D matmul over token rows)."""
        b, s, h, d = attn.shape
        weight = self.o_proj[...].astype(self.dtype)
        out = attn.astype(self.dtype).reshape(b * s, h * d) @ weight.reshape(h * d, -1)
        return constrain(out.reshape(b, s, -1), HIDDEN, self.config)
