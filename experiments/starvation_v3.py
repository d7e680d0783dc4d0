"""The third gradient-starvation study's report: the pilot's decision (its pre-registered acceptance rule
applied to GRPO's cells, with the base model's plateau by problem length) and the grid's paired
endpoints, from the cells' run directories.

Problems by length: a held-out problem's operand count is read off its record (`load_task` rebuilds the
held-out records from the run's config, in the evaluation's order); a training response's problem is
rebuilt by `experiments.starvation_problems.rollout_problems`.

Paired endpoints (each a difference of two arms with `paired_cluster_bootstrap`, App. D.3: problems and
seeds resampled, the same draws for both arms):
- `long_first_quarter`: the training score (share of correct responses, reward > 0) on long problems
  over the first quarter of the run's policy updates, per (seed, long-problem group) [seeds, groups];
  the arms of one N sample the same problems in the same order (the batches depend on task.seed only);
- `heldout_long_pass_at_1`: the final held-out sampled pass@1 on long problems [seeds, problems, samples]
  (every arm is scored on the same problems with the same evaluation draws);
- `late_mean`: the late mean of the blocked training score [seeds, 1] (only the seeds vary).
"""

from __future__ import annotations

import numpy as np

from experiments.configs import gradient_starvation_v3 as v3
from experiments.starvation_problems import long_positive_tail_share, rollout_problems
from experiments.starvation_summary import trust_region_diagnostics
from respo_jax.data.synthetic import operand_count
from respo_jax.eval.report import Run
from respo_jax.eval.statistics import paired_cluster_bootstrap
from respo_jax.training.config import ExperimentConfig, config_from_dict
from respo_jax.training.tasks import load_task

ENDPOINTS = ("long_first_quarter", "heldout_long_pass_at_1", "late_mean")
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 10_000, 0


def is_long(operands: int) -> bool:
    low, high = v3.LONG_OPERANDS
    return low <= operands <= high


def _config(run_config: dict) -> ExperimentConfig:
    return config_from_dict(ExperimentConfig, run_config, validate=False)


def heldout_operands(run_config: dict) -> np.ndarray:
    """[problems] the operand count of each held-out problem of a run, in its evaluation's order."""
    return np.array([operand_count(r["problem"]) for r in load_task(_config(run_config)).held_out])


def accuracy_by_length(held_out: dict, operands: np.ndarray) -> dict:
    """Greedy accuracy and sampled pass@1 of one held-out record (per-problem outcomes) on the short and
    the long problems, and per operand count: {"short", "long", "by_operands": {count: {...}}}."""
    greedy = np.asarray(held_out["greedy_correct"], np.float64)
    samples = held_out.get("sampled_samples") or 0
    sampled = np.asarray(held_out["sampled_correct"], np.float64) / samples if samples else None
    if greedy.shape != operands.shape:
        raise ValueError(f"the held-out record scores {greedy.size} problems, its config {operands.size}")

    def of(rows) -> dict:
        some = bool(rows.any())
        return {"problems": int(rows.sum()), "greedy_accuracy": float(greedy[rows].mean()) if some else None,
                "sampled_pass_at_1": float(sampled[rows].mean()) if sampled is not None and some else None}

    long = np.array([is_long(int(k)) for k in operands], bool)
    return {"short": of(~long), "long": of(long),
            "by_operands": {str(k): of(operands == k) for k in np.unique(operands)}}


def pilot_cell(run: Run) -> dict:
    """One pilot cell: GRPO's mean clip fraction, the long-positive tail share (and its count) in the
    E.3 window, and `pilot_accepted` of the two."""
    clip = trust_region_diagnostics(run)["clip_fraction"]
    share, count = long_positive_tail_share(run, v3.LONG_OPERANDS, v3.TAIL_LOG_W)
    return {"reuse": int(run.config["rollout"]["reuse"]), "seed": int(run.config["run"]["seed"]),
            "learning_rate": run.config["optim"]["learning_rate"], "policy_updates": run.policy_updates,
            "clip_fraction": clip, "long_positive_tail_share": share, "long_positives": count,
            "accepted": v3.pilot_accepted(clip, share)}


