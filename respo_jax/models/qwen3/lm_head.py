"""Log-probs of given tokens through the vocabulary projection, without [tokens, vocab] logits.

The policy update needs log π(o_t | ·) of the sampled tokens only, but a softmax over the whole
vocabulary (151,936 for Qwen3) for each of them. Materialising float32 logits for a mini-batch of
responses costs tokens × 600 KB (20 GB for 32k tokens), so the projection and the log-softmax run
over `chunk_tokens` tokens at a time, in the forward and in the backward pass. Two kernels
(`impl`, the model's `lm_head_impl`, chosen in kernels.py):

- ``vocab_chunks``: each token chunk also walks the vocabulary in blocks of `vocab_chunk` columns (the
  last one narrower where the width does not divide the vocabulary) with an online log-sum-exp
  (running max, rescaled sum of exponentials, the target's logit, and for the entropy the rescaled sum
  of p·logit), so no array is larger than one [chunk tokens, vocab_chunk] block of logits. Its
  backward recomputes each block's logits, forms `g · (onehot − softmax) / temperature` from the saved
  log-sum-exp and accumulates d hidden and that block's rows of d weight at once. A block is small
  enough to stay in the caches between the matmul that writes it and the elementwise passes that read
  it, where a [1024, 151,936] float32 chunk (622 MB) goes through main memory in every pass (the
  LM-head gradient ran at a fifth of XLA's matmul rate that way).
- ``token_chunks``: one [chunk tokens, vocab] logits array per chunk: for a vocabulary split over
  devices (tensor parallelism), where slicing vocabulary blocks of the sharded weight would gather it,
  and on CPU. When every chunk's softmax fits in `keep_probs_bytes` the forward keeps it for the
  backward, which then skips recomputing the logits: a 32-row mini-batch's update step at Qwen3's
  vocabulary went from 6.9 to 5.0 s on CPU. Its log-sum-exp is ``row_logsumexp``.

Both backward passes are written by hand (`jax.custom_vjp`): the forward keeps only each token's
log-sum-exp (and, in ``token_chunks`` when it fits, the softmax). Differentiating the forward under
`jax.checkpoint` instead recomputes the log-sum-exp (max, exp, sum), exponentiates again for its
gradient and scatters the target's gradient into a zero [tokens, vocab] array.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from respo_jax.models.qwen3.config import LM_HEAD_IMPLS
from respo_jax.models.qwen3.layers import rows as token_rows

# 4096 columns: a [1024, 4096] float32 block is 16 MiB, its bfloat16 cotangent 8 MiB, the weight block
# 4096 × embed; the Qwen3 vocabulary is 37 such blocks and one of 384 columns. The matmuls are
# [tokens, embed] @ [embed, 4096] and their transposes: wide enough for the GEMM kernels of every
# backend, few loop steps per chunk (experiments/benchmarks/lm_head.py compares widths).
VOCAB_CHUNK = 4096

# ``row_logsumexp`` reads a row of logits as [vocab / 128, 128]: 128 float32 lanes are 512 bytes, whole
# cache lines and vector registers.
LSE_LANES = 128

# ``token_chunks`` keeps the forward's softmax for the backward when all the chunks' [tokens, vocab]
# float32 probabilities fit in this many bytes, instead of recomputing the logits (a quarter of the
# head's matmul FLOPs) and their exponential there: 1.2 GB for the 2,048 response tokens of a 32-row
# mini-batch at Qwen3's vocabulary, 10 GB (recomputed) for the paper's 256 rows.
KEEP_PROBS_BYTES = 2 << 30


def chunked_token_logprobs(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *, tied: bool,
                           temperature: float = 1.0, chunk_tokens: int = 1024, return_entropy: bool = False,
                           entropy_gradient: bool = False,
                           impl: str = "vocab_chunks", vocab_chunk: int = VOCAB_CHUNK,
                           keep_probs_bytes: int = KEEP_PROBS_BYTES, lse_lanes: int = LSE_LANES):
    """log softmax(hidden @ W / temperature)[target] per position: [batch, seq] float32.

    hidden: [batch, seq, embed] (the final-norm output at the positions to score);
    weight: [vocab, embed] if `tied` (the embedding table) else [embed, vocab];
    targets: [batch, seq] int in [0, vocab). Chunks hold `max(1, chunk_tokens // batch)` positions of
    every row, so the batch axis stays whole (a sharded batch is never split across chunks).
    `temperature` (static, > 0) divides the logits before the log-softmax, as the sampler does.
    `impl`: ``"vocab_chunks"`` (blocks of `vocab_chunk` vocabulary columns, online log-sum-exp) or
    ``"token_chunks"`` (the whole vocabulary per chunk); see the module docstring.
    `keep_probs_bytes`: ``token_chunks`` saves the forward's softmax for the backward pass when it fits
    in these bytes (the logits are not recomputed there); 0 never does.
    `lse_lanes`: ``token_chunks`` reads each row of logits as [vocab / lanes, lanes] for its log-sum-exp
    (``row_logsumexp``); 1 reduces whole rows, as where the vocabulary is split over devices (the view
    would split its shards).
    `return_entropy=True` also returns the entropy of the whole distribution at each position,
    `(logp, entropy)`, from the same chunks; a diagnostic (the log-probs' gradient is the one without it,
    none flows through the entropy) unless
    `entropy_gradient=True`, which differentiates both (an entropy bonus): the backward recomputes each
    chunk's logits and adds the entropy's cotangent g_H · dH/dz = -g_H · p (log p + H) / T to the
    log-probs' (still no [tokens, vocab] array beyond one chunk or block).
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [batch, seq, embed] and targets [batch, seq]; got {hidden.shape} "
                         f"and {targets.shape}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if impl not in LM_HEAD_IMPLS:
        raise ValueError(f"impl must be one of {LM_HEAD_IMPLS}, got {impl!r}")
    for name, value in (("vocab_chunk", vocab_chunk), ("lse_lanes", lse_lanes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    b, s, _ = hidden.shape
    per_chunk = max(1, min(s, int(chunk_tokens) // b))
    n = math.ceil(s / per_chunk)
    pad = n * per_chunk - s
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    # [n, batch, per_chunk, ...]: chunk c holds positions [c·per_chunk, (c+1)·per_chunk) of every row.
    h = h.reshape(b, n, per_chunk, -1).swapaxes(0, 1)
    t = t.reshape(b, n, per_chunk).swapaxes(0, 1)

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(b, n * per_chunk)[:, :s]

    temperature = float(temperature)
    vocab = weight.shape[0 if tied else 1]
    blocks = _Blocks(vocab=vocab, width=min(vocab_chunk, vocab), tied=bool(tied), temperature=temperature)
    if return_entropy and entropy_gradient:
        if impl == "vocab_chunks":
            logp, entropy = _vocab_logprobs_entropy(h, weight, t, blocks)
        else:
            logp, entropy = _logprobs_entropy(h, weight, t, tied, temperature, lse_lanes)
        return unchunk(logp), unchunk(entropy)
    keep = n * b * per_chunk * vocab * 4 <= keep_probs_bytes
    if return_entropy:
        if impl == "vocab_chunks":
            logp, entropy = _vocab_logprobs_with_entropy(h, weight, t, blocks)
        else:
            logp, entropy = _logprobs_with_entropy(h, weight, t, tied, temperature, keep, lse_lanes)
        return unchunk(logp), unchunk(jax.lax.stop_gradient(entropy))
    if impl == "vocab_chunks":
        return unchunk(_vocab_logprobs(h, weight, t, blocks))
    return unchunk(_logprobs(h, weight, t, tied, temperature, keep, lse_lanes))


# ---------------------------------------------------------------------------------------- vocab_chunks


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The static layout of the vocabulary blocks: `vocab // width` blocks of `width` columns walked by a
    loop, then, if the width does not divide the vocabulary, one narrower block of the remaining columns
    (a static slice: no padded copy of the weight, no masked columns in the loop)."""

    vocab: int
    width: int
    tied: bool
    temperature: float

    @property
    def axis(self) -> int:
        """The weight's vocabulary axis."""
        return 0 if self.tied else 1

    def walk(self, weight: jax.Array, step, carry):
        """carry = step(carry, block weight, first column) over every block, in vocabulary order."""
        full, width = self.vocab // self.width, self.width

        # XLA:CPU runs a 16-bit float dynamic-slice in float32 and hoists the conversion of the whole
        # weight out of the loop (a float32 copy of it, twice its size); slicing the weight's bits does not.
        bits = jax.lax.bitcast_convert_type(weight, jnp.uint16) if weight.dtype.itemsize == 2 else weight

        def loop_step(j, c):
            start = j * width
            block = jax.lax.dynamic_slice_in_dim(bits, start, width, axis=self.axis)
            return step(c, jax.lax.bitcast_convert_type(block, weight.dtype), start)

        carry = jax.lax.fori_loop(0, full, loop_step, carry)
        if self.vocab % width:
            carry = step(carry, jax.lax.slice_in_dim(weight, full * width, self.vocab, axis=self.axis),
                         full * width)
        return carry

    def logits(self, rows: jax.Array, w: jax.Array) -> jax.Array:
        """rows [tokens, embed] @ block weight -> unscaled float32 logits [tokens, block width]."""
        return jnp.einsum("te,ve->tv" if self.tied else "te,ev->tv", rows, w,
                          preferred_element_type=jnp.float32)

    def scaled(self, z: jax.Array) -> jax.Array:
        """z / temperature (left to the elementwise pass that reads it, so no scaled block is stored)."""
        return z if self.temperature == 1.0 else z / jnp.float32(self.temperature)


def _vocab_chunk_forward(rows, weight, t, blocks: _Blocks, with_entropy: bool):
    """One token chunk, rows [tokens, embed], t [tokens]: (log-prob of the targets, log-sum-exp,
    entropy or None), each [tokens] float32, from one pass over the vocabulary blocks.

    Per block: the max (of the unscaled logits: dividing by T > 0 keeps the order, and float rounding
    too), the sum of exp(z/T − running max) in one pass, and the target's logit read at its index when it
    falls in the block (a gather of one value per token, not a pass over the block)."""
    def step(carry, w, start):
        m, s, picked, pz = carry
        z = blocks.logits(rows, w)
        width = z.shape[-1]
        m_new = jnp.maximum(m, blocks.scaled(jnp.max(z, axis=-1)))
        scale = jnp.exp(m - m_new)
        zs = blocks.scaled(z)
        e = jnp.exp(zs - m_new[:, None])
        s = s * scale + jnp.sum(e, axis=-1)
        local = t - start
        at_target = jnp.take_along_axis(z, jnp.clip(local, 0, width - 1)[:, None], axis=-1)[:, 0]
        picked = picked + jnp.where((local >= 0) & (local < width), at_target, 0.0)
        if with_entropy:  # Σ exp(z/T − m)·z/T, rescaled with s: Σ p·z/T = pz / s at the end
            pz = pz * scale + jnp.sum(e * zs, axis=-1)
        return m_new, s, picked, pz

    zeros = jnp.zeros(rows.shape[:1], jnp.float32)
    m, s, picked, pz = blocks.walk(weight, step, (jnp.full_like(zeros, -jnp.inf), zeros, zeros, zeros))
    lse = m + jnp.log(s)
    return blocks.scaled(picked) - lse, lse, (lse - pz / s if with_entropy else None)


def _vocab_forward(h, weight, t, blocks: _Blocks, with_entropy: bool = False):
    """h [n, batch, c, embed], t [n, batch, c] -> (log-probs, log-sum-exp, entropy or None), each
    [n, batch, c] float32."""
    def chunk(args):
        h_c, t_c = args
        out = _vocab_chunk_forward(token_rows(h_c), weight, t_c.reshape(-1), blocks, with_entropy)
        return tuple(None if x is None else x.reshape(t_c.shape) for x in out)

    return jax.lax.map(chunk, (h, t))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _vocab_logprobs(h, weight, t, blocks):
    """h: [n, batch, c, embed], t: [n, batch, c] -> [n, batch, c] float32 log-probs."""
    return _vocab_forward(h, weight, t, blocks)[0]


def _vocab_logprobs_fwd(h, weight, t, blocks):
    logp, lse, _ = _vocab_forward(h, weight, t, blocks)
    return logp, (h, weight, t, lse)


def _vocab_logprobs_bwd(blocks, residuals, g):
    """Per token chunk and vocabulary block: the logits' cotangent g · (onehot(t) − softmax) / T from
    the saved log-sum-exp (one elementwise pass), then d hidden += it @ Wᵀ and the block's rows of
    d W += itᵀ @ hidden (float32 accumulators)."""
    h, weight, t, lse = residuals
    return _vocab_backward(blocks, h, weight, t, lse, g)


def _vocab_backward(blocks, h, weight, t, lse, g, entropy=None, g_h=None):
    """`_vocab_logprobs_bwd`, plus (`entropy`, `g_h` given) the entropy's cotangent −g_H · p (log p + H)."""
    with_entropy = entropy is not None
    if not with_entropy:
        entropy = g_h = jnp.zeros_like(lse)

    def chunk(grad_w, args):
        h_c, t_c, lse_c, g_c, ent_c, gh_c = args
        rows = token_rows(h_c)
        t_r, lse_r, g_r = t_c.reshape(-1, 1), lse_c.reshape(-1, 1), g_c.reshape(-1, 1)
        ent_r, gh_r = ent_c.reshape(-1, 1), gh_c.reshape(-1, 1)

        def step(carry, w, start):
            dh, grad_w = carry
            z = blocks.scaled(blocks.logits(rows, w))
            cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, z.shape[-1]), 1)
            probs = jnp.exp(z - lse_r)
            g_z = jnp.where(cols == t_r, 1.0 - probs, -probs) * g_r
            if with_entropy:
                g_z = g_z - gh_r * probs * (z - lse_r + ent_r)
            g_z = blocks.scaled(g_z).astype(rows.dtype)
            dh = dh + jnp.einsum("tv,ve->te" if blocks.tied else "tv,ev->te", g_z, w,
                                 preferred_element_type=jnp.float32)
            dw = jnp.einsum("tv,te->ve" if blocks.tied else "tv,te->ev", g_z, rows,
                            preferred_element_type=jnp.float32)
            old = jax.lax.dynamic_slice_in_dim(grad_w, start, dw.shape[blocks.axis], axis=blocks.axis)
            return dh, jax.lax.dynamic_update_slice_in_dim(grad_w, old + dw, start, axis=blocks.axis)

        dh, grad_w = blocks.walk(weight, step, (jnp.zeros(rows.shape, jnp.float32), grad_w))
        return grad_w, dh.reshape(h_c.shape).astype(h_c.dtype)

    grad_w, dh = jax.lax.scan(chunk, jnp.zeros(weight.shape, jnp.float32), (h, t, lse, g, entropy, g_h))
    return dh, grad_w.astype(weight.dtype), None


_vocab_logprobs.defvjp(_vocab_logprobs_fwd, _vocab_logprobs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _vocab_logprobs_with_entropy(h, weight, t, blocks):
    """h: [n, batch, c, embed], t: [n, batch, c] -> (log-probs, entropy), each [n, batch, c] float32; the
    log-probs differentiable as `_vocab_logprobs`, the entropy a diagnostic (its cotangent is dropped:
    the caller stops its gradient)."""
    logp, _, entropy = _vocab_forward(h, weight, t, blocks, with_entropy=True)
    return logp, entropy


def _vocab_logprobs_with_entropy_fwd(h, weight, t, blocks):
    logp, lse, entropy = _vocab_forward(h, weight, t, blocks, with_entropy=True)
    return (logp, entropy), (h, weight, t, lse)


def _vocab_logprobs_with_entropy_bwd(blocks, residuals, cotangents):
    return _vocab_logprobs_bwd(blocks, residuals, cotangents[0])


_vocab_logprobs_with_entropy.defvjp(_vocab_logprobs_with_entropy_fwd, _vocab_logprobs_with_entropy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _vocab_logprobs_entropy(h, weight, t, blocks):
    """h: [n, batch, c, embed], t: [n, batch, c] -> (log-probs, entropy), each [n, batch, c] float32,
    both differentiable."""
    logp, _, entropy = _vocab_forward(h, weight, t, blocks, with_entropy=True)
    return logp, entropy


def _vocab_logprobs_entropy_fwd(h, weight, t, blocks):
    logp, lse, entropy = _vocab_forward(h, weight, t, blocks, with_entropy=True)
    return (logp, entropy), (h, weight, t, lse, entropy)


def _vocab_logprobs_entropy_bwd(blocks, residuals, cotangents):
    h, weight, t, lse, entropy = residuals
    g, g_h = cotangents
    return _vocab_backward(blocks, h, weight, t, lse, g, entropy, g_h)


_vocab_logprobs_entropy.defvjp(_vocab_logprobs_entropy_fwd, _vocab_logprobs_entropy_bwd)


# ---------------------------------------------------------------------------------------- token_chunks


def _logits(h_c: jax.Array, weight: jax.Array, tied: bool, temperature: float) -> jax.Array:
    """One chunk's scaled float32 logits: h_c [batch, c, embed] -> [batch, c, vocab]."""
    spec = "te,ve->tv" if tied else "te,ev->tv"
    logits = jnp.einsum(spec, token_rows(h_c), weight, preferred_element_type=jnp.float32)
    logits = logits.reshape(*h_c.shape[:-1], -1)
    return logits if temperature == 1.0 else logits / jnp.float32(temperature)


def row_logsumexp(logits: jax.Array, lanes: int = LSE_LANES) -> jax.Array:
    """log Σ exp over the last axis: [..., vocab] float32 -> [...], the vocabulary read as
    [vocab / l, l] for l the greatest common divisor of `lanes` and the vocabulary (128 for Qwen3's
    151,936 = 128 · 1187).

    Each lane's max, then its sum of exp(z − that max), are reduced down the long axis, lanes side by
    side (contiguous, vectorised reads); the lanes' sums are rescaled to the row's max at the end (the
    online log-sum-exp's combination). XLA:CPU splits a reduction over a whole row into windows of 32
    consecutive values that do not vectorise, about twice as slow (docs/results/measurements.md). A
    vocabulary with no power-of-two factor of 8 or more, or `lanes` under 8, takes jax.nn.logsumexp."""
    vocab = logits.shape[-1]
    lanes = math.gcd(vocab, lanes)
    if lanes < 8:
        return jax.nn.logsumexp(logits, axis=-1)
    blocks = logits.reshape(*logits.shape[:-1], vocab // lanes, lanes)
    lane_max = jnp.max(blocks, axis=-2)
    # A lane (or row) of -inf is shifted by 0, so it sums to 0 rather than NaN.
    lane_sum = jnp.sum(jnp.exp(blocks - _finite_or_zero(lane_max)[..., None, :]), axis=-2)
    # The row's max over the lanes' finite maxima: a max of `lane_max` itself XLA would merge with the
    # lanes' max into one reduction over the whole row (the slow windowed kind, 107 ms here).
    row_max = _finite_or_zero(jnp.max(jnp.where(jnp.isfinite(lane_max), lane_max, -jnp.inf), axis=-1))
    return row_max + jnp.log(jnp.sum(lane_sum * jnp.exp(lane_max - row_max[..., None]), axis=-1))


def row_logsumexp_entropy(logits: jax.Array, lanes: int = LSE_LANES) -> tuple[jax.Array, jax.Array]:
    """(log Σ exp z, H = log Σ exp z − Σ softmax(z)·z) over the last axis of finite float32 logits
    [..., vocab], each [...]: ``row_logsumexp``'s lanes, each also summing exp(z − lane max)·z in the
    same pass, rescaled to the row's max like the sums of exponentials."""
    vocab = logits.shape[-1]
    lanes = math.gcd(vocab, lanes)
    if lanes < 8:
        lse = jax.nn.logsumexp(logits, axis=-1)
        return lse, lse - jnp.sum(jnp.exp(logits - lse[..., None]) * logits, axis=-1)
    blocks = logits.reshape(*logits.shape[:-1], vocab // lanes, lanes)
    lane_max = jnp.max(blocks, axis=-2)
    weights = jnp.exp(blocks - lane_max[..., None, :])
    lane_sum, lane_dot = jnp.sum(weights, axis=-2), jnp.sum(weights * blocks, axis=-2)
    row_max = jnp.max(jnp.where(jnp.isfinite(lane_max), lane_max, -jnp.inf), axis=-1)
    scale = jnp.exp(lane_max - row_max[..., None])
    total = jnp.sum(lane_sum * scale, axis=-1)
    lse = row_max + jnp.log(total)
    return lse, lse - jnp.sum(lane_dot * scale, axis=-1) / total


def _finite_or_zero(x: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _chunk_scores(h_c, weight, t_c, tied, temperature, lanes):
    """One chunk's scaled logits [batch, c, vocab], their log-sum-exp (``row_logsumexp``) and the
    log-prob of the targets ([batch, c] each), all float32."""
    logits = _logits(h_c, weight, tied, temperature)
    lse = row_logsumexp(logits, lanes)
    picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
    return logits, lse, picked - lse


def _chunk_forward(h_c, weight, t_c, tied, temperature, lanes):
    """(log-prob of the targets, log-sum-exp): each [batch, c] float32."""
    _, lse, logp = _chunk_scores(h_c, weight, t_c, tied, temperature, lanes)
    return logp, lse


def _chunk_with_entropy(h_c, weight, t_c, tied, temperature, lanes):
    """(log-prob of the targets, entropy H = logsumexp(z) − Σ softmax(z)·z): each [batch, c] float32."""
    logp, entropy, _ = _chunk_with_entropy_lse(h_c, weight, t_c, tied, temperature, lanes)
    return logp, entropy


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logprobs(h, weight, t, tied, temperature, keep_probs, lanes):
    """h: [n, batch, c, embed], t: [n, batch, c] -> [n, batch, c] float32 log-probs. `keep_probs`
    (static): the backward reads the forward's softmax instead of recomputing it; `lanes`: the
    log-sum-exp's (``row_logsumexp``)."""
    return _forward(h, weight, t, tied, temperature, lanes)[0]


def _forward(h, weight, t, tied, temperature, lanes):
    return jax.lax.map(lambda args: _chunk_forward(args[0], weight, args[1], tied, temperature, lanes),
                       (h, t))


def _chunk_forward_with_probs(h_c, weight, t_c, tied, temperature, lanes):
    """(log-prob of the targets [batch, c], softmax [batch, c, vocab]) float32: the softmax as the
    backward would compute it."""
    logits, lse, logp = _chunk_scores(h_c, weight, t_c, tied, temperature, lanes)
    return logp, jnp.exp(logits - lse[..., None])


def _logprobs_fwd(h, weight, t, tied, temperature, keep_probs, lanes):
    if keep_probs:
        logp, probs = jax.lax.map(
            lambda args: _chunk_forward_with_probs(args[0], weight, args[1], tied, temperature, lanes),
            (h, t))
        return logp, (h, weight, t, probs)
    logp, lse = _forward(h, weight, t, tied, temperature, lanes)
    return logp, (h, weight, t, lse)


def _logprobs_bwd(tied, temperature, keep_probs, lanes, residuals, g):
    """d logp[t] / d logits = onehot(t) − softmax, scaled by 1 / temperature; one chunk at a time,
    the weight's gradient accumulated in float32 over chunks. The softmax: the forward's (`keep_probs`)
    or exp(logits − log-sum-exp) from the logits recomputed here."""
    h, weight, t, saved = residuals
    return _token_chunks_backward(tied, temperature, keep_probs, h, weight, t, saved, g)


def _token_chunks_backward(tied, temperature, keep_probs, h, weight, t, saved, g, entropy=None, g_h=None):
    """`_logprobs_bwd`, plus (`entropy`, `g_h` given; `saved` the log-sum-exp) the entropy's cotangent
    −g_H · p (log p + H)."""
    with_entropy = entropy is not None
    if not with_entropy:
        entropy = g_h = jnp.zeros_like(g)

    def chunk(grad_w, args):
        h_c, t_c, saved_c, g_c, ent_c, gh_c = args
        if keep_probs:
            probs = saved_c
        else:
            log_probs = _logits(h_c, weight, tied, temperature) - saved_c[..., None]
            probs = jnp.exp(log_probs)
        target = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1) == t_c[..., None]
        g_logits = jnp.where(target, 1.0 - probs, -probs) * g_c[..., None]
        if with_entropy:
            g_logits = g_logits - gh_c[..., None] * probs * (log_probs + ent_c[..., None])
        if temperature != 1.0:
            g_logits = g_logits / jnp.float32(temperature)
        g_logits = g_logits.astype(h_c.dtype)
        rows, g_rows = token_rows(h_c), token_rows(g_logits)
        dh = jnp.einsum("tv,ve->te" if tied else "tv,ev->te", g_rows, weight,
                        preferred_element_type=jnp.float32).reshape(h_c.shape)
        dw = jnp.einsum("tv,te->ve" if tied else "tv,te->ev", g_rows, rows,
                        preferred_element_type=jnp.float32)
        return grad_w + dw, dh.astype(h_c.dtype)

    grad_w, dh = jax.lax.scan(chunk, jnp.zeros(weight.shape, jnp.float32), (h, t, saved, g, entropy, g_h))
    return dh, grad_w.astype(weight.dtype), None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logprobs_with_entropy(h, weight, t, tied, temperature, keep_probs, lanes):
    """h: [n, batch, c, embed], t: [n, batch, c] -> (log-probs, entropy), each [n, batch, c] float32; the
    log-probs differentiable as `_logprobs`, the entropy a diagnostic (its cotangent is dropped: the
    caller stops its gradient)."""
    return jax.lax.map(lambda args: _chunk_with_entropy(args[0], weight, args[1], tied, temperature, lanes),
                       (h, t))


def _chunk_entropy_scores(h_c, weight, t_c, tied, temperature, lanes):
    """`_chunk_scores` with the entropy H = logsumexp(z) − Σ softmax(z)·z [batch, c] from the log-sum-exp's
    own pass (`row_logsumexp_entropy`): (logits, log-sum-exp, entropy, log-prob of the targets)."""
    logits = _logits(h_c, weight, tied, temperature)
    lse, entropy = row_logsumexp_entropy(logits, lanes)
    picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
    return logits, lse, entropy, picked - lse


def _chunk_with_entropy_probs(h_c, weight, t_c, tied, temperature, lanes):
    """(log-prob of the targets, entropy, softmax [batch, c, vocab]) float32 of one chunk. No pass of
    the entropy's own (`_chunk_entropy_scores`), so the logits are dead once the softmax is written and
    it can take their buffer, as without the entropy."""
    logits, lse, entropy, logp = _chunk_entropy_scores(h_c, weight, t_c, tied, temperature, lanes)
    return logp, entropy, jnp.exp(logits - lse[..., None])


def _logprobs_with_entropy_fwd(h, weight, t, tied, temperature, keep_probs, lanes):
    chunk = _chunk_with_entropy_probs if keep_probs else _chunk_with_entropy_lse
    logp, entropy, saved = jax.lax.map(lambda args: chunk(args[0], weight, args[1], tied, temperature, lanes),
                                       (h, t))
    return (logp, entropy), (h, weight, t, saved)


def _logprobs_with_entropy_bwd(tied, temperature, keep_probs, lanes, residuals, cotangents):
    return _logprobs_bwd(tied, temperature, keep_probs, lanes, residuals, cotangents[0])


_logprobs_with_entropy.defvjp(_logprobs_with_entropy_fwd, _logprobs_with_entropy_bwd)


def _chunk_with_entropy_lse(h_c, weight, t_c, tied, temperature, lanes):
    """(log-prob of the targets, entropy, log-sum-exp): each [batch, c] float32 (`_chunk_entropy_scores`)."""
    _, lse, entropy, logp = _chunk_entropy_scores(h_c, weight, t_c, tied, temperature, lanes)
    return logp, entropy, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _logprobs_entropy(h, weight, t, tied, temperature, lanes):
    """h: [n, batch, c, embed], t: [n, batch, c] -> (log-probs, entropy), each [n, batch, c] float32,
    both differentiable."""
    return _logprobs_entropy_fwd(h, weight, t, tied, temperature, lanes)[0]


def _logprobs_entropy_fwd(h, weight, t, tied, temperature, lanes):
    logp, entropy, lse = jax.lax.map(
        lambda args: _chunk_with_entropy_lse(args[0], weight, args[1], tied, temperature, lanes), (h, t))
    return (logp, entropy), (h, weight, t, lse, entropy)


def _logprobs_entropy_bwd(tied, temperature, lanes, residuals, cotangents):
    h, weight, t, lse, entropy = residuals
    g, g_h = cotangents
    return _token_chunks_backward(tied, temperature, False, h, weight, t, lse, g, entropy, g_h)


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd)
