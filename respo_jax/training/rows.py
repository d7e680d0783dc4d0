"""The host-side rows of one RL iteration (paper §4.1): the groups a rollout batch drew, then the rows
trained on with their advantages. Typed values between the loop's steps, prompt-major (G rows per group).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SampledGroups:
    """The groups of one rollout batch to train on and how they were drawn (`RLTrainer.sample_groups`).

    The kept rows, host arrays in prompt-major order: `prompts`, `tokens` [rows, max_new_tokens],
    `lengths` [rows], `sampler_logp` [rows, max_new_tokens], `sampler_entropy` (the sampler's token
    entropy, None unless log π_old comes from the sampler), `scores` [rows], `prompt_routing` / `routing`
    (Routing Replay only). Every generated response's `all_scores` / `all_lengths` (dynamic sampling draws
    more than it keeps) and the counts `groups_generated`, `groups_kept`, `generation_batches`.
    `batches_after`: the prompt stream's position after the draws; `reward_counts`: the failed and
    timed-out rewards of an asynchronous job's draws (None: counted by the trainer)."""

    prompts: list[list[int]]
    tokens: np.ndarray
    lengths: np.ndarray
    sampler_logp: np.ndarray
    sampler_entropy: np.ndarray | None
    scores: np.ndarray
    prompt_routing: np.ndarray | None
    routing: np.ndarray | None
    all_scores: np.ndarray
    all_lengths: np.ndarray
    groups_generated: int
    groups_kept: int
    generation_batches: int
    batches_after: dict | None = None
    reward_counts: dict | None = None

    def take(self, rows: np.ndarray) -> "SampledGroups":
        """These groups' `rows` (indices into the kept rows), the counts unchanged."""
        def some(a):
            return None if a is None else a[rows]

        return dataclasses.replace(
            self, prompts=[self.prompts[i] for i in rows], tokens=self.tokens[rows],
            lengths=self.lengths[rows], sampler_logp=self.sampler_logp[rows],
            sampler_entropy=some(self.sampler_entropy),
            scores=self.scores[rows], prompt_routing=None, routing=None)

    @classmethod
    def concatenate(cls, parts: list["SampledGroups"], **counts) -> "SampledGroups":
        """The kept rows of several generation batches, in order (routing is not kept across batches:
        Routing Replay and dynamic sampling do not combine); `counts`: the remaining fields."""
        def joined(name):
            values = [getattr(part, name) for part in parts]
            return None if values[0] is None else np.concatenate(values)

        return cls(prompts=[p for part in parts for p in part.prompts],
                   **{name: joined(name) for name in ("tokens", "lengths", "sampler_logp", "sampler_entropy",
                                                      "scores")},
                   prompt_routing=None, routing=None, **counts)


@dataclasses.dataclass(frozen=True)
class TrainingRows:
    """One iteration's rows to train on, host arrays in prompt-major order (G rows per group): the kept
    groups' `real_rows` rows, then any filler rows of no weight that complete the last mini-batch."""

    prompts: list[list[int]]  # [rows] prompt tokens
    tokens: np.ndarray  # [rows, max_new_tokens]
    lengths: np.ndarray  # [rows] response tokens
    sampler_logp: np.ndarray  # [rows, max_new_tokens]
    sampler_entropy: np.ndarray | None  # [rows, max_new_tokens] with rollout.old_logprobs = "sampler"
    scores: np.ndarray  # [rows]
    advantages: np.ndarray  # [rows]
    prompt_routing: np.ndarray | None  # Routing Replay only: the sampler's experts of the prompts
    routing: np.ndarray | None  # and of the responses
    real_rows: int

    @classmethod
    def of(cls, sampled: SampledGroups, advantages: np.ndarray, rows: int, pad_id: int) -> "TrainingRows":
        """The sampled rows with their `advantages` [kept rows], filled up to `rows` with rows of no
        weight: pad tokens, length, score and advantage 0 (they add nothing to any loss, denominator or
        gradient)."""
        real = sampled.lengths.shape[0]
        filler = rows - real

        def zeros(a: np.ndarray | None) -> np.ndarray | None:
            if a is None or not filler:
                return a
            return np.concatenate([a, np.zeros((filler, *a.shape[1:]), a.dtype)])

        tokens = sampled.tokens
        if filler:
            tokens = np.concatenate([tokens, np.full((filler, tokens.shape[1]), pad_id, tokens.dtype)])
        prompts = sampled.prompts + [sampled.prompts[0]] * filler if filler else sampled.prompts
        return cls(prompts=prompts, tokens=tokens,
                   lengths=zeros(sampled.lengths), sampler_logp=zeros(sampled.sampler_logp),
                   sampler_entropy=zeros(sampled.sampler_entropy), scores=zeros(sampled.scores),
                   advantages=zeros(np.asarray(advantages)), prompt_routing=sampled.prompt_routing,
                   routing=sampled.routing, real_rows=real)