def pilot_decision(base: dict, base_config: dict, runs: dict, missing: list[str]) -> dict:
    """decision.json: the setting (warm-up, task, step size, N, seed), the base model's plateau (warm-up
    loss curve; held-out accuracy on short and long problems), each finished GRPO cell's two numbers and
    the rule's verdict, and the cells still missing. `runs`: {cell name: Run} of the GRPO pilot cells."""
    cells = {name: pilot_cell(run) for name, run in runs.items()}
    held_out = base.get("held_out")
    plateau = {"sft_loss_last": base.get("sft_loss_last"), "sft_loss_curve": base.get("sft_loss_curve"),
               "held_out": accuracy_by_length(held_out, heldout_operands(base_config)) if held_out else None}
    accepted = sorted(name for name, cell in cells.items() if cell["accepted"])
    verdict = ("accepted: " + ", ".join(accepted) if accepted else
               "not accepted" if cells and not missing else "pending: no accepted cell yet")
    return {
        "rule": (f"GRPO on the pilot seed: mean clip fraction < {v3.PILOT_CLIP_LIMIT:.0%} and >= "
                 f"{v3.PILOT_TAIL_SHARE:.0%} of positives (A > 0) to problems of {v3.LONG_OPERANDS[0]}-"
                 f"{v3.LONG_OPERANDS[1]} operands with log W < {v3.TAIL_LOG_W:g} in the first half of the "
                 "rollout batches"),
        "setting": {"task": base["config"]["task"], "warmup": base["config"]["warmup"],
                    "learning_rate": base_config["optim"]["learning_rate"],
                    "max_new_tokens": base["config"]["rollout.max_new_tokens"]},
        "base_model": {"sha256": base["sha256"], **plateau},
        "cells": cells, "missing_cells": missing, "decision": verdict,
    }


def _pct(value, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f}%"


def _range(setting: dict) -> str:
    """The warm-up's operand bounds where set (absent or 0: the task's own), e.g. " (at most 11 operands)"."""
    low, high = setting["warmup"].get("min_operands"), setting["warmup"].get("max_operands")
    bounds = [f"at least {low}"] * bool(low) + [f"at most {high}"] * bool(high)
    return f" ({' and '.join(bounds)} operands)" if bounds else ""


