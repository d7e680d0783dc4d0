"""The second study's per-seed comparisons (summary.json's "per_seed", summary.md's last section): the
numbers its written conclusions rest on, each given per seed so that a claim of a tie or of a ranking can
be read against the spread between seeds. Pure functions of the summary's per-cell records
(`experiments.starvation_summary.cell_summary`); seeds are paired, since every seed trains and evaluates
on the same problems with the same evaluation random numbers.
"""

from __future__ import annotations

import math

import numpy as np

from respo_jax.eval import positive_branch

# The negative-branch kernel of each objective and control at N > 1 (GRPO and GSPO: clipped ratios).
PHI_MINUS = {"respo": "ReSPO", "vespo_respo": "ReSPO", "vespo": "VESPO", "respo_vespo": "VESPO",
             "reinforce": "1", "grpo": "clip", "gspo": "clip"}
SCORES = ("late_mean", "sampled_pass_at_1_after", "early_peak")


def _cell(cells: list[dict], objective: str, reuse: int, lr: float, seed: int) -> dict | None:
    return next((c for c in cells if (c["objective"], c["reuse"], c["seed"]) == (objective, reuse, seed)
                 and math.isclose(c["learning_rate"], lr, rel_tol=1e-9)), None)


def _values(cells: list[dict], objective: str, reuse: int, lr: float, seeds: list[int], key: str) -> list:
    """[seeds] of one score of (objective, N, lr); None where a cell or its value is missing."""
    out = []
    for seed in seeds:
        cell = _cell(cells, objective, reuse, lr, seed)
        out.append(None if cell is None else cell[key])
    return out


def _differences(a: list, b: list, mean_of: int | None = None) -> dict:
    """Per-seed a − b, the mean of the first `mean_of` (default all) and how many of all are below zero
    (None entries skipped)."""
    diff = [None if x is None or y is None else x - y for x, y in zip(a, b)]
    known = [d for d in diff if d is not None]
    averaged = [d for d in diff[:mean_of] if d is not None]
    return {"per_seed": diff, "mean": float(np.mean(averaged)) if averaged else None,
            "below": sum(d < 0 for d in known), "of": len(known)}


def _low_w(cell: dict | None, key: str) -> float | None:
    """Tab. 5's positive-branch value `key` on log W < -1 of one cell (the E.3 window)."""
    if cell is None or cell["tab5"] is None:
        return None
    return cell["tab5"][positive_branch.LOW_W[0]][key]


def per_seed_findings(summary: dict) -> dict:
    """From a second-study summary (needs "best", "settings", "cells"): at the largest N and the selected
    lrs, each method's per-seed late mean, sampled pass@1 and early peak; ReSPO minus every other method
    per seed; ReSPO minus GRPO and VESPO at every lr of the grid on every seed (the selection seed too,
    marked); the cost of reuse (N = largest minus N = 1, each at its selected lr; VESPO, ReSPO and the
    controls against GRPO at N = 1, which they equal there); and, at the common lr, the share of positive
    responses with log W < -1 and Tab. 5's amplification per seed with each method's negative kernel.
    Differences are per seed and paired; their means are over the report seeds."""
    settings = summary["settings"]
    sweep, cells = settings["sweep"], [c for c in summary["cells"] if c["regime"] == ""]
    seeds = [int(s) for s in str(sweep["seeds"]).split(",")]
    selection_seed = sweep["selection_seed"]
    largest = max(int(n) for n in str(sweep["reuse"]).split(","))
    common = settings["optim"]["learning_rate"]
    lrs = sorted(float(lr) for lr in str(sweep["learning_rates"]).split(","))
    best = {(g["objective"], g["reuse"]): g["learning_rate"] for g in summary["best"]}
    at_best = [(objective, lr) for (objective, n), lr in best.items() if n == largest]
    rows = [{"objective": objective, "learning_rate": lr,
             **{key: _values(cells, objective, largest, lr, seeds, key) for key in SCORES}}
            for objective, lr in at_best]
    late_means = [float(np.mean([v for v in r["late_mean"] if v is not None])) for r in rows
                  if any(v is not None for v in r["late_mean"])]
    out = {"seeds": seeds, "reuse": largest, "at_best_lr": rows,
           "late_mean_span": max(late_means) - min(late_means) if late_means else None}
    respo = next((r for r in rows if r["objective"] == "respo"), None)
    if respo is not None:
        out["respo_minus"] = [{"objective": r["objective"], **{key: _differences(respo[key], r[key])
                                                                for key in SCORES[:2]}}
                              for r in rows if r["objective"] != "respo"]
    all_seeds = seeds + ([selection_seed] if selection_seed >= 0 else [])
    out["respo_deficit_by_lr"] = [
        {"learning_rate": lr, "seeds": all_seeds, **{f"minus_{other}": _differences(
            _values(cells, "respo", largest, lr, all_seeds, "late_mean"),
            _values(cells, other, largest, lr, all_seeds, "late_mean"), len(seeds))
            for other in ("grpo", "vespo")}}
        for lr in lrs]
    reuse_cost = []
    for objective, lr in at_best:
        on_policy = objective if (objective, 1) in best else "grpo"
        if (on_policy, 1) in best:
            reuse_cost.append({"objective": objective, "against": on_policy, **{key: _differences(
                _values(cells, objective, largest, lr, seeds, key),
                _values(cells, on_policy, 1, best[(on_policy, 1)], seeds, key)) for key in SCORES[:2]}})
    out["reuse_cost"] = reuse_cost
    out["common_lr_tail"] = [
        {"objective": objective, "phi_minus": PHI_MINUS.get(objective, "?"), "learning_rate": common,
         "positive_low_w_share": [_low_w(_cell(cells, objective, largest, common, s), "response_share")
                                  for s in seeds],
         "amplification": [_low_w(_cell(cells, objective, largest, common, s), "amplification")
                           for s in seeds]}
        for objective in dict.fromkeys(c["objective"] for c in cells if c["reuse"] == largest)
        if _cell(cells, objective, largest, common, seeds[0]) is not None]
    return out


