"""Small building blocks of the Qwen3 port: parameters with logical axis names, RMSNorm, rotary
position embeddings and activation sharding constraints.

Every parameter carries its logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``,
``head_dim``, ``mlp``, ``experts``, ``expert_mlp``; stacked layers add ``layers`` in front) as NNX
``out_sharding`` metadata, so running sharded only needs a mesh and a rules table
(``nnx.get_partition_spec`` + ``flax.core.spmd`` logical rules). With no mesh everything is plain
single-device JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.core.spmd as flax_spmd
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

# Logical axis names of activations.
BATCH, SEQ = "batch", "seq"


def make_param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], dtype,
               std: float | None) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` initialised N(0, std²) (``std=None``: ones), with its logical
    axis names as sharding metadata.

    ``eager_sharding=False``: the names are metadata only, so building the model never needs a mesh;
    a sharded run creates the parameters under ``jax.jit(..., out_shardings=...)`` instead.
    """
    if len(shape) != len(axes):
        raise ValueError(f"parameter shape {tuple(shape)} and axis names {tuple(axes)} differ in rank")
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical axis names; a no-op unless logical axis rules
    (``nnx.logical_axis_rules``) are set *and* a mesh is active (``jax.set_mesh``). On a mesh with
    ``Explicit`` axes the array is resharded; on ``Auto`` axes it is a constraint for the partitioner."""
    rules = flax_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    spec = logical_to_mesh_spec(axes, rules)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def token_rows(x: jax.Array) -> jax.Array | None:
    """x [..., features] as [tokens, features] when no mesh is active, else None (keep the batch axes).

    Dense layers run their matmuls on these 2-D token rows: from 3-D operands XLA:CPU builds the
    weight-gradient dots with explicit transposes of the [batch, seq, features] activations, which
    cost ~25% of a layer's forward + backward on CPU (experiments/benchmarks/README.md). Under a mesh
    the batch axes stay visible to the partitioner (a sharded axis cannot be merged and split freely).
    """
    if not jax.sharding.get_abstract_mesh().empty:
        return None
    return x.reshape(-1, x.shape[-1])


def logical_to_mesh_spec(axes: Sequence[str | None], rules) -> PartitionSpec:
    """Map logical names to mesh axes with the first applicable rule; a mesh axis is used at most
    once per array (a later logical axis that would reuse it stays unsharded)."""
    used: set[str] = set()
    spec = []
    for name in axes:
        target = None
        for logical, mesh_axes in rules:
            if logical != name:
                continue
            flat = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
            if flat and not used.intersection(flat):
                target = mesh_axes
                used.update(flat)
                break
        spec.append(target)
    return PartitionSpec(*spec)


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
