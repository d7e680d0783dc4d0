"""Model FLOPs of a Qwen3 train step and decode step, and the achieved fraction of a measured peak (MFU).

Counting convention (PaLM, App. B): a train step costs 6·N·T FLOPs for the weight matmuls — forward 2·N·T,
backward 4·N·T — plus attention's two score/value matmuls, 12·L·H·D·S FLOPs per token for a sequence
of S positions (full S×S, as both implementations compute it; a causal kernel would do half).
N counts the parameters that take part in a matmul per token: the decoder layers' projections (for
MoE, the router and only the ``top_k`` routed experts: the *active* parameters) and the output
projection (counted even when tied); the embedding lookup is a gather and costs no FLOPs. Work that
an implementation adds on top (rematerialization, recomputed logits) is not counted: MFU measures
useful model FLOPs.
"""

from __future__ import annotations

from respo_jax.models.qwen3 import Qwen3Config


def layer_matmul_params(cfg: Qwen3Config, layer: int) -> int:
    """Parameters of layer `layer` that multiply each token's activations (MoE: active experts only)."""
    e, h, kvh, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attention = e * h * d + 2 * e * kvh * d + h * d * e
    if cfg.is_moe_layer(layer):
        mlp = e * cfg.num_experts + cfg.num_experts_per_tok * 3 * e * cfg.moe_intermediate_size
    else:
        mlp = 3 * e * cfg.intermediate_size
    return attention + mlp


def active_matmul_params(cfg: Qwen3Config) -> int:
    """N of the 6·N·T rule: per-token matmul parameters of all layers plus the output projection."""
    return sum(layer_matmul_params(cfg, i) for i in range(cfg.num_hidden_layers)) + cfg.hidden_size * cfg.vocab_size


def total_params(cfg: Qwen3Config) -> int:
    """Every stored parameter (all experts, embeddings, norms; the output projection once if tied)."""
    e, h, kvh, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    total = cfg.vocab_size * e + e  # embeddings + final norm
    if not cfg.tie_word_embeddings:
        total += e * cfg.vocab_size
    for layer in range(cfg.num_hidden_layers):
        total += e * h * d + 2 * e * kvh * d + h * d * e + 2 * d + 2 * e  # attention, q/k norms, 2 layer norms
        if cfg.is_moe_layer(layer):
            total += e * cfg.num_experts + cfg.num_experts * 3 * e * cfg.moe_intermediate_size
        else:
            total += 3 * e * cfg.intermediate_size
    return total


def attention_flops_per_token(cfg: Qwen3Config, keys: int) -> float:
    """Forward FLOPs of QKᵀ and PV for one query attending to `keys` positions, summed over layers."""
    return 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * keys


def train_step_flops(cfg: Qwen3Config, batch: int, seq: int) -> dict:
    """Model FLOPs of forward + backward on [batch, seq]: {"total", "matmul", "attention", "params_active"}."""
    tokens = batch * seq
    n = active_matmul_params(cfg)
    matmul = 6.0 * n * tokens
    attention = 3.0 * attention_flops_per_token(cfg, seq) * tokens
    return {"total": matmul + attention, "matmul": matmul, "attention": attention, "params_active": n,
            "params_total": total_params(cfg), "tokens": tokens}


def decode_step_flops(cfg: Qwen3Config, batch: int, context: int) -> float:
    """Forward FLOPs of one decode step: `batch` new tokens, each attending to `context` cached keys."""
    return batch * (2.0 * active_matmul_params(cfg) + attention_flops_per_token(cfg, context))


def decode_step_bytes(cfg: Qwen3Config, batch: int, context: int, param_bytes: int, cache_bytes: int) -> float:
    """Minimum bytes one decode step must read from memory: every weight that a token touches once per
    step (for MoE at most min(num_experts, batch·top_k) experts per layer) plus the K and V cache of
    `context` positions of every row."""
    e = cfg.hidden_size
    weights = 0
    for layer in range(cfg.num_hidden_layers):
        attention = e * cfg.num_attention_heads * cfg.head_dim * 2 + 2 * e * cfg.num_key_value_heads * cfg.head_dim
        if cfg.is_moe_layer(layer):
            experts = min(cfg.num_experts, batch * cfg.num_experts_per_tok)
            mlp = e * cfg.num_experts + experts * 3 * e * cfg.moe_intermediate_size
        else:
            mlp = 3 * e * cfg.intermediate_size
        weights += attention + mlp
    weights += e * cfg.vocab_size
    kv = 2 * cfg.num_hidden_layers * batch * context * cfg.num_key_value_heads * cfg.head_dim
    return float(weights * param_bytes + kv * cache_bytes)


def mfu(model_flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Achieved fraction of the peak: model_flops / seconds / peak."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError(f"need positive time and peak; got seconds={seconds}, peak={peak_flops_per_s}")
    return model_flops / seconds / peak_flops_per_s
