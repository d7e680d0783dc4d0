"""Attention of one new token per slot over its cached tokens in a paged KV pool: the per-device kernel
the paged cache's decode step calls (`PagedKVCache.attend`), one function over one layer's pool, with
what each kernel needs (`check_paged_attention`) and how exact it is (`KERNEL_PRECISION`).

Kernels: "gather" (every platform) gathers the pages a slot's table names, up to the table's width, and
runs the model's dense masked attention; "ragged" (every platform) reads each slot's own pages only, block
by block, with an online softmax (`ragged_decode_attention`), so its work follows each slot's length, not
the table's width or the longest slot; "pallas_tpu" / "pallas_gpu" are JAX's Pallas paged-attention kernels
(`jax.experimental.pallas.ops.tpu.paged_attention`, `...ops.gpu.paged_attention`), which read the pages
in place on their accelerator. `interpret=True` runs a Pallas kernel's own program in the Pallas
interpreter (TPU: `pltpu.force_tpu_interpret_mode()`; GPU: the kernel's `interpret` argument), which
needs neither the accelerator nor libtpu: how the CPU tests run them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


# Kernels of attention over pages: the platform each one runs on (None: every platform).
PAGED_ATTENTION_IMPLS = {"gather": None, "pallas_tpu": "tpu", "pallas_gpu": "gpu", "ragged": None}

# The compute dtypes each kernel is exact for: its output differs from exact attention (float64) only by
# the round-off of that dtype (float32: ~1e-6 on unit-scale inputs; bfloat16: its own rounding, 2^-8).
# "pallas_tpu" is exact for bfloat16 only: it loads each block of K and V pages and casts it to bfloat16
# before its dots (`MultiPageAsyncCopyDescriptor.wait_and_get_loaded` -> `_maybe_dequantize(...,
# dtype=jnp.bfloat16)`), whatever the pool's dtype, so a float32 model gets attention at bfloat16
# precision (the default matmul precision plays no part: `jax.default_matmul_precision("highest")`
# changes nothing). "pallas_gpu" is exact for float32 because its dots are traced under
# `jax.default_matmul_precision("float32")`: Pallas Triton lowers a float32 dot of default precision to
# TF32 (10-bit mantissa) on the GPU, which the interpreter on CPU would not show.
KERNEL_PRECISION = {"gather": ("float32", "bfloat16"), "pallas_tpu": ("bfloat16",),
                    "pallas_gpu": ("float32", "bfloat16"), "ragged": ("float32", "bfloat16")}

# The most pages one block of the Pallas kernels reads (a divisor of the page table's width).
PAGES_PER_COMPUTE_BLOCK = 8
# "ragged": slots sorted by length fall into at most this many groups of equal size, each reading the
# blocks of pages its longest slot holds; a block holds this many tokens (whole pages, at least one).
RAGGED_GROUPS = 4
RAGGED_BLOCK_TOKENS = 128
# Triton's `tl.dot` takes operands of at least 16 in every dimension.
TRITON_MIN_DOT = 16


def kernel_exact(impl: str, dtype) -> bool:
    """Whether kernel `impl` is exact for compute dtype `dtype` (`KERNEL_PRECISION`)."""
    return jnp.dtype(dtype).name in KERNEL_PRECISION[impl]


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_paged_attention(impl: str, *, interpret: bool = False, platform: str | None = None,
                          head_dim: int | None = None, page_size: int | None = None) -> None:
    """Refuse (ValueError, one line) a kernel that cannot run the engine: an unknown name; `interpret`
    without a Pallas kernel; a Pallas kernel on another platform than its own, except on "cpu" with
    `interpret`; a `head_dim` / `page_size` the kernel cannot lower. `platform` (the engine's devices',
    e.g. "cpu"), `head_dim` and `page_size`: None skips their checks (a config checked before the model
    or the mesh exists).

    What each kernel lowers (found by lowering them for their platform, `lowering_platforms`):
    - pallas_tpu: head_dim a multiple of 128 (Pallas TPU: a block's last two dimensions divisible by 8
      and 128, or whole); any page_size (a page is a whole block);
    - pallas_gpu: head_dim and page_size powers of two (Pallas Triton: every array's size a power of 2;
      a block is `pages_per_compute_block` · page_size keys), each at least 16 (Triton's `tl.dot`; a
      block may hold a single page).
    """
    if impl not in PAGED_ATTENTION_IMPLS:
        raise ValueError(f"paged_attention_impl={impl!r}: expected one of "
                         f"{', '.join(map(repr, PAGED_ATTENTION_IMPLS))}")
    needs = PAGED_ATTENTION_IMPLS[impl]
    if interpret and needs is None:
        raise ValueError(f"paged_attention_interpret=true: expected false with paged_attention_impl={impl!r} "
                         "(the interpreter runs a Pallas kernel)")
    interpreted = interpret and platform == "cpu"
    if platform is not None and needs is not None and needs != platform and not interpreted:
        raise ValueError(f"paged_attention_impl={impl!r}: runs on {needs} devices; the engine runs on "
                         f"{platform} devices (use 'gather', which runs everywhere"
                         f"{', or paged_attention_interpret=true on cpu' if platform == 'cpu' else ''})")
    if impl == "pallas_tpu" and head_dim is not None and head_dim % 128:
        raise ValueError(f"paged_attention_impl='pallas_tpu': needs head_dim a multiple of 128 (Pallas TPU "
                         f"blocks); the model's is {head_dim} (use 'gather')")
    if impl == "pallas_gpu":
        for name, value in (("head_dim", head_dim), ("page_size", page_size)):
            if value is not None and not (_power_of_two(value) and value >= TRITON_MIN_DOT):
                raise ValueError(f"paged_attention_impl='pallas_gpu': needs {name} a power of two >= "
                                 f"{TRITON_MIN_DOT} (Pallas Triton blocks); got {value} (use 'gather')")


def gather_pages(pool: jax.Array, layer, page_table: jax.Array) -> jax.Array:
    """The pages `page_table` [batch, max_pages] names, of layer `layer` of `pool` [layers, kv_heads,
    pages, page_size, head_dim], read by one gather (no copy of the layer's pool) ->
    [batch, max_pages · page_size, kv_heads, head_dim]: token t of a row at index t."""
    pages = pool[layer, :, page_table]                       # [batch, max_pages, kv_heads, page_size, dim]
    b, n, kv, size, dim = pages.shape
    return pages.transpose(0, 1, 3, 2, 4).reshape(b, n * size, kv, dim)


def gather_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                            mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention of one new token per row over the pages its table names ("gather").

    q: [batch, heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim];
    page_tables: [batch, max_pages] int32 (ids in range); mask: [batch, max_pages · page_size] bool, the
    keys each row sees -> [batch, heads, head_dim] in q's dtype. Scores and softmax in float32; a fully
    masked row gets uniform weights (as `dot_product_attention`).

    The pages are gathered as [kv_heads, batch, keys, head_dim], the pool's own order, so no transpose of
    them is written; the scores are the gathered keys times the query ([keys, head_dim] @ [head_dim,
    group] per kv head and row): on CPU the product in this orientation ran 4x faster than [group,
    head_dim] @ [head_dim, keys], which reads the keys against their layout.
    """
    b, h, d = q.shape
    kv = k_pages.shape[0]
    keys, values = (jnp.take(pool, page_tables, axis=1, mode="clip").reshape(kv, b, -1, d).astype(q.dtype)
                    for pool in (k_pages, v_pages))                     # [kv_heads, batch, keys, head_dim]
    qg = q.reshape(b, kv, h // kv, d).transpose(1, 0, 2, 3)            # [kv_heads, batch, group, head_dim]
    scores = jnp.einsum("kbtd,kbgd->kbtg", keys, qg, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[None, :, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=2).astype(values.dtype)
    out = jnp.einsum("kbtg,kbtd->kbgd", probs, values)
    return out.transpose(1, 0, 2, 3).reshape(b, h, d)


def ragged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                            lengths: jax.Array, scale: float, *, groups: int = RAGGED_GROUPS,
                            block_tokens: int = RAGGED_BLOCK_TOKENS) -> jax.Array:
    """Grouped-query attention of one new token per slot over its first `lengths` tokens, whose work
    follows each slot's own length ("ragged"): flash-decoding over blocks of pages.

    q: [slots, heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim];
    page_tables: [slots, max_pages] int32; lengths: [slots] int32 (at most max_pages · page_size)
    -> [slots, heads, head_dim] in q's dtype.

    The slots are sorted by length (longest first) and cut into `groups` groups of equal size; a group
    loops (a dynamic trip count) over the blocks of `block_tokens` tokens (whole pages) that its longest
    slot holds, and each step gathers only that block's pages of its slots, a [kv_heads, group, block,
    head_dim] tile, into an online softmax (Milakov & Gimelshein 2018: float32 running max m, sum l and
    accumulator a; for a block's scores s, m' = max(m, max s), l' = l·e^(m-m') + Σ e^(s-m'),
    a' = a·e^(m-m') + Σ e^(s-m')·v; the output a / l). Keys at or past a slot's length weigh exactly 0.
    A slot of length 0 gets 0 (in a group of empty slots, at no cost). The outputs return in the slots'
    order."""
    b, h, d = q.shape
    kv, _, size, _ = k_pages.shape
    group = h // kv
    per_block = max(1, block_tokens // size)
    n_groups = max(1, min(groups, b))
    rows = -(-b // n_groups)                      # slots per group
    padded = n_groups * rows
    width = -(-page_tables.shape[1] // per_block) * per_block
    tables = jnp.pad(page_tables, ((0, padded - b), (0, width - page_tables.shape[1])))
    lengths = jnp.pad(lengths.astype(jnp.int32), (0, padded - b))
    order = jnp.argsort(-lengths, stable=True)    # longest first
    qs = jnp.pad(q, ((0, padded - b), (0, 0), (0, 0)))[order].reshape(n_groups, rows, kv, group, d)
    tables, lengths = tables[order].reshape(n_groups, rows, width), lengths[order].reshape(n_groups, rows)
    tokens = per_block * size
    offsets = jnp.arange(tokens, dtype=jnp.int32)

    def attend(qg, table, length):  # qg [rows, kv, group, dim]; table [rows, width]; length [rows]
        qg = qg.transpose(1, 0, 2, 3)                                   # [kv_heads, rows, group, head_dim]

        def block(j, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(table, j * per_block, per_block, axis=1)
            keys, values = (jnp.take(pool, pages, axis=1, mode="clip").reshape(kv, rows, tokens, d)
                            .astype(q.dtype) for pool in (k_pages, v_pages))   # [kv_heads, rows, block, dim]
            scores = jnp.einsum("kbtd,kbgd->kbtg", keys, qg, preferred_element_type=jnp.float32) * scale
            visible = (j * tokens + offsets)[None, :] < length[:, None]          # [rows, block]
            scores = jnp.where(visible[None, :, :, None], scores, -jnp.inf)
            m_new = jnp.maximum(m, scores.max(axis=2))                          # [kv_heads, rows, group]
            p = jnp.where(visible[None, :, :, None], jnp.exp(scores - m_new[:, :, None]), 0.0)
            correction = jnp.exp(m - m_new)
            acc = acc * correction[..., None] + jnp.einsum("kbtg,kbtd->kbgd", p.astype(values.dtype), values,
                                                           preferred_element_type=jnp.float32)
            return m_new, l * correction + p.sum(axis=2), acc

        init = (jnp.full((kv, rows, group), jnp.finfo(jnp.float32).min, jnp.float32),
                jnp.zeros((kv, rows, group), jnp.float32), jnp.zeros((kv, rows, group, d), jnp.float32))
        blocks = (length[0] + tokens - 1) // tokens                       # the group's longest slot
        _, l, acc = jax.lax.fori_loop(0, blocks, block, init)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        return out.transpose(1, 0, 2, 3)                                # [rows, kv_heads, group, head_dim]

    out = jnp.stack([attend(qs[i], tables[i], lengths[i]) for i in range(n_groups)]).reshape(padded, h, d)
    return jnp.zeros_like(out).at[order].set(out)[:b].astype(q.dtype)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_tables: jax.Array,
                    lengths: jax.Array, *, scale: float, impl: str = "gather", interpret: bool = False
                    ) -> jax.Array:
    """Grouped-query attention of one new token per slot over its cached tokens.

    q: [slots, heads, head_dim]; k_pages, v_pages: [kv_heads, num_pages, page_size, head_dim] (one
    layer's pool, in q's dtype: read in place, never cast); page_tables: [slots, max_pages] int32 (entry
    j: the page of tokens [j·page_size, (j+1)·page_size)); lengths: [slots] int32, tokens of the slot
    visible to its query (positions < length) -> [slots, heads, head_dim] in q's dtype, softmax(q·kᵀ ·
    scale)·v. Scores and softmax in float32; exact for the dtypes `KERNEL_PRECISION` names. A slot of
    length 0 (a free slot) gets an unspecified finite output that nothing reads. `impl`, `interpret`:
    static (`check_paged_attention`).
    """
    slots, heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    if heads % kv_heads or k_pages.shape != v_pages.shape or k_pages.shape[-1] != head_dim:
        raise ValueError(f"q {q.shape} (slots, heads, head_dim) does not fit k_pages {k_pages.shape} / "
                         f"v_pages {v_pages.shape} (kv_heads, num_pages, page_size, head_dim)")
    if page_tables.shape[0] != slots or lengths.shape != (slots,):
        raise ValueError(f"page_tables {page_tables.shape} / lengths {lengths.shape}: expected ({slots}, "
                         f"max_pages) / ({slots},)")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"the pools ({k_pages.dtype}, {v_pages.dtype}) must hold q's dtype {q.dtype}: a "
                         "kernel reads them in place")
    check_paged_attention(impl, interpret=interpret)
    if impl == "ragged":
        return ragged_decode_attention(q, k_pages, v_pages, page_tables, lengths, scale)
    per_block = math.gcd(page_tables.shape[1], PAGES_PER_COMPUTE_BLOCK)
    if impl == "gather":
        keys = page_tables.shape[1] * k_pages.shape[2]
        visible = jnp.arange(keys, dtype=jnp.int32)[None, :] < lengths[:, None]
        return gather_decode_attention(q, k_pages, v_pages, page_tables, visible, scale)
    if impl == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as kernel

        with jax.default_matmul_precision("float32"):  # IEEE float32 dots on the GPU, not TF32
            out = kernel.paged_attention(
                (q * scale).astype(q.dtype), k_pages, v_pages, page_tables, lengths,
                pages_per_compute_block=per_block, k_splits=math.gcd(page_tables.shape[1] // per_block, 16),
                interpret=interpret)
        return out.astype(q.dtype)
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import paged_attention as kernel

    def run():
        return kernel.paged_attention((q * scale).astype(q.dtype), k_pages, v_pages, lengths, page_tables,
                                      pages_per_compute_block=per_block)

    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return run().astype(q.dtype)
    return run().astype(q.dtype)
