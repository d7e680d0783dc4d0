"""The continuous-batching engine against the static sampler (`generate`, itself tested against
transformers in test_sampling.py) and a teacher-forced forward: greedy and sampled tokens equal for one
seed whatever max_slots / page_size / steps_per_schedule / pool size / decode widths, log-probs those of the
distribution sampled from, per-row budgets and ignore_eos honoured; one prefill and one admission call per
schedule; MoE tokens and routing equal the static sampler's; compile_continuous compiles every program."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jitted_model as jm
from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams, generate, paged_decode
from respo_jax.sampling.paged_decode import compile_continuous, generate_continuous
from respo_jax.training.compilation import compilation_totals

PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [100], [7, 7, 8, 9, 10, 11]]
NEW = 12
# slots fewer than rows, pages smaller than prompts, segments that end mid-row
ENGINE = EngineConfig(max_slots=3, page_size=4, steps_per_schedule=5)
STATIC = EngineConfig(scheduler="static")  # the reference: the static sampler


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.3: well-separated logits, so no greedy choice hinges on float rounding
    cfg = qwen3.Qwen3Config.preset("tiny", initializer_range=0.3, tie_word_embeddings=False)
    return qwen3.init_model(cfg, 1)


def _with_eos(full, eos: int, pad: int) -> dict:
    """The static sampler's EOS rule applied in NumPy to rows sampled without EOS (a row's draws do not
    depend on its EOS): cut each row after its first `eos`, pad after it."""
    tokens, logprobs = np.asarray(full.tokens).copy(), np.asarray(full.logprobs).copy()
    lengths = np.full(len(tokens), tokens.shape[1])
    for r, row in enumerate(tokens):
        hits = np.flatnonzero(row == eos)
        if hits.size:
            lengths[r] = hits[0] + 1
            tokens[r, lengths[r]:], logprobs[r, lengths[r]:] = pad, 0.0
    return dict(tokens=tokens, lengths=lengths, logprobs=logprobs)


def _assert_same(got, want: dict, logprob_tol=1e-5):
    np.testing.assert_array_equal(np.asarray(got.lengths), want["lengths"])
    np.testing.assert_array_equal(np.asarray(got.tokens), want["tokens"])
    np.testing.assert_allclose(np.asarray(got.logprobs), want["logprobs"], atol=logprob_tol)


def _reference(model, params):
    """(params with an EOS id that the static sampler emits at step 4 of row 1, its rows without EOS,
    the same rows with it)."""
    full = generate(model, PROMPTS, params, engine=STATIC)
    eos = int(np.asarray(full.tokens)[1, 4])
    want = _with_eos(full, eos, pad=eos)
    assert want["lengths"].min() < NEW  # EOS retires some rows early
    return dataclasses.replace(params, eos_token_ids=(eos,)), full, want


def test_greedy_equals_the_static_sampler(model):
    params, _, want = _reference(model, SamplingParams(max_new_tokens=NEW, temperature=0.0, num_samples=2))
    _assert_same(generate_continuous(model, PROMPTS, params, engine=ENGINE), want)
    # the model's other layer loop (stacked weights, scanned): same values, same samples
    scanned = qwen3.init_model(model.config.replace(scan_layers=True), 1)
    assert scanned.config.scan_layers and not model.config.scan_layers
    _assert_same(generate_continuous(scanned, PROMPTS, params, engine=ENGINE), want)


@pytest.fixture(scope="module")
def sampled(model):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, num_samples=3, seed=2**33 + 7)
    return _reference(model, params)


def test_sampled_tokens_equal_the_static_samplers(model, sampled):
    params, _, want = sampled
    _assert_same(generate_continuous(model, PROMPTS, params, engine=ENGINE), want)


def test_row_ids_and_prefill_chunks_keep_the_samples(model, sampled):
    params, _, _ = sampled
    ids = np.arange(12, dtype=np.uint32)[::-1] * 1000 + 5  # a row's draws follow its id, not its index
    full = generate(model, PROMPTS, dataclasses.replace(params, eos_token_ids=()), row_ids=ids, engine=STATIC)
    assert not np.array_equal(np.asarray(full.tokens), np.asarray(sampled[1].tokens))
    engine = dataclasses.replace(ENGINE, prefill_chunk_size=4)
    got = generate_continuous(model, PROMPTS, params, engine=engine, row_ids=ids)
    _assert_same(got, _with_eos(full, params.eos_token_ids[0], pad=params.eos_token_ids[0]))


def test_reported_logprobs_equal_a_teacher_forced_forward(model, sampled):
    params, _, _ = sampled
    out = generate_continuous(model, PROMPTS, params, engine=ENGINE)
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
# the prompt's partial page): admission waits for pages although slots are free. The same samples as
# the static sampler here and with ENGINE above: they depend on neither max_slots, page_size,
# steps_per_schedule nor the pool.
WAITING = EngineConfig(max_slots=6, page_size=2, steps_per_schedule=1, num_pages=26)


def test_row_budgets_and_ignore_eos(model, sampled):
    params, full, _ = sampled
    params = dataclasses.replace(params, ignore_eos=True)
    eos = params.eos_token_ids[0]
    full_tokens = np.asarray(full.tokens)  # sampled without EOS ids
    assert (full_tokens[:, :-1] == eos).any()  # EOS is sampled, so ignoring it matters
    _assert_same(generate(model, PROMPTS, params, engine=STATIC), _with_eos(full, -1, pad=eos))  # static too
    budgets = np.random.default_rng(0).integers(1, NEW + 1, len(PROMPTS) * params.num_samples)
    budgets[0] = 1
    out = generate_continuous(model, PROMPTS, params, engine=WAITING, row_max_new_tokens=budgets)
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    np.testing.assert_array_equal(np.asarray(out.lengths), budgets)
    for r, budget in enumerate(budgets):  # a row's draws do not depend on its own or others' budgets
        np.testing.assert_array_equal(tokens[r, :budget], full_tokens[r, :budget])
        np.testing.assert_allclose(logprobs[r, :budget], np.asarray(full.logprobs)[r, :budget], atol=1e-5)
        assert (tokens[r, budget:] == params.pad_token_id).all() and (logprobs[r, budget:] == 0).all()


def test_engine_input_errors(model, sampled):
    params, _, _ = sampled
    with pytest.raises(ValueError, match=r"page pool \(3 pages of 4 tokens\) is too small for row 0"):
        generate_continuous(model, PROMPTS, params, engine=EngineConfig(page_size=4, num_pages=3))
    with pytest.raises(ValueError, match="paged_attention_impl='pallas_gpu' runs on gpu devices; the engine "
                                         "runs on cpu devices"):
        generate_continuous(model, PROMPTS, params, engine=EngineConfig(paged_attention_impl="pallas_gpu"))
    with pytest.raises(ValueError, match=r"row_max_new_tokens must lie in \[1, max_new_tokens=12\]"):
        generate_continuous(model, PROMPTS, params, row_max_new_tokens=[NEW + 1] * 12)
    with pytest.raises(ValueError, match=r"return_routing=True needs an MoE model"):
        generate_continuous(model, PROMPTS, params, return_routing=True)
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        compile_continuous(model, 0, 1, params)


def test_one_prefill_and_one_admission_call_per_schedule(model, sampled, monkeypatch):
    # Enough slots for every row: the first schedule starts all 4 prompts in one prefill of a [4, bucket]
    # batch and admits all 12 rows in one call; later schedules only decode.
    params, _, want = sampled
    calls = {name: [] for name in ("prefill_prompts", "admit_rows", "decode_segment")}

    def logged(program, log):
        def call(*args, **kwargs):
            log.append(args)
            return program(*args, **kwargs)
        return call

    for name, log in calls.items():
        monkeypatch.setattr(paged_decode, name, logged(getattr(paged_decode, name), log))
    engine = EngineConfig(max_slots=12, page_size=4, steps_per_schedule=3)
    _assert_same(generate_continuous(model, PROMPTS, params, engine=engine), want)
    assert len(calls["prefill_prompts"]) == 1 and len(calls["admit_rows"]) == 1
    input_ids = calls["prefill_prompts"][0][3]
    assert input_ids.shape == (4, 16)  # the 4 prompts, left-padded to the 11-token prompt's bucket
    assert len(calls["decode_segment"]) <= -(-NEW // 3)  # the longest row's segments at most


def test_the_tail_decodes_only_the_occupied_slots_width(model, sampled, monkeypatch):
    # min_decode_slots=1: 6 slots decode at widths 6, 3 or 1 (the occupied slots and the lowest free
    # ones); rows of random budgets leave a tail of few live rows. Same samples as every slot decoding.
    params, _, want = sampled
    widths = []

    def logged(*args, **kwargs):
        widths.append(int(args[4].shape[0]))  # run_slots
        return program(*args, **kwargs)

    program = paged_decode.decode_segment
    monkeypatch.setattr(paged_decode, "decode_segment", logged)
    engine = EngineConfig(max_slots=6, page_size=4, steps_per_schedule=2, min_decode_slots=1)
    _assert_same(generate_continuous(model, PROMPTS, params, engine=engine), want)
    assert set(widths) <= {1, 3, 6}
    budgets = np.full(12, 2)
    budgets[[4, 9]] = NEW  # two long rows: once the others are done, segments decode 3 slots, then 1
    ignoring = dataclasses.replace(params, ignore_eos=True)
    widths.clear()
    out = generate_continuous(model, PROMPTS, ignoring, engine=engine, row_max_new_tokens=budgets)
    assert widths[:2] == [6, 6] and 3 in widths and widths[-1] == 1  # rows 4 and 9, then the later one
    wide = generate_continuous(model, PROMPTS, ignoring, row_max_new_tokens=budgets,
                               engine=dataclasses.replace(engine, min_decode_slots=6))
    np.testing.assert_array_equal(np.asarray(out.lengths), budgets)
    _assert_same(out, dict(tokens=np.asarray(wide.tokens), lengths=budgets,
                           logprobs=np.asarray(wide.logprobs)))


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
        monkeypatch.setattr(paged_decode, name, logged(name, getattr(paged_decode, name)))
    engine = dataclasses.replace(ENGINE, prefill_chunk_size=2)
    _assert_same(generate_continuous(model, PROMPTS, params, engine=engine), want)
    last = 7  # steps [0, 2) ... [12, 14), [14, 15) + the last token
    steps = [step for name, step in events if name == "prefill_prompts"]
    assert {2, 3, 4, 5, 6, 7} <= set(steps) and max(steps) == last  # the 11-token prompt: steps 2 to 7
    between = [events[i + 1][0] for i, (name, step) in enumerate(events[:-1])
               if name == "prefill_prompts" and step < last]
    assert "decode_segment" in between  # decoding went on during a long prefill


@pytest.fixture(scope="module")
def moe_model():
    # initializer_range 0.3: well-separated logits and router scores (no top-k at a near-tie)
    return qwen3.init_model(qwen3.Qwen3Config.preset("tiny-moe", initializer_range=0.3), 1)


def _with_eos_routing(full, eos: int) -> dict:
    """`_with_eos` plus the routing of the static sampler's rows cut at the first `eos` (0 after it)."""
    want = _with_eos(full, eos, pad=eos)
    routing = np.asarray(full.routing).copy()
    for r, n in enumerate(want["lengths"]):
        routing[:, r, n:] = 0
    return dict(want, routing=routing)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_moe_tokens_and_routing_equal_the_static_samplers(moe_model, temperature):
    # The routed experts of every prompt and generated token, in generate's format: rows that end at an
    # EOS mid-segment, at a segment's end and at the budget all record their last token's routing.
    params = SamplingParams(max_new_tokens=NEW, temperature=temperature, num_samples=2, seed=5)
    full = generate(moe_model, PROMPTS, params, return_routing=True, engine=STATIC)
    eos = int(np.asarray(full.tokens)[1, 4])
    want = _with_eos_routing(full, eos)
    assert want["lengths"].min() < NEW < want["lengths"].max() + 1
    params = dataclasses.replace(params, eos_token_ids=(eos,))
    # segments of 3 or 1 slots (capture in both); sampled: prefills spread over schedules (the routing of
    # the prompt tokens written step by step)
    narrow = dataclasses.replace(ENGINE, min_decode_slots=1, prefill_chunk_size=2 if temperature else None)
    got = generate_continuous(moe_model, PROMPTS, params, engine=narrow, return_routing=True)
    _assert_same(got, want, logprob_tol=2e-5)  # pieces of 2 prompt tokens: sums in another order
    np.testing.assert_array_equal(np.asarray(got.routing), want["routing"])
    mask = np.asarray(full.prompt_mask)
    np.testing.assert_array_equal(np.asarray(got.prompt_mask), mask)
    assert got.prompt_routing.shape == full.prompt_routing.shape
    real = np.broadcast_to(mask[None, :, :, None] > 0, full.prompt_routing.shape)  # pads: any expert
    np.testing.assert_array_equal(np.asarray(got.prompt_routing)[real], np.asarray(full.prompt_routing)[real])