def pilot_markdown(decision: dict) -> str:
    """decision.md: the rule, the base model's plateau and one row per GRPO cell."""
    s, base = decision["setting"], decision["base_model"]
    lines = [f"# Third study: pilot decision — {decision['decision']}", "", f"Rule: {decision['rule']}.", "",
             f"Setting: task {s['task'].get('difficulty')}, warm-up {s['warmup']['steps']} steps{_range(s)}, "
             f"lr {s['learning_rate']:g}, max_new_tokens {s['max_new_tokens']}.", "",
             "## Base model (the warm-up's plateau)", ""]
    curve = base.get("sft_loss_curve") or []
    lines.append(f"Warm-up loss, mean of the last 10 steps: {base['sft_loss_last']:.4f}; per 100 steps: "
                 + (", ".join(f"{v:.3f}" for v in curve) if curve else "–") + ".")
    if base["held_out"]:
        lines += ["", "| Operands | Problems | Greedy acc. | Sampled pass@1 |", "|---|---|---|---|"]
        held_out = base["held_out"]
        low, high = v3.LONG_OPERANDS
        for key, row in [*held_out["by_operands"].items(), (f"< {low} (short)", held_out["short"]),
                         (f"{low}-{high} (long)", held_out["long"])]:
            lines.append(f"| {key} | {row['problems']} | {_pct(row['greedy_accuracy'])} "
                         f"| {_pct(row['sampled_pass_at_1'])} |")
    lines += ["", "## GRPO pilot cells", "", "| Cell | N | Clip fraction | Long positives | "
              "Share log W < −1 | Accepted |", "|---|---|---|---|---|---|"]
    for name, c in decision["cells"].items():
        lines.append(f"| {name} | {c['reuse']} | {_pct(c['clip_fraction'], 2)} | {c['long_positives']} "
                     f"| {_pct(c['long_positive_tail_share'])} | {'yes' if c['accepted'] else 'no'} |")
    if decision["missing_cells"]:
        lines += ["", "Not finished: " + ", ".join(decision["missing_cells"]) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Paired endpoints of the grid


def long_first_quarter(run: Run) -> np.ndarray:
    """[groups] the share of correct responses (reward > 0) of each long-problem group of the rollout
    batches in the first quarter of the run's policy updates, in sampling order."""
    quarter = run.policy_updates / 4
    rollouts = [r for r in run.rollouts if int(r["policy_updates"]) <= quarter] or run.rollouts[:1]
    problems = rollout_problems(_config(run.config), max(int(r["iteration"]) for r in rollouts))
    scores = []
    for rollout in rollouts:
        batch = problems[int(rollout["iteration"]) - 1]
        group, correct = np.asarray(rollout["group"]), np.asarray(rollout["reward"], np.float64) > 0
        for g in range(len(batch)):
            if is_long(operand_count(batch[g]["problem"])):
                scores.append(correct[group == g].mean())
    return np.array(scores, np.float64)


def heldout_long_samples(run: Run, operands: np.ndarray) -> np.ndarray:
    """[long problems, samples] the final evaluation's sampled outcomes (1 for each of a problem's correct
    samples, first) on the long held-out problems: what pass@1 averages, pairable across arms."""
    final = [r for r in run.records if r.get("phase") == "eval"][-1]
    samples = int(final["sampled_samples"])
    correct = np.asarray(final["sampled_correct"])[[is_long(int(k)) for k in operands]]
    return (np.arange(samples)[None, :] < correct[:, None]).astype(np.float64)


def endpoint_arrays(cell: dict, run: Run, operands: np.ndarray) -> dict:
    """The three endpoints of one cell (`cell`: its record in summary.json, for the late mean)."""
    return {"long_first_quarter": long_first_quarter(run),
            "heldout_long_pass_at_1": heldout_long_samples(run, operands),
            "late_mean": np.array([np.nan if cell["late_mean"] is None else cell["late_mean"]])}


def contrasts(objectives: list[str]) -> list[tuple[str, str]]:
    """The primary contrasts (respo_vespo vs VESPO, respo_vespo vs its tail cut), then every other arm
    vs GRPO, among `objectives`."""
    pairs = [p for p in v3.PRIMARY_CONTRASTS if p[0] in objectives and p[1] in objectives]
    if "grpo" in objectives:
        pairs += [(o, "grpo") for o in objectives if o != "grpo" and (o, "grpo") not in pairs]
    return pairs


def paired_endpoints(cells: list[dict], runs: dict) -> list[dict]:
    """One row per (N, contrast, endpoint): the paired difference A - B, its bootstrap SE and 95% interval
    over the seeds both arms finished. `cells`: summary.json's cell records; `runs`: {name: Run}."""
    operands = heldout_operands(next(iter(runs.values())).config)
    by_key = {(c["reuse"], c["objective"], c["seed"]): c for c in cells}
    arrays = {key: endpoint_arrays(c, runs[c["name"]], operands) for key, c in by_key.items()}
    rows = []
    for reuse in sorted({c["reuse"] for c in cells}):
        objectives = list(dict.fromkeys(c["objective"] for c in cells if c["reuse"] == reuse))
        for a, b in contrasts(objectives):
            seeds = sorted({s for (n, o, s) in by_key if n == reuse and o == a} &
                           {s for (n, o, s) in by_key if n == reuse and o == b})
            for endpoint in ENDPOINTS:
                xa = [arrays[(reuse, a, s)][endpoint] for s in seeds]
                xb = [arrays[(reuse, b, s)][endpoint] for s in seeds]
                width = min(len(x) for x in xa + xb) if seeds else 0
                row = {"reuse": reuse, "a": a, "b": b, "endpoint": endpoint, "seeds": seeds, "units": width}
                finite = seeds and width and all(np.isfinite(x).all() for x in xa + xb)
                if finite:
                    diff = paired_cluster_bootstrap(np.stack([x[:width] for x in xa]),
                                                    np.stack([x[:width] for x in xb]),
                                                    num_resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
                    row.update(mean_a=float(np.mean([x[:width].mean() for x in xa])),
                               mean_b=float(np.mean([x[:width].mean() for x in xb])),
                               difference=diff.difference, se=diff.se, low=diff.low, high=diff.high)
                rows.append(row)
    return rows


ENDPOINT_NAMES = {"long_first_quarter": "Long-problem training score, first quarter",
                  "heldout_long_pass_at_1": "Held-out sampled pass@1, 12-16 operands",
                  "late_mean": "Late mean (training score)"}


def paired_markdown(rows: list[dict]) -> str:
    """One table per endpoint: A, B, N, seeds, the two means and A - B with its 95% paired interval (pp)."""
    lines = []
    for endpoint in ENDPOINTS:
        lines += [f"### {ENDPOINT_NAMES[endpoint]}", "",
                  "| A | B | N | Seeds | Units | A | B | A − B (pp) | 95% interval (pp) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["endpoint"] == endpoint):
            if "difference" not in r:
                lines.append(f"| {r['a']} | {r['b']} | {r['reuse']} | {len(r['seeds'])} | {r['units']} "
                             "| – | – | – | – |")
                continue
            lines.append(f"| {r['a']} | {r['b']} | {r['reuse']} | {len(r['seeds'])} | {r['units']} "
                         f"| {_pct(r['mean_a'])} | {_pct(r['mean_b'])} | {100 * r['difference']:+.2f} "
                         f"| [{100 * r['low']:+.2f}, {100 * r['high']:+.2f}] |")
        lines.append("")
    return "\n".join(lines)
