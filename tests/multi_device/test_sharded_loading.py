"""On 8 simulated CPU devices: sharded loading from the hub's and the fused expert layouts (reading slices,
never whole tensors), the expert-parallel FFN's dispatches and kernels, and the sampler under the model's
mesh and rules, each against one device. Run by tests/test_multi_device.py."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from meshes import MOE_SPECS, flat_params, mesh_of, model_of, rel, spec_of, tiny

from respo_jax.models import qwen3
from respo_jax.models.qwen3 import checkpoint as checkpoint_module
from respo_jax.models.qwen3 import moe as moe_module
from respo_jax.sharding import ShardingRules


def _fused_copy(src: str, dst: str, cfg) -> None:
    """The checkpoint at src rewritten with transformers-5's fused expert tensors."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(src, "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    n = cfg.num_experts
    for layer in cfg.moe_layers:
        p = f"model.layers.{layer}.mlp.experts."
        fused[p + "gate_up_proj"] = np.stack([np.concatenate(
            [tensors[f"{p}{j}.gate_proj.weight"], tensors[f"{p}{j}.up_proj.weight"]]) for j in range(n)])
        fused[p + "down_proj"] = np.stack([tensors[f"{p}{j}.down_proj.weight"] for j in range(n)])
    save_file(fused, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def test_sharded_loading_equals_unsharded_and_reads_slices(monkeypatch, tmp_path):
    """from_pretrained(mesh=) builds each parameter in its sharding with the unsharded values, from the
    hub and the fused expert layouts; split parameters are read block by block, never whole."""
    reads = []
    original = checkpoint_module.SafetensorsReader.read

    def recording(self, name, index):
        out = original(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(checkpoint_module.SafetensorsReader, "read", recording)
    hub, fused = str(tmp_path / "hub"), str(tmp_path / "fused")
    os.makedirs(hub), os.makedirs(fused)
    cfg = tiny(True)
    qwen3.save_pretrained(model_of(True, None), hub)
    _fused_copy(hub, fused, cfg)
    want = flat_params(qwen3.from_pretrained(hub, scan_layers=True))
    for path in (hub, fused):
        for shape in ((1, 2, 2, 2), (2, 1, 1, 4)):
            mesh = mesh_of(*shape)
            reads.clear()
            model = qwen3.from_pretrained(path, mesh=mesh, scan_layers=True)
            assert model.config.mesh is mesh
            got = flat_params(model)
            for name in want:
                np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]),
                                              err_msg=f"{path} {shape} {name}")
                assert spec_of(got[name]) == MOE_SPECS[name], (name, got[name].sharding.spec)
            if shape == (1, 2, 2, 2):
                # q_proj [heads·head_dim, embed] = [64, 64]: heads over tensor (2), embed over
                # (fsdp, expert) (4): eighth blocks only
                q = [s for n, s in reads if n == "model.layers.0.self_attn.q_proj.weight"]
                assert q and all(s == (32, 16) for s in q), q
                # experts split over expert (2), expert_mlp over tensor (2), embed over fsdp (2)
                if path == fused:
                    g = [s for n, s in reads if n == "model.layers.0.mlp.experts.gate_up_proj"]
                    assert g and all(s == (4, 16, 32) for s in g), g
                else:
                    g = [s for n, s in reads if n == "model.layers.0.mlp.experts.5.gate_proj.weight"]
                    assert g and all(s == (16, 32) for s in g), g


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all's documented semantics from all_gather (XLA:CPU lacks the collective):
    device i's rows operand[input_offsets[j] : + send_sizes[j]] land in device j's output at
    output_offsets[j] (as given by the sender)."""
    del recv_sizes, axis_index_groups
    me = jax.lax.axis_index(axis_name)
    rows_all = jax.lax.all_gather(operand, axis_name)                  # [devices, rows, ...]
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # per source: where its rows for me start
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    lands = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    r = jnp.arange(operand.shape[0])
    src = jnp.clip(starts[:, None] + r[None, :], 0, operand.shape[0] - 1)   # [devices, rows]
    dst = jnp.where(r[None, :] < sizes[:, None], lands[:, None] + r[None, :], output.shape[0])
    values = jnp.take_along_axis(rows_all, src.reshape(*src.shape, *([1] * (operand.ndim - 1))), axis=1)
    return output.at[dst.reshape(-1)].set(values.reshape(-1, *operand.shape[1:]), mode="drop")


def test_expert_parallel_ffn_matches_single_device(monkeypatch):
    """expert_parallel_ffn with experts over 4 and 8 devices (and expert_mlp over tensor), both kernels,
    the padded all-to-all and the ragged dispatch (its collective emulated from its documented
    semantics): outputs and gradients w.r.t. tokens, gate weights and expert weights equal expert_ffn."""
    rng = np.random.default_rng(0)
    b, s, e, n, k, m = 8, 6, 16, 8, 2, 8
    x = jnp.asarray(rng.standard_normal((b, s, e)), jnp.float32)
    gate, up = (jnp.asarray(0.3 * rng.standard_normal((n, e, m)), jnp.float32) for _ in range(2))
    down = jnp.asarray(0.3 * rng.standard_normal((n, m, e)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((b * s, n)), jnp.float32).at[:, 3].set(-1e9)  # expert 3 idle
    weights, indices, _ = moe_module.route(logits, k, norm_topk_prob=True)
    weights, indices = weights.reshape(b, s, k), indices.reshape(b, s, k)

    def reference(x, weights, gate, up, down):
        return moe_module.expert_ffn(x.reshape(b * s, e), indices.reshape(b * s, k),
                                     weights.reshape(b * s, k), gate, up, down).reshape(b, s, e)

    cotangent = jnp.asarray(rng.standard_normal((b, s, e)), jnp.float32)
    args = (x, weights, gate, up, down)
    want = reference(*args)
    want_grads = jax.grad(lambda *a: jnp.sum(reference(*a) * cotangent), argnums=tuple(range(5)))(*args)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    for shape, impl, dispatch in (((2, 1, 1, 4), "tiled", "all_to_all"),
                                  ((2, 1, 1, 4), "ragged", "ragged_all_to_all"),
                                  ((1, 1, 1, 8), "tiled", "ragged_all_to_all"),
                                  ((1, 1, 2, 4), "ragged", "all_to_all")):
        mesh = mesh_of(*shape)

        def sharded(x, weights, gate, up, down):
            out = moe_module.expert_parallel_ffn(x, indices, weights, gate, up, down, mesh=mesh,
                                                 rules=ShardingRules(), impl=impl, dispatch=dispatch)
            return jnp.sum(out * cotangent), out

        (_, got), grads = jax.jit(jax.value_and_grad(sharded, argnums=tuple(range(5)), has_aux=True))(*args)
        assert rel(got, want) < 1e-5, (shape, impl, dispatch, rel(got, want))
        for i, (g, w) in enumerate(zip(grads, want_grads)):
            assert rel(g, w) < 1e-5, (shape, impl, dispatch, i, rel(g, w))


def test_sampler_runs_under_the_model_mesh_and_rules():
    """generate runs under the model config's mesh and rules: tokens, log-probs and routing split their
    batch by the "batch" rule (default (data, fsdp, expert); a table saying "data" splits over data
    only), filler rows pad the batch to a multiple, and the samples equal the single-device ones."""
    from respo_jax.sampling import SamplingParams, generate

    # initializer_range 0.3: well-separated logits, so top-k sets are not decided by float rounding
    cfg = qwen3.Qwen3Config.preset("tiny-moe", initializer_range=0.3, scan_layers=True)
    mesh = mesh_of(2, 2, 2, 1)
    plain = qwen3.init_model(cfg, seed=0)
    sharded = qwen3.init_model(cfg.replace(mesh=mesh), seed=0)
    by_data_rules = ShardingRules().replace(batch=("data", "expert"))
    by_data = qwen3.init_model(cfg.replace(mesh=mesh, rules=by_data_rules), seed=0)
    prompts = [[5, 9, 17], [3, 1, 4, 1, 5, 9], [100], [8, 8]]
    params = SamplingParams(max_new_tokens=5, temperature=1.0, top_k=30, seed=4, num_samples=1)
    want = generate(plain, prompts, params, return_routing=True)
    got = generate(sharded, prompts, params, return_routing=True)
    # (the compiler may drop the size-1 expert axis from a spec: compare what the shardings place where)
    batch_split = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert")))
    assert got.tokens.sharding.is_equivalent_to(batch_split, 2), got.tokens.sharding
    routing_split = jax.sharding.NamedSharding(mesh, P(None, ("data", "fsdp", "expert")))
    assert got.routing.sharding.is_equivalent_to(routing_split, 4), got.routing.sharding
    data_only = generate(by_data, prompts, params, return_routing=True)
    assert data_only.tokens.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data")), 2), \
        data_only.tokens.sharding
    # 3 rows are padded to 4 (a multiple of data x fsdp) with filler rows; a row's samples depend only on
    # its own prompt, index and the seed, so they equal the first 3 unsharded rows.
    padded = generate(sharded, prompts[:3], params, return_routing=True)
    for name in ("tokens", "routing", "logprobs"):
        expected = np.asarray(getattr(want, name))
        np.testing.assert_allclose(np.asarray(getattr(got, name)), expected, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(getattr(data_only, name)), expected, atol=1e-5, err_msg=name)
        first3 = expected[:, :3] if name == "routing" else expected[:3]
        np.testing.assert_allclose(np.asarray(getattr(padded, name)), first3, atol=1e-5, err_msg=name)
    # Rows seeded by ids of their own (`row_ids`) on the mesh: 2 rows padded to 4, given the ids of rows 2
    # and 0 of the batch above, are those rows' samples although they now sit at rows 0 and 1.
    by_id = generate(sharded, [prompts[2], prompts[0]], params, return_routing=True, row_ids=[2, 0])
    for name in ("tokens", "logprobs"):
        expected = np.asarray(getattr(want, name))[[2, 0]]
        np.testing.assert_allclose(np.asarray(getattr(by_id, name)), expected, atol=1e-5, err_msg=name)
