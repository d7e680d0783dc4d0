"""What one RL iteration reports: its metrics record and the per-response arrays of its rollout batch.

Pure functions of host arrays, so the trainer's loop (`respo_jax.training.loop`) stays the paper's
§4.1 steps: the sampler/trainer log-prob gap and the rollout-time entropy per response token, the
rollout-correction ratio statistics and the App. E.3 diagnostics pooled over the whole rollout batch
(not means of the N mini-batches' ratios), and the policy updates' own metrics averaged over them.
"""

from __future__ import annotations

import numpy as np

from respo_jax.objectives import rollout_correction_weights
from respo_jax.objectives.positive_branch import positive_branch_statistics
from respo_jax.training.step import NonFiniteError


def logprob_metrics(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], minibatches: list[np.ndarray],
                    sampler_logp: np.ndarray, correction) -> dict:
    """`sampler_trainer_logp_gap` (mean |log π_sampler − log π_old|) and `entropy` per response token of
    the rollout batch, plus the rollout-correction metrics pooled over it when `correction` is on.
    parts: (response_mask, old_logp, entropy) [rows_k, width_k] of each mini-batch, whose rows are
    `minibatches[k]` of `sampler_logp` [rows, >= width_k] (the entropy may hold anything where the mask
    is 0: the sampler's is not masked)."""
    gap, entropy, response_tokens, pooled = 0.0, 0.0, 0.0, []
    for rows, (mask, old_logp, token_entropy) in zip(minibatches, parts):
        sampler = sampler_logp[rows, :mask.shape[1]]
        gap += float(np.abs(sampler * mask - old_logp).sum())
        entropy += float((token_entropy * mask).sum())
        response_tokens += float(mask.sum())
        pooled.append((old_logp, sampler, mask))
    response_tokens = max(response_tokens, 1.0)
    metrics = {"sampler_trainer_logp_gap": gap / response_tokens, "entropy": entropy / response_tokens}
    if correction and pooled:  # the sampler/trainer ratio over the whole rollout batch
        metrics.update(rollout_correction_metrics(pooled, correction))
    return metrics


def rollout_correction_metrics(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], correction) -> dict:
    """The rollout-correction metrics (`rollout_correction_weights`) pooled over mini-batches given as
    (old_logp, sampler_logp, mask) of [rows, width_k] each: the rows padded to one width and stacked."""
    width = max(mask.shape[1] for _, _, mask in parts)

    def stacked(index: int) -> np.ndarray:
        return np.concatenate([np.pad(part[index], ((0, 0), (0, width - part[index].shape[1])))
                               for part in parts])

    _, metrics = rollout_correction_weights(stacked(0), stacked(1), stacked(2), correction)
    return {key: float(value) for key, value in metrics.items()}


def check_finite_steps(step_metrics: list[dict], iteration: int) -> None:
    """Raises NonFiniteError naming the first mini-batch of `iteration` whose loss, gradient norm or updated
    parameters are not finite; removes the `params_finite` flags (not a metric) from `step_metrics`."""
    problem = None
    for index, metrics in enumerate(step_metrics, start=1):
        finite = bool(metrics.pop("params_finite", True))
        if problem is not None:
            continue
        for key in ("loss", "grad_norm"):
            if not np.isfinite(float(metrics[key])):
                problem = f"mini-batch {index}/{len(step_metrics)}: {key} is {float(metrics[key])}"
                break
        else:
            if not finite:
                problem = f"mini-batch {index}/{len(step_metrics)}: the updated parameters hold NaN/inf"
    if problem is not None:
        raise NonFiniteError(f"iteration {iteration}, {problem}; the run stops before any checkpoint is "
                             "written")


