"""The report's figures as matplotlib `Figure`s (no pyplot state): training curves (Figs. 3, 5) and the
accuracy per shared response-length bin (Fig. 3 right, Fig. 4a)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from respo_jax.eval.report.loading import SCORE_KEY, ReportError, Run
from respo_jax.eval.report.tables import LengthBinGroup

# (metrics key, axis label) of the curve panels: Fig. 3 (left) and Fig. 5.
CURVE_PANELS = (
    (SCORE_KEY, "training score (score+1)/2"),
    ("response_length", "response length (tokens)"),
    ("approx_kl", "approx. KL (k1)"),
    ("entropy", "entropy (nats)"),
)


# ---------------------------------------------------------------------------------------------------
# Curves (Figs. 3, 5)


def curves_figure(runs: Sequence[Run], panels: Sequence[tuple[str, str]] = CURVE_PANELS) -> Figure:
    """One panel per (metrics key, axis label), one line per run, against policy updates. Panels that no
    run logs are left out; a run that lacks a key has no line in that panel (`missing_curves`)."""
    panels = [(key, label) for key, label in panels if any(run.has_curve(key) for run in runs)]
    if not panels:
        raise ReportError("none of the runs logs any of the curve keys")
    fig = Figure(figsize=(4.2 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, label) in zip(axes, panels):
        for index, run in enumerate(runs):
            if run.has_curve(key):
                steps, values = run.curve(key)
                ax.plot(steps, values, lw=1.6, marker="o" if steps.size <= 16 else None, ms=3,
                        color=f"C{index % 10}", label=run.label)
        ax.set_xlabel("policy updates")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 4), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.07 * math.ceil(len(runs) / 4)))
    return fig


def missing_curves(runs: Sequence[Run], panels: Sequence[tuple[str, str]] = CURVE_PANELS) -> list[str]:
    """Human-readable notes on the (run, key) pairs `curves_figure` cannot draw."""
    notes = []
    for key, _ in panels:
        lacking = [run.label for run in runs if not run.has_curve(key)]
        if lacking:
            notes.append(f"{', '.join(lacking)}: metrics.jsonl has no {key!r} in every RL record (no line)")
    return notes




def length_bins_figure(groups: Sequence[LengthBinGroup]) -> Figure:
    """Accuracy per shared length bin, one panel per N, one line per run (Fig. 3 right, Fig. 4a)."""
    if not groups:
        raise ReportError("no evaluated runs: no length bins to plot")
    fig = Figure(figsize=(4.6 * len(groups), 3.6))
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups):
        x = np.arange(1, group.edges.size + 1)
        for index, (label, bins) in enumerate(group.bins.items()):
            ax.plot(x, 100 * bins.accuracy, marker="o", ms=4, lw=1.6, color=f"C{index % 10}", label=label)
        ax.set_xticks(x, [f"Q{i}" for i in x])
        ax.set_xlabel("response-length bin")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"N = {group.reuse}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


