"""The Qwen3 / Qwen3-MoE causal language model in Flax NNX (the policy of paper §4.1).

The layer loop is a config field (``scan_layers``, chosen per platform by ``kernels``), and the
weights are stored for it: with ``scan_layers`` each run of same-kind layers (``Qwen3Config.
layer_groups``) is one stacked module (a leading ``layers`` axis) executed by ``lax.scan`` over its
``nnx.split`` state, so the compile time does not grow with depth; without, every layer is a module
of its own and a Python loop runs them. Why the second: on XLA:CPU a scan (or a slice) of stacked
weights copies every layer's weights at every step, about half of a batch-1 decode step; per-layer
weights are read in place, so the sampler decodes with the model's own parameters and no copy.
Either loop optionally runs under ``jax.checkpoint``; the KV cache rides in the carry and is updated
in place with ``dynamic_update_slice``. The forward can return each MoE layer's expert indices and
accept indices to replay (Routing Replay, §4.3 / App. E.4).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models.qwen3.attention import Attention, attention_mask_from_slots
from respo_jax.models.qwen3.cache import KVCache, init_cache
from respo_jax.models.qwen3.config import Qwen3Config
from respo_jax.models.qwen3.kernels import resolve_config
from respo_jax.models.qwen3.layers import BATCH, HIDDEN, SEQ, RMSNorm, constrain, make_param, rope_cos_sin, rows
from respo_jax.models.qwen3.lm_head import LSE_LANES, chunked_token_logprobs
from respo_jax.models.qwen3.mlp import MLP
from respo_jax.models.qwen3.moe import MoE, load_balancing_loss_from_terms
from respo_jax.models.qwen3.paged_attention import PagedKVCache
from respo_jax.sharding import axis_size, sharded_init, state_shardings


# Tokens per chunk of the vocabulary projection in ``token_logprobs``: [1024, 151,936] float32 logits
# are 620 MB. Under a gradient, larger chunks win (fewer [vocab, embed] gradient accumulations); a
# forward-only pass (log π_old and its entropy) with whole-vocabulary logits (``token_chunks``) is
# faster in small chunks, whose logits stay in cache (the measurements are in
# docs/results/benchmarks.md, RL iterations); the vocabulary-blocked kernel keeps only a block in
# cache whatever the chunk, so it takes the large chunks.
LOGPROB_CHUNK_TOKENS = 1024
INFERENCE_CHUNK_TOKENS = 64


def forward_chunk_tokens(lm_head_impl: str) -> int:
    """Tokens per chunk of a forward-only log-prob pass with the head kernel `lm_head_impl`."""
    return LOGPROB_CHUNK_TOKENS if lm_head_impl == "vocab_chunks" else INFERENCE_CHUNK_TOKENS


@flax.struct.dataclass
class Qwen3Output:
    """logits: [batch, seq, vocab] float32; cache: the updated KVCache or PagedKVCache (None without);
    routing: [num_moe_layers, batch, seq, top_k] int32 (when requested, MoE only); aux_loss: scalar
    load-balancing loss over real tokens (MoE only; not yet scaled by ``router_aux_loss_coef``)."""

    logits: jax.Array
    cache: KVCache | PagedKVCache | None = None
    routing: jax.Array | None = None
    aux_loss: jax.Array | None = None


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(·)) with a dense or sparse MLP."""

    def __init__(self, cfg: Qwen3Config, is_moe: bool, *, rngs: nnx.Rngs):
        e, pd, dt = cfg.hidden_size, cfg.param_dtype, cfg.dtype
        self.input_layernorm = RMSNorm(e, cfg.rms_norm_eps, "embed", param_dtype=pd, dtype=dt)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(e, cfg.rms_norm_eps, "embed", param_dtype=pd, dtype=dt)
        if is_moe:
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg, rngs=rngs)
        self.is_moe = is_moe


class LayerStack(nnx.Module):
    """``count`` consecutive decoder layers of one kind starting at ``first``. With
    ``cfg.scan_layers`` ``layers`` is one DecoderLayer whose every parameter has a leading ``layers``
    axis of length ``count``; without, a list of ``count`` DecoderLayers with the same values (the
    stacked initialisation, split per layer, so both layouts start from the same weights)."""

    def __init__(self, cfg: Qwen3Config, first: int, count: int, is_moe: bool, *, rngs: nnx.Rngs):
        self.first, self.count, self.is_moe = first, count, is_moe

        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, is_moe, rngs=rngs)

        stacked = make(rngs)
        if cfg.scan_layers:
            self.layers = stacked
            return
        values = nnx.to_pure_dict(nnx.state(stacked))

        def layer(i: int) -> DecoderLayer:
            graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, is_moe, rngs=nnx.Rngs(0))))
            nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: a[i], values))
            return nnx.merge(graphdef, state)

        self.layers = nnx.List([layer(i) for i in range(count)])


