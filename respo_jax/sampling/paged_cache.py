"""Host-side bookkeeping of the paged KV cache: which page of the pool holds which tokens of which slot.

Why: a cache of rows × max length holds memory for tokens a row never generates. Here K/V live in a
pool of `page_size`-token pages (the device arrays are `paged_attention`'s `[kv_heads, num_pages + 1,
page_size, head_dim]` per layer); each decode slot has a page table, takes pages as its row grows and
returns them when the row ends. The G samples of a prompt share the prompt's full pages (reference
counts); each gets its own copy of the prompt's partial last page, which decoding writes into. This is
vLLM's KV-cache manager in plain NumPy: no jit, no device arrays; the engine applies its decisions.

Reservation. Admitting a row reserves the pages its own budget can need (prompt + budget tokens), so
a running row never waits for a page and no row is ever preempted, dropped or truncated; pages are
*taken* only as the row grows, so the pages in use follow the tokens generated. Which pages are taken
is deterministic (always the lowest-numbered free page), so every process takes the same decisions.

Page `num_pages` (one past the pool) is a scratch page: free slots' page tables point at it, so a
fixed-shape decode step may write a free slot's K/V there without touching a live page.

Shards. On a mesh the pool is split over the batch axes with the slots (`qwen3.PagedKVCache`): each
of `shards` batch shards has a pool of its own (`num_pages` pages and a scratch page, ids 0 ..
num_pages local to the shard) and its own contiguous block of slots, and a slot's pages are always
its shard's. A prompt is held on one shard and its rows run in that shard's slots.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


def pool_pages_for_bytes(budget: int, *, num_layers: int, kv_heads: int, head_dim: int, page_size: int,
                         itemsize: int) -> int:
    """Pages of a pool that fits `budget` bytes of K and V over all layers (the scratch page included)."""
    page_bytes = 2 * num_layers * kv_heads * head_dim * page_size * itemsize
    pages = budget // page_bytes - 1
    if pages < 1:
        raise ValueError(f"kv_cache_bytes={budget} holds no page: one page (page_size {page_size}, "
                         f"{num_layers} layers, {kv_heads} kv heads, head_dim {head_dim}, {itemsize}-byte "
                         f"dtype, K and V) is {page_bytes} bytes, and the pool needs a scratch page too")
    return pages


@dataclasses.dataclass(frozen=True)
class PromptPages:
    """The pages a prompt was prefilled into (`tokens` tokens; the last page partial unless
    `tokens % page_size == 0`)."""

    tokens: int
    pages: tuple[int, ...]
    shard: int = 0


class PagedCache:
    """Page pools (one per batch shard), reference counts and per-slot page tables.

    Attributes:
      page_table: `[max_slots, max_pages]` int32; entry j of slot s is the page of the slot's shard
        holding tokens [j·page_size, (j+1)·page_size) of the slot's row (the scratch page `num_pages`
        where unused).
      num_pages (per shard), page_size, scratch_page, shards (slot s in shard s // (max_slots / shards)).
    """

    def __init__(self, num_pages: int, page_size: int, max_slots: int, max_pages: int, shards: int = 1):
        if max_slots % shards:
            raise ValueError(f"{max_slots} slots do not split over {shards} batch shards")
        self.num_pages, self.page_size, self.shards = num_pages, page_size, shards
        self.scratch_page = num_pages
        self.slots_per_shard = max_slots // shards
        self.page_table = np.full((max_slots, max_pages), self.scratch_page, np.int32)
        self._held = np.zeros(max_slots, np.int64)       # pages in each slot's table
        self._reserved = np.zeros(max_slots, np.int64)   # pages a slot may still take
        self._refcount = np.zeros((shards, num_pages), np.int64)
        self._free = [list(range(num_pages)) for _ in range(shards)]  # heaps: the lowest free page first

    # -- accounting ------------------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        """Pages holding tokens (taken, not returned), over all shards."""
        return self.shards * self.num_pages - sum(len(free) for free in self._free)

    @property
    def available(self) -> int:
        """Free pages not promised to an admitted row, over all shards."""
        return sum(self.available_in(shard) for shard in range(self.shards))

    def available_in(self, shard: int) -> int:
        """Free pages of `shard` not promised to an admitted row of its slots."""
        slots = self.slots_of(shard)
        return len(self._free[shard]) - int(self._reserved[slots].sum())

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def slots_of(self, shard: int) -> slice:
        return slice(shard * self.slots_per_shard, (shard + 1) * self.slots_per_shard)

    def refcount(self, page: int, shard: int = 0) -> int:
        return int(self._refcount[shard, page])

    def pages_of(self, slot: int) -> tuple[int, ...]:
        return tuple(int(p) for p in self.page_table[slot, : self._held[slot]])

    def attach_cost(self, prompt_tokens: int, row_tokens: int, take_partial: bool) -> int:
        """Pages a row of `row_tokens` tokens (prompt + budget) takes or reserves beyond the shared
        prompt pages: its own copy of the partial page (unless it takes the prompt's own) and growth."""
        shared = prompt_tokens // self.page_size
        if take_partial and prompt_tokens % self.page_size:
            shared += 1
        return pages_for(row_tokens, self.page_size) - shared

    # -- prompts ---------------------------------------------------------------------------------

    def hold_prompt(self, tokens: int, shard: int = 0) -> PromptPages:
        """Take the pages of `shard` a prompt of `tokens` tokens is prefilled into (released by
        `release_prompt`)."""
        need = pages_for(tokens, self.page_size)
        if need > self.available_in(shard):
            raise ValueError(f"a prompt of {tokens} tokens needs {need} pages; "
                             f"{self.available_in(shard)} are available")
        return PromptPages(tokens, tuple(self._take(shard) for _ in range(need)), shard)

    def release_prompt(self, prompt: PromptPages) -> None:
        """Drop the prompt's own hold on its pages (rows attached to it keep theirs)."""
        for page in prompt.pages:
            self._release(page, prompt.shard)

    def attach(self, slot: int, prompt: PromptPages, row_tokens: int, take_partial: bool):
        """Start `slot`'s page table from `prompt`'s pages for a row of at most `row_tokens` tokens.

        The full pages are shared. The partial last page is shared too when `take_partial` (the last
        row of the prompt: the caller releases the prompt right after, so the row owns it alone);
        otherwise the row gets a fresh page and must copy the partial one into it. The pages the row
        can still need are reserved. Returns the `(source, destination)` page copy, or None.
        """
        if self._held[slot] or self._reserved[slot]:
            raise ValueError(f"slot {slot} is in use")
        shard = self.shard_of(slot)
        if shard != prompt.shard:
            raise ValueError(f"slot {slot} is in batch shard {shard}; the prompt's pages are shard "
                             f"{prompt.shard}'s")
        if row_tokens > self.page_table.shape[1] * self.page_size:
            raise ValueError(f"a row of {row_tokens} tokens exceeds the page table "
                             f"({self.page_table.shape[1]} pages of {self.page_size})")
        cost = self.attach_cost(prompt.tokens, row_tokens, take_partial)
        if cost > self.available_in(shard):
            raise ValueError(f"slot {slot}: a row of {row_tokens} tokens needs {cost} more pages; "
                             f"{self.available_in(shard)} are available")
        full = prompt.tokens // self.page_size
        partial = prompt.tokens % self.page_size != 0
        shared = prompt.pages[: full + (partial and take_partial)]
        for j, page in enumerate(shared):
            self._refcount[shard, page] += 1
            self.page_table[slot, j] = page
        self._held[slot] = len(shared)
        copy = None
        if partial and not take_partial:
            self._reserved[slot] = 1
            copy = (prompt.pages[full], self._grow_one(slot))
        self._reserved[slot] = pages_for(row_tokens, self.page_size) - self._held[slot]
        return copy

    # -- rows ------------------------------------------------------------------------------------

    def grow(self, slot: int, tokens: int) -> None:
        """Make `slot`'s pages hold at least `tokens` tokens (within its reservation)."""
        need = pages_for(tokens, self.page_size) - self._held[slot]
        if need > self._reserved[slot]:
            raise ValueError(f"slot {slot} asks for {tokens} tokens, beyond its reservation of "
                             f"{(self._held[slot] + self._reserved[slot]) * self.page_size}")
        for _ in range(need):
            self._grow_one(slot)

    def free_slot(self, slot: int) -> None:
        """Return the slot's pages (shared ones only when no other holder remains) and reservation."""
        for page in self.pages_of(slot):
            self._release(page, self.shard_of(slot))
        self.page_table[slot] = self.scratch_page
        self._held[slot] = 0
        self._reserved[slot] = 0

    def writable(self, slot: int, position: int) -> bool:
        """Whether the page holding token `position` of the slot is the slot's alone (decode may write)."""
        page = self.page_table[slot, position // self.page_size]
        return page != self.scratch_page and self._refcount[self.shard_of(slot), page] == 1

    # -- internals -------------------------------------------------------------------------------

    def _grow_one(self, slot: int) -> int:
        page = self._take(self.shard_of(slot), reserved=True)
        self._reserved[slot] -= 1
        self.page_table[slot, self._held[slot]] = page
        self._held[slot] += 1
        return page

    def _take(self, shard: int, reserved: bool = False) -> int:
        if not self._free[shard] or (not reserved and self.available_in(shard) < 1):
            raise ValueError("the page pool is exhausted")
        page = heapq.heappop(self._free[shard])
        self._refcount[shard, page] = 1
        return page

    def _release(self, page: int, shard: int) -> None:
        self._refcount[shard, page] -= 1
        if self._refcount[shard, page] == 0:
            heapq.heappush(self._free[shard], page)
