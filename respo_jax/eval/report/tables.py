"""The report's tables: the early/late training summary (§4.1, Tab. 8), metrics side by side, accuracy in
shared length bins (App. E.2, Tab. 4), Tab. 1 and App. E.3's Tabs. 5-7, each as plain data and markdown.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

import numpy as np

from respo_jax.eval import positive_branch
from respo_jax.eval.config import DISPLAY_NAMES, PAPER_BENCHMARKS
from respo_jax.eval.report.loading import (
    PAPER_E3_BATCHES,
    PAPER_EARLY_UNTIL,
    PAPER_LATE_WINDOW,
    PAPER_POLICY_UPDATES,
    SCORE_KEY,
    ReportError,
    Run,
)
from respo_jax.eval.statistics import LengthBins, early_peak, late_mean, shared_length_bins

DASH = "–"


# ---------------------------------------------------------------------------------------------------
# Training summary (§4.1, App. E.1, Tab. 8)


@dataclasses.dataclass(frozen=True)
class SummaryWindows:
    """The early-peak and late-mean windows, in policy updates.

    early_until: the early peak is the maximum logged score at updates <= early_until.
    late_window: the late mean covers each run's last `late_window` updates [T - late_window, T].
    scale: the factor applied to the paper's windows (1.0: the paper's; None: both windows given
    explicitly); note: says how they were chosen, for the report.
    """

    early_until: float
    late_window: float
    scale: float | None
    note: str


def summary_windows(runs: Sequence[Run], early_until: float | None = None,
                    late_window: float | None = None) -> SummaryWindows:
    """The paper's windows (first 256 / last 128 policy updates of 1,024), scaled for short runs.

    When the shortest run has T < 1,024 updates, the windows keep the paper's proportions: the early
    window ends at 256 T / 1,024 (but at least at every run's first logged update, so each run has an
    early point) and the late window is 128 T / 1,024 updates. Explicit `early_until` / `late_window`
    are used as given.
    """
    if not runs:
        raise ReportError("no runs to summarize")
    for name, value in (("early_until", early_until), ("late_window", late_window)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ReportError(f"{name} must be a positive number of policy updates; got {value!r}")
    shortest = min(run.policy_updates for run in runs)
    scale = min(1.0, shortest / PAPER_POLICY_UPDATES)
    first_points = max(run.rl_records[0]["policy_updates"] for run in runs)
    paper = f"the paper's {PAPER_EARLY_UNTIL} and {PAPER_LATE_WINDOW} of {PAPER_POLICY_UPDATES:,} updates"
    reasons = []
    defaults = early_until is None or late_window is None
    if early_until is None:
        early_until = PAPER_EARLY_UNTIL * scale
        if early_until < first_points:
            early_until = float(first_points)
            reasons.append(f"early window widened to {first_points:g}, the latest first logged update "
                           "among the runs")
    else:
        reasons.append("early window as given")
    if late_window is None:
        late_window = PAPER_LATE_WINDOW * scale
    else:
        reasons.append("late window as given")
    if defaults and scale < 1.0:
        reasons.insert(0, f"{paper} scaled to the shortest run ({shortest} policy updates, "
                          f"{100 * scale:.3g}% of the paper's)")
    elif defaults:
        reasons.insert(0, paper + (" (§4.1)" if shortest == PAPER_POLICY_UPDATES
                                   else f"; the shortest run has {shortest:,}"))
    note = (f"Windows: early peak through update {early_until:g}, late mean over each run's last "
            f"{late_window:g} updates ({'; '.join(reasons)}).")
    return SummaryWindows(early_until=float(early_until), late_window=float(late_window),
                          scale=scale if defaults else None, note=note)


def training_summary(runs: Sequence[Run], windows: SummaryWindows | None = None,
                     key: str = SCORE_KEY) -> list[dict]:
    """One row per run: early peak (`early_peak` through windows.early_until), late mean and within-run
    temporal std (`late_mean` over [T - late_window, T], T the run's last logged update) and the final
    value, of metrics `key` (default the training score (score+1)/2).

    A late window that starts before the run's first logged update is clipped to it (the row's
    late_start says so); with a single logged point the late mean is None. Row keys: label, reuse,
    early_until, early_peak, late_start, late_end, late_mean, late_std, final, final_step, points.
    """
    windows = windows or summary_windows(runs)
    rows = []
    for run in runs:
        steps, values = run.curve(key)
        end = float(steps[-1])
        start = max(end - windows.late_window, float(steps[0]))
        mean = std = None
        if start < end:
            mean, std = late_mean(steps, values, start, end)
        peak = early_peak(steps, values, windows.early_until) if steps[0] <= windows.early_until else None
        rows.append({
            "label": run.label, "reuse": run.reuse, "early_until": windows.early_until, "early_peak": peak,
            "late_start": start, "late_end": end, "late_mean": mean, "late_std": std,
            "final": float(values[-1]), "final_step": end, "points": int(steps.size),
        })
    return rows


def _number(value, digits: int = 3, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return f"{scale * value:.{digits}f}"


def _steps(value: float) -> str:
    return f"{value:g}"


def training_summary_markdown(rows: Sequence[dict], windows: SummaryWindows, key: str = SCORE_KEY) -> str:
    """The summary rows as a markdown table in Tab. 8's format (values as fractions, 3 decimals)."""
    what = "training score (score+1)/2" if key == SCORE_KEY else key
    lines = [
        f"| Run | N | Early peak (≤ {_steps(windows.early_until)}) | Late mean ± temporal std | Late window "
        "| Final (update) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        late = DASH if row["late_mean"] is None else f"{row['late_mean']:.3f} ± {row['late_std']:.3f}"
        lines.append(f"| {row['label']} | {row['reuse']} | {_number(row['early_peak'])} | {late} "
                     f"| [{_steps(row['late_start'])}, {_steps(row['late_end'])}] "
                     f"| {row['final']:.3f} ({_steps(row['final_step'])}) |")
    lines += ["", f"Quantity: {what}. Early peak: the maximum logged value through the given policy update. "
              "Late mean: the policy-step-weighted trapezoidal mean over the window, ± the within-run "
              f"temporal standard deviation (§4.1, App. E.4). {windows.note}"]
    clipped = [row["label"] for row in rows
               if row["late_end"] - row["late_start"] < windows.late_window - 1e-9]
    if clipped:
        lines.append(f"The late window of {', '.join(clipped)} is clipped at its first logged update.")
    return "\n".join(lines) + "\n"



# ---------------------------------------------------------------------------------------------------
# Metrics side by side


# Counters and wall-clock bookkeeping of an RL record (*_seconds too): not what an objective changes.
_NOT_COMPARED = frozenset({"iteration", "policy_updates", "phase", "compiles"})


def _compared_by_default(key: str, value) -> bool:
    return (key not in _NOT_COMPARED and not key.endswith("_seconds") and isinstance(value, (int, float))
            and not isinstance(value, bool))


def metrics_comparison(runs: Sequence[Run], keys: Sequence[str] | None = None) -> dict:
    """Every run's mean over its RL records of each metrics key, for comparing objectives side by side.

    keys: the metrics keys to compare (default: every numeric key some run logs, in the order the first
    run that logs a key logs it, except counters and wall-clock times (iteration, policy_updates,
    compiles, *_seconds), which depend on the machine and the compile cache rather than the objective). Returns {"labels": [run labels], "keys": [...],
    "means": {key: [mean per run, or None where the run never logs the key]}, "records": [RL records
    per run]}. A key a run logs at some iterations only is averaged over those; non-finite values are
    refused (ReportError naming the run and key), not averaged away.
    """
    if not runs:
        raise ReportError("no runs to compare")
    if keys is None:
        keys = []
        for run in runs:
            for record in run.rl_records:
                for key, value in record.items():
                    if key not in keys and _compared_by_default(key, value):
                        keys.append(key)
    else:
        keys = list(keys)
        unknown = [key for key in keys if not any(key in record for run in runs for record in run.rl_records)]
        if unknown:
            raise ReportError(f"no run logs {unknown} in its RL records")
    means: dict[str, list] = {}
    for key in keys:
        means[key] = []
        for run in runs:
            values = [record[key] for record in run.rl_records if key in record]
            if not values:
                means[key].append(None)
                continue
            if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                   for v in values):
                raise ReportError(f"{run.path}: metrics key {key!r} holds a non-finite or non-numeric value")
            means[key].append(float(np.mean(values)))
    return {"labels": [run.label for run in runs], "keys": keys, "means": means,
            "records": [len(run.rl_records) for run in runs]}


