"""The continuous-batching engine's decode programs and its host loop: `generate_continuous`, and
`compile_continuous` to compile its programs ahead.

Why: with a static batch every chunk decodes until its longest row ends (see `generate`); here a
finished row's slot is refilled between segments by the host `Scheduler`, and K/V live in the pages
`PagedCache` hands out, so work and memory follow the tokens rows actually generate.

Per schedule the host runs a few jitted programs and one sync: `prefill_prompts` (one batch per
prefill step the schedule runs: the prompts it starts, and at most one long prompt's next piece,
`EngineConfig.prefill_chunk_size`), `admit_rows` (every admission, one call; `paged_prefill`) and
`decode_segment` (a `lax.while_loop` of at most `EngineConfig.steps_per_schedule` steps over the
occupied slots padded to one of a few widths, `EngineConfig.min_decode_slots`; no host sync per
token); then it reads the slots' token counts and done flags (gathered to every process, so all take
the same decisions), retires and refills. The decode step runs the model's decoder
layers through their public pieces (norms, `Attention.project` / `output`, the dense MLP or the MoE
module under the model's mesh) with `paged_attention` in place of the dense cache attention.

Same samples. Row r's token t uses `fold_in(fold_in(seed_key, id_r), t)`, the key of `generate`, in
whichever slot and segment it runs: for one seed the samples do not depend on max_slots, page size,
steps_per_schedule, the pool size or the other rows (up to float round-off of attention sums over a
different number of masked keys, which can flip a draw only at a near-tie).

Routing (MoE, `return_routing`), as `generate` records it: the experts of each generated token when it
is fed to the model. A row's last token is fed after the row is done (in the next step of the segment,
or by a capture step at the segment's end), so a row is retired only once its routing is complete.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from respo_jax.distributed import to_host
from respo_jax.exported_programs import ProgramCache
from respo_jax.models import qwen3
from respo_jax.models.qwen3.paged_attention import check_paged_attention_impl
from respo_jax.sampling.engine_state import EngineState, Layout, constrain_state, init_state
from respo_jax.sampling.engine_state import is_eos, place_state, row_keys
from respo_jax.sampling.generate import (
    GenerateOutput, _batch_shards, _check_call, _check_engine, _model_config, left_pad,
)
from respo_jax.sampling.logits_processing import sample
from respo_jax.sampling.paged_cache import pages_for
from respo_jax.sampling.paged_prefill import admit_rows, padded_count, prefill_counts, prefill_prompts
from respo_jax.sampling.params import EngineConfig, SamplingParams, padded_prompt_length
from respo_jax.sampling.scheduler import Scheduler, engine_slots, pool_pages, prefill_steps, segment_widths


def _feed(model, state: EngineState, feed: jax.Array, impl: str):
    """The model's forward on each slot's last token (token `generated - 1`, at its position), its K/V
    written into the slot's page where `feed` [slots] is set (elsewhere: the scratch page). Returns
    (logits [slots, vocab] float32, the state with the pools written, routing [num_moe_layers, slots,
    top_k] int32 or None)."""
    position = jnp.maximum(state.prompt_len + state.generated - 1, 0)[:, None]
    cache = qwen3.PagedKVCache(state.k_pages, state.v_pages, state.page_table, impl=impl)
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


def _decode_step(model, state: EngineState, params: SamplingParams, impl: str) -> EngineState:
    """Feed every live slot's last token (and, with routing, a done row's last one), sample the next."""
    live = ~state.done
    routing = state.routing is not None
    feed = ~state.captured if routing else live
    logits, state, routed = _feed(model, state, feed, impl)
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


def _capture(model, state: EngineState, impl: str) -> EngineState:
    """Feed the last token of every done row whose routing lacks it (nothing is sampled)."""
    feed = state.done & ~state.captured
    _, state, routed = _feed(model, state, feed, impl)
    state = _record_routing(state, routed, feed)
    return state.replace(captured=state.captured | feed)


# The EngineState fields with one entry per slot (a decode segment runs a subset of the slots).
SLOT_FIELDS = ("page_table", "row", "row_id", "prompt_len", "budget", "generated", "last_token", "done",
               "captured")


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "impl"), donate_argnames=("state",))
def decode_segment(graphdef, model_state, state: EngineState, page_table, run_slots, steps, *,
                   params: SamplingParams, impl: str):
    """At most `steps` (traced) decode steps of the slots `run_slots` ([width] int32, distinct: every
    occupied slot among them, `Scheduler.decode_slots`) with `page_table` [slots, max_pages], stopping
    early once none is live; with routing, then the capture of the done rows' last tokens. The other
    slots (free) are untouched. Returns (state, flags [2, slots] int32: each slot's generated tokens
    and done flag)."""
    model = nnx.merge(graphdef, model_state)
    full = state.replace(page_table=page_table)
    state = full.replace(**{name: getattr(full, name)[run_slots] for name in SLOT_FIELDS})

    def cond(carry):
        step, state = carry
        return (step < steps) & ~jnp.all(state.done)

    def body(carry):
        step, state = carry
        return step + 1, _decode_step(model, state, params, impl)

    state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))[1]
    if state.routing is not None:
        state = jax.lax.cond(jnp.any(state.done & ~state.captured), lambda s: _capture(model, s, impl),
                             lambda s: s, state)
    state = state.replace(**{name: getattr(full, name).at[run_slots].set(getattr(state, name))
                             for name in SLOT_FIELDS})
    state = constrain_state(state, model.config)
    return state, jnp.stack([state.generated, state.done.astype(jnp.int32)])


def engine_programs(programs: ProgramCache | None):
    """(prefill_prompts, admit_rows, decode_segment): as jitted here, or kept in `programs` (a later
    launch reads them instead of tracing them, `respo_jax.exported_programs`; used only where
    `ProgramCache.usable()`)."""
    if programs is None or not programs.usable():
        return prefill_prompts, admit_rows, decode_segment
    return (programs.jit(prefill_prompts.__wrapped__, "prefill_prompts", static_argnums=(0,),
                         static_argnames=("chunk", "step"), donate_argnums=(2,)),
            programs.jit(admit_rows.__wrapped__, "admit_rows", static_argnums=(0,),
                         static_argnames=("params",), donate_argnums=(2,)),
            programs.jit(decode_segment.__wrapped__, "decode_segment", static_argnums=(0,),
                         static_argnames=("params", "impl"), donate_argnums=(2,)))


@functools.partial(jax.jit, static_argnames=("rows", "num_samples"))
def finish(state: EngineState, prompt_lengths, *, rows: int, num_samples: int) -> GenerateOutput:
    """The outputs in `generate`'s format: `rows` rows (filler rows dropped); with routing, each prompt's
    routing repeated for its rows and the left-padded layout's mask (`prompt_lengths`: [num_prompts])."""
    def keep(a, axis=0):
        return a if a.shape[axis] == rows else jax.lax.slice_in_dim(a, 0, rows, axis=axis)

    routing = prompt_routing = prompt_mask = None
    if state.routing is not None:
        bucket = state.prompt_routing.shape[2]
        routing = keep(state.routing, 1)
        prompt_routing = jnp.repeat(state.prompt_routing, num_samples, axis=1)
        real = jnp.arange(bucket, dtype=jnp.int32)[None, :] >= bucket - prompt_lengths[:, None]
        prompt_mask = jnp.repeat(real.astype(jnp.int32), num_samples, axis=0)
    return GenerateOutput(tokens=keep(state.tokens), lengths=keep(state.lengths), logprobs=keep(state.logprobs),
                          routing=routing, prompt_routing=prompt_routing, prompt_mask=prompt_mask,
                          entropy=None if state.entropy is None else keep(state.entropy))


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What one call's programs are built from (`_setup`)."""

    layout: Layout
    prefill_sizes: tuple[int, ...]
    decode_widths: tuple[int, ...]
    graphdef: nnx.GraphDef
    model_state: nnx.State
    params: SamplingParams  # seed 0: the seed is traced (EngineState.seed)
    seed: np.ndarray


