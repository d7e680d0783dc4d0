"""The whole report: every section the runs have data for, as markdown with its figures and numbers
(`build_report`), written atomically into a directory (`write_report`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from respo_jax.eval.report.figures import curves_figure, length_bins_figure, missing_curves
from respo_jax.eval.report.loading import PAPER_E3_BATCHES, ReportError, Run
from respo_jax.eval.report.tables import (
    DASH,
    SummaryWindows,
    evaluation_markdown,
    evaluation_table,
    length_bin_groups,
    length_bins_markdown,
    positive_branch_markdown,
    positive_branch_tables,
    summary_windows,
    training_summary,
    training_summary_markdown,
)
from respo_jax.eval.statistics import LengthBins
from respo_jax.runs import (
    CURVES_FILE,
    LENGTH_BINS_FIGURE,
    REPORT_DATA_FILE,
    REPORT_FILE,
    atomic_write,
    atomic_write_bytes,
)

CURVES_FIGURE = CURVES_FILE  # build_report's figures
REPORT_FIGURES = (CURVES_FIGURE, LENGTH_BINS_FIGURE)


@dataclasses.dataclass
class Report:
    """A built report: markdown (linking the figures by file name), figures (file name -> Figure) and
    data (every table's numbers, JSON-serializable)."""

    markdown: str
    figures: dict[str, Figure]
    data: dict


def _jsonable(value):
    if isinstance(value, LengthBins):  # a NamedTuple: as a mapping, before tuples become lists
        return {field: _jsonable(getattr(value, field)) for field in value._fields}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return None if math.isnan(value) else (str(value) if math.isinf(value) else value)
    return value


def build_report(runs: Sequence[Run], *, windows: SummaryWindows | None = None,
                 e3_batches: int = PAPER_E3_BATCHES, num_bins: int = 10, title: str = "Run report") -> Report:
    """Every section the runs have data for: runs, training curves, early/late summary, Tab. 1, length
    bins (runs with evaluations), Tabs. 5-7 (runs with rollout files). Sections without data say why."""
    runs = list(runs)
    if not runs:
        raise ReportError("no runs to report")
    windows = windows or summary_windows(runs)
    figures: dict[str, Figure] = {}
    data: dict = {"runs": [], "windows": dataclasses.asdict(windows)}
    md = [f"# {title}", "", "## Runs", "",
          "| Run | Directory | Objective | N | M × G | Seed | Iterations | Policy updates | Rollout files "
          "| Evaluation |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        r = run.config["rollout"]
        evaluation = DASH if run.evaluation is None else (
            f"{run.evaluation.path} (step {run.evaluation.step})" if run.evaluation.step is not None
            else run.evaluation.path)
        md.append(f"| {run.label} | {run.path} | {run.objective} | {run.reuse} | "
                  f"{r['prompts_per_minibatch']} × {r['group_size']} | {run.seed} | {run.iterations} | "
                  f"{run.policy_updates} | {len(run.rollouts)} | {evaluation} |")
        data["runs"].append({"label": run.label, "path": run.path, "objective": run.objective,
                             "reuse": run.reuse, "seed": run.seed, "iterations": run.iterations,
                             "policy_updates": run.policy_updates, "rollout_files": len(run.rollouts),
                             "evaluation": None if run.evaluation is None else run.evaluation.path,
                             "notes": list(run.notes)})
    notes = [note for run in runs for note in run.notes]
    if notes:
        md += [""] + [f"- {note}" for note in notes]

    figures[CURVES_FIGURE] = curves_figure(runs)
    md += ["", "## Training curves (Figs. 3, 5)", "", f"![training curves]({CURVES_FIGURE})", "",
           "Training score (score+1)/2 (§4.1), mean response length, approximate KL (k1) and rollout-time "
           "entropy per RL iteration, against policy updates."]
    md += [f"- {note}" for note in missing_curves(runs)]

    summary = training_summary(runs, windows)
    data["training_summary"] = summary
    md += ["", "## Early and late training score (§4.1, App. E.1)", "",
           training_summary_markdown(summary, windows)]

    evaluated = [run for run in runs if run.evaluation is not None]
    md += ["## Evaluation (Tab. 1)", ""]
    if evaluated:
        table = evaluation_table(runs)
        data["evaluation"] = table
        md.append(evaluation_markdown(table))
        groups = length_bin_groups(runs, num_bins)
        data["length_bins"] = [{"reuse": g.reuse, "cap": g.cap, "edges": g.edges, "bins": g.bins}
                               for g in groups]
        figures[LENGTH_BINS_FIGURE] = length_bins_figure(groups)
        md += ["## Accuracy across response lengths (App. E.2, Tab. 4, Fig. 3 right)", "",
               f"![accuracy per length bin]({LENGTH_BINS_FIGURE})", "", length_bins_markdown(groups)]
    else:
        md += ["No run has evaluation outputs (run_dir/eval/summary.json from python -m "
               "experiments.evaluate, or --eval RUN_DIR=EVAL_DIR): no Tab. 1 and no length bins.", ""]

    md += ["## Positive-branch weight and length dynamics (App. E.3, Tabs. 5–7)", ""]
    if any(run.rollouts for run in runs):
        tables = positive_branch_tables(runs, e3_batches)
        data["positive_branch"] = tables
        md.append(positive_branch_markdown(tables))
        lacking = [run.label for run in runs if not run.rollouts]
        if lacking:
            md.append(f"No rollout files (rollouts/iteration_*.npz): {', '.join(lacking)}.\n")
    else:
        md += ["No run has rollout files (rollouts/iteration_*.npz): no E.3 tables.", ""]
    return Report(markdown="\n".join(md).rstrip() + "\n", figures=figures, data=_jsonable(data))


def write_report(report: Report, out_dir: str | os.PathLike, dpi: int = 120) -> str:
    """Writes report.md, report.json and the figures (PNG) into `out_dir` (created; files replaced
    atomically; a figure of an earlier report that this one lacks is removed, so no stale PNG stays
    next to it); returns the path of report.md."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for name in REPORT_FIGURES:
        if name not in report.figures and os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    for name, fig in report.figures.items():
        atomic_write(os.path.join(out_dir, name), lambda handle: fig.savefig(handle, format="png", dpi=dpi))
    atomic_write_bytes(os.path.join(out_dir, REPORT_DATA_FILE),
                       (json.dumps(report.data, indent=2, allow_nan=False) + "\n").encode("utf-8"))
    path = os.path.join(out_dir, REPORT_FILE)
    atomic_write_bytes(path, report.markdown.encode("utf-8"))
    return path

