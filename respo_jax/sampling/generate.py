"""Rollout generation: `generate` and `compile_generate`, and the static engine behind
`EngineConfig(scheduler="static")`: prefill ragged prompts into a preallocated KV cache, then decode in
one jitted loop.

The rollouts feed the off-policy update of the paper (Sec. 4.1: G samples per prompt, reused for N
mini-batches), so besides tokens the sampler returns pi_old(o_t | q, o_<t): the log-prob of each
sampled token under the distribution it was drawn from (see `logits_processing`), and, for MoE
models, the routed experts of every generated token (for Routing Replay).

Engines. `generate` dispatches on `EngineConfig.scheduler`: "continuous" (the default) runs the
continuous-batching engine over a paged KV cache (`respo_jax.sampling.paged_decode`), "static" the
batch below. Both take the same arguments, seed rows alike and return the same `GenerateOutput`, so
for one seed they give the same samples (up to float round-off ties); they differ in speed and memory.

Static engine. Prompts are left-padded to a bucketed length P (pads are masked and never attended;
a real token's position is its index within its own prompt), so a row's result does not depend on the
other rows. A batch larger than `EngineConfig.max_batch_rows` is generated in equal chunks of rows, one
after the other, each stopping when its own rows are done; the samples are those of one batch. The
cache holds P + max_new_tokens slots rounded up to a bucket. The prefill writes the prompt (in
`EngineConfig.prefill_chunk_size` pieces if set) and then its last token alone, so logits are
computed for that token only. Decode is a `lax.while_loop` that stops once every row has emitted an
EOS or reached its own budget (`row_max_new_tokens`, else max_new_tokens); nothing syncs with the
host per token. With `EngineConfig.decode_chunk_size` the loop runs in segments whose cache grows
with the responses, so attention reads the slots generated so far (rounded up to a segment) instead
of the whole limit.
The loops run the model's own forward over its own parameters (its layer loop is the config's
`scan_layers`, chosen for the platform where the model was built): no second copy of the weights.

Randomness. Row r (of the prompt-major, sample-expanded batch) at step t uses the key
`fold_in(fold_in(seed_key, id_r), t)` with `seed_key = fold_in(key(seed % 2**32), seed // 2**32)` and
`id_r` the row's id: `row_ids[r]` when the caller gives them, else its row index r. A row's draws
depend only on the seed, its id and its own context, not on the batch size or on the other prompts;
with ids of its own (the evaluation's (benchmark, problem, sample)) not on its position either. The
seed and the ids are traced arguments, so new ones do not recompile.

Output conventions. `tokens[r, t]` for t >= lengths[r] holds `SamplingParams.pad_token_id` (the first
EOS id, or 0 without EOS ids) and `logprobs[r, t]` holds 0 there; `lengths` counts the EOS token and
is at most the row's budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from respo_jax.distributed import process_rows, rows_from_process
from respo_jax.exported_programs import ProgramCache
from respo_jax.models import qwen3
from respo_jax.sampling.logits_processing import sample
from respo_jax.sampling.params import EngineConfig, SamplingParams, padded_prompt_length


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
class _DecodeState:
    """Loop carry. `step` = number of tokens generated so far (the next one to sample)."""

    step: jax.Array  # int32 scalar
    cache: Any  # qwen3.KVCache
    last_tokens: jax.Array  # [batch] int32, the token sampled at step - 1
    tokens: jax.Array  # [batch, max_new_tokens] int32
    logprobs: jax.Array  # [batch, max_new_tokens] float32
    lengths: jax.Array  # [batch] int32
    budget: jax.Array  # [batch] int32, the most tokens each row may generate (row_max_new_tokens)
    done: jax.Array  # [batch] bool
    prompt_lengths: jax.Array  # [batch] int32, real (unpadded) prompt lengths
    row_keys: jax.Array  # [batch] typed PRNG keys
    routing: jax.Array | None  # [num_moe_layers, batch, max_new_tokens, top_k] int32
    entropy: jax.Array | None = None  # [batch, max_new_tokens] float32 (SamplingParams.return_entropy)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _model_config(model) -> qwen3.Qwen3Config:
    """The config of a built model: its mesh and kernels are set (`qwen3.resolve_config`)."""
    if not isinstance(model, qwen3.Qwen3ForCausalLM):
        raise ValueError(f"generate needs a qwen3.Qwen3ForCausalLM, got {type(model).__name__}")
    return model.config


def _validate_prompts(prompts, vocab_size: int | None) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty; expected at least one prompt (a list of token ids)")
    out = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt {i} must hold integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
            raise ValueError(
                f"prompt {i} has token ids in [{ids.min()}, {ids.max()}]; expected [0, {vocab_size})"
            )
        out.append(ids.astype(np.int32).tolist())
    return out


def _batch_sharding(cfg, ndim: int, axis: int = 0):
    """NamedSharding splitting dimension `axis` of an `ndim`-array like the activations' batch (the
    model config's `rules` on its `mesh`), the other dimensions whole."""
    names = [None] * ndim
    names[axis] = "batch"
    return cfg.rules.sharding(cfg.mesh, names)


