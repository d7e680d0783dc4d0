"""The rollout engine against independent references: a step-by-step sampler over the model's full
forward (`decode_reference`: the same keys, no cache, no pages, no schedule) for tokens and log-probs,
teacher-forced forwards for log-probs and MoE routing. Greedy and sampled tokens are the reference's
whatever max_slots / page size / steps_per_schedule / pool size / decode widths / schedule; per-row
budgets and ignore_eos honoured; one prefill and one admission call per schedule; the static schedule
runs batches of rows to their end; every program compiles ahead; prefill and decode both run the model's
own layers (a spy norm)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import jitted_model as jm
from decode_reference import assert_same, reference_generate
from respo_jax.models import qwen3
from respo_jax.models.qwen3.layers import RMSNorm
from respo_jax.sampling import EngineConfig, SamplingParams, compile_generate, generate, model_step
from respo_jax.training.compilation import compilation_totals

PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [100], [7, 7, 8, 9, 10, 11]]
NEW = 12
# slots fewer than rows, pages smaller than prompts, segments that end mid-row
ENGINE = EngineConfig(max_slots=3, page_size=4, steps_per_schedule=5)


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.3: well-separated logits, so no greedy choice hinges on float rounding
    cfg = qwen3.Qwen3Config.preset("tiny", initializer_range=0.3, tie_word_embeddings=False)
    return qwen3.init_model(cfg, 1)


def _reference(model, params):
    """(params with an EOS id that the reference emits at step 4 of row 1, the reference's rows
    without EOS, the same rows with it)."""
    full = reference_generate(model, PROMPTS, params)
    eos = int(full.tokens[1, 4])
    params = dataclasses.replace(params, eos_token_ids=(eos,))
    want = reference_generate(model, PROMPTS, params)
    assert want.lengths.min() < NEW  # EOS retires some rows early
    return params, full, want


def test_greedy_equals_the_reference(model):
    params, _, want = _reference(model, SamplingParams(max_new_tokens=NEW, temperature=0.0, num_samples=2))
    assert_same(generate(model, PROMPTS, params, engine=ENGINE), want)
    # the model's other layer loop (stacked weights, scanned): same values, same samples
    scanned = qwen3.init_model(model.config.replace(scan_layers=True), 1)
    assert scanned.config.scan_layers and not model.config.scan_layers
    assert_same(generate(scanned, PROMPTS, params, engine=ENGINE), want)


@pytest.fixture(scope="module")
def sampled(model):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, num_samples=3, seed=2**33 + 7)
    return _reference(model, params)


def test_sampled_tokens_equal_the_references_in_either_schedule(model, sampled):
    params, _, want = sampled
    assert_same(generate(model, PROMPTS, params, engine=ENGINE), want)
    # static batches of 5 rows (5 + 5 + 2), each decoded to its end: the same samples
    assert_same(generate(model, PROMPTS, params, engine=EngineConfig(scheduler="static", max_slots=5,
                                                                     page_size=4)), want)


def test_row_ids_and_prefill_chunks_keep_the_samples(model, sampled):
    params, full, _ = sampled
    ids = np.arange(12, dtype=np.uint32)[::-1] * 1000 + 5  # a row's draws follow its id, not its index
    want = reference_generate(model, PROMPTS, params, row_ids=ids)
    moved = reference_generate(model, PROMPTS, dataclasses.replace(params, eos_token_ids=()), row_ids=ids)
    assert not np.array_equal(moved.tokens, full.tokens)
    engine = dataclasses.replace(ENGINE, prefill_chunk_size=4)
    assert_same(generate(model, PROMPTS, params, engine=engine, row_ids=ids), want)


def test_reported_logprobs_equal_a_teacher_forced_forward(model, sampled):
    params, _, _ = sampled
    out = generate(model, PROMPTS, params, engine=ENGINE)
    tokens, lengths, logprobs = (np.asarray(a) for a in (out.tokens, out.lengths, out.logprobs))
    rows = [p for p in PROMPTS for _ in range(params.num_samples)]
    width = max(len(p) for p in PROMPTS) + NEW
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for r, prompt in enumerate(rows):  # right-padded: causal attention never sees the trailing pads
        sequence = prompt + tokens[r, : lengths[r]].tolist()
        ids[r, : len(sequence)] = sequence
        mask[r, : len(sequence)] = 1
    targets = np.concatenate([ids[:, 1:], np.zeros((len(rows), 1), np.int32)], axis=1)
    forced = np.asarray(jm.token_logprobs(model, ids, targets, attention_mask=mask,
                                          temperature=params.temperature))
    for r, prompt in enumerate(rows):
        n = lengths[r]
        start = len(prompt) - 1  # the logits at the last prompt token score the first response token
        np.testing.assert_allclose(logprobs[r, :n], forced[r, start:start + n], atol=2e-5)


# More slots than ENGINE, a page per 2 tokens, a segment per token, and a pool of 26 pages, far fewer
# than the 12 rows need together (a row of the 11-token prompt at full budget alone takes 12 pages +
# the prompt's partial page): admission waits for pages although slots are free. The reference's
# samples here and with ENGINE above: they depend on neither max_slots, page_size, steps_per_schedule
# nor the pool.
WAITING = EngineConfig(max_slots=6, page_size=2, steps_per_schedule=1, num_pages=26)


def test_row_budgets_and_ignore_eos(model, sampled):
    params, full, _ = sampled
    params = dataclasses.replace(params, ignore_eos=True)
    eos = params.eos_token_ids[0]
    assert (full.tokens[:, :-1] == eos).any()  # EOS is sampled, so ignoring it matters
    budgets = np.random.default_rng(0).integers(1, NEW + 1, len(PROMPTS) * params.num_samples)
    budgets[0] = 1
    out = generate(model, PROMPTS, params, engine=WAITING, row_max_new_tokens=budgets)
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    np.testing.assert_array_equal(np.asarray(out.lengths), budgets)
    for r, budget in enumerate(budgets):  # a row's draws do not depend on its own or others' budgets
        np.testing.assert_array_equal(tokens[r, :budget], full.tokens[r, :budget])
        np.testing.assert_allclose(logprobs[r, :budget], full.logprobs[r, :budget], atol=2e-5)
        assert (tokens[r, budget:] == params.pad_token_id).all() and (logprobs[r, budget:] == 0).all()


def test_engine_input_errors(model, sampled):
    params, _, _ = sampled
    with pytest.raises(ValueError, match=r"page pool \(3 pages of 4 tokens\) is too small for row 0"):
        generate(model, PROMPTS, params, engine=EngineConfig(page_size=4, num_pages=3))
    with pytest.raises(ValueError, match="paged_attention_impl='pallas_gpu': runs on gpu devices; the engine "
                                         "runs on cpu devices"):
        generate(model, PROMPTS, params, engine=EngineConfig(paged_attention_impl="pallas_gpu"))
    with pytest.raises(ValueError, match=r"row_max_new_tokens must lie in \[1, max_new_tokens=12\]"):
        generate(model, PROMPTS, params, row_max_new_tokens=[NEW + 1] * 12)
    with pytest.raises(ValueError, match=r"return_routing=True needs an MoE model"):
        generate(model, PROMPTS, params, return_routing=True)
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        compile_generate(model, 0, 1, params)
    with pytest.raises(TypeError, match="max_batch_rows"):  # the static engine's fields are gone
        EngineConfig(max_batch_rows=8)


def _log_calls(monkeypatch, names) -> dict:
    """{name: [positional args of each call]} of the `model_step` programs `names`, called through."""
    calls = {name: [] for name in names}

    def logged(program, log):
        def call(*args, **kwargs):
            log.append(args)
            return program(*args, **kwargs)
        return call

    for name, log in calls.items():
        monkeypatch.setattr(model_step, name, logged(getattr(model_step, name), log))
    return calls


def test_one_prefill_and_one_admission_call_per_schedule(model, sampled, monkeypatch):
    # Enough slots for every row: the first schedule starts all 4 prompts in one prefill of a [4, bucket]
    # batch and admits all 12 rows in one call; later schedules only decode.
    params, _, want = sampled
    calls = _log_calls(monkeypatch, ("prefill_prompts", "admit_rows", "decode_segment"))
    engine = EngineConfig(max_slots=12, page_size=4, steps_per_schedule=3)
    assert_same(generate(model, PROMPTS, params, engine=engine), want)
    assert len(calls["prefill_prompts"]) == 1 and len(calls["admit_rows"]) == 1
    input_ids = calls["prefill_prompts"][0][3]
    assert input_ids.shape == (4, 16)  # the 4 prompts, left-padded to the 11-token prompt's bucket
    assert len(calls["decode_segment"]) <= -(-NEW // 3)  # the longest row's segments at most


def test_the_tail_decodes_only_the_occupied_slots_width(model, sampled, monkeypatch):
    # min_decode_slots=1, two widths per octave: 6 slots decode at widths 6, 4, 3, 2 or 1 (the occupied
    # slots and the lowest free ones); rows of random budgets leave a tail of few live rows. Same samples
    # as every slot decoding.
    params, _, want = sampled
    widths = []

    def logged(*args, **kwargs):
        widths.append(int(args[4].shape[0]))  # run_slots
        return program(*args, **kwargs)

    program = model_step.decode_segment
    monkeypatch.setattr(model_step, "decode_segment", logged)
    engine = EngineConfig(max_slots=6, page_size=4, steps_per_schedule=2, min_decode_slots=1)
    assert_same(generate(model, PROMPTS, params, engine=engine), want)
    assert set(widths) <= {1, 2, 3, 4, 6}
    budgets = np.full(12, 2)
    budgets[[4, 9]] = NEW  # two long rows: once the others are done, segments decode 2 slots, then 1
    ignoring = dataclasses.replace(params, ignore_eos=True)
    widths.clear()
    out = generate(model, PROMPTS, ignoring, engine=engine, row_max_new_tokens=budgets)
    assert widths[:2] == [6, 6] and 2 in widths and widths[-1] == 1  # rows 4 and 9, then the later one
    wide = generate(model, PROMPTS, ignoring, row_max_new_tokens=budgets,
                               engine=dataclasses.replace(engine, min_decode_slots=6))
    np.testing.assert_array_equal(np.asarray(out.lengths), budgets)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(wide.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(wide.logprobs), atol=2e-5)


def test_decode_reads_a_page_table_cut_to_the_live_pages(model, sampled, monkeypatch):
    # Parts of one token (every cut a quarter of the table): with "gather", a segment's table holds only
    # the pages its rows hold, narrower while they are short; "ragged" reads each row's own pages
    # whatever the table's width, so its segments take one width. The samples are the reference's.
    from respo_jax.sampling import scheduler

    params, _, want = sampled
    tables = []

    def logged(*args, **kwargs):
        tables.append(args[3].shape)  # page_table [slots, pages]
        return program(*args, **kwargs)

    program = model_step.decode_segment
    monkeypatch.setattr(model_step, "decode_segment", logged)
    monkeypatch.setattr(scheduler, "DECODE_PAGE_PART_TOKENS", 1)
    widths = {}
    for impl in ("gather", "ragged"):
        tables.clear()
        engine = dataclasses.replace(ENGINE, paged_attention_impl=impl)
        assert_same(generate(model, PROMPTS, params, engine=engine), want)
        widths[impl] = {pages for _, pages in tables}
    assert len(widths["gather"]) > 1 and len(widths["ragged"]) == 1
    assert max(widths["gather"]) <= min(widths["ragged"])  # the ragged table: the layout's whole width


def test_a_long_prompts_prefill_is_spread_over_schedules_while_rows_decode(model, sampled, monkeypatch):
    # prefill_chunk_size=2: the 11-token prompt (bucket 16) takes 6 prefill steps, one per schedule,
    # started when a slot frees; the rows in the other slots decode between its steps. Same samples.
    params, _, want = sampled
    events = []

    def logged(name, program):
        def call(*args, **kwargs):
            events.append((name, kwargs.get("step")))
            return program(*args, **kwargs)
        return call

    for name in ("prefill_prompts", "decode_segment"):
        monkeypatch.setattr(model_step, name, logged(name, getattr(model_step, name)))
    engine = dataclasses.replace(ENGINE, prefill_chunk_size=2)
    assert_same(generate(model, PROMPTS, params, engine=engine), want)
    last = 7  # steps [0, 2) ... [12, 14), [14, 15) + the last token
    steps = [step for name, step in events if name == "prefill_prompts"]
    assert {2, 3, 4, 5, 6, 7} <= set(steps) and max(steps) == last  # the 11-token prompt: steps 2 to 7
    between = [events[i + 1][0] for i, (name, step) in enumerate(events[:-1])
               if name == "prefill_prompts" and step < last]
    assert "decode_segment" in between  # decoding went on during a long prefill


def test_the_static_schedule_admits_a_batch_only_once_the_last_one_is_done(model, sampled, monkeypatch):
    # 12 rows through 5 slots: batches of 5, 5 and 2 rows, one decode segment each over every slot
    # (each decodes until its last row ends), one admission call per batch; the reference's samples.
    params, _, want = sampled
    calls = _log_calls(monkeypatch, ("admit_rows", "decode_segment"))
    assert_same(generate(model, PROMPTS, params, engine=EngineConfig(scheduler="static", max_slots=5)), want)
    admitted = [int((np.asarray(args[3]) < 5).sum()) for args in calls["admit_rows"]]  # slot < 5: real
    assert admitted == [5, 5, 2]
    assert [args[4].shape[0] for args in calls["decode_segment"]] == [5, 5, 5]
    assert all(int(args[5]) == NEW for args in calls["decode_segment"])  # a segment runs to the cap


def test_prefill_and_decode_both_run_the_models_own_layers(sampled):
    # A spy in place of one layer's input norm (a subclass: the same weights and values, plus a host
    # callback recording the shape it normalises): the engine's prefill ([prompts, tokens, embed]) and
    # decode step ([slots, 1, embed]) both go through it, and the samples are the reference's.
    params, _, want = sampled
    seen = []

    class SpyNorm(RMSNorm):
        def __call__(self, x):
            jax.debug.callback(lambda: seen.append(x.shape[:2]))
            return super().__call__(x)

    cfg = qwen3.Qwen3Config.preset("tiny", initializer_range=0.3, tie_word_embeddings=False)
    spied = qwen3.init_model(cfg, 1)
    layer = spied.stacks[0].layers[1]
    norm = layer.input_layernorm
    layer.input_layernorm = SpyNorm(norm.weight.shape[0], norm.eps, "embed", param_dtype=norm.weight.dtype,
                                    dtype=norm.dtype)
    layer.input_layernorm.weight = norm.weight
    out = generate(spied, PROMPTS, params, engine=ENGINE)
    jax.effects_barrier()
    assert_same(out, want)
    assert any(tokens > 1 for _, tokens in seen)  # a prefill piece of many tokens
    assert any(tokens == 1 and rows <= ENGINE.max_slots for rows, tokens in seen)  # a decode step


@pytest.fixture(scope="module")
def moe_model():
    # initializer_range 0.3: well-separated logits and router scores (no top-k at a near-tie)
    return qwen3.init_model(qwen3.Qwen3Config.preset("tiny-moe", initializer_range=0.3), 1)


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_moe_tokens_equal_the_reference_and_routing_teacher_forcing(moe_model, temperature):
    # The routed experts of every prompt and generated token, in generate's format: rows that end at an
    # EOS mid-segment, at a segment's end and at the budget all record their last token's routing, which
    # equals a teacher-forced forward's over prompt + response.
    params = SamplingParams(max_new_tokens=NEW, temperature=temperature, num_samples=2, seed=5)
    full = reference_generate(moe_model, PROMPTS, params)
    params = dataclasses.replace(params, eos_token_ids=(int(full.tokens[1, 4]),))
    want = reference_generate(moe_model, PROMPTS, params)
    assert want.lengths.min() < NEW < want.lengths.max() + 1
    # segments of 3 or 1 slots (capture in both); sampled: prefills spread over schedules (the routing of
    # the prompt tokens written step by step)
    narrow = dataclasses.replace(ENGINE, min_decode_slots=1, prefill_chunk_size=2 if temperature else None)
    got = generate(moe_model, PROMPTS, params, engine=narrow, return_routing=True)
    assert_same(got, want, logprob_tol=2e-5)
    rows = [p for p in PROMPTS for _ in range(params.num_samples)]
    seqs = [rows[r] + want.tokens[r, : want.lengths[r]].tolist() for r in range(len(rows))]
    width = max(map(len, seqs))
    ids = np.array([s + [0] * (width - len(s)) for s in seqs], np.int32)
    mask = np.array([[1] * len(s) + [0] * (width - len(s)) for s in seqs], np.int32)
    forced = np.asarray(jm.forward(moe_model, ids, attention_mask=mask, return_routing=True).routing)
    routing, prompt_routing, prompt_mask = (np.asarray(a) for a in (got.routing, got.prompt_routing,
                                                                  got.prompt_mask))
    bucket = prompt_mask.shape[1]
    for r, prompt in enumerate(rows):
        n, m = int(want.lengths[r]), len(prompt)
        np.testing.assert_array_equal(routing[:, r, :n], forced[:, r, m:m + n])
        np.testing.assert_array_equal(routing[:, r, n:], 0)
        np.testing.assert_array_equal(prompt_mask[r], [0] * (bucket - m) + [1] * m)
        np.testing.assert_array_equal(prompt_routing[:, r, bucket - m:], forced[:, r, :m])


@pytest.mark.slow  # compiles every program of a run: in the full suite, not the fast path
def test_compile_generate_compiles_every_program_ahead(moe_model):
    # Routing capture, a pool that makes admission wait, prefills of 1 and 2 prompts: every program of a
    # call with these shapes is compiled ahead, so the call compiles nothing.
    params = SamplingParams(max_new_tokens=6, temperature=1.0, num_samples=2, seed=3, eos_token_ids=(2,))
    engine = EngineConfig(max_slots=3, page_size=4, steps_per_schedule=2, prompt_bucket=8, min_decode_slots=1,
                          prefill_chunk_size=4)
    compile_generate(moe_model, 16, 4, params, engine=engine, return_routing=True)  # widths 3, 1; 4 steps
    before = compilation_totals()
    generate(moe_model, PROMPTS, params, engine=engine, return_routing=True)  # longest 11: 16
    assert (compilation_totals() - before).compiles == 0


def test_a_call_whose_rows_fit_the_slots_compiles_one_prefill_size_and_one_width(model):
    # 8 rows in 8 slots, every row ends within the first segment: one prefill of all 4 prompts, one
    # decode width, so compile_generate compiles 5 programs (the state, that prefill, the admission,
    # the segment, the output) and the call none. Bucket 24: shapes no other test compiles.
    params = SamplingParams(max_new_tokens=4, temperature=1.0, num_samples=2, seed=1)
    engine = EngineConfig(max_slots=8, page_size=4, steps_per_schedule=4, min_decode_slots=1,
                          prompt_bucket=24)
    before = compilation_totals()
    compile_generate(model, 24, 4, params, engine=engine)
    assert (compilation_totals() - before).compiles == 5
    before = compilation_totals()
    out = generate(model, PROMPTS, params, engine=engine)
    assert (compilation_totals() - before).compiles == 0
    np.testing.assert_array_equal(np.asarray(out.tokens), reference_generate(model, PROMPTS, params).tokens)


_CACHE_LAUNCH = """
import sys
from respo_jax.training.compilation import compilation_totals, configure_compilation_cache
configure_compilation_cache(sys.argv[2])
from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams
from respo_jax.sampling import compile_generate, generate
model = qwen3.init_model(qwen3.Qwen3Config.preset("tiny", tie_word_embeddings=True), 2)
params = SamplingParams(max_new_tokens=12, temperature=1.0, num_samples=8, seed=5)
engine = EngineConfig(max_slots=32, steps_per_schedule=4, prompt_bucket=16, min_decode_slots=16)
before = compilation_totals()
if sys.argv[1] == "ahead":
    compile_generate(model, 16, 4, params, engine=engine)
