"""The gradient-starvation sweep's markdown tables (summary.md) from its summary.json: the first study's
per-(objective, N) and drift tables, and the second study's grid, selection, best-lr, controls and
long-regime tables. Pure functions of the summary dict (`experiments.starvation_summary`).
"""

from __future__ import annotations

from experiments.starvation_findings import findings_markdown

OBJECTIVE_NAMES = {"respo": "ReSPO", "vespo": "VESPO", "grpo": "GRPO", "gspo": "GSPO"}


def _ratio(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _pct(value, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f}"


def summary_markdown(summary: dict) -> str:
    """The per-(objective, N) table (values in %, means over seeds) and a drift/deep-tail table."""
    w = summary["windows"]
    lines = [
        "| Objective | N | Early peak | Late mean ± temporal std | Cross-seed std | Held-out acc. "
        "| Pos. log W<−1 | Mass log W<−1 | Amplif. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["groups"]:
        late = "–" if g["late_mean"] is None else \
            f"{_pct(g['late_mean'])} ± {_pct(g['late_temporal_std'])}"
        held = _pct(g["heldout_accuracy"])
        if g["heldout_accuracy_cross_seed_std"] is not None:
            held += f" ± {_pct(g['heldout_accuracy_cross_seed_std'])}"
        amp = _ratio(g["positive_low_w_amplification"])
        name = OBJECTIVE_NAMES.get(g["objective"], g["objective"])
        lines.append(
            f"| {name} | {g['reuse']} | {_pct(g['early_peak'])} "
            f"| {late} | {_pct(g['late_mean_cross_seed_std'])} | {held} | {_pct(g['positive_low_w_share'])} "
            f"| {_pct(g['positive_low_w_mass_share'])} | {amp} |")
    lines += [
        "",
        "Training score (score+1)/2 and held-out greedy accuracy in %, means over seeds "
        f"({', '.join(str(s) for s in summary['settings']['sweep']['seeds'].split(','))}). "
        f"{w['note']} Temporal std: within-run, averaged over seeds; cross-seed std: population std of the "
        "late means. Held-out: greedy accuracy on the disjoint test split after the last update "
        f"(± cross-seed std); the base model scores {_pct(summary['base_model']['greedy_accuracy'])}. "
        "Positive-branch columns (App. E.3, Tab. 5): share of positive responses (Â > 0) and of their "
        "coefficient mass |Â|·φ with log W < −1, and amplification = mass share / response share, over the "
        "second half of the first half of each run's rollout batches (the paper's batches 9–16 of 32), means "
        "over seeds.",
        "",
        "| Objective | N | log W q05 | median | q95 | share \\|log W\\|>1 | Pos. −5<log W≤−2 "
        "| Mass −5<log W≤−2 | Amplif. | Length, log W≤−0.5 (n) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["groups"]:
        amp = "–" if g["positive_deep_tail_amplification"] is None else \
            f"{g['positive_deep_tail_amplification']:.2f}×"
        name = OBJECTIVE_NAMES.get(g["objective"], g["objective"])
        lines.append(
            f"| {name} | {g['reuse']} | {g['log_w_q05']:+.2f} "
            f"| {g['log_w_median']:+.2f} | {g['log_w_q95']:+.2f} | {_pct(g['log_w_abs_gt1_share'])} "
            f"| {_pct(g['positive_deep_tail_share'])} | {_pct(g['positive_deep_tail_mass_share'])} | {amp} "
            f"| {_ratio(g['positive_low_w_length_relative'])} ({g['positive_low_w_length_count']}) |")
    lines += ["", "log W quantiles and the share with |log W| > 1 pooled over every response of each run "
              "(the weight the objective saw at its update), means over seeds; deep-tail columns as Tab. 5. "
              "Length: mean length of the positive responses with log W ≤ −0.5 relative to all positive "
              "responses (Tab. 7 pooled over the first half of the run's rollout batches; paper at N=32: "
              "ReSPO 1.13×, VESPO 1.06×), weighted over seeds by their count n."]
    if summary["missing_cells"]:
        lines += ["", f"Not finished (not in the table): {', '.join(summary['missing_cells'])}."]
    return "\n".join(lines) + "\n"


V2_HEADER = ("| Objective | N | lr | Updates | Late mean ± temporal std | Cross-seed std | Greedy held-out "
             "| Sampled pass@1 ± SE | Approx. KL | Clip frac. | Pos. log W<−1 | Neg. log W<0 "
             "| Neg. mass log W<0 |")


def _v2_row(g: dict) -> str:
    late = "–" if g["late_mean"] is None else f"{_pct(g['late_mean'])} ± {_pct(g['late_temporal_std'])}"
    sampled = "–" if g["sampled_pass_at_1"] is None else \
        f"{_pct(g['sampled_pass_at_1'])} ± {_pct(g['sampled_pass_at_1_se'])}"
    kl = "–" if g["approx_kl"] is None else f"{g['approx_kl']:.4f}"
    name = OBJECTIVE_NAMES.get(g["objective"], g["objective"])
    return (f"| {name} | {g['reuse']} | {g['learning_rate']:g} | {g['policy_updates']} | {late} "
            f"| {_pct(g['late_mean_cross_seed_std'])} | {_pct(g['heldout_accuracy'])} | {sampled} | {kl} "
            f"| {_pct(g['clip_fraction'], 2)} | {_pct(g['positive_log_w_lt_minus1_share'])} "
            f"| {_pct(g['negative_log_w_lt0_share'])} | {_pct(g['negative_log_w_lt0_mass_share'])} |")


def _v2_table(rows: list[dict]) -> list[str]:
    return [V2_HEADER, "|" + "---|" * V2_HEADER.count(" | ") + "---|", *(_v2_row(g) for g in rows)] \
        if rows else ["(no finished cell yet)"]


def second_study_markdown(summary: dict) -> str:
    """The second study's tables: the lr grid, the selection, each method at its best lr, the controls
    and the long regime with its acceptance (values in %, means over the report seeds)."""
    settings = summary["settings"]["sweep"]
    main = [g for g in summary["groups"] if g["regime"] == ""]
    base = (summary.get("base_held_out") or {}).get("main") or {}
    lines = ["## Grid: every objective at every lr (lr × updates fixed)", "", *_v2_table(main), "",
             f"Means over the report seeds ({settings['seeds']}). Training score (score+1)/2: late mean over "
             "the last quarter of each run's updates, in blocks of the largest N. Held-out: greedy accuracy "
             "and sampled pass@1 (± its standard error over problems, combined over seeds) after the last "
             f"update; the base model: greedy {_pct(base.get('greedy_accuracy'))}, sampled "
             f"{_pct(base.get('sampled_pass_at_1'))} ± {_pct(base.get('sampled_pass_at_1_se'))}. Approx. KL: "
             "k1 to π_old per response, mean over rollout batches; clip fraction: share of tokens clipped "
             "(clipped objectives only); Pos. log W<−1: share of positive responses; Neg. log W<0: share "
             "of negative responses (Â < 0) with log W < 0, and their share of the negative coefficient "
             "mass |Â|·φ.", "", "## Selection of each method's lr", "",
             f"Rule: {summary['selection']['rule']}; selection seed {summary['selection']['seed']}.", "",
             "| Objective | N | Late mean per lr (selection seed) | Selected lr |", "|---|---|---|---|"]
    for r in summary["selection"]["records"]:
        scores = ", ".join(f"{lr}: {_pct(v)}" for lr, v in r["late_means"].items())
        lines.append(f"| {OBJECTIVE_NAMES.get(r['objective'], r['objective'])} | {r['reuse']} | {scores} "
                     f"| {r['best_learning_rate']:g} |")
    lines += ["", "## Each method at its own best lr", "", *_v2_table(summary["best"]), "",
              "## Controls at the largest N (common lr, then each one's best lr)", "",
              *_v2_table(summary["controls"]), "",
              "Controls (registered with `kernel_objective` by the config file): REINFORCE φ ≡ 1; ReSPO's φ⁺ "
              "with VESPO's φ⁻; VESPO's φ⁺ with ReSPO's φ⁻."]
    if "long_acceptance" in summary:
        accept = summary["long_acceptance"]
        lines += ["", f"## Long-response regime (task.difficulty={settings['long_difficulty']}, each "
                  "objective at its best lr of the largest N)", "", *_v2_table(summary["long_regime"]), "",
                  f"Acceptance: {accept['rule']}."]
        for row in accept["by_reuse"]:
            checks = "; ".join(f"{OBJECTIVE_NAMES.get(k, k)} clip {_pct(v['clip_fraction'], 2)}%, "
                               f"pos. log W<−1 {_pct(v['positive_log_w_lt_minus1_share'])}%"
                               for k, v in row["checks"].items())
            lines.append(f"- N = {row['reuse']}: {'accepted' if row['accepted'] else 'NOT accepted'} "
                         f"({checks or 'no clipped baseline finished'}).")
    if summary.get("per_seed"):
        lines += ["", *findings_markdown(summary["per_seed"], OBJECTIVE_NAMES)]
    if summary["missing_cells"]:
        lines += ["", f"Not finished (not in the tables): {', '.join(summary['missing_cells'])}."]
    return "\n".join(lines) + "\n"
