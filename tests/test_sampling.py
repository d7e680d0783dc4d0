"""The sampler against real references: transformers' greedy generate (dense and MoE, ragged prompts,
batched and one by one), teacher-forced forwards of the same model for log-probs and routing, and a
float64 NumPy implementation of temperature / top-k / top-p for truncated log-probs.

Most tests run the engine's static schedule (`EngineConfig(scheduler="static")`: every row its own
slot, one batch decoded to its end), some the continuous one (fewer slots than rows, pages smaller than
prompts); both against transformers, teacher-forced forwards, the float64 reference and a step-by-step
reference sampler (`decode_reference`); the continuous schedule in detail in test_engine.py."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest
import torch
import transformers

import jitted_model as jm
from decode_reference import reference_generate
from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams, compile_generate, generate
from respo_jax.training.compilation import compilation_totals

PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [100], [7, 7, 8, 9, 10, 11]]
NEW = 10
STATIC = EngineConfig(scheduler="static")
# The continuous engine with fewer slots than rows, pages smaller than prompts, segments ending mid-row.
CONTINUOUS = EngineConfig(max_slots=3, page_size=4, steps_per_schedule=3)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_model(moe: bool):
    # A larger initializer_range than the default makes logits well separated, so greedy choices
    # are not decided by float32 rounding differences between the two implementations.
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.3, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(1 if moe else 0)
    if moe:
        fields.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).eval()


def _checkpoint(moe: bool, tmp_path_factory):
    """(transformers model, our model loaded from its saved checkpoint)."""
    hf = _hf_model(moe)
    path = tmp_path_factory.mktemp("moe" if moe else "dense")
    hf.save_pretrained(path)
    return hf, qwen3.from_pretrained(path)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _checkpoint(False, tmp_path_factory)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _checkpoint(True, tmp_path_factory)


def _right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded `[rows, width]` ids and mask: causal attention never sees the trailing pads, so
    default positions (0, 1, ...) are the right ones for every real token."""
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask


def _hf_greedy(hf, prompts, eos: int | None) -> list[list[int]]:
    """transformers' greedy continuations (left-padded batch), cut after the first EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=0 if eos is None else eos)[:, width:].tolist()
    cut = []
    for row in out:
        cut.append(row[: row.index(eos) + 1] if eos in row else row)
    return cut


def _eos_hit_mid_sequence(hf) -> int:
    """A token that prompt 1's greedy continuation emits at step 3, so that row stops early."""
    return _hf_greedy(hf, [PROMPTS[1]], eos=None)[0][3]


def _check_row(out, row: int, want: list[int], pad: int):
    n = len(want)
    assert int(out.lengths[row]) == n
    np.testing.assert_array_equal(np.asarray(out.tokens[row, :n]), want)
    np.testing.assert_array_equal(np.asarray(out.tokens[row, n:]), pad)
    np.testing.assert_array_equal(np.asarray(out.logprobs[row]), 0.0)  # greedy: point mass


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_ragged_batch_equals_transformers_batched_and_alone(kind, request):
    hf, model = request.getfixturevalue(kind)
    eos = _eos_hit_mid_sequence(hf)
    want = _hf_greedy(hf, PROMPTS, eos)
    assert len(want[1]) <= 4 and any(len(w) == NEW for w in want)  # one row stops early, one runs out
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, eos_token_ids=(eos,))
    out = generate(model, PROMPTS, params, engine=STATIC)
    assert out.tokens.shape == (len(PROMPTS), NEW) and out.tokens.dtype == np.int32
    for row, continuation in enumerate(want):
        _check_row(out, row, continuation, pad=eos)
        # Batch independence: the prompt alone, in transformers and here, gives the same tokens.
        assert _hf_greedy(hf, [PROMPTS[row]], eos)[0] == continuation
        _check_row(generate(model, [PROMPTS[row]], params, engine=STATIC), 0, continuation, pad=eos)
    if kind == "dense":
        # num_samples=G repeats every prompt G times, prompt-major; the continuous engine (8 rows
        # through 3 slots) gives transformers' tokens too.
        grouped = generate(model, PROMPTS, dataclasses.replace(params, num_samples=2), engine=CONTINUOUS)
        for row, continuation in enumerate(want):
            _check_row(grouped, 2 * row, continuation, pad=eos)
            _check_row(grouped, 2 * row + 1, continuation, pad=eos)


