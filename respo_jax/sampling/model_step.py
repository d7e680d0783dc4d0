"""The engine's model step: the jitted programs between two host scheduling decisions, each the
model's own forward (`Qwen3ForCausalLM.forward` over a `qwen3.PagedKVCache` of the pool) plus sampling.

- `prefill_prompts`: the prompts a schedule starts (and at most one long prompt's next piece,
  `EngineConfig.prefill_chunk_size`) as one `[P, bucket]` batch, P padded to one of a few sizes
  (`prefill_counts`; filler prompts write only the scratch page), K/V written into their pages.
- `admit_rows`: every admission of the schedule as arrays padded to the slot count (filler entries point
  out of bounds and are dropped): a row's first token from its prompt's logits, its own copy of the
  prompt's partial page.
- `decode_segment`: a `lax.while_loop` of at most `EngineConfig.steps_per_schedule` steps over the
  occupied slots padded to one of a few widths, their page table cut to the pages they hold (one of a
  few cuts, `scheduler.page_widths`), with no host sync per token. The pools are the loop's
  carry, donated and written in place (one copy of the pool in the program).

Batch shards: every batch of these programs (prompts, admissions, decode slots) is laid out in the
`shards` contiguous blocks of the batch axes, block s holding only rows whose pages are shard s's
(`Scheduler` places them), so each device reads and writes only its own pages.

Why batched: the host loop runs once per schedule and a trainer's rollout (32 prompts x G = 8 rows)
takes a fraction of a second, so a dispatch per prompt or per row would cost more than the decoding.
Shapes depend only on the call's `Layout`, the bucket, P, the prefill step and the decode width, so
each program compiles once per such shape.

One prefill per prompt: the G rows of a prompt share its pages (`PagedCache`) and its last token's
logits (`EngineState.prompt_logits`, one row per prompt with rows still to admit); each row draws its
first token from them with its own key.

Same samples. Row r's token t uses `fold_in(fold_in(seed_key, id_r), t)` in whichever slot and segment
it runs: for one seed the samples do not depend on max_slots, page size, steps_per_schedule, the pool
size or the other rows (up to float round-off of attention sums over a different number of masked
keys, which can flip a draw only at a near-tie).

Routing (MoE, `return_routing`): the experts of each generated token when it is fed to the model. A
row's last token is fed after the row is done (in the next step of the segment, or by a capture step at
the segment's end), so a row is retired only once its routing is complete.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models import qwen3
from respo_jax.models.qwen3.paged_attention import copy_pages
from respo_jax.programs import FROM_ARGUMENTS, Program
from respo_jax.sampling.engine_state import EngineState, constrain_state, is_eos, row_keys
from respo_jax.sampling.logits_processing import sample
from respo_jax.sampling.params import SamplingParams
from respo_jax.sampling.scheduler import prefill_steps


def paged_cache(state: EngineState, page_table: jax.Array, cfg, impl: str = "gather",
                interpret: bool = False) -> qwen3.PagedKVCache:
    """The state's pools as the forward's cache, with `page_table` [batch, max_pages] (local page ids of
    each row's shard), split over the model's mesh; `impl` / `interpret`: the attention kernel and whether
    it runs in the Pallas interpreter."""
    return qwen3.PagedKVCache(state.k_pages, state.v_pages, page_table, impl=impl, interpret=interpret,
                              mesh=cfg.mesh, rules=cfg.rules)


def prefill_counts(max_prompts: int, shards: int) -> tuple[int, ...]:
    """The batch sizes a prefill is padded to: `shards`·2^i up to `max_prompts` rounded up to a multiple
    of `shards` (the batch must split over the batch axes), so a run compiles at most log2 + 1 of them."""
    cap = -(-max_prompts // shards) * shards
    sizes, size = [], shards
    while size < cap:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [cap])


def padded_count(count: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` that holds `count` prompts."""
    for size in sizes:
        if size >= count:
            return size
    raise ValueError(f"{count} prompts exceed the largest prefill batch {sizes[-1]}")


def _prefill_prompts(graphdef, model_state, state: EngineState, input_ids, positions, attention_mask, pages,
                     logit_rows, prompt_index, chunk: int | None, step: int = 0) -> EngineState:
    """Step `step` of the prefill of P prompts: the model's forward over the step's pieces with the
    prompts' pages as its cache (`qwen3.PagedKVCache`), so each piece writes its K/V into the pages and
    attends over the pages its earlier pieces (earlier steps included) wrote.

    input_ids, positions, attention_mask: [P, bucket] int32, left-padded (`engine.left_pad`; filler
    rows hold one token; split over the batch axes, each prompt in the block of the shard holding its
    pages); pages: [P, pages_for(bucket)] int32 local pool pages of each prompt's tokens in
    order (the scratch page past the prompt's own, and everywhere for filler); logit_rows: [P] int32
    rows of `state.prompt_logits` to write the last token's logits to (at the last step); prompt_index:
    [P] int32 the prompts' indices (routing). Filler entries of both are out of bounds: dropped. All but
    the last token run in pieces of at most `chunk` tokens (`EngineConfig.prefill_chunk_size`; None: one
    piece) and the last token alone, so logits are computed for it only; the step runs the pieces
    `scheduler.prefill_steps` gives it. Pads write to the scratch page (masked), so a piece of pads
    alone writes nothing a real token reads.
    """
    model = nnx.merge(graphdef, model_state)
    cfg = model.config
    pieces = prefill_steps(input_ids.shape[1], chunk)[step]
    begin, end = pieces[0][0], pieces[-1][1]
    cache = paged_cache(state, pages, cfg)
    routing = state.prompt_routing is not None
    routed = []
    for start, stop in pieces:  # static unroll: few pieces
        out = model.forward(input_ids[:, start:stop], positions[:, start:stop], attention_mask[:, start:stop],
                            cache, return_routing=routing)
        cache = out.cache
        if routing:
            routed.append(out.routing.astype(jnp.int32))
    state = state.replace(k_pages=cache.k_pages, v_pages=cache.v_pages)
    if end == input_ids.shape[1]:
        logits = state.prompt_logits.at[logit_rows].set(out.logits[:, -1], mode="drop")
        state = state.replace(prompt_logits=logits)
    if routing:
        state = state.replace(prompt_routing=state.prompt_routing.at[:, prompt_index, begin:end].set(
            jnp.concatenate(routed, axis=2), mode="drop"))
    return constrain_state(state, cfg)


def _admit_rows(graphdef, model_state, state: EngineState, slot, row, row_id, prompt_len, budget, copy_from,
                copy_to, logit_row, params: SamplingParams) -> EngineState:
    """Start each row `row[i]` in `slot[i]` (all arrays [slots], entry i for slot i, so split over the
    batch axes like the slots; filler entries have `slot` and `row` out of bounds and copy the scratch
    page onto itself): copy page `copy_from` to `copy_to` (local ids of the slot's shard: its own copy
    of the prompt's partial page, all layers), draw its first token from its prompt's logits
    (`state.prompt_logits[logit_row]`) with the key of step 0 of row id `row_id`."""
    cfg = nnx.merge(graphdef, model_state).config
    k_pages, v_pages = copy_pages(state.k_pages, state.v_pages, copy_from, copy_to, cfg.mesh, cfg.rules)
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys(state, row_id), 0)
    token, logprob, *entropy = sample(keys, state.prompt_logits[logit_row], params.temperature, params.top_k,
                                      params.top_p, params.return_entropy)
    done = is_eos(token, params) | (budget <= 1)
    if entropy:  # params.return_entropy
        state = state.replace(entropy=state.entropy.at[row, 0].set(*entropy, mode="drop"))

    def put(field, value):
        return getattr(state, field).at[slot].set(value, mode="drop")

    state = state.replace(
        k_pages=k_pages, v_pages=v_pages,
        row=put("row", row), row_id=put("row_id", row_id), prompt_len=put("prompt_len", prompt_len),
        budget=put("budget", budget), generated=put("generated", jnp.ones_like(slot)),
        last_token=put("last_token", token), done=put("done", done),
        captured=put("captured", jnp.zeros_like(done)),
        tokens=state.tokens.at[row, 0].set(token, mode="drop"),
        logprobs=state.logprobs.at[row, 0].set(logprob, mode="drop"),
        lengths=state.lengths.at[row].set(jnp.ones_like(row), mode="drop"),
    )
    return constrain_state(state, cfg)


