"""The rollout engine: `Engine`, the driver that owns one call's device state and runs vLLM's three
pieces in a host loop.

- The scheduler (`scheduler.Scheduler`, host): which rows occupy the decode slots, admitted and retired
  between segments; with `EngineConfig.scheduler="static"` a static batch of the same engine: every
  row in its own slot, its pages held to its cap, and the next rows admitted only once the whole batch
  is done (one segment runs it to its end).
- The KV page manager (`paged_cache.PagedCache`, inside the scheduler, host): which pool pages hold
  which slot's tokens.
- The model step (`model_step`, jitted): prefill, admission and the decode segment, each the model's
  own forward over the paged pool plus sampling.

Per schedule the driver runs a few programs and one sync: one prefill call per prefill step the
schedule runs, one admission call, one decode segment; then it reads the slots' token counts and done
flags (gathered to every process, so all take the same decisions), retires and refills. The driver also
keeps the prompts' logit rows: a prompt's last-token logits stay in `EngineState.prompt_logits` from
its prefill until its last row is admitted.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from respo_jax.distributed import to_host
from respo_jax.models import qwen3
from respo_jax.models.qwen3.paged_kernels import check_paged_attention
from respo_jax.programs import FROM_ARGUMENTS, Program
from respo_jax.sharding import axis_size
from respo_jax.sampling import model_step
from respo_jax.sampling.engine_state import GenerateOutput, Layout, init_state, place_state
from respo_jax.sampling.paged_cache import pages_for
from respo_jax.sampling.params import EngineConfig, SamplingParams, padded_prompt_length
from respo_jax.sampling.scheduler import (Scheduler, engine_slots, page_widths, pool_pages, prefill_steps,
                                          segment_widths)


def check_call(model, prompts, params, return_routing: bool, row_ids, row_max_new_tokens, engine):
    """The checks of a `generate` call (ValueError, one line); returns (the prompts as int lists, the
    row ids [rows] uint32, the row budgets [rows] int32)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(engine, EngineConfig):
        raise ValueError(f"engine must be an EngineConfig, got {type(engine).__name__}")
    if not isinstance(model, qwen3.Qwen3ForCausalLM):
        raise ValueError(f"generate needs a qwen3.Qwen3ForCausalLM, got {type(model).__name__}")
    cfg = model.config
    prompts = _validate_prompts(prompts, cfg.vocab_size)
    if return_routing and not cfg.num_experts:
        raise ValueError("return_routing=True needs an MoE model (config.num_experts > 0)")
    rows = len(prompts) * params.num_samples
    return (prompts, _validate_row_ids(row_ids, rows),
            _validate_row_budgets(row_max_new_tokens, rows, params.max_new_tokens))


def _validate_prompts(prompts, vocab_size: int) -> list[list[int]]:
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
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids in [{ids.min()}, {ids.max()}]; "
                             f"expected [0, {vocab_size})")
        out.append(ids.astype(np.int32).tolist())
    return out


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