def _reference_logprobs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64: temperature, top-k, then top-p on the top-k-renormalized distribution; [vocab] -> [vocab]."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")[: top_k or None]
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    kept = order[(np.cumsum(probs) - probs) < top_p]
    out = np.full(scaled.shape, -np.inf)
    z = scaled[kept].max()
    out[kept] = scaled[kept] - z - np.log(np.exp(scaled[kept] - z).sum())
    return out


@pytest.mark.parametrize(
    "kind,temperature,top_k,top_p,engine",
    [("dense", 1.0, 0, 1.0, STATIC), ("dense", 0.7, 20, 0.8, STATIC), ("moe", 1.3, 0, 0.6, STATIC),
     ("dense", 0.7, 20, 0.8, CONTINUOUS)],
    ids=["dense-plain", "dense-truncated", "moe-truncated", "dense-truncated-continuous"],
)
def test_sampled_logprobs_equal_teacher_forced_forward(kind, temperature, top_k, top_p, engine, request):
    _, model = request.getfixturevalue(kind)
    params = SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, seed=3,
                            eos_token_ids=(2,), num_samples=2)
    out = generate(model, PROMPTS, params, engine=engine)
    tokens, logprobs, lengths = (np.asarray(a) for a in (out.tokens, out.logprobs, out.lengths))
    assert any((tokens[2 * i] != tokens[2 * i + 1]).any() for i in range(len(PROMPTS)))  # samples differ
    prompts = [PROMPTS[row // 2] for row in range(len(tokens))]
    rows = [p + tokens[row, : lengths[row]].tolist() for row, p in enumerate(prompts)]
    ids, mask = _right_padded(rows)
    if (temperature, top_k, top_p) == (1.0, 0, 1.0):
        # No processing: the model's own teacher-forced log-softmax (model.token_logprobs).
        teacher = np.asarray(jm.token_logprobs(model, ids[:, :-1], ids[:, 1:], attention_mask=mask[:, :-1]))
    else:
        logits = np.asarray(jm.logits(model, ids, attention_mask=mask))
    for row, prompt in enumerate(prompts):
        n = int(lengths[row])
        steps = range(len(prompt) - 1, len(prompt) - 1 + n)  # logits position predicting each new token
        if (temperature, top_k, top_p) == (1.0, 0, 1.0):
            want = teacher[row, len(prompt) - 1 : len(prompt) - 1 + n]
        else:
            ref = [_reference_logprobs(logits[row, t], temperature, top_k, top_p) for t in steps]
            want = np.array([r[tok] for r, tok in zip(ref, tokens[row, :n])])
            assert np.all(np.isfinite(want))  # every sampled token is inside the kept set
        np.testing.assert_allclose(logprobs[row, :n], want, atol=1e-3, rtol=0)
        np.testing.assert_array_equal(logprobs[row, n:], 0.0)
        np.testing.assert_array_equal(tokens[row, n:], 2)
        assert n == params.max_new_tokens or tokens[row, n - 1] == 2


MOE_PARAMS = SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.9, seed=11, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def moe_sampled(moe):
    return generate(moe[1], PROMPTS, MOE_PARAMS, return_routing=True, engine=STATIC)


def _teacher_forced_routing(model, rows: list[list[int]]) -> np.ndarray:
    ids, mask = _right_padded(rows)
    return np.asarray(jm.forward(model, ids, attention_mask=mask, return_routing=True).routing)


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_same_seed_same_samples_other_seed_other_samples_chunking_changes_nothing(moe, moe_sampled):
    model, first = moe[1], moe_sampled
    again = generate(model, PROMPTS, MOE_PARAMS, return_routing=True, engine=STATIC)
    other = generate(model, PROMPTS, dataclasses.replace(MOE_PARAMS, seed=12), return_routing=True,
                     engine=STATIC)
    high = generate(model, PROMPTS, dataclasses.replace(MOE_PARAMS, seed=11 + 2**32), return_routing=True,
                    engine=STATIC)
    chunked = generate(model, PROMPTS, MOE_PARAMS, return_routing=True,
                       engine=EngineConfig(prompt_bucket=8, prefill_chunk_size=5, max_slots=3, page_size=4,
                                           steps_per_schedule=4))
    for field in ("tokens", "lengths", "logprobs", "routing"):
        np.testing.assert_array_equal(np.asarray(getattr(first, field)), np.asarray(getattr(again, field)))
    for field in ("tokens", "lengths", "routing"):
        np.testing.assert_array_equal(np.asarray(getattr(first, field)), np.asarray(getattr(chunked, field)))
    np.testing.assert_allclose(np.asarray(first.logprobs), np.asarray(chunked.logprobs), atol=1e-5)
    assert not np.array_equal(np.asarray(first.tokens), np.asarray(other.tokens))
    assert not np.array_equal(np.asarray(first.tokens), np.asarray(high.tokens))  # all 64 seed bits count


@pytest.mark.slow
def test_a_batch_generated_in_static_batches_equals_one_batch(moe, moe_sampled):
    # 4 prompts x 2 samples = 8 rows in static batches of 3 slots (3 + 3 + 2): a row's keys depend on its
    # index in the whole batch, so tokens, log-probs and routing are those of one batch.
    model = moe[1]
    params = dataclasses.replace(MOE_PARAMS, num_samples=2)
    whole = generate(model, PROMPTS, params, return_routing=True, engine=STATIC)
    chunked = generate(model, PROMPTS, params, return_routing=True,
                       engine=dataclasses.replace(STATIC, max_slots=3))
    for field in ("tokens", "lengths", "routing", "prompt_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(chunked, field)), np.asarray(getattr(whole, field)))
    real = np.broadcast_to(np.asarray(whole.prompt_mask)[None, :, :, None] > 0, whole.prompt_routing.shape)
    np.testing.assert_array_equal(np.asarray(chunked.prompt_routing)[real],  # pads: any expert
                                  np.asarray(whole.prompt_routing)[real])
    # (log-probs to round-off: the batch size changes the matmuls' summation order)
    np.testing.assert_allclose(np.asarray(chunked.logprobs), np.asarray(whole.logprobs), atol=1e-5)
    assert chunked.tokens.shape == (8, MOE_PARAMS.max_new_tokens)


def test_row_ids_make_a_rows_samples_independent_of_its_position(dense):
    # 4 prompts x 2 samples seeded by ids of their own; the same 8 rows shuffled, as single samples, in
    # static batches of 3 rows (3 + 3 + 2) with their ids: each row gets its sample back.
    model = dense[1]
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=5, eos_token_ids=(2,),
                            num_samples=2)
    ids = np.array([7, 2**32 - 1, 40_000, 3, 0, 123_456_789, 11, 12])
    whole = generate(model, PROMPTS, params, row_ids=ids, engine=STATIC)
    order = np.array([5, 0, 7, 2, 6, 1, 3, 4])
    rows = [PROMPTS[i // 2] for i in order]
    moved = generate(model, rows, dataclasses.replace(params, num_samples=1), row_ids=ids[order],
                     engine=dataclasses.replace(STATIC, max_slots=3))
    np.testing.assert_array_equal(np.asarray(moved.tokens), np.asarray(whole.tokens)[order])
    np.testing.assert_array_equal(np.asarray(moved.lengths), np.asarray(whole.lengths)[order])
    np.testing.assert_allclose(np.asarray(moved.logprobs), np.asarray(whole.logprobs)[order], atol=1e-5)
    # Without ids a row is seeded by its index: the default is row_ids = 0..rows-1, and other ids give
    # other samples.
    default = generate(model, PROMPTS, params, engine=STATIC)
    by_index = generate(model, PROMPTS, params, row_ids=np.arange(8), engine=STATIC)
    np.testing.assert_array_equal(np.asarray(default.tokens), np.asarray(by_index.tokens))
    assert not np.array_equal(np.asarray(default.tokens), np.asarray(whole.tokens))
    for engine in (STATIC, CONTINUOUS):  # refused before either engine runs
        with pytest.raises(ValueError, match=r"row_ids has shape \(4,\); expected \(8,\)"):
            generate(model, PROMPTS, params, row_ids=[0, 1, 2, 3], engine=engine)
        with pytest.raises(ValueError, match=r"in \[0, 2\*\*32\)"):
            generate(model, PROMPTS, params, row_ids=[-1] + [0] * 7, engine=engine)


def test_compile_generate_compiles_every_program_of_a_bucket_ahead(moe):
    # The static schedule with routing capture: every program generate runs for a prompt bucket is
    # compiled ahead, so generating at that bucket compiles nothing (the continuous schedule's widths and
    # prefill sizes: test_engine.py).
    model, params = moe[1], dataclasses.replace(MOE_PARAMS, max_new_tokens=6)
    engine = EngineConfig(scheduler="static", prompt_bucket=8, page_size=4)
    compile_generate(model, 32, 2, params, return_routing=True, engine=engine)
    before = compilation_totals()
    generate(model, [p + [3] * 10 for p in PROMPTS[:2]], params, return_routing=True, engine=engine)  # 21: 32
    assert (compilation_totals() - before).compiles == 0
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        compile_generate(model, 0, 1, params, engine=engine)


def test_decoding_stops_when_every_row_is_done(dense, monkeypatch):
    # Count the static batch's decode steps on the device (each feeds one token per slot through the
    # model's forward): with every row done after its first EOS or at its own budget, the loop runs
    # until the longest response ends, not for max_new_tokens. (New params: the segment is traced anew.)
    from respo_jax.sampling import model_step

    steps = []
    decode_step = model_step._decode_step

    def counting_step(*args, **kwargs):
        jax.debug.callback(lambda: steps.append(1))
        return decode_step(*args, **kwargs)

    monkeypatch.setattr(model_step, "_decode_step", counting_step)
    hf, model = dense
    eos = _hf_greedy(hf, [PROMPTS[0]], eos=None)[0][2]
    params = SamplingParams(max_new_tokens=200, temperature=0.0, eos_token_ids=(eos,))
    out = generate(model, [PROMPTS[0], PROMPTS[0]], params, engine=STATIC)
    jax.effects_barrier()
    # the prompt's logits give the first token, each decode step the next; none after the last row's EOS
    assert int(np.asarray(out.lengths).max()) == 3 and len(steps) == 2
    steps.clear()
    capped = generate(model, [PROMPTS[0], PROMPTS[0]], params, engine=STATIC, row_max_new_tokens=[1, 2])
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(capped.lengths), [1, 2])
    first = np.asarray(out.tokens)[0, :2]  # both rows have the same prompt: the same greedy tokens
    np.testing.assert_array_equal(np.asarray(capped.tokens)[:, :2], [[first[0], eos], first])
    assert len(steps) == 1


def test_routing_equals_teacher_forced_routing(moe, moe_sampled):
    model, out = moe[1], moe_sampled
    cfg = model.config
    assert out.routing.shape == (cfg.num_moe_layers, len(PROMPTS), 9, cfg.num_experts_per_tok)
    lengths = np.asarray(out.lengths)
    rows = [p + np.asarray(out.tokens[r, : lengths[r]]).tolist() for r, p in enumerate(PROMPTS)]
    routing = _teacher_forced_routing(model, rows)
    width = out.prompt_mask.shape[1]
    for row, prompt in enumerate(PROMPTS):
        n, m = int(lengths[row]), len(prompt)
        np.testing.assert_array_equal(np.asarray(out.routing[:, row, :n]), routing[:, row, m : m + n])
        np.testing.assert_array_equal(np.asarray(out.routing[:, row, n:]), 0)
        np.testing.assert_array_equal(np.asarray(out.prompt_mask[row]), [0] * (width - m) + [1] * m)
        np.testing.assert_array_equal(np.asarray(out.prompt_routing[:, row, width - m :]),
                                      routing[:, row, :m])


def test_row_budgets_keep_the_tokens_and_routing_of_the_tokens_kept(moe, moe_sampled):
    # A row cut at its budget is its uncut sample's prefix, with that prefix's routing (the last kept
    # token's included, fed after the row is done) and zeros after; the prompts' routing is unchanged.
    model, whole = moe[1], moe_sampled
    budgets = np.array([1, 4, MOE_PARAMS.max_new_tokens, 2])
    out = generate(model, PROMPTS, MOE_PARAMS, return_routing=True, engine=STATIC, row_max_new_tokens=budgets)
    kept = np.minimum(np.asarray(whole.lengths), budgets)
    assert (kept < np.asarray(whole.lengths)).sum() >= 2  # budgets cut rows
    np.testing.assert_array_equal(np.asarray(out.lengths), kept)
    np.testing.assert_array_equal(np.asarray(out.prompt_routing), np.asarray(whole.prompt_routing))
    for row, n in enumerate(kept):
        np.testing.assert_array_equal(np.asarray(out.tokens[row, :n]), np.asarray(whole.tokens[row, :n]))
        np.testing.assert_array_equal(np.asarray(out.routing[:, row, :n]), np.asarray(whole.routing[:, row, :n]))
        np.testing.assert_array_equal(np.asarray(out.routing[:, row, n:]), 0)


def test_routing_when_every_row_stops_in_an_early_decode_segment(moe):
    # The EOS token's routing needs one forward after the row is done; here the row ends in the first of
    # several decode segments (the capture runs at that segment's end), and must equal teacher forcing.
    hf, model = moe
    eos = _hf_greedy(hf, [PROMPTS[0]], eos=None)[0][2]
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, eos_token_ids=(eos,))
    out = generate(model, [PROMPTS[0]], params, return_routing=True,
                   engine=dataclasses.replace(CONTINUOUS, steps_per_schedule=4))
    n = int(out.lengths[0])
    assert n <= 3
    routing = _teacher_forced_routing(model, [PROMPTS[0] + np.asarray(out.tokens[0, :n]).tolist()])
    np.testing.assert_array_equal(np.asarray(out.routing[:, 0, :n]), routing[:, 0, len(PROMPTS[0]) :])


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
@pytest.mark.parametrize(
    "prompts,params,kwargs,match",
    [
        ([], dict(max_new_tokens=4), {}, "prompts is empty"),
        ([[1, 2], []], dict(max_new_tokens=4), {}, "prompt 1 is empty"),
        ([[1, 500]], dict(max_new_tokens=4), {}, r"expected \[0, 128\)"),
        ([[1] * 200], dict(max_new_tokens=100), {}, "max_position_embeddings"),
        ([[1]], dict(max_new_tokens=2), dict(return_routing=True), "MoE"),
        ([[1], [2]], dict(max_new_tokens=4, num_samples=2), dict(row_max_new_tokens=[1, 2, 3]),
         r"row_max_new_tokens has shape \(3,\) \(int64\); expected \(4,\) integers"),
        ([[1], [2]], dict(max_new_tokens=4), dict(row_max_new_tokens=[1.0, 2.0]),
         r"expected \(2,\) integers"),
        ([[1], [2]], dict(max_new_tokens=4), dict(row_max_new_tokens=[0, 4]),
         r"must lie in \[1, max_new_tokens=4\]; got \[0, 4\]"),
        ([[1], [2]], dict(max_new_tokens=4), dict(row_max_new_tokens=[4, 5]),
         r"must lie in \[1, max_new_tokens=4\]; got \[4, 5\]"),
    ],
)
def test_bad_generate_inputs_raise(dense, prompts, params, kwargs, match, scheduler):
    # refused before anything compiles, whichever engine was asked for
    with pytest.raises(ValueError, match=match):
        generate(dense[1], prompts, SamplingParams(**params), engine=EngineConfig(scheduler=scheduler),
                 **kwargs)


def test_row_budgets_cut_rows_and_both_schedules_draw_the_reference_samples(dense):
    # Reference: the step-by-step sampler's samples without EOS and budgets (a row's draws depend on
    # neither). With an EOS id that some rows sample and budgets that cut others first, each row is that
    # sample up to its first EOS or its budget, whichever comes first, in either schedule.
    model = dense[1]
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=21, num_samples=2)
    full = reference_generate(model, PROMPTS, params)
    full_tokens, full_logprobs = full.tokens, full.logprobs
    eos = int(full_tokens[3, 5])
    params = dataclasses.replace(params, eos_token_ids=(eos,))
    ends = np.array([np.flatnonzero(row == eos)[0] + 1 if (row == eos).any() else NEW for row in full_tokens])
    budgets = np.array([1, NEW, 3, NEW, 7, 2, NEW, 4])
    want = np.minimum(ends, budgets)
    assert (ends < budgets).any() and (budgets < ends).any()  # EOS stops some rows, budgets others
    static = generate(model, PROMPTS, params, engine=STATIC, row_max_new_tokens=budgets)
    continuous = generate(model, PROMPTS, params, engine=CONTINUOUS, row_max_new_tokens=budgets)
    for out in (static, continuous):
        tokens, lengths, logprobs = (np.asarray(a) for a in (out.tokens, out.lengths, out.logprobs))
        np.testing.assert_array_equal(lengths, want)
        for row, n in enumerate(want):
            np.testing.assert_array_equal(tokens[row, :n], full_tokens[row, :n])
            np.testing.assert_array_equal(tokens[row, n:], eos)  # pad id: the first EOS id
            np.testing.assert_allclose(logprobs[row, :n], full_logprobs[row, :n], atol=1e-5)
            np.testing.assert_array_equal(logprobs[row, n:], 0.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p"),
        (dict(max_new_tokens=4, top_p=1.01), "top_p"),
        (dict(max_new_tokens=4, temperature=-0.5), "temperature"),
        (dict(max_new_tokens=4, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=4, top_k=-1), "top_k"),
        (dict(max_new_tokens=4, num_samples=0), "num_samples"),
        (dict(max_new_tokens=4, eos_token_ids=(1, -2)), "eos_token_ids"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens=4, seed=-1), "seed"),
        (dict(max_new_tokens=4, seed=2**64), "seed"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_config_raises():
    with pytest.raises(ValueError, match="scheduler must be one of continuous, static; got 'paged'"):
        EngineConfig(scheduler="paged")
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        EngineConfig(prefill_chunk_size=0)