def _batch_shards(cfg) -> int:
    """Devices the batch is split over: rows are padded to a multiple."""
    return math.prod(cfg.mesh.shape[a] for a in cfg.rules.mesh_axes("batch"))


def left_pad(prompts: list[list[int]], length: int, num_rows: int) -> tuple[np.ndarray, ...]:
    """Left-pad prompts into `[num_rows, length]` arrays (rows past `len(prompts)` are filler).

    Returns input_ids (pad id 0), positions (index within the real prompt; 0 on pads) and
    attention_mask (1 real, 0 pad), all int32, plus `active: [num_rows] bool`. A filler row holds a
    single real token 0 so that its attention is never empty; it is marked inactive.
    """
    ids = np.zeros((num_rows, length), np.int32)
    mask = np.zeros((num_rows, length), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :] = prompt
        mask[row, length - len(prompt) :] = 1
    mask[len(prompts) :, -1] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    active = np.arange(num_rows) < len(prompts)
    return ids, positions, mask, active


def _record(state: _DecodeState, sampled: tuple, params: SamplingParams) -> _DecodeState:
    """Write the tokens sampled at `state.step` (`_sample_step`'s tokens, log-probs and entropies; pad/0
    for rows already done) and advance; a row is done after an EOS or once it holds its budget of
    tokens."""
    tokens, token_logprobs, token_entropy = sampled
    was_done = state.done
    tokens = jnp.where(was_done, params.pad_token_id, tokens).astype(jnp.int32)
    token_logprobs = jnp.where(was_done, 0.0, token_logprobs).astype(jnp.float32)
    if token_entropy is not None:
        token_entropy = jnp.where(was_done, 0.0, token_entropy).astype(jnp.float32)
        state = state.replace(entropy=jax.lax.dynamic_update_slice_in_dim(
            state.entropy, token_entropy[:, None], state.step, axis=1))
    is_eos = jnp.zeros_like(was_done)
    for eos in () if params.ignore_eos else params.eos_token_ids:  # ignore_eos: rows run to the limit
        is_eos = is_eos | (tokens == eos)
    lengths = state.lengths + (~was_done).astype(jnp.int32)
    return state.replace(
        step=state.step + 1,
        last_tokens=tokens,
        tokens=jax.lax.dynamic_update_slice_in_dim(state.tokens, tokens[:, None], state.step, axis=1),
        logprobs=jax.lax.dynamic_update_slice_in_dim(
            state.logprobs, token_logprobs[:, None], state.step, axis=1
        ),
        lengths=lengths,
        done=was_done | is_eos | (lengths >= state.budget),
    )


def _sample_step(state: _DecodeState, logits, params: SamplingParams):
    """Sample `[batch, vocab]` logits with each row's key for the current step: tokens, their log-probs
    and (`return_entropy`, else None) the distribution's entropy, each [batch]."""
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.row_keys, state.step)
    sampled = sample(keys, logits, params.temperature, params.top_k, params.top_p, params.return_entropy)
    return sampled if params.return_entropy else (*sampled, None)


