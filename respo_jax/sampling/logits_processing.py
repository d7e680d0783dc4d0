"""Turn next-token logits into the distribution actually sampled from, and sample it.

The importance ratio W = pi_theta / pi_old of the paper (Sec. 1, 3.1) needs pi_old(o_t | ...), the
probability under which o_t was *generated*. With temperature, top-k or top-p that is the truncated,
renormalized, temperature-scaled distribution, not the model's full softmax; returning the latter
while sampling from the former is a known trap. Here one function builds the processed log-probs,
the sampler draws from exactly those and returns the drawn token's log-prob from the same array.

Order of composition (as in HF `transformers` and vLLM): temperature, then top-k, then top-p, where
top-p is the nucleus of the temperature-scaled, top-k-renormalized distribution. All functions work
on `[..., vocab]` float arrays; truncation writes -inf, so `log_softmax` renormalizes over the kept
set. Ties at a truncation threshold are all kept (the kept set is `logits >= threshold`). Drawing
is an exact two-stage Gumbel-max (`sample_from_logprobs`), which also normalizes, so sampling never
writes a separate [batch, vocab] log-softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def scale_by_temperature(logits: jax.Array, temperature: float) -> jax.Array:
    """Divide `logits: [..., vocab]` by a positive temperature (static Python float)."""
    if not temperature > 0.0:
        raise ValueError(f"scale_by_temperature needs temperature > 0, got {temperature}")
    logits = logits.astype(jnp.float32)
    return logits if temperature == 1.0 else logits / jnp.float32(temperature)


def top_p_threshold(sorted_desc: jax.Array, top_p: float) -> jax.Array:
    """Smallest kept logit of the nucleus, from logits sorted descending `[..., n]` -> `[..., 1]`.

    A token is kept when the probability mass strictly before it (in descending order) is < top_p,
    i.e. the smallest prefix whose mass reaches top_p; the top token is always kept. `sorted_desc`
    may hold -inf (already-truncated tokens); they carry no mass.
    """
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
    num_kept = jnp.maximum(num_kept, 1)
    return jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)


def nucleus_min_prob(probs: jax.Array, top_p: float) -> jax.Array:
    """Smallest kept probability of the nucleus, without sorting: `probs: [..., n]` -> `[..., 1]`.

    The nucleus (smallest set of most likely tokens whose mass reaches top_p, as in `top_p_threshold`)
    is `{p >= t}` for the largest t with `sum(p[p >= t]) >= top_p`. Non-negative float32 values order
    like their int32 bit patterns, so bisection over the bits of t in [0, max p] finds that t exactly
    in 31 masked sums over the vocabulary - on CPU ~30x cheaper than sorting 32k-151k entries per row.
    """
    target = jnp.float32(top_p)
    lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)  # bits of 0.0: keeps everything
    hi = jax.lax.bitcast_convert_type(jnp.max(probs, axis=-1, keepdims=True), jnp.int32)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2
        threshold = jax.lax.bitcast_convert_type(mid, jnp.float32)
        enough = jnp.sum(jnp.where(probs >= threshold, probs, 0.0), axis=-1, keepdims=True) >= target
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 31, halve, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def truncate(logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Apply top-k then top-p to (temperature-scaled) `logits: [..., vocab]`; dropped -> -inf.

    `top_k` (0 = off) and `top_p` (1 = off) are static switches. With top-k the nucleus is found on
    the k values `lax.top_k` returns sorted; without it, by bisection (`nucleus_min_prob`), so the
    vocabulary is never sorted.
    """
    if top_k < 0 or not (0.0 < top_p <= 1.0):
        raise ValueError(f"need top_k >= 0 and top_p in (0, 1], got top_k={top_k}, top_p={top_p}")
    use_top_k = 0 < top_k < logits.shape[-1]
    if not use_top_k and top_p >= 1.0:
        return logits
    if use_top_k:
        top_values = jax.lax.top_k(logits, top_k)[0]  # [..., k], sorted descending
        # The nucleus threshold is one of the k values, hence never below the k-th one.
        threshold = top_p_threshold(top_values, top_p) if top_p < 1.0 else top_values[..., -1:]
        return jnp.where(logits >= threshold, logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.where(probs >= nucleus_min_prob(probs, top_p), logits, NEG_INF)


def sampling_logprobs(
    logits: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
    """Log-probs of the distribution sampled from: `logits: [..., vocab]` -> `[..., vocab]` float32.

    Kept tokens hold log-probs that sum (in probability) to one; dropped tokens hold -inf.
    `temperature == 0` is greedy: a point mass on the argmax (log-prob 0 there, -inf elsewhere), so
    top-k/top-p do not matter. All three parameters are static Python numbers.
    """
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        best = first_argmax(logits)
        hot = jax.nn.one_hot(best, logits.shape[-1], dtype=jnp.bool_)
        return jnp.where(hot, 0.0, NEG_INF).astype(jnp.float32)
    scaled = scale_by_temperature(logits, temperature)
    return jax.nn.log_softmax(truncate(scaled, top_k, top_p), axis=-1)


def sampling_entropy(
    logits: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
    """Entropy (nats) of the distribution sampled from: `logits: [batch, vocab]` -> `[batch]` float32.

    The same processing as `sample`; dropped tokens carry no mass. Greedy (temperature 0) is a point
    mass: 0. Why here: the sampler holds every step's logits, so a trainer that takes log π_old from the
    sampler (`rollout.old_logprobs`) gets the rollout's entropy without a forward pass of its own; the
    engines take it from `sample(..., return_entropy=True)`, which reuses the draw's normalizer.
    """
    if temperature == 0.0:
        return jnp.zeros(logits.shape[:-1], jnp.float32)
    weights = truncate(scale_by_temperature(logits, temperature), top_k, top_p)
    log_norm = jax.nn.logsumexp(weights, axis=-1, keepdims=True)
    probs = jnp.exp(weights - log_norm)
    return jnp.sum(jnp.where(probs > 0.0, probs * (log_norm - weights), 0.0), axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, -1)` (first maximal index) as two plain reductions: `[..., n]` -> `[...]` int32.

    XLA:CPU lowers `argmax` to a variadic (value, index) reduce that is not vectorized, several times
    slower than a max followed by a min over the matching indices.
    """
    n = x.shape[-1]
    best = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.min(jnp.where(x == best, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.minimum(index, n - 1)  # NaN rows (no match) stay in range


SAMPLING_BLOCK = 256
ENTROPY_ROWS = 32  # the most rows whose entropy `sample_from_logprobs` computes at once (it says why)


def sampling_blocks(vocab: int, max_block: int = SAMPLING_BLOCK) -> tuple[int, int]:
    """(block width, tail width) of the two-stage draw over `vocab` tokens, static.

    The block is the largest divisor of the vocabulary up to `max_block` when it is at least a quarter
    of it (Qwen3's 151,936 = 1,187 × 128: blocks of 128), so the logits reshape into whole blocks in
    place; otherwise `max_block`, and the last `vocab mod max_block` tokens form a narrower tail block.
    On CPU a decode step's vocabulary projection and draw for 32 rows took 50 ms with 256-wide blocks
    (a padded copy of the logits) and 29 ms with 128-wide ones, the projection alone 24 ms (128 rows:
    161, 106 and 93 ms).
    """
    block = min(max_block, vocab)
    divisor = next(d for d in range(block, 0, -1) if vocab % d == 0)
    if divisor * 4 >= block:
        return divisor, 0
    return block, vocab % block


def sample_from_logprobs(
    keys: jax.Array, logprobs: jax.Array, block: int = SAMPLING_BLOCK, return_entropy: bool = False
) -> tuple[jax.Array, ...]:
    """Draw one token per row and return it with its log-prob under the same distribution.

    Exact two-stage Gumbel-max: the vocabulary is cut into blocks (`sampling_blocks`: at most `block`
    tokens, the last one narrower when no block width divides the vocabulary); a block is drawn with
    probability equal to its mass (Gumbel-max over per-block logsumexp), then a token within it with
    probability proportional to its own (Gumbel-max over the block). P(block) * P(token | block) is the
    token's probability, so this samples `softmax(logprobs)` exactly, with about vocab/block + block
    random numbers per row instead of vocab (151,936 for Qwen3): on CPU the per-token threefry bits of
    a `jax.random.categorical` draw were most of the sampling time.

    Args:
      keys: `[batch]` typed PRNG keys, one per row, so a row's draw does not depend on the others.
      logprobs: `[batch, vocab]` log-probs, or unnormalized log-weights of the distribution (e.g.
        temperature-scaled, truncated logits; -inf = dropped): the blocks' log-masses normalize them,
        so no separate log-softmax pass over the vocabulary is needed.
      block: static largest block width.
      return_entropy: static; also the distribution's entropy, from the exponentials the blocks'
        log-masses computed anyway (`_block_masses`). On this CPU at Qwen3's vocabulary: +0.15 ms on a
        5.3 ms draw of 32 rows (+3.2 ms with a pass of its own, +6 ms for `sampling_entropy`). With two
        reductions reading them, XLA:CPU writes the exponentials out, which costs 3x the draw once
        they outgrow the cache (64 rows: 28 against 8 ms), so larger batches run in chunks of at most
        `ENTROPY_ROWS` rows (`lax.map`): 128 rows 24 against 14 ms.
    Returns:
      tokens `[batch]` int32, token_logprobs `[batch]` float32 (normalized: log softmax(logprobs)),
      and with `return_entropy` the entropy `[batch]` float32 (nats).
    """
    batch, vocab = logprobs.shape
    chunk = max(d for d in range(1, min(batch, ENTROPY_ROWS) + 1) if batch % d == 0)
    if return_entropy and chunk < batch and chunk >= ENTROPY_ROWS // 4:  # rows are independent draws
        parts = jax.lax.map(lambda part: sample_from_logprobs(*part, block=block, return_entropy=True),
                            (keys.reshape(-1, chunk), logprobs.reshape(-1, chunk, vocab)))
        return tuple(part.reshape(batch) for part in parts)
    width, tail_width = sampling_blocks(vocab, block)
    full = vocab // width
    blocks = logprobs[:, :full * width].reshape(batch, full, width)
    block_logmass, block_mean = _block_masses(blocks, return_entropy)  # [batch, blocks]; -inf: all dropped
    if tail_width:  # the tail padded to a block's width: [batch, width]
        tail = jnp.pad(logprobs[:, full * width:], ((0, 0), (0, width - tail_width)), constant_values=NEG_INF)
        tail_logmass, tail_mean = _block_masses(tail[:, None], return_entropy)
        block_logmass = jnp.concatenate([block_logmass, tail_logmass], axis=-1)
        block_mean = jnp.concatenate([block_mean, tail_mean], axis=-1) if return_entropy else None
    pick_block, pick_token = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, block_logmass.shape[1:], logprobs.dtype))(pick_block)
    chosen = first_argmax(block_logmass + noise)  # [batch]
    within = jnp.take_along_axis(blocks, jnp.minimum(chosen, full - 1)[:, None, None], axis=1)[:, 0]
    if tail_width:
        within = jnp.where((chosen == full)[:, None], tail, within)  # [batch, width]
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (width,), logprobs.dtype))(pick_token)
    tokens = chosen * width + first_argmax(within + noise)
    log_norm = jax.nn.logsumexp(block_logmass, axis=-1)  # [batch]: log of the total mass
    token_logprobs = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0] - log_norm
    if not return_entropy:
        return tokens.astype(jnp.int32), token_logprobs
    block_prob = jnp.exp(block_logmass - log_norm[:, None])  # H = log Z - sum_b P(b) E[x | b]
    mean_logit = jnp.sum(jnp.where(block_prob > 0.0, block_prob * block_mean, 0.0), axis=-1)
    return tokens.astype(jnp.int32), token_logprobs, log_norm - mean_logit


def _block_masses(blocks: jax.Array, with_mean: bool) -> tuple[jax.Array, jax.Array | None]:
    """Each block's log-mass (`jax.nn.logsumexp`'s formula) and, `with_mean`, its mean logit under its own
    softmax, from one set of exponentials: `[batch, blocks, width]` -> two `[batch, blocks]` (None).
    A block of dropped tokens (-inf) has log-mass -inf (its mean is NaN: it carries no probability)."""
    top = jnp.max(blocks, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    exps = jnp.exp(blocks - top)
    total = jnp.sum(exps, axis=-1)
    logmass = top[..., 0] + jnp.log(total)
    if not with_mean:
        return logmass, None
    return logmass, jnp.sum(jnp.where(exps > 0.0, exps * blocks, 0.0), axis=-1) / total


def sample(
    keys: jax.Array, logits: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    return_entropy: bool = False,
) -> tuple[jax.Array, ...]:
    """Process `logits: [batch, vocab]` and sample: -> tokens `[batch]` int32, log-probs `[batch]`, and
    with `return_entropy` (static) the sampled distribution's entropy `[batch]` (`sampling_entropy`).

    The draw and the token's log-prob come from the temperature-scaled, truncated logits (the same
    distribution as `sampling_logprobs`, normalized inside the draw). Greedy (temperature 0) takes the
    argmax without touching the keys; its log-prob and entropy are 0.
    """
    if temperature == 0.0:
        tokens = first_argmax(logits)
        zeros = jnp.zeros(tokens.shape, jnp.float32)
        return (tokens, zeros, zeros) if return_entropy else (tokens, zeros)
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return sample_from_logprobs(keys, truncate(scale_by_temperature(logits, temperature), top_k, top_p),
                                return_entropy=return_entropy)
