"""Evaluation and diagnostics with the paper's protocol and statistics (§4.1, App. D.2, D.3, E.2, E.3).

  statistics       pure functions: cluster-bootstrap SE, shared length bins, early peak / late mean
  config           the typed `eval.*` settings of `python -m experiments.evaluate` (the paper's protocol)
  completions      the `completions.jsonl` records `experiments.evaluate` writes, read back and summarized
  rollout_files    the per-iteration rollout files the trainer writes (App. E.3 inputs)
  positive_branch  App. E.3's positive-branch weight and length tables (Tabs. 5-7) from those files
  report           run reports: load run directories, the paper's curves and tables as figures and markdown
                   (imported as `respo_jax.eval.report`; it needs matplotlib, so it is not re-exported here)
"""

from respo_jax.eval.positive_branch import (
    LOG_W_BIN_EDGES,
    allocation_table,
    bin_allocation,
    bin_labels,
    length_by_bin,
    pooled_diagnostics,
    weight_length_trajectory,
)
from respo_jax.eval.rollout_files import load_rollout_files, read_rollout_file, write_rollout_file
from respo_jax.eval.statistics import (
    LengthBins,
    cluster_bootstrap,
    early_peak,
    late_mean,
    length_bin_accuracy,
    length_bin_edges,
    paired_cluster_bootstrap,
    shared_length_bins,
)

__all__ = [
    "LOG_W_BIN_EDGES",
    "LengthBins",
    "allocation_table",
    "bin_allocation",
    "bin_labels",
    "cluster_bootstrap",
    "early_peak",
    "late_mean",
    "length_bin_accuracy",
    "length_bin_edges",
    "length_by_bin",
    "load_rollout_files",
    "paired_cluster_bootstrap",
    "pooled_diagnostics",
    "read_rollout_file",
    "shared_length_bins",
    "weight_length_trajectory",
    "write_rollout_file",
]
