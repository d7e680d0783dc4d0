"""Dense Qwen3 port vs the transformers PyTorch reference: checkpoints in and out, left-padded batches,
KV-cache decoding, scan/remat, chunked log-probs, bf16, config parsing and sharding metadata."""

from __future__ import annotations

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

import jitted_model as jm
from respo_jax.models import qwen3
from respo_jax.sharding import MeshConfig, ShardingRules, make_mesh
from respo_jax.training.compilation import compilation_totals

VOCAB = 128
REL_TOL = 1e-4


def _hf_config(tie: bool) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.1,
        tie_word_embeddings=tie, attn_implementation="eager")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Random transformers checkpoints (untied and tied embeddings) saved as HF directories."""
    torch.set_default_dtype(torch.float32)
    out = {}
    for seed, tie in ((0, False), (1, True)):
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(_hf_config(tie)).eval()
        path = tmp_path_factory.mktemp(f"qwen3_tie{tie}")
        model.save_pretrained(path)
        out[tie] = (model, str(path))
    return out


def _left_padded_batch(seed: int = 0, batch: int = 3, seq: int = 11):
    """ids, mask, positions [batch, seq] with rows padded on the left by 0, 3 and 6 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        mask[row, : 3 * row] = 0
    ids = ids * mask  # pad id 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def _rel_err(ours, ref, mask=None) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if mask is not None:
        ours, ref = ours[mask], ref[mask]
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers_left_padded(checkpoints, tie):
    hf_model, path = checkpoints[tie]
    ids, mask, positions = _left_padded_batch()
    with torch.no_grad():
        ref = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.numpy()
    model = qwen3.from_pretrained(path, dtype=jnp.float32)
    assert model.config.tie_word_embeddings is tie and (model.lm_head is None) is tie
    logits = jm.logits(model, jnp.asarray(ids.numpy()), jnp.asarray(positions.numpy()), jnp.asarray(mask.numpy()))
    assert logits.shape == (3, 11, VOCAB) and logits.dtype == jnp.float32
    real = mask.numpy().astype(bool)
    assert _rel_err(logits, ref, real) < REL_TOL
    # Defaults (no mask, positions 0..s-1) match transformers' defaults.
    with torch.no_grad():
        ref_plain = hf_model(input_ids=ids).logits.numpy()
    assert _rel_err(jm.logits(model, jnp.asarray(ids.numpy())), ref_plain) < REL_TOL