@dataclasses.dataclass(frozen=True)
class _Context:
    """Per-forward constants shared by all layers."""

    cos: jax.Array          # [batch, seq, head_dim]
    sin: jax.Array          # [batch, seq, head_dim]
    mask: jax.Array | None  # [batch, seq, seq] bool without a cache (causal + padding)
    token_mask: jax.Array   # [batch, seq] bool
    view: Any               # the cache's per-forward view (`KVCache.view` / `PagedKVCache.view`), or None


def _layer_forward(layer: DecoderLayer, x: jax.Array, ctx: _Context, cache, layer_idx, routing):
    """One decoder layer. x: [batch, seq, embed]; cache: None, a `KVCache` or a `PagedKVCache` (its
    layer `layer_idx` written with the new tokens' K/V, then attended over); routing: None or
    [batch, seq, top_k]."""
    q, k, v = layer.attn.project(layer.input_layernorm(x), ctx.cos, ctx.sin)
    if cache is None:
        attn = layer.attn.attend(q, k, v, ctx.mask)
    else:
        cache = cache.update(layer_idx, k, v, ctx.view, layer.attn.config)
        attn = cache.attend(layer_idx, q, ctx.view, layer.attn.scale)
    x = x + layer.attn.output(attn)
    h = layer.post_attention_layernorm(x)
    if layer.is_moe:
        y, indices, terms = layer.mlp(h, ctx.token_mask, routing)
    else:
        y, indices, terms = layer.mlp(h), None, None
    return constrain(x + y, HIDDEN, layer.attn.config), cache, indices, terms


