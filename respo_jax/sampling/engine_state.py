"""The rollout engine's device state (page pools, the decode slots' rows, the outputs) and its result,
`GenerateOutput`.

Why one module: every engine program (`model_step`) takes the state and returns it
donated, and they must all agree on its shapes and shardings, or a program compiled ahead
(`Engine.compile`) is not the one a call looks up. So the state is created once by `init_state`
under the model's mesh and every program ends with `constrain_state`: the same NamedSharding per
field whatever program produced it.

Shardings (`respo_jax.sharding.ShardingRules` logical names). The page pools split their kv heads like
the attention weights and their shards over the `batch` axes (`PAGE_AXES`): the slots split over the
same axes in contiguous blocks, and the slots of block s hold pages of shard s only (local page ids),
so each device holds its own slots' pages; the rows of the outputs split over the `batch` axes too
(slots and rows padded to a multiple); the
prompts' last logits and routing are replicated (they are read by whichever slot admits a row).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from respo_jax.models.qwen3.paged_attention import PAGE_AXES, pool_shape
from respo_jax.programs import FROM_ARGUMENTS, Program


@struct.dataclass
class GenerateOutput:
    """Result of `generate` (prompt-major: row i * num_samples + j is sample j of prompt i).

    Attributes:
      tokens: `[batch, max_new_tokens]` int32 generated tokens; pad id after EOS.
      lengths: `[batch]` int32 number of generated tokens, EOS included (at most the row's budget).
      logprobs: `[batch, max_new_tokens]` float32 log-prob of each token under the sampling
        distribution (0 after EOS, and 0 everywhere for greedy decoding).
      routing: `[num_moe_layers, batch, max_new_tokens, top_k]` int32 routed experts of each generated
        token when it was fed to the model (0 after EOS), or None.
      prompt_routing: `[num_moe_layers, batch, prompt_len, top_k]` int32 routed experts of the
        left-padded prompt (pads hold whatever the router chose for the pad token; mask them with
        `prompt_mask`), or None.
      prompt_mask: `[batch, prompt_len]` int32, 1 on real prompt tokens of the left-padded layout.
      entropy: `[batch, max_new_tokens]` float32 entropy (nats) of the sampling distribution each token
        was drawn from (0 after EOS), with `SamplingParams.return_entropy`; else None.
    """

    tokens: jax.Array
    lengths: jax.Array
    logprobs: jax.Array
    routing: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    prompt_mask: jax.Array | None = None
    entropy: jax.Array | None = None


@struct.dataclass
class EngineState:
    """Device state of the engine (slot fields are those of the row in the slot).

    k_pages, v_pages: [kv_heads, shards, layers, num_pages + 1, page_size, head_dim] (`PagedKVCache`;
    the last page of each shard: its scratch page); page_table: [slots, max_pages] int32, local page ids
    of the slot's shard; row, row_id, prompt_len, budget, generated (tokens so far),
    last_token: [slots] int32 (row_id uint32); done: [slots] bool (True for a free slot); captured:
    [slots] bool, the routing of the row's last token is recorded (routing runs only; True when free);
    seed: [2] uint32 (low, high word); prompt_logits: [logit_rows, vocab] float32, the last prompt
    token's logits of each prompt with rows still to admit; tokens, logprobs: [rows, max_new_tokens];
    lengths: [rows] int32 (rows padded to a multiple of the batch shards); routing: [num_moe_layers,
    rows, max_new_tokens, top_k] int32 or None; prompt_routing: [num_moe_layers, num_prompts, bucket,
    top_k] int32 or None; entropy: [rows, max_new_tokens] float32 (the sampling distribution's, with
    `SamplingParams.return_entropy`) or None.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    row: jax.Array
    row_id: jax.Array
    prompt_len: jax.Array
    budget: jax.Array
    generated: jax.Array
    last_token: jax.Array
    done: jax.Array
    captured: jax.Array
    seed: jax.Array
    prompt_logits: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    routing: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    entropy: jax.Array | None = None


SLOT = ("batch",)
ROWS = ("batch", None)
STATE_AXES = dict(
    k_pages=PAGE_AXES, v_pages=PAGE_AXES, page_table=ROWS, row=SLOT, row_id=SLOT, prompt_len=SLOT,
    budget=SLOT, generated=SLOT, last_token=SLOT, done=SLOT, captured=SLOT, seed=(None,),
    prompt_logits=(None, None), tokens=ROWS, logprobs=ROWS, lengths=SLOT,
    routing=(None, "batch", None, None), prompt_routing=(None, None, None, None), entropy=ROWS,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static shapes of one engine call (hashable: a static argument of `init_state`).

    slots: decode slots (a multiple of the batch shards); max_pages: page-table width; num_pages,
    page_size: each batch shard's pool (plus one scratch page); rows: output rows (padded like the slots);
    max_new_tokens; logit_rows: prompts whose logits are held at once; num_prompts, bucket: the
    prompts and their padded length; routing: record MoE routing (prompt and generated tokens);
    entropy: record each token's sampling entropy; shards: the batch shards.
    """

    slots: int
    max_pages: int
    num_pages: int
    page_size: int
    rows: int
    max_new_tokens: int
    logit_rows: int
    num_prompts: int
    bucket: int
    routing: bool
    entropy: bool = False
    shards: int = 1


def constrain_state(state: EngineState, cfg) -> EngineState:
    """Every field in its sharding (`STATE_AXES`) on the model's mesh."""
    fields = {}
    for name, axes in STATE_AXES.items():
        value = getattr(state, name)
        if value is not None:
            value = jax.lax.with_sharding_constraint(value, cfg.rules.sharding(cfg.mesh, axes))
        fields[name] = value
    return state.replace(**fields)


def place_state(state: EngineState, cfg) -> EngineState:
    """The state a program returned (arrays, or `jax.ShapeDtypeStruct`s when compiling ahead) with each
    field's sharding object the declared one (`STATE_AXES`), on the host side of the program boundary.

    Why: `constrain_state` fixes the layout, not the name JAX gives it. JAX names an output after an
    input whose sharding is equivalent, and on a mesh of size-1 axes every sharding is equivalent to
    replicated: the prompt logits of a tied-embedding model came out of the prefill and the decode
    segment as P('tensor', ('fsdp', 'expert')) (the embedding's), out of the admission as P(). A decode
    segment then ran with either, and the one `Engine.compile` had not lowered was compiled anew in
    a process reading the other from the persistent cache. Equivalent layouts: no data moves. It runs
    after every engine program, so the shardings are built once per mesh and the renamed fields go
    through one `jax.device_put` (17 separate ones cost ~1 ms a program, ~8 ms of the default run's
    0.12 s iteration)."""
    declared = _declared_shardings(cfg.mesh, cfg.rules)
    fields = {name: getattr(state, name) for name in declared}
    fields = {name: value for name, value in fields.items() if value is not None}
    abstract = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=declared[name],
                                           weak_type=value.weak_type)
                for name, value in fields.items() if isinstance(value, jax.ShapeDtypeStruct)}
    moved = [name for name, value in fields.items()
             if name not in abstract and value.sharding != declared[name]]
    placed = (jax.device_put([fields[name] for name in moved], [declared[name] for name in moved])
              if moved else [])
    return state.replace(**abstract, **dict(zip(moved, placed)))


