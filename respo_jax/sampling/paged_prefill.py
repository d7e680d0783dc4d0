"""The engine's two programs between decode segments: prefill the prompts a schedule starts, and admit
its rows into their decode slots.

Why batched: the host loop runs once per schedule, and a trainer's rollout (32 prompts × G = 8 rows)
takes a fraction of a second, so a dispatch per prompt or per row would cost more than the decoding.
`prefill_prompts` runs every prompt a schedule prefills as one `[P, bucket]` batch (P padded to one of
a few sizes, `prefill_counts`; filler prompts write only the scratch page), `admit_rows` every admission
of the schedule as arrays padded to the slot count (filler entries point out of bounds and are
dropped). Shapes depend only on the call's `Layout`, the bucket, P and the prefill step, so each
program compiles once per (bucket, P, step). A long prompt's prefill runs one step per schedule
(`scheduler.prefill_steps`), so admissions of its rows wait for it but decoding does not.

One prefill per prompt: the G rows of a prompt share its pages (`PagedCache`) and its last token's
logits (`EngineState.prompt_logits`, one row per prompt with rows still to admit); each row draws its
first token from them with its own key, as `generate` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models import qwen3
from respo_jax.sampling.engine_state import EngineState, constrain_state, is_eos, row_keys
from respo_jax.sampling.logits_processing import sample
from respo_jax.sampling.params import SamplingParams
from respo_jax.sampling.scheduler import prefill_steps


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


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk", "step"), donate_argnames=("state",))
def prefill_prompts(graphdef, model_state, state: EngineState, input_ids, positions, attention_mask, pages,
                    logit_rows, prompt_index, *, chunk: int | None, step: int = 0) -> EngineState:
    """Step `step` of the prefill of P prompts: the model's forward over the step's pieces with the
    prompts' pages as its cache (`qwen3.PagedKVCache`), so each piece writes its K/V into the pages and
    attends over the pages its earlier pieces (earlier steps included) wrote.

    input_ids, positions, attention_mask: [P, bucket] int32, left-padded (`engine.left_pad`; filler
    rows hold one token); pages: [P, pages_for(bucket)] int32 pool pages of each prompt's tokens in
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
    cache = qwen3.PagedKVCache(state.k_pages, state.v_pages, pages)
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


@functools.partial(jax.jit, static_argnames=("graphdef", "params"), donate_argnames=("state",))
def admit_rows(graphdef, model_state, state: EngineState, slot, row, row_id, prompt_len, budget, copy_from,
               copy_to, logit_row, *, params: SamplingParams) -> EngineState:
    """Start each row `row[i]` in `slot[i]` (all arrays [slots]; filler entries have `slot` and `row`
    out of bounds and copy the scratch page onto itself): copy page `copy_from` to `copy_to` (its own
    copy of the prompt's partial page, all layers), draw its first token from its prompt's logits
    (`state.prompt_logits[logit_row]`) with the key of step 0 of row id `row_id`."""
    cfg = nnx.merge(graphdef, model_state).config
    k_pages = state.k_pages.at[:, :, copy_to].set(state.k_pages[:, :, copy_from])
    v_pages = state.v_pages.at[:, :, copy_to].set(state.v_pages[:, :, copy_from])
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
