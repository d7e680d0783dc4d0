"""The model's methods through one `jax.jit` each, for tests that call a model directly.

`Qwen3ForCausalLM.forward` / `token_logprobs` hold no jit (the caller jits, as the trainer and the
sampler do); called eagerly they run op by op. These wrappers jit the pure functions
`qwen3.forward` / `qwen3.token_logprobs` instead, so every test shares one compiled program per
(model structure, shapes, options) — the same way a caller outside the tests would jit them.
"""

from __future__ import annotations

import jax
from flax import nnx

from respo_jax.models import qwen3
from respo_jax.training import batch as batch_module

_FORWARD = jax.jit(qwen3.forward, static_argnames=qwen3.FORWARD_STATIC)
_TOKEN_LOGPROBS = jax.jit(qwen3.token_logprobs, static_argnames=qwen3.TOKEN_LOGPROBS_STATIC)


def forward(model, input_ids, positions=None, attention_mask=None, cache=None, routing=None,
            return_routing=False) -> qwen3.Qwen3Output:
    """`model.forward(...)` compiled."""
    graphdef, params = nnx.split(model)
    return _FORWARD(graphdef, params, input_ids, positions, attention_mask, cache, routing,
                    return_routing=bool(return_routing))


def logits(model, input_ids, positions=None, attention_mask=None):
    """`model(...)` compiled: [batch, seq, vocab] float32."""
    return forward(model, input_ids, positions, attention_mask).logits


def token_logprobs(model, input_ids, targets, positions=None, attention_mask=None, routing=None, **options):
    """`model.token_logprobs(...)` compiled (options: chunk_size, start, temperature, return_entropy,
    return_aux)."""
    graphdef, params = nnx.split(model)
    return _TOKEN_LOGPROBS(graphdef, params, input_ids, targets, positions, attention_mask, routing, **options)


def _response_logprobs(graphdef, params, input_ids, positions, attention_mask, prompt_len, **options):
    return batch_module.response_logprobs(nnx.merge(graphdef, params), input_ids, positions, attention_mask,
                                          prompt_len, **options)


_RESPONSE_LOGPROBS = jax.jit(_response_logprobs, static_argnames=(
    "graphdef", "prompt_len", "temperature", "return_entropy", "chunk_size", "return_aux"))


def response_logprobs(model, input_ids, positions, attention_mask, prompt_len, **options):
    """`respo_jax.training.batch.response_logprobs(model, ...)` compiled."""
    graphdef, params = nnx.split(model)
    return _RESPONSE_LOGPROBS(graphdef, params, input_ids, positions, attention_mask, int(prompt_len), **options)
