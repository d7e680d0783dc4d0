"""On 8 simulated CPU devices: the engine under the model's mesh and rules (slots, output rows and the
page pool's shards split over the batch axes, the pool's kv heads over tensor) gives the samples and
the routing it gives on one device in a static batch. Run by tests/test_multi_device.py."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from meshes import mesh_of

from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams, engine_state, generate, model_step
from respo_jax.sampling.engine import Engine


def test_the_continuous_schedule_on_a_mesh_equals_a_static_batch_on_one_device():
    """(2,2,2,1): 4 batch shards, kv heads split over tensor; 8 slots refilled by 16 rows, whose budgets
    leave a tail that decodes at width 4 (the slots gathered across the batch shards). Tokens, log-probs,
    lengths and the routing of prompt and generated tokens equal a single-device static batch's (each
    slot reading only its batch shard's pages); the rows come out split like the batch. The pool: every
    device holds its own eighth (pool / 4 batch shards / 2 kv-head shards), no two devices the same
    block; the decode segment compiled on the mesh updates the donated pool in place (no pool-sized
    temporary, the pool aliased to the output)."""
    # initializer_range 0.3: well-separated logits, so top-k sets are not decided by float rounding
    cfg = qwen3.Qwen3Config.preset("tiny-moe", initializer_range=0.3, scan_layers=True)
    mesh = mesh_of(2, 2, 2, 1)
    plain = qwen3.init_model(cfg, seed=0)
    sharded = qwen3.init_model(cfg.replace(mesh=mesh), seed=0)
    prompts = [[5, 9, 17], [3, 1, 4, 1, 5, 9], [100], [8, 8]]
    params = SamplingParams(max_new_tokens=5, temperature=1.0, top_k=30, seed=4, num_samples=4)
    budgets = [5, 1, 2, 5, 1, 1, 2, 5, 2, 1, 1, 1, 2, 1, 5, 1]  # the last rows' tail: width 4 of 8 slots
    want = generate(plain, prompts, params, return_routing=True, engine=EngineConfig(scheduler="static"),
                    row_max_new_tokens=budgets)
    engine = EngineConfig(max_slots=8, page_size=4, steps_per_schedule=2, min_decode_slots=1)
    got = generate(sharded, prompts, params, engine=engine, return_routing=True,
                              row_max_new_tokens=budgets)
    batch_split = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert")))
    assert got.tokens.sharding.is_equivalent_to(batch_split, 2), got.tokens.sharding
    for name in ("tokens", "lengths", "routing", "prompt_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=name)
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    real = np.broadcast_to(np.asarray(want.prompt_mask)[None, :, :, None] > 0, want.prompt_routing.shape)
    np.testing.assert_array_equal(np.asarray(got.prompt_routing)[real], np.asarray(want.prompt_routing)[real])


    big = dataclasses.replace(engine, num_pages=16384)  # a pool far larger than the program's other buffers
    run = Engine(sharded, [len(p) for p in prompts], params, big, return_routing=True)
    layout = run.layout
    assert (layout.shards, layout.num_pages) == (4, 4096)
    state = engine_state.init_state(run.graphdef, run.model_state, run.seed, layout=layout, pad_token_id=0)
    split = jax.sharding.NamedSharding(mesh, P("tensor", ("data", "fsdp", "expert")))
    kv_heads, _, layers, _, page_size, head_dim = state.k_pages.shape
    for pool in (state.k_pages, state.v_pages):
        assert pool.sharding.is_equivalent_to(split, pool.ndim), pool.sharding
        blocks = pool.addressable_shards
        assert {b.data.shape for b in blocks} == {(kv_heads // 2, 1, layers, 4097, page_size, head_dim)}
        assert len({tuple((i.start, i.stop) for i in b.index) for b in blocks}) == 8  # nothing replicated
    per_device = 2 * state.k_pages.nbytes // 8
    table = np.full((layout.slots, layout.max_pages), layout.num_pages, np.int32)
    compiled = model_step.decode_segment.lower(
        run.graphdef, run.model_state, state, table, np.arange(layout.slots, dtype=np.int32), np.int32(2),
        params=run.params, impl="gather").compile()
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < per_device / 4, (memory.temp_size_in_bytes, per_device)
    assert memory.alias_size_in_bytes >= per_device, (memory.alias_size_in_bytes, per_device)
