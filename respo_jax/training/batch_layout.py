"""How a mini-batch's rows become the update's device batch: bucketed prompt and response lengths, this
process's rows placed in the step's batch sharding, and the rows per micro-batch (paper §4.1's mini-batch
of M prompts × G responses, at any scale).

The shapes come from all rows (every process computes the same ones); each process lays out only the
rows its devices hold and the global batch is assembled from the processes' parts (`RowPlacer`).
"""

from __future__ import annotations

import math

import numpy as np

from respo_jax.training.batch import (PolicyBatch, bucket_length, build_sequences, microbatch_size,
                                      replay_routing)
from respo_jax.training.config import RolloutConfig
from respo_jax.training.placement import RowPlacer


def prompt_groups_hold(prompts: list[list[int]], group: int) -> bool:
    """Whether the rows' prompts come in consecutive groups of `group` equal prompts (a mini-batch's
    prompt-major order: `PolicyBatch.prompt_group`)."""
    return group > 1 and len(prompts) % group == 0 and all(
        prompts[i] == prompts[i - i % group] for i in range(len(prompts)))


class BatchLayout:
    """Lays out mini-batches for the update step of a run (`rollout` settings, the padding token, the
    row placement over processes, the devices a batch's rows are split over and the rows per shared
    prompt, `rollout.share_prompts`: 1 for none)."""

    def __init__(self, rollout: RolloutConfig, pad_id: int, placer: RowPlacer, batch_shards: int,
                 prompt_group: int):
        self.rollout, self.pad_id, self.placer = rollout, pad_id, placer
        self.batch_shards, self.prompt_group = batch_shards, prompt_group

    def policy_batch(self, prompts: list[list[int]], tokens: np.ndarray, lengths: np.ndarray,
                     advantages: np.ndarray, sampler_routing: tuple | None = None,
                     sampler_logp: np.ndarray | None = None) -> tuple[PolicyBatch, int]:
        """A mini-batch laid out with bucketed prompt and response lengths (old_logp still zero), placed
        on the devices in the step's batch sharding, and the rows per micro-batch that keep it within
        `rollout.max_tokens_per_microbatch` (a multiple of the batch devices, so every micro-batch is
        spread over all of them). `tokens: [rows, >= response length]`, `lengths, advantages: [rows]`;
        `sampler_routing`: (prompt_routing, routing) of these rows from the sampler, to replay (Routing
        Replay); `sampler_logp`: [rows, >= response length] the sampler's log-probs (rollout
        correction)."""
        r = self.rollout
        rows = len(prompts)
        prompt_len = r.padded_prompt_length(max(len(p) for p in prompts))
        response_len = bucket_length(max(int(lengths.max()), 1), r.response_bucket, r.max_new_tokens)
        part = self.placer.rows(rows)
        ids, positions, attention, response_mask, prompt_len = build_sequences(
            self.placer.take(prompts, part), tokens[part], lengths[part], self.pad_id,
            prompt_len=prompt_len, response_len=response_len)
        routing = None
        if sampler_routing is not None:  # the sampler's experts, laid out like the model input (R3)
            routing = replay_routing(*(a[:, part] for a in sampler_routing), prompt_len, response_len)
        local = PolicyBatch(
            input_ids=ids, positions=positions, attention_mask=attention, response_mask=response_mask,
            old_logp=np.zeros(response_mask.shape, np.float32),
            advantages=np.asarray(advantages, np.float32)[part], routing=routing, prompt_len=prompt_len,
            sampler_logp=None if sampler_logp is None
            else np.asarray(sampler_logp, np.float32)[part, :response_len] * response_mask,
        )
        group = self.prompt_group if prompt_groups_hold(prompts, self.prompt_group) else 1
        batch = self.placer.place(local.replace(prompt_group=group), rows)
        micro = microbatch_size(rows, ids.shape[1], r.max_tokens_per_microbatch)
        unit = math.lcm(self.batch_shards, group)  # every micro-batch spread over all devices, whole groups
        return batch, min(rows, -(-micro // unit) * unit)
