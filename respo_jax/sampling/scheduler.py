"""Host-side scheduler of the continuous-batching engine: which rows occupy the decode slots.

Why: a static batch decodes until its longest row ends, so on a long-tailed length distribution most
decode steps produce nothing anyone keeps. Here `EngineConfig.max_slots` slots are decoded together
for a segment of `EngineConfig.steps_per_schedule` steps; between segments the scheduler retires the
rows that finished (EOS unless `SamplingParams.ignore_eos`, or the row's own budget) and refills
their slots with waiting rows, while `PagedCache` owns the pages (vLLM's scheduler / KV-cache manager
split).

Determinism. Every decision is a function of the inputs (prompt lengths, budgets, config) and of
the per-slot flags the device returns after a segment: rows are admitted first-in first-out in
prompt-major order into the lowest free slot, and admission stops at the first row that does not fit
(it waits; no later row overtakes it). Every process fed the same flags takes the same decisions.

Rows and prompts. Row r is sample r % G of prompt r // G (G = `num_samples`). A prompt is prefilled
once, starting when its first row could be admitted: in one step, or with `prefill_chunk` in one step
per schedule (`prefill_steps`), its rows admitted with the last one while running rows go on
decoding; its pages stay held while any of its rows waits, so rows of one prompt admitted in
different segments share the same prefill.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from respo_jax.sampling.paged_cache import PagedCache, PromptPages, pages_for, pool_pages_for_bytes
from respo_jax.sharding import axis_size


@dataclasses.dataclass(frozen=True)
class Prefill:
    """Run step `step` of prompt `prompt`'s prefill (`tokens` tokens) into `pages` (in order, local
    ids of batch shard `shard`); `last`: the step that ends it (writes the last token's logits: its rows
    can be admitted)."""

    prompt: int
    tokens: int
    pages: tuple[int, ...]
    step: int = 0
    last: bool = True
    shard: int = 0


def prefill_steps(bucket: int, chunk: int | None) -> list[list[tuple[int, int]]]:
    """The pieces `[start, end)` of a prefill of `bucket` (left-padded) tokens, grouped by the engine
    call (step) that runs them: all but the last token in pieces of at most `chunk` tokens (None: one
    piece), one piece a step, and the last token alone (its logits only) in the last step.

    Why steps: a long prompt's prefill spread over schedules, one piece per schedule, so the decode
    segments of running rows go on between its pieces."""
    size = chunk or bucket
    steps = [[(start, min(start + size, bucket - 1))] for start in range(0, bucket - 1, size)] or [[]]
    steps[-1].append((bucket - 1, bucket))
    return steps


def first_prefill_step(prompt_len: int, bucket: int, chunk: int | None) -> int:
    """The first step of `prefill_steps(bucket, chunk)` holding a real token of a prompt of `prompt_len`
    tokens left-padded to `bucket`: the steps before it are padding alone (masked: skipped)."""
    steps = len(prefill_steps(bucket, chunk))
    return min((bucket - prompt_len) // (chunk or bucket), steps - 1)


@dataclasses.dataclass(frozen=True)
class Admission:
    """Row `row` (of prompt `prompt`) starts in `slot`; `copy`: a `(source, destination)` page copy of
    the prompt's partial last page to make first, or None."""

    slot: int
    row: int
    prompt: int
    copy: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One scheduling decision: prefills to run, then admissions to apply, then decode with
    `page_table` (`[max_slots, max_pages]` int32, grown for the coming segment)."""

    prefills: tuple[Prefill, ...]
    admissions: tuple[Admission, ...]
    page_table: np.ndarray


class Scheduler:
    """Admission, retirement and page growth for the rows of one `generate` call.

    Args:
      prompt_lengths: `[num_prompts]` prompt token counts.
      num_samples: rows per prompt (G).
      budgets: `[num_prompts * num_samples]` tokens each row may generate at most (its
        `row_max_new_tokens`, each in [1, max_new_tokens]).
      max_new_tokens: `SamplingParams.max_new_tokens` (the page table's width is sized for it).
      max_slots, steps_per_schedule, page_size: as in `EngineConfig`.
      num_pages: pages in the pool (`default_num_pages` when the engine leaves it open).
      max_prompt_len: the page tables are sized for prompts of up to this many tokens (None: the
        longest prompt); the engine passes its prompt bucket, so the tables' shape follows the bucket.
      prefill_chunk: `EngineConfig.prefill_chunk_size`: a prompt's prefill runs in the steps of
        `prefill_steps(max_prompt_len, prefill_chunk)` from its first real one, one step per schedule
        (None: one step); its rows are admitted in the schedule of its last step, and no later row
        overtakes them meanwhile, while running rows go on decoding.
      static: a static batch: rows are admitted only into an engine whose every slot is free (a batch
        of up to `max_slots` rows at once), each row's pages grown to its whole budget at admission; the
        engine decodes such a batch until its last row ends.
      shards: the batch shards: `max_slots` slots in `shards` contiguous blocks, each with a pool of
        `num_pages` pages of its own (`PagedCache`). A prompt is held on the shard with the most free
        slots (then the most available pages, then the lowest index) and its rows run in that shard's
        slots; a row whose shard has no free slot waits (no later row overtakes it).
    A row's cache holds its prompt and its response: `prompt + budget` tokens at most.
    """

    def __init__(self, prompt_lengths: Sequence[int], num_samples: int, budgets: Sequence[int], *,
                 max_new_tokens: int, max_slots: int, steps_per_schedule: int, page_size: int,
                 num_pages: int, max_prompt_len: int | None = None, prefill_chunk: int | None = None,
                 static: bool = False, shards: int = 1):
        self.prompt_lengths = [int(n) for n in prompt_lengths]
        self.num_samples = int(num_samples)
        budgets = np.asarray(budgets)
        rows = len(self.prompt_lengths) * self.num_samples
        if budgets.shape != (rows,) or not np.issubdtype(budgets.dtype, np.integer):
            raise ValueError(f"row_max_new_tokens has shape {budgets.shape} ({budgets.dtype}); expected "
                             f"({rows},) integers: one per row (len(prompts) * num_samples)")
        if rows and (budgets.min() < 1 or budgets.max() > max_new_tokens):
            raise ValueError(f"row_max_new_tokens must lie in [1, max_new_tokens={max_new_tokens}]; got "
                             f"[{budgets.min()}, {budgets.max()}]")
        self.budgets = budgets.astype(np.int64)
        self.steps_per_schedule = max_new_tokens if static else steps_per_schedule
        self.static = static
        longest = max(self.prompt_lengths + [max_prompt_len or 0])
        self.bucket, self.prefill_chunk = longest, prefill_chunk
        self._last_step = len(prefill_steps(longest, prefill_chunk)) - 1
        self._prefilling: dict[int, int] = {}  # prompt -> its prefill's next step (started, not ended)
        max_pages = pages_for(longest + max_new_tokens, page_size)
        self.cache = PagedCache(num_pages, page_size, max_slots, max_pages, shards)
        for row in range(rows):
            alone = self._row_need(row, prompt_held=False, take_partial=self.num_samples == 1)
            if alone > num_pages:
                prompt_len = self.prompt_lengths[row // self.num_samples]
                raise ValueError(
                    f"the page pool ({num_pages} pages of {page_size} tokens) is too small for row {row}: "
                    f"its prompt ({prompt_len} tokens) and budget ({self.budgets[row]} new tokens) need "
                    f"{alone} pages (with the prompt's own partial page, shared by its {self.num_samples} "
                    "samples); raise EngineConfig.num_pages / kv_cache_bytes or lower page_size")
        self._waiting = deque(range(rows))
        self._prompts: dict[int, PromptPages] = {}        # prefilled prompts with rows still waiting
        self._pending = [self.num_samples] * len(self.prompt_lengths)  # rows of each prompt not admitted
        self.slot_row = np.full(max_slots, -1, np.int64)  # row in each slot, -1 = free
        self.generated = np.zeros(max_slots, np.int64)    # tokens the slot's row has generated

    @property
    def finished(self) -> bool:
        """No row waits and no slot runs."""
        return not self._waiting and bool(np.all(self.slot_row < 0))

    def _row_tokens(self, row: int) -> int:
        return self.prompt_lengths[row // self.num_samples] + int(self.budgets[row])

    def _row_need(self, row: int, prompt_held: bool, take_partial: bool) -> int:
        prompt_len = self.prompt_lengths[row // self.num_samples]
        need = self.cache.attach_cost(prompt_len, self._row_tokens(row), take_partial)
        return need if prompt_held else need + pages_for(prompt_len, self.cache.page_size)

    def schedule(self) -> Schedule:
        """Admit waiting rows into free slots (FIFO, while pages allow) and grow every running row's
        pages for the next `steps_per_schedule` steps."""
        prefills, admissions = [], []
        for prompt, step in list(self._prefilling.items()):  # prefills started in earlier schedules
            prefills.append(self._prefill(prompt, step))
        cache = self.cache
        free = [[int(s) for s in np.flatnonzero(self.slot_row < 0) if cache.shard_of(s) == shard]
                for shard in range(cache.shards)]
        if self.static and np.any(self.slot_row >= 0):
            free = [[] for _ in free]  # a static batch is admitted whole, once the last one is done
        while self._waiting and any(free):
            row = self._waiting[0]
            prompt = row // self.num_samples
            if prompt in self._prefilling:
                break  # its prefill goes on in the next schedules; no later row overtakes it
            last = self._pending[prompt] == 1
            held = prompt in self._prompts
            need = self._row_need(row, held, take_partial=last)
            shard = (self._prompts[prompt].shard if held else
                     max(range(cache.shards), key=lambda s: (need <= cache.available_in(s), len(free[s]),
                                                             cache.available_in(s), -s)))
            if not free[shard] or need > cache.available_in(shard):
                break  # wait for a slot and pages: a row is never dropped or truncated
            if not held:
                self._prompts[prompt] = cache.hold_prompt(self.prompt_lengths[prompt], shard)
                first = first_prefill_step(self.prompt_lengths[prompt], self.bucket, self.prefill_chunk)
                prefills.append(self._prefill(prompt, first))
                if prompt in self._prefilling:
                    break  # admitted once its last step ran (the pages it needs stay free: FIFO)
            slot = free[shard].pop(0)
            copy = self.cache.attach(slot, self._prompts[prompt], self._row_tokens(row), take_partial=last)
            self._waiting.popleft()
            self._pending[prompt] -= 1
            if last:
                self.cache.release_prompt(self._prompts.pop(prompt))
            self.slot_row[slot] = row
            self.generated[slot] = 0
            admissions.append(Admission(slot, row, prompt, copy))
        if self._waiting and not admissions and not prefills and np.all(self.slot_row < 0):  # see __init__
            raise RuntimeError(f"row {self._waiting[0]} fits no empty pool of {self.cache.num_pages} pages")
        for slot in np.flatnonzero(self.slot_row >= 0):
            row = int(self.slot_row[slot])
            upto = min(int(self.generated[slot]) + self.steps_per_schedule, int(self.budgets[row]))
            self.cache.grow(int(slot), self.prompt_lengths[row // self.num_samples] + upto)
        return Schedule(tuple(prefills), tuple(admissions), self.cache.page_table.copy())

    def _prefill(self, prompt: int, step: int) -> Prefill:
        """Step `step` of the prompt's prefill; notes the next one unless it is the last."""
        last = step == self._last_step
        if last:
            self._prefilling.pop(prompt, None)
        else:
            self._prefilling[prompt] = step + 1
        held = self._prompts[prompt]
        return Prefill(prompt, self.prompt_lengths[prompt], held.pages, step, last, held.shard)

    @property
    def decoding(self) -> bool:
        """Some slot holds a row (a decode segment has work)."""
        return bool(np.any(self.slot_row >= 0))

    def decode_pages(self, slots: np.ndarray, widths: Sequence[int]) -> int:
        """The page-table columns the next segment of `slots` reads: the smallest of `widths` (ascending,
        `page_widths`) that holds every page those slots' rows hold (grown for the segment by
        `schedule`: every position the segment writes or reads)."""
        held = int(np.max(np.sum(self.cache.page_table[slots] != self.cache.scratch_page, axis=1), initial=0))
        return next(w for w in widths if w >= held)

    def decode_slots(self, widths: Sequence[int]) -> np.ndarray:
        """The slots the next segment decodes: the smallest of `widths` (ascending multiples of the
        shards, the last one every slot) whose share per shard holds each shard's occupied slots; each
        shard's share is its occupied slots and its lowest free ones, in shard order: `[width]` int32,
        ascending (block s of the batch: shard s's slots)."""
        per_shard = self.slot_row.reshape(self.cache.shards, -1)
        busiest = int(np.max(np.sum(per_shard >= 0, axis=1)))
        share = next(w for w in widths if w // self.cache.shards >= busiest) // self.cache.shards
        picked = []
        for shard, rows in enumerate(per_shard):
            occupied, free = np.flatnonzero(rows >= 0), np.flatnonzero(rows < 0)[: share - np.sum(rows >= 0)]
            picked.append(np.sort(np.concatenate([occupied, free])) + shard * len(rows))
        return np.concatenate(picked).astype(np.int32)

    def retire(self, generated: Sequence[int], done: Sequence[bool]) -> list[int]:
        """Record the segment's result per slot (`generated`: tokens of the slot's row so far; `done`:
        the row ended) and free the finished rows' slots and pages. Returns the retired rows."""
        generated, done = np.asarray(generated), np.asarray(done, bool)
        retired = []
        for slot in np.flatnonzero(self.slot_row >= 0):
            row = int(self.slot_row[slot])
            if generated[slot] > self.budgets[row]:
                raise ValueError(f"row {row} in slot {slot} generated {generated[slot]} tokens, beyond its "
                                 f"budget of {self.budgets[row]}")
            self.generated[slot] = generated[slot]
            if done[slot] or generated[slot] == self.budgets[row]:
                self.cache.free_slot(int(slot))
                self.slot_row[slot] = -1
                retired.append(row)
        return retired


def default_num_pages(prompt_lengths: Sequence[int], max_new_tokens: int, *, max_slots: int,
                      page_size: int) -> int:
    """A pool in which every slot can hold a row of the longest prompt and `max_new_tokens` (plus
    one pristine partial prompt page per slot), so admission never waits for pages."""
    longest = max(int(n) for n in prompt_lengths)
    return max_slots * (pages_for(longest + max_new_tokens, page_size) + 1)


def engine_slots(max_slots: int, rows: int, shards: int = 1) -> int:
    """The decode slots of a call of `rows` rows: at most `max_slots` and no more than the rows (a step
    computes every slot, free or not), rounded up to a multiple of the batch axes' `shards`."""
    return -(-min(max_slots, rows) // shards) * shards


def decode_widths(slots: int, min_slots: int, shards: int = 1, per_octave: int = 1) -> tuple[int, ...]:
    """The slot counts a decode segment runs at (ascending): `slots`, and `slots` · 2^(-j / per_octave)
    floored (j = 1, 2, ...) while they hold at least `min_slots` slots, each rounded up to a multiple of
    the batch axes' `shards`. per_octave 1: the halvings; 2: the halvings and the widths between them.

    Why: a step computes every slot it runs, and at the tail of a long-tailed batch most slots are free;
    one program per width (vLLM pads its decode batch to the nearest captured CUDA-graph size alike)
    lets the tail decode only the occupied slots' width. The occupied slots are padded up to the next
    width, which is under 2^(1 / per_octave) times their count: more widths per octave, fewer padded
    slots and more programs. `min_slots >= slots`: one width."""
    widths, j = {slots}, 1
    while (width := int(slots * 2.0 ** (-j / per_octave))) >= max(min_slots, 1):
        widths.add(-(-width // shards) * shards)
        j += 1
    return tuple(sorted(widths))


# A decode segment's page table is cut to the smallest of max_pages · k / parts (k = 1 .. parts, rounded
# up) that holds its slots' pages, with parts = DECODE_PAGE_PARTS, fewer where a part would hold fewer
# than DECODE_PAGE_PART_TOKENS tokens: one program per cut. Below that, attention over the whole table
# costs little beside the LM head and another program is not worth its compilation.
DECODE_PAGE_PARTS = 4
DECODE_PAGE_PART_TOKENS = 512


def page_widths(max_pages: int, page_size: int, parts: int | None = None,
                part_tokens: int | None = None) -> tuple[int, ...]:
    """The page-table widths a decode segment runs at (ascending): `max_pages` · k / n, rounded up, for
    k = 1 .. n with n = `parts`, or fewer so that a part holds at least `part_tokens` tokens (one: the
    whole table, every page a row can hold). None: `DECODE_PAGE_PARTS`, `DECODE_PAGE_PART_TOKENS`.

    Why: attention over a slot's pages gathers and scores every column of the table it is given, so a
    table as wide as the longest row a call may hold makes every step cost that row's length; cut to the
    pages the segment's slots hold, a step costs what the longest live row holds, within 1 / n."""
    parts = DECODE_PAGE_PARTS if parts is None else parts
    part_tokens = DECODE_PAGE_PART_TOKENS if part_tokens is None else part_tokens
    parts = max(1, min(parts, max_pages * page_size // max(part_tokens, 1)))
    return tuple(sorted({-(-max_pages * k // parts) for k in range(1, parts + 1)}))


def segment_widths(engine, *, slots: int, rows: int, max_new_tokens: int, shards: int = 1) -> tuple[int, ...]:
    """The decode widths of a call of `rows` rows in `slots` slots, as `EngineConfig` sets them:
    `decode_widths(slots, engine.min_decode_slots, shards, engine.decode_widths_per_octave)`, or the slot
    count alone when every row fits the slots and ends within the first segment (no tail to narrow to:
    the narrower programs would be compiled for nothing)."""
    if rows <= slots and engine.steps_per_schedule >= max_new_tokens:
        return (slots,)
    return decode_widths(slots, engine.min_decode_slots, shards, engine.decode_widths_per_octave)


def pool_pages(engine, *, bucket: int, max_new_tokens: int, slots: int, num_layers: int, kv_heads: int,
               head_dim: int, itemsize: int, shards: int = 1) -> int:
    """Pages of each batch shard's pool (its scratch page not counted), as `EngineConfig` sizes the
    whole pool, split evenly over `shards`: `num_pages` (floor, at least 1); else the pages
    `kv_cache_bytes` / shards holds; else `default_num_pages` for `slots` slots of rows of `bucket`
    (the padded longest prompt) + `max_new_tokens` tokens (admission never waits)."""
    if engine.num_pages is not None:
        return max(engine.num_pages // shards, 1)
    if engine.kv_cache_bytes is not None:
        return pool_pages_for_bytes(engine.kv_cache_bytes // shards, num_layers=num_layers, kv_heads=kv_heads,
                                    head_dim=head_dim, page_size=engine.page_size, itemsize=itemsize)
    return default_num_pages([bucket], max_new_tokens, max_slots=slots // shards, page_size=engine.page_size)


def pool_bytes_per_chip(engine, model_config, mesh, *, bucket: int, max_new_tokens: int, rows: int) -> int:
    """Bytes of the engine's K and V page pools on each device of `mesh` for a call of `rows` rows of
    prompts padded to `bucket` tokens (as `Engine` sizes it): each batch shard's pool (`pool_pages`, its
    scratch page included), its kv heads split over the `kv_heads` axes of `model_config.rules`; the
    pool / batch shards / kv-head shards. A function of the shapes alone (no device is touched)."""
    rules = model_config.rules
    shards = axis_size(mesh, rules.mesh_axes("batch"))
    kv_heads = model_config.num_key_value_heads // axis_size(mesh, rules.mesh_axes("kv_heads"))
    slots = engine_slots(engine.max_slots, rows, shards)
    layers, head_dim = model_config.num_hidden_layers, model_config.head_dim
    itemsize = jnp.dtype(model_config.dtype).itemsize
    pages = pool_pages(engine, bucket=bucket, max_new_tokens=max_new_tokens, slots=slots, num_layers=layers,
                       kv_heads=model_config.num_key_value_heads, head_dim=head_dim, itemsize=itemsize,
                       shards=shards)
    return 2 * layers * kv_heads * (pages + 1) * engine.page_size * head_dim * itemsize
