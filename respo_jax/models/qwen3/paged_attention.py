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
on an accelerator (one query token per row: a decode step; a prefill gathers). The kernels themselves
are `respo_jax.models.qwen3.paged_kernels`.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from respo_jax.models.qwen3.attention import dot_product_attention
from respo_jax.models.qwen3.layers import constrain
from respo_jax.models.qwen3.paged_kernels import (  # noqa: F401  (re-exported: the kernels' old home)
    PAGED_ATTENTION_IMPLS, check_paged_attention, gather_pages, paged_attention)

# Logical axes of the page pools: kv heads split like the attention weights (and like the dense cache's
# `cache.CACHE_AXES`); pages and their tokens whole.
PAGE_AXES = ("layers", "kv_heads", None, None, "head_dim")


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
    `page_table[b, p // page_size]`, offset `p % page_size`; impl: the attention kernel, interpret: a Pallas
    kernel in its interpreter (`paged_kernels.paged_attention`; both static).

    A forward with this cache writes each real token's K/V at its position (the `positions` argument,
    explicit) and lets it attend to the row's tokens at positions <= its own, which must all have been
    written (by this forward or an earlier one: a prompt's earlier prefill pieces, the tokens decoded
    so far). Masked tokens (`attention_mask` 0: pads, slots not fed) write to the scratch page.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    impl: str = flax.struct.field(pytree_node=False, default="gather")
    interpret: bool = flax.struct.field(pytree_node=False, default=False)

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
        out = paged_attention(q[:, 0], self.k_pages[layer], self.v_pages[layer], self.page_table,
                              view.lengths, scale=scale, impl=self.impl, interpret=self.interpret)
        return out[:, None]

    def advance(self, view: PagedView) -> PagedKVCache:
        """The cache after the forward (the pools carry the writes; nothing else changes)."""
        return self
