"""Qwen3 and Qwen3-MoE in Flax NNX, numerically faithful to transformers (paper §4.1 models).

Public API::

    from respo_jax.models import qwen3
    cfg = qwen3.Qwen3Config.preset("qwen3-1.7b")          # "0.6b" … "235b-a22b", "tiny", "tiny-moe"
    model = qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))   # random init (N(0, initializer_range²))
    model = qwen3.init_model(cfg, seed=0)                   # the same; sharded at creation on cfg.mesh
    cfg = qwen3.resolve_config(cfg, mesh)    # what both do first: the mesh (None: 1 device) and kernels
    model = qwen3.from_pretrained(path, dtype=jnp.float32)  # HF dir: config.json + safetensors
    model = qwen3.from_pretrained(path, mesh=mesh, rules=rules)   # each parameter read into its shards
    shardings = qwen3.param_shardings(cfg)                  # NamedSharding per parameter (jit in/out)
    qwen3.save_pretrained(model, out_dir)                   # transformers loads it back

    logits = model(input_ids, positions=None, attention_mask=None)     # [b, s] -> [b, s, vocab] f32
    out = model.forward(input_ids, positions, attention_mask, cache=None, routing=None,
                        return_routing=False)                          # -> Qwen3Output
    cache = qwen3.init_cache(cfg, batch, max_len, dtype=jnp.float32)   # -> KVCache
    cache = qwen3.PagedKVCache(k_pages, v_pages, page_table, impl="gather")  # a paged pool's view
    logp = model.token_logprobs(input_ids, targets, positions, attention_mask, routing,
                                chunk_size=512)                        # [b, s] f32, chunked vocab
    logp, aux = model.token_logprobs(..., return_aux=True)             # + load-balancing loss (MoE)

    # The methods are plain (op by op when called eagerly): the caller jits. Pure functions of
    # (graphdef, params) = nnx.split(model) for that, with their static arguments:
    fwd = jax.jit(qwen3.forward, static_argnames=qwen3.FORWARD_STATIC)
    out = fwd(graphdef, params, input_ids, positions, attention_mask, return_routing=True)
    logps = jax.jit(qwen3.token_logprobs, static_argnames=qwen3.TOKEN_LOGPROBS_STATIC)
    logp = logps(graphdef, params, input_ids, targets, positions, attention_mask, chunk_size=512)

Conventions:
- ``attention_mask`` [b, s]: 1 real token, 0 pad. Without a cache: causal + padding mask.
- ``positions`` [b, s] int32 default to ``cache.index + arange(s)`` (0.. without cache), as in
  transformers; left-padded batches must pass them (e.g. ``cumsum(mask) - 1`` clipped at 0).
- ``forward(..., cache=c)`` writes the s new tokens at slots [c.index, c.index+s), marks them valid
  from ``attention_mask``, attends causally over valid slots, returns the cache with index += s.
  Jit the step with the cache as an argument: one compilation serves every decode position.
- ``forward(..., cache=PagedKVCache(...))`` (positions required) writes each real token's K/V at the
  page and offset its position names in its row's page table and attends over the row's tokens at
  positions <= its own: the rollout engine's prefill, chunked prefill and decode run this forward.
- ``Qwen3Output``: logits [b, s, vocab] f32; cache; routing [num_moe_layers, b, s, top_k] int32 (when
  ``return_routing``); aux_loss = transformers' load-balancing loss over real tokens (MoE only,
  unscaled: multiply by ``cfg.router_aux_loss_coef``).
- Routing Replay: pass ``routing=`` (from ``return_routing``) to reuse the expert choice; gate
  weights still come from the current router probabilities, so the router is trained.
- Decoding: jit a step of ``nnx.merge(graphdef, state).forward(tok, pos, mask, cache=c)`` with
  ``donate_argnums`` on the cache; the cache is updated in place inside the layer loop, which reads
  the model's own weights (per-layer weights without ``scan_layers``: no copy, no per-step slicing).
- Options live in the config: ``dtype`` (compute), ``param_dtype``, ``remat``, the layer loop
  ``scan_layers`` and the kernels ``attention_impl`` / ``moe_impl`` / ``moe_dispatch``: ``None``
  (the default) is chosen for the mesh's platform in one place (``kernels.py``: ``default_kernels``,
  ``resolve_config``), at the entry points; ``mesh`` / ``rules`` (``respo_jax.sharding``).
- Sharding: every model runs under a mesh (one device: 1×1×1×1). Every parameter carries logical
  axis names as NNX ``out_sharding`` metadata and every activation constraint names its axes;
  ``cfg.rules`` maps them to ``cfg.mesh``'s axes, and the MoE layers run expert-parallel inside
  ``shard_map`` (axes of one device exchange nothing).
"""

from respo_jax.models.qwen3.cache import KVCache, init_cache
from respo_jax.models.qwen3.checkpoint import from_pretrained, hf_state_dict, load_config, save_pretrained
from respo_jax.models.qwen3.config import PRESETS, Qwen3Config
from respo_jax.models.qwen3.kernels import default_kernels, default_mesh, resolve_config
from respo_jax.models.qwen3.model import (
    FORWARD_STATIC,
    TOKEN_LOGPROBS_STATIC,
    Qwen3ForCausalLM,
    Qwen3Output,
    forward,
    init_model,
    param_shardings,
    token_logprobs,
)
from respo_jax.models.qwen3.moe import load_balancing_loss
from respo_jax.models.qwen3.paged_attention import PagedKVCache

__all__ = [
    "FORWARD_STATIC", "TOKEN_LOGPROBS_STATIC", "forward", "token_logprobs",
    "PRESETS", "KVCache", "PagedKVCache",
    "Qwen3Config", "Qwen3ForCausalLM", "Qwen3Output", "default_kernels", "from_pretrained",
    "hf_state_dict", "init_cache", "init_model", "load_balancing_loss", "load_config", "param_shardings",
    "save_pretrained", "resolve_config", "default_mesh",
]
