"""The continuous-batching engine's device side for the dense Qwen3 model: one prefill per prompt into
pages, admission of a row into a decode slot, and a jitted segment of decode steps over all slots.

Why: with a static batch every chunk decodes until its longest row ends (see `generate`); here a
finished row's slot is refilled between segments by the host `Scheduler`, and K/V live in the pages
`PagedCache` hands out, so work and memory follow the tokens rows actually generate.

The host drives three jitted programs (`generate_continuous`): `_prefill` (a prompt, left-padded to
its `EngineConfig.prompt_bucket`, through the model's own `forward` into a dense cache, scattered into
the prompt's pages; logits of its last token only), `_admit` (copy the partial prompt page if the
scheduler says so, sample the row's first token from the prompt's logits, fill the slot) and
`_decode_segment` (a `lax.while_loop` of at most `EngineConfig.steps_per_schedule` steps over every
slot, no host sync per token). After a segment the host reads the slots' token counts and done flags
(one sync), retires and refills. The decode step runs the model's decoder layers through their public
pieces (norms, `Attention.project` / `output`, the MLP) with `paged_attention` in place of the dense
cache attention.

Same samples. Row r's token t uses `fold_in(fold_in(seed_key, id_r), t)`, the key of `generate`, in
whichever slot and segment it runs: for one seed the samples do not depend on max_slots, page size,
steps_per_schedule, the pool size or the other rows (up to float round-off of attention sums over a
different number of masked keys, which can flip a draw only at a near-tie).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from respo_jax.models import qwen3
from respo_jax.models.qwen3.layers import HIDDEN, constrain, rope_cos_sin
from respo_jax.sampling.generate import GenerateOutput, _validate_prompts, _validate_row_ids, left_pad
from respo_jax.sampling.logits_processing import sample
from respo_jax.sampling.paged_attention import check_paged_attention_impl, paged_attention
from respo_jax.sampling.paged_cache import pages_for, pool_pages_for_bytes
from respo_jax.sampling.params import EngineConfig, SamplingParams
from respo_jax.sampling.scheduler import Scheduler, default_num_pages

# Logical axes of the page pools (`respo_jax.sharding.ShardingRules`): kv heads split like the attention
# weights (and like the dense cache's `qwen3.cache.CACHE_AXES`); pages and their tokens whole.
PAGE_AXES = ("layers", "kv_heads", None, None, "head_dim")


@struct.dataclass
class EngineState:
    """Device state of the engine (slot fields are those of the row in the slot).

    k_pages, v_pages: [layers, kv_heads, num_pages + 1, page_size, head_dim] (the last page: scratch);
    page_table: [slots, max_pages] int32; row, prompt_len, budget, generated (tokens so far),
    last_token: [slots] int32; done: [slots] bool (True for a free slot); row_key: [slots] PRNG keys;
    base_key: the seed's key; tokens, logprobs: [rows, max_new_tokens]; lengths: [rows] int32.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    row: jax.Array
    prompt_len: jax.Array
    budget: jax.Array
    generated: jax.Array
    last_token: jax.Array
    done: jax.Array
    row_key: jax.Array
    base_key: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array


