"""The gradient-starvation sweep's summary (summary.json): per-cell statistics of a finished cell's run
(blocked curves, early peak and late mean, held-out scores, trust-region diagnostics, drift, App. E.3's
positive-branch allocation), their means over seeds per (objective, N), and the second study's lr
selection, controls and long-regime acceptance. Pure functions of loaded runs (`respo_jax.eval.report.Run`)
and the sweep config; `experiments/gradient_starvation.py` runs the cells and writes the files.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from experiments.starvation_findings import per_seed_findings
from respo_jax.config import EngineSection
from respo_jax.eval import positive_branch
from respo_jax.eval.report import Run, positive_branch_tables
from respo_jax.eval.statistics import early_peak, late_mean
from respo_jax.training.sweep import Cell, StarvationConfig

# CPU-scale windows (fractions of the run's policy updates): the early peak over the first quarter (the
# paper's 256 of 1,024) and the late mean over the last quarter (the paper's last 128 of 1,024 is an
# eighth; a quarter gives N=32 three logged points instead of two).
EARLY_FRACTION, LATE_FRACTION = 0.25, 0.25
CURVE_KEYS = ("train_accuracy", "response_length")


THIRD_STUDY_TASK = "scratchpad_mixed"  # the third study's task: its report adds the paired endpoints


def json_view(obj):
    """`obj` as JSON reads it back (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(obj))


def settings_view(config) -> dict:
    """The JSON view of a config (a StarvationConfig or ExperimentConfig) without the warm-up's operand
    bounds where they are the task's (0), and without the rollout's `decode_widths_per_octave` where it
    is the engine's default (a speed knob: the same samples for one seed): the settings a base model or
    summary made before those options recorded, unchanged."""
    view = json_view(dataclasses.asdict(config))
    view["warmup"] = {k: v for k, v in view["warmup"].items()
                      if v or k not in ("min_operands", "max_operands")}
    if view["rollout"].get("decode_widths_per_octave") == EngineSection.decode_widths_per_octave:
        del view["rollout"]["decode_widths_per_octave"]
    return view


def windows(policy_updates: int, block: int) -> dict:
    """The early-peak and late-mean windows in policy updates, and how the curves were blocked."""
    early, late = EARLY_FRACTION * policy_updates, LATE_FRACTION * policy_updates
    return {"early_until": early, "late_window": late, "block": block, "note": (
        f"Curves in blocks of {block} policy updates (the largest N): each point is the mean logged score of "
        f"the rollout batches of one block, so every point of every N averages the same number of prompts "
        f"({block} x M). Early peak: the maximum block through update {early:g} (the first quarter; paper: "
        f"256 of 1,024); late mean: the step-weighted mean over the last {late:g} updates (the last quarter; "
        "paper: the last 128 of 1,024).")}