def test_compile_continuous_compiles_every_program_ahead(moe_model):
    # Routing capture, a pool that makes admission wait, prefills of 1 and 2 prompts: every program of a
    # call with these shapes is compiled ahead, so the call compiles nothing.
    params = SamplingParams(max_new_tokens=6, temperature=1.0, num_samples=2, seed=3, eos_token_ids=(2,))
    engine = EngineConfig(max_slots=3, page_size=4, steps_per_schedule=2, prompt_bucket=8, min_decode_slots=1,
                          prefill_chunk_size=4)
    compile_continuous(moe_model, 16, 4, params, engine=engine, return_routing=True)  # widths 3, 1; 4 steps
    before = compilation_totals()
    generate_continuous(moe_model, PROMPTS, params, engine=engine, return_routing=True)  # longest 11: 16
    assert (compilation_totals() - before).compiles == 0


def test_a_call_whose_rows_fit_the_slots_compiles_one_prefill_size_and_one_width(model):
    # 8 rows in 8 slots, every row ends within the first segment: one prefill of all 4 prompts, one
    # decode width, so compile_continuous compiles 5 programs (the state, that prefill, the admission,
    # the segment, the output) and the call none. Bucket 24: shapes no other test compiles.
    params = SamplingParams(max_new_tokens=4, temperature=1.0, num_samples=2, seed=1)
    engine = EngineConfig(max_slots=8, page_size=4, steps_per_schedule=4, min_decode_slots=1,
                          prompt_bucket=24)
    before = compilation_totals()
    compile_continuous(model, 24, 4, params, engine=engine)
    assert (compilation_totals() - before).compiles == 5
    before = compilation_totals()
    out = generate_continuous(model, PROMPTS, params, engine=engine)
    assert (compilation_totals() - before).compiles == 0
    want = generate(model, PROMPTS, params, engine=STATIC)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))




_CACHE_LAUNCH = """
import sys
from respo_jax.training.compilation import compilation_totals, configure_compilation_cache
configure_compilation_cache(sys.argv[2])
from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams
from respo_jax.sampling.paged_decode import compile_continuous, generate_continuous
model = qwen3.init_model(qwen3.Qwen3Config.preset("tiny", tie_word_embeddings=True), 2)
params = SamplingParams(max_new_tokens=12, temperature=1.0, num_samples=8, seed=5)
engine = EngineConfig(max_slots=32, steps_per_schedule=4, prompt_bucket=16, min_decode_slots=16)
before = compilation_totals()
if sys.argv[1] == "ahead":
    compile_continuous(model, 16, 4, params, engine=engine)
else:
    generate_continuous(model, %r, params, engine=engine)
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