def _run_stack(stack: LayerStack, cfg: Qwen3Config, x, ctx: _Context, cache, routing):
    """Run a LayerStack (scanned or unrolled, as its weights are stored; optionally rematerialised).
    Returns (x, cache, indices [count, batch, seq, top_k] | None, terms ([count, E], [count, E]) | None)."""

    def layer_step(graphdef):
        def step(carry, xs):
            x, cache = carry
            layer_state, layer_idx, layer_routing = xs
            layer = nnx.merge(graphdef, layer_state)
            x, cache, indices, terms = _layer_forward(layer, x, ctx, cache, layer_idx, layer_routing)
            return (x, cache), (indices, terms)

        return jax.checkpoint(step, prevent_cse=not cfg.scan_layers) if cfg.remat else step

    layer_ids = stack.first + jnp.arange(stack.count, dtype=jnp.int32)
    if cfg.scan_layers:
        graphdef, state = nnx.split(stack.layers)
        (x, cache), (indices, terms) = jax.lax.scan(layer_step(graphdef), (x, cache), (state, layer_ids, routing))
        return x, cache, indices, terms
    outs = []
    for i, layer in enumerate(stack.layers):
        graphdef, state = nnx.split(layer)
        layer_routing = None if routing is None else routing[i]
        (x, cache), y = layer_step(graphdef)((x, cache), (state, layer_ids[i], layer_routing))
        outs.append(y)
    indices, terms = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return x, cache, indices, terms


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 / Qwen3-MoE causal LM. Parameters: ``embed_tokens`` [vocab, embed], ``stacks`` (one
    LayerStack per ``cfg.layer_groups`` entry), ``norm``, ``lm_head`` [embed, vocab] (None if tied).

    ``forward`` and ``token_logprobs`` are plain code: they check their inputs' shapes (with errors
    naming the argument, also while being traced) and run the layers; nothing is jitted inside. The
    caller jits — the trainer's step and the sampler jit pure functions of (parameters, inputs) with
    their shardings; ``qwen3.forward`` / ``qwen3.token_logprobs`` are those pure functions for anyone
    else (``jax.jit(qwen3.forward, static_argnames=qwen3.FORWARD_STATIC)``). Called eagerly, the
    methods run op by op.
    """

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        cfg = self.config = resolve_config(cfg)  # an entry point: mesh and kernels, if left to it
        pd, std = cfg.param_dtype, cfg.initializer_range
        self.embed_tokens = make_param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd, std)
        self.stacks = nnx.List([LayerStack(cfg, first, count, is_moe, rngs=rngs)
                                for first, count, is_moe in cfg.layer_groups])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", param_dtype=pd, dtype=cfg.dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        make_param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd, std))

    # ----------------------------------------------------------------------------------------------

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        """input_ids: [batch, seq] int -> logits [batch, seq, vocab] float32."""
        return self.forward(input_ids, positions, attention_mask).logits

    def forward(self, input_ids: jax.Array, positions: jax.Array | None = None,
                attention_mask: jax.Array | None = None, cache: KVCache | PagedKVCache | None = None,
                routing: jax.Array | None = None, return_routing: bool = False) -> Qwen3Output:
        """Full forward.

        input_ids: [batch, seq] int; positions: [batch, seq] int (default ``cache.index + arange(seq)``,
        pass them explicitly for left-padded rows); attention_mask: [batch, seq] (1 real, 0 pad);
        cache: a KVCache to extend, or a PagedKVCache (the rollout engine's pages; positions required);
        routing: [num_moe_layers, batch, seq, top_k] expert indices to replay;
        return_routing: also return the expert indices used.
        """
        args = _check_inputs(self.config, input_ids, positions, attention_mask, cache, routing)
        return self._forward_impl(*args, bool(return_routing))

    def token_logprobs(self, input_ids: jax.Array, targets: jax.Array, positions: jax.Array | None = None,
                       attention_mask: jax.Array | None = None, routing: jax.Array | None = None,
                       chunk_size: int = LOGPROB_CHUNK_TOKENS, return_aux: bool = False,
                       temperature: float = 1.0,
                       return_entropy: bool = False, *, start: int = 0, forward_only: bool = False,
                       prompt_group: int = 1, entropy_gradient: bool = True):
        """log π(targets[b, t] | input_ids[b, :t+1]) for t in [start, seq): [batch, seq - start] float32.

        The decoder runs over the whole sequence; the vocabulary projection and the log-softmax run
        only for positions ``start:`` (e.g. the response of a prompt + response sequence), over about
        ``chunk_size`` tokens at a time in the forward and the backward pass (``lm_head``), so float32
        logits never exist for more than one chunk (the vocabulary is 151,936). ``temperature``
        divides the logits first (π of the sampling temperature, as the sampler and verl's actor do).
        ``return_entropy=True`` also returns the entropy of the full distribution at each scored
        position, [batch, seq - start]: ``(logp, entropy)``, both differentiable (an entropy bonus)
        unless ``forward_only``; ``entropy_gradient=False``: the entropy a diagnostic, the log-probs'
        gradient the one without it. ``forward_only=True`` (no gradient will be taken) runs the head kernel
        ``lm_head_forward_impl`` instead of ``lm_head_impl``.
        ``return_aux=True`` appends ``aux_loss`` from the same forward (MoE trainers add
        ``router_aux_loss_coef · aux``; ``aux_loss`` is None for dense models).

        ``prompt_group`` > 1 (dense models, no routing): the rows come in consecutive groups of that
        many whose first ``start + 1`` tokens (the prompt, with its positions and mask) are the same,
        as a GRPO mini-batch's G responses to one prompt are; each group's prompt runs once and its
        responses attend to its keys and values (`_shared_prompt_backbone`): the same log-probs and
        gradients, without G - 1 copies of the prompt's forward and backward.
        """
        input_ids, positions, attention_mask, _, routing = _check_inputs(
            self.config, input_ids, positions, attention_mask, None, routing)
        prompt_group = int(prompt_group)
        if prompt_group < 1 or input_ids.shape[0] % prompt_group:
            raise ValueError(f"prompt_group must be >= 1 and divide the batch ({input_ids.shape[0]} rows); "
                             f"got {prompt_group}")
        if prompt_group > 1 and self.config.is_moe:  # (routing: MoE only, `_check_inputs`)
            raise ValueError("prompt_group > 1 needs a dense model without routing (a MoE's load-balancing "
                             "loss counts every row's prompt tokens)")
        targets = jnp.asarray(targets)
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets has shape {targets.shape}; input_ids has {input_ids.shape}")
        if int(chunk_size) <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if not 0 <= int(start) < input_ids.shape[1]:
            raise ValueError(f"start must lie in [0, {input_ids.shape[1]}) (the sequence length); "
                             f"got {start}")
        if not (float(temperature) > 0 and math.isfinite(float(temperature))):
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
        logp, entropy, aux = self._token_logprobs_impl(
            input_ids, targets, positions, attention_mask, routing, int(chunk_size), int(start),
            float(temperature), bool(return_entropy), bool(forward_only), prompt_group,
            bool(entropy_gradient))
        out = (logp, entropy) if return_entropy else (logp,)
        out = out + (aux,) if return_aux else out
        return out if len(out) > 1 else logp

    # ----------------------------------------------------------------------------------------------

    def _forward_impl(self, input_ids, positions, attention_mask, cache, routing, return_routing):
        hidden, cache, indices, aux = self._backbone(input_ids, positions, attention_mask, cache, routing)
        logits = constrain(self._project(hidden), (BATCH, SEQ, "vocab"), self.config)
        return Qwen3Output(logits=logits, cache=cache, routing=indices if return_routing else None,
                           aux_loss=aux)

    def _token_logprobs_impl(self, input_ids, targets, positions, attention_mask, routing, chunk_size,
                             start=0, temperature=1.0, return_entropy=False, forward_only=False,
                             prompt_group=1, entropy_gradient=True):
        if prompt_group > 1:
            hidden, aux = self._shared_prompt_backbone(input_ids, positions, attention_mask, start + 1,
                                                       prompt_group), None
        else:
            hidden, _, _, aux = self._backbone(input_ids, positions, attention_mask, None, routing)
            hidden = hidden[:, start:]
        weight, tied = self._output_weight()
        impl = self.config.lm_head_forward_impl if forward_only else self.config.lm_head_impl
        # A vocabulary split over devices keeps whole rows in the log-sum-exp (a [vocab / 128, 128] view
        # would split its shards).
        lanes = LSE_LANES if axis_size(self.config.mesh, self.config.rules.vocab) == 1 else 1
        out = chunked_token_logprobs(hidden, weight, targets[:, start:], tied=tied,
                                     temperature=temperature, chunk_tokens=chunk_size,
                                     return_entropy=return_entropy,
                                     entropy_gradient=entropy_gradient and not forward_only,
                                     impl=impl, lse_lanes=lanes)
        logp, entropy = out if return_entropy else (out, None)
        return logp, entropy, aux

    def _shared_prompt_backbone(self, input_ids, positions, attention_mask, prompt_len: int, group: int):
        """The final hidden states at positions ``prompt_len - 1:`` ([batch, seq - prompt_len + 1,
        embed]) of rows whose first ``prompt_len`` tokens are shared by consecutive groups of ``group``
        rows: the first row of each group runs its prompt into a KV cache, the cache is repeated over
        the group, and every row runs its remaining tokens over it (the attention mask is the one of
        the whole sequence: causal over valid slots). The prompt's gradient is the sum of the group's.
        """
        b, s = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if attention_mask is None:
            attention_mask = jnp.ones((b, s), jnp.int32)
        first = slice(None, None, group)
        cache = init_cache(self.config, b // group, s, dtype=self.config.dtype)
        prompt = (first, slice(None, prompt_len))
        prompt_hidden, cache, _, _ = self._backbone(input_ids[prompt], positions[prompt],
                                                    attention_mask[prompt], cache, None)
        cache = KVCache(k=jnp.repeat(cache.k, group, axis=1), v=jnp.repeat(cache.v, group, axis=1),
                        valid=jnp.repeat(cache.valid, group, axis=0), index=cache.index)
        rest, _, _, _ = self._backbone(input_ids[:, prompt_len:], positions[:, prompt_len:],
                                       attention_mask[:, prompt_len:], cache, None)
        last = jnp.repeat(prompt_hidden[:, -1:], group, axis=0)
        return jnp.concatenate([last, rest], axis=1)

    def _output_weight(self):
        dt = self.config.dtype
        if self.lm_head is None:
            return self.embed_tokens[...].astype(dt), True
        return self.lm_head[...].astype(dt), False

    def _project(self, hidden: jax.Array) -> jax.Array:
        weight, tied = self._output_weight()
        return _project_with(hidden, weight, tied)

    def _backbone(self, input_ids, positions, attention_mask, cache, routing):
        """Embeddings → decoder stacks → final norm on validated inputs. Returns (hidden [batch, seq,
        embed], cache, indices [num_moe_layers, batch, seq, top_k] | None, aux_loss | None)."""
        cfg = self.config
        b, s = input_ids.shape
        if positions is None:
            index = cache.index if isinstance(cache, KVCache) else jnp.zeros((), jnp.int32)
            positions = jnp.broadcast_to(index + jnp.arange(s, dtype=jnp.int32), (b, s))
        positions = positions.astype(jnp.int32)
        token_mask = (jnp.ones((b, s), jnp.bool_) if attention_mask is None
                      else attention_mask.astype(jnp.bool_))
        mask = view = None
        if cache is None:
            mask = attention_mask_from_slots(jnp.arange(s, dtype=jnp.int32), token_mask)
        else:
            view = cache.view(positions, token_mask, cfg)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        ctx = _Context(cos=cos, sin=sin, mask=mask, token_mask=token_mask, view=view)

        # The lookup reads whole rows: gather the table's FSDP-split embed dimension first (vocab may stay
        # split; the partitioner then gathers locally and sums over those axes).
        table = constrain(self.embed_tokens[...], ("vocab", None), cfg)
        x = jnp.take(table, input_ids, axis=0).astype(cfg.dtype)
        x = constrain(x, HIDDEN, cfg)
        all_indices, counts, prob_sums = [], 0.0, 0.0
        moe_offset = 0
        for stack in self.stacks:
            stack_routing = None
            if stack.is_moe and routing is not None:
                stack_routing = routing[moe_offset:moe_offset + stack.count]
            x, cache, indices, terms = _run_stack(stack, cfg, x, ctx, cache, stack_routing)
            if stack.is_moe:
                moe_offset += stack.count
                all_indices.append(indices)
                counts = counts + jnp.sum(terms[0], axis=0)
                prob_sums = prob_sums + jnp.sum(terms[1], axis=0)
        hidden = self.norm(x)

        new_cache = None if cache is None else cache.advance(view)
        indices = aux = None
        if cfg.is_moe:
            indices = jnp.concatenate(all_indices, axis=0)
            routed = cfg.num_moe_layers * jnp.sum(token_mask.astype(jnp.float32))
            aux = load_balancing_loss_from_terms(counts, prob_sums, routed)
        return hidden, new_cache, indices, aux


def init_model(cfg: Qwen3Config, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised model (N(0, initializer_range²) weights, unit norms), created by one jit
    on ``cfg.mesh`` (None: one device; kernels resolved by ``kernels.resolve_config``): every parameter
    comes out of that jit already split by ``cfg.rules``, never materialised whole on one device, with
    the same values on every mesh (same seed)."""
    cfg = resolve_config(cfg)

    def create():
        return Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed))

    return sharded_init(create, cfg.mesh, cfg.rules)