def test_save_pretrained_reloads_in_transformers_with_identical_logits(checkpoints, tmp_path):
    hf_model, path = checkpoints[False]
    model = qwen3.from_pretrained(path)
    qwen3.save_pretrained(model, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["rope_theta"] == 10000.0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                 attn_implementation="eager")
    ids, mask, positions = _left_padded_batch(seed=3)
    with torch.no_grad():
        a = hf_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        b = reloaded(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert torch.equal(a, b)
    # The tensors themselves round-trip bit-exactly (same names, [out, in] layout).
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    theirs = load_file(os.path.join(path, "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_sharded_save_and_load(checkpoints, tmp_path):
    hf_model, path = checkpoints[True]
    model = qwen3.from_pretrained(path)
    qwen3.save_pretrained(model, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, like transformers
    again = qwen3.from_pretrained(tmp_path)
    ids = jnp.asarray(_left_padded_batch()[0].numpy())
    np.testing.assert_array_equal(np.asarray(jm.logits(again, ids)), np.asarray(jm.logits(model, ids)))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    with torch.no_grad():
        ids_pt = torch.tensor(np.asarray(ids))
        assert torch.equal(reloaded(input_ids=ids_pt).logits, hf_model(input_ids=ids_pt).logits)


def test_kv_cache_prefill_then_decode_matches_full_forward(checkpoints):
    """Left-padded prompts: prefill 5 slots, a 2-token chunk, then 1 token per step under one jitted
    step function; every step's logits equal the full forward's logits at the same positions, with the
    dense cache and with a paged one (`qwen3.PagedKVCache`, the rollout engine's)."""
    _, path = checkpoints[False]
    model = qwen3.from_pretrained(path)
    ids, mask, positions = (jnp.asarray(t.numpy()) for t in _left_padded_batch(seed=5, seq=11))
    full = jm.logits(model, ids, positions, mask)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, positions, mask, cache):
        out = nnx.merge(graphdef, state).forward(ids, positions, mask, cache=cache)
        return out.logits, out.cache

    cache = qwen3.init_cache(model.config, batch=3, max_len=16)
    real = np.asarray(mask).astype(bool)
    # host arrays: slicing them compiles nothing, so every program counted below is one of step's
    ids, positions, mask, full = (np.asarray(a) for a in (ids, positions, mask, full))
    bounds = [(0, 7), (7, 9)] + [(t, t + 1) for t in range(9, 11)]
    before = compilation_totals()
    for lo, hi in bounds:
        logits, cache = step(state, ids[:, lo:hi], positions[:, lo:hi], mask[:, lo:hi], cache)
        assert int(cache.index) == hi
        assert _rel_err(logits, full[:, lo:hi], real[:, lo:hi]) < 1e-5
    programs = compilation_totals() - before  # compiled, or read from the session's compilation cache
    assert programs.compiles + programs.cache_hits == 3  # one per chunk length (7, 2, 1), not per step
    assert np.array_equal(np.asarray(cache.valid[:, :11]), real)
    assert not np.asarray(cache.valid[:, 11:]).any()
    # The same steps over a paged pool (each row's pages out of order; the last page is the scratch page
    # that pads write to): the same logits at every real position, and no page a row owns is written
    # past its real tokens.
    cfg, page_size = model.config, 4
    tables = np.random.default_rng(0).permutation(12).reshape(3, 4).astype(np.int32)  # 16 positions a row
    pool = jnp.zeros((cfg.num_key_value_heads, 1, cfg.num_hidden_layers, 13, page_size, cfg.head_dim),
                     cfg.dtype)  # [kv_heads, shards, layers, pages, page_size, head_dim]
    paged = qwen3.PagedKVCache(pool, pool, jnp.asarray(tables))
    for lo, hi in bounds:
        logits, paged = step(state, ids[:, lo:hi], positions[:, lo:hi], mask[:, lo:hi], paged)
        assert _rel_err(logits, full[:, lo:hi], real[:, lo:hi]) < 1e-5
    k_pages = np.asarray(paged.k_pages)[:, 0].swapaxes(0, 1)  # [layers, kv_heads, pages, page_size, dim]
    for row, length in enumerate(real.sum(axis=1)):
        unused = [(tables[row, p // page_size], p % page_size) for p in range(length, 16)]
        assert all(not k_pages[:, :, page, offset].any() for page, offset in unused), row
        assert all(k_pages[:, :, tables[row, p // page_size], p % page_size].any() for p in range(length))


def test_cache_overflow_and_shape_errors(checkpoints):
    _, path = checkpoints[False]
    model = qwen3.from_pretrained(path)
    cache = qwen3.init_cache(model.config, batch=1, max_len=4)
    with pytest.raises(ValueError, match="cache overflow"):
        model.forward(jnp.zeros((1, 3), jnp.int32), cache=jm.forward(model, jnp.zeros((1, 2), jnp.int32),
                                                                       cache=cache).cache)
    with pytest.raises(ValueError, match="cache k/v have shape"):
        model.forward(jnp.zeros((2, 1), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model.forward(jnp.zeros((1, 3), jnp.int32), attention_mask=jnp.ones((1, 4), jnp.int32))


def test_scan_and_remat_variants_agree_in_logits_and_gradients(checkpoints):
    """Scanned, scanned + rematerialised, and unrolled layers: same logits, same gradients."""
    _, path = checkpoints[False]
    ids, mask, positions = (jnp.asarray(t.numpy()) for t in _left_padded_batch(seed=7))
    targets = jnp.roll(ids, -1, axis=1)

    def loss(model):
        logp = model.token_logprobs(ids, targets, positions, mask, chunk_size=4)
        return jnp.sum(logp * mask), model(ids, positions, mask)

    results = {}
    for scan_layers, remat in ((False, False), (True, False), (True, True)):
        model = qwen3.from_pretrained(path, scan_layers=scan_layers, remat=remat)
        grads, logits = nnx.jit(nnx.grad(loss, has_aux=True))(model)
        # per transformers tensor name: stacked and per-layer weights are laid out differently
        grads = qwen3.hf_state_dict(nnx.merge(nnx.graphdef(model), grads))
        results[scan_layers, remat] = (np.asarray(logits), grads)
    ref_logits, ref_grads = results[False, False]
    assert len(ref_grads) == 3 + 3 * 11 and all(np.abs(g).max() > 0 for g in ref_grads.values())
    for logits, grads in results.values():
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert _rel_err(g, ref_grads[name]) < 1e-4, name


def test_token_logprobs_equal_log_softmax_of_full_logits(checkpoints):
    _, path = checkpoints[True]
    model = qwen3.from_pretrained(path)
    ids, mask, positions = (jnp.asarray(t.numpy()) for t in _left_padded_batch(seed=9))
    targets = jax.random.randint(jax.random.key(0), ids.shape, 0, VOCAB)
    logits = np.asarray(jm.logits(model, ids, positions, mask), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    full = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # float64 log-softmax
    expected = np.take_along_axis(full, np.asarray(targets)[..., None], axis=-1)[..., 0]
    for chunk in (1, 4, 11, 64):  # 4 does not divide 11: the last chunk is padded
        got = jm.token_logprobs(model, ids, targets, positions, mask, chunk_size=chunk)
        assert got.shape == ids.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="targets has shape"):
        model.token_logprobs(ids, targets[:, :-1])


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_response_only_chunked_logprobs_equal_the_dense_computation_in_values_and_gradients(checkpoints, tie):
    """token_logprobs(start=, temperature=) — the LM head and log-softmax over positions start: only,
    a few tokens per chunk, with its hand-written backward — equals the dense path (full [b, s, vocab]
    logits, log_softmax(logits / T), autodiff) in values and in the gradients of every parameter."""
    _, path = checkpoints[tie]
    model = qwen3.from_pretrained(path)
    ids, mask, positions = (jnp.asarray(t.numpy()) for t in _left_padded_batch(seed=11))
    targets = jax.random.randint(jax.random.key(1), ids.shape, 0, VOCAB)
    weights = jax.random.normal(jax.random.key(2), ids.shape)  # a generic cotangent

    def dense(model, start, temperature):
        logits = model(ids, positions, mask)[:, start:] / temperature
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, targets[:, start:, None], axis=-1)[..., 0]

    def chunked(model, start, temperature, chunk):
        return model.token_logprobs(ids, targets, positions, mask, chunk_size=chunk, start=start,
                                    temperature=temperature)

    def values_and_grads(fn, start):
        """fn(model) [batch, seq - start] and the gradients of its weighted sum: one jit."""
        def loss(m):
            values = fn(m)
            return jnp.sum(values * weights[:, start:]), values

        (_, values), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        return values, jax.tree.leaves(nnx.to_pure_dict(grads))

    for start, temperature, chunk in ((0, 1.0, 64), (6, 1.0, 4), (6, 0.6, 7), (10, 1.7, 1)):
        want, grads_want = values_and_grads(lambda m: dense(m, start, temperature), start)
        got, grads_got = values_and_grads(lambda m: chunked(m, start, temperature, chunk), start)
        assert got.shape == (3, 11 - start) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        pairs = list(zip(grads_got, grads_want))
        assert len(pairs) == (2 if tie else 3) + 3 * 11 and all(np.abs(np.asarray(r)).max() > 0 for _, r in pairs)
        for g, r in pairs:
            assert _rel_err(g, r) < 1e-4
    for bad, match in ((dict(start=11), "start must lie"), (dict(temperature=0.0), "temperature must be")):
        with pytest.raises(ValueError, match=match):
            model.token_logprobs(ids, targets, positions, mask, **bad)


def test_bf16_forward_close_to_fp32(checkpoints):
    """bf16 parameters + compute: max |Δlogit| below 3% of the largest fp32 logit and mean
    |Δ log p| below 0.02 nats (float32 softmax/norm statistics, bf16 matmuls)."""
    _, path = checkpoints[False]
    ids, mask, positions = (jnp.asarray(t.numpy()) for t in _left_padded_batch(seed=11))
    fp32 = jm.logits(qwen3.from_pretrained(path, dtype=jnp.float32), ids, positions, mask)
    model = qwen3.from_pretrained(path, dtype=jnp.bfloat16)
    assert jax.tree.leaves(nnx.state(model))[0].dtype == jnp.bfloat16
    bf16 = jm.logits(model, ids, positions, mask)
    real = np.asarray(mask).astype(bool)
    assert 0 < _rel_err(bf16, fp32, real) < 0.03
    dlogp = np.abs(np.asarray(jax.nn.log_softmax(bf16) - jax.nn.log_softmax(fp32)))[real]
    assert dlogp.mean() < 0.02


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------


def test_config_accepts_classic_and_transformers5_names(checkpoints):
    _, path = checkpoints[False]
    t5 = json.loads(open(os.path.join(path, "config.json")).read())
    assert "rope_parameters" in t5 and "rope_theta" not in t5  # transformers 5 wrote it
    classic = {k: v for k, v in t5.items() if k != "rope_parameters"}
    classic.update(rope_theta=10000.0, rope_scaling=None)
    assert qwen3.Qwen3Config.from_hf_dict(t5) == qwen3.Qwen3Config.from_hf_dict(classic)
    cfg = qwen3.Qwen3Config.from_hf_dict(t5)
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_key_value_heads, cfg.is_moe) == (10000.0, 16, 2, False)
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        qwen3.Qwen3Config.from_hf_dict({**t5, "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        qwen3.Qwen3Config.from_hf_dict({**classic, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="use_sliding_window"):
        qwen3.Qwen3Config.from_hf_dict({**t5, "use_sliding_window": True})
    with pytest.raises(KeyError, match="hidden_size"):
        qwen3.Qwen3Config.from_hf_dict({k: v for k, v in t5.items() if k != "hidden_size"})


def test_missing_mismatched_and_unexpected_tensors_are_named(checkpoints, tmp_path):
    _, path = checkpoints[False]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    config = open(os.path.join(path, "config.json")).read()

    def write(name, tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(config)
        save_file(tensors, str(d / "model.safetensors"))
        return d

    missing = write("missing", {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        qwen3.from_pretrained(missing)
    bad = dict(tensors)
    bad["model.layers.2.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    named = r"model\.layers\.2\.self_attn\.k_proj\.weight.*\(16, 64\).*\(32, 64\)"
    with pytest.raises(ValueError, match=named):
        qwen3.from_pretrained(write("bad", bad))
    extra = dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros((64,), np.float32)})
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        qwen3.from_pretrained(write("extra", extra))


# Published parameter counts from the Qwen3 model cards: (total, non-embedding), in billions.
PUBLISHED = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
             "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2),
             "qwen3-30b-a3b": (30.5, 29.9), "qwen3-235b-a22b": (235, 234)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_reproduce_published_parameter_counts(name):
    cfg = qwen3.Qwen3Config.preset(name)
    shapes = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(shapes)))
    embedding = cfg.vocab_size * cfg.hidden_size
    published_total, published_non_embedding = PUBLISHED[name]
    # Model cards round to 2-3 significant digits (and count tied embeddings once).
    assert abs(total / 1e9 - published_total) / published_total < 0.1, total
    assert abs((total - embedding * (1 if cfg.tie_word_embeddings else 2)) / 1e9 - published_non_embedding) \
        / published_non_embedding < 0.03
    assert qwen3.Qwen3Config.preset(name.removeprefix("qwen3-")) == cfg


@pytest.mark.parametrize("scan_layers", [True, False])
def test_every_parameter_carries_logical_axis_names(scan_layers):
    """Stacked weights name their leading ``layers`` axis; per-layer weights (``stacks/g/layers/i``) do
    not have one."""
    cfg = qwen3.Qwen3Config.preset("tiny-moe", num_hidden_layers=3, mlp_only_layers=(1,),
                                   scan_layers=scan_layers)
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    allowed = {"layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "expert_embed",
               "expert_mlp"}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == len(var.shape) and set(names) - {None} <= allowed, (path, names)
        assert set(names) - {None} <= set(ShardingRules.logical_axes())
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    layer, stacked = ((("stacks", 0, "layers"), ("layers",)) if scan_layers
                      else (("stacks", 0, "layers", 0), ()))
    assert flat[(*layer, "mlp", "gate_proj")].get_metadata()["out_sharding"] == \
        (*stacked, "experts", "expert_embed", "expert_mlp")
    # the router's expert dimension is the only unnamed one: each token needs all its logits
    assert flat[(*layer, "mlp", "router")].get_metadata()["out_sharding"] == (*stacked, "embed", None)


def test_runs_under_a_one_device_mesh_with_rules(checkpoints):
    """With a (one-device) mesh in the config, activation constraints become real sharding annotations
    by the rules table, and the logits do not change."""
    _, path = checkpoints[False]
    model = qwen3.from_pretrained(path)
    ids, mask, positions = (jnp.asarray(t.numpy()) for t in _left_padded_batch())
    expected = np.asarray(jm.logits(model, ids, positions, mask))
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    meshed = qwen3.from_pretrained(path, mesh=mesh)
    assert meshed.config.mesh is mesh
    lowered = jax.jit(lambda *a: meshed(*a)).lower(ids, positions, mask)
    # q: [batch, seq, heads, head_dim] constrained to ((data, fsdp, expert), -, tensor, -)
    assert '[{"data", "fsdp", "expert"}, {}, {"tensor"}, {}]' in lowered.as_text()
    got = lowered.compile()(ids, positions, mask)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_per_layer_weights_match_the_layer_scan(moe):
    """scan_layers=False (the CPU layer loop, also the sampler's decode path) stores every layer's
    weights on their own, with the values of the stacked initialisation, and gives the scanned
    model's logits, cache, routing and aux loss over a prefill and two decode steps; the MoE model
    mixes stacks (MoE, dense, MoE) so per-stack layer indices and routing offsets are exercised."""
    if moe:
        cfg = qwen3.Qwen3Config.preset("tiny-moe", num_hidden_layers=3, mlp_only_layers=(1,))
    else:
        cfg = qwen3.Qwen3Config.preset("tiny", num_hidden_layers=3)
    models = [qwen3.Qwen3ForCausalLM(cfg.replace(scan_layers=scan), rngs=nnx.Rngs(3))
              for scan in (True, False)]
    stacked, per_layer = (dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in models)
    assert all(isinstance(path[3], int) for path in per_layer if path[0] == "stacks")
    assert not any(isinstance(path[3], int) for path in stacked if path[0] == "stacks")
    for path, var in per_layer.items():  # ("stacks", group, "layers", i, ...) holds layer i of the group
        if path[0] == "stacks":
            want = stacked[path[:3] + path[4:]][...][path[3]]
        else:
            want = stacked[path][...]
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(want), err_msg=str(path))
    ids, mask, positions = (jnp.asarray(t.numpy()) for t in _left_padded_batch(seed=4, batch=2, seq=6))
    ids = ids % cfg.vocab_size
    caches = [qwen3.init_cache(cfg, 2, 8), qwen3.init_cache(cfg, 2, 8)]
    steps = [(ids, positions, mask)] + [
        (ids[:, -1:] + t, positions[:, -1:] + 1 + t, np.ones((2, 1), np.int32)) for t in range(2)]
    for step_ids, step_pos, step_mask in steps:
        outs = [jm.forward(models[i], step_ids, step_pos, step_mask, cache=caches[i], return_routing=moe)
                for i in range(2)]
        caches = [out.cache for out in outs]
        np.testing.assert_allclose(outs[1].logits, outs[0].logits, rtol=1e-6, atol=1e-6)
        for name in ("k", "v", "valid", "index"):
            np.testing.assert_allclose(getattr(caches[1], name), getattr(caches[0], name), rtol=1e-6,
                                       atol=1e-6)
        if moe:
            np.testing.assert_array_equal(outs[1].routing, outs[0].routing)
            np.testing.assert_allclose(outs[1].aux_loss, outs[0].aux_loss, rtol=1e-6)
            replay = jnp.flip(outs[0].routing, axis=-1)  # replayed routing takes the same path
            np.testing.assert_allclose(
                jm.forward(models[1], step_ids, step_pos, step_mask, routing=replay).logits,
                jm.forward(models[0], step_ids, step_pos, step_mask, routing=replay).logits,
                rtol=1e-6, atol=1e-6)


def test_model_methods_hold_no_jit_the_caller_jits():
    """forward / token_logprobs trace straight into the caller's program: the layer scan sits at the
    top level of the caller's jaxpr (a jit hidden in a method would wrap it in a nested call), so the
    caller's jit, with its shardings and donation, is the only one."""
    cfg = qwen3.Qwen3Config.preset("tiny", num_hidden_layers=2, scan_layers=True)  # the scan is the marker
    graphdef, params = nnx.split(nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))))
    ids = jnp.zeros((2, 5), jnp.int32)
    for fn in (lambda p: qwen3.forward(graphdef, p, ids).logits,
               lambda p: qwen3.token_logprobs(graphdef, p, ids, ids, chunk_size=4)):
        primitives = [eqn.primitive.name for eqn in jax.make_jaxpr(fn)(params).jaxpr.eqns]
        assert "scan" in primitives, primitives
