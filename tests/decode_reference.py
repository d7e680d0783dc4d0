"""A reference sampler for the engine's tests: each step re-runs the model's full forward (no KV cache,
no pages, no schedule) over prompt + tokens so far and draws the next token with `generate`'s key of
(seed, row id, step), through the same `logits_processing.sample`. What it shares with the engine is the
model's forward and the draw; what it checks is everything between (cache writes and reads, paging,
scheduling, admission, EOS and budget bookkeeping)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import jitted_model as jm
from respo_jax.sampling.logits_processing import sample

_SAMPLE = jax.jit(sample, static_argnames=("temperature", "top_k", "top_p", "return_entropy"))


@dataclasses.dataclass
class Reference:
    """tokens, logprobs: [rows, max_new_tokens]; lengths: [rows] (`GenerateOutput`'s conventions)."""

    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray


def reference_generate(model, prompts, params, row_ids=None, row_max_new_tokens=None) -> Reference:
    """`generate(model, prompts, params, ...)` recomputed step by step from full forwards (right-padded
    rows: causal attention never sees the trailing pads, so default positions are right)."""
    rows = [list(p) for p in prompts for _ in range(params.num_samples)]
    n, new = len(rows), params.max_new_tokens
    ids = np.arange(n, dtype=np.uint32) if row_ids is None else np.asarray(row_ids, np.uint32)
    budgets = np.full(n, new) if row_max_new_tokens is None else np.asarray(row_max_new_tokens)
    base = jax.random.fold_in(jax.random.key(params.seed & 0xFFFFFFFF), params.seed >> 32)
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, ids)
    eos = set() if params.ignore_eos else set(params.eos_token_ids)
    tokens = np.full((n, new), params.pad_token_id, np.int32)
    logprobs = np.zeros((n, new), np.float32)
    lengths = np.zeros(n, np.int32)
    done = np.zeros(n, bool)
    width = max(map(len, rows)) + new
    for step in range(new):
        seqs = [rows[r] + tokens[r, :step].tolist() for r in range(n)]
        input_ids = np.zeros((n, width), np.int32)
        mask = np.zeros((n, width), np.int32)
        for r, seq in enumerate(seqs):
            input_ids[r, : len(seq)] = seq
            mask[r, : len(seq)] = 1
        logits = np.asarray(jm.logits(model, input_ids, attention_mask=mask))
        last = logits[np.arange(n), [len(seq) - 1 for seq in seqs]]
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
        drawn, logp = _SAMPLE(keys, last, temperature=params.temperature, top_k=params.top_k,
                              top_p=params.top_p)[:2]
        drawn, logp = np.asarray(drawn), np.asarray(logp)
        for r in np.flatnonzero(~done):
            tokens[r, step], logprobs[r, step] = drawn[r], logp[r]
            lengths[r] += 1
            done[r] = int(drawn[r]) in eos or lengths[r] >= budgets[r]
        if done.all():
            break
    return Reference(tokens, lengths, logprobs)


def assert_same(got, want: Reference, logprob_tol: float = 2e-5) -> None:
    np.testing.assert_array_equal(np.asarray(got.lengths), want.lengths)
    np.testing.assert_array_equal(np.asarray(got.tokens), want.tokens)
    np.testing.assert_allclose(np.asarray(got.logprobs), want.logprobs, atol=logprob_tol)
