"""Decode attention over a paged KV cache: one query token per slot against the pages its table names.

Why a kernel field: the gather implementation runs everywhere (it is what the CPU tests run), but it
materialises each slot's pages contiguously; on an accelerator a Pallas kernel reads the pages in
place. The choice is `EngineConfig.paged_attention_impl`, checked once at the engine's entry point
against the platform of the devices it runs on (`check_paged_attention_impl`) — never picked by
asking which backend is the default.

Layout: `[kv_heads, num_pages, page_size, head_dim]` per layer, the layout both Pallas paged-attention
kernels (`jax.experimental.pallas.ops.tpu.paged_attention`, `...ops.gpu.paged_attention`) read, so no
kernel transposes the pool at every step; kv heads lead, so a mesh splits them like the weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from respo_jax.sampling.params import PAGED_ATTENTION_IMPLS


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

    q: [slots, heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim];
    page_tables: [slots, max_pages] int32 (entry j: the page of tokens [j·page_size, (j+1)·page_size));
    lengths: [slots] int32, tokens of the slot visible to its query (positions < length) ->
    [slots, heads, head_dim] in q's dtype. Scores and softmax in float32. A slot of length 0 (a free
    slot) gets an unspecified finite output that nothing reads.
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
        return _gather_attention(q, k_pages, v_pages, page_tables, lengths, scale)
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


def _gather_attention(q, k_pages, v_pages, page_tables, lengths, scale):
    """The slots' pages gathered into [kv_heads, slots, max_pages·page_size, head_dim], then masked
    dense attention (the reference the kernels must equal)."""
    slots, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    keys = k_pages[:, page_tables].reshape(kv_heads, slots, -1, head_dim)
    values = v_pages[:, page_tables].reshape(kv_heads, slots, -1, head_dim)
    qg = q.reshape(slots, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("skgd,kstd->skgt", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    visible = jnp.arange(keys.shape[2], dtype=jnp.int32)[None, :] < lengths[:, None]  # [slots, tokens]
    scores = jnp.where(visible[:, None, None, :], scores * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("skgt,kstd->skgd", probs, values.astype(q.dtype))
    return out.reshape(slots, heads, head_dim)
