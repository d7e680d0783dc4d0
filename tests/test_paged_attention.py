"""Paged decode attention against dense masked attention in float64 NumPy: each slot's tokens read
through its page table (pages shared between slots, out of order, a partial last page), grouped-query
heads; and the accelerator kernels refused on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from respo_jax.models.qwen3.paged_attention import check_paged_attention_impl, paged_attention


def _reference(q, k_pages, v_pages, tables, lengths, scale):
    """float64: for each slot, its first `length` tokens gathered page by page, softmax attention."""
    slots, heads, _ = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    out = np.zeros(q.shape, np.float64)
    for s in range(slots):
        positions = np.arange(lengths[s])
        pages = tables[s, positions // page_size]
        for h in range(heads):
            kh = h // (heads // kv_heads)
            keys = k_pages[kh, pages, positions % page_size].astype(np.float64)     # [length, dim]
            values = v_pages[kh, pages, positions % page_size].astype(np.float64)
            scores = keys @ q[s, h].astype(np.float64) * scale
            weights = np.exp(scores - scores.max())
            out[s, h] = weights @ values / weights.sum()
    return out


@pytest.mark.parametrize("heads,kv_heads,page_size", [(4, 2, 4), (2, 2, 1), (6, 1, 8)])
def test_gather_equals_dense_masked_attention_in_float64(heads, kv_heads, page_size):
    rng = np.random.default_rng(heads * 10 + page_size)
    slots, dim, num_pages, max_pages = 5, 8, 23, 6
    q = rng.normal(size=(slots, heads, dim)).astype(np.float32)
    k_pages = rng.normal(size=(kv_heads, num_pages, page_size, dim)).astype(np.float32)
    v_pages = rng.normal(size=(kv_heads, num_pages, page_size, dim)).astype(np.float32)
    tables = np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(slots)]).astype(np.int32)
    tables[1, :2] = tables[0, :2]  # two samples of one prompt share its first pages
    capacity = max_pages * page_size
    lengths = np.array([1, page_size, page_size + 1, capacity - 1, capacity], np.int32)
    scale = dim ** -0.5
    got = jax.jit(paged_attention, static_argnames=("scale", "impl"))(
        jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables), jnp.asarray(lengths),
        scale=scale)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k_pages, v_pages, tables, lengths, scale),
                               rtol=2e-5, atol=2e-6)
    # tokens past a slot's length, and pages its table does not name, are never read
    poisoned_k, poisoned_v = k_pages.copy(), v_pages.copy()
    unused = np.setdiff1d(np.arange(num_pages), tables)
    poisoned_k[:, unused] = 1e4
    poisoned_v[:, unused] = -1e4
    last = tables[0, (lengths[0] - 1) // page_size]
    poisoned_k[:, last, lengths[0] % page_size:] = 1e4
    again = paged_attention(jnp.asarray(q[:1]), jnp.asarray(poisoned_k), jnp.asarray(poisoned_v),
                            jnp.asarray(tables[:1]), jnp.asarray(lengths[:1]), scale=scale)
    np.testing.assert_allclose(np.asarray(again), np.asarray(got[:1]), rtol=1e-6, atol=1e-7)


def test_accelerator_kernels_are_refused_on_cpu_and_bad_shapes_raise():
    check_paged_attention_impl("gather", "cpu")
    check_paged_attention_impl("pallas_gpu", "gpu")
    with pytest.raises(ValueError, match=r"paged_attention_impl='pallas_tpu' runs on tpu devices; the engine "
                                         r"runs on cpu devices \(use 'gather'"):
        check_paged_attention_impl("pallas_tpu", "cpu")
    with pytest.raises(ValueError, match="runs on gpu devices"):
        check_paged_attention_impl("pallas_gpu", "tpu")
    with pytest.raises(ValueError, match="must be one of gather, pallas_tpu, pallas_gpu"):
        check_paged_attention_impl("flash", "cpu")
    with pytest.raises(ValueError, match=r"does not fit k_pages"):
        paged_attention(jnp.zeros((2, 3, 4)), jnp.zeros((2, 5, 4, 4)), jnp.zeros((2, 5, 4, 4)),
                        jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32), scale=1.0)
