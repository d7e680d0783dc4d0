"""The continuous-batching scheduler and the paged-cache bookkeeping, driven by a NumPy stand-in for
the device: every token a row writes is a value naming (row, position), stored in a NumPy page pool
through the page tables exactly as the engine writes K/V; reading a row back through its page table
must give its own prompt and its own tokens, whatever the slots, page size or pool size."""

from __future__ import annotations

import numpy as np
import pytest

from respo_jax.sampling import EngineConfig, SamplingParams
from respo_jax.sampling.paged_cache import PagedCache, pool_pages_for_bytes
from respo_jax.sampling.scheduler import (Scheduler, decode_widths, default_num_pages, first_prefill_step,
                                         page_widths, prefill_steps, segment_widths)


def _prompt_value(prompt: int, position: int) -> int:
    return 1000 * prompt + position


def _row_value(row: int, position: int) -> int:
    return 10**6 + 1000 * row + position


def _simulate(prompt_lengths, num_samples, lengths, budgets, *, max_slots, steps, page_size, num_pages,
              static=False, shards=1):
    """Run the scheduler to the end against a fake device; row r ends after `lengths[r]` tokens (its
    "EOS") or at its budget. Checks the pool's content and the bookkeeping after every segment (a static
    schedule: admissions only into an engine with every slot free). Returns (generated tokens per row,
    the most slots busy at once, the most pages in use). With `shards`, one pool per batch shard (local
    page ids): a slot reads and writes only its own shard's pool, and each decode width's block s holds
    shard s's slots."""
    sched = Scheduler(prompt_lengths, num_samples, budgets, max_new_tokens=max(budgets), max_slots=max_slots,
                      steps_per_schedule=steps, page_size=page_size, num_pages=num_pages, static=static,
                      shards=shards)
    steps = sched.steps_per_schedule  # a static batch: to its end
    pool = np.full((shards, num_pages + 1, page_size), -1, np.int64)  # + each shard's scratch page
    shard_of = sched.cache.shard_of
    generated = np.zeros(max_slots, np.int64)
    done = np.zeros(max_slots, bool)
    result, busiest, most_pages, admitted = {}, 0, 0, []

    def read(slot, tokens):
        table = sched.cache.page_table[slot]
        return [pool[shard_of(slot), table[p // page_size], p % page_size] for p in range(tokens)]

    while not sched.finished:
        busy = bool(np.any(sched.slot_row >= 0))
        plan = sched.schedule()
        assert not (static and busy and plan.admissions), "a static batch is admitted whole, once free"
        for prefill in plan.prefills:
            for p in range(prefill.tokens):
                page = prefill.pages[p // page_size]
                pool[prefill.shard, page, p % page_size] = _prompt_value(prefill.prompt, p)
        for adm in plan.admissions:
            if adm.copy is not None:
                pool[shard_of(adm.slot), adm.copy[1]] = pool[shard_of(adm.slot), adm.copy[0]]
            admitted.append(adm.row)
            row = adm.row
            generated[adm.slot] = 1  # the first token comes from the prefill's logits
            done[adm.slot] = lengths[row] == 1
        assert admitted == sorted(admitted), "rows are admitted first-in first-out"
        np.testing.assert_array_equal(plan.page_table, sched.cache.page_table)
        live = np.flatnonzero(sched.slot_row >= 0)
        busiest = max(busiest, len(live))
        width = sched.decode_slots(decode_widths(max_slots, 1, shards))
        assert set(live) <= set(width) and len(set(width)) == len(width)
        cut = sched.decode_pages(width, page_widths(plan.page_table.shape[1], page_size, part_tokens=1))
        assert all(shard_of(slot) == i for i, block in enumerate(np.split(width, shards)) for slot in block)
        for slot in live:  # one segment of decode steps
            row = int(sched.slot_row[slot])
            prompt_len = prompt_lengths[row // num_samples]
            for _ in range(steps):
                if done[slot] or generated[slot] == budgets[row]:
                    break
                position = prompt_len + generated[slot] - 1  # the K/V of the token fed now
                assert sched.cache.writable(slot, position), "decode writes only pages the row owns"
                assert position // page_size < cut, "the segment's cut table holds every page it writes"
                page = sched.cache.page_table[slot, position // page_size]
                pool[shard_of(slot), page, position % page_size] = _row_value(row, position)
                generated[slot] += 1
                done[slot] = generated[slot] == lengths[row]
        most_pages = max(most_pages, sched.cache.pages_in_use)
        for slot in live:  # every row reads back its own prompt and tokens
            row = int(sched.slot_row[slot])
            prompt = row // num_samples
            prompt_len = prompt_lengths[prompt]
            tokens = prompt_len + generated[slot] - 1
            want = [_prompt_value(prompt, p) for p in range(prompt_len)]
            want += [_row_value(row, p) for p in range(prompt_len, tokens)]
            assert read(slot, tokens) == want, f"row {row}"
        snapshot = {int(s): (int(sched.slot_row[s]), int(generated[s])) for s in live}
        for row in sched.retire(generated, done):
            assert row not in result
            result[row] = next(g for r, g in snapshot.values() if r == row)
    assert sched.cache.pages_in_use == 0 and sched.cache.available == shards * num_pages
    assert (sched.cache.page_table == num_pages).all()
    return [result[r] for r in range(len(budgets))], busiest, most_pages


PROMPTS = [5, 16, 1, 23]  # tokens: partial, exactly full, single, several pages (page size 8)
G = 3
LENGTHS = [1, 40, 7, 12, 3, 30, 2, 2, 19, 33, 8, 5]   # each row's "EOS" length
BUDGETS = [4, 40, 40, 9, 40, 40, 1, 40, 40, 20, 40, 40]


@pytest.mark.parametrize("max_slots,steps,page_size,num_pages,shards", [
    (4, 3, 8, None, 1), (12, 1, 8, None, 1), (2, 5, 4, None, 1), (5, 2, 1, None, 1),
    (12, 4, 8, 9, 1),  # a pool smaller than the batch: admission waits, every row still completes
    (8, 2, 4, None, 4), (6, 3, 8, 9, 2),  # a pool per batch shard, its slots' pages local to it
])
def test_every_row_completes_with_its_own_tokens(max_slots, steps, page_size, num_pages, shards):
    pages = num_pages or default_num_pages(PROMPTS, max(BUDGETS), max_slots=max_slots // shards,
                                           page_size=page_size)
    got, busiest, most_pages = _simulate(PROMPTS, G, LENGTHS, BUDGETS, max_slots=max_slots, steps=steps,
                                         page_size=page_size, num_pages=pages, shards=shards)
    assert got == [min(n, b) for n, b in zip(LENGTHS, BUDGETS)]
    assert busiest <= max_slots and most_pages <= shards * pages
    if num_pages is not None:
        assert busiest < max_slots  # the pool, not the slots, held rows back


@pytest.mark.parametrize("max_slots,page_size", [(5, 8), (12, 4), (1, 8)])
def test_the_static_schedule_runs_batches_of_rows_to_their_end(max_slots, page_size):
    pages = default_num_pages(PROMPTS, max(BUDGETS), max_slots=max_slots, page_size=page_size)
    got, busiest, _ = _simulate(PROMPTS, G, LENGTHS, BUDGETS, max_slots=max_slots, steps=1,
                                page_size=page_size, num_pages=pages, static=True)
    assert got == [min(n, b) for n, b in zip(LENGTHS, BUDGETS)] and busiest == max_slots


def test_samples_share_the_prompts_full_pages_and_copy_its_partial_page():
    sched = Scheduler([20, 16], 3, [10] * 6, max_new_tokens=10, max_slots=6, steps_per_schedule=4,
                      page_size=8, num_pages=40)
    plan = sched.schedule()
    assert [(p.prompt, p.tokens, len(p.pages)) for p in plan.prefills] == [(0, 20, 3), (1, 16, 2)]
    first, second = plan.prefills
    copies = [a.copy for a in plan.admissions]
    # prompt 0 (20 = 2 full pages + 4 tokens): two rows copy the partial page, the last takes it
    assert [c[0] for c in copies[:2]] == [first.pages[2]] * 2 and copies[2] is None
    assert copies[3:] == [None] * 3  # prompt 1 fills its pages exactly: nothing to copy
    tables = plan.page_table
    for slot in range(3):
        assert tuple(tables[slot, :2]) == first.pages[:2]
        assert sched.cache.refcount(first.pages[0]) == 3
    assert len({tables[s, 2] for s in range(3)}) == 3  # a partial page of its own per row
    for slot in range(3, 6):
        assert tuple(tables[slot, :2]) == second.pages
    # rows grow into pages of their own, and retiring them frees exactly what nobody else holds
    assert len({tables[s, 2] for s in range(3, 6)}) == 3
    sched.retire([10, 3, 3, 3, 3, 3], [False] * 6)  # row 0 reached its budget
    assert sched.cache.refcount(first.pages[0]) == 2


def test_page_widths_cut_the_table_in_parts():
    assert page_widths(129, 16) == (33, 65, 97, 129)  # quarters, rounded up; the last: every page
    assert page_widths(48, 16) == (48,)  # 768 tokens: no part of 512 tokens to cut off
    assert page_widths(64, 16) == (32, 64) and page_widths(48, 16, part_tokens=1) == (12, 24, 36, 48)
    assert page_widths(3, 4, part_tokens=1) == (1, 2, 3)  # fewer pages than parts: no duplicates
    sched = Scheduler([5, 5], 1, [40, 3], max_new_tokens=40, max_slots=2, steps_per_schedule=4, page_size=4,
                      num_pages=20)
    sched.schedule()  # both rows admitted, pages for 5 + 4 tokens: 3 each
    widths = page_widths(sched.cache.page_table.shape[1], 4, part_tokens=1)  # 12 pages: (3, 6, 9, 12)
    assert sched.decode_pages(np.arange(2), widths) == 3 and sched.decode_pages(np.array([], int), widths) == 3
    sched.retire(np.array([4, 3]), np.array([False, True]))
    for _ in range(3):  # row 0 grows to 5 + 16 tokens: 6 pages
        sched.schedule()
        sched.retire(np.array([4 * (_ + 2), 0]), np.array([False, False]))
    assert sched.decode_pages(np.arange(2), widths) == 6


def test_decode_widths_and_the_slots_a_segment_decodes():
    assert decode_widths(64, 16) == (16, 32, 64)
    assert decode_widths(64, 64) == decode_widths(64, 100) == (64,)
    assert decode_widths(24, 1) == (1, 3, 6, 12, 24)  # halvings, floored
    assert decode_widths(24, 1, shards=4) == (4, 8, 12, 24)  # each a multiple of the batch shards
    # Two widths per octave: 64 · 2^(-j/2) floored, 45 = floor(64 / sqrt 2), 22 = floor(64 / sqrt 8).
    assert decode_widths(64, 16, per_octave=2) == (16, 22, 32, 45, 64)
    assert decode_widths(24, 1, shards=4, per_octave=2) == (4, 8, 12, 16, 24)
    for per_octave in (1, 2, 3, 4):  # any occupied count is padded by less than 2^(1 / per_octave)
        widths = decode_widths(64, 1, per_octave=per_octave)
        assert len(widths) == len(set(widths)) and widths[0] == 1 and widths[-1] == 64
        for occupied in range(1, 65):
            assert next(w for w in widths if w >= occupied) < occupied * 2 ** (1 / per_octave)
    engine = EngineConfig(min_decode_slots=16, steps_per_schedule=8)
    assert engine.decode_widths_per_octave == 2  # the default
    assert segment_widths(engine, slots=64, rows=128, max_new_tokens=8) == (16, 22, 32, 45, 64)
    engine = EngineConfig(min_decode_slots=16, steps_per_schedule=8, decode_widths_per_octave=1)
    assert segment_widths(engine, slots=64, rows=128, max_new_tokens=8) == (16, 32, 64)
    assert segment_widths(engine, slots=64, rows=64, max_new_tokens=9) == (16, 32, 64)
    assert segment_widths(engine, slots=64, rows=64, max_new_tokens=8) == (64,)  # all end in segment 1
    sched = Scheduler([3, 5], 4, [2, 9, 2, 2, 2, 2, 2, 9], max_new_tokens=9, max_slots=8,
                      steps_per_schedule=2, page_size=4, num_pages=64)
    sched.schedule()  # all 8 rows admitted into slots 0-7
    np.testing.assert_array_equal(sched.decode_slots((2, 4, 8)), np.arange(8))
    done = np.isin(np.arange(8), [1, 7], invert=True)  # rows 1 and 7 (budget 9) go on
    sched.retire(np.full(8, 2), done)
    sched.schedule()
    np.testing.assert_array_equal(sched.decode_slots((2, 4, 8)), [1, 7])  # the two occupied slots
    np.testing.assert_array_equal(sched.decode_slots((4, 8)), [0, 1, 2, 7])  # + the lowest free ones
    np.testing.assert_array_equal(sched.decode_slots((8,)), np.arange(8))


def test_a_long_prompts_prefill_takes_a_step_per_schedule_while_rows_decode():
    assert prefill_steps(8, None) == [[(0, 7), (7, 8)]]  # one call: all but the last token, then it
    assert prefill_steps(9, 4) == [[(0, 4)], [(4, 8), (8, 9)]]
    assert prefill_steps(1, 4) == [[(0, 1)]]
    assert [first_prefill_step(n, 24, 4) for n in (1, 3, 4, 20, 24)] == [5, 5, 5, 1, 0]  # pads skipped
    # Bucket 24, pieces of 4: 6 steps. Prompt 0 (3 tokens) needs its last step only: admitted at once;
    # prompt 1 (20 tokens) starts at step 1 and is admitted in the schedule of step 5, while row 0 decodes.
    budgets = np.array([12, 4])
    sched = Scheduler([3, 20], 1, budgets, max_new_tokens=12, max_slots=2, steps_per_schedule=2, page_size=4,
                      num_pages=64, max_prompt_len=24, prefill_chunk=4)
    log = []
    while not sched.finished:
        plan = sched.schedule()
        log.append(([(p.prompt, p.step, p.last) for p in plan.prefills], [a.row for a in plan.admissions]))
        running = sched.slot_row >= 0  # a segment of 2 steps, no EOS
        sched.retire(np.where(running, np.minimum(sched.generated + 2, budgets[sched.slot_row]), 0),
                     np.zeros(2, bool))
    assert log[:5] == [([(0, 5, True), (1, 1, False)], [0]), ([(1, 2, False)], []), ([(1, 3, False)], []),
                       ([(1, 4, False)], []), ([(1, 5, True)], [1])]
    assert all(not prefills for prefills, _ in log[5:])


def test_a_pool_too_small_for_one_row_is_a_clear_error():
    with pytest.raises(ValueError, match=r"page pool \(6 pages of 8 tokens\) is too small for row 0: its "
                                         r"prompt \(20 tokens\) and budget \(30 new tokens\) need 8 pages"):
        Scheduler([20], 2, [30, 30], max_new_tokens=30, max_slots=2, steps_per_schedule=4, page_size=8,
                  num_pages=6)
    with pytest.raises(ValueError, match=r"row_max_new_tokens must lie in \[1, max_new_tokens=8\]"):
        Scheduler([4], 2, [3, 9], max_new_tokens=8, max_slots=2, steps_per_schedule=4, page_size=8,
                  num_pages=6)


def test_pool_size_from_a_byte_budget_and_engine_validation():
    # 2 layers x (K, V) x 2 kv heads x head_dim 4 x page 8 x 4 bytes = 1,024 bytes a page; one is scratch
    assert pool_pages_for_bytes(10 * 1024 + 1023, num_layers=2, kv_heads=2, head_dim=4, page_size=8,
                                itemsize=4) == 9
    with pytest.raises(ValueError, match="holds no page"):
        pool_pages_for_bytes(1024, num_layers=2, kv_heads=2, head_dim=4, page_size=8, itemsize=4)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_pages=4, kv_cache_bytes=4096)
    with pytest.raises(ValueError, match="paged_attention_impl='flash': expected one of 'gather', 'pallas_tpu'"):
        EngineConfig(paged_attention_impl="flash")
    with pytest.raises(ValueError, match="ignore_eos must be a bool"):
        SamplingParams(max_new_tokens=4, ignore_eos=1)


def test_page_cache_refuses_to_overdraw():
    cache = PagedCache(num_pages=3, page_size=4, max_slots=2, max_pages=3)
    prompt = cache.hold_prompt(6)  # 2 pages
    cache.attach(0, prompt, row_tokens=8, take_partial=True)
    cache.release_prompt(prompt)
    assert cache.available == 1 and cache.pages_in_use == 2
    with pytest.raises(ValueError, match="beyond its reservation"):
        cache.grow(0, 9)
    with pytest.raises(ValueError, match="needs 2 pages; 1 are available"):
        cache.hold_prompt(5)


def test_pool_bytes_per_chip_are_the_pool_over_the_batch_and_kv_head_shards():
    """`pool_bytes_per_chip` from shapes alone (an abstract mesh): a pool of kv_cache_bytes split over 4
    batch shards (each its own pages and scratch page) and 2 kv-head shards holds 1/8 of it a device;
    on one device, all of it."""
    from jax.sharding import AbstractMesh

    from respo_jax.models import qwen3
    from respo_jax.sampling.scheduler import pool_bytes_per_chip

    cfg = qwen3.Qwen3Config.preset("tiny")  # 2 layers, 2 kv heads, head_dim 16, float32: 1 KiB a 4-token page
    engine = EngineConfig(kv_cache_bytes=2**20, page_size=4)
    axes = ("data", "fsdp", "tensor", "expert")
    for shape, want in (((4, 1, 2, 1), 2**20 // 8), ((1, 1, 1, 1), 2**20)):
        got = pool_bytes_per_chip(engine, cfg, AbstractMesh(shape, axes), bucket=8, max_new_tokens=8, rows=16)
        assert got == want, (shape, got)
