"""The relaunch figure: how much slower a relaunched run's first iteration is than its median, with the
persistent compilation cache alone and with the traced programs kept beside it (`run.export_programs`).

    python -m experiments.benchmarks.relaunch                          # 1 device and 8 simulated ones
    python -m experiments.benchmarks.relaunch --iterations 3 --devices 1 warmup.steps=2   # a quick check

For each device count (`--devices`; more than one is a simulated CPU mesh, `mesh.data` = the count) and
each mechanism (`cache`: run.export_programs=false; `exported`: true), the default run (`--config`, with
the overrides given) is launched twice, each in a fresh process, on one compilation cache created empty
for the case: the first launch fills it, the second is the relaunch. Per launch, from its metrics.jsonl:
every RL iteration's `iteration_seconds`, the first one, their median and first / median (the figure:
at most 1.5 is a relaunch as fast as a warm run), the first iteration's compiles and cache hits, and the
launch's wall seconds (start-up and warm-up included); `exported_entries` is the number of programs the
first launch kept (0 where exported programs do not apply: several devices). Writes the JSON to --out.
Timing: run it on an otherwise idle machine and say what else ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from experiments.cli import ArgumentParser, run_cli
from respo_jax.exported_programs import EXPORTED_DIR
from respo_jax.runs import atomic_write_bytes

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "respo_synthetic.py")
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "relaunch.json")
MECHANISMS = {"cache": "false", "exported": "true"}  # run.export_programs


def launch(config: str, overrides: list[str], devices: int, out_dir: str, cache: str, export: str) -> dict:
    """One run of `experiments.train` in a fresh process; its RL iterations' timings (module docstring)."""
    env = dict(os.environ)
    if devices > 1:  # a simulated mesh of CPU devices
        flag = f"--xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "experiments.train", "--config", config, *overrides,
               f"run.out_dir={out_dir}", f"run.compilation_cache_dir={cache}",
               f"run.export_programs={export}", "run.progress=false", f"mesh.data={devices}"]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        tail = result.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {tail[0]}")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        records = [r for r in map(json.loads, handle) if r.get("phase") == "rl"]
    seconds = [float(r["iteration_seconds"]) for r in records]
    median = statistics.median(seconds)
    return {"iteration_seconds": seconds, "first": seconds[0], "median": median,
            "first_over_median": seconds[0] / median, "first_compiles": records[0]["compiles"],
            "first_cache_hits": records[0]["compile_cache_hits"], "wall_seconds": wall}


def run(config: str, overrides: list[str], device_counts: list[int], out: str) -> dict:
    """Every case's two launches (module docstring); the result, also written to `out` as JSON."""
    cases = []
    with tempfile.TemporaryDirectory(prefix="relaunch_") as scratch:
        for devices in device_counts:
            for mechanism, export in MECHANISMS.items():
                case = os.path.join(scratch, f"{devices}_{mechanism}")
                cache = os.path.join(case, "cache")
                first = launch(config, overrides, devices, os.path.join(case, "first"), cache, export)
                exported = os.path.join(cache, EXPORTED_DIR)
                entries = len(os.listdir(exported)) if os.path.isdir(exported) else 0
                second = launch(config, overrides, devices, os.path.join(case, "second"), cache, export)
                cases.append({"devices": devices, "mechanism": mechanism, "exported_entries": entries,
                              "first_launch": first, "relaunch": second})
                print(f"{devices} device(s), {mechanism}: relaunch first/median "
                      f"{second['first_over_median']:.2f} ({entries} exported programs)", file=sys.stderr)
    result = {"config": os.path.relpath(config), "overrides": overrides, "cases": cases}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_write_bytes(out, (json.dumps(result, indent=1) + "\n").encode())
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the run's config file")
    parser.add_argument("--iterations", type=int, default=6, help="RL iterations per launch (>= 2)")
    parser.add_argument("--devices", default="1,8", help="comma-separated device counts (>1: simulated CPU)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the JSON goes")
    parser.add_argument("overrides", nargs="*", help="section.field=value for both launches")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices={args.devices!r}: expected comma-separated integers")
    if args.iterations < 2 or not counts or min(counts) < 1:
        parser.error("--iterations must be >= 2 and every --devices count >= 1")
    return run(args.config, [f"run.iterations={args.iterations}", *args.overrides], counts, args.out)


def cli(argv: list[str]) -> int:
    return run_cli(main, argv, failures=(RuntimeError,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
