"""Paged decode attention against dense masked attention in float64 NumPy: each slot's tokens read
through its page table (pages shared between slots, out of order, a partial last page), grouped-query
heads; every kernel's stated precision (`KERNEL_PRECISION`), the Pallas kernels in their interpreter on
CPU; and what `check_paged_attention` refuses: a kernel off its platform, shapes it cannot lower."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from respo_jax.models.qwen3.paged_attention import paged_attention
from respo_jax.models.qwen3.paged_kernels import (KERNEL_PRECISION, check_paged_attention,
                                                  ragged_decode_attention)


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


# bfloat16's rounding: a relative spacing of 2^-7 between neighbours in [1, 2).
BF16_STEP = 2.0 ** -7


def _bf16(x):
    """x rounded to bfloat16, back in float64."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


@pytest.mark.parametrize("impl,dtype", [(impl, dtype) for impl in KERNEL_PRECISION
                                        for dtype in ("float32", "bfloat16")])
def test_each_kernel_has_its_stated_precision(impl, dtype):
    """Exact for a dtype (`KERNEL_PRECISION`): float32 within float32 round-off of float64 attention,
    bfloat16 within bfloat16's rounding of float64 attention of the same (bfloat16) inputs. pallas_tpu in
    float32: float64 attention of its K and V rounded to bfloat16 (what it computes), farther from
    exact attention than float32 round-off."""
    rng = np.random.default_rng(7)
    slots, heads, kv_heads, dim, page_size, num_pages, max_pages = 3, 4, 2, 128, 16, 9, 4
    q, k_pages, v_pages = (rng.normal(size=shape) for shape in
                           [(slots, heads, dim)] + [(kv_heads, num_pages, page_size, dim)] * 2)
    tables = np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(slots)]).astype(np.int32)
    lengths = np.array([1, page_size + 3, max_pages * page_size], np.int32)
    scale = dim ** -0.5
    inputs = [np.asarray(jnp.asarray(x, dtype), np.float64) for x in (q, k_pages, v_pages)]
    got = jax.jit(paged_attention, static_argnames=("scale", "impl", "interpret"))(
        *(jnp.asarray(x, dtype) for x in inputs), jnp.asarray(tables), jnp.asarray(lengths), scale=scale,
        impl=impl, interpret=impl.startswith("pallas"))
    assert got.dtype == dtype and got.shape == q.shape
    error = np.abs(np.asarray(got, np.float64) - _reference(*inputs, tables, lengths, scale)).max()
    exact = dtype in KERNEL_PRECISION[impl]
    if dtype == "float32" and exact:
        assert error < 2e-6, error
    elif dtype == "bfloat16":  # the output's rounding, and the probabilities' before the values' dot
        assert exact and error < 2 * BF16_STEP, error
    else:  # pallas_tpu, float32: attention of bfloat16-rounded K and V
        assert not exact and impl == "pallas_tpu"
        rounded = _reference(inputs[0], _bf16(inputs[1]), _bf16(inputs[2]), tables, lengths, scale)
        assert np.abs(np.asarray(got, np.float64) - rounded).max() < 2e-6
        assert 100 * 2e-6 < error < 2 * BF16_STEP, error


def test_pallas_gpu_traces_its_float32_dots_at_full_precision():
    """On a GPU, Pallas Triton runs a float32 dot of default precision in TF32; the interpreter on CPU
    runs it in float32 whatever its precision, so the precision the kernel's dots carry is checked here."""
    q, pool = jnp.zeros((2, 16, 64)), jnp.zeros((2, 8, 16, 64))
    jaxpr = jax.make_jaxpr(lambda *a: paged_attention(*a, scale=0.125, impl="pallas_gpu", interpret=True))(
        q, pool, pool, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32))

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn.params["precision"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from dots(sub)

    precisions = list(dots(jaxpr.jaxpr))
    assert len(precisions) == 2  # q·kᵀ and p·v
    assert all(p == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST) for p in precisions), precisions


