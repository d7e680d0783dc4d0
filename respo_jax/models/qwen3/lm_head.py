"""Log-probs of given tokens through the vocabulary projection, without [tokens, vocab] logits.

The policy update needs log π(o_t | ·) of the sampled tokens only, but a softmax over the whole
vocabulary (151,936 for Qwen3) for each of them. Materialising float32 logits for a mini-batch of
responses costs tokens × 600 KB (20 GB for 32k tokens), so the projection and the log-softmax run
over `chunk_tokens` tokens at a time, in the forward and in the backward pass.

The backward pass is written by hand (`jax.custom_vjp`): the forward keeps only each token's
log-sum-exp, and the backward recomputes one chunk's logits and forms the logits' cotangent
`g · (onehot(target) − softmax) / temperature` in one pass. Differentiating the forward under
`jax.checkpoint` instead recomputes the log-sum-exp (max, exp, sum), exponentiates again for its
gradient and scatters the target's gradient into a zero [tokens, vocab] array.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from respo_jax.models.qwen3.layers import rows as token_rows


def chunked_token_logprobs(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *, tied: bool,
                           temperature: float = 1.0, chunk_tokens: int = 1024, return_entropy: bool = False):
    """log softmax(hidden @ W / temperature)[target] per position: [batch, seq] float32.

    hidden: [batch, seq, embed] (the final-norm output at the positions to score);
    weight: [vocab, embed] if `tied` (the embedding table) else [embed, vocab];
    targets: [batch, seq] int. Chunks hold `max(1, chunk_tokens // batch)` positions of every row,
    so the batch axis stays whole (a sharded batch is never split across chunks). `temperature`
    (static, > 0) divides the logits before the log-softmax, as the sampler does.
    `return_entropy=True` also returns the entropy of the whole distribution at each position,
    `(logp, entropy)`, from the same chunks; it is a diagnostic (its gradient is not provided).
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [batch, seq, embed] and targets [batch, seq]; got {hidden.shape} "
                         f"and {targets.shape}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
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

    if return_entropy:
        logp, entropy = jax.lax.map(
            lambda args: _chunk_with_entropy(args[0], jax.lax.stop_gradient(weight), args[1], tied,
                                             temperature),
            (jax.lax.stop_gradient(h), t))
        return unchunk(logp), unchunk(entropy)
    return unchunk(_logprobs(h, weight, t, tied, float(temperature)))


def _logits(h_c: jax.Array, weight: jax.Array, tied: bool, temperature: float) -> jax.Array:
    """One chunk's scaled float32 logits: h_c [batch, c, embed] -> [batch, c, vocab]."""
    rows = token_rows(h_c)
    if rows is None:  # under a mesh: keep the batch axis visible to the partitioner
        spec = "bce,ve->bcv" if tied else "bce,ev->bcv"
        logits = jnp.einsum(spec, h_c, weight, preferred_element_type=jnp.float32)
    else:
        spec = "te,ve->tv" if tied else "te,ev->tv"
        logits = jnp.einsum(spec, rows, weight, preferred_element_type=jnp.float32)
        logits = logits.reshape(*h_c.shape[:-1], -1)
    return logits if temperature == 1.0 else logits / jnp.float32(temperature)


def _chunk_forward(h_c, weight, t_c, tied, temperature):
    """(log-prob of the targets, log-sum-exp): each [batch, c] float32."""
    logits = _logits(h_c, weight, tied, temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
    return picked - lse, lse


def _chunk_with_entropy(h_c, weight, t_c, tied, temperature):
    """(log-prob of the targets, entropy H = logsumexp(z) − Σ softmax(z)·z): each [batch, c] float32."""
    logits = _logits(h_c, weight, tied, temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
    entropy = lse - jnp.sum(jnp.exp(logits - lse[..., None]) * logits, axis=-1)
    return picked - lse, entropy


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _logprobs(h, weight, t, tied, temperature):
    """h: [n, batch, c, embed], t: [n, batch, c] -> [n, batch, c] float32 log-probs."""
    return _forward(h, weight, t, tied, temperature)[0]


def _forward(h, weight, t, tied, temperature):
    return jax.lax.map(lambda args: _chunk_forward(args[0], weight, args[1], tied, temperature), (h, t))


def _logprobs_fwd(h, weight, t, tied, temperature):
    logp, lse = _forward(h, weight, t, tied, temperature)
    return logp, (h, weight, t, lse)


def _logprobs_bwd(tied, temperature, residuals, g):
    """d logp[t] / d logits = onehot(t) − softmax, scaled by 1 / temperature; one chunk at a time,
    the weight's gradient accumulated in float32 over chunks."""
    h, weight, t, lse = residuals

    def chunk(grad_w, args):
        h_c, t_c, lse_c, g_c = args
        logits = _logits(h_c, weight, tied, temperature)
        probs = jnp.exp(logits - lse_c[..., None])
        target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == t_c[..., None]
        g_logits = jnp.where(target, 1.0 - probs, -probs) * g_c[..., None]
        if temperature != 1.0:
            g_logits = g_logits / jnp.float32(temperature)
        g_logits = g_logits.astype(h_c.dtype)
        rows, g_rows = token_rows(h_c), token_rows(g_logits)
        if rows is None:
            dh = jnp.einsum("bcv,ve->bce" if tied else "bcv,ev->bce", g_logits, weight,
                            preferred_element_type=jnp.float32)
            dw = jnp.einsum("bcv,bce->ve" if tied else "bcv,bce->ev", g_logits, h_c,
                            preferred_element_type=jnp.float32)
        else:
            dh = jnp.einsum("tv,ve->te" if tied else "tv,ev->te", g_rows, weight,
                            preferred_element_type=jnp.float32).reshape(h_c.shape)
            dw = jnp.einsum("tv,te->ve" if tied else "tv,te->ev", g_rows, rows,
                            preferred_element_type=jnp.float32)
        return grad_w + dw, dh.astype(h_c.dtype)

    grad_w, dh = jax.lax.scan(chunk, jnp.zeros(weight.shape, jnp.float32), (h, t, lse, g))
    return dh, grad_w.astype(weight.dtype), None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)
