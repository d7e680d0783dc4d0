"""Small building blocks of the Qwen3 port: parameters with logical axis names, RMSNorm, rotary
position embeddings and activation sharding constraints.

Every parameter carries its logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``experts``, ``expert_embed``, ``expert_mlp``; stacked layers add ``layers`` in
front) as NNX ``out_sharding`` metadata, and activations are constrained by logical names (``batch``,
``sequence``, ``activation_embed``, ``heads``, ``mlp``, ``vocab``, …). ``respo_jax.sharding.ShardingRules``
is the one table from these names to mesh axes; the model reads it, and the mesh, from its config
(always set: one device is the 1×1×1×1 mesh, where the constraints place everything on that device).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from respo_jax.models.qwen3.config import Qwen3Config

# Logical axis names of activations (parameters name theirs where they are created).
BATCH, SEQ, EMBED = "batch", "sequence", "activation_embed"
HIDDEN = (BATCH, SEQ, EMBED)  # [batch, seq, embed] between blocks


def make_param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], dtype,
               std: float | None) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` initialised N(0, std²) (``std=None``: ones), with its logical
    axis names as sharding metadata.

    ``eager_sharding=False``: the names are metadata only, so building the model never needs a mesh;
    a sharded run creates the parameters under ``jax.jit(..., out_shardings=...)`` instead
    (``respo_jax.sharding.sharded_init``).
    """
    if len(shape) != len(axes):
        raise ValueError(f"parameter shape {tuple(shape)} and axis names {tuple(axes)} differ in rank")
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def constrain(x: jax.Array, axes: Sequence[str | None], cfg: Qwen3Config) -> jax.Array:
    """Sharding constraint of ``x`` by logical axis names under ``cfg.rules`` on ``cfg.mesh`` (a
    constraint for the partitioner)."""
    return jax.lax.with_sharding_constraint(x, cfg.rules.sharding(cfg.mesh, axes))


def rows(x: jax.Array) -> jax.Array:
    """x [..., features] -> [tokens, features]. Dense layers run their matmuls on these 2-D token rows:
    from 3-D operands XLA:CPU builds the weight-gradient dots with explicit transposes of the
    [batch, seq, features] activations, which cost ~25% of a layer's forward + backward on CPU
    (docs/results/benchmarks.md). Under a mesh the merge is free too: the batch is the major,
    split dimension and the sequence the minor one, so XLA's SPMD partitioner keeps the token rows
    split as the batch was (same collectives as the 3-D einsums; checked on an 8-device mesh)."""
    return x.reshape(-1, x.shape[-1])


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, statistics in float32 (as transformers' Qwen3RMSNorm): the
    normalised input is cast back to the compute dtype before the weight multiplies it."""

    def __init__(self, dim: int, eps: float, axis_name: str, *, param_dtype, dtype):
        self.weight = make_param(None, (dim,), (axis_name,), param_dtype, std=None)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in the compute dtype."""
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype)
        return self.weight[...].astype(self.dtype) * normed


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """Inverse frequencies θ^(-2i/d), i < d/2: [head_dim // 2] float32 (same float32 arithmetic as
    transformers' default rope)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions: [batch, seq] int -> (cos, sin): [batch, seq, head_dim] float32, the two halves of the
    last axis repeating the same frequencies (rotate-half convention)."""
    inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim]; cos, sin: [batch, seq, head_dim] -> rotated x (x's dtype)."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