def blocked_curve(run: Run, block: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(block ends [blocks], means [blocks]) of a metrics key: the mean over the rollout batches whose
    policy-update count lies in ((k-1)·block, k·block]. At N = block this is the logged curve; at N=1
    it averages `block` logged points, so points of every N rest on equally many prompts."""
    steps, values = run.curve(key)
    index = np.ceil(steps / block).astype(int)
    ends = np.unique(index)
    return ends * float(block), np.array([values[index == k].mean() for k in ends])


def _final_heldout(run: Run) -> tuple[float | None, float | None]:
    """(before, after) greedy accuracy on the held-out split: the first and last eval records."""
    evals = [r["greedy_accuracy"] for r in run.records if r.get("phase") == "eval"]
    return (evals[0], evals[-1]) if evals else (None, None)


def sampled_heldout(run: Run) -> dict:
    """Sampled pass@1 ± its standard error (`respo_jax.training.held_out`) before and after training:
    the first and last eval records' (None where the run did not sample)."""
    evals = [r for r in run.records if r.get("phase") == "eval"]
    out = {}
    for key, record in (("before", evals[0] if evals else {}), ("after", evals[-1] if evals else {})):
        out[f"sampled_pass_at_1_{key}"] = record.get("sampled_pass_at_1")
        out[f"sampled_pass_at_1_se_{key}"] = record.get("sampled_pass_at_1_se")
    return out


def trust_region_diagnostics(run: Run) -> dict:
    """What the trust-region argument needs, per run: the mean over rollout batches of the k1 approx. KL
    to π_old and of the clip fraction (None for objectives without one), and, pooled over every
    response, the share of negative responses (Â < 0) with log W < 0 and their share of the negative
    coefficient mass |Â|·φ (ReSPO's φ⁻ ≥ 1 there; every baseline's < 1)."""
    rl = run.rl_records
    clip = [r["clip_fraction"] for r in rl if "clip_fraction" in r]
    log_w = np.concatenate([np.asarray(r["log_w"], np.float64) for r in run.rollouts])
    advantage = np.concatenate([np.asarray(r["advantage"], np.float64) for r in run.rollouts])
    phi = np.concatenate([np.asarray(r["phi"], np.float64) for r in run.rollouts])
    negative = advantage < 0
    mass = np.abs(advantage) * phi
    neg_mass = mass[negative].sum()
    return {
        "approx_kl": _mean(r.get("approx_kl") for r in rl),
        "clip_fraction": float(np.mean(clip)) if clip else None,
        "negative_log_w_lt0_share": float(np.mean(log_w[negative] < 0)) if negative.any() else None,
        "negative_log_w_lt0_mass_share": float(mass[negative & (log_w < 0)].sum() / neg_mass)
        if neg_mass > 0 else None,
    }


def drift_statistics(run: Run) -> dict:
    """How far the policy drifted off the rollout policy, pooled over every response of the run:
    quantiles of log W, the share with |log W| > 1 and the share of positive responses (Â > 0) below -1."""
    log_w = np.concatenate([np.asarray(r["log_w"], np.float64) for r in run.rollouts])
    advantage = np.concatenate([np.asarray(r["advantage"], np.float64) for r in run.rollouts])
    q05, q50, q95 = np.quantile(log_w, [0.05, 0.5, 0.95])
    positive = log_w[advantage > 0]
    return {
        "log_w_q05": float(q05), "log_w_median": float(q50), "log_w_q95": float(q95),
        "log_w_abs_gt1_share": float(np.mean(np.abs(log_w) > 1)),
        "positive_log_w_lt_minus1_share": float(np.mean(positive < -1)) if positive.size else None,
    }


def low_w_length(table: dict | None) -> dict:
    """From Tab. 7 (`length_by_bin`): the count-weighted mean length of positive responses with
    log W <= -0.5, relative to the positive-branch mean (paper: 1.13x ReSPO, 1.06x VESPO), and their count."""
    if table is None:
        return {"count": 0, "length_mean": None, "relative": None, "branch_mean": None}
    rows = [row for row in table["bins"] if row["log_w_range"][1] <= -0.5 and row["count"]]
    count = sum(row["count"] for row in rows)
    mean = sum(row["count"] * row["length_mean"] for row in rows) / count if count else None
    return {"count": count, "length_mean": mean, "branch_mean": table["branch_mean"],
            "relative": None if mean is None else mean / table["branch_mean"]}


def cell_summary(cell: Cell, run: Run, window: dict) -> dict:
    """One cell: early peak and late mean (± temporal std) of its blocked training score, held-out
    accuracy, drift, Tab. 5, and its logged and blocked curves."""
    e3 = max(1, run.iterations // 2)  # App. E.3: the first half of the run (16 of 32 batches at N=32)
    tables = positive_branch_tables([run], batches=e3)
    allocation = tables["allocation"][run.label]
    length = tables["length"][run.label]
    before, after = _final_heldout(run)
    steps, score = blocked_curve(run, window["block"], "train_accuracy")
    end = float(steps[-1])
    start = max(end - window["late_window"], float(steps[0]))
    late, late_std = late_mean(steps, score, start, end) if start < end else (None, None)
    peak = early_peak(steps, score, window["early_until"]) if steps[0] <= window["early_until"] else None
    raw_steps, _ = run.curve()
    return {
        "objective": cell.objective, "reuse": cell.reuse, "seed": cell.seed, "name": cell.name,
        "learning_rate": run.config["optim"]["learning_rate"], "policy_updates": run.policy_updates,
        "regime": cell.regime, **sampled_heldout(run), "diagnostics": trust_region_diagnostics(run),
        "early_peak": peak, "late_mean": late, "late_std": late_std, "late_window": [start, end],
        "heldout_accuracy_before": before, "heldout_accuracy": after,
        "e3_window_batches": tables["window"]["allocation"],
        "tab5": None if allocation is None else {
            region: {k: v for k, v in values.items()} for region, values in allocation.items()},
        "drift": drift_statistics(run),
        "tab7_low_w_length": low_w_length(length),
        "curve": {"policy_updates": raw_steps.astype(int).tolist(),
                  **{key: np.round(run.curve(key)[1], 4).tolist() for key in CURVE_KEYS}},
        "blocked_curve": {"policy_updates": steps.astype(int).tolist(),
                          **{key: np.round(blocked_curve(run, window["block"], key)[1], 5).tolist()
                             for key in CURVE_KEYS}},
    }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(values)) if values else None


def _std(values) -> float | None:
    """Population std over seeds (the paper's cross-seed std, §4.3); None with fewer than two."""
    values = [v for v in values if v is not None]
    return float(np.std(values)) if len(values) >= 2 else None


def group_summary(cells: list[dict]) -> dict:
    """Means over the seeds of one (objective, N), and the cross-seed std of the late mean and the
    held-out accuracy."""
    def tab5(region: str, key: str) -> float | None:
        return _mean([c["tab5"][region][key] for c in cells if c["tab5"] is not None])

    low, deep = positive_branch.LOW_W[0], positive_branch.DEEP_TAIL[0]
    share, mass = tab5(low, "response_share"), tab5(low, "mass_share")
    deep_share, deep_mass = tab5(deep, "response_share"), tab5(deep, "mass_share")
    return {
        "objective": cells[0]["objective"], "reuse": cells[0]["reuse"], "seeds": [c["seed"] for c in cells],
        "early_peak": _mean(c["early_peak"] for c in cells),
        "late_mean": _mean(c["late_mean"] for c in cells),
        "late_temporal_std": _mean(c["late_std"] for c in cells),
        "late_mean_cross_seed_std": _std([c["late_mean"] for c in cells]),
        "heldout_accuracy": _mean(c["heldout_accuracy"] for c in cells),
        "heldout_accuracy_cross_seed_std": _std([c["heldout_accuracy"] for c in cells]),
        "learning_rate": cells[0]["learning_rate"], "policy_updates": cells[0]["policy_updates"],
        "regime": cells[0]["regime"],
        "sampled_pass_at_1": _mean(c["sampled_pass_at_1_after"] for c in cells),
        # the standard error of the seed mean from each seed's evaluation error (problems resampled)
        "sampled_pass_at_1_se": _se_of_mean([c["sampled_pass_at_1_se_after"] for c in cells]),
        "sampled_pass_at_1_cross_seed_std": _std([c["sampled_pass_at_1_after"] for c in cells]),
        **{key: _mean(c["diagnostics"][key] for c in cells) for key in cells[0]["diagnostics"]},
        "positive_low_w_share": share, "positive_low_w_mass_share": mass,
        # amplification of the seed means, as the paper's Tab. 5 divides the mean mass by the mean share
        "positive_low_w_amplification": mass / share if share else None,
        "positive_deep_tail_share": deep_share, "positive_deep_tail_mass_share": deep_mass,
        "positive_deep_tail_amplification": deep_mass / deep_share if deep_share else None,
        **{key: _mean(c["drift"][key] for c in cells) for key in cells[0]["drift"]},
        # pooled over seeds (count-weighted), as Tab. 7 pools batches
        "positive_low_w_length_relative": _pooled_relative([c["tab7_low_w_length"] for c in cells]),
        "positive_low_w_length_count": sum(c["tab7_low_w_length"]["count"] for c in cells),
    }


def _se_of_mean(errors: list) -> float | None:
    """The standard error of a mean of independent estimates with these standard errors."""
    errors = [e for e in errors if e is not None]
    return float(np.sqrt(np.sum(np.square(errors))) / len(errors)) if errors else None


def _pooled_relative(rows: list[dict]) -> float | None:
    """Mean over seeds of each seed's low-W length ratio, weighted by its low-W count."""
    rows = [r for r in rows if r["count"]]
    if not rows:
        return None
    return float(sum(r["count"] * r["relative"] for r in rows) / sum(r["count"] for r in rows))


def summarize(config: StarvationConfig, bases: dict, runs: dict[Cell, Run], best: dict | None = None,
              selection: list[dict] | None = None) -> dict:
    """summary.json: the settings, the base model, one record per cell and per (objective, N) (the
    second study: per (regime, N, objective, lr), over the report seeds, plus the lr selection, each
    method at its best lr, the controls and the long regime's acceptance)."""
    s = config.sweep
    window = windows(s.policy_updates, max(s.reuse_list))
    cells = [cell_summary(c, runs[c], cell_window(config, c)) for c in runs]
    order = s.objective_list + s.control_list
    keys = dict.fromkeys((c["regime"], c["reuse"], c["objective"], c["learning_rate"]) for c in cells
                         if c["seed"] != s.selection_seed)
    reuse_order = {"": s.reuse_list, "long": s.long_reuse_list}
    groups = []
    for regime, n, objective, lr in sorted(keys, key=lambda k: (k[0], reuse_order[k[0]].index(k[1]),
                                                                order.index(k[2]), -k[3])):
        groups.append(group_summary([c for c in cells if (c["regime"], c["reuse"], c["objective"],
                                                          c["learning_rate"]) == (regime, n, objective, lr)
                                     and c["seed"] != s.selection_seed]))
    missing = [c.name for c in config.cells(best) if c not in runs]
    summary = {
        "settings": settings_view(config),
        "windows": window,
        "base_model": {k: bases[""][k] for k in ("sha256", "greedy_accuracy", "sft_loss_last")},
        "groups": groups, "cells": cells, "missing_cells": missing,
    }
    if s.learning_rates:
        summary.update(second_study(config, bases, groups, best or {}, selection or []))
        summary = add_per_seed(summary)
    return summary


def cell_window(config: StarvationConfig, cell: Cell) -> dict:
    """The cell's early/late windows: in its own policy updates, blocked by its regime's largest N."""
    block = max(config.sweep.long_reuse_list if cell.regime else config.sweep.reuse_list)
    return windows(config.experiment(cell).run.policy_updates, block)


def selection_score(run: Run, window: dict) -> float | None:
    """What `select_learning_rate` compares: the late mean of the blocked training score."""
    steps, score = blocked_curve(run, window["block"], "train_accuracy")
    end = float(steps[-1])
    start = max(end - window["late_window"], float(steps[0]))
    return late_mean(steps, score, start, end)[0] if start < end else None


def _group(groups: list[dict], regime: str, reuse: int, objective: str, lr: float) -> dict | None:
    return next((g for g in groups if (g["regime"], g["reuse"], g["objective"]) == (regime, reuse, objective)
                 and math.isclose(g["learning_rate"], lr, rel_tol=1e-9)), None)


def second_study(config: StarvationConfig, bases: dict, groups: list[dict], best: dict,
                 selection: list[dict]) -> dict:
    """The second study's parts of summary.json: the base models' held-out scores, the lr selection,
    each (objective, N) at its best lr, the controls beside the objectives at N = largest (common and
    best lr), and the long regime with its acceptance rule."""
    s = config.sweep
    largest, common = max(s.reuse_list), config.optim.learning_rate
    at_best = [dict(g, selected=True) for (objective, n), lr in best.items()
               if (g := _group(groups, "", n, objective, lr)) is not None]
    controls = []
    for objective in s.objective_list + s.control_list:
        for label, lr in (("common", common), ("best", best.get((objective, largest)))):
            group = None if lr is None else _group(groups, "", largest, objective, lr)
            if group is not None:
                controls.append(dict(group, lr_choice=label))
    long_groups = [g for g in groups if g["regime"] == "long"]
    out = {
        "base_held_out": {regime or "main": base.get("held_out") for regime, base in bases.items()},
        "selection": {"rule": "per (objective, N), the lr whose run on the selection seed has the highest "
                              "late-mean training score (ties: the smaller lr), fixed in code "
                              "(respo_jax.training.sweep.select_learning_rate) before the report seeds ran",
                      "seed": s.selection_seed, "records": selection},
        "best": at_best, "controls": controls, "long_regime": long_groups,
    }
    if s.long_difficulty:
        out["long_acceptance"] = long_acceptance(long_groups)
    return out


def add_per_seed(summary: dict) -> dict:
    """`summary` with the second study's per-seed comparisons (`experiments.starvation_findings`)."""
    return dict(summary, per_seed=per_seed_findings(summary))


CLIPPED = ("grpo", "gspo")  # the clipped baselines of the long regime's acceptance rule
CLIP_LIMIT, TAIL_SHARE = 0.01, 0.15


def long_acceptance(groups: list[dict]) -> dict:
    """The second study's rule for the long-response regime, per N: the clipped baselines clip little
    (mean clip fraction < 1% under each) while >= 15% of positive responses reach log W < -1 (under each
    of them: the drift is there and the clip does not already remove it)."""
    out = {"rule": f"each of {', '.join(CLIPPED)}: clip fraction < {CLIP_LIMIT:.0%} and >= {TAIL_SHARE:.0%} "
                   "of positive responses with log W < -1", "by_reuse": []}
    for n in sorted({g["reuse"] for g in groups}):
        rows = [g for g in groups if g["reuse"] == n and g["objective"] in CLIPPED]
        checks = {g["objective"]: {"clip_fraction": g["clip_fraction"],
                                   "positive_log_w_lt_minus1_share": g["positive_log_w_lt_minus1_share"]}
                  for g in rows}
        met = bool(rows) and all(c["clip_fraction"] is not None and c["clip_fraction"] < CLIP_LIMIT
                                 and (c["positive_log_w_lt_minus1_share"] or 0.0) >= TAIL_SHARE
                                 for c in checks.values())
        out["by_reuse"].append({"reuse": n, "accepted": met, "checks": checks})
    return out
