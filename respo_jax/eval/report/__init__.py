"""Run reports: the paper's figures and tables for a set of training runs (§4.1-4.3, App. E.1-E.3).

A report compares runs (objectives, N, seeds) from what their directories hold, with the statistics of
`respo_jax.eval`; nothing is recomputed from a model. The builders return plain data, markdown and
matplotlib `Figure`s (no pyplot state), so notebooks display them and `experiments.report` writes them.
One module per concept, every name importable from here:

  loading   load_run / load_runs       a run directory: config.json, metrics.jsonl, rollouts/, eval/,
                                       checked against each other
  tables    training_summary           early peak and late mean ± temporal std of the training score (§4.1,
                                       Tab. 8)
            metrics_comparison         every logged metric's mean per run, side by side (comparing objectives)
            length_bin_groups          accuracy in shared response-length bins per N (App. E.2, Tab. 4)
            evaluation_table           Tab. 1: pass@1 per benchmark and the macro average ± bootstrap SE
            positive_branch_tables     App. E.3's Tabs. 5-7 from the rollout files
  figures   curves_figure              score, response length, approx. KL, entropy vs policy updates (Figs. 3, 5)
            length_bins_figure         accuracy per shared length bin (Fig. 3 right)
  writer    build_report / write_report  all of the above as one markdown document with its PNGs (and JSON)

Each table has a `*_markdown` renderer. Bad or mismatched inputs raise `ReportError` naming the file.
"""

from respo_jax.eval.report.figures import CURVE_PANELS, curves_figure, length_bins_figure, missing_curves
from respo_jax.eval.report.loading import (
    OBJECTIVE_NAMES,
    PAPER_E3_BATCHES,
    PAPER_EARLY_UNTIL,
    PAPER_LATE_WINDOW,
    PAPER_POLICY_UPDATES,
    SCORE_KEY,
    Evaluation,
    ReportError,
    Run,
    load_evaluation,
    load_run,
    load_runs,
    run_label,
)
from respo_jax.eval.report.tables import (
    DASH,
    LengthBinGroup,
    SummaryWindows,
    e3_window,
    evaluation_markdown,
    evaluation_table,
    length_bin_groups,
    length_bins_markdown,
    metrics_comparison,
    metrics_comparison_markdown,
    positive_branch_markdown,
    positive_branch_tables,
    summary_windows,
    training_summary,
    training_summary_markdown,
)
from respo_jax.eval.report.writer import (
    CURVES_FIGURE,
    LENGTH_BINS_FIGURE,
    REPORT_FIGURES,
    Report,
    build_report,
    write_report,
)
from respo_jax.runs import CONFIG_FILE, EVAL_DIR, METRICS_FILE

__all__ = [
    "CONFIG_FILE", "CURVES_FIGURE", "CURVE_PANELS", "DASH", "EVAL_DIR", "LENGTH_BINS_FIGURE", "METRICS_FILE",
    "OBJECTIVE_NAMES", "PAPER_E3_BATCHES", "PAPER_EARLY_UNTIL", "PAPER_LATE_WINDOW", "PAPER_POLICY_UPDATES",
    "REPORT_FIGURES", "SCORE_KEY", "Evaluation", "LengthBinGroup", "Report", "ReportError", "Run",
    "SummaryWindows", "build_report", "curves_figure", "e3_window", "evaluation_markdown", "evaluation_table",
    "length_bin_groups", "length_bins_figure", "length_bins_markdown", "load_evaluation", "load_run",
    "load_runs", "metrics_comparison", "metrics_comparison_markdown", "missing_curves",
    "positive_branch_markdown", "positive_branch_tables", "run_label", "summary_windows", "training_summary",
    "training_summary_markdown", "write_report",
]
