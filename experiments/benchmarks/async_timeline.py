"""The timeline of asynchronous iterations from the device programs' own timestamps: when the rollout mesh
and the trainer's mesh are busy, and for how much of the trainer's busy time the rollout mesh is busy too.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.benchmarks.async_timeline
    python -m experiments.benchmarks.async_timeline --iterations 8 rollout.async_steps=2 \
        mesh.rollout_devices=4

Runs the warm-up and `--iterations` iterations of `--config` (default experiments/configs/respo_synthetic.py)
with rollout.async_steps=1 and a rollout mesh of its own (mesh.rollout_devices=1: on CPU, simulate two
devices as above) unless overridden, and records the iterations after the first `--skip` (they compile)
with `jax.profiler`. The trace's XLA execution events (those naming their `hlo_module`) carry the device
they ran on — the `device_ordinal` of a CPU thunk, the `/device:<kind>:<n>` process of an accelerator's
kernels — and their start and duration as the runtime recorded them; a device is busy while one of its
events runs, a mesh while one of its devices is. Writes to --out: timeline.json (per mesh: its devices,
its busy seconds, in all and per program, its busy intervals in seconds from the first event with idle
gaps under --gap closed; the seconds both meshes are busy, as a share of the trainer's busy seconds)
and timeline.png (each device's busy intervals). Timing: run it
on an otherwise idle machine and say what else ran.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import tempfile

from experiments.cli import ArgumentParser, run_cli
from respo_jax.runs import atomic_write_bytes
from respo_jax.training.config import ConfigError, apply_overrides

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "respo_synthetic.py")
DEVICE_PROCESS = re.compile(r"/device:[A-Za-z_]+:(\d+)")


def xla_events(trace: dict) -> list[tuple[int, str, float, float]]:
    """(device, program, start, end) of each XLA execution event of a Chrome-format trace (`traceEvents`;
    timestamps in µs, returned in seconds): the complete events ("X") whose args name an `hlo_module`,
    on the device of their `device_ordinal` arg, else of their process's `/device:<kind>:<n>` name."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process_device = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            found = DEVICE_PROCESS.search(str(e.get("args", {}).get("name", "")))
            if found:
                process_device[e["pid"]] = int(found.group(1))
    out = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_module" not in args:
            continue
        device = int(args["device_ordinal"]) if "device_ordinal" in args else process_device.get(e.get("pid"))
        if device is not None:
            start = float(e["ts"]) * 1e-6
            out.append((device, str(args["hlo_module"]), start, start + float(e.get("dur", 0.0)) * 1e-6))
    return out


