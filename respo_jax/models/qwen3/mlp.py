"""SwiGLU feed-forward block of dense Qwen3 layers: down(silu(x·gate) ⊙ (x·up))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models.qwen3.layers import BATCH, SEQ, constrain, make_param


class MLP(nnx.Module):
    """gate_proj, up_proj: [embed, mlp]; down_proj: [mlp, embed]."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, param_dtype, dtype, std: float,
                 rngs: nnx.Rngs):
        e, m = hidden_size, intermediate_size
        self.gate_proj = make_param(rngs, (e, m), ("embed", "mlp"), param_dtype, std)
        self.up_proj = make_param(rngs, (e, m), ("embed", "mlp"), param_dtype, std)
        self.down_proj = make_param(rngs, (m, e), ("mlp", "embed"), param_dtype, std)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]."""
        dt = self.dtype
        gate = jnp.einsum("bse,em->bsm", x, self.gate_proj[...].astype(dt))
        up = jnp.einsum("bse,em->bsm", x, self.up_proj[...].astype(dt))
        hidden = constrain(jax.nn.silu(gate) * up, (BATCH, SEQ, "mlp"))
        out = jnp.einsum("bsm,me->bse", hidden, self.down_proj[...].astype(dt))
        return constrain(out, (BATCH, SEQ, "embed"))
