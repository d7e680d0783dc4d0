"""Sparse mixture-of-experts block of Qwen3-MoE, in three separable stages:

1. routing: float32 softmax over router logits, top-k (optionally renormalised, ``norm_topk_prob``);
   or, for Routing Replay (R3, paper §4.3 / App. E.4), given expert indices whose gate weights are
   still read from the *current* router probabilities, so the router keeps its gradient;
2. dispatch: the token×k assignments are sorted by expert (a permutation and its inverse);
3. expert compute: dropless grouped matmuls with ``jax.lax.ragged_dot`` over the sorted rows.

Also the Switch-Transformer load-balancing loss exactly as transformers' ``load_balancing_loss_func``
computes it, split into per-layer sums so the layer scan can accumulate it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models.qwen3.config import Qwen3Config
from respo_jax.models.qwen3.layers import BATCH, SEQ, constrain, make_param


def route(router_logits: jax.Array, top_k: int, norm_topk_prob: bool,
          indices: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k softmax routing.

    router_logits: [tokens, experts]; indices: optional [tokens, top_k] int (replayed routing)
    -> (weights [tokens, top_k] in the logits' dtype, indices [tokens, top_k] int32,
        probs [tokens, experts] float32).
    Replay gathers the given experts' current probabilities (renormalised if ``norm_topk_prob``), so
    replaying the model's own routing reproduces its forward exactly and the router gets gradients.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    if indices is None:
        top_probs, indices = jax.lax.top_k(probs, top_k)
    else:
        if indices.shape != (*probs.shape[:-1], top_k):
            raise ValueError(f"replayed routing has shape {indices.shape}; expected "
                             f"{(*probs.shape[:-1], top_k)} ([tokens, top_k])")
        indices = indices.astype(jnp.int32)
        top_probs = jnp.take_along_axis(probs, indices, axis=-1)
    if norm_topk_prob:
        top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    return top_probs.astype(router_logits.dtype), indices.astype(jnp.int32), probs


def expert_ffn(x: jax.Array, indices: jax.Array, weights: jax.Array, gate_proj: jax.Array,
               up_proj: jax.Array, down_proj: jax.Array) -> jax.Array:
    """Dropless SwiGLU experts via grouped matmuls over tokens sorted by expert.

    x: [tokens, embed]; indices, weights: [tokens, top_k]; gate_proj, up_proj: [experts, embed,
    expert_mlp]; down_proj: [experts, expert_mlp, embed] -> [tokens, embed] = Σ_k w_k · FFN_{e_k}(x).
    """
    tokens, top_k = indices.shape
    num_experts = gate_proj.shape[0]
    flat_experts = indices.reshape(-1)                                   # [tokens*top_k]
    order = jnp.argsort(flat_experts, stable=True)                        # sorted row -> assignment
    rows = tokens * top_k
    inverse = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_experts].add(1)
    x_sorted = jnp.take(x, order // top_k, axis=0)                        # [rows, embed]
    gate = jax.lax.ragged_dot(x_sorted, gate_proj, group_sizes)
    up = jax.lax.ragged_dot(x_sorted, up_proj, group_sizes)
    hidden = jax.nn.silu(gate) * up                                       # [rows, expert_mlp]
    y_sorted = jax.lax.ragged_dot(hidden, down_proj, group_sizes)         # [rows, embed]
    y = jnp.take(y_sorted, inverse, axis=0).reshape(tokens, top_k, -1)    # back to assignment order
    return jnp.einsum("tke,tk->te", y, weights.astype(y.dtype))


# Rows per tile of `tiled_expert_ffn`.
EXPERT_TILE = 128


def tiled_expert_ffn(x: jax.Array, indices: jax.Array, weights: jax.Array, gate_proj: jax.Array,
                     up_proj: jax.Array, down_proj: jax.Array, tile: int = EXPERT_TILE) -> jax.Array:
    """`expert_ffn` without `ragged_dot`, for backends that lack a grouped-matmul kernel (XLA:CPU lowers
    `ragged_dot` to work and memory proportional to rows × experts: 4-18× slower than this at 8-32
    experts, and 34 GB for 128 experts × 4096 tokens).

    Dropless: the token×k rows are sorted by expert and each expert's group is padded to a multiple
    of `tile` rows, so every tile belongs to one expert; all tiles then run as one batched matmul with
    their expert's weights gathered per tile. The padding is at most experts × (tile − 1) rows.
    Same arguments and result as `expert_ffn` (up to float summation order).
    """
    tokens, top_k = indices.shape
    num_experts = gate_proj.shape[0]
    rows = tokens * top_k
    flat_experts = indices.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)                        # sorted row -> assignment
    sorted_experts = flat_experts[order]
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_experts].add(1)
    padded_sizes = (sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded_sizes)
    starts = jnp.cumsum(sizes) - sizes
    slot = padded_ends[sorted_experts] - padded_sizes[sorted_experts] + (
        jnp.arange(rows, dtype=jnp.int32) - starts[sorted_experts])       # sorted row -> padded slot
    capacity = -(-(rows + num_experts * (tile - 1)) // tile) * tile       # static bound on padded rows
    num_tiles = capacity // tile
    tile_expert = jnp.minimum(
        jnp.searchsorted(padded_ends, jnp.arange(num_tiles, dtype=jnp.int32) * tile, side="right"),
        num_experts - 1)                                                  # unused tail tiles: any expert
    x_tiles = (jnp.zeros((capacity, x.shape[-1]), x.dtype)
               .at[slot].set(jnp.take(x, order // top_k, axis=0))
               .reshape(num_tiles, tile, -1))
    gate = jnp.einsum("nte,nem->ntm", x_tiles, jnp.take(gate_proj, tile_expert, axis=0))
    up = jnp.einsum("nte,nem->ntm", x_tiles, jnp.take(up_proj, tile_expert, axis=0))
    y_tiles = jnp.einsum("ntm,nme->nte", jax.nn.silu(gate) * up, jnp.take(down_proj, tile_expert, axis=0))
    y_sorted = jnp.take(y_tiles.reshape(capacity, -1), slot, axis=0)     # [rows, embed], sorted order
    inverse = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    y = jnp.take(y_sorted, inverse, axis=0).reshape(tokens, top_k, -1)   # back to assignment order
    return jnp.einsum("tke,tk->te", y, weights.astype(y.dtype))


def load_balancing_terms(probs: jax.Array, indices: jax.Array, token_mask: jax.Array):
    """One layer's sums for the load-balancing loss.

    probs: [tokens, experts] float32; indices: [tokens, top_k]; token_mask: [tokens] float (1 real)
    -> (assignment counts [experts], probability sums [experts]), both weighted by the mask.
    """
    num_experts = probs.shape[-1]
    one_hot = jax.nn.one_hot(indices, num_experts, dtype=jnp.float32)   # [tokens, top_k, experts]
    counts = jnp.einsum("tke,t->e", one_hot, token_mask)
    prob_sums = jnp.einsum("te,t->e", probs, token_mask)
    return counts, prob_sums


def load_balancing_loss_from_terms(counts: jax.Array, prob_sums: jax.Array, rows: jax.Array) -> jax.Array:
    """counts, prob_sums: [experts] summed over layers; rows: number of (layer, real token) pairs ->
    scalar E · Σ_e f_e · P_e (Switch Transformer eq. 4-6, transformers' normalisation: f_e counts
    top-k assignments per routed row, so a perfectly uniform router gives top_k)."""
    num_experts = counts.shape[-1]
    return num_experts * jnp.sum((counts / rows) * (prob_sums / rows))


def load_balancing_loss(router_logits: jax.Array, top_k: int, attention_mask: jax.Array | None = None):
    """Reference form on stored logits: router_logits [layers, tokens, experts], attention_mask
    [tokens] (or [batch, seq], flattened) -> scalar, as transformers' ``load_balancing_loss_func``."""
    layers, tokens, _ = router_logits.shape
    mask = (jnp.ones((tokens,), jnp.float32) if attention_mask is None
            else attention_mask.reshape(-1).astype(jnp.float32))
    counts = prob_sums = 0.0
    for layer_logits in router_logits:
        probs = jax.nn.softmax(layer_logits.astype(jnp.float32), axis=-1)
        _, indices = jax.lax.top_k(probs, top_k)
        c, p = load_balancing_terms(probs, indices, mask)
        counts, prob_sums = counts + c, prob_sums + p
    return load_balancing_loss_from_terms(counts, prob_sums, layers * jnp.sum(mask))