def _feed_last_tokens(model, state: _DecodeState, return_routing: bool):
    """Run the model on the last sampled token of every row; store its routing (token step-1)."""
    positions = state.prompt_lengths + state.step - 1
    out = model.forward(
        state.last_tokens[:, None],
        positions=positions[:, None],
        attention_mask=jnp.ones_like(state.last_tokens)[:, None],
        cache=state.cache,
        return_routing=return_routing,
    )
    state = state.replace(cache=out.cache)
    if return_routing:
        was_real = (state.lengths > state.step - 1)[None, :, None]  # token step-1 was not a pad
        routed = jnp.where(was_real, out.routing[:, :, 0, :], 0).astype(jnp.int32)
        state = state.replace(
            routing=jax.lax.dynamic_update_slice_in_dim(
                state.routing, routed[:, :, None, :], state.step - 1, axis=2
            )
        )
    return out.logits[:, -1, :], state


def _decode_until(model, state: _DecodeState, stop, params: SamplingParams, return_routing: bool):
    """`lax.while_loop`: feed the last token, sample the next, until step == stop or all rows done."""

    def cond(state):
        return (state.step < stop) & ~jnp.all(state.done)

    def body(state):
        logits, state = _feed_last_tokens(model, state, return_routing)
        return _record(state, _sample_step(state, logits, params), params)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef", "params", "cache_len", "stop", "prefill_chunk", "cache_dtype", "return_routing",
        "capture_last",
    ),
)
def _prefill_and_decode(
    graphdef, model_state, input_ids, positions, attention_mask, active, row_ids, budgets, seed,
    *, params, cache_len, stop, prefill_chunk, cache_dtype, return_routing, capture_last,
):
    """Prefill `[batch, P]` prompts, sample the first token and decode until `stop` (jitted once per
    shape/params). `row_ids`: `[batch]` uint32 ids that seed the rows' keys
    (by default the rows' indices in the whole batch); `budgets`: `[batch]` int32 tokens each row may
    generate (traced: new budgets do not recompile). Returns the loop state and the prompt routing
    (or None)."""
    model = nnx.merge(graphdef, model_state)
    batch, prompt_len = input_ids.shape
    cache = qwen3.init_cache(_model_config(model), batch, cache_len, dtype=jnp.dtype(cache_dtype))

    # Prefill as pieces of at most `prefill_chunk` tokens, the last token on its own: only the last
    # position's logits are used, so XLA drops the vocabulary projection of every other piece and
    # never materialises [batch, prompt_len, vocab] logits. (Static unroll: few pieces.)
    chunk = prefill_chunk or prompt_len
    bounds = [(start, min(start + chunk, prompt_len - 1)) for start in range(0, prompt_len - 1, chunk)]
    bounds.append((prompt_len - 1, prompt_len))
    chunk_routings = []
    for start, end in bounds:
        out = model.forward(
            input_ids[:, start:end],
            positions=positions[:, start:end],
            attention_mask=attention_mask[:, start:end],
            cache=cache,
            return_routing=return_routing,
        )
        cache = out.cache
        if return_routing:
            chunk_routings.append(out.routing.astype(jnp.int32))
    last_logits = out.logits[:, -1, :]
    prompt_routing = jnp.concatenate(chunk_routings, axis=2) if return_routing else None

    base_key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])  # seed: [2] uint32 (low, high word)
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base_key, row_ids)
    routing = None
    if return_routing:
        num_layers, _, _, top_k = prompt_routing.shape
        routing = jnp.zeros((num_layers, batch, params.max_new_tokens, top_k), jnp.int32)
    state = _DecodeState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        last_tokens=jnp.zeros((batch,), jnp.int32),
        tokens=jnp.full((batch, params.max_new_tokens), params.pad_token_id, jnp.int32),
        logprobs=jnp.zeros((batch, params.max_new_tokens), jnp.float32),
        lengths=jnp.zeros((batch,), jnp.int32),
        budget=budgets,
        done=~active,
        prompt_lengths=jnp.sum(attention_mask, axis=1).astype(jnp.int32),
        row_keys=row_keys,
        routing=routing,
        entropy=jnp.zeros((batch, params.max_new_tokens), jnp.float32) if params.return_entropy else None,
    )
    state = _record(state, _sample_step(state, last_logits, params), params)
    state = _decode_until(model, state, stop, params, return_routing)
    if capture_last:
        _, state = _feed_last_tokens(model, state, return_routing)
    return state, prompt_routing


