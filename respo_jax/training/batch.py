"""Policy-update batches: prompt + sampled response laid out as one left-padded sequence per response.

The trainer recomputes log π_old with a forward pass of the rollout-time parameters (not the sampler's
log-probs, whose gap to the trainer's is logged), then reuses the same rollout batch for N mini-batch
updates (paper §4.1). Everything here is a pure function of arrays.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class PolicyBatch:
    """One rollout batch, the jit boundary of a policy update.

    input_ids:      [batch, prompt_len + response_len] int32, prompt left-padded, response right-padded
    positions:      [batch, prompt_len + response_len] int32, 0 at the first real prompt token
    attention_mask: [batch, prompt_len + response_len] int32, 1 on real prompt and response tokens
    response_mask:  [batch, response_len] float32, 1 on the generated tokens (EOS included)
    old_logp:       [batch, response_len] float32, log π_old of each response token (0 where masked)
    advantages:     [batch] float32
    """

    input_ids: jnp.ndarray
    positions: jnp.ndarray
    attention_mask: jnp.ndarray
    response_mask: jnp.ndarray
    old_logp: jnp.ndarray
    advantages: jnp.ndarray
    prompt_len: int = flax.struct.field(pytree_node=False, default=0)

    def take(self, rows: np.ndarray) -> "PolicyBatch":
        """The sub-batch of the given rows (a mini-batch)."""
        return self.replace(
            input_ids=self.input_ids[rows],
            positions=self.positions[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            old_logp=self.old_logp[rows],
            advantages=self.advantages[rows],
        )


def build_sequences(
    prompts: Sequence[Sequence[int]], responses: np.ndarray, lengths: np.ndarray, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Joins each prompt (left-padded to the longest) with its response (right-padded after `lengths`).

    prompts: `batch` token lists; responses: [batch, response_len] int; lengths: [batch] int.
    Returns input_ids, positions, attention_mask (all [batch, prompt_len + response_len]),
    response_mask [batch, response_len] float32 and prompt_len.
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
    batch, response_len = responses.shape
    prompt_len = max(len(p) for p in prompts)
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


def response_logprobs(
    model, input_ids, positions, attention_mask, prompt_len: int, temperature: float = 1.0,
    return_entropy: bool = False,
):
    """log π(o_t | q, o_<t) of every response slot: [batch, response_len] float32, under the logits divided
    by the rollout ``temperature`` (the distribution the responses were sampled from, before truncation).

    Slot t of the response is predicted by the logits at sequence position prompt_len - 1 + t.
    ``return_entropy=True``: also the entropy of that full distribution at each slot, (logp, entropy).
    """
    out = model.token_logprobs(
        input_ids[:, :-1], input_ids[:, 1:], positions=positions[:, :-1],
        attention_mask=attention_mask[:, :-1], temperature=temperature, return_entropy=return_entropy,
    )
    if return_entropy:
        return out[0][:, prompt_len - 1 :], out[1][:, prompt_len - 1 :]
    return out[:, prompt_len - 1 :]