def param_shardings(cfg: Qwen3Config) -> nnx.State:
    """NamedSharding of every parameter of a model of ``cfg`` (on its mesh; None: one device), as a
    prefix of ``nnx.state(model)``: the ``in_shardings`` / ``out_shardings`` of a jit taking them."""
    cfg = resolve_config(cfg)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    return state_shardings(nnx.state(abstract), cfg.mesh, cfg.rules)


# The static arguments of the pure functions below, for ``jax.jit(..., static_argnames=...)``.
FORWARD_STATIC = ("graphdef", "return_routing")
TOKEN_LOGPROBS_STATIC = ("graphdef", "chunk_size", "start", "temperature", "return_entropy", "return_aux",
                         "forward_only", "prompt_group")


def forward(graphdef: nnx.GraphDef, params: nnx.State, input_ids: jax.Array,
            positions: jax.Array | None = None, attention_mask: jax.Array | None = None,
            cache: KVCache | None = None, routing: jax.Array | None = None, *,
            return_routing: bool = False) -> Qwen3Output:
    """``Qwen3ForCausalLM.forward`` as a pure function of ``(graphdef, params)`` = ``nnx.split(model)``
    and the inputs, for a caller to jit (``static_argnames=FORWARD_STATIC``) with its own shardings
    and donation (e.g. ``donate_argnames="cache"`` for a decode step)."""
    return nnx.merge(graphdef, params).forward(input_ids, positions, attention_mask, cache, routing,
                                               return_routing)


