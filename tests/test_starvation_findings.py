"""The second study's per-seed comparisons (experiments.starvation_findings) on a hand-built summary
whose differences are known, and on the committed cells' summary against what its README section states."""

import json
import os

import pytest

from experiments.starvation_findings import findings_markdown, per_seed_findings
from experiments.starvation_tables import OBJECTIVE_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOW_W = "log W < -1"


def _cell(objective, reuse, seed, lr, late, sampled, peak, share=0.1, amp=1.5):
    return {"objective": objective, "reuse": reuse, "seed": seed, "learning_rate": lr, "regime": "",
            "late_mean": late, "sampled_pass_at_1_after": sampled, "early_peak": peak,
            "tab5": {LOW_W: {"response_share": share, "mass_share": share * amp, "amplification": amp}}}


def _summary():
    """Seeds 0, 1 (report) and 2 (selection); lrs 1e-4 (common) and 5e-5; ReSPO = GRPO - (seed+1)/100 at
    every lr, VESPO = GRPO + 0.01; N = 1: GRPO only, at 0.3 + seed/100."""
    cells = []
    for seed in (0, 1, 2):
        for lr in (1e-4, 5e-5):
            grpo = 0.2 + lr * 100 + seed / 1000
            cells += [_cell("grpo", 4, seed, lr, grpo, grpo + 0.05, grpo - 0.1, share=0.02),
                      _cell("vespo", 4, seed, lr, grpo + 0.01, grpo + 0.07, grpo - 0.1, share=0.03, amp=0.8),
                      _cell("respo", 4, seed, lr, grpo - (seed + 1) / 100, grpo + 0.04 - seed / 100,
                            grpo - 0.2, share=0.2 + seed / 100)]
            cells.append(_cell("grpo", 1, seed, lr, 0.3 + seed / 100, 0.4, 0.2))
    best = [{"objective": o, "reuse": n, "learning_rate": 5e-5} for o, n in
            (("grpo", 1), ("grpo", 4), ("vespo", 4), ("respo", 4))]
    settings = {"sweep": {"seeds": "0,1", "selection_seed": 2, "reuse": "1,4", "learning_rates": "5e-5,1e-4"},
                "optim": {"learning_rate": 1e-4}}
    return {"settings": settings, "cells": cells, "best": best}


def test_per_seed_differences_are_paired_by_seed_and_averaged_over_the_report_seeds():
    f = per_seed_findings(_summary())
    assert f["seeds"] == [0, 1] and f["reuse"] == 4
    grpo_late = [0.205, 0.206]
    rows = {r["objective"]: r for r in f["at_best_lr"]}
    assert rows["grpo"]["late_mean"] == pytest.approx(grpo_late)
    assert f["late_mean_span"] == pytest.approx(0.01 + (0.01 + 0.02) / 2)  # VESPO's mean minus ReSPO's
    minus = {r["objective"]: r for r in f["respo_minus"]}
    assert minus["grpo"]["late_mean"]["per_seed"] == pytest.approx([-0.01, -0.02])
    assert minus["grpo"]["late_mean"]["mean"] == pytest.approx(-0.015)
    assert (minus["grpo"]["late_mean"]["below"], minus["grpo"]["late_mean"]["of"]) == (2, 2)
    assert minus["vespo"]["sampled_pass_at_1_after"]["per_seed"] == pytest.approx([-0.03, -0.04])
    deficit = {r["learning_rate"]: r for r in f["respo_deficit_by_lr"]}
    assert deficit[1e-4]["seeds"] == [0, 1, 2]
    assert deficit[1e-4]["minus_vespo"]["per_seed"] == pytest.approx([-0.02, -0.03, -0.04])
    assert deficit[1e-4]["minus_vespo"]["mean"] == pytest.approx(-0.025)  # the report seeds only
    assert (deficit[5e-5]["minus_grpo"]["below"], deficit[5e-5]["minus_grpo"]["of"]) == (3, 3)
    cost = {r["objective"]: r for r in f["reuse_cost"]}
    assert cost["respo"]["against"] == "grpo"
    assert cost["respo"]["late_mean"]["per_seed"] == pytest.approx([0.195 - 0.3, 0.186 - 0.31])
    tail = {r["objective"]: r for r in f["common_lr_tail"]}
    assert tail["respo"]["phi_minus"] == "ReSPO" and tail["vespo"]["phi_minus"] == "VESPO"
    assert tail["respo"]["positive_low_w_share"] == pytest.approx([0.2, 0.21])
    assert tail["vespo"]["amplification"] == pytest.approx([0.8, 0.8])
    text = "\n".join(findings_markdown(f, OBJECTIVE_NAMES))
    assert "| ReSPO | 5e-05 | 19.50 / 18.60 |" in text and "| GRPO | -1.00 / -2.00 | -1.50 | 2/2 |" in text


def test_the_committed_second_study_gives_the_numbers_its_report_states():
    """The per-seed numbers the second study's README section quotes, from its committed summary."""
    with open(os.path.join(ROOT, "experiments/results/gradient_starvation_v2/summary.json")) as fh:
        f = per_seed_findings(json.load(fh))
    minus = {r["objective"]: r["late_mean"] for r in f["respo_minus"]}
    late = [round(100 * minus[o]["mean"], 2) for o in ("grpo", "vespo", "respo_vespo")]
    assert late == [-0.74, -0.81, -0.88]
    assert all(minus[o]["below"] == 3 for o in ("grpo", "vespo", "respo_vespo"))
    deficit = [round(100 * r["minus_grpo"]["mean"], 1) for r in f["respo_deficit_by_lr"]]
    assert deficit == [-0.7, -2.5, -5.8]  # lr 2.5e-5, 5e-5, 1e-4
    assert sum(r[f"minus_{o}"]["below"] for r in f["respo_deficit_by_lr"] for o in ("grpo", "vespo")) == 24
    cost = {r["objective"]: round(100 * r["late_mean"]["mean"], 2) for r in f["reuse_cost"]}
    assert (cost["respo"], cost["grpo"], cost["vespo"]) == (-1.58, -0.85, -0.78)
    assert round(100 * f["late_mean_span"], 1) == 2.1