def metrics_comparison_markdown(comparison: dict, digits: int = 4) -> str:
    """`metrics_comparison` as a markdown table: one row per metrics key, one column per run."""
    labels = comparison["labels"]
    lines = ["| Metric | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for key in comparison["keys"]:
        lines.append(f"| {key} | " + " | ".join(_number(v, digits) for v in comparison["means"][key]) + " |")
    counts = ", ".join(f"{label}: {n}" for label, n in zip(labels, comparison["records"]))
    lines += ["", f"Means over each run's RL iterations ({counts}). {DASH}: the run does not log the key."]
    return "\n".join(lines) + "\n"



# ---------------------------------------------------------------------------------------------------
# Accuracy across response lengths (App. E.2)


@dataclasses.dataclass(frozen=True)
class LengthBinGroup:
    """The runs of one N with evaluations, binned with shared edges (App. E.2: one set of edges per N,
    from the pooled lengths of every method and benchmark).

    edges: int64 [num_bins] inclusive upper bounds (Q10 = the cap); bins: label -> `LengthBins`.
    """

    reuse: int
    cap: int
    edges: np.ndarray
    bins: dict[str, LengthBins]


def length_bin_groups(runs: Sequence[Run], num_bins: int = 10) -> list[LengthBinGroup]:
    """`shared_length_bins` of the evaluated runs, one group per N (in order of first appearance).

    Each run contributes its summarized completions pooled over benchmarks (length, Math-Verify score).
    The runs of a group must share the generation cap (else ReportError naming them). A group whose
    responses are all at the cap has no quantile bins and raises ReportError.
    """
    groups: dict[int, list[Run]] = {}
    for run in runs:
        if run.evaluation is not None:
            groups.setdefault(run.reuse, []).append(run)
    out = []
    for reuse, members in groups.items():
        caps = {run.label: run.evaluation.cap for run in members}
        if len(set(caps.values())) > 1:
            raise ReportError(f"N={reuse}: the evaluations have different generation caps {caps}; shared "
                              "length bins need one cap (evaluate with the same eval.max_new_tokens)")
        cap = next(iter(caps.values()))
        methods = {
            run.label: (np.array([r["length"] for r in run.evaluation.completions], np.int64),
                        np.array([r["score"] for r in run.evaluation.completions], np.float64))
            for run in members
        }
        pooled = np.concatenate([lengths for lengths, _ in methods.values()])
        if np.all(pooled >= cap):
            raise ReportError(f"N={reuse}: every evaluated response of {list(methods)} is at the cap ({cap} "
                              "tokens), so the quantile bins Q1-Q9 are undefined")
        edges, bins = shared_length_bins(methods, cap, num_bins)
        out.append(LengthBinGroup(reuse=reuse, cap=cap, edges=edges, bins=bins))
    return out


def length_bins_markdown(groups: Sequence[LengthBinGroup]) -> str:
    """Tab. 4's layout (upper bounds and counts per method) plus the accuracy (%) in each bin."""
    lines = []
    for group in groups:
        k = group.edges.size
        header = "| Entry | " + " | ".join(f"Q{i + 1}" for i in range(k)) + " |"
        lines += [f"**N = {group.reuse}** (cap {group.cap:,} tokens)", "", header, "|---" * (k + 1) + "|",
                  "| Upper bound | " + " | ".join(f"{int(b):,}" for b in group.edges) + " |"]
        for label, bins in group.bins.items():
            lines.append(f"| {label} count | " + " | ".join(f"{int(c):,}" for c in bins.counts) + " |")
        for label, bins in group.bins.items():
            lines.append(f"| {label} accuracy (%) | "
                         + " | ".join(_number(a, 1, 100.0) for a in bins.accuracy) + " |")
        lines.append("")
    quantiles = groups[0].edges.size - 1 if groups else 9
    lines.append(f"Shared bins per N over every evaluated run's completions, pooled over benchmarks "
                 f"(App. E.2): Q1-Q{quantiles} equal-frequency over the uncapped lengths, the last bin "
                 f"exactly the responses at the cap; {DASH}: an empty bin.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Tab. 1


def evaluation_table(runs: Sequence[Run]) -> dict:
    """Tab. 1 from the evaluated runs' summaries: pass@1 per benchmark and the macro average with its
    cluster-bootstrap SE (App. D.3), as `experiments.evaluate` computed them.

    Returns {"benchmarks": [names, the paper's order first], "rows": [{"label", "reuse", "step",
    "pass_at_1": {benchmark: value}, "average", "se", "benchmarks", "bootstrap"}]} (fractions, not %),
    rows sorted by N (stable in the given run order).
    """
    evaluated = sorted((run for run in runs if run.evaluation is not None), key=lambda run: run.reuse)
    names: list[str] = []
    for run in evaluated:
        for name in run.evaluation.benchmarks:
            if name not in names:
                names.append(name)
    names = [n for n in PAPER_BENCHMARKS if n in names] + [n for n in names if n not in PAPER_BENCHMARKS]
    rows = []
    for run in evaluated:
        summary = run.evaluation.summary
        rows.append({
            "label": run.label, "reuse": run.reuse, "step": run.evaluation.step,
            "pass_at_1": {name: row["pass_at_1"] for name, row in summary["benchmarks"].items()},
            "average": summary["macro_average"]["pass_at_1"], "se": summary["macro_average"]["se"],
            "benchmarks": list(summary["benchmarks"]), "bootstrap": summary.get("bootstrap"),
        })
    return {"benchmarks": names, "rows": rows}


def evaluation_markdown(table: dict) -> str:
    """Tab. 1's layout: pass@1 (%) per benchmark, Avg. = macro average ± cluster-bootstrap SE (pp)."""
    names, rows = table["benchmarks"], table["rows"]
    lines = ["| N | Run | Step | " + " | ".join(DISPLAY_NAMES.get(n, n) for n in names) + " | Avg. |",
             "|---" * (len(names) + 4) + "|"]
    for row in rows:
        cells = [_number(row["pass_at_1"].get(name), 1, 100.0) for name in names]
        step = DASH if row["step"] is None else str(row["step"])
        lines.append(f"| {row['reuse']} | {row['label']} | {step} | " + " | ".join(cells)
                     + f" | {100 * row['average']:.1f} ± {100 * row['se']:.1f} |")
    lines += ["", "pass@1 (%): mean over problems of the mean Math-Verify score over samples; Avg.: macro "
              "average over the run's benchmarks ± its cluster-bootstrap standard error over problems "
              "(App. D.3), as python -m experiments.evaluate computed them. Step: the evaluated "
              "checkpoint's iteration."]
    sets = {tuple(row["benchmarks"]) for row in rows}
    if len(sets) > 1:
        lines.append("The runs were evaluated on different benchmark sets: their averages are not "
                     "comparable.")
    boots = {json.dumps(row["bootstrap"], sort_keys=True) for row in rows}
    if len(boots) > 1:
        lines.append("The runs' bootstrap settings differ: "
                     + "; ".join(f"{row['label']}: {row['bootstrap']}" for row in rows) + ".")
    return "\n".join(lines) + "\n"



# ---------------------------------------------------------------------------------------------------
# App. E.3 (Tabs. 5-7)


def e3_window(runs: Sequence[Run], batches: int = PAPER_E3_BATCHES) -> dict:
    """The diagnostic window in rollout batches: the first `batches` (paper: 16), cut to the shortest run
    with rollout files. Returns {"batches": W, "allocation": (first, last) of Tab. 5 = the second half
    (paper: 9-16), "length": (1, W) of Tab. 7, "trajectory": [1, W // 2, W] of Tab. 6 (paper: 1, 8, 16)}."""
    with_files = [run for run in runs if run.rollouts]
    if not with_files:
        raise ReportError("none of the runs has rollout files (rollouts/iteration_*.npz)")
    if not isinstance(batches, int) or batches < 1:
        raise ReportError(f"batches must be a positive int; got {batches!r}")
    window = min(batches, *(int(run.rollouts[-1]["iteration"]) for run in with_files))
    return {"batches": window, "allocation": (window // 2 + 1, window), "length": (1, window),
            "trajectory": sorted({1, max(1, window // 2), window})}


def positive_branch_tables(runs: Sequence[Run], batches: int = PAPER_E3_BATCHES) -> dict:
    """Tabs. 5-7 (App. E.3) for every run with rollout files, over `e3_window(runs, batches)`.

    Returns {"window": ..., "labels": [...], "allocation": {label: `allocation_table` or None},
    "trajectory": {label: {iteration: row of `weight_length_trajectory`}}, "length": {label:
    `length_by_bin` or None}, "missing": {label: [iterations of the window without a rollout file]}}.
    None: no positive response in the window.
    """
    window = e3_window(runs, batches)
    with_files = [run for run in runs if run.rollouts]
    out = {"window": window, "labels": [run.label for run in with_files], "allocation": {}, "trajectory": {},
           "length": {}, "missing": {}}
    for run in with_files:
        present = {int(r["iteration"]) for r in run.rollouts}
        out["missing"][run.label] = [i for i in range(1, window["batches"] + 1) if i not in present]
        inside = [r for r in run.rollouts if int(r["iteration"]) <= window["batches"]]
        first, last = window["allocation"]
        try:
            out["allocation"][run.label] = positive_branch.allocation_table(inside, first, last)
        except ValueError:  # no positive response (or no file) in the window
            out["allocation"][run.label] = None
        trajectory = {row["iteration"]: row for row in positive_branch.weight_length_trajectory(inside)}
        out["trajectory"][run.label] = {i: trajectory.get(i) for i in window["trajectory"]}
        try:
            out["length"][run.label] = positive_branch.length_by_bin(inside, *window["length"])
        except ValueError:
            out["length"][run.label] = None
    return out


def positive_branch_markdown(tables: dict) -> str:
    """Tabs. 5, 6 and 7 as markdown, one column (group) per run."""
    window, labels = tables["window"], tables["labels"]
    first, last = window["allocation"]
    lines = [f"**Tab. 5** — positive-branch allocation, means over rollout batches {first}–{last}", "",
             "| Statistic | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for region in (positive_branch.LOW_W[0], positive_branch.DEEP_TAIL[0]):
        for key, what, fmt in (("response_share", "Positive responses with", "pct"),
                               ("mass_share", "Coefficient mass on", "pct"),
                               ("amplification", "Amplification on", "x")):
            cells = []
            for label in labels:
                table = tables["allocation"][label]
                value = None if table is None else table[region][key]
                if key == "amplification" and table is not None and table[region]["response_share"] == 0:
                    value = None  # no positive response in the region: the ratio is undefined
                if value is None:
                    cells.append(DASH)
                else:
                    cells.append(f"{100 * value:.1f}%" if fmt == "pct" else f"{value:.2f}×")
            lines.append(f"| {what} {region} | " + " | ".join(cells) + " |")
    lines += ["", "**Tab. 6** — mean log W and response length of the positive responses", "",
              "| Batch | " + " | ".join(f"log W: {label}" for label in labels) + " | "
              + " | ".join(f"length: {label}" for label in labels) + " |",
              "|---" * (2 * len(labels) + 1) + "|"]
    for iteration in window["trajectory"]:
        rows = [tables["trajectory"][label][iteration] for label in labels]
        log_w = [DASH if row is None else _signed(row["positive_log_w_mean"]) for row in rows]
        length = [DASH if row is None else _number(row["positive_length_mean"], 1) for row in rows]
        lines.append(f"| {iteration} | " + " | ".join(log_w) + " | " + " | ".join(length) + " |")
    a, b = window["length"]
    lines += ["", f"**Tab. 7** — count-weighted positive-response length by log W bin, rollout batches "
              f"{a}–{b} (relative to the run's positive-branch mean)", "",
              "| log W bin | W range | " + " | ".join(f"{label} length | {label} n" for label in labels)
              + " |",
              "|---" * (2 * len(labels) + 2) + "|"]
    for j, name in enumerate(positive_branch.bin_labels()):
        lower, upper = positive_branch.LOG_W_BIN_EDGES[j], positive_branch.LOG_W_BIN_EDGES[j + 1]
        cells = []
        for label in labels:
            table = tables["length"][label]
            row = None if table is None else table["bins"][j]
            if row is None or row["length_mean"] is None:
                cells += [DASH, "0" if row is not None else DASH]
            else:
                cells += [f"{row['length_mean']:.1f} ({row['relative']:.2f}×)", str(row["count"])]
        lines.append(f"| {name} | {_w_range(lower, upper)} | " + " | ".join(cells) + " |")
    cells = []
    for label in labels:
        table = tables["length"][label]
        if table is None:
            cells += [DASH, DASH]
        else:
            cells += [f"{table['branch_mean']:.1f}", str(table["branch_count"])]
    lines.append("| Positive-branch mean | – | " + " | ".join(cells) + " |")
    lines += ["", f"Diagnostic window: the first {window['batches']} rollout batch(es) (paper: 16; Tab. 5 "
              "over batches 9–16, Tab. 6 at 1, 8, 16, Tab. 7 over 1–16). Shares are pooled over each batch's "
              f"positive responses (Â > 0); coefficient mass is |Â|·φ. {DASH}: no positive response."]
    for label, missing in tables["missing"].items():
        if missing:
            lines.append(f"{label}: no rollout file for batch(es) {missing} of the window.")
    return "\n".join(lines) + "\n"


def _signed(value: float) -> str:
    return DASH if value is None or math.isnan(value) else f"{value:+.3f}"


def _w_range(lower: float, upper: float) -> str:
    def fmt(x: float) -> str:
        w = math.exp(x)
        if math.isinf(w):
            return "∞"
        return f"{w:.2g}" if (w < 0.01 or w >= 1000) and w != 0 else f"{w:.3g}"

    return f"({fmt(lower)}, {fmt(upper)}{')' if math.isinf(upper) else ']'}"


