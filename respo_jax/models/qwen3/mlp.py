"""SwiGLU feed-forward block of dense Qwen3 layers: down(silu(x·gate) ⊙ (x·up))."""

from __future__ import annotations

import jax
from flax import nnx

from respo_jax.models.qwen3.config import Qwen3Config
from respo_jax.models.qwen3.layers import BATCH, HIDDEN, SEQ, constrain, make_param, rows


class MLP(nnx.Module):
    """gate_proj, up_proj: [embed, mlp]; down_proj: [mlp, embed]."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        e, m, pd, std = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype, cfg.initializer_range
        self.gate_proj = make_param(rngs, (e, m), ("embed", "mlp"), pd, std)
        self.up_proj = make_param(rngs, (e, m), ("embed", "mlp"), pd, std)
        self.down_proj = make_param(rngs, (m, e), ("mlp", "embed"), pd, std)
        self.config = cfg

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, seq, embed] -> [batch, seq, embed]; 2-D matmuls over the token rows."""
        cfg = self.config
        b, s, _ = x.shape
        gate_w, up_w, down_w = (w[...].astype(cfg.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        tokens = rows(x)
        hidden = jax.nn.silu(tokens @ gate_w) * (tokens @ up_w)
        hidden = rows(constrain(hidden.reshape(b, s, -1), (BATCH, SEQ, "mlp"), cfg))
        return constrain((hidden @ down_w).reshape(x.shape), HIDDEN, cfg)