def _pct(value, digits: int = 1, sign: bool = False) -> str:
    if value is None:
        return "–"
    return f"{100 * value:+.{digits}f}" if sign else f"{100 * value:.{digits}f}"


def _seeds(values: list, digits: int = 1, sign: bool = False) -> str:
    return " / ".join(_pct(v, digits, sign) for v in values)


def findings_markdown(findings: dict, names: dict) -> list[str]:
    """summary.md's per-seed section (values in %, percentage points for differences)."""
    def name(objective: str) -> str:
        return names.get(objective, objective)

    seeds = "/".join(str(s) for s in findings["seeds"])
    n = findings["reuse"]
    lines = ["## Per seed", "", f"Each method at its selected lr, N = {n}, seeds {seeds} (values per seed):",
             "",
             "| Objective | lr | Late mean | Sampled pass@1 | Early peak |", "|---|---|---|---|---|"]
    lines += [f"| {name(r['objective'])} | {r['learning_rate']:g} | {_seeds(r['late_mean'], 2)} "
              f"| {_seeds(r['sampled_pass_at_1_after'], 2)} | {_seeds(r['early_peak'], 2)} |"
              for r in findings["at_best_lr"]]
    span = _pct(findings["late_mean_span"], 2)
    lines += ["", f"Span of the seed-mean late means across these methods: {span} "
              "pp. Early peak: the highest blocked training score in the first quarter of the updates."]
    if "respo_minus" in findings:
        lines += ["", "ReSPO minus each method, per seed (pp), at the selected lrs:", "",
                  "| Against | Late mean | mean | below | Sampled pass@1 | mean | below |", "|" + "---|" * 7]
        for r in findings["respo_minus"]:
            late, sampled = r["late_mean"], r["sampled_pass_at_1_after"]
            lines.append(f"| {name(r['objective'])} | {_seeds(late['per_seed'], 2, True)} "
                         f"| {_pct(late['mean'], 2, True)} | {late['below']}/{late['of']} "
                         f"| {_seeds(sampled['per_seed'], 2, True)} | {_pct(sampled['mean'], 2, True)} "
                         f"| {sampled['below']}/{sampled['of']} |")
    deficit = findings["respo_deficit_by_lr"]
    if deficit:
        all_seeds = "/".join(str(s) for s in deficit[0]["seeds"])
        lines += ["", f"ReSPO's late mean minus GRPO's and VESPO's at every lr of the grid, N = {n}, seeds "
                  f"{all_seeds} (the last: the selection seed; the mean is over the report seeds), pp:", "",
                  "| lr | − GRPO | mean | below | − VESPO | mean | below |", "|" + "---|" * 7]
        for r in deficit:
            g, v = r["minus_grpo"], r["minus_vespo"]
            lines.append(f"| {r['learning_rate']:g} | {_seeds(g['per_seed'], 2, True)} "
                         f"| {_pct(g['mean'], 2, True)} "
                         f"| {g['below']}/{g['of']} | {_seeds(v['per_seed'], 2, True)} "
                         f"| {_pct(v['mean'], 2, True)} | {v['below']}/{v['of']} |")
    if findings["reuse_cost"]:
        lines += ["", f"The cost of reuse: N = {n} minus N = 1, each at its selected lr, per seed (pp; "
                  "against GRPO at N = 1 for the methods that equal it there):", "",
                  "| Objective | Against | Late mean | mean | Sampled pass@1 | mean |", "|" + "---|" * 6]
        for r in findings["reuse_cost"]:
            late, sampled = r["late_mean"], r["sampled_pass_at_1_after"]
            lines.append(f"| {name(r['objective'])} | {name(r['against'])} N = 1 "
                         f"| {_seeds(late['per_seed'], 2, True)} | {_pct(late['mean'], 2, True)} "
                         f"| {_seeds(sampled['per_seed'], 2, True)} | {_pct(sampled['mean'], 2, True)} |")
    if findings["common_lr_tail"]:
        lr = findings["common_lr_tail"][0]["learning_rate"]
        lines += ["", f"At the common lr {lr:g}, N = {n}: share of positive responses with log W < −1 and "
                  "Tab. 5's amplification on them (the E.3 window), per seed, by negative kernel φ⁻:", "",
                  "| Objective | φ⁻ | Pos. log W < −1 (%) | Amplification |", "|---|---|---|---|"]
        for r in findings["common_lr_tail"]:
            amp = " / ".join("–" if a is None else f"{a:.2f}×" for a in r["amplification"])
            lines.append(f"| {name(r['objective'])} | {r['phi_minus']} | {_seeds(r['positive_low_w_share'])} "
                         f"| {amp} |")
    return lines
