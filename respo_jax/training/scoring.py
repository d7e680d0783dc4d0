"""The rewards of a run's responses (paper §4.1's reward step), split over the processes: the task's
reward (`task.reward`, strict box ±1 by default) of each decoded solution plus DAPO's overlong penalty,
each process verifying its even share of the responses and the scores then exchanged, and the failed
and timed-out rewards counted for the next metrics record.
"""

from __future__ import annotations

import numpy as np

from respo_jax.rewards import SCORED, TIMED_OUT, RewardScorer, get_reward, overlong_penalty
from respo_jax.training.config import ExperimentConfig
from respo_jax.training.placement import RowPlacer


def no_reward_counts() -> dict:
    """Zero failed and timed-out rewards (the metrics record's `reward_failures` / `reward_timeouts`)."""
    return {"reward_failures": 0, "reward_timeouts": 0}


def raw_accuracy(config: ExperimentConfig, scores: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Whether each response is correct: its reward before the overlong penalty is > 0, [batch] bool
    (DAPO's filter metric "acc"); `scores, lengths: [batch]`."""
    task = config.task
    raw = np.asarray(scores, np.float64)
    if task.overlong_buffer_length > 0:
        raw = raw - overlong_penalty(lengths, config.rollout.max_new_tokens, task.overlong_buffer_length,
                                     task.overlong_penalty_factor)
    return raw > 0


class ResponseScorer:
    """Scores responses of a run's task: `score` in this process, `score_shared` split over the
    processes; the reward's failures are counted (`take_counts`)."""

    def __init__(self, config: ExperimentConfig, tokenizer, prompt_format, placer: RowPlacer):
        self.config, self.tokenizer, self.prompt_format = config, tokenizer, prompt_format
        self.placer = placer
        self.reward = RewardScorer(get_reward(config.task.reward))
        self.counts = no_reward_counts()

    def score(self, tokens: np.ndarray, lengths: np.ndarray,
              records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """The `task.reward` of each response (`respo_jax.rewards.scoring`) + the overlong penalty when
        configured: scores [batch] float32, and each reward's status [batch] int8 (SCORED, FAILED or
        TIMED_OUT: a failed reward scores its `failure_score`, penalty added). `tokens: [batch, width]`,
        `lengths: [batch]`."""
        task = self.config.task
        texts = [self.prompt_format.solution_text(self.tokenizer.decode(tokens[i, : lengths[i]]))
                 for i in range(len(records))]
        scores, status = self.reward(records, texts)
        if task.overlong_buffer_length > 0:
            scores += overlong_penalty(lengths, self.config.rollout.max_new_tokens,
                                       task.overlong_buffer_length, task.overlong_penalty_factor)
        return scores, status

    def score_shared(self, tokens: np.ndarray, lengths: np.ndarray, records: list[dict],
                     count: bool = True, counts: dict | None = None) -> np.ndarray:
        """`score` of every response, each process verifying its even share of them (`RowPlacer.share`;
        all in one process) and the scores then exchanged, so the (host-bound) reward work is split over
        the hosts and every process ends up with all scores. With `count`, the failed and timed-out
        rewards are added to this scorer's counts, or to `counts` when given (a rollout job's own)."""
        share = self.placer.share(len(records))
        scores, status = self.score(tokens[share], lengths[share], self.placer.take(records, share))
        status = self.placer.gather(status, share, len(records))
        if count:
            counts = self.counts if counts is None else counts
            counts["reward_failures"] += int(np.sum(status != SCORED))
            counts["reward_timeouts"] += int(np.sum(status == TIMED_OUT))
        return self.placer.gather(scores, share, len(records))

    def take_counts(self) -> dict:
        """The failed / timed-out rewards counted since the last call."""
        counts, self.counts = self.counts, no_reward_counts()
        return counts
