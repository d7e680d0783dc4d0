"""The reporting statistics (respo_jax.eval.statistics) against references on synthetic data.

References: the analytic standard error of a mean of independent clusters (plug-in and the generating
Beta-Bernoulli model's closed form), hand-computed trapezoid means and weighted standard deviations, a
dense-grid integral of the interpolated curve, and hand-built length bins with ties and capped responses.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from respo_jax.eval import (
    cluster_bootstrap,
    early_peak,
    late_mean,
    length_bin_accuracy,
    length_bin_edges,
    shared_length_bins,
)

PAPER_SIZES = {"aime25": (30, 16), "aime24": (30, 16), "amc23": (40, 16),
               "olympiadbench": (675, 4), "minerva_math": (272, 4), "math500": (500, 4)}


def _beta_bernoulli(rng, sizes, a=0.6, b=0.9):
    """Per benchmark: m problems with success probability p ~ Beta(a, b), n Bernoulli(p) samples each."""
    scores = {}
    for name, (m, n) in sizes.items():
        p = rng.beta(a, b, size=m)
        scores[name] = (rng.random((m, n)) < p[:, None]).astype(float).tolist()
    return scores


def _plug_in_se(scores) -> float:
    """sqrt(sum_j var(z_j) / m_j) / J, var the population variance of the problem means."""
    total = 0.0
    for problems in scores.values():
        z = np.array([np.mean(p) for p in problems])
        total += z.var() / z.size
    return math.sqrt(total) / len(scores)


# --------------------------------------------------------------------------------------- bootstrap


def test_macro_mean_weighs_benchmarks_equally_and_problems_within_them():
    scores = {"a": [[1, 0], [1]], "b": [[0, 0, 0, 1]]}  # a: z = (0.5, 1) -> 0.75; b: 0.25
    mean, se = cluster_bootstrap(scores, num_resamples=2000, seed=0)
    assert mean == pytest.approx(0.5, abs=1e-15)  # not the pooled 3/7 nor the problem-pooled 7/12
    assert se > 0


def test_bootstrap_se_matches_plug_in_analytic_se_at_the_papers_sizes():
    scores = _beta_bernoulli(np.random.default_rng(1), PAPER_SIZES)
    _, se = cluster_bootstrap(scores, num_resamples=20_000, seed=3)
    analytic = _plug_in_se(scores)
    # Monte Carlo error of a 20k-replicate SE is ~0.5 %; the issue asks for 10 %.
    assert se / analytic == pytest.approx(1.0, abs=0.03), (se, analytic)


def test_bootstrap_se_matches_the_generating_models_standard_error():
    """Independent clusters with p ~ Beta(a, b): Var(z) = Var(p) + E[p(1-p)] / n in closed form."""
    a, b = 0.6, 0.9
    sizes = {f"bench{j}": (400, n) for j, n in enumerate((16, 16, 4, 4, 4, 8))}
    e_p = a / (a + b)
    var_p = a * b / ((a + b) ** 2 * (a + b + 1))
    e_pq = e_p - var_p - e_p**2
    true_se = math.sqrt(sum((var_p + e_pq / n) / m for m, n in sizes.values())) / len(sizes)
    scores = _beta_bernoulli(np.random.default_rng(7), sizes, a, b)
    mean, se = cluster_bootstrap(scores, num_resamples=10_000, seed=0)
    assert se / true_se == pytest.approx(1.0, abs=0.10), (se, true_se)
    assert abs(mean - e_p) < 3 * true_se


def test_resampling_unit_is_the_problem_not_the_sample():
    """Samples perfectly correlated within a problem: the SE is that of m clusters, sqrt(n) above a
    naive per-sample SE."""
    rng = np.random.default_rng(0)
    m, n = 200, 16
    solved = rng.random(m) < 0.4
    scores = {"x": [[float(s)] * n for s in solved]}
    _, se = cluster_bootstrap(scores, num_resamples=20_000, seed=1)
    cluster_se = solved.astype(float).std() / math.sqrt(m)
    naive_se = solved.astype(float).std() / math.sqrt(m * n)
    assert se == pytest.approx(cluster_se, rel=0.03)
    assert se / naive_se == pytest.approx(math.sqrt(n), rel=0.05)


def test_bootstrap_is_seeded_order_free_and_zero_without_spread():
    scores = _beta_bernoulli(np.random.default_rng(2), {"a": (20, 4), "b": (30, 4)})
    first = cluster_bootstrap(scores, 500, seed=5)
    assert cluster_bootstrap(dict(reversed(list(scores.items()))), 500, seed=5) == first
    assert cluster_bootstrap(scores, 500, seed=6)[1] != first[1]
    assert cluster_bootstrap({"a": np.ones((5, 3)), "b": [[0.0], [0.0]]}, 100, seed=0) == (0.5, 0.0)


@pytest.mark.parametrize(
    "scores, match",
    [
        ({}, "empty"),
        ([[1.0]], "map benchmark names"),
        ({"a": []}, "no problems"),
        ({"a": [[1.0], []]}, r"scores\['a'\]\[1\] has no samples"),
        ({"a": [[1.0, float("nan")]]}, "non-finite"),
        ({"a": [[[1.0, 0.0]]]}, r"flat list of sample scores; got shape \(1, 2\)"),
        ({"a": [[1.0, [0.0, 1.0]]]}, "flat list of numbers"),
        ({"a": np.ones(3)}, "2-D"),
    ],
)
def test_bootstrap_bad_input_is_named(scores, match):
    with pytest.raises(ValueError, match=match):
        cluster_bootstrap(scores, 100, 0)


def test_bootstrap_bad_resamples_and_seed():
    with pytest.raises(ValueError, match="num_resamples"):
        cluster_bootstrap({"a": [[1.0]]}, 1, 0)
    with pytest.raises(ValueError, match="seed"):
        cluster_bootstrap({"a": [[1.0]]}, 10, -1)


# --------------------------------------------------------------------------------------- length bins


def test_length_bins_on_a_hand_built_example_with_ties_and_capped_responses():
    cap = 20
    uncapped = [3, 3, 3, 5, 6, 7, 8, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19]  # n = 18: 2 per bin
    lengths = np.array(uncapped + [cap] * 3)
    # Bound k = u[ceil(18k/9) - 1] = u[2k - 1] for k = 1..8; Q9 = cap - 1; Q10 = cap.
    edges = length_bin_edges(np.random.default_rng(0).permutation(lengths), cap)
    assert edges.tolist() == [3, 5, 7, 8, 10, 12, 14, 16, 19, 20]
    correct = np.array([1, 1, 0] + [1] + [1, 0] * 7 + [0, 0, 1], float)
    bins = length_bin_accuracy(lengths, correct, edges)
    # Three tied 3s stay together in Q1 (so Q2 gets only the 5); Q10 holds exactly the capped ones.
    assert bins.counts.tolist() == [3, 1, 2, 2, 2, 2, 2, 2, 2, 3]
    np.testing.assert_allclose(bins.accuracy, [2 / 3, 1] + [0.5] * 7 + [1 / 3])
    assert bins.correct.sum() == correct.sum()


def test_repeated_bounds_leave_empty_bins_marked_nan():
    lengths = [4] * 9 + [5, 10]  # heavy ties: u = (4 x 9, 5), bound k = u[ceil(10k/9) - 1] = 4 for k <= 8
    edges = length_bin_edges(lengths, cap=10)
    assert edges.tolist() == [4] * 8 + [9, 10]
    bins = length_bin_accuracy(lengths, [1.0] * 11, edges)
    assert bins.counts.tolist() == [9, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert np.isnan(bins.accuracy[1:8]).all() and not np.isnan(bins.accuracy[[0, 8, 9]]).any()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=300),
    st.integers(min_value=0, max_value=40),
)
def test_length_bins_are_inverted_cdf_quantiles(uncapped_raw, num_capped):
    cap = 61
    lengths = np.array(uncapped_raw + [cap] * num_capped)
    edges = length_bin_edges(lengths, cap)
    uncapped = np.array(uncapped_raw)
    n = uncapped.size
    for k in range(1, 9):  # smallest observed length with at least k n / 9 responses at or below it
        assert edges[k - 1] in uncapped
        assert 9 * np.sum(uncapped <= edges[k - 1]) >= k * n
        assert 9 * np.sum(uncapped < edges[k - 1]) < k * n
    bins = length_bin_accuracy(lengths, np.zeros(lengths.size), edges)
    assert bins.counts[-1] == num_capped and bins.counts.sum() == lengths.size
    which = np.searchsorted(edges, lengths, side="left")
    for value in np.unique(lengths):  # tie-preserving: one bin per distinct length
        assert np.unique(which[lengths == value]).size == 1


def test_shared_bins_pool_methods_and_keep_their_counts_separate():
    a = (np.array([1, 2, 3, 4, 100]), np.array([1, 1, 0, 0, 0.0]))
    b = (np.array([5, 6, 7, 8, 9, 10, 11, 12, 13, 100]), np.ones(10))
    edges, bins = shared_length_bins({"a": a, "b": b}, cap=100)
    assert edges.tolist() == length_bin_edges(np.concatenate([a[0], b[0]]), 100).tolist()
    assert bins["a"].counts.sum() == 5 and bins["b"].counts.sum() == 10
    assert bins["a"].counts[-1] == 1 and bins["b"].counts[-1] == 1


@pytest.mark.parametrize(
    "lengths, cap, match",
    [
        ([1, 2, 30], 20, "<= cap=20"),
        ([1, -2], 20, ">= 0"),
        ([1.0, float("nan")], 20, "NaN"),
        ([1.5, 2.0], 20, "whole token counts"),
        ([20, 20], 20, "every response is at the cap"),
        ([[1, 2]], 20, "1-D"),
        ([], 20, "empty"),
        ([1, 2], 1, "cap must be"),
    ],
)
def test_length_bin_edges_bad_input(lengths, cap, match):
    with pytest.raises(ValueError, match=match):
        length_bin_edges(lengths, cap)


def test_length_bin_accuracy_bad_input():
    edges = [2, 4, 6]
    with pytest.raises(ValueError, match=r"correct has shape \(2,\); lengths has \(3,\)"):
        length_bin_accuracy([1, 2, 3], [1, 0], edges)
    with pytest.raises(ValueError, match="exceeds the last bin"):
        length_bin_accuracy([1, 7], [1, 0], edges)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        length_bin_accuracy([1, 2], [1, 2], edges)
    with pytest.raises(ValueError, match="non-decreasing"):
        length_bin_accuracy([1, 2], [1, 0], [4, 2, 6])


# --------------------------------------------------------------------------------------- curves


def test_early_peak_includes_the_bound_and_nothing_after_it():
    steps = [32, 64, 128, 256, 288]
    assert early_peak(steps, [0.1, 0.3, 0.2, 0.4, 0.9]) == 0.4
    assert early_peak(steps, [0.1, 0.3, 0.2, 0.4, 0.9], until=128) == 0.3
    with pytest.raises(ValueError, match="no logged step is <= until=16"):
        early_peak(steps, [0.1] * 5, until=16)


def test_late_mean_by_hand_on_logged_knots():
    # Integral of the interpolant: (1+3) + (3+2) + (2+4) = 15 over 6 steps; weights (1, 2, 2, 1) / 6.
    mean, std = late_mean([0, 2, 4, 6], [1, 3, 2, 4], 0, 6)
    assert mean == pytest.approx(2.5, abs=1e-15)
    assert std == pytest.approx(math.sqrt((2.25 + 2 * 0.25 + 2 * 0.25 + 2.25) / 6), abs=1e-15)


def test_late_mean_interpolates_window_edges_between_logged_steps():
    # v(1) = 2 and v(5) = 3 by interpolation; knots (1, 2, 4, 5), values (2, 3, 2, 3), weights
    # (0.5, 1.5, 1.5, 0.5) / 4: mean 2.5, every knot 0.5 away from it.
    mean, std = late_mean([0, 2, 4, 6], [1, 3, 2, 4], 1, 5)
    assert (mean, std) == pytest.approx((2.5, 0.5), abs=1e-15)


def test_late_mean_at_the_papers_window():
    steps = np.arange(32, 1025, 32)  # N = 32: one record per rollout batch of 32 updates
    values = np.sin(steps / 50.0)
    mean, std = late_mean(steps, values, 896, 1024)
    knots = values[steps >= 896]  # 896, 928, 960, 992, 1024 with weights 16, 32, 32, 32, 16
    weights = np.array([16, 32, 32, 32, 16]) / 128
    assert mean == pytest.approx(float(weights @ knots), abs=1e-14)
    assert std == pytest.approx(math.sqrt(float(weights @ (knots - weights @ knots) ** 2)), abs=1e-14)


def test_late_mean_equals_the_interpolants_average_on_random_curves():
    rng = np.random.default_rng(0)
    steps = np.cumsum(rng.integers(1, 9, size=40)).astype(float)
    values = rng.normal(size=40)
    start, end = steps[3] + 0.37, steps[-5] - 1.6
    grid = np.linspace(start, end, 400_001)
    reference = np.trapezoid(np.interp(grid, steps, values), grid) / (end - start)
    mean, _ = late_mean(steps, values, start, end)
    assert mean == pytest.approx(reference, abs=1e-8)
    # A knot added on the line (no new information) moves neither statistic of a linear curve's mean.
    assert late_mean([0, 10], [0, 1], 0, 10)[0] == pytest.approx(late_mean([0, 5, 10], [0, 0.5, 1], 0, 10)[0])
    assert late_mean([0, 4, 8], [0.7, 0.7, 0.7], 1, 7) == pytest.approx((0.7, 0.0))


@pytest.mark.parametrize(
    "steps, values, start, end, match",
    [
        ([0, 2, 4], [1, 2, 3], -1, 4, "not within the logged steps"),
        ([0, 2, 4], [1, 2, 3], 0, 5, "does not extrapolate"),
        ([0, 2, 4], [1, 2, 3], 3, 3, "start < end"),
        ([0, 2, 2], [1, 2, 3], 0, 2, "strictly increasing"),
        ([0, 2, 4], [1, float("nan"), 3], 0, 4, "NaN or inf .first at step 2"),
        ([0, 2, 4], [1, 2], 0, 4, "same length"),
        ([], [], 0, 4, "empty"),
    ],
)
def test_late_mean_bad_input(steps, values, start, end, match):
    with pytest.raises(ValueError, match=match):
        late_mean(steps, values, start, end)