@jax.jit
def _all_done(done):
    """Whether every row is done: [batch] bool -> bool (on a mesh, over every process's rows)."""
    return jnp.all(done)


@functools.partial(jax.jit, static_argnames=("cache_len",))
def _grow_cache(cache, *, cache_len):
    """Pad the cache's slot axis to `cache_len` (new slots empty and invalid)."""
    grow = cache_len - cache.k.shape[2]
    pad_kv = [(0, 0)] * cache.k.ndim
    pad_kv[2] = (0, grow)
    return cache.replace(
        k=jnp.pad(cache.k, pad_kv),
        v=jnp.pad(cache.v, pad_kv),
        valid=jnp.pad(cache.valid, ((0, 0), (0, grow))),
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "params", "return_routing", "capture_last"),
    donate_argnames=("state",),
)
def _resume(graphdef, model_state, state, stop, *, params, return_routing, capture_last):
    """Decode until step `stop` (one segment of chunked decode; `stop` is traced, so segments of one
    cache length share a compilation), then optionally feed the last tokens to record their routing.
    The state's buffers are donated: the loop updates them in place."""
    model = nnx.merge(graphdef, model_state)
    state = _decode_until(model, state, stop, params, return_routing)
    if capture_last:
        _, state = _feed_last_tokens(model, state, return_routing)
    return state


