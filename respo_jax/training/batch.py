"""Policy-update batches: prompt + sampled response laid out as one left-padded sequence per response.

The trainer recomputes log π_old with a forward pass of the rollout-time parameters (not the sampler's
log-probs, whose gap to the trainer's is logged), then reuses the same rollout batch for N mini-batch
updates (paper §4.1). Everything here is a pure function of arrays.

Shapes are bucketed: the padded prompt and response lengths are rounded up to multiples of a bucket
(`bucket_length`), so a run compiles its update and log-prob programs once per bucket instead of once
per batch. A mini-batch too large for memory is split into micro-batches of whole responses
(`microbatch_size`, `split_microbatches`) whose gradients add up to the mini-batch's exactly.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np

from respo_jax.models.qwen3.model import LOGPROB_CHUNK_TOKENS


@flax.struct.dataclass
class PolicyBatch:
    """One rollout batch, the jit boundary of a policy update.

    input_ids:      [batch, prompt_len + response_len] int32, prompt left-padded, response right-padded
    positions:      [batch, prompt_len + response_len] int32, 0 at the first real prompt token
    attention_mask: [batch, prompt_len + response_len] int32, 1 on real prompt and response tokens
    response_mask:  [batch, response_len] float32, 1 on the generated tokens (EOS included)
    old_logp:       [batch, response_len] float32, log π_old of each response token (0 where masked);
                    None when the update's parameters are π_old (`training.step.make_policy_step` then
                    takes it from the update's own forward)
    advantages:     [batch] float32
    routing:        None, or (Routing Replay) [batch, num_moe_layers, prompt_len + response_len - 1, top_k]
                    int32: the experts the sampler routed each input token to (the model input is the
                    sequence without its last token); log π_old and the policy forward replay them
    sampler_logp:   None, or (rollout correction) [batch, response_len] float32: the sampler's log-prob
                    of each response token (0 where masked)
    ref_logp:       None, or (KL to a reference policy) [batch, response_len] float32: log π_ref of each
                    response token (0 where masked)
    behaviour_logp: None, or (the decoupled objective) [batch, response_len] float32: log-prob of each
                    response token under the policy that generated it (old_logp is then π_prox's)
    prompt_group:   (static) the rows come in consecutive groups of this many with the same prompt
                    (tokens, positions and mask), and the forward runs each group's prompt once
                    (`response_logprobs`); 1: no sharing

    Every array has the rows first, so one sharding of the leading dimension (`batch_sharding`) places
    the whole batch and `take` selects rows of every field alike.
    """

    input_ids: jnp.ndarray
    positions: jnp.ndarray
    attention_mask: jnp.ndarray
    response_mask: jnp.ndarray
    old_logp: jnp.ndarray | None
    advantages: jnp.ndarray
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)
    routing: jnp.ndarray | None = None
    sampler_logp: jnp.ndarray | None = None
    ref_logp: jnp.ndarray | None = None
    behaviour_logp: jnp.ndarray | None = None
    prompt_group: int = flax.struct.field(pytree_node=False, default=1)

    def take(self, rows: np.ndarray) -> "PolicyBatch":
        """The sub-batch of the given rows (a mini-batch; any rows, so no prompt sharing is assumed)."""
        return self.replace(
            prompt_group=1,
            input_ids=self.input_ids[rows],
            positions=self.positions[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            old_logp=None if self.old_logp is None else self.old_logp[rows],
            advantages=self.advantages[rows],
            routing=None if self.routing is None else self.routing[rows],
            sampler_logp=None if self.sampler_logp is None else self.sampler_logp[rows],
            ref_logp=None if self.ref_logp is None else self.ref_logp[rows],
            behaviour_logp=None if self.behaviour_logp is None else self.behaviour_logp[rows],
        )


def bucket_length(length: int, bucket: int, limit: int | None = None) -> int:
    """`length` rounded up to a multiple of `bucket`, at most `limit` (when given, `length` <= `limit`).

    The few distinct padded lengths this yields are the shapes a run compiles for."""
    if bucket < 1 or length < 0 or (limit is not None and length > limit):
        raise ValueError(f"need bucket >= 1 and 0 <= length <= limit; got length={length}, bucket={bucket}, "
                         f"limit={limit}")
    padded = -(-length // bucket) * bucket
    return padded if limit is None else min(padded, limit)


def build_sequences(
    prompts: Sequence[Sequence[int]], responses: np.ndarray, lengths: np.ndarray, pad_id: int,
    prompt_len: int | None = None, response_len: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Joins each prompt (left-padded to `prompt_len`) with its response (right-padded after `lengths`
    to `response_len`).

    prompts: `batch` token lists; responses: [batch, width] int; lengths: [batch] int.
    `prompt_len` defaults to the longest prompt and `response_len` to `width`; a bucketed
    `prompt_len` must hold the longest prompt and `response_len` the longest response (the
    responses are cut or padded to it). Returns input_ids, positions, attention_mask (all
    [batch, prompt_len + response_len]), response_mask [batch, response_len] float32 and prompt_len.
    """
    responses = np.asarray(responses)
    lengths = np.asarray(lengths)
    if responses.ndim != 2 or len(prompts) != responses.shape[0] or lengths.shape != (responses.shape[0],):
        raise ValueError(
            f"expected {len(prompts)} prompts, responses [batch, len] and lengths [batch]; got responses "
            f"{responses.shape} and lengths {lengths.shape}"
        )
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must have at least one token")
    if np.any(lengths < 0) or np.any(lengths > responses.shape[1]):
        raise ValueError(f"lengths must lie in [0, {responses.shape[1]}]; got {lengths.tolist()}")
    batch, width = responses.shape
    longest = max(len(p) for p in prompts)
    prompt_len = longest if prompt_len is None else int(prompt_len)
    response_len = width if response_len is None else int(response_len)
    if prompt_len < longest:
        raise ValueError(f"prompt_len {prompt_len} is shorter than the longest prompt ({longest} tokens)")
    if response_len < int(lengths.max(initial=0)):
        raise ValueError(f"response_len {response_len} is shorter than the longest response "
                         f"({int(lengths.max())} tokens)")
    responses = responses[:, :response_len]
    if response_len > width:
        responses = np.pad(responses, ((0, 0), (0, response_len - width)), constant_values=pad_id)
    input_ids = np.full((batch, prompt_len + response_len), pad_id, dtype=np.int32)
    attention_mask = np.zeros((batch, prompt_len + response_len), dtype=np.int32)
    response_mask = (np.arange(response_len)[None, :] < lengths[:, None]).astype(np.float32)
    for row, prompt in enumerate(prompts):
        input_ids[row, prompt_len - len(prompt) : prompt_len] = prompt
        attention_mask[row, prompt_len - len(prompt) : prompt_len] = 1
    input_ids[:, prompt_len:] = np.where(response_mask > 0, responses, pad_id)
    attention_mask[:, prompt_len:] = response_mask.astype(np.int32)
    positions = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32)
    return input_ids, positions, attention_mask, response_mask, prompt_len