def _feed(model, state: EngineState, feed: jax.Array, impl: str, interpret: bool = False):
    """The model's forward on each slot's last token (token `generated - 1`, at its position), its K/V
    written into the slot's page where `feed` [slots] is set (elsewhere: the scratch page). Returns
    (logits [slots, vocab] float32, the state with the pools written, routing [num_moe_layers, slots,
    top_k] int32 or None)."""
    position = jnp.maximum(state.prompt_len + state.generated - 1, 0)[:, None]
    cache = paged_cache(state, state.page_table, model.config, impl, interpret)
    out = model.forward(state.last_token[:, None], position, feed[:, None], cache,
                        return_routing=state.routing is not None)
    state = state.replace(k_pages=out.cache.k_pages, v_pages=out.cache.v_pages)
    return out.logits[:, 0], state, None if out.routing is None else out.routing[:, :, 0]


def _record_routing(state: EngineState, routed, feed) -> EngineState:
    """Store the routing [num_moe_layers, slots, top_k] of the tokens just fed (token `generated - 1` of
    each feeding slot's row)."""
    rows = state.tokens.shape[0]
    row = jnp.where(feed, state.row, rows)  # out of bounds: dropped
    step = jnp.maximum(state.generated - 1, 0)
    return state.replace(routing=state.routing.at[:, row, step].set(routed, mode="drop"))