def collect_rollout(minibatches: list[np.ndarray], responses: list[dict], advantages: np.ndarray,
                    lengths: np.ndarray, scores: np.ndarray, group_size: int, iteration: int,
                    policy_updates: int) -> dict:
    """The per-response arrays [rows] of one iteration in prompt-major row order and its counters (the
    rollout file's layout, `respo_jax.eval.rollout_files`), plus the responses' k1 approx-KL under key
    "approx_kl"; `responses[k]`: the per-response metrics of the update on rows `minibatches[k]`."""
    rows = advantages.shape[0]
    out = {key: np.zeros(rows, np.float32) for key in ("log_w", "phi", "approx_kl")}
    minibatch = np.full(rows, -1, np.int32)
    for index, (row_ids, values) in enumerate(zip(minibatches, responses)):
        minibatch[row_ids] = index
        for key in out:
            out[key][row_ids] = np.asarray(values[key], np.float32)
    if np.any(minibatch < 0):
        raise AssertionError(f"rows {np.nonzero(minibatch < 0)[0][:5].tolist()} belong to no mini-batch")
    return {
        **out,
        "advantage": advantages.astype(np.float32),
        "length": lengths.astype(np.int32),
        "reward": np.asarray(scores, np.float32),
        "minibatch": minibatch,
        "group": (np.arange(rows) // group_size).astype(np.int32),
        "iteration": np.int64(iteration),
        "policy_updates": np.int64(policy_updates),
    }


def iteration_record(counters: dict, sampled: dict, timings: dict, logprob: dict, step_metrics: list[dict],
                     trained: dict, learning_rate: float | None, filter_groups: bool) -> dict:
    """The iteration's metrics record (in the historical key order). counters: phase, iteration and
    policy_updates; sampled: the `SampledGroups` (its counts and every generated response's
    all_scores / all_lengths); timings: seconds, compile counts and reward counts; logprob: `logprob_metrics`;
    step_metrics: each update's metrics (their means are recorded); trained: [rows] "log_w", "phi",
    "approx_kl", "advantage" and "length" of the responses trained on (no filler rows);
    learning_rate: the mean over the updates (None: no update)."""
    all_scores = sampled.all_scores
    record = {
        **counters,
        "score": float(all_scores.mean()),
        "train_accuracy": float((all_scores.mean() + 1.0) / 2.0),
        "response_length": float(sampled.all_lengths.mean()),
        "sampler_trainer_logp_gap": logprob["sampler_trainer_logp_gap"],
        **timings,
    }
    if filter_groups:
        counts = ("groups_generated", "groups_kept", "generation_batches")
        record.update({key: getattr(sampled, key) for key in counts}, updates=len(step_metrics))
    for key in (step_metrics[0] if step_metrics else ()):
        values = np.array([float(m[key]) for m in step_metrics])
        record[key] = float(values.mean())
        if key == "log_w_mean":
            record["log_w_mean_last_minibatch"] = float(values[-1])
    record.update({k: v for k, v in logprob.items() if k not in ("sampler_trainer_logp_gap", "entropy")})
    lengths = trained["length"]
    if lengths.size:  # pooled over the whole rollout batch (not means of the N mini-batches' ratios)
        diagnostics = positive_branch_statistics(trained["log_w"], trained["advantage"], trained["phi"],
                                                 lengths, xp=np)
        record.update(diagnostics)
        record["positive_low_w_fraction"] = diagnostics["positive_low_w_share"]
    non_empty = lengths > 0
    record["approx_kl"] = float(trained["approx_kl"][non_empty].mean()) if non_empty.any() else 0.0
    record["entropy"] = logprob["entropy"]
    if learning_rate is not None:
        record["learning_rate"] = learning_rate
    return record


def rl_record(counters: dict, sampled, batch, minibatches: list[np.ndarray], logprob_parts: list,
              step_metrics: list[dict], timings: dict, learning_rate: float | None, correction,
              group_size: int, version: int, filter_groups: bool,
              async_steps: int) -> tuple[dict, dict | None]:
    """An RL iteration's metrics record and its rows trained on (the rollout file; None when no group was
    trained on). `counters`: phase, iteration (after the updates) and policy_updates; `sampled`: the
    `SampledGroups`; `batch`: the `TrainingRows`; `logprob_parts`: [(response_mask, old_logp, entropy)]
    per mini-batch, on the host; `version`: the policy version that generated the batch. An asynchronous
    run's record has its staleness (iterations of lag behind the policy before the updates) as
    staleness_mean / staleness_max over the responses."""
    logprob = logprob_metrics(logprob_parts, minibatches, batch.sampler_logp, correction)
    rollout = collect_rollout(minibatches, [m.pop("responses") for m in step_metrics], batch.advantages,
                              batch.lengths, batch.scores, group_size, counters["iteration"],
                              counters["policy_updates"])
    rollout = {key: value[:batch.real_rows] if np.ndim(value) else value for key, value in rollout.items()}
    rollout["policy_version"] = np.full(batch.real_rows, version, np.int32)
    record = iteration_record(counters, sampled, timings, logprob, step_metrics, rollout, learning_rate,
                              filter_groups)
    if async_steps:
        staleness = counters["iteration"] - 1 - rollout["policy_version"]
        record["staleness_mean"] = float(staleness.mean()) if staleness.size else 0.0
        record["staleness_max"] = int(staleness.max()) if staleness.size else 0
    rollout.pop("approx_kl")  # in the record, not in the rollout file
    return record, rollout if batch.real_rows else None
