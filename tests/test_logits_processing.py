"""The processed log-probs are those of the distribution sampled from (float64 NumPy and HF references)."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from respo_jax.sampling import logits_processing as lp


def _reference_logprobs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Float64 NumPy: temperature, then top-k, then top-p on the renormalized top-k distribution."""
    scaled = logits.astype(np.float64) / temperature
    out = np.full_like(scaled, -np.inf)
    for row, values in enumerate(scaled):
        order = np.argsort(-values, kind="stable")
        kept = order if top_k == 0 else order[:top_k]
        probs = np.exp(values[kept] - values[kept].max())
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        kept = kept[mass_before < top_p]
        kept_logits = values[kept] - values[kept].max()
        out[row, kept] = kept_logits - np.log(np.exp(kept_logits).sum())
    return out


def _hf_kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    scores = torch.from_numpy(logits.astype(np.float32))
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    for warper in warpers:
        scores = warper(None, scores)
    return torch.isfinite(scores).numpy()


def _well_separated_logits(seed: int, batch: int = 4, vocab: int = 50) -> np.ndarray:
    """Random logits whose nucleus boundaries are not within float32 rounding of top_p."""
    return np.random.default_rng(seed).normal(0.0, 2.0, size=(batch, vocab)).astype(np.float32)


SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 5, 1.0),
    (1.0, 0, 0.7),
    (1.3, 0, 0.9),
    (0.8, 10, 0.6),
    (1.0, 3, 0.95),
    (2.0, 49, 0.3),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_logprobs_match_float64_reference_and_hf_kept_set(temperature, top_k, top_p):
    logits = _well_separated_logits(seed=int(temperature * 10 + top_k + top_p * 100))
    got = np.asarray(lp.sampling_logprobs(jnp.asarray(logits), temperature, top_k, top_p))
    want = _reference_logprobs(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(np.isfinite(got), _hf_kept(logits, temperature, top_k, top_p))
    kept = np.isfinite(want)
    np.testing.assert_allclose(got[kept], want[kept], atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_entropy_is_float64_entropy_of_the_sampled_distribution(temperature, top_k, top_p):
    """`sampling_entropy` is -sum p log p of the processed (scaled, truncated, renormalized) distribution,
    computed here from the float64 reference log-probs; greedy is a point mass (0)."""
    logits = _well_separated_logits(seed=int(temperature * 10 + top_k + top_p * 100) + 7)
    got = np.asarray(lp.sampling_entropy(jnp.asarray(logits), temperature, top_k, top_p))
    want = _reference_logprobs(logits, temperature, top_k, top_p)
    want = -(np.exp(want) * np.where(np.isfinite(want), want, 0.0)).sum(-1)  # 0 log 0 = 0
    np.testing.assert_allclose(got, want, atol=5e-6, rtol=1e-5)
    assert np.all(np.asarray(lp.sampling_entropy(jnp.asarray(logits), 0.0)) == 0.0)
    keys = jax.random.split(jax.random.key(3), logits.shape[0])
    for vocab, block in ((50, 8), (53, 8)):  # blocks of 5; 6 of 8 and a tail of 5 (53 is prime)
        assert lp.sampling_blocks(vocab, block) == ((5, 0) if vocab == 50 else (8, 5))
        logits = _well_separated_logits(seed=vocab + top_k, vocab=vocab)
        weights = lp.truncate(lp.scale_by_temperature(jnp.asarray(logits), temperature), top_k, top_p)
        tokens, logprobs = lp.sample_from_logprobs(keys, weights, block)
        drawn = lp.sample_from_logprobs(keys, weights, block, return_entropy=True)
        np.testing.assert_array_equal(drawn[0], tokens)  # the same draw
        np.testing.assert_array_equal(drawn[1], logprobs)
        want = _reference_logprobs(logits, temperature, top_k, top_p)
        want = -(np.exp(want) * np.where(np.isfinite(want), want, 0.0)).sum(-1)  # 0 log 0 = 0
        np.testing.assert_allclose(drawn[2], want, atol=5e-6, rtol=1e-5)


def test_entropy_of_a_large_batch_in_row_chunks_is_the_whole_batch_draw():
    """Past `ENTROPY_ROWS` rows the draw with entropy runs in chunks of rows (48 rows: 2 of 24; 37, prime:
    at once): the same tokens and log-probs as without entropy, the float64 entropy."""
    for rows in (48, 37):
        logits = _well_separated_logits(seed=rows, batch=rows, vocab=53)
        keys = jax.random.split(jax.random.key(rows), rows)
        tokens, logprobs = lp.sample(keys, jnp.asarray(logits), 0.9)
        drawn = lp.sample(keys, jnp.asarray(logits), 0.9, return_entropy=True)
        np.testing.assert_array_equal(drawn[0], tokens)
        np.testing.assert_allclose(drawn[1], logprobs, atol=1e-6, rtol=0)
        want = _reference_logprobs(logits, 0.9, 0, 1.0)
        np.testing.assert_allclose(drawn[2], -(np.exp(want) * want).sum(-1), atol=5e-6, rtol=1e-5)


def test_order_is_temperature_then_top_k_then_top_p():
    # probs [0.4, 0.3, 0.2, 0.1]; top-k=2 renormalizes to [4/7, 3/7], so top-p=0.5 keeps only token 0.
    # (top-p first would keep {0, 1}: the mass before token 1 is 0.4 < 0.5.)
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    got = np.asarray(lp.sampling_logprobs(logits, 1.0, top_k=2, top_p=0.5))
    np.testing.assert_allclose(got, [[0.0, -np.inf, -np.inf, -np.inf]])
    # Temperature before top-p: at T=1, top-p=0.65 keeps {0, 1} (mass before token 2 is 0.7);
    # at T=0.25 the probs become proportional to p^4 = [.0256, .0081, .0016, .0001], so the mass
    # before token 1 is 0.2560/0.3540 = 0.723 >= 0.65 and only token 0 is kept.
    np.testing.assert_array_equal(np.isfinite(lp.sampling_logprobs(logits, 1.0, 0, 0.65))[0], [1, 1, 0, 0])
    np.testing.assert_array_equal(np.isfinite(lp.sampling_logprobs(logits, 0.25, 0, 0.65))[0], [1, 0, 0, 0])


def test_plain_temperature_one_is_model_log_softmax():
    logits = _well_separated_logits(seed=3).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    want = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp.sampling_logprobs(jnp.asarray(logits, jnp.float32)), want, atol=2e-6)


def test_low_temperature_tends_to_greedy_and_zero_is_greedy():
    logits = jnp.asarray(_well_separated_logits(seed=4))
    best = np.argmax(np.asarray(logits), axis=-1)
    cold = np.asarray(lp.sampling_logprobs(logits, 1e-3))
    np.testing.assert_allclose(np.exp(cold[np.arange(4), best]), 1.0, atol=1e-6)
    greedy = np.asarray(lp.sampling_logprobs(logits, 0.0, top_k=3, top_p=0.5))
    assert np.all(greedy[np.arange(4), best] == 0.0)
    assert np.isfinite(greedy).sum() == 4
    tokens, token_logprobs = lp.sample(jax.random.split(jax.random.key(0), 4), logits, 0.0)
    np.testing.assert_array_equal(tokens, best)
    np.testing.assert_array_equal(token_logprobs, 0.0)


def test_samples_follow_the_processed_distribution():
    probs = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None].repeat(20000, axis=0)
    keys = jax.random.split(jax.random.key(7), 20000)
    tokens, token_logprobs = lp.sample(keys, logits, temperature=1.0, top_k=4, top_p=0.8)
    # top-k=4 -> [.35,.25,.2,.1]/.9; top-p=.8 keeps tokens 0..2 (mass before token 3 is .8/.9 >= .8).
    want = np.array([0.35, 0.25, 0.2]) / 0.8
    counts = np.bincount(np.asarray(tokens), minlength=6)
    assert counts[3:].sum() == 0
    freq = counts[:3] / counts.sum()
    assert np.all(np.abs(freq - want) < 4 * np.sqrt(want * (1 - want) / 20000)), (freq, want)
    np.testing.assert_allclose(np.exp(np.asarray(token_logprobs)), want[np.asarray(tokens)], rtol=1e-5)