def left_pad(prompts: list[list[int]], length: int, num_rows: int) -> tuple[np.ndarray, ...]:
    """Left-pad prompts into `[num_rows, length]` arrays (rows past `len(prompts)` are filler).

    Returns input_ids (pad id 0), positions (index within the real prompt; 0 on pads) and
    attention_mask (1 real, 0 pad), all int32, plus `active: [num_rows] bool`. A filler row holds a
    single real token 0 so that its attention is never empty; it is marked inactive.
    """
    ids = np.zeros((num_rows, length), np.int32)
    mask = np.zeros((num_rows, length), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = prompt
        mask[row, length - len(prompt):] = 1
    mask[len(prompts):, -1] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    active = np.arange(num_rows) < len(prompts)
    return ids, positions, mask, active


def abstract(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """A compiled program's output as the next program's argument when compiling ahead: shape, dtype and
    a mesh sharding. Not a single-device sharding: a call lowers a single-device array with an
    unspecified sharding, and a lowering that names it would not be the one the call looks up."""
    sharding = None if isinstance(x.sharding, jax.sharding.SingleDeviceSharding) else x.sharding
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)


def finish(state, prompt_lengths, rows: int, num_samples: int) -> GenerateOutput:
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
    return GenerateOutput(tokens=keep(state.tokens), lengths=keep(state.lengths),
                          logprobs=keep(state.logprobs), routing=routing, prompt_routing=prompt_routing, prompt_mask=prompt_mask,
                          entropy=None if state.entropy is None else keep(state.entropy))


_finish = Program(finish, "finish", FROM_ARGUMENTS, FROM_ARGUMENTS, static_argnums=(2, 3))


class Engine:
    """One `generate` call's engine: its shapes (`Layout`), its programs, its device state and the loop.

    Args:
      model: a `qwen3.Qwen3ForCausalLM` (dense or MoE), run under its config's mesh and rules: slots
        split over the `batch` axes (`max_slots` rounded up to a multiple of them), page pools by
        `PAGE_AXES`. In a run of several processes every process passes the same arguments.
      lengths: `[num_prompts]` prompt token counts (the call's shapes follow their padded bucket).
      params: the sampling parameters (the seed is traced: a new seed compiles nothing).
      engine: the schedule (`scheduler`), slots, segment length, pages, pool, attention kernel,
        prompt bucket and prefill chunking; the pages hold the model's compute dtype.
      return_routing: record MoE routing.
    """

    def __init__(self, model, lengths: Sequence[int], params: SamplingParams, engine: EngineConfig,
                 return_routing: bool = False):
        cfg = model.config
        check_paged_attention(engine.paged_attention_impl, interpret=engine.paged_attention_interpret,
                              platform=qwen3.kernels.platform(cfg.mesh), head_dim=cfg.head_dim,
                              page_size=engine.page_size)
        lengths = [int(n) for n in lengths]
        longest = max(lengths)
        if longest + params.max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"longest prompt ({longest} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})")
        self.model, self.engine, self.lengths = model, engine, lengths
        self.static = engine.scheduler == "static"
        # A static batch runs each wave of rows to its end in one segment, over every slot.
        self.steps = params.max_new_tokens if self.static else engine.steps_per_schedule
        bucket = padded_prompt_length(longest, engine.prompt_bucket, engine.prompt_buckets)
        shards = axis_size(cfg.mesh, cfg.rules.mesh_axes("batch"))
        rows = len(lengths) * params.num_samples
        slots = engine_slots(engine.max_slots, rows, shards)
        # Sized by the bucket, not the prompts: the shapes of a call follow its bucket only.
        num_pages = pool_pages(engine, bucket=bucket, max_new_tokens=params.max_new_tokens, slots=slots,
                               num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                               head_dim=cfg.head_dim, itemsize=jnp.dtype(cfg.dtype).itemsize, shards=shards)
        self.shards = shards
        # A prefill's prompts lie in the blocks of their shards: up to a shard's slots (or every prompt)
        # in one block.
        sizes = model_step.prefill_counts(shards * min(slots // shards, len(lengths)), shards)
        if rows <= slots:
            sizes = sizes[-1:]  # every prompt starts in the first schedule (a smaller prefill is padded)
        self.prefill_sizes = sizes
        self.layout = Layout(slots=slots, shards=shards, num_pages=num_pages, page_size=engine.page_size,
                             max_pages=pages_for(bucket + params.max_new_tokens, engine.page_size),
                             rows=-(-rows // shards) * shards, max_new_tokens=params.max_new_tokens, logit_rows=sizes[-1] + 1,
                             num_prompts=len(lengths), bucket=bucket, routing=bool(return_routing),
                             entropy=params.return_entropy)
        self.decode_widths = (slots,) if self.static else segment_widths(
            engine, slots=slots, rows=rows, max_new_tokens=params.max_new_tokens, shards=shards)
        # A static batch, or a call whose rows all end in the first segment, decodes in one segment: its
        # rows' every page. "ragged" and the Pallas kernels read only a row's live pages whatever the
        # table's width (and the Pallas kernels take widths of whole blocks): one page width, one program.
        one_segment = self.static or (rows <= slots and self.steps >= params.max_new_tokens)
        cut = not one_segment and engine.paged_attention_impl == "gather"
        self.page_widths = (page_widths(self.layout.max_pages, engine.page_size) if cut else
                            (self.layout.max_pages,))
        self.graphdef, self.model_state = nnx.split(model)
        self.seed = np.array([params.seed & 0xFFFFFFFF, params.seed >> 32], np.uint32)
        self.params = dataclasses.replace(params, seed=0)  # the seed is traced (EngineState.seed)
        self.pad_token_id = params.pad_token_id
        self.num_samples = params.num_samples

    # -- the device programs, each followed by the state's placement ------------------------------------

    def _place(self, state):
        return place_state(state, self.model.config)

    def _init(self, call):
        return self._place(call(init_state, self.graphdef, self.model_state, self.seed, layout=self.layout,
                                pad_token_id=self.pad_token_id))

    def _prefill(self, call, state, arrays, step: int):
        return self._place(call(model_step.prefill_prompts, self.graphdef, self.model_state, state, *arrays,
                                chunk=self.engine.prefill_chunk_size, step=step))

    def _admit(self, call, state, arrays):
        return self._place(call(model_step.admit_rows, self.graphdef, self.model_state, state, *arrays,
                                params=self.params))

    def _decode(self, call, state, page_table, run_slots):
        state, flags = call(model_step.decode_segment, self.graphdef, self.model_state, state, page_table,
                            run_slots, np.int32(self.steps), params=self.params,
                            impl=self.engine.paged_attention_impl,
                            interpret=self.engine.paged_attention_interpret)
        return self._place(state), flags

    # -- host arrays ---------------------------------------------------------------------------------------

    def _prefill_arrays(self, prompts, prefills, count: int, logit_row_of: dict):
        """The host arrays of `prefill_prompts` for `prefills` (`Prefill`s) padded to `count` prompts:
        the prompts of shard s first in block s of `count / shards` rows."""
        layout, block = self.layout, count // self.shards
        placed = [[p for p in prefills if p.shard == shard] for shard in range(self.shards)]
        prefills = [None] * count
        for shard, group in enumerate(placed):
            prefills[shard * block: shard * block + len(group)] = group
        padded = [left_pad([prompts[p.prompt] for p in group], layout.bucket, block)[:3] for group in placed]
        input_ids, positions, mask = (np.concatenate(arrays) for arrays in zip(*padded))
        pages = np.full((count, pages_for(layout.bucket, layout.page_size)), layout.num_pages, np.int32)
        logit_rows = np.full(count, layout.logit_rows, np.int32)  # filler, steps before the last: dropped
        index = np.full(count, layout.num_prompts, np.int32)
        for i, prefill in enumerate(prefills):
            if prefill is None:
                continue
            pages[i, : len(prefill.pages)] = prefill.pages
            index[i] = prefill.prompt
            if prefill.last:
                logit_rows[i] = logit_row_of[prefill.prompt]
        return input_ids, positions, mask, pages, logit_rows, index

    def _admission_arrays(self, admissions, ids, budgets, logit_row_of: dict):
        """The host arrays of `admit_rows` for `admissions`, entry i for slot i (filler: out of bounds)."""
        layout = self.layout
        n, scratch = layout.slots, layout.num_pages
        slot, row = np.full(n, n, np.int32), np.full(n, layout.rows, np.int32)
        row_id, prompt_len, budget = np.zeros(n, np.uint32), np.zeros(n, np.int32), np.ones(n, np.int32)
        copy_from, copy_to = np.full(n, scratch, np.int32), np.full(n, scratch, np.int32)
        logit_row = np.zeros(n, np.int32)
        for adm in admissions:
            i = adm.slot
            slot[i], row[i], row_id[i] = adm.slot, adm.row, ids[adm.row]
            prompt_len[i], budget[i] = self.lengths[adm.prompt], budgets[adm.row]
            logit_row[i] = logit_row_of[adm.prompt]
            if adm.copy is not None:
                copy_from[i], copy_to[i] = adm.copy
        return slot, row, row_id, prompt_len, budget, copy_from, copy_to, logit_row

    # -- the loop ----------------------------------------------------------------------------------------

    def run(self, prompts: list[list[int]], ids: np.ndarray, budgets: np.ndarray) -> GenerateOutput:
        """Generate `num_samples` rows of every prompt (prompt-major), row r seeded by `ids[r]` and held to
        `budgets[r]` tokens."""
        layout, call = self.layout, _run
        sched = Scheduler(self.lengths, self.num_samples, budgets, max_new_tokens=layout.max_new_tokens,
                          max_slots=layout.slots, steps_per_schedule=self.steps, page_size=layout.page_size,
                          num_pages=layout.num_pages, max_prompt_len=layout.bucket,
                          prefill_chunk=self.engine.prefill_chunk_size, static=self.static, shards=self.shards)
        state = self._init(call)
        logit_rows = _LogitRows(layout.logit_rows, self.num_samples)
        while not sched.finished:
            plan = sched.schedule()
            for step in sorted({prefill.step for prefill in plan.prefills}):  # one call per prefill step
                group = [prefill for prefill in plan.prefills if prefill.step == step]
                for prefill in group:
                    if prefill.last:
                        logit_rows.take(prefill.prompt)
                busiest = max(sum(p.shard == shard for p in group) for shard in range(self.shards))
                count = model_step.padded_count(busiest * self.shards, self.prefill_sizes)
                arrays = self._prefill_arrays(prompts, group, count, logit_rows.row_of)
                state = self._prefill(call, state, arrays, step)
            if plan.admissions:
                state = self._admit(call, state, self._admission_arrays(plan.admissions, ids, budgets,
                                                                        logit_rows.row_of))
                for adm in plan.admissions:
                    logit_rows.admitted(adm.prompt)
            if not sched.decoding:
                continue  # a long prompt's prefill goes on, no row runs yet
            slots = sched.decode_slots(self.decode_widths)
            pages = sched.decode_pages(slots, self.page_widths)
            state, flags = self._decode(call, state, plan.page_table[:, :pages], slots)
            generated, done = to_host(flags)  # the one sync of a segment, the same flags in every process
            sched.retire(generated, done.astype(bool))
        return _finish(state, np.asarray(self.lengths, np.int32), rows=len(self.lengths) * self.num_samples,
                       num_samples=self.num_samples)

    def compile(self, compile: Callable | None = None) -> None:
        """Compile, without running, every program `run` runs for prompts of this call's bucket: the
        state's creation, the prefill at each padded prompt count and step, the admission, the decode
        segment at each of its widths and the output's assembly, so `run` compiles nothing.
        `compile(name, lowered) -> compiled` compiles each (default `lowered.compile()`; an ahead-of-time
        report keeps them, `respo_jax.training.aot`)."""
        layout = self.layout
        compile = compile or (lambda name, lowered: lowered.compile())

        def named(name: str):  # the program's outputs as abstract values (`abstract`), for the next one
            return lambda program, *args, **kwargs: jax.tree.map(
                abstract, compile(name, program.lower(*args, **kwargs)).out_info)

        state = self._init(named("engine_init"))
        for count in self.prefill_sizes:
            for step in range(len(prefill_steps(layout.bucket, self.engine.prefill_chunk_size))):
                state = self._prefill(named(f"engine_prefill[prompts={count},step={step}]"), state,
                                      self._prefill_arrays([], (), count, {}), step)
        zeros = np.zeros(layout.num_prompts * self.num_samples, np.int64)
        state = self._admit(named("engine_admit"), state, self._admission_arrays((), zeros, zeros, {}))
        for width in self.decode_widths:
            for pages in self.page_widths:
                cut = f",pages={pages}" if len(self.page_widths) > 1 else ""
                name = f"engine_decode[width={width}{cut}]"
                state, _ = self._decode(named(name), state,
                                        np.full((layout.slots, pages), layout.num_pages, np.int32),
                                        np.arange(width, dtype=np.int32))
        named("engine_finish")(_finish, state, np.asarray(self.lengths, np.int32),
                               rows=layout.num_prompts * self.num_samples, num_samples=self.num_samples)


def _run(program, *args, **kwargs):
    return program(*args, **kwargs)


class _LogitRows:
    """Which row of `EngineState.prompt_logits` holds which prompt's last-token logits: taken at the
    prompt's last prefill step, freed once its `num_samples` rows are admitted (the lowest free first)."""

    def __init__(self, count: int, num_samples: int):
        self._free = list(range(count))[::-1]
        self._pending: dict[int, int] = {}
        self.num_samples = num_samples
        self.row_of: dict[int, int] = {}

    def take(self, prompt: int) -> None:
        self.row_of[prompt] = self._free.pop()
        self._pending[prompt] = self.num_samples

    def admitted(self, prompt: int) -> None:
        self._pending[prompt] -= 1
        if self._pending[prompt] == 0:
            del self._pending[prompt]
            self._free.append(self.row_of.pop(prompt))