def replay_routing(prompt_routing: np.ndarray, routing: np.ndarray, prompt_len: int,
                   response_len: int) -> np.ndarray:
    """The sampler's routed experts laid out like a `PolicyBatch`'s model input (Routing Replay).

    prompt_routing: [layers, batch, P, top_k], the sampler's left-padded prompts (any P >= every prompt);
    routing: [layers, batch, T, top_k], the generated tokens (T >= response_len);
    -> [batch, layers, prompt_len + response_len - 1, top_k] int32 (`PolicyBatch.routing`'s rows-first
    layout): position j < prompt_len holds the
    prompt token's experts (both layouts are left-padded, so they align at the right; pad slots, whose
    outputs nothing reads, get expert 0), position prompt_len + t the experts of response token t. The
    last response slot is dropped, as the model input drops the last token.
    """
    prompt_routing, routing = np.asarray(prompt_routing), np.asarray(routing)
    if prompt_routing.ndim != 4 or routing.ndim != 4 or prompt_routing.shape[:2] != routing.shape[:2]:
        raise ValueError(f"expected prompt routing and routing [layers, batch, len, top_k] of the same rows; "
                         f"got {prompt_routing.shape} and {routing.shape}")
    if routing.shape[2] < response_len:
        raise ValueError(f"routing covers {routing.shape[2]} generated tokens; the batch has {response_len}")
    layers, batch, sampler_len, top_k = prompt_routing.shape
    prompt = np.zeros((layers, batch, prompt_len, top_k), np.int32)
    keep = min(sampler_len, prompt_len)
    prompt[:, :, prompt_len - keep:] = prompt_routing[:, :, sampler_len - keep:]
    out = np.concatenate([prompt, routing[:, :, :response_len].astype(np.int32)], axis=2)
    return np.ascontiguousarray(out[:, :, :-1].swapaxes(0, 1))


def batch_sharding(mesh, rules):
    """The sharding of every `PolicyBatch` field (and of the trainer's other [batch, ...] inputs): rows
    split by the "batch" rule, everything else whole."""
    return rules.sharding(mesh, ("batch",))


