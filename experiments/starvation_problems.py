"""Which problem each response of a synthetic-task run answered, rebuilt from the run's config, and the
share of long-problem positive responses in the low-W tail (App. E.3's window) that the third study's
pilot acceptance rule reads.

Rollout files store a response's group (its prompt's position in the rollout batch), not its problem. The
batches are a pure function of the config (`PromptBatches` over the task's training records, seeded by
task.seed), so the problem of group g of iteration k is record g of the k-th batch, as long as every
sampled group is trained on in order: no dynamic sampling (`rollout.filter_groups`) and synchronous
rollouts (`rollout.async_steps` = 0; each iteration takes the next batch).
"""

from __future__ import annotations

import numpy as np

from respo_jax.data.batches import PromptBatches
from respo_jax.data.synthetic import operand_count
from respo_jax.eval.report import Run
from respo_jax.training.config import ConfigError, ExperimentConfig, config_from_dict
from respo_jax.training.tasks import load_task


def rollout_problems(config: ExperimentConfig, iterations: int) -> list[list[dict]]:
    """[iterations][prompts] the training records of the first `iterations` rollout batches of a run
    with `config` (prompt-major: record g is group g of the rollout file)."""
    if config.rollout.filter_groups or config.rollout.async_steps:
        raise ConfigError("rollout_problems needs rollout.filter_groups=false and rollout.async_steps=0 "
                          "(every sampled group trained on, each iteration on the next batch)")
    r = config.rollout
    batches = PromptBatches(load_task(config).train, batch_size=r.reuse * r.prompts_per_minibatch,
                            seed=config.task.seed)
    return [next(batches) for _ in range(iterations)]


def long_positive_tail_share(run: Run, operands: tuple[int, int] = (12, 16), log_w_below: float = -1.0,
                             batches: int | None = None) -> tuple[float | None, int]:
    """(share, count): among the positive responses (A > 0) to problems with `operands` (bounds
    included) operands in the first `batches` rollout files (default: App. E.3's window, the first half
    of the run's, at least one), the share with log W < `log_w_below`, and how many such positives there
    are (share None when there are none)."""
    config = config_from_dict(ExperimentConfig, run.config, validate=False)
    batches = max(1, run.iterations // 2) if batches is None else batches
    rollouts = [r for r in run.rollouts if int(r["iteration"]) <= batches]
    problems = rollout_problems(config, max((int(r["iteration"]) for r in rollouts), default=0))
    tail = total = 0
    for rollout in rollouts:
        counts = np.array([operand_count(rec["problem"]) for rec in problems[int(rollout["iteration"]) - 1]])
        rows = counts[np.asarray(rollout["group"])]
        chosen = (np.asarray(rollout["advantage"]) > 0) & (rows >= operands[0]) & (rows <= operands[1])
        total += int(chosen.sum())
        tail += int((chosen & (np.asarray(rollout["log_w"], np.float64) < log_w_below)).sum())
    return (tail / total if total else None), total