def compile_generate(
    model,
    prompt_len: int,
    num_prompts: int,
    params: SamplingParams,
    *,
    return_routing: bool = False,
    engine: EngineConfig = EngineConfig(),
    programs: ProgramCache | None = None,
) -> None:
    """Compile, without running, the programs `generate` runs for `num_prompts` prompts whose longest
    is `prompt_len` tokens (every decode segment included), so the later call finds them compiled.

    Why: a trainer knows the prompt buckets its data can need before its first rollout; compiling
    them then keeps compilation out of the run's later iterations (`RLTrainer.compile_ahead`).
    Dispatches on `engine.scheduler` as `generate` does; `programs` as in `generate`."""
    _check_engine(engine)
    if prompt_len < 1 or num_prompts < 1:
        raise ValueError(f"need prompt_len >= 1 and num_prompts >= 1, got {prompt_len} and {num_prompts}")
    if engine.scheduler == "continuous":
        from respo_jax.sampling import paged_decode  # not at the top: paged_decode builds on this module

        paged_decode.compile_continuous(model, prompt_len, num_prompts, params, engine=engine,
                                        return_routing=return_routing, programs=programs)
        return
    _generate(model, [[0] * prompt_len] * num_prompts, params, return_routing, engine, compile_only=True)


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    return_routing: bool = False,
    engine: EngineConfig = EngineConfig(),
    row_ids: Sequence[int] | None = None,
    row_max_new_tokens: Sequence[int] | None = None,
    programs: ProgramCache | None = None,
) -> GenerateOutput:
    """Sample `params.num_samples` continuations of every prompt.

    Args:
      model: a `qwen3.Qwen3ForCausalLM` (its config carries the mesh and kernels it was built with).
      prompts: token-id lists of any (non-zero) lengths.
      params: sampling distribution and limits (static: a new value compiles once).
      return_routing: also return the routed experts of prompt and generated tokens (MoE only).
      engine: which engine runs (`EngineConfig.scheduler`: "continuous" by default, or "static") and
        its memory layout: slots, pages, buckets, chunking.
      row_ids: `[len(prompts) * num_samples]` ints in [0, 2**32), one per output row (prompt-major),
        that seed the rows' random draws instead of their row indices (the default): a row with the
        same id, prompt and params gets the same sample wherever it sits in the batch.
      row_max_new_tokens: `[len(prompts) * num_samples]` ints in [1, params.max_new_tokens], each
        row's own budget (vLLM's per-request max_tokens; None: max_new_tokens for every row). A row
        stops at its budget as at an EOS: pad tokens and log-prob 0 after it. A row's draws do not
        depend on its budget, so a shorter budget gives a prefix of the longer one's sample.
      programs: a `respo_jax.exported_programs.ProgramCache` keeping the continuous engine's programs
        (`paged_decode.engine_programs`): a later launch reads them instead of tracing them. Its key
        must pin the model (the trainer's does); None: plain `jax.jit`.
    The sampler runs under the model config's `mesh` and `rules` (`respo_jax.sharding`), as the
    trainer does: prompts, sampled tokens, log-probs and routing split their batch dimension by the
    `batch` rule (rows padded with inactive filler rows to a multiple of those axes' size), the KV
    cache is constrained by its logical axes (`qwen3.cache.CACHE_AXES`) inside the model, and the
    parameters stay where they are. In a run of several processes every process passes all prompts
    (the shapes depend on all of them) but lays out only the rows its own devices hold
    (`respo_jax.distributed.process_rows`); the outputs are global arrays split like the batch.
    Returns:
      GenerateOutput with rows in prompt-major order (`len(prompts) * num_samples` rows).
    """
    _check_engine(engine)
    if engine.scheduler == "continuous":  # it checks the call as `_generate` does (`_check_call`)
        from respo_jax.sampling.paged_decode import generate_continuous  # (see compile_generate)

        return generate_continuous(model, prompts, params, engine=engine,
                                   row_max_new_tokens=row_max_new_tokens, row_ids=row_ids,
                                   return_routing=return_routing, programs=programs)
    return _generate(model, prompts, params, return_routing, engine, compile_only=False, row_ids=row_ids,
                     row_max_new_tokens=row_max_new_tokens)


def _check_engine(engine) -> None:
    if not isinstance(engine, EngineConfig):
        raise ValueError(f"engine must be an EngineConfig, got {type(engine).__name__}")


