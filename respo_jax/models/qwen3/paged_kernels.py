"""Attention of one new token per slot over its cached tokens in a paged KV pool: the per-device kernel
the paged cache's decode step calls (`PagedKVCache.attend`), one function over one layer's pool.

Kernels: "gather" (every platform) gathers only the pages a slot's table names and runs the model's dense
masked attention; "pallas_tpu" / "pallas_gpu" are JAX's Pallas paged-attention kernels
(`jax.experimental.pallas.ops.tpu.paged_attention`, `...ops.gpu.paged_attention`), which read the pages
in place on their accelerator.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from respo_jax.models.qwen3.attention import dot_product_attention


def gather_pages(pool: jax.Array, layer, page_table: jax.Array) -> jax.Array:
    """The pages `page_table` [batch, max_pages] names, of layer `layer` of `pool` [layers, kv_heads,
    pages, page_size, head_dim], read by one gather (no copy of the layer's pool) ->
    [batch, max_pages · page_size, kv_heads, head_dim]: token t of a row at index t."""
    pages = pool[layer, :, page_table]                       # [batch, max_pages, kv_heads, page_size, dim]
    b, n, kv, size, dim = pages.shape
    return pages.transpose(0, 1, 3, 2, 4).reshape(b, n * size, kv, dim)


# Kernels of attention over pages: the platform each one runs on (None: every platform).
PAGED_ATTENTION_IMPLS = {"gather": None, "pallas_tpu": "tpu", "pallas_gpu": "gpu"}


def check_paged_attention_impl(impl: str, platform: str) -> None:
    """Refuse a kernel that does not run on `platform` (the engine's devices', e.g. "cpu")."""
    if impl not in PAGED_ATTENTION_IMPLS:
        raise ValueError(f"paged_attention_impl must be one of {', '.join(PAGED_ATTENTION_IMPLS)}; "
                         f"got {impl!r}")
    needs = PAGED_ATTENTION_IMPLS[impl]
    if needs is not None and needs != platform:
        raise ValueError(f"EngineConfig.paged_attention_impl={impl!r} runs on {needs} devices; the engine "
                         f"runs on {platform} devices (use 'gather', which runs everywhere)")


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                    lengths: jax.Array, *, scale: float, impl: str = "gather") -> jax.Array:
    """Grouped-query attention of one new token per slot over its cached tokens.

    q: [slots, heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] (one
    layer's pool); page_tables: [slots, max_pages] int32 (entry j: the page of tokens
    [j·page_size, (j+1)·page_size)); lengths: [slots] int32, tokens of the slot visible to its query
    (positions < length) -> [slots, heads, head_dim] in q's dtype. Scores and softmax in float32. A
    slot of length 0 (a free slot) gets an unspecified finite output that nothing reads.
    """
    slots, heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    if heads % kv_heads or k_pages.shape != v_pages.shape or k_pages.shape[-1] != head_dim:
        raise ValueError(f"q {q.shape} (slots, heads, head_dim) does not fit k_pages {k_pages.shape} / "
                         f"v_pages {v_pages.shape} (kv_heads, num_pages, page_size, head_dim)")
    if page_tables.shape[0] != slots or lengths.shape != (slots,):
        raise ValueError(f"page_tables {page_tables.shape} / lengths {lengths.shape}: expected ({slots}, "
                         f"max_pages) / ({slots},)")
    if impl == "gather":
        keys, values = (gather_pages(pool[None], 0, page_tables) for pool in (k_pages, v_pages))
        visible = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :] < lengths[:, None]
        out = dot_product_attention(q[:, None], keys.astype(q.dtype), values.astype(q.dtype),
                                    visible[:, None, :], scale)
        return out[:, 0]
    if impl == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as kernel

        max_pages = page_tables.shape[1]
        per_block = math.gcd(max_pages, 8)
        out = kernel.paged_attention(
            (q * scale).astype(q.dtype), k_pages, v_pages, page_tables, lengths,
            pages_per_compute_block=per_block, k_splits=math.gcd(max_pages // per_block, 16))
        return out.astype(q.dtype)
    if impl == "pallas_tpu":
        from jax.experimental.pallas.ops.tpu import paged_attention as kernel

        out = kernel.paged_attention((q * scale).astype(q.dtype), k_pages, v_pages, lengths, page_tables,
                                     pages_per_compute_block=math.gcd(page_tables.shape[1], 8))
        return out.astype(q.dtype)
    raise ValueError(f"paged_attention_impl must be one of {', '.join(PAGED_ATTENTION_IMPLS)}; got {impl!r}")