@functools.lru_cache(maxsize=8)
def _declared_shardings(mesh, rules) -> dict:
    """Every `STATE_AXES` field's NamedSharding on `mesh` under `rules` (both hashable)."""
    return {name: rules.sharding(mesh, axes) for name, axes in STATE_AXES.items()}


def _init_state(graphdef, model_state, seed, layout: Layout, pad_token_id: int) -> EngineState:
    """The empty state (every slot free, every page-table entry the scratch page) of a call with
    `layout`, created in its shardings. `seed`: [2] uint32."""
    cfg = nnx.merge(graphdef, model_state).config
    pool = pool_shape(cfg, shards=layout.shards, num_pages=layout.num_pages, page_size=layout.page_size)
    slots, rows, new = layout.slots, layout.rows, layout.max_new_tokens
    zeros = functools.partial(jnp.zeros, (slots,), jnp.int32)
    routing = prompt_routing = None
    if layout.routing:
        top_k = cfg.num_experts_per_tok
        routing = jnp.zeros((cfg.num_moe_layers, rows, new, top_k), jnp.int32)
        prompt_routing = jnp.zeros((cfg.num_moe_layers, layout.num_prompts, layout.bucket, top_k), jnp.int32)
    state = EngineState(
        k_pages=jnp.zeros(pool, cfg.dtype), v_pages=jnp.zeros(pool, cfg.dtype),
        page_table=jnp.full((slots, layout.max_pages), layout.num_pages, jnp.int32),
        row=zeros(), row_id=jnp.zeros((slots,), jnp.uint32), prompt_len=zeros(), budget=zeros(),
        generated=zeros(), last_token=zeros(), done=jnp.ones((slots,), jnp.bool_),
        captured=jnp.ones((slots,), jnp.bool_), seed=seed.astype(jnp.uint32),
        prompt_logits=jnp.zeros((layout.logit_rows, cfg.vocab_size), jnp.float32),
        tokens=jnp.full((rows, new), pad_token_id, jnp.int32), logprobs=jnp.zeros((rows, new), jnp.float32),
        lengths=jnp.zeros((rows,), jnp.int32), routing=routing, prompt_routing=prompt_routing,
        entropy=jnp.zeros((rows, new), jnp.float32) if layout.entropy else None,
    )
    return constrain_state(state, cfg)


# Created in its shardings (`constrain_state`), once per layout.
init_state = Program(_init_state, "init_state", FROM_ARGUMENTS, FROM_ARGUMENTS, static_argnums=(0, 3, 4))


def row_keys(state: EngineState, row_id: jax.Array) -> jax.Array:
    """The keys of rows with ids `row_id` [n] (`generate`'s `fold_in(seed_key, id)`): [n] PRNG keys."""
    base = jax.random.fold_in(jax.random.key(state.seed[0]), state.seed[1])
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, row_id)


def is_eos(tokens: jax.Array, params) -> jax.Array:
    """[n] int tokens -> [n] bool: an EOS id of `params` (never with `ignore_eos`)."""
    hit = jnp.zeros(tokens.shape, jnp.bool_)
    for eos in () if params.ignore_eos else params.eos_token_ids:
        hit = hit | (tokens == eos)
    return hit
