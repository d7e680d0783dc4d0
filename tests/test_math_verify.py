"""The evaluation scorer (App. D.2): Math-Verify in a persistent process pool.

References: Math-Verify's own test expectations (`verifier_cases/math_verify_cases.jsonl`), the MATH
repository's `is_equiv` cases, and verl's scoring function run in this (main-thread) process. Also:
hostile answers finish within the timeout, and the pool survives killed and crashed workers.
"""

import json
import os
import pathlib
import signal
import threading
import time

import numpy as np
import pytest
from math_verify import ExprExtractionConfig, LatexExtractionConfig, math_metric

from respo_jax.rewards import EXPR, Extraction, MathVerifyScorer, VerifyCall, math_verify_score

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
CASES = DATA / "verifier_cases"
SLACK_S = 1.0  # time to notice a deadline and reap the worker, on a loaded 2-core machine


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def scorer():
    with MathVerifyScorer(num_workers=2, timeout_s=20.0) as pool:
        yield pool


def call_for_case(case: dict) -> VerifyCall:
    """The Math-Verify call a case names, with its options (`compare_strings` is Math-Verify's test helper:
    parse both sides with the listed targets, LaTeX with boxed_match_priority=0, then `verify`)."""
    options = case["options"]
    if case["api"] == "parse+verify(defaults)":
        assert options == {}
        return VerifyCall(case["gold"], case["pred"])
    assert case["api"] == "compare_strings", case["api"]
    kinds = {"latex": Extraction("latex", boxed_match_priority=0), "expr": EXPR}
    targets = tuple(kinds[name] for name in options.get("match_types", ["latex", "expr"]))
    return VerifyCall(
        case["gold"],
        case["pred"],
        gold_targets=targets,
        pred_targets=targets,
        float_rounding=options.get("precision", 6),
        strict=options.get("strict", True),
        allow_set_relation_comp=options.get("allow_set_relation_comp", False),
    )


def test_pool_agrees_with_math_verify_reference_cases(scorer):
    cases = read_jsonl(CASES / "math_verify_cases.jsonl")
    outcomes = scorer.run_calls([call_for_case(case) for case in cases])
    assert all(outcome.status == "ok" for outcome in outcomes), [o for o in outcomes if o.status != "ok"]
    disagreements = [
        (case["api"], case["gold"][:60], case["pred"][:60], case["expected"], outcome.score)
        for case, outcome in zip(cases, outcomes)
        if outcome.score != case["expected"]
    ]
    by_api = {}
    for case, outcome in zip(cases, outcomes):
        agree, total = by_api.get(case["api"], (0, 0))
        by_api[case["api"]] = (agree + (outcome.score == case["expected"]), total + 1)
    print(f"Math-Verify reference cases, agreement by api: {by_api}")
    assert set(by_api) == {"parse+verify(defaults)", "compare_strings"}
    assert not disagreements, disagreements


def test_score_batch_is_verls_math_verify_call(scorer):
    """The pool's score equals verl's `compute_score` run here, in the main thread where its alarm works."""
    records = read_jsonl(DATA / "math500" / "test.jsonl")[:24]
    solutions = [record["solution"] for record in records] * 2
    # Second half: each solution against the answer two problems on (no two of those are equivalent;
    # one problem on would pair "5" with "x=5", which Math-Verify rightly calls equal).
    answers = [record["answer"] for record in records]
    golds = answers + answers[2:] + answers[:2]
    metric = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    expected = []
    for solution, gold in zip(solutions, golds):
        try:
            expected.append(metric(["\\boxed{" + gold + "}"], [solution])[0])
        except Exception:  # noqa: BLE001 - verl scores any failure 0
            expected.append(0.0)
    scores = scorer.score_batch(solutions, golds)
    assert scores.shape == (48,) and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, expected)
    assert scores[:24].mean() > 0.9  # the reference solution matches its own answer
    assert scores[24:].max() == 0.0  # ... and not another problem's


def test_math_equivalence_cases_from_the_math_repository(scorer):
    # MATH's is_equiv compares comma lists in order; Math-Verify reads them as sets, so the two
    # list-order cases ("10, 4, -2" vs "4, 10, -2") are a known difference of the paper's scorer.
    cases = [c for c in read_jsonl(CASES / "hendrycks_math_equiv_cases.jsonl") if "order" not in c["source"]]
    cases = [c for c in cases if not c["source"].endswith("test_decimals")]
    solutions = ["$\\boxed{" + case["pred"] + "}$" for case in cases]
    scores = scorer.score_batch(solutions, [case["gold"] for case in cases])
    np.testing.assert_array_equal(scores, [case["expected"] for case in cases])
    assert len(cases) == 13


def deep_fraction(depth: int) -> str:
    text = "1"
    for _ in range(depth):
        text = "\\frac{" + text + "}{2}"
    return text


HOSTILE = {
    "fraction nested 1000 deep": "$\\boxed{" + deep_fraction(1000) + "}$",
    "tower of exponents": "$\\boxed{" + "2^{" * 8 + "2" + "}" * 8 + "}$",
    "flat tower 2^2^...^2": "The answer is $" + "^".join(["2"] * 30) + "$",
    "100k-character sum": "$\\boxed{" + "1+" * 50_000 + "1}$",
    "100k characters of prose": "x" * 100_000,
    "parentheses 1000 deep": "$\\boxed{" + "(" * 1000 + "1" + ")" * 1000 + "}$",
}