def _check_call(model, prompts, params, return_routing: bool, row_ids, row_max_new_tokens):
    """The checks of a `generate` call that do not depend on the engine (ValueError, one line);
    returns (the model config, the prompts as int lists, the row ids, the row budgets)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    cfg = _model_config(model)
    prompts = _validate_prompts(prompts, getattr(cfg, "vocab_size", None))
    if return_routing and not getattr(cfg, "num_experts", 0):
        raise ValueError("return_routing=True needs an MoE model (config.num_experts > 0)")
    rows = len(prompts) * params.num_samples
    return (cfg, prompts, _validate_row_ids(row_ids, rows),
            _validate_row_budgets(row_max_new_tokens, rows, params.max_new_tokens))


def _validate_row_budgets(budgets, rows: int, max_new_tokens: int) -> np.ndarray:
    """`row_max_new_tokens` as `[rows]` int32, each in [1, max_new_tokens] (None: max_new_tokens)."""
    if budgets is None:
        return np.full(rows, max_new_tokens, np.int32)
    caps = np.asarray(budgets)
    if caps.shape != (rows,) or not np.issubdtype(caps.dtype, np.integer):
        raise ValueError(f"row_max_new_tokens has shape {caps.shape} ({caps.dtype}); expected ({rows},) "
                         "integers: one per output row (len(prompts) * num_samples)")
    if rows and (caps.min() < 1 or caps.max() > max_new_tokens):
        raise ValueError(f"row_max_new_tokens must lie in [1, max_new_tokens={max_new_tokens}]; got "
                         f"[{caps.min()}, {caps.max()}]")
    return caps.astype(np.int32)


def _validate_row_ids(row_ids, rows: int) -> np.ndarray:
    """`row_ids` as `[rows]` uint32 (None: the row indices 0..rows-1)."""
    if row_ids is None:
        return np.arange(rows, dtype=np.uint32)
    ids = np.asarray(row_ids)
    if ids.shape != (rows,):
        raise ValueError(f"row_ids has shape {ids.shape}; expected ({rows},): one id per output row "
                         "(len(prompts) * num_samples)")
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError(f"row_ids must be integers in [0, 2**32); got dtype {ids.dtype}, "
                         f"range [{ids.min()}, {ids.max()}]")
    return ids.astype(np.uint32)


def _generate(model, prompts, params: SamplingParams, return_routing: bool, engine: EngineConfig,
              compile_only: bool, row_ids=None, row_max_new_tokens=None) -> GenerateOutput | None:
    """The static engine's `generate`, or with `compile_only` the compilation of its programs (returns
    None)."""
    cfg, prompts, ids, budgets = _check_call(model, prompts, params, return_routing, row_ids,
                                             row_max_new_tokens)

    longest = max(len(p) for p in prompts)
    max_positions = getattr(cfg, "max_position_embeddings", None)
    if max_positions is not None and longest + params.max_new_tokens > max_positions:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"model's max_position_embeddings ({max_positions})"
        )
    prompt_len = padded_prompt_length(longest, engine.prompt_bucket, engine.prompt_buckets)

    def cache_slots(stop: int) -> int:
        """Slots for the prompt, `stop` generated tokens and the routing-capture feed of the last one."""
        return _round_up(prompt_len + stop, engine.cache_bucket)

    rows = [p for p in prompts for _ in range(params.num_samples)]
    chunk_rows = _round_up(_chunk_rows(len(rows), engine.max_batch_rows), _batch_shards(cfg))
    graphdef, model_state = nnx.split(model)
    run = functools.partial(
        _generate_chunk, graphdef=graphdef, model_state=model_state, params=params, engine=engine,
        prompt_len=prompt_len, cache_slots=cache_slots, return_routing=return_routing, cfg=cfg,
        cache_dtype=getattr(cfg, "dtype", "float32"), compile_only=compile_only,
    )
    if compile_only:  # equal chunks: the first one's programs are every chunk's
        run(rows[:chunk_rows], ids[:chunk_rows], budgets[:chunk_rows], 0, chunk_rows)
        return None
    outputs = [run(rows[first:first + chunk_rows], ids[first:first + chunk_rows],
                   budgets[first:first + chunk_rows], first, chunk_rows)
               for first in range(0, len(rows), chunk_rows)]
    return outputs[0] if len(outputs) == 1 else _concatenate(outputs)


def _concatenate(outputs: list[GenerateOutput]) -> GenerateOutput:
    """The outputs of consecutive row chunks as one (the row axis is 1 for routing, else 0)."""
    fields = {}
    for field in dataclasses.fields(GenerateOutput):
        parts = [getattr(out, field.name) for out in outputs]
        axis = 1 if field.name in ("routing", "prompt_routing") else 0
        fields[field.name] = None if parts[0] is None else jnp.concatenate(parts, axis=axis)
    return GenerateOutput(**fields)


def _chunk_rows(rows: int, max_rows: int | None) -> int:
    """Rows per sampler chunk: all of them, or equal chunks of at most `max_rows`."""
    if max_rows is None or rows <= max_rows:
        return rows
    return math.ceil(rows / math.ceil(rows / max_rows))


def _abstract(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A compiled program's output as the next program's argument in `compile_only`: shape, dtype and
    a mesh sharding. Not a single-device sharding: a call lowers a single-device array with an
    unspecified sharding, and a lowering that names it would not be the one the call looks up."""
    sharding = None if isinstance(x.sharding, jax.sharding.SingleDeviceSharding) else x.sharding
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def _generate_chunk(rows, ids, budgets, first_row, num_rows, *, graphdef, model_state, params, engine,
                    prompt_len, cache_slots, return_routing, cfg, cache_dtype,
                    compile_only) -> GenerateOutput | None:
    """Generate `rows` (prompt token lists, rows `first_row`… of the whole batch, seeded by their `ids`,
    each at most its entry of `budgets` tokens) as one jitted batch of `num_rows` rows (filler rows
    past `len(rows)`, dropped from the output; their ids continue the row indices, as without ids; an
    inactive row's draws are unused). `compile_only`: compile the programs of every decode segment
    instead (the loop state stays abstract), return None."""

    def call(program, *args, **kwargs):
        if not compile_only:
            return program(*args, **kwargs)
        return jax.tree.map(_abstract, program.lower(*args, **kwargs).compile().out_info)

    # Each process lays out only the rows its devices hold (all of them in one process); the global
    # arrays are assembled from the processes' parts (respo_jax.distributed).
    part = np.arange(num_rows)[process_rows(_batch_sharding(cfg, 1), num_rows)]
    host_arrays = left_pad([rows[i] for i in part if i < len(rows)], prompt_len, len(part))  # filler last
    chunk_ids = first_row + np.arange(num_rows, dtype=np.uint32)
    chunk_ids[: len(rows)] = ids
    chunk_budgets = np.full(num_rows, params.max_new_tokens, np.int32)  # filler rows: inactive anyway
    chunk_budgets[: len(rows)] = budgets
    host_arrays += (chunk_ids[part], chunk_budgets[part])
    device_arrays = [rows_from_process(_batch_sharding(cfg, a.ndim), a, num_rows) for a in host_arrays]
    input_ids, positions, attention_mask, active, row_ids, row_budgets = device_arrays

    total = params.max_new_tokens
    chunk = engine.decode_chunk_size or total
    stop = min(chunk, total)
    static_params = dataclasses.replace(params, seed=0)  # the seed is traced: no recompile per seed
    state, prompt_routing = call(
        _prefill_and_decode, graphdef, model_state, input_ids, positions, attention_mask, active, row_ids,
        row_budgets, np.array([params.seed & 0xFFFFFFFF, params.seed >> 32], np.uint32),
        params=static_params, cache_len=cache_slots(stop), stop=stop,
        prefill_chunk=engine.prefill_chunk_size, cache_dtype=cache_dtype, return_routing=return_routing,
        capture_last=return_routing and stop == total,
    )
    while stop < total:
        # One host sync per decode segment (compile_only: every segment may run, and each may be the
        # one after which all rows are done).
        all_done = call(_all_done, state.done)
        all_done = compile_only or bool(jax.device_get(all_done))
        if all_done and return_routing:  # record the routing of the last tokens
            finished = call(
                _resume, graphdef, model_state, state, np.int32(stop), params=static_params,
                return_routing=True, capture_last=True,
            )
            state = state if compile_only else finished
        if all_done and not compile_only:
            break
        next_stop = min(stop + chunk, total)
        if cache_slots(next_stop) > state.cache.max_len:
            state = state.replace(cache=call(_grow_cache, state.cache, cache_len=cache_slots(next_stop)))
        state = call(
            _resume, graphdef, model_state, state, np.int32(next_stop), params=static_params,
            return_routing=return_routing, capture_last=return_routing and next_stop == total,
        )
        stop = next_stop
    if compile_only:
        return None

    n = len(rows)

    def keep(a, axis=0):  # drop filler rows (no copy when there are none)
        return a if n == num_rows else jax.lax.slice_in_dim(a, 0, n, axis=axis)

    return GenerateOutput(
        tokens=keep(state.tokens),
        lengths=keep(state.lengths),
        logprobs=keep(state.logprobs),
        routing=keep(state.routing, 1) if return_routing else None,
        prompt_routing=keep(prompt_routing, 1) if return_routing else None,
        prompt_mask=keep(attention_mask) if return_routing else None,
        entropy=keep(state.entropy) if params.return_entropy else None,
    )