def _decode_step(model, state: EngineState, params: SamplingParams, impl: str,
                 interpret: bool) -> EngineState:
    """Feed every live slot's last token (and, with routing, a done row's last one), sample the next."""
    live = ~state.done
    routing = state.routing is not None
    feed = ~state.captured if routing else live
    logits, state, routed = _feed(model, state, feed, impl, interpret)
    keys = jax.vmap(jax.random.fold_in)(row_keys(state, state.row_id), state.generated)
    tokens, token_logprobs, *entropy = sample(keys, logits, params.temperature, params.top_k, params.top_p,
                                              params.return_entropy)
    if routing:
        state = _record_routing(state, routed, feed).replace(captured=state.captured | (feed & state.done))
    write_row = jnp.where(live, state.row, state.tokens.shape[0])  # out of bounds: dropped
    if entropy:  # params.return_entropy
        state = state.replace(entropy=state.entropy.at[write_row, state.generated].set(*entropy, mode="drop"))
    generated = state.generated + live.astype(jnp.int32)
    done = state.done | (live & (is_eos(tokens, params) | (generated >= state.budget)))
    return state.replace(
        generated=generated, done=done,
        last_token=jnp.where(live, tokens, state.last_token),
        tokens=state.tokens.at[write_row, state.generated].set(tokens, mode="drop"),
        logprobs=state.logprobs.at[write_row, state.generated].set(token_logprobs, mode="drop"),
        lengths=state.lengths.at[write_row].set(generated, mode="drop"),
    )


def _capture(model, state: EngineState, impl: str, interpret: bool) -> EngineState:
    """Feed the last token of every done row whose routing lacks it (nothing is sampled)."""
    feed = state.done & ~state.captured
    _, state, routed = _feed(model, state, feed, impl, interpret)
    state = _record_routing(state, routed, feed)
    return state.replace(captured=state.captured | feed)


# The EngineState fields with one entry per slot (a decode segment runs a subset of the slots).
SLOT_FIELDS = ("page_table", "row", "row_id", "prompt_len", "budget", "generated", "last_token", "done",
               "captured")


def _decode_segment(graphdef, model_state, state: EngineState, page_table, run_slots, steps,
                    params: SamplingParams, impl: str, interpret: bool = False):
    """At most `steps` (traced) decode steps of the slots `run_slots` ([width] int32, distinct: every
    occupied slot among them, `Scheduler.decode_slots`) with `page_table` [slots, pages], stopping
    early once none is live; with routing, then the capture of the done rows' last tokens. The other
    slots (free) are untouched. Returns (state, flags [2, slots] int32: each slot's generated tokens
    and done flag).

    `pages` may be fewer than the state's `max_pages`: the first columns, enough for every position the
    segment reads or writes (`Scheduler.decode_pages`). Attention gathers and scores only those pages,
    so a step's cost follows the longest live row, not the longest row a call may hold."""
    model = nnx.merge(graphdef, model_state)
    full = state
    state = full.replace(page_table=page_table[run_slots],
                         **{name: getattr(full, name)[run_slots] for name in SLOT_FIELDS if name != "page_table"})

    def cond(carry):
        step, state = carry
        return (step < steps) & ~jnp.all(state.done)

    def body(carry):
        step, state = carry
        return step + 1, _decode_step(model, state, params, impl, interpret)

    state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]
    if state.routing is not None:
        state = jax.lax.cond(jnp.any(state.done & ~state.captured),
                             lambda s: _capture(model, s, impl, interpret),
                             lambda s: s, state)
    state = state.replace(page_table=full.page_table,
                          **{name: getattr(full, name).at[run_slots].set(getattr(state, name))
                             for name in SLOT_FIELDS if name != "page_table"})
    state = constrain_state(state, model.config)
    return state, jnp.stack([state.generated, state.done.astype(jnp.int32)])


# The engine's programs, each jitted once (`respo_jax.programs`): the graph definition, the prefill's
# chunking and step, the sampling parameters and the attention kernel are static (one compile per engine
# configuration and shape); the state is donated, so the page pools are written in place. Their
# arguments come placed on the model's mesh and `constrain_state` fixes the state's layout, so the
# shardings are the arguments'.
prefill_prompts = Program(_prefill_prompts, "prefill_prompts", FROM_ARGUMENTS, FROM_ARGUMENTS,
                          static_argnums=(0, 9, 10), donate_argnums=(2,))
admit_rows = Program(_admit_rows, "admit_rows", FROM_ARGUMENTS, FROM_ARGUMENTS, static_argnums=(0, 11),
                     donate_argnums=(2,))
decode_segment = Program(_decode_segment, "decode_segment", FROM_ARGUMENTS, FROM_ARGUMENTS,
                         static_argnums=(0, 6, 7, 8), donate_argnums=(2,))
