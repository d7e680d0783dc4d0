"""What staleness does: k ∈ {0, 1, 2, 4} rollout batches of lag (`rollout.async_steps`) × GRPO, GSPO,
VESPO and ReSPO × seeds on the default synthetic task at N = 4, and its report.

    python -m experiments.async_staleness                        # the grid, then its report
    python -m experiments.async_staleness --report-only          # re-report the finished cells
    python -m experiments.async_staleness --objectives grpo,respo --steps 0,2 --seeds 0 run.iterations=8

Every cell trains through the main trainer (`experiments.train.run_experiment`) from the config of
`--config` (default experiments/configs/async_staleness.py) with objective.name, rollout.async_steps
and run.seed set, into <runs-dir>/<objective>_k<k>_s<seed>; a cell whose summary.json exists is
finished and kept (its config.json must be the cell's config, else it is refused), so a killed grid
resumes at its first unfinished cell. The report reads the cells' metrics.jsonl and rollout files and
writes to --out-dir: results.jsonl (one line per cell), summary.md (the means over seeds per objective
and k) and async_staleness.png. Per cell: the log W quantiles (10/50/90%) of the responses trained on,
the share of positive-advantage responses with log W < -1, the mean clip fraction (objectives that
clip), the mean staleness and the training score (train_accuracy) over the last quarter of iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from experiments.cli import ArgumentParser, run_cli, run_failures
from respo_jax.eval.rollout_files import load_rollout_files
from respo_jax.runs import atomic_write_bytes
from respo_jax.training.config import ConfigError, apply_overrides

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "async_staleness.py")
GRID = {"objectives": ("grpo", "gspo", "vespo", "respo"), "steps": (0, 1, 2, 4), "seeds": (0, 1, 2)}
RESULTS, SUMMARY, FIGURE = "results.jsonl", "summary.md", "async_staleness.png"
LOW_LOG_W = -1.0  # the positives' tail the table counts: log W below this


def main(argv: list[str] | None = None) -> list[dict]:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("--objectives", default=",".join(GRID["objectives"]), help="comma-separated names")
    parser.add_argument("--steps", default=",".join(map(str, GRID["steps"])),
                        help="values of k, comma-separated")
    parser.add_argument("--seeds", default=",".join(map(str, GRID["seeds"])),
                        help="run seeds, comma-separated")
    parser.add_argument("--runs-dir", default="runs/async_staleness", help="where the cells train")
    parser.add_argument("--out-dir", default="experiments/results/async_staleness",
                        help="the report's folder")
    parser.add_argument("--report-only", action="store_true", help="report the finished cells, train none")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides of every cell")
    args = parser.parse_args(argv)
    from experiments.train import load_config

    base = apply_overrides(load_config(args.config), args.overrides)
    cells = [(name, int(k), int(seed)) for name in _items(args.objectives, "--objectives")
             for k in _items(args.steps, "--steps") for seed in _items(args.seeds, "--seeds")]
    configs = {cell: apply_overrides(base, [f"objective.name={cell[0]}", f"rollout.async_steps={cell[1]}",
                                            f"run.seed={cell[2]}",
                                            f"run.out_dir={_cell_dir(args.runs_dir, cell)}"])
               for cell in cells}  # every cell validated before the first trains
    for config in configs.values():
        config.validate()
    if not args.report_only:
        for cell, config in configs.items():
            _train_cell(config)
    return report(args.runs_dir, cells, args.out_dir)


def _items(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{flag}={text!r}: expected a comma-separated list")
    return items


def _cell_dir(runs_dir: str, cell: tuple) -> str:
    name, k, seed = cell
    return os.path.join(runs_dir, f"{name}_k{k}_s{seed}")


def _train_cell(config) -> None:
    """Trains one cell unless it is finished with this config (a finished cell of another config is
    refused)."""
    from experiments.train import run_experiment

    out, config = config.run.out_dir, apply_overrides(config, ["run.overwrite=true"])
    if os.path.isfile(os.path.join(out, "summary.json")):
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            stored = json.load(f)
        if stored != json.loads(json.dumps(config.to_dict())):
            raise ConfigError(f"{out}: a finished cell made with another config; move it or pick --runs-dir")
        return
    print(f"training {out}", file=sys.stderr, flush=True)
    run_experiment(config)


def cell_result(run: str, cell: tuple) -> dict:
    """One cell's numbers (the module docstring) from its run directory."""
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"), encoding="utf-8")]
    rl = [r for r in records if r["phase"] == "rl"]
    rollouts = load_rollout_files(run)
    log_w = np.concatenate([r["log_w"] for r in rollouts])
    advantage = np.concatenate([r["advantage"] for r in rollouts])
    positive = advantage > 0
    quarter = max(1, len(rl) // 4)
    clip = [r["clip_fraction"] for r in rl if "clip_fraction" in r]
    name, k, seed = cell
    return {
        "objective": name, "async_steps": k, "seed": seed, "iterations": len(rl),
        "staleness_mean": float(np.mean([r.get("staleness_mean", 0.0) for r in rl])),
        "log_w_p10": float(np.quantile(log_w, 0.1)), "log_w_p50": float(np.quantile(log_w, 0.5)),
        "log_w_p90": float(np.quantile(log_w, 0.9)),
        "positive_below_minus_1": float(np.mean(log_w[positive] < LOW_LOG_W)) if positive.any() else 0.0,
        "clip_fraction": float(np.mean(clip)) if clip else None,
        "train_score_last_quarter": float(np.mean([r["train_accuracy"] for r in rl[-quarter:]])),
    }


def report(runs_dir: str, cells: list[tuple], out_dir: str) -> list[dict]:
    """results.jsonl, summary.md and the figure of the finished cells; ConfigError when none is."""
    done = [cell for cell in cells if os.path.isfile(os.path.join(_cell_dir(runs_dir, cell), "summary.json"))]
    if not done:
        raise ConfigError(f"--runs-dir={runs_dir!r}: no finished cell to report")
    results = [cell_result(_cell_dir(runs_dir, cell), cell) for cell in done]
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_bytes(os.path.join(out_dir, RESULTS),
                       "".join(json.dumps(r, sort_keys=True) + "\n" for r in results).encode())
    atomic_write_bytes(os.path.join(out_dir, SUMMARY), summary_markdown(results).encode())
    figure(results, os.path.join(out_dir, FIGURE))
    print(f"report: {out_dir}/{{{RESULTS},{SUMMARY},{FIGURE}}} ({len(results)} of {len(cells)} cells)")
    return results


def means(results: list[dict]) -> dict[tuple[str, int], dict]:
    """{(objective, k): the mean of each number over the seeds, and "seeds"}."""
    grouped: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        grouped.setdefault((r["objective"], r["async_steps"]), []).append(r)
    out = {}
    for key, rows in grouped.items():
        row = {"seeds": len(rows)}
        for field in ("staleness_mean", "log_w_p10", "log_w_p50", "log_w_p90", "positive_below_minus_1",
                      "clip_fraction", "train_score_last_quarter"):
            values = [r[field] for r in rows if r[field] is not None]
            row[field] = float(np.mean(values)) if values else None
        out[key] = row
    return out


def summary_markdown(results: list[dict]) -> str:
    """The table of the means over seeds, one row per objective and k."""
    lines = ["| objective | k | seeds | staleness | log W p10 / p50 / p90 | positives with log W < −1 | "
             "clip fraction | training score (last quarter) |",
             "|---|---|---|---|---|---|---|---|"]
    for (name, k), row in sorted(means(results).items(), key=lambda item: (item[0][0], item[0][1])):
        clip = "—" if row["clip_fraction"] is None else f"{row['clip_fraction']:.4f}"
        lines.append(f"| {name} | {k} | {row['seeds']} | {row['staleness_mean']:.2f} | "
                     f"{row['log_w_p10']:+.3f} / {row['log_w_p50']:+.3f} / {row['log_w_p90']:+.3f} | "
                     f"{row['positive_below_minus_1']:.4f} | {clip} | "
                     f"{row['train_score_last_quarter']:.3f} |")
    return "\n".join(lines) + "\n"


def figure(results: list[dict], path: str) -> None:
    """Four panels against k, one line per objective (means over seeds): the log W median with its
    10–90% band, the positives below log W = −1, the clip fraction and the training score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = means(results)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [("log_w_p50", "log W (median, 10–90%)"),
              ("positive_below_minus_1", "positives with log W < −1"),
              ("clip_fraction", "clip fraction"),
              ("train_score_last_quarter", "training score, last quarter")]
    for name in sorted({key[0] for key in table}):
        steps = sorted(k for n, k in table if n == name)
        rows = [table[(name, k)] for k in steps]
        for ax, (field, title) in zip(axes, panels):
            values = [row[field] for row in rows]
            if any(v is None for v in values):
                continue
            line, = ax.plot(steps, values, marker="o", label=name)
            if field == "log_w_p50":
                ax.fill_between(steps, [r["log_w_p10"] for r in rows], [r["log_w_p90"] for r in rows],
                                color=line.get_color(), alpha=0.15)
            ax.set_title(title)
            ax.set_xlabel("k (rollout.async_steps)")
            ax.set_xticks(steps)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cli(argv: list[str]) -> int:
    return run_cli(main, argv, failures=run_failures())


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