def response_logprobs(model, input_ids, positions, attention_mask, prompt_len: int, temperature: float = 1.0,
                      return_entropy: bool = False, *, chunk_size: int = LOGPROB_CHUNK_TOKENS, routing=None,
                      return_aux: bool = False, forward_only: bool = False, prompt_group: int = 1,
                      entropy_gradient: bool = True):
    """log π(o_t | q, o_<t) of every response slot: [batch, response_len] float32, under the logits divided
    by the rollout ``temperature`` (the distribution the responses were sampled from, before truncation).

    Slot t of the response is predicted by the logits at sequence position prompt_len - 1 + t; the
    vocabulary projection runs for those positions only, ``chunk_size`` tokens at a time.
    ``return_entropy=True``: also the entropy of that full distribution at each slot, (logp, entropy),
    differentiable unless ``entropy_gradient=False`` (a diagnostic; the log-probs' gradient unchanged).
    ``routing`` ([batch, num_moe_layers, seq - 1, top_k], `PolicyBatch.routing`): experts to replay.
    ``return_aux=True`` appends the forward's router load-balancing loss (None for dense models).
    ``forward_only=True``: no gradient will be taken (the model's ``lm_head_forward_impl`` head).
    ``prompt_group``: rows share their prompt in consecutive groups of that many (`PolicyBatch.prompt_group`;
    the model runs each prompt once).
    """
    *values, aux = model.token_logprobs(
        input_ids[:, :-1], input_ids[:, 1:], positions=positions[:, :-1], attention_mask=attention_mask[:, :-1],
        chunk_size=chunk_size, temperature=temperature, return_entropy=return_entropy, start=prompt_len - 1,
        routing=None if routing is None else jnp.swapaxes(routing, 0, 1), return_aux=True,
        forward_only=forward_only, prompt_group=prompt_group, entropy_gradient=entropy_gradient,
    )
    values = tuple(values) if return_entropy else values[0]
    return (values, aux) if return_aux else values


def microbatch_size(rows: int, seq_len: int, max_tokens: int) -> int:
    """Rows per micro-batch so that rows × seq_len <= max_tokens (at least one row), balanced: the
    mini-batch of `rows` splits into ceil(rows / that) micro-batches of equal size (the last one
    padded), never more micro-batches than the budget requires."""
    if rows < 1 or seq_len < 1 or max_tokens < 1:
        raise ValueError(f"need rows, seq_len, max_tokens >= 1; got {rows}, {seq_len}, {max_tokens}")
    fit = max(1, max_tokens // seq_len)
    count = math.ceil(rows / fit)
    return math.ceil(rows / count)


def split_rows(x, zero: bool = True, *, rows_per_microbatch: int):
    """[rows, ...] as [count, rows_per_microbatch, ...] (traceable), the rows missing from the last
    micro-batch filled with zeros (`zero`) or copies of row 0: `split_microbatches`' layout."""
    rows = x.shape[0]
    count = math.ceil(rows / rows_per_microbatch)
    filler = count * rows_per_microbatch - rows
    if filler:
        fill = jnp.zeros_like(x[:1]) if zero else x[:1]
        x = jnp.concatenate([x, jnp.repeat(fill, filler, axis=0)], axis=0)
    return x.reshape(count, rows_per_microbatch, *x.shape[1:])


def split_microbatches(batch: PolicyBatch, rows_per_microbatch: int) -> PolicyBatch:
    """The batch as [count, rows_per_microbatch, ...] arrays (traceable; shapes are static).

    Rows missing from the last micro-batch are filled with copies of row 0 whose response mask and
    advantage are zero: they contribute nothing to any loss total, denominator or gradient, and their
    activations stay finite (an all-padding row would attend to nothing and give NaN)."""
    pad = functools.partial(split_rows, rows_per_microbatch=rows_per_microbatch)
    return batch.replace(
        input_ids=pad(batch.input_ids, False), positions=pad(batch.positions, False),
        attention_mask=pad(batch.attention_mask, False), response_mask=pad(batch.response_mask, True),
        old_logp=None if batch.old_logp is None else pad(batch.old_logp, True),
        advantages=pad(batch.advantages, True),
        routing=None if batch.routing is None else pad(batch.routing, False),
        sampler_logp=None if batch.sampler_logp is None else pad(batch.sampler_logp, True),
        ref_logp=None if batch.ref_logp is None else pad(batch.ref_logp, True),
        behaviour_logp=None if batch.behaviour_logp is None else pad(batch.behaviour_logp, True),
    )