def token_logprobs(graphdef: nnx.GraphDef, params: nnx.State, input_ids: jax.Array, targets: jax.Array,
                   positions: jax.Array | None = None, attention_mask: jax.Array | None = None,
                   routing: jax.Array | None = None, *, chunk_size: int = LOGPROB_CHUNK_TOKENS,
                   start: int = 0, temperature: float = 1.0, return_entropy: bool = False,
                   return_aux: bool = False, forward_only: bool = False, prompt_group: int = 1):
    """``Qwen3ForCausalLM.token_logprobs`` as a pure function of ``(graphdef, params)`` and the inputs,
    for a caller to jit (``static_argnames=TOKEN_LOGPROBS_STATIC``)."""
    return nnx.merge(graphdef, params).token_logprobs(
        input_ids, targets, positions, attention_mask, routing, chunk_size=chunk_size, return_aux=return_aux,
        temperature=temperature, return_entropy=return_entropy, start=start, forward_only=forward_only,
        prompt_group=prompt_group)


def _project_with(hidden: jax.Array, weight: jax.Array, tied: bool) -> jax.Array:
    """hidden [..., embed] -> float32 logits [..., vocab] (weight: [vocab, embed] if tied else
    [embed, vocab])."""
    logits = jnp.einsum("te,ve->tv" if tied else "te,ev->tv", rows(hidden), weight,
                        preferred_element_type=jnp.float32)
    return logits.reshape(*hidden.shape[:-1], -1)