def union(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def shared_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds two sorted disjoint interval lists (`union`) have in common."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def coarse(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """Sorted disjoint intervals with the gaps shorter than `gap` seconds closed (for a figure)."""
    out: list[tuple[float, float]] = []
    for start, end in intervals:
        if out and start - out[-1][1] < gap:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def timeline(events: list[tuple[int, str, float, float]], meshes: dict[str, set[int]],
             gap: float = 0.0) -> dict:
    """Per mesh (`meshes`: name -> its device ids; "trainer" and "rollout"): its devices, busy seconds,
    busy seconds per program, and busy intervals (seconds from the first event; gaps under `gap` seconds
    closed, for the figure); per device its intervals alike; the seconds both meshes are busy and that
    share of the trainer's busy seconds ("overlapped_fraction"). The seconds come from the exact unions."""
    origin = min(e[2] for e in events)

    def busy_of(devices, program=None) -> list[tuple[float, float]]:
        return union((s - origin, e - origin) for d, p, s, e in events
                     if d in devices and program in (None, p))

    def seconds(intervals) -> float:
        return sum(b - a for a, b in intervals)

    busy = {name: busy_of(devices) for name, devices in meshes.items()}
    programs = {name: {p: seconds(busy_of(devices, p))
                       for p in sorted({e[1] for e in events if e[0] in devices})}
                for name, devices in meshes.items()}
    both = shared_seconds(busy["trainer"], busy["rollout"])
    trainer_seconds = seconds(busy["trainer"])
    return {
        "meshes": {name: {"devices": sorted(meshes[name]), "busy_seconds": seconds(busy[name]),
                          "program_busy_seconds": programs[name], "busy": coarse(busy[name], gap)}
                   for name in meshes},
        "devices": {str(d): coarse(busy_of({d}), gap) for d in sorted({e[0] for e in events})},
        "span_seconds": max(e[3] for e in events) - origin,
        "both_busy_seconds": both,
        "overlapped_fraction": both / trainer_seconds if trainer_seconds else 0.0,
        "intervals_gap_closed_seconds": gap,
    }


def figure(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, device) for name, mesh in result["meshes"].items() for device in mesh["devices"]]
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.5 * len(rows)))
    colors = {"trainer": "tab:blue", "rollout": "tab:orange"}
    for y, (name, device) in enumerate(rows):
        spans = result["devices"].get(str(device), [])
        ax.broken_barh([(a, b - a) for a, b in spans], (y - 0.35, 0.7), color=colors.get(name, "gray"))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{name} device {device}" for name, device in rows])
    ax.set_xlabel("seconds (XLA execution events of the traced iterations)")
    ax.set_title(f"both meshes busy for {result['overlapped_fraction']:.0%} of the trainer's busy time",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_trace(directory: str) -> dict:
    """The Chrome-format trace `jax.profiler` wrote under `directory` (the newest)."""
    paths = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.trace.json.gz")))
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {directory}")
    with gzip.open(paths[-1]) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("--iterations", type=int, default=6, help="iterations to run")
    parser.add_argument("--skip", type=int, default=2, help="first iterations not traced (they compile)")
    parser.add_argument("--gap", type=float, default=5e-4,
                        help="idle gaps shorter than this (seconds) are closed in the stored intervals")
    parser.add_argument("--out", default="experiments/results/async_timeline", help="output folder")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    import jax

    from experiments.train import load_config
    from respo_jax.training.loop import RLTrainer

    config = apply_overrides(load_config(args.config), [
        "rollout.async_steps=1", "mesh.rollout_devices=1", *args.overrides,
        f"run.iterations={args.iterations}", "run.progress=false"]).validate()
    if not config.mesh.rollout_devices:
        raise ConfigError("mesh.rollout_devices=0: expected >= 1 (the timeline compares the busy time of "
                          "a rollout mesh and a trainer mesh on separate devices)")
    with RLTrainer(config) as trainer:
        for _ in trainer.warmup():
            pass
        for _ in range(args.skip):
            trainer.iteration()
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            for _ in range(config.num_iterations - args.skip):
                trainer.iteration()
            jax.profiler.stop_trace()
            trace = read_trace(trace_dir)
        meshes = {"trainer": {d.id for d in trainer.mesh.devices.flat},
                  "rollout": {d.id for d in trainer.rollout_mesh.devices.flat}}
    result = dict(timeline(xla_events(trace), meshes, gap=args.gap),
                  traced_iterations=config.num_iterations - args.skip,
                  async_steps=config.rollout.async_steps, rollout_devices=config.mesh.rollout_devices,
                  platform=jax.devices()[0].platform, overrides=args.overrides)
    os.makedirs(args.out, exist_ok=True)
    atomic_write_bytes(os.path.join(args.out, "timeline.json"), json.dumps(result, indent=1).encode())
    figure(result, os.path.join(args.out, "timeline.png"))
    print(f"trainer busy {result['meshes']['trainer']['busy_seconds']:.3f} s, rollout busy "
          f"{result['meshes']['rollout']['busy_seconds']:.3f} s, both {result['both_busy_seconds']:.3f} s "
          f"({result['overlapped_fraction']:.1%} of the trainer's) over {result['span_seconds']:.3f} s; "
          f"{args.out}/timeline.json, timeline.png")
    return result


def cli(argv: list[str]) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