def _setup(model, lengths: list[int], params: SamplingParams, engine: EngineConfig,
           return_routing: bool) -> _Setup:
    """Check the engine against the model and fix the call's shapes (the arguments `_check_call`
    checked): the prompts' bucket (the longest rounded up to
    `prompt_bucket`, as in `generate`), slots and rows padded to a multiple of the batch shards, the
    pool, the prefill batch sizes, the decode widths."""
    _check_engine(engine)
    cfg = _model_config(model)
    check_paged_attention_impl(engine.paged_attention_impl, qwen3.kernels.platform(cfg.mesh))
    longest = max(lengths)
    if longest + params.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"longest prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) "
                         f"exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})")
    bucket = padded_prompt_length(longest, engine.prompt_bucket, engine.prompt_buckets)
    shards = _batch_shards(cfg)
    rows = len(lengths) * params.num_samples
    slots = engine_slots(engine.max_slots, rows, shards)
    page_size = engine.page_size
    # Sized by the bucket, not the prompts: the shapes of a call follow its bucket only.
    num_pages = pool_pages(engine, bucket=bucket, max_new_tokens=params.max_new_tokens, slots=slots,
                           num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                           head_dim=cfg.head_dim, itemsize=jnp.dtype(cfg.dtype).itemsize)
    sizes = prefill_counts(min(slots, len(lengths)), shards)
    if rows <= slots:
        sizes = sizes[-1:]  # every prompt starts in the first schedule (a later, smaller prefill is padded)
    layout = Layout(slots=slots, max_pages=pages_for(bucket + params.max_new_tokens, page_size),
                    num_pages=num_pages, page_size=page_size, rows=-(-rows // shards) * shards,
                    max_new_tokens=params.max_new_tokens, logit_rows=sizes[-1] + 1, num_prompts=len(lengths),
                    bucket=bucket, routing=bool(return_routing), entropy=params.return_entropy)
    graphdef, model_state = nnx.split(model)
    seed = np.array([params.seed & 0xFFFFFFFF, params.seed >> 32], np.uint32)
    widths = segment_widths(engine, slots=slots, rows=rows, max_new_tokens=params.max_new_tokens,
                            shards=shards)
    return _Setup(layout, sizes, widths, graphdef, model_state, dataclasses.replace(params, seed=0), seed)


def _prefill_arrays(layout: Layout, prompts, prefills, count: int, logit_row_of: dict):
    """The host arrays of `prefill_prompts` for `prefills` (`Prefill`s) padded to `count` prompts."""
    input_ids, positions, mask, _ = left_pad([prompts[p.prompt] for p in prefills], layout.bucket, count)
    pages = np.full((count, pages_for(layout.bucket, layout.page_size)), layout.num_pages, np.int32)
    logit_rows = np.full(count, layout.logit_rows, np.int32)  # filler (and steps before the last): dropped
    index = np.full(count, layout.num_prompts, np.int32)
    for i, prefill in enumerate(prefills):
        pages[i, : len(prefill.pages)] = prefill.pages
        index[i] = prefill.prompt
        if prefill.last:
            logit_rows[i] = logit_row_of[prefill.prompt]
    return input_ids, positions, mask, pages, logit_rows, index


def _admission_arrays(layout: Layout, admissions, ids, lengths, budgets, logit_row_of: dict):
    """The host arrays of `admit_rows` for `admissions` padded to the slot count (filler: out of bounds)."""
    n, scratch = layout.slots, layout.num_pages
    slot, row = np.full(n, n, np.int32), np.full(n, layout.rows, np.int32)
    row_id, prompt_len, budget = np.zeros(n, np.uint32), np.zeros(n, np.int32), np.ones(n, np.int32)
    copy_from, copy_to, logit_row = np.full(n, scratch, np.int32), np.full(n, scratch, np.int32), np.zeros(n, np.int32)
    for i, adm in enumerate(admissions):
        slot[i], row[i], row_id[i] = adm.slot, adm.row, ids[adm.row]
        prompt_len[i], budget[i], logit_row[i] = lengths[adm.prompt], budgets[adm.row], logit_row_of[adm.prompt]
        if adm.copy is not None:
            copy_from[i], copy_to[i] = adm.copy
    return slot, row, row_id, prompt_len, budget, copy_from, copy_to, logit_row


def generate_continuous(model, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                        engine: EngineConfig = EngineConfig(),
                        row_max_new_tokens: Sequence[int] | None = None,
                        row_ids: Sequence[int] | None = None,
                        return_routing: bool = False,
                        programs: ProgramCache | None = None) -> GenerateOutput:
    """`generate` with continuous batching over a paged KV cache.

    Args:
      model: a `qwen3.Qwen3ForCausalLM` (dense or MoE), run under its config's mesh and rules: slots
        split over the `batch` axes (`max_slots` rounded up to a multiple of them), page pools by
        `PAGE_AXES`. In a run of several processes every process passes the same arguments.
      prompts, params, row_ids, return_routing: as in `generate` (prompt-major rows,
        `params.num_samples` per prompt).
      engine: `max_slots`, `steps_per_schedule`, `page_size`, the pool (`num_pages` / `kv_cache_bytes`),
        `paged_attention_impl`, `prompt_bucket` (the prefill's padded length) and
        `prefill_chunk_size`; the pages hold the model's compute dtype (`config.dtype`).
      row_max_new_tokens: `[rows]` each row's own budget in [1, max_new_tokens] (None: max_new_tokens).
      programs: where the prefill, admission and decode programs are kept (`engine_programs`).
    Returns:
      GenerateOutput (tokens, lengths, logprobs; with `return_routing` routing, prompt_routing and
      prompt_mask) with `generate`'s conventions: `tokens[r, t]` for t >= lengths[r] is
      `params.pad_token_id`, `logprobs` and `routing` 0 there.
    """
    _, prompts, ids, budgets = _check_call(model, prompts, params, return_routing, row_ids,
                                           row_max_new_tokens)
    lengths = [len(p) for p in prompts]
    run = _setup(model, lengths, params, engine, return_routing)
    layout, num_samples = run.layout, params.num_samples
    rows = len(prompts) * num_samples
    sched = Scheduler(lengths, num_samples, budgets, max_new_tokens=params.max_new_tokens,
                      max_slots=layout.slots, steps_per_schedule=engine.steps_per_schedule,
                      page_size=layout.page_size, num_pages=layout.num_pages, max_prompt_len=layout.bucket,
                      prefill_chunk=engine.prefill_chunk_size)
    cfg = model.config
    run_prefill, run_admit, run_decode = engine_programs(programs)
    state = place_state(init_state(run.graphdef, run.model_state, run.seed, layout=layout,
                                   pad_token_id=params.pad_token_id), cfg)
    free_logit_rows = list(range(layout.logit_rows))[::-1]  # the lowest first (pop)
    logit_row_of, pending = {}, [num_samples] * len(prompts)
    while not sched.finished:
        plan = sched.schedule()
        for step in sorted({prefill.step for prefill in plan.prefills}):  # one call per prefill step
            group = [prefill for prefill in plan.prefills if prefill.step == step]
            for prefill in group:
                if prefill.last:
                    logit_row_of[prefill.prompt] = free_logit_rows.pop()
            count = padded_count(len(group), run.prefill_sizes)
            state = run_prefill(run.graphdef, run.model_state, state,
                                *_prefill_arrays(layout, prompts, group, count, logit_row_of),
                                chunk=engine.prefill_chunk_size, step=step)
            state = place_state(state, cfg)
        if plan.admissions:
            admission = _admission_arrays(layout, plan.admissions, ids, lengths, budgets, logit_row_of)
            state = run_admit(run.graphdef, run.model_state, state, *admission, params=run.params)
            state = place_state(state, cfg)
            for adm in plan.admissions:
                pending[adm.prompt] -= 1
                if pending[adm.prompt] == 0:
                    free_logit_rows.append(logit_row_of.pop(adm.prompt))
        if not sched.decoding:
            continue  # a long prompt's prefill goes on, no row runs yet
        run_slots = sched.decode_slots(run.decode_widths)
        state, flags = run_decode(run.graphdef, run.model_state, state, plan.page_table, run_slots,
                                  np.int32(engine.steps_per_schedule), params=run.params,
                                  impl=engine.paged_attention_impl)
        state = place_state(state, cfg)
        generated, done = to_host(flags)  # the one sync of a segment, the same flags in every process
        sched.retire(generated, done.astype(bool))
    return finish(state, np.asarray(lengths, np.int32), rows=rows, num_samples=num_samples)


def _abstract(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A compiled program's output as the next program's argument (see `generate._abstract`)."""
    sharding = None if isinstance(x.sharding, jax.sharding.SingleDeviceSharding) else x.sharding
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def compile_continuous(model, prompt_len: int, num_prompts: int, params: SamplingParams, *,
                       engine: EngineConfig = EngineConfig(), return_routing: bool = False,
                       programs: ProgramCache | None = None) -> None:
    """Compile, without running, every program `generate_continuous` runs for `num_prompts` prompts
    whose longest is `prompt_len` tokens: the state's creation, the prefill at each padded prompt count,
    the admission, the decode segment at each of its widths and the output's assembly, so the later call
    compiles nothing (`programs`: as `generate_continuous`'s).

    Why: a trainer knows its prompt buckets before its first rollout (`RLTrainer.compile_ahead`)."""
    if prompt_len < 1 or num_prompts < 1:
        raise ValueError(f"need prompt_len >= 1 and num_prompts >= 1, got {prompt_len} and {num_prompts}")
    lengths = [prompt_len] * num_prompts
    _check_call(model, [[0] * prompt_len] * num_prompts, params, return_routing, None, None)
    run = _setup(model, lengths, params, engine, return_routing)
    layout = run.layout
    run_prefill, run_admit, run_decode = engine_programs(programs)

    def compiled(program, *args, **kwargs):
        return jax.tree.map(_abstract, program.lower(*args, **kwargs).compile().out_info)

    def placed(state):  # as generate_continuous places each program's state
        return place_state(state, model.config)

    state = placed(compiled(init_state, run.graphdef, run.model_state, run.seed, layout=layout,
                            pad_token_id=params.pad_token_id))
    for count in run.prefill_sizes:
        for step in range(len(prefill_steps(layout.bucket, engine.prefill_chunk_size))):
            state = placed(compiled(run_prefill, run.graphdef, run.model_state, state,
                                    *_prefill_arrays(layout, [], (), count, {}),
                                    chunk=engine.prefill_chunk_size, step=step))
    zeros = np.zeros(num_prompts * params.num_samples, np.int64)
    state = placed(compiled(run_admit, run.graphdef, run.model_state, state,
                            *_admission_arrays(layout, (), zeros, lengths, zeros, {}), params=run.params))
    table = np.full((layout.slots, layout.max_pages), layout.num_pages, np.int32)
    for width in run.decode_widths:
        state = placed(compiled(run_decode, run.graphdef, run.model_state, state, table,
                                np.arange(width, dtype=np.int32), np.int32(engine.steps_per_schedule),
                                params=run.params, impl=engine.paged_attention_impl)[0])
    compiled(finish, state, np.asarray(lengths, np.int32), rows=num_prompts * params.num_samples,
             num_samples=params.num_samples)