class MoE(nnx.Module):
    """router [embed, experts]; gate_proj, up_proj [experts, embed, expert_mlp];
    down_proj [experts, expert_mlp, embed]."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        e, n, m = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        pd, std = cfg.param_dtype, cfg.initializer_range
        self.router = make_param(rngs, (e, n), ("embed", "experts"), pd, std)
        self.gate_proj = make_param(rngs, (n, e, m), ("experts", "embed", "expert_mlp"), pd, std)
        self.up_proj = make_param(rngs, (n, e, m), ("experts", "embed", "expert_mlp"), pd, std)
        self.down_proj = make_param(rngs, (n, m, e), ("experts", "expert_mlp", "embed"), pd, std)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array, token_mask: jax.Array, routing: jax.Array | None = None):
        """x: [batch, seq, embed]; token_mask: [batch, seq] bool; routing: optional [batch, seq, top_k]
        -> (out [batch, seq, embed], indices [batch, seq, top_k] int32, (counts, prob_sums) [experts]).
        """
        b, s, e = x.shape
        dt = self.dtype
        flat = x.reshape(b * s, e)
        logits = jnp.einsum("te,en->tn", flat, self.router[...].astype(dt))
        weights, indices, probs = route(logits, self.top_k, self.norm_topk_prob,
                                        None if routing is None else routing.reshape(b * s, -1))
        ffn = tiled_expert_ffn if jax.default_backend() == "cpu" else expert_ffn
        out = ffn(flat, indices, weights, self.gate_proj[...].astype(dt),
                         self.up_proj[...].astype(dt), self.down_proj[...].astype(dt))
        terms = load_balancing_terms(probs, indices, token_mask.reshape(-1).astype(jnp.float32))
        out = constrain(out.reshape(b, s, e), (BATCH, SEQ, "embed"))
        return out, indices.reshape(b, s, self.top_k), terms
