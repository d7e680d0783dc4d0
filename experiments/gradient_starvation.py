"""Gradient starvation at CPU scale: a matched sweep of objectives x rollout-reuse ratio N x seeds
(paper §3.2, §4.1-4.3, App. E.3) on the synthetic scratchpad task, and its report.

    python -m experiments.gradient_starvation                      # the full sweep, then its report
    python -m experiments.gradient_starvation --quick              # a reduced sweep in minutes
    python -m experiments.gradient_starvation sweep.seeds=0 sweep.reuse=1,32 optim.learning_rate=1e-3
    python -m experiments.gradient_starvation --report-only        # re-report the finished cells

Steps: (1) the shared base model — the supervised warm-up of `sweep.base_seed`, saved once in
Hugging Face format under sweep.runs_dir/base; (2) every cell (`respo_jax.training.sweep`) trained by
the main trainer (`experiments.train.run_experiment`) from that base into sweep.runs_dir/cells/<name>;
(3) the report in sweep.out_dir: summary.json, summary.md and gradient_starvation.png, computed with
`respo_jax.eval` (early peak, late mean, App. E.3's positive-branch allocation) from the cells' run
directories.

One sweep at a time per sweep.runs_dir: a second one is refused in one line naming the first (its
lock, `respo_jax.training.run_lock`, is held for the whole sweep; each cell's trainer also locks the
cell's directory). Resumable per cell: a cell trains in `<name>.partial/` and is renamed to `<name>/`
only when finished (metrics, rollout files, held-out evaluation; its checkpoints are deleted), so a
killed sweep restarts the unfinished cell and never recomputes a finished one. A finished cell or
base model made with a different config is refused (ConfigError naming the keys), never mixed in. Exit
status 2 on a configuration error (one line on stderr), 1 when a run fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import time

import numpy as np
from matplotlib.figure import Figure
from tqdm import tqdm

from experiments.cli import ArgumentParser, run_cli, run_failures
from respo_jax.eval import positive_branch
from respo_jax.eval.report import ReportError, Run, load_run, positive_branch_tables
from respo_jax.eval.statistics import early_peak, late_mean
from respo_jax.files import file_sha256
from respo_jax.runs import atomic_write_bytes
from respo_jax.training import run_dir
from respo_jax.training.compilation import configure_compilation_cache
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.run_lock import RunLock
from respo_jax.training.sweep import Cell, StarvationConfig, select_learning_rate

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "gradient_starvation.py")
BASE_INFO = "base.json"  # in the base model directory: the config that made it, its checksum, accuracy
CELL_INFO = "sweep_cell.json"  # in a finished cell: the cell and the base model it started from
SUMMARY_JSON, SUMMARY_MD, FIGURE = "summary.json", "summary.md", "gradient_starvation.png"
GRID_FIGURE, CONTROLS_FIGURE, LONG_FIGURE = "grid.png", "controls.png", "long_regime.png"  # second study
# CPU-scale windows (fractions of the run's policy updates): the early peak over the first quarter (the
# paper's 256 of 1,024) and the late mean over the last quarter (the paper's last 128 of 1,024 is an
# eighth; a quarter gives N=32 three logged points instead of two).
EARLY_FRACTION, LATE_FRACTION = 0.25, 0.25
CURVE_KEYS = ("train_accuracy", "response_length")
OBJECTIVE_NAMES = {"respo": "ReSPO", "vespo": "VESPO", "grpo": "GRPO", "gspo": "GSPO"}


# ---------------------------------------------------------------------------------------------------
# Config


def load_sweep_config(path: str, quick: bool = False) -> StarvationConfig:
    """The config file's `get_config()` (or `get_quick_config()` with `quick`), a StarvationConfig."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: no such file")
    spec = importlib.util.spec_from_file_location("starvation_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name = "get_quick_config" if quick else "get_config"
    if not hasattr(module, name):
        raise ConfigError(f"--config {path!r}: the file has no {name}()")
    config = getattr(module, name)()
    if not isinstance(config, StarvationConfig):
        raise ConfigError(f"--config {path!r}: {name}() returned {type(config).__name__}, expected "
                          "StarvationConfig")
    return config


def _json_view(obj):
    return json.loads(json.dumps(obj))


# ---------------------------------------------------------------------------------------------------
# Running


def base_fingerprint(config: StarvationConfig, regime: str = "") -> dict:
    """The settings that define the base model and its held-out score: model, task, warm-up, its seed,
    the held-out problems and the generation cap (not the RL settings, which cells may vary)."""
    view = _json_view(config.base_experiment(regime).to_dict())
    fingerprint = {"model": view["model"], "task": view["task"], "warmup": view["warmup"],
                   "run.seed": view["run"]["seed"], "run.eval_problems": view["run"]["eval_problems"],
                   "rollout.max_new_tokens": view["rollout"]["max_new_tokens"]}
    if config.run.eval_samples:  # the second study's sampled held-out score (absent: the first study's)
        fingerprint.update({f"run.{k}": view["run"][k] for k in ("eval_samples", "eval_temperature",
                                                                   "eval_top_p")})
    return fingerprint


def prepare_base(config: StarvationConfig, show: bool = True, regime: str = "") -> dict:
    """The shared base model of `regime`: reads sweep.runs_dir/base (base_long) when it was made by this
    config, else runs the warm-up, evaluates it on the held-out split and saves it (atomically: written to
    base.partial/, then renamed). Returns its base.json: {"config", "sha256", "greedy_accuracy",
    "sft_loss_last", "seconds"} and, with run.eval_samples, "held_out" (`RLTrainer.evaluation`)."""
    from respo_jax.models.qwen3 import save_pretrained
    from respo_jax.training.loop import RLTrainer

    base_dir, experiment = config.regime_base_dir(regime), config.base_experiment(regime)
    wanted = base_fingerprint(config, regime)
    info_path = os.path.join(base_dir, BASE_INFO)
    if os.path.isdir(base_dir):
        if not os.path.isfile(info_path):
            raise ConfigError(f"{base_dir} exists but has no {BASE_INFO} (not a base model of this sweep); "
                              "remove it or choose another sweep.runs_dir")
        info = run_dir.read_json(info_path)
        if info.get("config") != wanted:
            saved = info.get("config") or {}
            keys = sorted(k for k in wanted if saved.get(k) != wanted[k])
            raise ConfigError(f"{base_dir} holds a base model made with a different config (differs in "
                              f"{keys}); its cells would not be matched: choose another sweep.runs_dir "
                              "or delete that directory")
        return info
    started = time.perf_counter()
    trainer = RLTrainer(experiment)
    losses = [record["sft_loss"] for record in tqdm(
        trainer.warmup(), total=experiment.warmup.steps, desc="base model warm-up", disable=not show)]
    held_out = trainer.evaluation() or {}
    accuracy = held_out.get("greedy_accuracy")
    partial = base_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    save_pretrained(trainer.model(), partial)
    weights = sorted(f for f in os.listdir(partial) if f.endswith(".safetensors"))
    info = {
        "config": wanted,
        "sha256": hashlib.sha256("".join(file_sha256(os.path.join(partial, f)) for f in weights).encode())
        .hexdigest(),
        "greedy_accuracy": accuracy,
        "sft_loss_last": float(np.mean(losses[-10:])) if losses else None,
        "seconds": time.perf_counter() - started,
    }
    if config.run.eval_samples:
        info["held_out"] = held_out
    run_dir.atomic_write_json(os.path.join(partial, BASE_INFO), info)
    os.replace(partial, base_dir)
    return info


def finished(config: StarvationConfig, cell: Cell, base: dict) -> bool:
    """Whether `cell` is done (its directory exists); ConfigError when it was run with another config
    or from another base model (a stale cell is never mixed into a report)."""
    path = config.cell_dir(cell)
    if not os.path.isdir(path):
        return False
    info_path, config_path = os.path.join(path, CELL_INFO), os.path.join(path, run_dir.CONFIG_FILE)
    if not (os.path.isfile(info_path) and os.path.isfile(config_path)):
        raise ConfigError(f"{path} is not a finished cell ({CELL_INFO} or config.json missing); remove it")
    info, saved = run_dir.read_json(info_path), run_dir.read_json(config_path)
    expected = config.experiment(cell)
    problems = run_dir.config_differences(saved, expected)
    if saved.get("run", {}).get("policy_updates") != expected.run.policy_updates:
        problems.append(f"run.policy_updates: saved {saved.get('run', {}).get('policy_updates')!r}, "
                        f"now {expected.run.policy_updates!r}")
    if info.get("base_sha256") != base["sha256"]:
        problems.append("it started from another base model")
    if problems:
        raise ConfigError(f"{path} was run with a different config ({'; '.join(problems[:3])}); choose "
                          "another sweep.runs_dir or delete the cell")
    return True


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


def selected_learning_rates(config: StarvationConfig, bases: dict) -> tuple[dict, list[dict]]:
    """({(objective, N): best lr}, the selection records) from the finished selection-seed cells; an
    (objective, N) gets its lr only once every lr of the grid has finished on the selection seed."""
    s = config.sweep
    best, records = {}, []
    if s.selection_seed < 0:
        return best, records
    for reuse in s.reuse_list:
        objectives = s.on_policy_list if reuse == 1 < max(s.reuse_list) else s.objective_list
        if reuse == max(s.reuse_list):
            objectives = objectives + s.control_list
        for objective in objectives:
            scores = {}
            for lr in s.learning_rate_list:
                cell = Cell(objective, reuse, s.selection_seed, lr)
                if finished(config, cell, bases[""]):
                    info = run_dir.read_json(os.path.join(config.cell_dir(cell), CELL_INFO))
                    scores[lr] = info.get("selection_score")
            if len(scores) == len(s.learning_rate_list):
                best[(objective, reuse)] = select_learning_rate(scores)
                records.append({"objective": objective, "reuse": reuse, "seed": s.selection_seed,
                                "late_means": {f"{lr:g}": v for lr, v in scores.items()},
                                "best_learning_rate": best[(objective, reuse)]})
    return best, records


def run_cell(config: StarvationConfig, cell: Cell, base: dict) -> None:
    """Trains one cell in <cell>.partial/, drops its checkpoints and renames it to <cell>/."""
    from experiments.train import run_experiment

    final = config.cell_dir(cell)
    partial = final + ".partial"
    started = time.perf_counter()
    run_experiment(config.experiment(cell, out_dir=partial))
    shutil.rmtree(os.path.join(partial, run_dir.CHECKPOINT_DIR), ignore_errors=True)
    saved = run_dir.read_json(os.path.join(partial, run_dir.CONFIG_FILE))
    saved["run"]["out_dir"] = final
    run_dir.atomic_write_json(os.path.join(partial, run_dir.CONFIG_FILE), saved)
    run_dir.atomic_write_json(os.path.join(partial, CELL_INFO), {
        "cell": dataclasses.asdict(cell), "base_sha256": base["sha256"],
        "seconds": time.perf_counter() - started,
        "selection_score": selection_score(load_run(partial), cell_window(config, cell))})
    os.replace(partial, final)


# ---------------------------------------------------------------------------------------------------
# Summary


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
        "settings": _json_view(dataclasses.asdict(config)),
        "windows": window,
        "base_model": {k: bases[""][k] for k in ("sha256", "greedy_accuracy", "sft_loss_last")},
        "groups": groups, "cells": cells, "missing_cells": missing,
    }
    if s.learning_rates:
        summary.update(second_study(config, bases, groups, best or {}, selection or []))
    return summary


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