def _check_inputs(cfg: Qwen3Config, input_ids, positions, attention_mask, cache, routing):
    """Shape checks (eager, so errors name the argument); returns the arguments as arrays."""
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be an integer [batch, seq] array, got {input_ids.dtype} "
                         f"{input_ids.shape}")
    b, s = input_ids.shape
    out = [input_ids]
    for name, value in (("positions", positions), ("attention_mask", attention_mask)):
        if value is not None:
            value = jnp.asarray(value)
            if value.shape != (b, s):
                raise ValueError(f"{name} has shape {value.shape}; input_ids has {(b, s)}")
        out.append(value)
    if isinstance(cache, PagedKVCache):
        _check_paged_cache(cache, cfg, b, out[1])
    elif cache is not None:
        _check_cache(cache, cfg, b, s)
    out.append(cache)
    if routing is not None:
        routing = jnp.asarray(routing)
        expected = (cfg.num_moe_layers, b, s, cfg.num_experts_per_tok)
        if not cfg.is_moe or routing.shape != expected:
            raise ValueError(f"routing has shape {routing.shape}; expected {expected} "
                             "([num_moe_layers, batch, seq, top_k])")
    out.append(routing)
    return tuple(out)


def _check_paged_cache(cache: PagedKVCache, cfg: Qwen3Config, batch: int, positions) -> None:
    pool = cache.k_pages.shape
    if (len(pool) != 6 or (pool[0], pool[2]) != (cfg.num_key_value_heads, cfg.num_hidden_layers)
            or pool[5] != cfg.head_dim or cache.v_pages.shape != pool):
        raise ValueError(f"k_pages/v_pages have shape {pool}/{cache.v_pages.shape}; expected "
                         f"({cfg.num_key_value_heads}, shards, {cfg.num_hidden_layers}, pages, page_size, "
                         f"{cfg.head_dim}) ([kv_heads, shards, num_layers, num_pages + 1, page_size, "
                         "head_dim])")
    if batch % pool[1]:
        raise ValueError(f"a batch of {batch} rows does not split over the pool's {pool[1]} shards")
    if cache.page_table.ndim != 2 or cache.page_table.shape[0] != batch:
        raise ValueError(f"page_table has shape {cache.page_table.shape}; expected ({batch}, max_pages)")
    if positions is None:
        raise ValueError("a forward over a PagedKVCache needs explicit positions (each token's place in its row)")


def _check_cache(cache: KVCache, cfg: Qwen3Config, batch: int, seq: int) -> None:
    expected = (cfg.num_hidden_layers, batch, cache.max_len, cfg.num_key_value_heads, cfg.head_dim)
    if cache.k.shape != expected or cache.v.shape != expected:
        raise ValueError(f"cache k/v have shape {cache.k.shape}/{cache.v.shape}; expected {expected} "
                         "([num_layers, batch, max_len, kv_heads, head_dim])")
    if seq > cache.max_len:
        raise ValueError(f"{seq} new tokens do not fit a cache of max_len {cache.max_len}")
    if not isinstance(cache.index, jax.core.Tracer) and int(cache.index) + seq > cache.max_len:
        raise ValueError(f"cache overflow: index {int(cache.index)} + {seq} new tokens > max_len "
                         f"{cache.max_len}")
