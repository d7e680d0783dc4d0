"""Loss aggregation over response tokens, in one place for every objective (paper Tab. 2, App. B).

An objective produces a per-token loss ``[batch, seq]``; aggregation turns it into an unreduced
``total`` and the ``denominator`` it is divided by. Both are sums over responses, so a mini-batch
split into micro-batches gives exactly the full-batch loss and gradient when every micro-batch is
divided by the *mini-batch* denominator (``loss_denominator`` of the full mask):

    den = loss_denominator(full_mask, mode)
    grads = sum(grad(aggregate_loss(token_loss(mb), mb_mask, mode, denominator=den)) for mb in micro_batches)

Modes (verl's names):
  token-mean               sum over all response tokens / number of response tokens (ReSPO's setting,
                           DAPO; TRL's "dapo", "cispo")
  seq-mean-token-mean      per-response token mean, averaged over non-empty responses (GRPO, Eq. 1;
                           GSPO, Eq. 2; TRL's "grpo", "sapo")
  seq-mean-token-sum       per-response token sum, averaged over non-empty responses (TRL's "luspo")
  seq-mean-token-sum-norm  per-response token sum / a constant ``loss_scale_factor`` L, averaged over
                           non-empty responses: Dr.GRPO's normalization, sum / (responses * L) with L the
                           generation budget (TRL's "dr_grpo" divides by batch * max_completion_length).
                           verl's mode of the same name divides its micro-batch sum by L only and falls
                           back to the padded width when L is None; here L = None means that width too,
                           and the trainer passes the response-length limit.
Responses whose mask is all zero contribute neither to the total nor to the denominator, so padding
rows change nothing; with no response tokens at all the loss is 0.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class LossTerms(NamedTuple):
    """An aggregated loss before division: loss = total / denominator (0 when denominator == 0)."""

    total: jax.Array  # scalar float32, unreduced sum
    denominator: jax.Array  # scalar float32, additive over micro-batches

    def loss(self, denominator=None) -> jax.Array:
        """total / denominator, using the mini-batch ``denominator`` when one is given."""
        return safe_divide(self.total, self.denominator if denominator is None else denominator)


def check_aggregation_mode(mode: str) -> str:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    return mode


def check_loss_scale_factor(value) -> float | None:
    """The constant L of ``seq-mean-token-sum-norm``: None (the padded width) or a number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"loss_scale_factor must be a number > 0 (or None); got {value!r}")
    return float(value)


def safe_divide(total, denominator) -> jax.Array:
    """total / denominator with 0 / 0 = 0, without NaN in the gradient."""
    denominator = jnp.asarray(denominator, jnp.float32)
    nonzero = denominator > 0
    return jnp.where(nonzero, total / jnp.where(nonzero, denominator, 1.0), 0.0)


def _response_lengths(mask) -> tuple[jax.Array, jax.Array]:
    lengths = jnp.sum(jnp.asarray(mask, jnp.float32), axis=-1)
    return lengths, (lengths > 0).astype(jnp.float32)


def loss_denominator(mask, mode: str = "token-mean", loss_scale_factor: float | None = None) -> jax.Array:
    """The denominator of ``mode`` for ``mask: [batch, seq]``: tokens (token-mean), non-empty responses
    (seq-mean-*), or non-empty responses * L (seq-mean-token-sum-norm; L = mask.shape[-1] when None)."""
    check_aggregation_mode(mode)
    lengths, non_empty = _response_lengths(mask)
    if mode == "token-mean":
        return jnp.sum(lengths)
    if mode == "seq-mean-token-sum-norm":
        scale = jnp.shape(mask)[-1] if loss_scale_factor is None else loss_scale_factor
        return jnp.sum(non_empty) * jnp.float32(scale)
    return jnp.sum(non_empty)


def aggregation_terms(
    token_loss, mask, mode: str = "token-mean", loss_scale_factor: float | None = None
) -> LossTerms:
    """(total, denominator) of ``token_loss: [batch, seq]`` under ``mask: [batch, seq]`` (values 0 or 1).

    Masked-out positions are removed with ``where``, so they may hold any value, even inf or NaN.
    """
    check_aggregation_mode(mode)
    mask = jnp.asarray(mask, jnp.float32)
    masked = jnp.where(mask > 0, jnp.asarray(token_loss, jnp.float32) * mask, 0.0)
    per_response = jnp.sum(masked, axis=-1)
    if mode == "seq-mean-token-mean":
        lengths, _ = _response_lengths(mask)
        per_response = safe_divide(per_response, lengths)
    return LossTerms(
        total=jnp.sum(per_response), denominator=loss_denominator(mask, mode, loss_scale_factor)
    )


def aggregate_loss(
    token_loss, mask, mode: str = "token-mean", denominator=None, loss_scale_factor: float | None = None
) -> jax.Array:
    """Scalar loss of ``token_loss: [batch, seq]``; pass the mini-batch ``denominator`` when accumulating."""
    return aggregation_terms(token_loss, mask, mode, loss_scale_factor).loss(denominator)


def combine_loss_terms(terms: Sequence[LossTerms]) -> jax.Array:
    """The full-batch loss from the terms of its micro-batches: sum(total) / sum(denominator)."""
    if not terms:
        raise ValueError("combine_loss_terms needs at least one LossTerms, got an empty sequence")
    total = sum(t.total for t in terms)
    denominator = sum(t.denominator for t in terms)
    return safe_divide(total, denominator)