def _is_eos(tokens: jax.Array, params: SamplingParams) -> jax.Array:
    hit = jnp.zeros(tokens.shape, jnp.bool_)
    for eos in () if params.ignore_eos else params.eos_token_ids:
        hit = hit | (tokens == eos)
    return hit


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"), donate_argnames=("state",))
def _prefill(graphdef, model_state, state: EngineState, input_ids, positions, attention_mask, pages, *,
             chunk: int | None):
    """Prefill one prompt ([1, bucket] left-padded arrays) and scatter its K/V into `pages`
    ([pages_for(bucket)] int32, the scratch page past the prompt's own). Returns (state, the last
    token's logits [vocab] float32). As in `generate`, all but the last token run in pieces of at most
    `chunk` tokens (`EngineConfig.prefill_chunk_size`; None: one piece) and the last token alone, so
    logits are computed for it only."""
    model = nnx.merge(graphdef, model_state)
    bucket = input_ids.shape[1]
    cache = qwen3.init_cache(model.config, 1, bucket, dtype=state.k_pages.dtype)
    step = chunk or bucket
    for start in range(0, bucket - 1, step):  # static unroll: few pieces
        end = min(start + step, bucket - 1)
        cache = model.forward(input_ids[:, start:end], positions[:, start:end], attention_mask[:, start:end],
                              cache).cache
    out = model.forward(input_ids[:, -1:], positions[:, -1:], attention_mask[:, -1:], cache)
    page_size = state.k_pages.shape[3]
    position = jnp.arange(pages.shape[0] * page_size, dtype=jnp.int32)
    pad = bucket - jnp.sum(attention_mask).astype(jnp.int32)
    source = jnp.minimum(position + pad, bucket - 1)  # cache slot of each prompt position (past it: junk)
    page, offset = pages[position // page_size], position % page_size

    def scatter(pool, cached):  # cached: [layers, 1, bucket, kv_heads, head_dim]
        values = cached[:, 0, source].transpose(0, 2, 1, 3).astype(pool.dtype)  # [layers, kv, T, dim]
        return pool.at[:, :, page, offset].set(values)

    cfg = model.config
    state = state.replace(k_pages=constrain(scatter(state.k_pages, out.cache.k), PAGE_AXES, cfg),
                          v_pages=constrain(scatter(state.v_pages, out.cache.v), PAGE_AXES, cfg))
    return state, out.logits[0, -1]


@functools.partial(jax.jit, static_argnames=("params",), donate_argnames=("state",))
def _admit(state: EngineState, logits, slot, row, row_id, prompt_len, budget, copy_from, copy_to, *,
           params: SamplingParams):
    """Start row `row` in `slot`: copy page `copy_from` to `copy_to` (all layers; scratch to scratch
    when there is nothing to copy), sample its first token from its prompt's `logits` [vocab]."""
    k_pages = state.k_pages.at[:, :, copy_to].set(state.k_pages[:, :, copy_from])
    v_pages = state.v_pages.at[:, :, copy_to].set(state.v_pages[:, :, copy_from])
    key = jax.random.fold_in(state.base_key, row_id)
    token, logprob = sample(jax.random.fold_in(key, 0)[None], logits[None], params.temperature, params.top_k,
                            params.top_p)
    done = _is_eos(token, params)[0] | (budget <= 1)
    return state.replace(
        k_pages=k_pages, v_pages=v_pages,
        row=state.row.at[slot].set(row), prompt_len=state.prompt_len.at[slot].set(prompt_len),
        budget=state.budget.at[slot].set(budget), generated=state.generated.at[slot].set(1),
        last_token=state.last_token.at[slot].set(token[0]), done=state.done.at[slot].set(done),
        row_key=state.row_key.at[slot].set(key),
        tokens=state.tokens.at[row, 0].set(token[0]), logprobs=state.logprobs.at[row, 0].set(logprob[0]),
        lengths=state.lengths.at[row].set(1),
    )


def _decode_step(model, state: EngineState, params: SamplingParams, impl: str) -> EngineState:
    """Feed every live slot's last token (writing its K/V into the slot's page), sample the next."""
    cfg = model.config
    live = ~state.done
    position = jnp.maximum(state.prompt_len + state.generated - 1, 0)  # of the token fed now
    page_size = state.k_pages.shape[3]
    scratch = state.k_pages.shape[2] - 1
    page = jnp.take_along_axis(state.page_table, (position // page_size)[:, None], axis=1)[:, 0]
    page = jnp.where(live, page, scratch)  # a slot with nothing to feed writes the scratch page
    offset = position % page_size
    cos, sin = rope_cos_sin(position[:, None], cfg.head_dim, cfg.rope_theta)
    table = constrain(model.embed_tokens[...], ("vocab", None), cfg)
    x = constrain(jnp.take(table, state.last_token[:, None], axis=0).astype(cfg.dtype), HIDDEN, cfg)
    def layer_step(carry, layer, layer_idx):
        x, k_pages, v_pages = carry
        q, k, v = layer.attn.project(layer.input_layernorm(x), cos, sin)  # [slots, 1, heads, dim]
        k_pages = k_pages.at[layer_idx, :, page, offset].set(k[:, 0].astype(k_pages.dtype))
        v_pages = v_pages.at[layer_idx, :, page, offset].set(v[:, 0].astype(v_pages.dtype))
        k_pages, v_pages = constrain(k_pages, PAGE_AXES, cfg), constrain(v_pages, PAGE_AXES, cfg)
        attn = paged_attention(q[:, 0], k_pages[layer_idx].astype(q.dtype),
                               v_pages[layer_idx].astype(q.dtype), state.page_table, position + 1,
                               scale=layer.attn.scale, impl=impl)
        x = x + layer.attn.output(attn[:, None])
        x = constrain(x + layer.mlp(layer.post_attention_layernorm(x)), HIDDEN, cfg)
        return x, k_pages, v_pages

    carry = (x, state.k_pages, state.v_pages)
    for stack in model.stacks:  # the model's own layer loop: scanned stacks or per-layer modules
        if cfg.scan_layers:
            graphdef, stacked = nnx.split(stack.layers)

            def scan_step(carry, xs, graphdef=graphdef):
                layer_state, layer_idx = xs
                return layer_step(carry, nnx.merge(graphdef, layer_state), layer_idx), None

            layer_ids = stack.first + jnp.arange(stack.count, dtype=jnp.int32)
            carry, _ = jax.lax.scan(scan_step, carry, (stacked, layer_ids))
        else:
            for i, layer in enumerate(stack.layers):
                carry = layer_step(carry, layer, stack.first + i)
    x, k_pages, v_pages = carry
    hidden = model.norm(x)[:, 0]
    weight = (model.embed_tokens if cfg.tie_word_embeddings else model.lm_head)[...].astype(cfg.dtype)
    logits = jnp.einsum("se,ve->sv" if cfg.tie_word_embeddings else "se,ev->sv", hidden, weight,
                        preferred_element_type=jnp.float32)
    keys = jax.vmap(jax.random.fold_in)(state.row_key, state.generated)
    tokens, token_logprobs = sample(keys, logits, params.temperature, params.top_k, params.top_p)
    rows = state.tokens.shape[0]
    write_row = jnp.where(live, state.row, rows)  # out of bounds: dropped
    generated = state.generated + live.astype(jnp.int32)
    done = state.done | (live & (_is_eos(tokens, params) | (generated >= state.budget)))
    return state.replace(
        k_pages=k_pages, v_pages=v_pages, generated=generated, done=done,
        last_token=jnp.where(live, tokens, state.last_token),
        tokens=state.tokens.at[write_row, state.generated].set(tokens, mode="drop"),
        logprobs=state.logprobs.at[write_row, state.generated].set(token_logprobs, mode="drop"),
        lengths=state.lengths.at[write_row].set(generated, mode="drop"),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "impl"), donate_argnames=("state",))
def _decode_segment(graphdef, model_state, state: EngineState, page_table, steps, *, params, impl):
    """At most `steps` (traced) decode steps of every slot, stopping early once no slot is live."""
    model = nnx.merge(graphdef, model_state)
    state = state.replace(page_table=page_table)

    def cond(carry):
        step, state = carry
        return (step < steps) & ~jnp.all(state.done)

    def body(carry):
        step, state = carry
        return step + 1, _decode_step(model, state, params, impl)

    return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]


def generate_continuous(model, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                        engine: EngineConfig = EngineConfig(),
                        row_max_new_tokens: Sequence[int] | None = None,
                        row_ids: Sequence[int] | None = None) -> GenerateOutput:
    """`generate` with continuous batching over a paged KV cache (dense Qwen3 models).

    Args:
      model: a dense `qwen3.Qwen3ForCausalLM`.
      prompts, params, row_ids: as in `generate` (prompt-major rows, `params.num_samples` per prompt).
      engine: `max_slots`, `steps_per_schedule`, `page_size`, the pool (`num_pages` / `kv_cache_bytes`),
        `paged_attention_impl`, `prompt_bucket` (the prefill's padded length) and
        `prefill_chunk_size`; the pages hold the model's compute dtype (`config.dtype`).
      row_max_new_tokens: `[rows]` each row's own budget in [1, max_new_tokens] (None: max_new_tokens).
    Returns:
      GenerateOutput (tokens, lengths, logprobs) with `generate`'s conventions: `tokens[r, t]` for
      t >= lengths[r] is `params.pad_token_id`, `logprobs` 0 there.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    cfg = model.config
    if cfg.is_moe:
        raise ValueError("generate_continuous runs dense Qwen3 models (config.num_experts == 0) for now; "
                         "use generate for MoE models")
    check_paged_attention_impl(engine.paged_attention_impl, qwen3.kernels.platform(cfg.mesh))
    prompts = _validate_prompts(prompts, cfg.vocab_size)
    lengths = [len(p) for p in prompts]
    if max(lengths) + params.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"longest prompt ({max(lengths)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                         f"exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})")
    rows = len(prompts) * params.num_samples
    ids = _validate_row_ids(row_ids, rows)
    budgets = (np.full(rows, params.max_new_tokens) if row_max_new_tokens is None
               else np.asarray(row_max_new_tokens))
    dtype = jnp.dtype(cfg.dtype)
    page_size = engine.page_size
    if engine.num_pages is not None:
        num_pages = engine.num_pages
    elif engine.kv_cache_bytes is not None:
        num_pages = pool_pages_for_bytes(engine.kv_cache_bytes, num_layers=cfg.num_hidden_layers,
                                         kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                         page_size=page_size, itemsize=dtype.itemsize)
    else:
        num_pages = default_num_pages(lengths, params.max_new_tokens, max_slots=engine.max_slots,
                                      page_size=page_size)
    sched = Scheduler(lengths, params.num_samples, budgets, max_new_tokens=params.max_new_tokens,
                      max_slots=engine.max_slots, steps_per_schedule=engine.steps_per_schedule,
                      page_size=page_size, num_pages=num_pages)
    state = _initial_state(cfg, num_pages, page_size, sched.cache.page_table, rows, params, dtype)
    static_params = dataclasses.replace(params, seed=0)  # the seed is traced (in base_key)
    graphdef, model_state = nnx.split(model)
    scratch = sched.cache.scratch_page
    prompt_logits, admitted = {}, np.zeros(len(prompts), np.int64)
    while not sched.finished:
        plan = sched.schedule()
        for prefill in plan.prefills:
            bucket = -(-prefill.tokens // engine.prompt_bucket) * engine.prompt_bucket
            input_ids, positions, mask, _ = left_pad([prompts[prefill.prompt]], bucket, 1)
            pages = np.full(pages_for(bucket, page_size), scratch, np.int32)
            pages[: len(prefill.pages)] = prefill.pages
            state, prompt_logits[prefill.prompt] = _prefill(graphdef, model_state, state, input_ids,
                                                            positions, mask, pages,
                                                            chunk=engine.prefill_chunk_size)
        for adm in plan.admissions:
            source, target = adm.copy or (scratch, scratch)
            state = _admit(state, prompt_logits[adm.prompt], np.int32(adm.slot), np.int32(adm.row),
                           np.uint32(ids[adm.row]), np.int32(lengths[adm.prompt]), np.int32(budgets[adm.row]),
                           np.int32(source), np.int32(target), params=static_params)
            admitted[adm.prompt] += 1
            if admitted[adm.prompt] == params.num_samples:
                del prompt_logits[adm.prompt]
        state = _decode_segment(graphdef, model_state, state, plan.page_table,
                                np.int32(engine.steps_per_schedule), params=static_params,
                                impl=engine.paged_attention_impl)
        generated, done = jax.device_get((state.generated, state.done))  # the one sync of a segment
        sched.retire(generated, done)
    return GenerateOutput(tokens=state.tokens, lengths=state.lengths, logprobs=state.logprobs)


def _initial_state(cfg, num_pages, page_size, page_table, rows, params: SamplingParams, dtype) -> EngineState:
    slots = page_table.shape[0]
    pool = (cfg.num_hidden_layers, cfg.num_key_value_heads, num_pages + 1, page_size, cfg.head_dim)
    seed_key = jax.random.fold_in(jax.random.key(params.seed & 0xFFFFFFFF), params.seed >> 32)
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731 (distinct buffers: the state is donated)
    return EngineState(
        k_pages=jnp.zeros(pool, dtype), v_pages=jnp.zeros(pool, dtype), page_table=jnp.asarray(page_table),
        row=zeros(), prompt_len=zeros(), budget=zeros(), generated=zeros(), last_token=zeros(),
        done=jnp.ones((slots,), jnp.bool_), row_key=jax.random.split(seed_key, slots), base_key=seed_key,
        tokens=jnp.full((rows, params.max_new_tokens), params.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((rows, params.max_new_tokens), jnp.float32),
        lengths=jnp.zeros((rows,), jnp.int32),
    )
