"""Positive-branch weight and length diagnostics of App. E.3 (Tabs. 5-7), pooled over rollout batches.

For the positive responses (A_i > 0) of a rollout batch and a region B of log W, the paper compares

    p_B = #{i : A_i > 0, log W_i in B} / #{i : A_i > 0}                 (response share)
    m_B = sum_{A_i > 0, log W_i in B} |A_i| phi_i / sum_{A_i > 0} |A_i| phi_i    (coefficient-mass share)

and their ratio m_B / p_B (amplification: > 1 means the kernel gives the region more than its share of
learning coefficient). Every statistic is pooled over the responses of a rollout batch (not averaged
over its N mini-batches). The inputs are the per-response arrays of the rollout files
(``respo_jax.eval.rollout_files``): ``log_w``, ``advantage``, ``phi``, ``length``.

  pooled_diagnostics    the metrics-record keys of one rollout batch
  bin_allocation        p_B and m_B over the 14 log-W bins of Tab. 7, per batch
  allocation_table      Tab. 5: shares, mass shares and amplification of regions, mean over batches
  weight_length_trajectory   Tab. 6: mean log W and length of positive responses per batch
  length_by_bin         Tab. 7: count-weighted positive-response length per log-W bin over a window
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from respo_jax.objectives.positive_branch import LOW_LOG_W, positive_branch_statistics

# The 14 right-closed bins (a, b] of Tab. 7; log W is clamped to [-20, 20], so the outer bins hold the
# clamped values (and (20, inf) stays empty).
LOG_W_BIN_EDGES = (-math.inf, -20.0, -10.0, -5.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, math.inf)
NUM_BINS = len(LOG_W_BIN_EDGES) - 1

# Tab. 5's regions: (label, lower, upper, lower bound included?, upper bound included?)
LOW_W = ("log W < -1", -math.inf, LOW_LOG_W, False, False)
DEEP_TAIL = ("-5 < log W <= -2", -5.0, -2.0, False, True)


def bin_labels() -> list[str]:
    """Interval labels of the 14 bins, e.g. "(-5, -2]"."""

    def fmt(x: float) -> str:
        return ("-inf" if x < 0 else "inf") if math.isinf(x) else f"{x:g}"

    return [
        f"({fmt(a)}, {fmt(b)}{')' if math.isinf(b) else ']'}"
        for a, b in zip(LOG_W_BIN_EDGES[:-1], LOG_W_BIN_EDGES[1:])
    ]


def log_w_bin(log_w) -> np.ndarray:
    """Bin index in [0, 14) of each log W: bin j holds edges[j] < log W <= edges[j + 1]."""
    log_w = np.asarray(log_w, np.float64)
    return np.clip(np.searchsorted(np.asarray(LOG_W_BIN_EDGES), log_w, side="left") - 1, 0, NUM_BINS - 1)


def _in_region(log_w: np.ndarray, region) -> np.ndarray:
    _, lower, upper, lower_closed, upper_closed = region
    above = log_w >= lower if lower_closed else log_w > lower
    below = log_w <= upper if upper_closed else log_w < upper
    return above & below


def _positive(rollout: Mapping) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(log W, coefficient mass |A| phi, length) of the positive responses of one batch, float64."""
    advantage = np.asarray(rollout["advantage"], np.float64)
    positive = advantage > 0
    mass = np.abs(advantage[positive]) * np.asarray(rollout["phi"], np.float64)[positive]
    return (
        np.asarray(rollout["log_w"], np.float64)[positive],
        mass,
        np.asarray(rollout["length"], np.float64)[positive],
    )


def _ratio(numerator: float, denominator: float) -> float:
    return float(numerator / denominator) if denominator > 0 else 0.0


def region_shares(rollout: Mapping, region=LOW_W) -> tuple[float, float]:
    """(p_B, m_B) of one rollout batch for a region (see LOW_W, DEEP_TAIL); (0, 0) without positives."""
    log_w, mass, _ = _positive(rollout)
    inside = _in_region(log_w, region)
    return _ratio(inside.sum(), log_w.size), _ratio(mass[inside].sum(), mass.sum())


def pooled_diagnostics(log_w, advantage, phi, length) -> dict[str, float]:
    """The App. E.3 keys of one rollout batch's metrics record, all ``[rows]`` arrays pooled (float64):
    `respo_jax.objectives.positive_branch.positive_branch_statistics`, the definitions the policy update's
    per-mini-batch metrics use (positive_low_w_share / _mass_share / _amplification for log W < -1,
    positive_log_w_mean, positive_length_mean; all 0 when the batch has no positive response)."""
    return positive_branch_statistics(log_w, advantage, phi, length, xp=np)


