"""Sparse mixture-of-experts block of Qwen3-MoE, in three separable stages:

1. routing: float32 softmax over router logits, top-k (optionally renormalised, ``norm_topk_prob``);
   or, for Routing Replay (R3, paper §4.3 / App. E.4), given expert indices whose gate weights are
   still read from the *current* router probabilities, so the router keeps its gradient;
2. dispatch: the token×k assignments are sorted by expert; under a mesh (expert parallelism) the
   sorted rows are sent to the devices owning their experts and the results sent back, inside
   ``shard_map``: ``moe_dispatch="all_to_all"`` exchanges dropless padded buffers (every backend),
   ``"ragged_all_to_all"`` only the routed rows (GPU/TPU; XLA:CPU does not implement it);
3. expert compute: a dropless grouped SwiGLU over rows sorted by expert, ``moe_impl="ragged"``
   (``jax.lax.ragged_dot``) or ``"tiled"`` (expert-aligned tiles, one batched matmul).

Every model runs the MoE layer as `expert_parallel_ffn`: inside ``shard_map`` each device runs the
stages on its own tokens and its own experts (`expert_ffn`); mesh axes of size 1 exchange nothing, so
on one device (the 1×1×1×1 mesh) it is the local computation.

Also the Switch-Transformer load-balancing loss exactly as transformers' ``load_balancing_loss_func``
computes it, split into per-layer sums so the layer scan can accumulate it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models.qwen3.config import Qwen3Config
from respo_jax.models.qwen3.layers import BATCH, HIDDEN, SEQ, constrain, make_param
from respo_jax.sharding import ShardingRules, axis_size


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


def grouped_ffn(x: jax.Array, group_sizes: jax.Array, gate_proj: jax.Array, up_proj: jax.Array,
                down_proj: jax.Array, impl: str, tile: int | None = None) -> jax.Array:
    """SwiGLU of each group of rows with its own expert's weights (dropless).

    x: [rows, embed] sorted by group; group_sizes: [experts] int, summing to at most ``rows`` (the rows
    past the sum are padding and come out as zeros); gate_proj, up_proj: [experts, embed, expert_mlp];
    down_proj: [experts, expert_mlp, embed] -> [rows, embed]. ``impl``: "ragged" or "tiled" (``tile``:
    rows per tile, default EXPERT_TILE).
    """
    if impl == "ragged":
        gate = jax.lax.ragged_dot(x, gate_proj, group_sizes)
        up = jax.lax.ragged_dot(x, up_proj, group_sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_proj, group_sizes)
        valid = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes)
        return jnp.where(valid[:, None], y, 0)
    if impl == "tiled":
        return _tiled_ffn(x, group_sizes, gate_proj, up_proj, down_proj, EXPERT_TILE if tile is None else tile)
    raise ValueError(f"unknown MoE kernel {impl!r}; expected 'ragged' or 'tiled'")


# Rows per tile of the tiled grouped FFN.
EXPERT_TILE = 128


def _tiled_ffn(x, group_sizes, gate_proj, up_proj, down_proj, tile: int):
    """`grouped_ffn` without `ragged_dot`, for backends that lack a grouped-matmul kernel (XLA:CPU lowers
    `ragged_dot` to work and memory proportional to rows × experts: several times slower than this
    (docs/results/benchmarks.md), and 34 GB for 128 experts × 4096 tokens).

    Each group is padded to a multiple of ``tile`` rows, so every tile belongs to one expert; all tiles
    then run as one batched matmul with their expert's weights gathered per tile. The padding is at
    most experts × (tile − 1) rows.
    """
    rows, num_experts = x.shape[0], gate_proj.shape[0]
    ends = jnp.cumsum(group_sizes)
    padded_sizes = (group_sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded_sizes)
    capacity = -(-(rows + num_experts * (tile - 1)) // tile) * tile        # static bound on padded rows
    num_tiles = capacity // tile
    row = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, row, side="right")                      # == num_experts: padding row
    g = jnp.minimum(group, num_experts - 1)
    slot = jnp.where(group < num_experts,
                     padded_ends[g] - padded_sizes[g] + row - (ends[g] - group_sizes[g]), capacity)
    tile_expert = jnp.minimum(
        jnp.searchsorted(padded_ends, jnp.arange(num_tiles, dtype=jnp.int32) * tile, side="right"),
        num_experts - 1)                                                   # unused tail tiles: any expert
    x_tiles = jnp.zeros((capacity, x.shape[-1]), x.dtype).at[slot].set(x, mode="drop").reshape(num_tiles, tile, -1)
    gate = jnp.einsum("nte,nem->ntm", x_tiles, jnp.take(gate_proj, tile_expert, axis=0))
    up = jnp.einsum("nte,nem->ntm", x_tiles, jnp.take(up_proj, tile_expert, axis=0))
    y_tiles = jnp.einsum("ntm,nme->nte", jax.nn.silu(gate) * up, jnp.take(down_proj, tile_expert, axis=0))
    return jnp.take(y_tiles.reshape(capacity, -1), slot, axis=0, mode="fill", fill_value=0)


def expert_ffn(x: jax.Array, indices: jax.Array, weights: jax.Array, gate_proj: jax.Array,
               up_proj: jax.Array, down_proj: jax.Array, impl: str = "ragged", tile: int | None = None,
               dispatch: str = "all_to_all", expert_axes: tuple[str, ...] = ()) -> jax.Array:
    """Dropless SwiGLU experts: Σ_k w_k · FFN_{e_k}(x) over the token×k assignments sorted by expert.

    x: [tokens, embed]; indices, weights: [tokens, top_k]; gate_proj, up_proj: [experts, embed,
    expert_mlp]; down_proj: [experts, expert_mlp, embed] -> [tokens, embed].

    Inside ``shard_map`` with ``expert_axes`` (mesh axes splitting the experts), the arguments are one
    device's tokens and its own slice of the experts (``indices`` stay global expert ids): the sorted
    rows go to the devices owning their experts by ``dispatch`` ("all_to_all" | "ragged_all_to_all"),
    are computed there and come back. Without ``expert_axes`` nothing is exchanged.
    """
    tokens, top_k = indices.shape
    local_experts = gate_proj.shape[0]
    flat = indices.reshape(-1)                                            # [tokens*top_k] assignments
    order = jnp.argsort(flat, stable=True)                                # sorted row -> assignment
    x_sorted = jnp.take(x, order // top_k, axis=0)                        # [rows, embed]
    if not expert_axes:
        group_sizes = jnp.zeros((local_experts,), jnp.int32).at[flat].add(1)
        y_sorted = grouped_ffn(x_sorted, group_sizes, gate_proj, up_proj, down_proj, impl, tile)
    else:
        sorted_experts = flat[order]
        exchange = {"all_to_all": _padded_exchange, "ragged_all_to_all": _ragged_exchange}.get(dispatch)
        if exchange is None:
            raise ValueError(f"unknown MoE dispatch {dispatch!r}; expected 'all_to_all' or 'ragged_all_to_all'")
        received, received_experts, send_back = exchange(
            x_sorted, sorted_experts // local_experts, sorted_experts % local_experts, local_experts, expert_axes)
        by_expert = jnp.argsort(received_experts, stable=True)            # padding rows (id = local_experts) last
        group_sizes = jnp.zeros((local_experts,), jnp.int32).at[received_experts].add(1, mode="drop")
        y = grouped_ffn(jnp.take(received, by_expert, axis=0), group_sizes, gate_proj, up_proj, down_proj,
                        impl, tile)
        y_sorted = send_back(_unsort(y, by_expert))
    y = _unsort(y_sorted, order).reshape(tokens, top_k, -1)               # back to assignment order
    return jnp.einsum("tke,tk->te", y, weights.astype(y.dtype))


def _unsort(y_sorted: jax.Array, order: jax.Array) -> jax.Array:
    """Rows of y_sorted (row i is original row order[i]) back in original order."""
    n = order.shape[0]
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return jnp.take(y_sorted, inverse, axis=0)


def _padded_exchange(x, dest, local_expert, local_experts: int, axes: tuple[str, ...]):
    """Dropless padded all-to-all. x: [rows, embed] sorted by destination device ``dest`` [rows];
    every device sends each other device a buffer of ``rows`` slots (enough if all its rows went
    there), its rows first. Returns (received [shards·rows, embed], their local expert ids
    [shards·rows] (``local_experts`` on padding slots), send_back: results in the received layout ->
    [rows, embed] in x's order)."""
    rows = x.shape[0]
    shards = jax.lax.axis_size(axes)
    counts = jnp.zeros((shards,), jnp.int32).at[dest].add(1)
    slot = dest * rows + jnp.arange(rows, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest]
    send = jnp.zeros((shards * rows, x.shape[-1]), x.dtype).at[slot].set(x)
    send_experts = jnp.full((shards * rows,), local_experts, jnp.int32).at[slot].set(local_expert)
    exchange = functools.partial(jax.lax.all_to_all, axis_name=axes, split_axis=0, concat_axis=0, tiled=True)

    def send_back(y):
        return jnp.take(exchange(y), slot, axis=0)

    return exchange(send), exchange(send_experts), send_back


def _ragged_exchange(x, dest, local_expert, local_experts: int, axes: tuple[str, ...]):
    """`_padded_exchange` with `jax.lax.ragged_all_to_all`: only the routed rows travel, packed at
    the front of the receive buffer (same return values; the buffer keeps the dropless worst-case
    size shards·rows). Needs a backend that implements ragged all-to-all (GPU, TPU)."""
    rows, embed = x.shape
    shards = jax.lax.axis_size(axes)
    me = jax.lax.axis_index(axes)
    sizes = jnp.zeros((shards,), jnp.int32).at[dest].add(1)               # rows I send to each device
    counts = jax.lax.all_gather(sizes, axes)                              # [source, destination]
    send_offsets = jnp.cumsum(sizes) - sizes
    land_offsets = (jnp.cumsum(counts, axis=0) - counts)[me]              # where my rows land on each device
    recv_sizes = counts[:, me]
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes                    # where each source's rows are here
    return_offsets = (jnp.cumsum(counts, axis=1) - counts)[:, me]         # where each source keeps them

    def exchange(operand, fill):
        out = jnp.full((shards * rows, *operand.shape[1:]), fill, operand.dtype)
        return jax.lax.ragged_all_to_all(operand, out, send_offsets, sizes, land_offsets, recv_sizes,
                                         axis_name=axes)

    def send_back(y):
        out = jnp.zeros((rows, embed), y.dtype)
        return jax.lax.ragged_all_to_all(y, out, recv_offsets, recv_sizes, return_offsets, sizes, axis_name=axes)

    return exchange(x, 0), exchange(local_expert, local_experts), send_back


def expert_parallel_ffn(x: jax.Array, indices: jax.Array, weights: jax.Array, gate_proj: jax.Array,
                        up_proj: jax.Array, down_proj: jax.Array, *, mesh: jax.sharding.Mesh,
                        rules: ShardingRules, impl: str, dispatch: str) -> jax.Array:
    """`expert_ffn` on a mesh: x [batch, seq, embed], indices / weights [batch, seq, top_k] split by the
    ``batch`` / ``sequence`` rules; expert weights split by ``experts`` (and ``expert_mlp``: tensor
    parallelism inside each expert, partial outputs summed over those axes); each device runs
    `expert_ffn` on its tokens and experts inside ``shard_map`` -> [batch, seq, embed].
    """
    token_spec = rules.spec((BATCH, SEQ, None))
    for dim, part in enumerate(token_spec[:2]):
        axes = () if part is None else (part,) if isinstance(part, str) else tuple(part)
        if x.shape[dim] % axis_size(mesh, axes):
            raise ValueError(f"expert parallelism splits the {('batch', 'sequence')[dim]} dimension "
                             f"({x.shape[dim]}) over mesh axes {axes} ({axis_size(mesh, axes)} devices); "
                             "pad it to a multiple")
    # Expert axes of one device exchange nothing: leave them out (the same numbers, no all-to-all).
    expert_axes = tuple(a for a in rules.mesh_axes("experts") if mesh.shape[a] > 1)
    tensor_axes = rules.mesh_axes("expert_mlp")
    in_spec = rules.spec(("experts", None, "expert_mlp"))
    out_spec = rules.spec(("experts", "expert_mlp", None))

    @functools.partial(jax.shard_map, mesh=mesh, out_specs=token_spec,
                       in_specs=(token_spec, token_spec, token_spec, in_spec, in_spec, out_spec))
    def local(x, indices, weights, gate_proj, up_proj, down_proj):
        b, s, e = x.shape
        out = expert_ffn(x.reshape(b * s, e), indices.reshape(b * s, -1), weights.reshape(b * s, -1),
                         gate_proj, up_proj, down_proj, impl=impl, dispatch=dispatch, expert_axes=expert_axes)
        if tensor_axes:
            out = jax.lax.psum(out, tensor_axes)
        return out.reshape(b, s, e)

    return local(x, indices, weights, gate_proj, up_proj, down_proj)


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
    down_proj [experts, expert_mlp, embed]. The router's expert dimension is never split (each token
    needs all its logits), and expert weights name their embed dimension ``expert_embed`` so that FSDP
    can split it over other mesh axes than the ``embed`` of dense weights."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        e, n, m = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        pd, std = cfg.param_dtype, cfg.initializer_range
        self.router = make_param(rngs, (e, n), ("embed", None), pd, std)
        self.gate_proj = make_param(rngs, (n, e, m), ("experts", "expert_embed", "expert_mlp"), pd, std)
        self.up_proj = make_param(rngs, (n, e, m), ("experts", "expert_embed", "expert_mlp"), pd, std)
        self.down_proj = make_param(rngs, (n, m, e), ("experts", "expert_mlp", "expert_embed"), pd, std)
        self.config = cfg

    def __call__(self, x: jax.Array, token_mask: jax.Array, routing: jax.Array | None = None):
        """x: [batch, seq, embed]; token_mask: [batch, seq] bool; routing: optional [batch, seq, top_k]
        -> (out [batch, seq, embed], indices [batch, seq, top_k] int32, (counts, prob_sums) [experts]).
        """
        cfg = self.config
        b, s, e = x.shape
        dt, top_k = cfg.dtype, cfg.num_experts_per_tok
        flat = x.reshape(b * s, e)
        logits = jnp.einsum("te,en->tn", flat, self.router[...].astype(dt))
        weights, indices, probs = route(logits, top_k, cfg.norm_topk_prob,
                                        None if routing is None else routing.reshape(b * s, -1))
        experts = tuple(w[...].astype(dt) for w in (self.gate_proj, self.up_proj, self.down_proj))
        out = expert_parallel_ffn(x, indices.reshape(b, s, top_k), weights.reshape(b, s, top_k), *experts,
                                  mesh=cfg.mesh, rules=cfg.rules, impl=cfg.moe_impl,
                                  dispatch=cfg.moe_dispatch)
        terms = load_balancing_terms(probs, indices, token_mask.reshape(-1).astype(jnp.float32))
        return constrain(out, HIDDEN, cfg), indices.reshape(b, s, top_k), terms
