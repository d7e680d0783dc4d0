"""SwiGLU feed-forward block of dense Qwen3 layers: down(silu(x·gate) ⊙ (x·up))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models.qwen3.layers import BATCH, SEQ, constrain, make_param, token_rows


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
        gate_w, up_w, down_w = (w[...].astype(dt) for w in (self.gate_proj, self.up_proj, self.down_proj))
        tokens = token_rows(x)
        if tokens is not None:  # no mesh: 2-D matmuls over [batch·seq] token rows (see token_rows)
            hidden = jax.nn.silu(tokens @ gate_w) * (tokens @ up_w)
            return (hidden @ down_w).reshape(x.shape)
        gate = jnp.einsum("bse,em->bsm", x, gate_w)
        up = jnp.einsum("bse,em->bsm", x, up_w)
        hidden = constrain(jax.nn.silu(gate) * up, (BATCH, SEQ, "mlp"))
        out = jnp.einsum("bsm,me->bse", hidden, down_w)
        return constrain(out, (BATCH, SEQ, "embed"))
