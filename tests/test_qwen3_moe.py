"""Qwen3-MoE port vs transformers: mixed sparse/dense stacks, routing, dropless ragged_dot experts,
Routing Replay, the load-balancing loss, KV-cache decoding and checkpoint round trips."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import jitted_model as jm
from respo_jax.models import qwen3
from respo_jax.models.qwen3.moe import expert_ffn, route

VOCAB = 128
REL_TOL = 1e-4

# Three layouts: all layers sparse (as the published Qwen3-MoE checkpoints), sparse except
# mlp_only_layers=[2] (runs M M | D | M), and every second layer sparse (D M D M); with and without
# top-k renormalisation.
HF_CONFIGS = {
    "all_sparse": dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                       mlp_only_layers=[], norm_topk_prob=True),
    "mlp_only": dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                     mlp_only_layers=[2], norm_topk_prob=True),
    "sparse_step2": dict(num_hidden_layers=4, num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2,
                         mlp_only_layers=[], norm_topk_prob=False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.set_default_dtype(torch.float32)
    out = {}
    for seed, (name, extra) in enumerate(HF_CONFIGS.items()):
        torch.manual_seed(seed)
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
            attn_implementation="eager", **extra)
        model = transformers.Qwen3MoeForCausalLM(cfg).eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, str(path))
    return out


def _left_padded_batch(seed: int = 0, batch: int = 3, seq: int = 10):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        mask[row, : 3 * row] = 0
    return ids * mask, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _jax(*tensors):
    return tuple(jnp.asarray(t.numpy()) for t in tensors)


def _rel_err(ours, ref, mask=None) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if mask is not None:
        ours, ref = ours[mask], ref[mask]
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_logits_and_aux_loss_match_transformers(checkpoints, name):
    hf_model, path = checkpoints[name]
    ids, mask, positions = _left_padded_batch()
    with torch.no_grad():
        ref = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions, output_router_logits=True)
    model = qwen3.from_pretrained(path)
    cfg = model.config
    expected_kinds = {"all_sparse": (True, True), "mlp_only": (True, True, False, True),
                      "sparse_step2": (False, True, False, True)}[name]
    assert tuple(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) == expected_kinds
    out = jm.forward(model, *_jax(ids, positions, mask), return_routing=True)
    real = mask.numpy().astype(bool)
    assert _rel_err(out.logits, ref.logits.numpy(), real) < REL_TOL
    np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-5)
    assert out.routing.shape == (cfg.num_moe_layers, 3, 10, cfg.num_experts_per_tok)
    # Our routing is transformers' top-k of the same router logits (real tokens).
    hf_topk = [torch.topk(torch.softmax(logits, -1), cfg.num_experts_per_tok, -1).indices.reshape(3, 10, -1)
               for logits in ref.router_logits]
    for ours, theirs in zip(np.asarray(out.routing), hf_topk):
        assert np.array_equal(np.sort(ours[real], -1), np.sort(theirs.numpy()[real], -1))


def test_load_balancing_loss_matches_transformers_function():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2 * 7, 6, generator=gen)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :4] = 0
    for attention_mask in (None, mask):
        ref = load_balancing_loss_func(tuple(logits), 6, 2, attention_mask)
        ours = qwen3.load_balancing_loss(jnp.asarray(logits.numpy()), 2,
                                         None if attention_mask is None else jnp.asarray(mask.numpy()))
        np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)


def _ffn_reference(x, indices, weights, gate, up, down):
    """float64 loop over tokens and their chosen experts."""
    x, gate, up, down, weights = (np.asarray(a, np.float64) for a in (x, gate, up, down, weights))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k, e in enumerate(np.asarray(indices)[t]):
            g, u = x[t] @ gate[e], x[t] @ up[e]
            out[t] += weights[t, k] * ((g / (1 + np.exp(-g))) * u) @ down[e]
    return out


@pytest.mark.parametrize("impl", ["ragged", "tiled"])
def test_dropless_expert_ffn_matches_per_token_reference_and_dense_gradients(impl):
    """Both grouped-matmul kernels (tile 4: several tiles per expert, empty experts) against the
    float64 per-token reference and the gradients of every expert on every token."""
    keys = jax.random.split(jax.random.key(0), 6)
    tokens, embed, mlp, experts, top_k = 13, 8, 5, 6, 2
    x = jax.random.normal(keys[0], (tokens, embed))
    gate, up = (jax.random.normal(k, (experts, embed, mlp)) for k in keys[1:3])
    down = jax.random.normal(keys[3], (experts, mlp, embed))
    # Expert 4 and 5 receive no tokens; expert 0 receives most.
    second = jax.random.randint(keys[4], (tokens,), 1, 4)
    indices = jnp.stack([jnp.zeros(tokens, jnp.int32), second], axis=1)
    indices = jnp.where((jnp.arange(tokens) % 2 == 1)[:, None], indices[:, ::-1], indices)
    weights = jax.nn.softmax(jax.random.normal(keys[5], (tokens, top_k)), -1)
    ffn = functools.partial(expert_ffn, impl=impl, tile=4)
    got = jax.jit(ffn)(x, indices, weights, gate, up, down)
    np.testing.assert_allclose(np.asarray(got), _ffn_reference(x, indices, weights, gate, up, down),
                               rtol=1e-5, atol=1e-5)

    def dense(x, weights, gate, up, down):  # every expert on every token, masked by the choice
        h = jax.nn.silu(jnp.einsum("te,nem->tnm", x, gate)) * jnp.einsum("te,nem->tnm", x, up)
        y = jnp.einsum("tnm,nme->tne", h, down)
        choice = jnp.einsum("tk,tkn->tn", weights, jax.nn.one_hot(indices, experts))
        return jnp.einsum("tne,tn->te", y, choice)

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    ours = jax.jit(jax.grad(loss(lambda *a: ffn(a[0], indices, *a[1:])), argnums=(0, 1, 2, 3, 4)))(
        x, weights, gate, up, down)
    ref = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3, 4)))(x, weights, gate, up, down)
    for g, r in zip(ours, ref):
        assert _rel_err(g, r) < 1e-5
    assert np.all(np.asarray(ours[2])[4:] == 0)  # unused experts get exactly zero gradient


def test_route_replay_reads_current_probabilities():
    logits = jax.random.normal(jax.random.key(1), (5, 6))
    probs = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    w, idx, p = route(logits, 2, norm_topk_prob=False)
    assert np.array_equal(np.asarray(idx), np.argsort(-probs, -1)[:, :2])
    np.testing.assert_allclose(np.asarray(w), np.sort(probs, -1)[:, ::-1][:, :2], rtol=1e-6)
    given = jnp.asarray([[5, 0], [1, 2], [3, 3], [0, 4], [2, 1]])
    w, idx, _ = route(logits, 2, norm_topk_prob=True, indices=given)
    picked = np.take_along_axis(probs, np.asarray(given), -1)
    np.testing.assert_allclose(np.asarray(w), picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    assert np.array_equal(np.asarray(idx), np.asarray(given))
    with pytest.raises(ValueError, match="replayed routing has shape"):
        route(logits, 2, True, indices=given[:, :1])


@pytest.mark.slow
def test_routing_replay_reproduces_logits_and_keeps_router_gradient(checkpoints):
    _, path = checkpoints["all_sparse"]
    model = qwen3.from_pretrained(path, scan_layers=True)  # one stacked router: [layers, embed, experts]
    ids, mask, positions = _jax(*_left_padded_batch(seed=2))
    own = jm.forward(model, ids, positions, mask, return_routing=True)
    replayed = jm.forward(model, ids, positions, mask, routing=own.routing, return_routing=True)
    np.testing.assert_array_equal(np.asarray(replayed.logits), np.asarray(own.logits))
    np.testing.assert_array_equal(np.asarray(replayed.routing), np.asarray(own.routing))
    shifted = (own.routing + 1) % model.config.num_experts
    other = jm.forward(model, ids, positions, mask, routing=shifted, return_routing=True)
    assert np.array_equal(np.asarray(other.routing), np.asarray(shifted))
    assert _rel_err(other.logits, own.logits) > 1e-2

    targets = jnp.roll(ids, -1, axis=1)

    def loss(model, routing):
        logp = model.token_logprobs(ids, targets, positions, mask, routing=routing, chunk_size=3)
        return jnp.sum(logp * mask)

    grad_fn = nnx.jit(nnx.grad(loss))
    free = nnx.to_flat_state(grad_fn(model, None))
    replay = nnx.to_flat_state(grad_fn(model, own.routing))
    for (path_, g_free), (_, g_replay) in zip(free, replay):
        assert _rel_err(g_replay[...], g_free[...]) < 1e-5, path_
    logp, aux = jm.token_logprobs(model, ids, targets, positions, mask, routing=own.routing, return_aux=True)
    np.testing.assert_allclose(float(aux), float(own.aux_loss), rtol=1e-6)
    expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(own.logits)), np.asarray(targets)[..., None],
                                  -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp), expected, rtol=1e-5, atol=1e-5)
    router_grads = [g[...] for p, g in replay if p[-1] == "router"]
    assert len(router_grads) == 1 and router_grads[0].shape == (2, 64, 8)  # one stack of 2 layers
    assert all(np.abs(g).max() > 0 for g in router_grads[0])
    # With someone else's routing the router still receives a (different) gradient.
    forced = dict(nnx.to_flat_state(grad_fn(model, shifted)))
    assert np.abs(forced[("stacks", 0, "layers", "mlp", "router")][...]).max() > 0


def test_kv_cache_decode_matches_full_forward(checkpoints):
    _, path = checkpoints["sparse_step2"]
    model = qwen3.from_pretrained(path)
    ids, mask, positions = _jax(*_left_padded_batch(seed=4))
    full = jm.forward(model, ids, positions, mask, return_routing=True)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, positions, mask, cache):
        out = nnx.merge(graphdef, state).forward(ids, positions, mask, cache=cache, return_routing=True)
        return out.logits, out.cache, out.routing

    cache = qwen3.init_cache(model.config, 3, 12)
    real = np.asarray(mask).astype(bool)
    logits, cache, routing = step(state, ids[:, :7], positions[:, :7], mask[:, :7], cache)
    chunks, routes = [logits], [routing]
    for t in range(7, 10):
        logits, cache, routing = step(state, ids[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
        chunks.append(logits)
        routes.append(routing)
    assert _rel_err(jnp.concatenate(chunks, 1), full.logits, real) < 1e-5
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(routes, 2))[:, real],
                                  np.asarray(full.routing)[:, real])


def test_save_pretrained_round_trip_in_transformers(checkpoints, tmp_path):
    hf_model, path = checkpoints["mlp_only"]
    model = qwen3.from_pretrained(path)
    qwen3.save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["model_type"], saved["num_experts"], saved["mlp_only_layers"]) == ("qwen3_moe", 8, [2])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids, mask, positions = _left_padded_batch(seed=6)
    with torch.no_grad():
        a = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        b = reloaded(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert torch.equal(a, b)
    ours = load_file(str(tmp_path / "model.safetensors"))
    theirs = load_file(os.path.join(path, "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_loads_fused_expert_layout_and_classic_config_names(checkpoints, tmp_path):
    """transformers-5 fused expert tensors and classic config names load to the same model."""
    _, path = checkpoints["mlp_only"]
    reference = qwen3.from_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    fused = {}
    for name, value in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = value
    for layer in (0, 1, 3):
        p = f"model.layers.{layer}.mlp.experts."
        fused[p + "gate_up_proj"] = np.stack([np.concatenate(
            [tensors[f"{p}{j}.gate_proj.weight"], tensors[f"{p}{j}.up_proj.weight"]]) for j in range(8)])
        fused[p + "down_proj"] = np.stack([tensors[f"{p}{j}.down_proj.weight"] for j in range(8)])
    save_file(fused, str(tmp_path / "model.safetensors"))
    hf = json.loads(open(os.path.join(path, "config.json")).read())
    assert hf["num_local_experts"] == 8 and "rope_parameters" in hf  # transformers-5 names
    classic = {k: v for k, v in hf.items() if k not in ("num_local_experts", "rope_parameters")}
    classic.update(num_experts=8, rope_theta=hf["rope_parameters"]["rope_theta"])
    (tmp_path / "config.json").write_text(json.dumps(classic))
    assert qwen3.load_config(tmp_path) == qwen3.load_config(path)
    model = qwen3.from_pretrained(tmp_path)
    ids = _jax(_left_padded_batch()[0])[0]
    np.testing.assert_array_equal(np.asarray(jm.logits(model, ids)), np.asarray(jm.logits(reference, ids)))
    del fused["model.layers.3.mlp.experts.down_proj"]
    save_file(fused, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.3\.mlp\.experts\.0\.down_proj\.weight.*fused"):
        qwen3.from_pretrained(tmp_path)


def test_bf16_close_to_fp32_under_replayed_routing(checkpoints):
    """bf16 can flip near-tied expert choices; with the fp32 routing replayed, bf16 logits stay within
    3% of the largest fp32 logit."""
    _, path = checkpoints["mlp_only"]
    ids, mask, positions = _jax(*_left_padded_batch(seed=8))
    fp32 = jm.forward(qwen3.from_pretrained(path), ids, positions, mask, return_routing=True)
    bf16 = jm.forward(qwen3.from_pretrained(path, dtype=jnp.bfloat16), ids, positions, mask, routing=fp32.routing)
    real = np.asarray(mask).astype(bool)
    assert 0 < _rel_err(bf16.logits, fp32.logits, real) < 0.03


def test_scan_remat_and_unrolled_moe_stacks_agree(checkpoints):
    _, path = checkpoints["mlp_only"]
    ids, mask, positions = _jax(*_left_padded_batch(seed=10))
    ref = jm.forward(qwen3.from_pretrained(path, scan_layers=False), ids, positions, mask, return_routing=True)
    model = qwen3.from_pretrained(path, scan_layers=True, remat=True)
    out = nnx.jit(lambda m: m.forward(ids, positions, mask, return_routing=True))(model)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.routing), np.asarray(ref.routing))
    np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-6)