def test_first_argmax_is_argmax():
    logits = jnp.asarray(_well_separated_logits(seed=8, batch=64, vocab=300))
    ties = jnp.array([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
    np.testing.assert_array_equal(lp.first_argmax(ties), jnp.argmax(ties, axis=-1))
    np.testing.assert_array_equal(lp.first_argmax(logits), jnp.argmax(logits, axis=-1))


def test_sampling_blocks_divide_the_vocabulary_or_leave_a_tail():
    assert lp.sampling_blocks(151_936) == (128, 0)  # Qwen3: 1,187 blocks of 128, no copy of the logits
    assert lp.sampling_blocks(152_064) == (256, 0)
    assert lp.sampling_blocks(1000, 256) == (250, 0)
    assert lp.sampling_blocks(700, 64) == (50, 0)
    assert lp.sampling_blocks(997, 64) == (64, 997 % 64)  # a prime: 15 blocks of 64 and a tail of 37
    assert lp.sampling_blocks(50, 256) == (50, 0)


@pytest.mark.parametrize("vocab,block", [(1000, 256), (700, 64), (997, 64)])
def test_two_stage_draw_matches_the_distribution_across_blocks(vocab, block):
    # Peaked logits spread over several blocks (whole blocks, or a narrower tail block when no width
    # divides the vocabulary): frequencies of 100k draws match the probabilities within 4 standard
    # errors; truncated tokens are never drawn.
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0.0, 1.0, vocab)
    logits[rng.choice(vocab, 12, replace=False)] += 5.0
    logits[-1] += 5.0  # mass in the last block (the tail, where there is one)
    logprobs = np.asarray(lp.sampling_logprobs(jnp.asarray(logits[None], jnp.float32), 1.0, 0, 0.9))[0]
    draws = 100_000
    keys = jax.random.split(jax.random.key(vocab), draws)
    rows = jnp.broadcast_to(jnp.asarray(logprobs), (draws, vocab))
    tokens, token_logprobs = jax.jit(lambda k, r: lp.sample_from_logprobs(k, r, block))(keys, rows)
    tokens = np.asarray(tokens)
    probs = np.exp(logprobs.astype(np.float64))
    freq = np.bincount(tokens, minlength=vocab) / draws
    assert np.all(freq[~np.isfinite(logprobs)] == 0)
    tolerance = 4 * np.sqrt(probs * (1 - probs) / draws) + 1e-12
    assert np.all(np.abs(freq - probs) <= tolerance), np.abs(freq - probs).max()
    np.testing.assert_allclose(np.asarray(token_logprobs), logprobs[tokens], rtol=0, atol=1e-6)
    # Unnormalized log-weights (the processed logits shifted by a constant) give the same draw and the
    # same normalized log-prob.
    shifted_tokens, shifted_logprobs = jax.jit(lambda k, r: lp.sample_from_logprobs(k, r + 3.5, block))(keys, rows)
    np.testing.assert_array_equal(np.asarray(shifted_tokens), tokens)
    np.testing.assert_allclose(np.asarray(shifted_logprobs), logprobs[tokens], rtol=0, atol=1e-5)


def test_rows_with_equal_keys_draw_equal_tokens_whatever_the_batch():
    logits = jnp.asarray(_well_separated_logits(seed=5, batch=3))
    keys = jax.random.split(jax.random.key(1), 3)
    full, _ = lp.sample(keys, logits, 1.0)
    for row in range(3):
        alone, _ = lp.sample(keys[row : row + 1], logits[row : row + 1], 1.0)
        assert int(alone[0]) == int(full[row])


def test_bisection_nucleus_equals_float64_sorted_nucleus():
    rng = np.random.default_rng(11)
    logits = (rng.normal(0.0, 1.0, (64, 1000)) * rng.uniform(0.2, 8.0, (64, 1))).astype(np.float32)
    probs64 = np.exp(logits - logits.max(-1, keepdims=True)).astype(np.float64)
    probs64 /= probs64.sum(-1, keepdims=True)
    cumulative = np.cumsum(np.sort(probs64, axis=-1)[:, ::-1], axis=-1)
    checked = 0
    for top_p in (0.1, 0.5, 0.7, 0.95, 0.999):
        kept = np.isfinite(np.asarray(lp.truncate(jnp.asarray(logits), 0, top_p)))
        want = 1 + np.sum(cumulative[:, :-1] < top_p, axis=-1)  # smallest prefix reaching top_p
        # Rows whose float64 nucleus boundary is farther than float32 rounding must match exactly;
        # at a closer boundary the two summation orders may disagree by the boundary token.
        below = np.where(want > 1, cumulative[np.arange(64), np.maximum(want - 2, 0)], 0.0)
        margin = np.minimum(top_p - below, cumulative[np.arange(64), want - 1] - top_p)
        clear = margin > 1e-5
        np.testing.assert_array_equal(kept.sum(-1)[clear], want[clear])
        assert np.all(np.abs(kept.sum(-1) - want) <= 1)
        top = np.argsort(-logits, axis=-1, kind="stable")
        for row in np.flatnonzero(clear):
            assert set(np.flatnonzero(kept[row])) == set(top[row, : want[row]])
        checked += clear.sum()
    assert checked > 250  # most rows are far from a boundary
    # Ties at the threshold are kept together: {1, 1, 1, 0} at top_p 0.5 keeps all three ones.
    tied = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(jnp.isfinite(lp.truncate(tied, 0, 0.5)), [[True, True, True, False]])


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.3, 0.6, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 2, 7, 31]),
    top_p=st.sampled_from([0.05, 0.5, 0.9, 0.99, 1.0]),
)
def test_kept_set_is_a_minimal_top_set_with_unit_mass(seed, temperature, top_k, top_p):
    logits = np.random.default_rng(seed).normal(0.0, 3.0, size=(2, 32)).astype(np.float32)
    got = np.asarray(lp.sampling_logprobs(jnp.asarray(logits), temperature, top_k, top_p), np.float64)
    for row_logits, row in zip(logits, got):
        kept = np.isfinite(row)
        assert kept.sum() >= 1
        if top_k:
            assert kept.sum() <= top_k
        np.testing.assert_allclose(np.exp(row[kept]).sum(), 1.0, atol=1e-5)
        assert row_logits[kept].min() > row_logits[~kept].max(initial=-np.inf)
        # Minimal: the kept set minus its least likely token has (top-k renormalized) mass < top_p.
        if top_p < 1.0:
            scaled = row_logits.astype(np.float64) / temperature
            ranked = np.sort(scaled)[::-1][: top_k or None]
            probs = np.exp(ranked - ranked.max())
            probs /= probs.sum()
            assert probs[: kept.sum() - 1].sum() < top_p + 1e-6
            assert probs[: kept.sum()].sum() >= top_p - 1e-6


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)],
)
def test_bad_processing_parameters_raise(kwargs):
    args = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    with pytest.raises(ValueError):
        lp.sampling_logprobs(jnp.zeros((1, 4)), **args)
