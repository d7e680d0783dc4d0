"""Evaluation with the paper's protocol and statistics (§4.1, App. D.2, D.3, E.2).

  statistics   pure functions: cluster-bootstrap SE, shared length bins, early peak / late mean
  config       the typed `eval.*` settings of `python -m experiments.evaluate` (the paper's protocol)
  completions  the `completions.jsonl` records `experiments.evaluate` writes, read back and summarized
"""

from respo_jax.eval.statistics import (
    LengthBins,
    cluster_bootstrap,
    early_peak,
    late_mean,
    length_bin_accuracy,
    length_bin_edges,
    shared_length_bins,
)

__all__ = [
    "LengthBins",
    "cluster_bootstrap",
    "early_peak",
    "late_mean",
    "length_bin_accuracy",
    "length_bin_edges",
    "shared_length_bins",
]