else:
    generate(model, %r, params, engine=engine)
done = compilation_totals() - before
print(done.compiles, done.cache_hits)
"""


@pytest.mark.slow
def test_a_call_in_another_process_reads_every_program_compiled_ahead_from_the_cache(tmp_path):
    # The race's second launch compiled a decode segment (~3 s) that the first had compiled ahead: with
    # tied embeddings the prefill and the decode segment returned the prompt logits, tokens and
    # log-probs named with the embedding's sharding, the admission with P() (equivalent on one device,
    # but another program for the cache), so a segment after an admission and one after a segment
    # were two programs. 32 rows in 32 slots, 12 tokens in segments of 4: one width, run after the
    # admission and after itself.
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    counts = {}
    for phase in ("ahead", "call"):
        result = subprocess.run([sys.executable, "-c", _CACHE_LAUNCH % (PROMPTS,), phase, str(tmp_path)],
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        counts[phase] = tuple(int(x) for x in result.stdout.split()[-2:])
    compiles, hits = counts["call"]
    assert compiles > 0 and hits == compiles, counts


def test_place_state_names_every_field_with_its_declared_sharding_and_moves_no_value(model):
    # Every engine program's state goes through place_state: arrays named otherwise (as programs return
    # them: P()) and abstract values (compile-ahead) come out with STATE_AXES's shardings, the arrays'
    # values untouched, absent fields (no routing) still absent.
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from respo_jax.sampling import engine_state

    cfg = model.config
    graphdef, model_state = nnx.split(model)
    layout = engine_state.Layout(slots=4, max_pages=3, num_pages=6, page_size=4, rows=4, max_new_tokens=5,
                                 logit_rows=2, num_prompts=2, bucket=8, routing=False)
    state = engine_state.init_state(graphdef, model_state, np.array([1, 2], np.uint32), layout=layout,
                                    pad_token_id=0)
    replicated = NamedSharding(cfg.mesh, PartitionSpec())
    renamed = jax.tree.map(lambda x: jax.device_put(x, replicated), state)
    declared = {name: cfg.rules.sharding(cfg.mesh, axes) for name, axes in engine_state.STATE_AXES.items()}
    assert renamed.k_pages.sharding != declared["k_pages"]  # the naming place_state mends
    placed = engine_state.place_state(renamed, cfg)
    abstract = engine_state.place_state(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state), cfg)
    for name, sharding in declared.items():
        value, shape = getattr(placed, name), getattr(abstract, name)
        if getattr(state, name) is None:
            assert value is None and shape is None, name
            continue
        assert value.sharding == sharding and shape.sharding == sharding, name
        assert shape.shape == value.shape and shape.dtype == value.dtype, name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(getattr(state, name)), err_msg=name)