def _window(rollouts: Sequence[Mapping], first: int | None, last: int | None) -> list[Mapping]:
    """The rollouts whose iteration lies in [first, last] (1-based, inclusive; None: open)."""
    if not rollouts:
        raise ValueError("no rollout batches given")
    chosen = [
        r for r in rollouts
        if (first is None or int(r["iteration"]) >= first) and (last is None or int(r["iteration"]) <= last)
    ]
    if not chosen:
        have = [int(r["iteration"]) for r in rollouts]
        raise ValueError(f"no rollout batch in iterations [{first}, {last}]; have {have[0]}..{have[-1]}")
    return chosen


def bin_allocation(rollout: Mapping) -> dict[str, np.ndarray]:
    """One batch over the 14 bins: "count", "share" (p_B) and "mass_share" (m_B), each [14]."""
    log_w, mass, _ = _positive(rollout)
    bins = log_w_bin(log_w)
    count = np.bincount(bins, minlength=NUM_BINS).astype(np.int64)
    mass_per_bin = np.bincount(bins, weights=mass, minlength=NUM_BINS)
    return {
        "count": count,
        "share": count / count.sum() if count.sum() else np.zeros(NUM_BINS),
        "mass_share": mass_per_bin / mass.sum() if mass.sum() > 0 else np.zeros(NUM_BINS),
    }


def allocation_table(
    rollouts: Sequence[Mapping], first: int | None = None, last: int | None = None,
    regions: Sequence = (LOW_W, DEEP_TAIL),
) -> dict[str, dict[str, float]]:
    """Tab. 5: per region, the response share and coefficient-mass share averaged over the rollout
    batches in [first, last] (batches without positive responses are skipped), and amplification =
    mean mass share / mean response share (the paper's 38.5% / 22.8% = 1.69x)."""
    chosen = [r for r in _window(rollouts, first, last) if np.any(np.asarray(r["advantage"]) > 0)]
    if not chosen:
        raise ValueError("no positive responses in the chosen rollout batches")
    table = {}
    for region in regions:
        shares = np.array([region_shares(r, region) for r in chosen])
        share, mass_share = shares.mean(axis=0)
        table[region[0]] = {
            "response_share": float(share),
            "mass_share": float(mass_share),
            "amplification": _ratio(mass_share, share),
            "batches": len(chosen),
        }
    return table


def weight_length_trajectory(rollouts: Sequence[Mapping]) -> list[dict[str, float]]:
    """Tab. 6: per rollout batch, the mean log W and mean length of its positive responses."""
    rows = []
    for rollout in rollouts:
        log_w, _, length = _positive(rollout)
        rows.append({
            "iteration": int(rollout["iteration"]),
            "positive_count": int(log_w.size),
            "positive_log_w_mean": float(log_w.mean()) if log_w.size else math.nan,
            "positive_length_mean": float(length.mean()) if length.size else math.nan,
        })
    return rows


def length_by_bin(
    rollouts: Sequence[Mapping], first: int | None = None, last: int | None = None
) -> dict[str, object]:
    """Tab. 7: positive-response length per log-W bin pooled (count-weighted) over the batches in
    [first, last], relative to the positive-branch mean of the same window.

    Returns {"bins": [{"bin", "log_w_range", "w_range", "count", "length_mean", "relative"}] (14 rows;
    length_mean and relative are None for an empty bin), "branch_mean": float, "branch_count": int}.
    """
    chosen = _window(rollouts, first, last)
    log_w = np.concatenate([_positive(r)[0] for r in chosen])
    length = np.concatenate([_positive(r)[2] for r in chosen])
    if not log_w.size:
        raise ValueError("no positive responses in the chosen rollout batches")
    bins = log_w_bin(log_w)
    branch_mean = float(length.mean())
    rows = []
    for j, label in enumerate(bin_labels()):
        inside = bins == j
        count = int(inside.sum())
        mean = float(length[inside].mean()) if count else None
        lower, upper = LOG_W_BIN_EDGES[j], LOG_W_BIN_EDGES[j + 1]
        rows.append({
            "bin": label,
            "log_w_range": (lower, upper),
            "w_range": (math.exp(lower), math.exp(upper)),
            "count": count,
            "length_mean": mean,
            "relative": None if mean is None else mean / branch_mean,
        })
    return {"bins": rows, "branch_mean": branch_mean, "branch_count": int(log_w.size)}
