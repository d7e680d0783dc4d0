"""The timeline of asynchronous iterations: when the rollout devices and the trainer's devices are busy,
from the trainer's own timestamps, and how much of the updates the next batch's rollout overlaps.

    python -m experiments.benchmarks.async_timeline                      # k = 1, the default synthetic run
    python -m experiments.benchmarks.async_timeline --iterations 8 rollout.async_steps=2

Runs the warm-up and `--iterations` iterations of `--config` (default
experiments/configs/respo_synthetic.py) with rollout.async_steps=1 unless overridden, then writes to
--out: timeline.json (per iteration: the N updates' interval, the interval of each rollout job that
ran, the seconds of updates during which a rollout ran, in time.perf_counter() seconds from the first
iteration's start) and timeline.png (the last iterations as bars). The first iteration is left out of
the overlap: it compiles. The trainer's interval is the N updates alone (not the advantages or the
log π_old pass); a rollout job's is its generation and reward until its rows are on the host. Timing:
run it on an otherwise idle machine and say what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments.cli import ArgumentParser, run_cli
from respo_jax.runs import atomic_write_bytes
from respo_jax.training.config import apply_overrides

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "respo_synthetic.py")


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two intervals share."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def timeline(updates: list[tuple], rollouts: list[tuple]) -> dict:
    """Per iteration (updates: (iteration, start, end); rollouts: (job iteration, start, end)): the
    update interval, the rollout jobs, and the update seconds overlapped by a rollout; and the totals
    from the second iteration on."""
    origin = min([u[1] for u in updates] + [r[1] for r in rollouts])
    rows = []
    for iteration, start, end in updates:
        shared = sum(overlap((start, end), (r[1], r[2])) for r in rollouts)
        rows.append({"iteration": iteration, "update": [start - origin, end - origin],
                     "update_seconds": end - start, "overlapped_seconds": shared})
    jobs = [{"job": j, "rollout": [s - origin, e - origin], "rollout_seconds": e - s}
            for j, s, e in rollouts]
    later = rows[1:]
    total = sum(r["update_seconds"] for r in later)
    return {"iterations": rows, "rollout_jobs": jobs,
            "update_seconds_after_first": total,
            "overlapped_fraction_after_first": sum(r["overlapped_seconds"] for r in later) / total if total else 0.0}


def figure(result: dict, path: str, last: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["iterations"][-last:]
    start = rows[0]["update"][0]
    fig, ax = plt.subplots(figsize=(10, 2.4))
    for row in rows:
        a, b = row["update"]
        ax.broken_barh([(a, b - a)], (10, 8), color="tab:blue")
        ax.text(a, 19, f"updates {row['iteration']}", fontsize=7)
    for job in result["rollout_jobs"]:
        a, b = job["rollout"]
        if b >= start:
            ax.broken_barh([(a, b - a)], (0, 8), color="tab:orange")
            ax.text(a, -3, f"rollout {job['job']}", fontsize=7)
    ax.set_yticks([4, 14])
    ax.set_yticklabels(["rollout", "trainer"])
    ax.set_xlabel("seconds")
    ax.set_xlim(left=start - 0.05 * (rows[-1]["update"][1] - start))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("--iterations", type=int, default=6, help="iterations to run and record")
    parser.add_argument("--out", default="experiments/results/async_timeline", help="output folder")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    from experiments.train import load_config
    from respo_jax.training.loop import RLTrainer

    config = apply_overrides(load_config(args.config), ["rollout.async_steps=1", *args.overrides,
                                                         f"run.iterations={args.iterations}",
                                                         "run.progress=false"])
    trainer = RLTrainer(config)
    for _ in trainer.warmup():
        pass
    for _ in range(config.num_iterations):
        trainer.iteration()
    trainer.close()
    result = dict(timeline(trainer.update_timeline, trainer.async_rollouts.timeline),
                  async_steps=config.rollout.async_steps, rollout_devices=config.mesh.rollout_devices,
                  overrides=args.overrides)
    os.makedirs(args.out, exist_ok=True)
    atomic_write_bytes(os.path.join(args.out, "timeline.json"), json.dumps(result, indent=1).encode())
    figure(result, os.path.join(args.out, "timeline.png"))
    print(f"updates overlapped by a rollout after the first iteration: "
          f"{result['overlapped_fraction_after_first']:.1%}; {args.out}/timeline.json, timeline.png")
    return result


def cli(argv: list[str]) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