def test_hostile_answers_are_killed_at_the_hard_timeout_and_the_pool_recovers():
    timeout_s = 1.5  # below Math-Verify's own 5 s alarms, so the hard timeout must act
    with MathVerifyScorer(num_workers=2, timeout_s=timeout_s) as pool:
        started = pool.stats.workers_started
        begin = time.monotonic()
        outcomes = pool.run_verl(list(HOSTILE.values()), ["1"] * len(HOSTILE))
        elapsed = time.monotonic() - begin
        for name, outcome in zip(HOSTILE, outcomes):
            assert outcome.score == 0.0, name
            assert outcome.seconds <= timeout_s + SLACK_S, (name, outcome)
        statuses = {name: outcome.status for name, outcome in zip(HOSTILE, outcomes)}
        assert statuses["tower of exponents"] == statuses["fraction nested 1000 deep"] == "timeout"
        killed = sum(status == "timeout" for status in statuses.values())
        stats = pool.stats
        assert stats.hard_timeouts == stats.workers_killed == killed
        assert stats.workers_started == started + killed  # every killed worker was replaced
        print(f"{len(HOSTILE)} hostile answers, {killed} killed at {timeout_s} s: batch took {elapsed:.1f} s")
        # The replaced workers still score correctly.
        np.testing.assert_array_equal(
            pool.score_batch(["$\\boxed{\\frac{1}{2}}$", "so x = 3", "$\\boxed{5}$"], ["0.5", "3", "4"]),
            [1.0, 1.0, 0.0],
        )


def test_math_verify_own_alarm_bounds_hostile_answers_without_killing():
    with MathVerifyScorer(num_workers=2, timeout_s=6.0, math_verify_timeout_s=1) as pool:
        outcomes = pool.run_calls([VerifyCall("1", pred) for pred in HOSTILE.values()])
        for name, outcome in zip(HOSTILE, outcomes):
            assert outcome.score == 0.0 and outcome.status == "ok", (name, outcome)
            assert outcome.seconds <= 3 * 1 + SLACK_S, (name, outcome)  # at most parse, parse, verify
        assert outcomes[1].soft_timeout  # the tower hits Math-Verify's alarm
        assert pool.stats.soft_timeouts >= 1 and pool.stats.hard_timeouts == 0
        assert pool.stats.workers_started == 2


def test_a_crashed_worker_scores_zero_and_the_batch_goes_on():
    with MathVerifyScorer(num_workers=1, timeout_s=20.0) as pool:
        pool.score_batch(["1"], ["1"])  # the worker is up
        victim = pool.worker_pids[0]
        killer = threading.Timer(0.5, os.kill, args=(victim, signal.SIGKILL))
        killer.start()
        slow = "$\\boxed{" + "2^{" * 8 + "2" + "}" * 8 + "}$"  # runs ~5 s: still busy when killed
        outcomes = pool.run_verl([slow, "$\\boxed{7}$", "$\\boxed{8}$"], ["1", "7", "9"])
        killer.join()
        assert [outcome.status for outcome in outcomes] == ["crash", "ok", "ok"]
        assert [outcome.score for outcome in outcomes] == [0.0, 1.0, 0.0]
        assert pool.stats.crashes == 1 and pool.worker_pids[0] != victim


def test_workers_are_recycled_after_max_tasks():
    with MathVerifyScorer(num_workers=1, max_tasks_per_worker=3) as pool:
        scores = pool.score_batch([f"$\\boxed{{{n}}}$" for n in range(7)], [str(n) for n in range(7)])
        np.testing.assert_array_equal(scores, np.ones(7))
        assert pool.stats.workers_recycled == 2 and pool.stats.workers_started == 3
        assert pool.stats.calls == pool.stats.correct == 7
        assert pool.score_batch([], []).shape == (0,)


def test_single_call_api_and_closed_scorer():
    assert math_verify_score("The answer is $\\boxed{\\dfrac{3}{4}}$.", "0.75") == 1.0
    assert math_verify_score("The answer is $\\boxed{4}$.", "3") == 0.0
    pool = MathVerifyScorer(num_workers=1)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_batch(["1"], ["1"])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_workers must be an int >= 1; got 0"):
        MathVerifyScorer(num_workers=0)
    with pytest.raises(ValueError, match="math_verify_timeout_s must be an int"):
        MathVerifyScorer(num_workers=1, math_verify_timeout_s=1.5)
    with pytest.raises(ValueError, match="kind must be 'latex' or 'expr'; got 'string'"):
        Extraction("string")
    with MathVerifyScorer(num_workers=1) as pool:
        with pytest.raises(ValueError, match="same length; got 2 and 1"):
            pool.score_batch(["a", "b"], ["a"])
        with pytest.raises(ValueError, match="item 0: solution and gold must be str; got int and str"):
            pool.score_batch([3], ["3"])


def test_workers_that_cannot_start_raise_instead_of_hanging():
    pool = MathVerifyScorer(num_workers=1, memory_limit_mb=64)  # too little memory to import SymPy
    try:
        with pytest.raises(RuntimeError, match="workers fail to start"):
            pool.score_batch(["1"], ["1"])
    finally:
        pool.close()
