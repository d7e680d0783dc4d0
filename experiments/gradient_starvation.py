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
from respo_jax.training.sweep import Cell, StarvationConfig

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "gradient_starvation.py")
BASE_INFO = "base.json"  # in the base model directory: the config that made it, its checksum, accuracy
CELL_INFO = "sweep_cell.json"  # in a finished cell: the cell and the base model it started from
SUMMARY_JSON, SUMMARY_MD, FIGURE = "summary.json", "summary.md", "gradient_starvation.png"
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


def base_fingerprint(config: StarvationConfig) -> dict:
    """The settings that define the base model and its held-out score: model, task, warm-up, its seed,
    the held-out problems and the generation cap (not the RL settings, which cells may vary)."""
    view = _json_view(config.base_experiment().to_dict())
    return {"model": view["model"], "task": view["task"], "warmup": view["warmup"],
            "run.seed": view["run"]["seed"], "run.eval_problems": view["run"]["eval_problems"],
            "rollout.max_new_tokens": view["rollout"]["max_new_tokens"]}


def prepare_base(config: StarvationConfig, show: bool = True) -> dict:
    """The shared base model: reads sweep.runs_dir/base when it was made by this config, else runs the
    warm-up, evaluates it on the held-out split and saves it (atomically: written to base.partial/, then
    renamed). Returns its base.json: {"config", "sha256", "greedy_accuracy", "sft_loss_last", "seconds"}."""
    from respo_jax.models.qwen3 import save_pretrained
    from respo_jax.training.loop import RLTrainer

    base_dir, experiment = config.base_dir, config.base_experiment()
    wanted = base_fingerprint(config)
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
    accuracy = trainer.evaluate()
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
        "seconds": time.perf_counter() - started})
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
        "objective": cell.objective, "reuse": cell.reuse, "seed": cell.seed,
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


def _pooled_relative(rows: list[dict]) -> float | None:
    """Mean over seeds of each seed's low-W length ratio, weighted by its low-W count."""
    rows = [r for r in rows if r["count"]]
    if not rows:
        return None
    return float(sum(r["count"] * r["relative"] for r in rows) / sum(r["count"] for r in rows))


def summarize(config: StarvationConfig, base: dict, runs: dict[Cell, Run]) -> dict:
    """summary.json: the settings, the base model, one record per cell and per (objective, N)."""
    window = windows(config.sweep.policy_updates, max(config.sweep.reuse_list))
    cells = [cell_summary(c, runs[c], window) for c in runs]
    groups = []
    for n in config.sweep.reuse_list:
        for objective in config.sweep.objective_list:
            members = [c for c in cells if c["objective"] == objective and c["reuse"] == n]
            if members:
                groups.append(group_summary(members))
    missing = [c.name for c in config.cells() if c not in runs]
    return {
        "settings": _json_view(dataclasses.asdict(config)),
        "windows": window,
        "base_model": {k: base[k] for k in ("sha256", "greedy_accuracy", "sft_loss_last")},
        "groups": groups, "cells": cells, "missing_cells": missing,
    }


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


def write_outputs(summary: dict, out_dir: str) -> list[str]:
    """summary.json, summary.md and the figure in out_dir (each written atomically)."""
    import io

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in (SUMMARY_JSON, SUMMARY_MD, FIGURE)]
    atomic_write_bytes(paths[0], (json.dumps(summary, indent=1) + "\n").encode())
    atomic_write_bytes(paths[1], summary_markdown(summary).encode())
    buffer = io.BytesIO()
    starvation_figure(summary).savefig(buffer, format="png", dpi=90)
    atomic_write_bytes(paths[2], buffer.getvalue())
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
    base = prepare_base(config, show=True)
    cells = config.cells()
    todo = [c for c in cells if not finished(config, c, base)]
    if not report_only:
        bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="cells", disable=False)
        for cell in todo:
            bar.set_postfix_str(cell.name)
            run_cell(config, cell, base)
            bar.update(1)
        bar.close()
    runs = {c: load_run(config.cell_dir(c)) for c in cells if finished(config, c, base)}
    if not runs:
        raise ConfigError(f"no finished cell in {os.path.join(config.sweep.runs_dir, 'cells')}")
    summary = summarize(config, base, runs)
    paths = write_outputs(summary, config.sweep.out_dir)
    print(summary_markdown(summary))
    print("\n".join(paths))
    return summary


def cli(argv: list[str]) -> int:
    """`main` for the command line: exit status 2 on a configuration error, 1 when a run or the report
    fails, each with one line on stderr."""
    return run_cli(main, argv, failures=run_failures() + (ReportError,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
