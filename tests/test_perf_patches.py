"""Tests for the proposed CPU performance patches: blocked causal attention and tiled MoE experts give
the same results as the reference paths (and as transformers) on sequences longer than one block."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jitted_model as jm
from respo_jax.models import qwen3
from respo_jax.models.qwen3.attention import (
    MAX_CAUSAL_BLOCKS,
    attention_mask_from_slots,
    causal_block_attention,
    causal_block_rows,
    dot_product_attention,
)
from respo_jax.models.qwen3.moe import grouped_ffn


def test_causal_block_attention_matches_full_attention_on_real_rows():
    b, s, h, kvh, d = 3, 300, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d))
    k = jax.random.normal(keys[1], (b, s, kvh, d))
    v = jax.random.normal(keys[2], (b, s, kvh, d))
    pads = np.array([0, 5, 140])  # the last row's padding spans more than one block
    valid = jnp.asarray(np.arange(s)[None, :] >= pads[:, None])
    mask = attention_mask_from_slots(jnp.arange(s), valid)
    # Each side through one jit (as the model calls them): a compiled program, not one per eager op.
    def full_fn(q, k, v):
        return dot_product_attention(q, k, v, mask, 0.25)

    def blocked_fn(q, k, v):
        return causal_block_attention(q, k, v, mask, 0.25, block=128)

    full, blocked = jax.jit(full_fn)(q, k, v), jax.jit(blocked_fn)(q, k, v)
    for row, pad in enumerate(pads):
        np.testing.assert_allclose(blocked[row, pad:], full[row, pad:], rtol=1e-5, atol=1e-5)

    def real_loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(valid[:, :, None, None], fn(q, k, v), 0.0) ** 2)

    g_full = jax.jit(jax.grad(real_loss(full_fn), (0, 1, 2)))(q, k, v)
    g_blocked = jax.jit(jax.grad(real_loss(blocked_fn), (0, 1, 2)))(q, k, v)
    for a, c in zip(g_blocked, g_full):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)


def test_causal_block_rows_bounds_the_number_of_blocks():
    # Short sequences keep 64-row blocks; a long one gets wider blocks (a multiple of 64), never more
    # than MAX_CAUSAL_BLOCKS of them, and never fewer rows than it needs.
    assert causal_block_rows(127) == 64 and causal_block_rows(192) == 64 and causal_block_rows(256) == 64
    assert causal_block_rows(320) == 128 and causal_block_rows(1088) == 320
    for seq in range(1, 5000, 37):
        rows = causal_block_rows(seq)
        assert rows % 64 == 0 and -(-seq // rows) <= MAX_CAUSAL_BLOCKS
        assert rows == 64 or -(-seq // (rows - 64)) > MAX_CAUSAL_BLOCKS  # the smallest such multiple
    with pytest.raises(ValueError):
        causal_block_rows(10, block=0)


def test_default_blocks_of_a_long_sequence_match_full_attention():
    # 700 tokens: the default rule cuts 4 blocks of 192 rows (the last one shorter).
    b, s, h, kvh, d = 2, 700, 2, 1, 8
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (b, s, n, d)) for key, n in zip(keys, (h, kvh, kvh)))
    pads = np.array([0, 250])
    valid = jnp.asarray(np.arange(s)[None, :] >= pads[:, None])
    mask = attention_mask_from_slots(jnp.arange(s), valid)
    full = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, mask, 0.3))(q, k, v)
    blocked = jax.jit(lambda q, k, v: causal_block_attention(q, k, v, mask, 0.3))(q, k, v)
    for row, pad in enumerate(pads):
        np.testing.assert_allclose(blocked[row, pad:], full[row, pad:], rtol=1e-5, atol=1e-5)


def test_long_left_padded_logits_match_transformers():
    cfg = qwen3.Qwen3Config.preset("tiny")
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = qwen3.from_pretrained(tmp)
    b, s = 2, 300
    rng = np.random.default_rng(0)
    pads = np.array([0, 137])
    mask = (np.arange(s)[None, :] >= pads[:, None]).astype(np.int64)
    ids = rng.integers(1, cfg.vocab_size, size=(b, s)) * mask
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(positions)).logits.numpy()
    logp = jm.token_logprobs(model, jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]),
                             positions=jnp.asarray(positions[:, :-1]), attention_mask=jnp.asarray(mask[:, :-1]))
    ref_logp = torch.log_softmax(torch.tensor(ref[:, :-1]), -1).gather(-1, torch.tensor(ids[:, 1:])[..., None])[..., 0].numpy()
    for row, pad in enumerate(pads):
        np.testing.assert_allclose(np.asarray(logp)[row, pad:], ref_logp[row, pad:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["ragged", "tiled"])
def test_grouped_ffn_padding_rows_are_zero_and_groups_match_per_expert_matmuls(impl):
    """Rows past sum(group_sizes) are padding (the expert-parallel receive buffers): they come out as
    zeros and do not disturb the real rows, which equal each expert's SwiGLU in float64 NumPy."""
    rng = np.random.default_rng(3)
    experts, embed, mlp, rows = 3, 8, 6, 23
    sizes = np.array([5, 0, 9])  # 14 real rows, 9 padding rows (random values: must not leak)
    x = rng.standard_normal((rows, embed)).astype(np.float32)
    gate, up = (0.3 * rng.standard_normal((experts, embed, mlp)).astype(np.float32) for _ in range(2))
    down = (0.3 * rng.standard_normal((experts, mlp, embed))).astype(np.float32)
    got = np.asarray(grouped_ffn(jnp.asarray(x), jnp.asarray(sizes, jnp.int32), jnp.asarray(gate), jnp.asarray(up),
                                 jnp.asarray(down), impl, tile=4))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    start = 0
    for e, n in enumerate(sizes):
        xe = x[start:start + n].astype(np.float64)
        want = (silu(xe @ gate[e]) * (xe @ up[e])) @ down[e]
        np.testing.assert_allclose(got[start:start + n], want, rtol=1e-5, atol=1e-5)
        start += n
    assert np.all(got[start:] == 0.0)