def test_what_check_paged_attention_refuses():
    check_paged_attention("gather", platform="cpu", head_dim=8, page_size=3)
    check_paged_attention("ragged", platform="tpu", head_dim=8, page_size=3)
    check_paged_attention("pallas_gpu", platform="gpu", head_dim=64, page_size=16)
    check_paged_attention("pallas_tpu", platform="tpu", head_dim=128, page_size=3)
    check_paged_attention("pallas_tpu", interpret=True, platform="cpu", head_dim=256)
    check_paged_attention("pallas_gpu", interpret=True, platform="cpu", head_dim=128)
    refusals = [
        (dict(impl="pallas_tpu", platform="cpu"), r"^paged_attention_impl='pallas_tpu': runs on tpu devices; "
         r"the engine runs on cpu devices \(use 'gather', which runs everywhere, or "
         r"paged_attention_interpret=true on cpu\)$"),
        (dict(impl="pallas_gpu", platform="tpu"), r"runs on gpu devices; the engine runs on tpu devices "
         r"\(use 'gather', which runs everywhere\)$"),
        (dict(impl="pallas_tpu", interpret=True, platform="gpu"), "runs on tpu devices"),
        (dict(impl="flash", platform="cpu"), r"^paged_attention_impl='flash': expected one of 'gather', "
         r"'pallas_tpu', 'pallas_gpu', 'ragged'$"),
        (dict(impl="gather", interpret=True), r"^paged_attention_interpret=true: expected false with "
         r"paged_attention_impl='gather' \(the interpreter runs a Pallas kernel\)$"),
        (dict(impl="pallas_tpu", head_dim=64), "'pallas_tpu': needs head_dim a multiple of 128 .* is 64"),
        (dict(impl="pallas_gpu", head_dim=96), "'pallas_gpu': needs head_dim a power of two >= 16 .* got 96"),
        (dict(impl="pallas_gpu", head_dim=8), "needs head_dim a power of two >= 16"),
        (dict(impl="pallas_gpu", page_size=12), "'pallas_gpu': needs page_size a power of two >= 16 .* 12"),
        (dict(impl="pallas_gpu", page_size=8), "needs page_size a power of two >= 16"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            check_paged_attention(kwargs.pop("impl"), **kwargs)


def test_bad_shapes_and_dtypes_raise():
    with pytest.raises(ValueError, match=r"does not fit k_pages"):
        paged_attention(jnp.zeros((2, 3, 4)), jnp.zeros((2, 5, 4, 4)), jnp.zeros((2, 5, 4, 4)),
                        jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match=r"the pools \(bfloat16, bfloat16\) must hold q's dtype float32"):
        paged_attention(jnp.zeros((2, 2, 4)), jnp.zeros((2, 5, 4, 4), jnp.bfloat16),
                        jnp.zeros((2, 5, 4, 4), jnp.bfloat16), jnp.zeros((2, 3), jnp.int32),
                        jnp.zeros((2,), jnp.int32), scale=1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# one group, a block wider than the table; 4 groups over 9 slots (padded), 2-page blocks; 3 groups, 3-page
# blocks of 1-token pages
@pytest.mark.parametrize("heads,kv_heads,page_size,groups,block_tokens", [
    (6, 1, 8, 1, 64), (4, 2, 4, 4, 8), (2, 2, 1, 3, 3)])
def test_ragged_equals_dense_masked_attention_in_float64(heads, kv_heads, page_size, groups, block_tokens,
                                                         dtype):
    """"ragged" against float64 attention of the same (dtype-rounded) inputs at ragged lengths (0, 1, a
    page's edges, the table's full width), in slots out of length order, for several group counts and
    block sizes (one page, several, a block wider than the table): float32 within float32 round-off,
    bfloat16 within its rounding; a slot of length 0 gets 0; tokens past a slot's length and pages its
    table does not name are never read (poisoned, the output is unchanged)."""
    rng = np.random.default_rng(heads * 100 + page_size * 10 + groups)
    slots, dim, num_pages, max_pages = 9, 8, 40, 5
    capacity = max_pages * page_size
    q, k_pages, v_pages = (np.asarray(jnp.asarray(rng.normal(size=shape), dtype), np.float64) for shape in
                           [(slots, heads, dim)] + [(kv_heads, num_pages, page_size, dim)] * 2)
    tables = np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(slots)]).astype(np.int32)
    tables[1, :2] = tables[0, :2]  # two samples of one prompt share its first pages
    lengths = np.array([page_size + 1, 0, capacity, 1, page_size, capacity - 1, 0, 2 * page_size, 3],
                       np.int32)
    scale = dim ** -0.5

    def run(k, v):
        kernel = jax.jit(ragged_decode_attention, static_argnames=("scale", "groups", "block_tokens"))
        return kernel(*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(tables), jnp.asarray(lengths),
                      scale=scale, groups=groups, block_tokens=block_tokens)

    got = run(k_pages, v_pages)
    assert got.dtype == dtype and got.shape == q.shape
    live = lengths > 0
    error = np.abs(np.asarray(got, np.float64)[live] - _reference(q[live], k_pages, v_pages, tables[live],
                                                                    lengths[live], scale)).max()
    assert error < (2e-6 if dtype == "float32" else 2 * BF16_STEP), error
    assert (np.asarray(got)[~live] == 0).all()
    read = np.zeros((num_pages, page_size), bool)  # the (page, offset) of every key a slot sees
    for s in range(slots):
        positions = np.arange(lengths[s])
        read[tables[s, positions // page_size], positions % page_size] = True
    poisoned_k, poisoned_v = k_pages.copy(), v_pages.copy()
    poisoned_k[:, ~read], poisoned_v[:, ~read] = 1e4, -1e4
    again = run(poisoned_k, poisoned_v)
    np.testing.assert_array_equal(np.asarray(again, np.float64), np.asarray(got, np.float64))
