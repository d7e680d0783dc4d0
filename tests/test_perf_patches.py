"""Tests for the proposed CPU performance patches: blocked causal attention and tiled MoE experts give
the same results as the reference paths (and as transformers) on sequences longer than one block."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from respo_jax.models import qwen3
from respo_jax.models.qwen3.attention import attention_mask_from_slots, causal_block_attention, dot_product_attention
from respo_jax.models.qwen3.moe import expert_ffn, route, tiled_expert_ffn


def test_causal_block_attention_matches_full_attention_on_real_rows():
    b, s, h, kvh, d = 3, 300, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, h, d))
    k = jax.random.normal(keys[1], (b, s, kvh, d))
    v = jax.random.normal(keys[2], (b, s, kvh, d))
    pads = np.array([0, 5, 140])  # the last row's padding spans more than one block
    valid = jnp.asarray(np.arange(s)[None, :] >= pads[:, None])
    mask = attention_mask_from_slots(jnp.arange(s), valid)
    full = dot_product_attention(q, k, v, mask, 0.25)
    blocked = causal_block_attention(q, k, v, mask, 0.25, block=128)
    for row, pad in enumerate(pads):
        np.testing.assert_allclose(blocked[row, pad:], full[row, pad:], rtol=1e-5, atol=1e-5)

    def real_loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(valid[:, :, None, None], fn(q, k, v, mask, 0.25), 0.0) ** 2)

    g_full = jax.grad(real_loss(dot_product_attention), (0, 1, 2))(q, k, v)
    g_blocked = jax.grad(real_loss(lambda *a: causal_block_attention(*a, block=128)), (0, 1, 2))(q, k, v)
    for a, c in zip(g_blocked, g_full):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)


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
    logp = model.token_logprobs(jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), positions=jnp.asarray(positions[:, :-1]),
                                attention_mask=jnp.asarray(mask[:, :-1]))
    ref_logp = torch.log_softmax(torch.tensor(ref[:, :-1]), -1).gather(-1, torch.tensor(ids[:, 1:])[..., None])[..., 0].numpy()
    for row, pad in enumerate(pads):
        np.testing.assert_allclose(np.asarray(logp)[row, pad:], ref_logp[row, pad:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_experts,top_k", [(4, 2), (16, 4)])
def test_tiled_expert_ffn_matches_ragged_dot(num_experts, top_k):
    rng = np.random.default_rng(num_experts)
    tokens, embed, mlp = 70, 16, 8
    x = jnp.asarray(rng.standard_normal((tokens, embed)), jnp.float32)
    gate, up = (jnp.asarray(0.1 * rng.standard_normal((num_experts, embed, mlp)), jnp.float32) for _ in range(2))
    down = jnp.asarray(0.1 * rng.standard_normal((num_experts, mlp, embed)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((tokens, num_experts)), jnp.float32)
    logits = logits.at[:, 0].set(-1e9)  # expert 0 receives no row: an empty group
    weights, indices, _ = route(logits, top_k, norm_topk_prob=True)
    args = (x, indices, weights, gate, up, down)
    np.testing.assert_allclose(tiled_expert_ffn(*args, tile=8), expert_ffn(*args), rtol=1e-5, atol=1e-6)

    def loss(fn):
        return lambda x, g, u, d: jnp.sum(jnp.sin(fn(x, indices, weights, g, u, d)))

    grads = jax.grad(loss(lambda *a: tiled_expert_ffn(*a, tile=8)), (0, 1, 2, 3))(x, gate, up, down)
    ref = jax.grad(loss(expert_ffn), (0, 1, 2, 3))(x, gate, up, down)
    for a, c in zip(grads, ref):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
