"""The paper's reporting statistics as pure functions of scores, lengths and logged curves.

  cluster_bootstrap      macro-average pass@1 and its cluster-bootstrap standard error (App. D.3, Tab. 1)
  paired_cluster_bootstrap  two methods' pass@1 difference on shared problems and seeds, with a paired
                         bootstrap over problems x seeds (App. D.3's resampling, both methods drawn alike)
  length_bin_edges       10 shared response-length bins: Q1-Q9 equal-frequency, Q10 the capped ones (App. E.2)
  length_bin_accuracy    per-bin counts and accuracy of one method under shared edges (Tab. 4, Fig. 4)
  shared_length_bins     edges pooled over several methods, then each method's bins
  early_peak             the maximum logged score through a policy step (§4.1: first 256 updates)
  late_mean              policy-step-weighted trapezoidal mean over a window and the within-run temporal
                         standard deviation (§4.1: last 128 updates; App. E.4, Tab. 8)

Everything is computed in float64 NumPy; bad input (empty benchmarks, ragged or mismatched shapes,
NaN, lengths past the cap, windows outside the logged steps) raises ValueError naming the problem.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np

# Indices drawn per block in `cluster_bootstrap` (bounds memory at ~32 MB of int64 per block).
_BOOTSTRAP_BLOCK_ELEMENTS = 4_000_000


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------
# Evaluation uncertainty (App. D.3)


def _problem_means(name: str, problems) -> np.ndarray:
    """z_ji = mean of the sample scores of problem i of benchmark `name`: float64 [m_j]."""
    if isinstance(problems, np.ndarray):
        if problems.ndim != 2:
            raise ValueError(
                f"scores[{name!r}] as an array must be 2-D [problems, samples]; got shape {problems.shape}"
            )
        problems = list(problems)
    elif isinstance(problems, (str, bytes)) or not isinstance(problems, Sequence):
        raise ValueError(
            f"scores[{name!r}] must be a list of per-problem lists of sample scores; "
            f"got {type(problems).__name__}"
        )
    if len(problems) == 0:
        raise ValueError(f"scores[{name!r}] has no problems; every benchmark needs at least one")
    means = np.empty(len(problems), np.float64)
    for index, samples in enumerate(problems):
        try:
            values = np.asarray(samples, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"scores[{name!r}][{index}] must be a flat list of numbers (sample scores); got {samples!r}"
            ) from None
        if values.ndim != 1:
            raise ValueError(
                f"scores[{name!r}][{index}] must be a flat list of sample scores; got shape {values.shape}"
            )
        if values.size == 0:
            raise ValueError(f"scores[{name!r}][{index}] has no samples; every problem needs at least one")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"scores[{name!r}][{index}] holds a non-finite score: {values.tolist()}")
        means[index] = values.mean()
    return means


def cluster_bootstrap(
    scores: Mapping[str, Sequence[Sequence[float]]], num_resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Macro-average pass@1 over benchmarks and its cluster-bootstrap standard error (App. D.3).

    scores: benchmark -> per-problem lists of sample scores (0/1 for Math-Verify; any finite reals),
      i.e. y_jik for benchmark j, problem i, sample k. Problems may have different sample counts
      (n_ji in D.3); a benchmark may also be given as a 2-D array [problems, samples].
    Point estimate: z_ji = mean_k y_jik, a_j = mean_i z_ji, A = mean_j a_j (benchmarks weigh equally,
      whatever their number of problems).
    Bootstrap: in each of `num_resamples` replicates, the m_j problems of every benchmark are drawn
      with replacement (independently per benchmark; samples stay with their problem, so
      within-problem correlation is kept), giving A^(b). The standard error is the standard deviation
      of the A^(b) with Bessel's correction (ddof=1), the usual bootstrap SE. For independent
      problems it converges to the plug-in analytic value sqrt(sum_j var(z_j) / m_j) / J with var
      the population variance of the z_ji.

    Replicates are drawn with `np.random.default_rng(seed)`, benchmarks in sorted-name order, so the
    result does not depend on the mapping's order. Returns (A, se) as Python floats.
    """
    if not isinstance(scores, Mapping):
        raise ValueError(
            f"scores must map benchmark names to per-problem score lists; got {type(scores).__name__}"
        )
    if len(scores) == 0:
        raise ValueError("scores is empty: expected at least one benchmark")
    if not _is_int(num_resamples) or num_resamples < 2:
        raise ValueError(f"num_resamples must be an int >= 2; got {num_resamples!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    names = sorted(scores)
    means = {name: _problem_means(name, scores[name]) for name in names}
    macro = float(np.mean([z.mean() for z in means.values()]))

    rng = np.random.default_rng(int(seed))
    replicates = np.zeros(int(num_resamples), np.float64)
    for name in names:
        z = means[name]
        block = max(1, _BOOTSTRAP_BLOCK_ELEMENTS // z.size)
        for start in range(0, num_resamples, block):
            count = min(block, num_resamples - start)
            draws = rng.integers(0, z.size, size=(count, z.size))
            replicates[start : start + count] += z[draws].mean(axis=1)
    replicates /= len(names)
    return macro, float(replicates.std(ddof=1))


class PairedDifference(NamedTuple):
    """A paired difference of two methods' pass@1 and its bootstrap spread (`paired_cluster_bootstrap`)."""

    difference: float
    se: float
    low: float
    high: float


def paired_cluster_bootstrap(
    a, b, num_resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> PairedDifference:
    """The difference of two methods' pass@1 on the same problems and seeds, with a cluster bootstrap over
    problems x seeds (App. D.3, paired).

    a, b: [seeds, problems] or [seeds, problems, samples] sample scores (0/1 correct, or any finite
      reals) of methods A and B; seed s of A and of B share their problems (and evaluation draws).
    Point estimate: z = mean over samples, d = z_a - z_b [seeds, problems], D = mean(d).
    Bootstrap: each of `num_resamples` replicates draws the seeds (S, with replacement) and, independently,
      the problems (I, with replacement), the same draws for both methods (so problem and seed effects
      shared by A and B cancel), and takes D^(b) = mean(d[S][:, I]). With one seed only the problems vary.
    Returns D, the standard deviation of the D^(b) (ddof=1) and the equal-tailed `level` percentile
    interval of the D^(b). Draws come from `np.random.default_rng(seed)`: all seed indices first
    [num_resamples, seeds], then all problem indices [num_resamples, problems]; float64 throughout.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim not in (2, 3) or 0 in a.shape:
        raise ValueError(f"a and b must have one shape, [seeds, problems] or [seeds, problems, samples], "
                         f"none empty; got {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("a and b must hold finite scores")
    if not _is_int(num_resamples) or num_resamples < 2:
        raise ValueError(f"num_resamples must be an int >= 2; got {num_resamples!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1); got {level!r}")
    d = (a.mean(axis=2) - b.mean(axis=2)) if a.ndim == 3 else a - b
    seeds, problems = d.shape
    rng = np.random.default_rng(int(seed))
    seed_draws = rng.integers(0, seeds, size=(num_resamples, seeds))
    problem_draws = rng.integers(0, problems, size=(num_resamples, problems))
    replicates = np.empty(num_resamples, np.float64)
    for r in range(num_resamples):  # counts per seed and per problem: D^(b) = c_S d c_I / (|S| |I|)
        seed_counts = np.bincount(seed_draws[r], minlength=seeds)
        problem_counts = np.bincount(problem_draws[r], minlength=problems)
        replicates[r] = seed_counts @ d @ problem_counts / (seeds * problems)
    low, high = np.quantile(replicates, [(1 - level) / 2, (1 + level) / 2])
    return PairedDifference(float(d.mean()), float(replicates.std(ddof=1)), float(low), float(high))


# ---------------------------------------------------------------------------------------------------
# Accuracy across response lengths (App. E.2)


def _integer_lengths(lengths, what: str = "lengths") -> np.ndarray:
    values = np.asarray(lengths)
    if values.ndim != 1:
        raise ValueError(f"{what} must be 1-D [responses]; got shape {values.shape}")
    if values.size == 0:
        raise ValueError(f"{what} is empty: expected at least one response length")
    numeric = np.issubdtype(values.dtype, np.integer) or np.issubdtype(values.dtype, np.floating)
    if values.dtype == bool or not numeric:
        raise ValueError(f"{what} must hold integer token counts; got dtype {values.dtype}")
    if np.issubdtype(values.dtype, np.floating):
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{what} holds NaN or inf")
        if not np.all(values == np.round(values)):
            raise ValueError(f"{what} must be whole token counts; got non-integer values")
    values = values.astype(np.int64)
    if values.min() < 0:
        raise ValueError(f"{what} must be >= 0; got minimum {values.min()}")
    return values


def length_bin_edges(lengths, cap: int, num_bins: int = 10) -> np.ndarray:
    """Upper bounds (inclusive, in tokens) of the paper's shared response-length bins (App. E.2, Tab. 4).

    lengths: [responses] response lengths in tokens, pooled over every method and benchmark that will
      share the bins; each in [0, cap].
    cap: the generation cap (max new tokens). A response of exactly `cap` tokens is capped.
    Returns int64 [num_bins]: the last bin (Q10) holds exactly the capped responses (bound `cap`); the
      one before it ends at `cap - 1`, so bins 1..num_bins-1 cover every uncapped response; bins
      1..num_bins-2 end at the equal-frequency quantiles of the uncapped lengths.

    Quantile rule ("inverted CDF", tie-preserving): with the n uncapped lengths sorted as u, bin k ends
    at u[ceil(k n / (num_bins - 1)) - 1], an observed length; a response goes to the first bin whose
    bound it does not exceed (`length_bin_accuracy`). Identical lengths therefore always share a bin,
    and through bin k at least k n / (num_bins - 1) uncapped responses are counted (more when ties
    straddle the quantile). Tab. 4's pooled counts satisfy exactly this (e.g. N=8: cumulative counts
    2889, 5779, ... against 2885.8, 5771.6, ...). Heavy ties can repeat a bound; the later copy is
    then an empty bin.
    """
    values = _integer_lengths(lengths)
    if not _is_int(cap) or cap < 2:
        raise ValueError(f"cap must be an int >= 2; got {cap!r}")
    if not _is_int(num_bins) or num_bins < 3:
        raise ValueError(f"num_bins must be an int >= 3 (>= 2 uncapped bins + the cap bin); got {num_bins!r}")
    if values.max() > cap:
        raise ValueError(f"lengths must be <= cap={cap}; got maximum {values.max()}")
    uncapped = np.sort(values[values < cap])
    if uncapped.size == 0:
        raise ValueError(f"every response is at the cap ({cap}); the uncapped quantile bins are undefined")
    quantile_bins = num_bins - 1
    n = uncapped.size
    positions = [-(-k * n // quantile_bins) - 1 for k in range(1, quantile_bins)]  # ceil(k n / q) - 1
    return np.array([*uncapped[positions], cap - 1, cap], np.int64)


class LengthBins(NamedTuple):
    """Per-bin statistics of one method (all [num_bins]).

    counts: responses in the bin; correct: their summed scores; accuracy: correct / counts (NaN for an
    empty bin: there is nothing to measure).
    """

    counts: np.ndarray
    correct: np.ndarray
    accuracy: np.ndarray


def _check_edges(edges) -> np.ndarray:
    edges = np.asarray(edges)
    if edges.ndim != 1 or edges.size == 0:
        raise ValueError(f"edges must be a non-empty 1-D array of upper bounds; got shape {edges.shape}")
    edges = _integer_lengths(edges, "edges")
    if np.any(np.diff(edges) < 0):
        raise ValueError(f"edges must be non-decreasing; got {edges.tolist()}")
    return edges


def length_bin_accuracy(lengths, correct, edges) -> LengthBins:
    """Counts and accuracy of one method's responses in the shared bins `edges` (App. E.2).

    lengths: [responses] tokens; correct: [responses] verifier scores in [0, 1] (bool or 0/1);
    edges: [num_bins] inclusive upper bounds from `length_bin_edges`. A response goes to the first
    bin whose bound is >= its length; a length past the last bound is an error, not dropped.
    """
    edges = _check_edges(edges)
    values = _integer_lengths(lengths)
    try:
        scores = np.asarray(correct, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("correct must be a flat numeric array of scores in [0, 1]") from None
    if scores.shape != values.shape:
        raise ValueError(f"correct has shape {scores.shape}; lengths has {values.shape}")
    if not np.all(np.isfinite(scores)) or scores.min() < 0 or scores.max() > 1:
        raise ValueError("correct must hold finite scores in [0, 1]")
    if values.max() > edges[-1]:
        raise ValueError(f"a length ({values.max()}) exceeds the last bin's upper bound ({edges[-1]})")
    bins = np.searchsorted(edges, values, side="left")
    counts = np.bincount(bins, minlength=edges.size).astype(np.int64)
    summed = np.bincount(bins, weights=scores, minlength=edges.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy = np.where(counts > 0, summed / np.maximum(counts, 1), np.nan)
    return LengthBins(counts=counts, correct=summed, accuracy=accuracy)


def shared_length_bins(
    methods: Mapping[str, tuple[Sequence[int], Sequence[float]]], cap: int, num_bins: int = 10
) -> tuple[np.ndarray, dict[str, LengthBins]]:
    """One set of edges from the pooled lengths of every method, then each method's bins (App. E.2).

    methods: name -> (lengths [responses], correct [responses]), e.g. each method's evaluation
    completions pooled over benchmarks for one N. Returns (edges [num_bins], {name: LengthBins}).
    """
    if not isinstance(methods, Mapping) or len(methods) == 0:
        raise ValueError("methods must be a non-empty mapping name -> (lengths, correct)")
    pooled = np.concatenate(
        [_integer_lengths(lengths, f"{name} lengths") for name, (lengths, _) in methods.items()]
    )
    edges = length_bin_edges(pooled, cap, num_bins)
    return edges, {name: length_bin_accuracy(lengths, correct, edges) for name, (lengths, correct) in
                   methods.items()}


# ---------------------------------------------------------------------------------------------------
# Training-curve summaries (§4.1, App. E.4)


def _curve(steps, values) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(steps, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if s.ndim != 1 or v.ndim != 1:
        raise ValueError(f"steps and values must be 1-D; got shapes {s.shape} and {v.shape}")
    if s.shape != v.shape:
        raise ValueError(f"steps and values must have the same length; got {s.size} and {v.size}")
    if s.size == 0:
        raise ValueError("steps and values are empty: expected at least one logged point")
    if not np.all(np.isfinite(s)):
        raise ValueError("steps hold NaN or inf")
    if not np.all(np.isfinite(v)):
        bad = int(np.flatnonzero(~np.isfinite(v))[0])
        raise ValueError(f"values hold NaN or inf (first at step {s[bad]:g})")
    if np.any(np.diff(s) <= 0):
        raise ValueError("steps must be strictly increasing (one value per logged policy step)")
    return s, v


def early_peak(steps, values, until: float = 256) -> float:
    """The maximum logged value at policy steps <= `until` (§4.1's early peak: the first 256 updates).

    steps: [points] strictly increasing policy-update counts; values: [points] the logged score.
    """
    s, v = _curve(steps, values)
    window = s <= until
    if not np.any(window):
        raise ValueError(f"no logged step is <= until={until:g}; the first is {s[0]:g}")
    return float(v[window].max())


def late_mean(steps, values, start: float, end: float) -> tuple[float, float]:
    """Policy-step-weighted trapezoidal mean over [start, end] and the within-run temporal std (§4.1).

    steps: [points] strictly increasing policy-update counts; values: [points] the logged score.
    The curve is the piecewise-linear interpolant of the logged points. When `start` or `end` falls
    between two logged steps, a knot is added there with the linearly interpolated value (so the mean
    is exactly the interpolant's average over the window); the window must lie within the logged
    steps (no extrapolation). With knots x_0 = start < ... < x_K = end, values v_i and trapezoid
    weights w_0 = (x_1 - x_0)/2, w_i = (x_{i+1} - x_{i-1})/2, w_K = (x_K - x_{K-1})/2 (sum: end - start):

        mean = sum_i w_i v_i / (end - start)
        std  = sqrt(sum_i w_i (v_i - mean)^2 / (end - start))

    i.e. the mean and (population) standard deviation of the knot values under the same trapezoid
    weights: each logged value counts for the policy steps it represents. The paper's late window is
    the last 128 updates, `late_mean(steps, values, steps[-1] - 128, steps[-1])` ([896, 1024]).
    Returns (mean, std) as Python floats.
    """
    s, v = _curve(steps, values)
    start, end = float(start), float(end)
    if not (np.isfinite(start) and np.isfinite(end)) or not start < end:
        raise ValueError(f"the window needs start < end (finite); got [{start:g}, {end:g}]")
    if start < s[0] or end > s[-1]:
        raise ValueError(
            f"window [{start:g}, {end:g}] is not within the logged steps [{s[0]:g}, {s[-1]:g}]; "
            "late_mean does not extrapolate"
        )
    inside = (s > start) & (s < end)
    knots = np.concatenate([[start], s[inside], [end]])
    knot_values = np.concatenate([[np.interp(start, s, v)], v[inside], [np.interp(end, s, v)]])
    gaps = np.diff(knots)
    weights = np.zeros_like(knots)
    weights[:-1] += gaps / 2
    weights[1:] += gaps / 2
    length = end - start
    mean = float(np.dot(weights, knot_values) / length)
    variance = float(np.dot(weights, (knot_values - mean) ** 2) / length)
    return mean, float(np.sqrt(max(variance, 0.0)))
