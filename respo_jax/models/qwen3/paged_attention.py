"""The paged KV cache the model's forward reads and writes: K/V in a pool of fixed-size pages, each row's
tokens found through its page table (vLLM's layout), and attention over those pages.

Why in the model: prefill, chunked prefill and the rollout engine's decode step all run the model's own
forward with this cache as an argument (as with the dense `KVCache`), so the decoder exists once. The
pool and the page tables are the engine's; the forward only writes its new tokens' K/V at the pages
their positions name and attends over the pages a row's table names.

Layout: `[kv_heads, shards, layers, num_pages + 1, page_size, head_dim]` (`PAGE_AXES`).
- Split with the rows that use it: `shards` is the number of batch shards and that axis is split over
  the `batch` mesh axes, so each device holds its own rows' pages (a pool's bytes per device: the
  pool / batch shards / kv-head shards), never a replica. Page tables hold local page ids (0 ..
  num_pages - 1; num_pages: the shard's scratch page, which masked tokens write to and unused
  page-table entries point at), and every write and read runs inside `shard_map`, each device over
  its own pages and its own rows. kv heads lead and split over the `kv_heads` axes, like the weights.
- Read where it lies: a shard's pool reshaped to `[kv_heads, layers · (num_pages + 1), page_size,
  head_dim]` (a bitcast: the dimensions are adjacent) is the layout both Pallas paged-attention
  kernels (`jax.experimental.pallas.ops.tpu.paged_attention`, `...ops.gpu.paged_attention`) read,
  with layer l's page p at l · (num_pages + 1) + p. So a layer is addressed by offsetting the page
  table, never by slicing a layer out of a stacked pool (a copy of the layer's pool per step); and one
  array per pool keeps the cache a single loop carry of a layer scan. Pages hold the compute dtype:
  attention converts nothing of the pool ("gather" converts only the pages it gathered).
- Written in place: writes are scatters into the (donated) pool; no pool-sized temporary.

Kernels (`PagedKVCache.impl`, the engine's `EngineConfig.paged_attention_impl`): "gather" runs
everywhere: it gathers only the pages a row's table names, from the pool in place, then runs masked
attention over them (a decode step: `paged_kernels.gather_decode_attention`; a prefill: the model's
dense masked attention); "ragged" runs everywhere too: a decode step reads each row's own pages block by
block (`paged_kernels.ragged_decode_attention`), so its cost follows each row's length; a prefill
gathers as "gather" does; "pallas_tpu" / "pallas_gpu" read the pages in place
on an accelerator (one query token per row: a decode step; a prefill gathers). The kernels themselves
are `respo_jax.models.qwen3.paged_kernels`.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from respo_jax.models.qwen3.attention import dot_product_attention
from respo_jax.models.qwen3.paged_kernels import (  # noqa: F401  (re-exported: the kernels' old home)
    PAGED_ATTENTION_IMPLS, check_paged_attention, gather_decode_attention, gather_pages, paged_attention)
from respo_jax.sharding import ShardingRules

# Logical axes of the page pools [kv_heads, shards, layers, pages, page_size, head_dim]: kv heads split
# like the attention weights, the shards over the batch axes (beside the rows that use them).
PAGE_AXES = ("kv_heads", "batch", "layers", None, None, "head_dim")
# Queries [batch, seq, heads, head_dim] and new K/V [batch, seq, kv_heads, head_dim] as attention splits them.
Q_AXES = ("batch", None, "heads", "head_dim")
NEW_KV_AXES = ("batch", None, "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class PagedView:
    """What one forward over a `PagedKVCache` computes once for all layers: each new token's page and
    offset ([batch, seq] int32; masked tokens: the scratch page), each row's visible tokens after the
    write ([batch] int32, the kernels' lengths), the causal mask over the gathered pages
    ([batch, seq, max_pages · page_size] bool: key position <= query position) and the rows with a real
    token ([batch] bool: a row without one, a slot not fed, has nothing to attend)."""

    page: jax.Array
    offset: jax.Array
    lengths: jax.Array
    mask: jax.Array
    live: jax.Array


@flax.struct.dataclass
class PagedKVCache:
    """A paged view of a KV pool for one forward.

    k_pages, v_pages: [kv_heads, shards, layers, num_pages + 1, page_size, head_dim] (`PAGE_AXES`; the
    last page of each shard: its scratch page); page_table: [batch, max_pages] int32, row b's token at
    position p lives at page `page_table[b, p // page_size]` of the row's shard (a local page id),
    offset `p % page_size`; impl: the attention kernel; interpret: a Pallas kernel in its interpreter
    (`paged_kernels.paged_attention`); mesh, rules: where the pool is split (None: one
    device, `shards` 1). Static: impl, interpret, mesh, rules.

    Rows split over the `batch` axes into `shards` contiguous blocks, and block s reads and writes only
    shard s's pages: every write and every read runs inside `shard_map` over the mesh, each device on
    its own pages and its own rows, so no device holds another's pages and no page crosses devices.

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
    mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)
    rules: ShardingRules | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[4]

    @property
    def scratch_page(self) -> int:
        return self.k_pages.shape[3] - 1

    def view(self, positions: jax.Array, token_mask: jax.Array, cfg) -> PagedView:
        """positions: [batch, seq] int32; token_mask: [batch, seq] bool (real tokens)."""
        del cfg
        pages = jnp.take_along_axis(self.page_table, positions // self.page_size, axis=1)
        capacity = self.page_table.shape[1] * self.page_size
        key_positions = jnp.arange(capacity, dtype=jnp.int32)
        return PagedView(page=jnp.where(token_mask, pages, self.scratch_page),
                         offset=positions % self.page_size,
                         lengths=jnp.max(positions, axis=1) + 1,
                         mask=key_positions[None, None, :] <= positions[:, :, None],
                         live=jnp.any(token_mask, axis=1))

    def _local(self, fn, out_axes, *args):
        """`fn(*args)` per shard: args are (value, logical axes) pairs; inside `shard_map` over the
        mesh (each device its pages and its rows), or as is on one device."""
        values = [value for value, _ in args]
        if self.mesh is None:
            return fn(*values)
        spec = self.rules.spec
        several = isinstance(out_axes[0], tuple)
        out_specs = tuple(spec(axes) for axes in out_axes) if several else spec(out_axes)
        # check_vma=False: the Pallas kernels' outputs carry no varying-axes annotation.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=tuple(spec(axes) for _, axes in args),
                             out_specs=out_specs, check_vma=False)(*values)

    def update(self, layer, k: jax.Array, v: jax.Array, view: PagedView, cfg) -> PagedKVCache:
        """Write k, v [batch, seq, kv_heads, head_dim] of layer `layer` at the view's pages, in place."""
        del cfg

        def write(k_pool, v_pool, k, v, layer, page, offset):
            def one(pool, new):  # pool [kv_heads, 1, layers, pages, ...]; new [batch, seq, kv_heads, dim]
                # Every dimension but head_dim indexed (kv heads too): the scatter's window is one head's
                # vector, so the compiler keeps the pool's own layout (the one the kernels read) rather
                # than moving kv heads minor and copying the pool back for the kernel at every step.
                heads = jnp.arange(pool.shape[0], dtype=jnp.int32)[:, None, None]
                return pool.at[heads, 0, layer, page[None], offset[None]].set(
                    new.transpose(2, 0, 1, 3).astype(pool.dtype))
            return one(k_pool, k), one(v_pool, v)

        rows = ("batch", None)
        k_pages, v_pages = self._local(write, (PAGE_AXES, PAGE_AXES), (self.k_pages, PAGE_AXES),
                                       (self.v_pages, PAGE_AXES), (k, NEW_KV_AXES), (v, NEW_KV_AXES),
                                       (layer, ()), (view.page, rows), (view.offset, rows))
        return self.replace(k_pages=k_pages, v_pages=v_pages)

    def attend(self, layer, q: jax.Array, view: PagedView, scale: float) -> jax.Array:
        """q: [batch, seq, heads, head_dim] over the pages of layer `layer` -> [batch, seq, heads,
        head_dim]. The Pallas kernels take one query token per row; "ragged" attends a decode step (one
        token per row; a row not fed reads nothing) and a prefill as "gather"."""
        if PAGED_ATTENTION_IMPLS[self.impl] is not None and q.shape[1] != 1:
            raise ValueError(f"paged_attention_impl={self.impl!r} attends one token per row; got "
                             f"{q.shape[1]} (a prefill over pages uses 'gather')")
        impl, interpret = self.impl, self.interpret

        def local(q, k_pool, v_pool, table, layer, lengths, mask, live):
            # A shard's pool as the kernels' [kv_heads, layers · pages, page_size, head_dim] (a bitcast);
            # layer l's page p is page l · pages + p of it, so no layer is sliced out.
            kv_heads, _, layers, pages, size, dim = k_pool.shape
            k_flat, v_flat = (pool.reshape(kv_heads, layers * pages, size, dim) for pool in (k_pool, v_pool))
            table = table + layer * pages
            if impl == "gather" and q.shape[1] == 1:  # a decode step
                return gather_decode_attention(q[:, 0], k_flat, v_flat, table, mask[:, 0], scale)[:, None]
            if impl == "ragged" and q.shape[1] == 1:
                lengths = jnp.where(live, lengths, 0)  # a row not fed reads nothing
                out = paged_attention(q[:, 0], k_flat, v_flat, table, lengths, scale=scale, impl=impl)
                return out[:, None]
            if impl in ("gather", "ragged"):  # a prefill
                keys, values = (gather_pages(pool[None], 0, table).astype(q.dtype)
                                for pool in (k_flat, v_flat))
                return dot_product_attention(q, keys, values, mask, scale)
            out = paged_attention(q[:, 0].astype(k_pool.dtype), k_flat, v_flat, table, lengths, scale=scale,
                                  impl=impl, interpret=interpret)
            return out[:, None].astype(q.dtype)

        return self._local(local, Q_AXES, (q, Q_AXES), (self.k_pages, PAGE_AXES), (self.v_pages, PAGE_AXES),
                           (self.page_table, ("batch", None)), (layer, ()), (view.lengths, ("batch",)),
                           (view.mask, ("batch", None, None)), (view.live, ("batch",)))

    def advance(self, view: PagedView) -> PagedKVCache:
        """The cache after the forward (the pools carry the writes; nothing else changes)."""
        return self


def copy_pages(k_pages: jax.Array, v_pages: jax.Array, source: jax.Array, dest: jax.Array, mesh: Mesh,
               rules: ShardingRules) -> tuple[jax.Array, jax.Array]:
    """Copy page `source[i]` onto page `dest[i]` (all layers) of the shard of entry i: source, dest
    [slots] int32 local page ids, split over the batch axes like the slots (entry i in shard
    i // (slots / shards)); the pools as in `PagedKVCache`, updated in place."""
    def local(k_pool, v_pool, source, dest):
        return tuple(pool.at[:, :, :, dest].set(pool[:, :, :, source]) for pool in (k_pool, v_pool))

    spec = rules.spec
    return jax.shard_map(local, mesh=mesh, in_specs=(spec(PAGE_AXES),) * 2 + (spec(("batch",)),) * 2,
                         out_specs=(spec(PAGE_AXES),) * 2)(k_pages, v_pages, source, dest)


def pool_shape(cfg, *, shards: int, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The shape of a pool of `num_pages` pages (+ a scratch page) on each of `shards` batch shards for
    the model of `cfg` (`PagedKVCache`)."""
    return (cfg.num_key_value_heads, shards, cfg.num_hidden_layers, num_pages + 1, page_size, cfg.head_dim)