CLIPPED = ("grpo", "gspo")  # the clipped baselines of the long regime's acceptance rule
CLIP_LIMIT, TAIL_SHARE = 0.01, 0.15


def long_acceptance(groups: list[dict]) -> dict:
    """Issue 28's rule for the long-response regime, per N: the clipped baselines clip little (mean clip
    fraction < 1% under each) while >= 15% of positive responses reach log W < -1 (under each of them:
    the drift is there and the clip does not already remove it)."""
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


def _ratio(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _pct(value, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f}"


def summary_markdown(summary: dict) -> str:
    """The per-(objective, N) table (values in %, means over seeds) and a drift/deep-tail table."""
    w = summary["windows"]
    lines = [
        f"| Objective | N | Early peak | Late mean ± temporal std | Cross-seed std | Held-out acc. "
        "| Pos. log W<−1 | Mass log W<−1 | Amplif. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["groups"]:
        late = "–" if g["late_mean"] is None else f"{_pct(g['late_mean'])} ± {_pct(g['late_temporal_std'])}"
        held = _pct(g["heldout_accuracy"])
        if g["heldout_accuracy_cross_seed_std"] is not None:
            held += f" ± {_pct(g['heldout_accuracy_cross_seed_std'])}"
        amp = "–" if g["positive_low_w_amplification"] is None else f"{g['positive_low_w_amplification']:.2f}×"
        lines.append(
            f"| {OBJECTIVE_NAMES.get(g['objective'], g['objective'])} | {g['reuse']} | {_pct(g['early_peak'])} "
            f"| {late} | {_pct(g['late_mean_cross_seed_std'])} | {held} | {_pct(g['positive_low_w_share'])} "
            f"| {_pct(g['positive_low_w_mass_share'])} | {amp} |")
    lines += [
        "",
        "Training score (score+1)/2 and held-out greedy accuracy in %, means over seeds "
        f"({', '.join(str(s) for s in summary['settings']['sweep']['seeds'].split(','))}). "
        f"{w['note']} Temporal std: within-run, averaged over seeds; cross-seed std: population std of the "
        "late means. Held-out: greedy accuracy on the disjoint test split after the last update (± cross-seed "
        f"std); the base model scores {_pct(summary['base_model']['greedy_accuracy'])}. Positive-branch "
        "columns (App. E.3, Tab. 5): share of positive responses (Â > 0) and of their coefficient mass "
        "|Â|·φ with log W < −1, and amplification = mass share / response share, over the second half of "
        "the first half of each run's rollout batches (the paper's batches 9–16 of 32), means over seeds.",
        "",
        "| Objective | N | log W q05 | median | q95 | share \\|log W\\|>1 | Pos. −5<log W≤−2 | Mass −5<log W≤−2 "
        "| Amplif. | Length, log W≤−0.5 (n) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["groups"]:
        amp = "–" if g["positive_deep_tail_amplification"] is None else \
            f"{g['positive_deep_tail_amplification']:.2f}×"
        lines.append(
            f"| {OBJECTIVE_NAMES.get(g['objective'], g['objective'])} | {g['reuse']} | {g['log_w_q05']:+.2f} "
            f"| {g['log_w_median']:+.2f} | {g['log_w_q95']:+.2f} | {_pct(g['log_w_abs_gt1_share'])} "
            f"| {_pct(g['positive_deep_tail_share'])} | {_pct(g['positive_deep_tail_mass_share'])} | {amp} "
            f"| {_ratio(g['positive_low_w_length_relative'])} ({g['positive_low_w_length_count']}) |")
    lines += ["", "log W quantiles and the share with |log W| > 1 pooled over every response of each run "
              "(the weight the objective saw at its update), means over seeds; deep-tail columns as Tab. 5. "
              "Length: mean length of the positive responses with log W ≤ −0.5 relative to all positive "
              "responses (Tab. 7 pooled over the first half of the run's rollout batches; paper at N=32: ReSPO "
              "1.13×, VESPO 1.06×), weighted over seeds by their count n."]
    if summary["missing_cells"]:
        lines += ["", f"Not finished (not in the table): {', '.join(summary['missing_cells'])}."]
    return "\n".join(lines) + "\n"


V2_HEADER = ("| Objective | N | lr | Updates | Late mean ± temporal std | Cross-seed std | Greedy held-out "
             "| Sampled pass@1 ± SE | Approx. KL | Clip frac. | Pos. log W<−1 | Neg. log W<0 "
             "| Neg. mass log W<0 |")


def _v2_row(g: dict) -> str:
    late = "–" if g["late_mean"] is None else f"{_pct(g['late_mean'])} ± {_pct(g['late_temporal_std'])}"
    sampled = "–" if g["sampled_pass_at_1"] is None else \
        f"{_pct(g['sampled_pass_at_1'])} ± {_pct(g['sampled_pass_at_1_se'])}"
    kl = "–" if g["approx_kl"] is None else f"{g['approx_kl']:.4f}"
    name = OBJECTIVE_NAMES.get(g["objective"], g["objective"])
    return (f"| {name} | {g['reuse']} | {g['learning_rate']:g} | {g['policy_updates']} | {late} "
            f"| {_pct(g['late_mean_cross_seed_std'])} | {_pct(g['heldout_accuracy'])} | {sampled} | {kl} "
            f"| {_pct(g['clip_fraction'], 2)} | {_pct(g['positive_log_w_lt_minus1_share'])} "
            f"| {_pct(g['negative_log_w_lt0_share'])} | {_pct(g['negative_log_w_lt0_mass_share'])} |")


def _v2_table(rows: list[dict]) -> list[str]:
    return [V2_HEADER, "|" + "---|" * V2_HEADER.count(" | ") + "---|", *(_v2_row(g) for g in rows)] \
        if rows else ["(no finished cell yet)"]


def second_study_markdown(summary: dict) -> str:
    """The second study's tables: the lr grid, the selection, each method at its best lr, the controls
    and the long regime with its acceptance (values in %, means over the report seeds)."""
    settings = summary["settings"]["sweep"]
    main = [g for g in summary["groups"] if g["regime"] == ""]
    base = (summary.get("base_held_out") or {}).get("main") or {}
    lines = ["## Grid: every objective at every lr (lr × updates fixed)", "", *_v2_table(main), "",
             f"Means over the report seeds ({settings['seeds']}). Training score (score+1)/2: late mean over "
             "the last quarter of each run's updates, in blocks of the largest N. Held-out: greedy accuracy "
             "and sampled pass@1 (± its standard error over problems, combined over seeds) after the last "
             f"update; the base model: greedy {_pct(base.get('greedy_accuracy'))}, sampled "
             f"{_pct(base.get('sampled_pass_at_1'))} ± {_pct(base.get('sampled_pass_at_1_se'))}. Approx. KL: "
             "k1 to π_old per response, mean over rollout batches; clip fraction: share of tokens clipped "
             "(clipped objectives only); Pos. log W<−1: share of positive responses; Neg. log W<0: share "
             "of negative responses (Â < 0) with log W < 0, and their share of the negative coefficient "
             "mass |Â|·φ.", "", "## Selection of each method's lr", "",
             f"Rule: {summary['selection']['rule']}; selection seed {summary['selection']['seed']}.", "",
             "| Objective | N | Late mean per lr (selection seed) | Selected lr |", "|---|---|---|---|"]
    for r in summary["selection"]["records"]:
        scores = ", ".join(f"{lr}: {_pct(v)}" for lr, v in r["late_means"].items())
        lines.append(f"| {OBJECTIVE_NAMES.get(r['objective'], r['objective'])} | {r['reuse']} | {scores} "
                     f"| {r['best_learning_rate']:g} |")
    lines += ["", "## Each method at its own best lr", "", *_v2_table(summary["best"]), "",
              "## Controls at the largest N (common lr, then each one's best lr)", "",
              *_v2_table(summary["controls"]), "",
              "Controls (registered with `kernel_objective` by the config file): REINFORCE φ ≡ 1; ReSPO's φ⁺ "
              "with VESPO's φ⁻; VESPO's φ⁺ with ReSPO's φ⁻."]
    if "long_acceptance" in summary:
        accept = summary["long_acceptance"]
        lines += ["", f"## Long-response regime (task.difficulty={settings['long_difficulty']}, each "
                  "objective at its best lr of the largest N)", "", *_v2_table(summary["long_regime"]), "",
                  f"Acceptance: {accept['rule']}."]
        for row in accept["by_reuse"]:
            checks = "; ".join(f"{OBJECTIVE_NAMES.get(k, k)} clip {_pct(v['clip_fraction'], 2)}%, "
                               f"pos. log W<−1 {_pct(v['positive_log_w_lt_minus1_share'])}%"
                               for k, v in row["checks"].items())
            lines.append(f"- N = {row['reuse']}: {'accepted' if row['accepted'] else 'NOT accepted'} "
                         f"({checks or 'no clipped baseline finished'}).")
    if summary["missing_cells"]:
        lines += ["", f"Not finished (not in the tables): {', '.join(summary['missing_cells'])}."]
    return "\n".join(lines) + "\n"


def grid_figure(summary: dict) -> Figure:
    """Late-mean training score (top) and sampled pass@1 (bottom) against lr, one column per N, one
    line per objective and control (means over seeds, bars: cross-seed std)."""
    main = [g for g in summary["groups"] if g["regime"] == ""]
    reuses = sorted({g["reuse"] for g in main}) or [1]
    names = list(dict.fromkeys(g["objective"] for g in main))
    fig = Figure(figsize=(4.4 * len(reuses), 6.4))
    axes = fig.subplots(2, len(reuses), squeeze=False, sharex=True)
    for col, n in enumerate(reuses):
        for row, (key, err, label) in enumerate((
                ("late_mean", "late_mean_cross_seed_std", "late-mean training score"),
                ("sampled_pass_at_1", "sampled_pass_at_1_cross_seed_std", "held-out sampled pass@1"))):
            ax = axes[row][col]
            for index, name in enumerate(names):
                rows = sorted((g for g in main if g["reuse"] == n and g["objective"] == name
                               and g[key] is not None), key=lambda g: g["learning_rate"])
                if rows:
                    ax.errorbar([g["learning_rate"] for g in rows], [g[key] for g in rows],
                                yerr=[g[err] or 0.0 for g in rows], color=f"C{index % 10}", marker="o", ms=3,
                                capsize=2, label=OBJECTIVE_NAMES.get(name, name))
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"N = {n}")
            else:
                ax.set_xlabel("learning rate")
            if col == 0:
                ax.set_ylabel(label)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=max(1, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def controls_figure(summary: dict) -> Figure:
    """Late-mean training score and sampled pass@1 of every objective and control at the largest N, at
    the common lr and at its best lr (bars: means over seeds, whiskers: cross-seed std)."""
    rows = summary["controls"]
    fig = Figure(figsize=(max(6.0, 0.9 * len(rows) + 2), 6.4))
    axes = fig.subplots(2, 1, squeeze=False)[:, 0]
    labels = [f"{OBJECTIVE_NAMES.get(g['objective'], g['objective'])}\n{g['lr_choice']} "
              f"{g['learning_rate']:g}" for g in rows]
    panels = (("late_mean", "late_mean_cross_seed_std", "late-mean training score"),
              ("sampled_pass_at_1", "sampled_pass_at_1_cross_seed_std", "held-out sampled pass@1"))
    for ax, (key, err, label) in zip(axes, panels):
        values = [g[key] if g[key] is not None else np.nan for g in rows]
        ax.bar(np.arange(len(rows)), values, yerr=[g[err] or 0.0 for g in rows], capsize=2,
               color=["C0" if g["lr_choice"] == "common" else "C1" for g in rows])
        ax.set_xticks(np.arange(len(rows)), labels, fontsize=7)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def starvation_figure(summary: dict) -> Figure:
    """Training score (top) and response length (bottom) vs policy updates, one column per N, one curve
    per objective: the blocked curves' mean over seeds with a min-max band across seeds."""
    reuses = sorted({c["reuse"] for c in summary["cells"]})
    objectives = [o for o in summary["settings"]["sweep"]["objectives"].split(",")
                  if any(c["objective"] == o for c in summary["cells"])]
    fig = Figure(figsize=(4.4 * len(reuses), 6.4))
    axes = fig.subplots(2, len(reuses), squeeze=False, sharex="col")
    for col, n in enumerate(reuses):
        for row, (key, label) in enumerate((("train_accuracy", "training score (score+1)/2"),
                                            ("response_length", "response length (tokens)"))):
            ax = axes[row][col]
            for index, objective in enumerate(objectives):
                members = [c for c in summary["cells"] if c["reuse"] == n and c["objective"] == objective]
                if not members:
                    continue
                steps = np.asarray(members[0]["blocked_curve"]["policy_updates"])
                values = np.array([c["blocked_curve"][key] for c in members])
                color = f"C{index}"
                name = OBJECTIVE_NAMES.get(objective, objective)
                ax.plot(steps, values.mean(axis=0), color=color, lw=1.6, label=name,
                        marker="o" if steps.size <= 16 else None, ms=3)
                if len(members) > 1:
                    ax.fill_between(steps, values.min(axis=0), values.max(axis=0), color=color, alpha=0.18,
                                    lw=0)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"N = {n}")
            else:
                ax.set_xlabel("policy updates")
            if col == 0:
                ax.set_ylabel(label)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _curves_of(summary: dict, keep) -> dict:
    """`summary` restricted to the cells `keep(cell)` accepts (for `starvation_figure`)."""
    return dict(summary, cells=[c for c in summary["cells"] if keep(c)])


def write_outputs(summary: dict, out_dir: str) -> list[str]:
    """summary.json, summary.md and the figures in out_dir (each written atomically): the curves, and in
    the second study the grid, the controls and the long regime."""
    import io

    os.makedirs(out_dir, exist_ok=True)
    second = "selection" in summary
    paths = [os.path.join(out_dir, name) for name in (SUMMARY_JSON, SUMMARY_MD)]
    atomic_write_bytes(paths[0], (json.dumps(summary, indent=1) + "\n").encode())
    atomic_write_bytes(paths[1], (second_study_markdown if second else summary_markdown)(summary).encode())
    figures = {FIGURE: lambda: starvation_figure(summary)}
    if second:
        settings = summary["settings"]
        common, selection_seed = settings["optim"]["learning_rate"], settings["sweep"]["selection_seed"]
        figures[FIGURE] = lambda: starvation_figure(_curves_of(summary, lambda c: (
            c["regime"] == "" and c["seed"] != selection_seed and math.isclose(c["learning_rate"], common))))
        figures[GRID_FIGURE] = lambda: grid_figure(summary)
        figures[CONTROLS_FIGURE] = lambda: controls_figure(summary)
        if summary["long_regime"]:
            figures[LONG_FIGURE] = lambda: starvation_figure(
                _curves_of(summary, lambda c: c["regime"] == "long"))
    for name, make in figures.items():
        buffer = io.BytesIO()
        make().savefig(buffer, format="png", dpi=90)
        paths.append(os.path.join(out_dir, name))
        atomic_write_bytes(paths[-1], buffer.getvalue())
    for path in paths:  # results to share (the temp files are private)
        os.chmod(path, 0o644)
    return paths


# ---------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("--quick", action="store_true", help="the config file's get_quick_config()")
    parser.add_argument("--report-only", action="store_true", help="report the finished cells, train nothing")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    config = apply_overrides(load_sweep_config(args.config, args.quick), args.overrides)
    if args.report_only:  # reads the cells (a running sweep may go on) and writes only the report
        return _sweep(config, args.report_only)
    # One sweep per runs_dir (the base model and the cells are its files); each cell's training also
    # holds its own directory's lock (experiments.train.run_experiment).
    lock = RunLock.acquire(config.sweep.runs_dir, "gradient-starvation sweep", key="sweep.runs_dir")
    try:
        return _sweep(config, args.report_only)
    finally:
        lock.release(remove_if_created=True)


def _sweep(config: StarvationConfig, report_only: bool) -> dict:
    configure_compilation_cache(config.compilation_cache_dir, key="sweep.compilation_cache")
    if report_only:
        base_dir = config.base_dir
        if not os.path.isfile(os.path.join(base_dir, BASE_INFO)):
            raise ConfigError(f"--report-only: no base model in {base_dir} (nothing was run)")
    bases = {"": prepare_base(config, show=True)}
    long_info = os.path.join(config.regime_base_dir("long"), BASE_INFO)
    if config.sweep.long_difficulty and os.path.isfile(long_info):
        bases["long"] = prepare_base(config, show=True, regime="long")  # checks a finished one matches
    best, selection = selected_learning_rates(config, bases)
    cells = config.cells(best)
    todo = [c for c in cells if not (c.regime in bases and finished(config, c, bases[c.regime]))]
    if not report_only:
        # The cell list grows as the selection cells finish (the cells at a selected lr), so the list
        # is rebuilt after every cell; the order is `StarvationConfig.cells`'.
        bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="cells", disable=False)
        while todo:
            cell = todo[0]
            if cell.regime not in bases:
                bases[cell.regime] = prepare_base(config, show=True, regime=cell.regime)
            bar.set_postfix_str(cell.name)
            run_cell(config, cell, bases[cell.regime])
            best, selection = selected_learning_rates(config, bases)
            cells = config.cells(best)
            todo = [c for c in cells if not (c.regime in bases and finished(config, c, bases[c.regime]))]
            bar.total = len(cells)
            bar.update(1)
        bar.close()
    runs = {c: load_run(config.cell_dir(c)) for c in cells
            if c.regime in bases and finished(config, c, bases[c.regime])}
    if not runs:
        raise ConfigError(f"no finished cell in {os.path.join(config.sweep.runs_dir, 'cells')}")
    summary = summarize(config, bases, runs, best, selection)
    paths = write_outputs(summary, config.sweep.out_dir)
    print((second_study_markdown if "selection" in summary else summary_markdown)(summary))
    print("\n".join(paths))
    return summary


def cli(argv: list[str]) -> int:
    """`main` for the command line: exit status 2 on a configuration error, 1 when a run or the report
    fails, each with one line on stderr."""
    return run_cli(main, argv, failures=run_failures() + (ReportError,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
