"""The gradient-starvation sweep's figures from its summary.json: the training curves per N, and the
second study's lr grid and controls. Pure functions of the summary dict returning matplotlib Figures
(`experiments/gradient_starvation.py` saves them).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from experiments.starvation_tables import OBJECTIVE_NAMES


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
            _label_panel(ax, row, col, n, "learning rate", label)
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
            _label_panel(ax, row, col, n, "policy updates", label)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _label_panel(ax, row: int, col: int, n: int, xlabel: str, ylabel: str) -> None:
    """A panel of an (N columns) x (metric rows) grid: grid lines, N over the top row, the x label under
    the others, the metric's name left of the first column."""
    ax.grid(alpha=0.3)
    if row == 0:
        ax.set_title(f"N = {n}")
    else:
        ax.set_xlabel(xlabel)
    if col == 0:
        ax.set_ylabel(ylabel)
