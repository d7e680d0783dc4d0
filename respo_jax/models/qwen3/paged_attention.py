"""The paged KV cache the model's forward reads and writes: K/V in a pool of fixed-size pages, each row's
tokens found through its page table (vLLM's layout), and attention over those pages.

Why in the model: prefill, chunked prefill and the rollout engine's decode step all run the model's own
forward with this cache as an argument (as with the dense `KVCache`), so the decoder exists once. The
pool and the page tables are the engine's; the forward only writes its new tokens' K/V at the pages
their positions name and attends over the pages a row's table names.

Layout: `[layers, kv_heads, num_pages + 1, page_size, head_dim]` (the last page a scratch page that
masked tokens write to and unused page-table entries point at); per layer this is the layout both
Pallas paged-attention kernels (`jax.experimental.pallas.ops.tpu.paged_attention`,
`...ops.gpu.paged_attention`) read, and kv heads lead, so a mesh splits them like the weights.

Kernels (`PagedKVCache.impl`, the engine's `EngineConfig.paged_attention_impl`): "gather" runs
everywhere (what the CPU tests run): it gathers only the pages a row's table names, from the pool in
place, then runs the model's dense masked attention; "pallas_tpu" / "pallas_gpu" read the pages in place
on an accelerator (one query token per row: a decode step; a prefill gathers). The choice is checked
once at the engine's entry point against the platform (`check_paged_attention_impl`).
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from respo_jax.models.qwen3.attention import dot_product_attention
from respo_jax.models.qwen3.layers import constrain

# Logical axes of the page pools: kv heads split like the attention weights (and like the dense cache's
# `cache.CACHE_AXES`); pages and their tokens whole.
PAGE_AXES = ("layers", "kv_heads", None, None, "head_dim")

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


def gather_pages(pool: jax.Array, layer, page_table: jax.Array) -> jax.Array:
    """The pages `page_table` [batch, max_pages] names, of layer `layer` of `pool` [layers, kv_heads,
    pages, page_size, head_dim], read by one gather (no copy of the layer's pool) ->
    [batch, max_pages · page_size, kv_heads, head_dim]: token t of a row at index t."""
    pages = pool[layer, :, page_table]                       # [batch, max_pages, kv_heads, page_size, dim]
    b, n, kv, size, dim = pages.shape
    return pages.transpose(0, 1, 3, 2, 4).reshape(b, n * size, kv, dim)


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


@dataclasses.dataclass(frozen=True)
class PagedView:
    """What one forward over a `PagedKVCache` computes once for all layers: each new token's page and
    offset ([batch, seq] int32; masked tokens: the scratch page), each row's visible tokens after the
    write ([batch] int32, the kernels' lengths) and the causal mask over the gathered pages
    ([batch, seq, max_pages · page_size] bool: key position <= query position)."""

    page: jax.Array
    offset: jax.Array
    lengths: jax.Array
    mask: jax.Array


@flax.struct.dataclass
class PagedKVCache:
    """A paged view of a KV pool for one forward.

    k_pages, v_pages: [layers, kv_heads, num_pages + 1, page_size, head_dim] (the last page: scratch);
    page_table: [batch, max_pages] int32, row b's token at position p lives at page
    `page_table[b, p // page_size]`, offset `p % page_size`; impl: the attention kernel (static).

    A forward with this cache writes each real token's K/V at its position (the `positions` argument,
    explicit) and lets it attend to the row's tokens at positions <= its own, which must all have been
    written (by this forward or an earlier one: a prompt's earlier prefill pieces, the tokens decoded
    so far). Masked tokens (`attention_mask` 0: pads, slots not fed) write to the scratch page.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    impl: str = flax.struct.field(pytree_node=False, default="gather")

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    @property
    def scratch_page(self) -> int:
        return self.k_pages.shape[2] - 1

    def view(self, positions: jax.Array, token_mask: jax.Array, cfg) -> PagedView:
        """positions: [batch, seq] int32; token_mask: [batch, seq] bool (real tokens)."""
        del cfg
        pages = jnp.take_along_axis(self.page_table, positions // self.page_size, axis=1)
        capacity = self.page_table.shape[1] * self.page_size
        key_positions = jnp.arange(capacity, dtype=jnp.int32)
        return PagedView(page=jnp.where(token_mask, pages, self.scratch_page),
                         offset=positions % self.page_size,
                         lengths=jnp.max(positions, axis=1) + 1,
                         mask=key_positions[None, None, :] <= positions[:, :, None])

    def update(self, layer, k: jax.Array, v: jax.Array, view: PagedView, cfg) -> PagedKVCache:
        """Write k, v [batch, seq, kv_heads, head_dim] of layer `layer` at the view's pages."""
        def write(pool, new):
            pool = pool.at[layer, :, view.page, view.offset].set(new.astype(pool.dtype))
            return constrain(pool, PAGE_AXES, cfg)

        return self.replace(k_pages=write(self.k_pages, k), v_pages=write(self.v_pages, v))

    def attend(self, layer, q: jax.Array, view: PagedView, scale: float) -> jax.Array:
        """q: [batch, seq, heads, head_dim] over the pages of layer `layer` -> [batch, seq, heads,
        head_dim]. The Pallas kernels take one query token per row."""
        if self.impl == "gather":
            keys, values = (gather_pages(pool, layer, self.page_table).astype(q.dtype)
                            for pool in (self.k_pages, self.v_pages))
            return dot_product_attention(q, keys, values, view.mask, scale)
        if q.shape[1] != 1:
            raise ValueError(f"paged_attention_impl={self.impl!r} attends one token per row; got {q.shape[1]} "
                             "(a prefill over pages uses 'gather')")
        out = paged_attention(q[:, 0], self.k_pages[layer].astype(q.dtype), self.v_pages[layer].astype(q.dtype),
                              self.page_table, view.lengths, scale=scale, impl=self.impl)
        return out[:, None]

    def advance(self, view: PagedView) -> PagedKVCache:
        """The cache after the forward (the pools carry the writes; nothing else changes)."""
        return self
