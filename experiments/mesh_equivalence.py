"""The same run on several device meshes: warm-up losses, first-iteration loss and gradient norm, and
where the parameters live, side by side (the sharded system's end-to-end check).

    python -m experiments.mesh_equivalence                       # toy_moe, 1 iteration, 3 meshes
    python -m experiments.mesh_equivalence --meshes 1,1,1,1 2,1,1,4 --out runs/mesh_equivalence

Each mesh (data,fsdp,tensor,expert) runs `python -m experiments.train --config <config>
run.iterations=1 mesh.data=… …` in its own process with XLA_FLAGS=--xla_force_host_platform_device_count
=<devices> (CPU devices simulated; on an accelerator host pass --devices 0 to use the real ones). Writes
`mesh_equivalence.json` and `.md` in --out: per mesh the warm-up losses, the first RL record's loss and
grad_norm, their largest relative difference to the first mesh, and param_bytes_max_per_device /
param_bytes_total from each run's run_info.json. A bad flag or mesh is one line and exit status 2
(before anything is written), a mesh whose training fails one line (its error) and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.cli import ArgumentParser, run_cli
from respo_jax import runs
from respo_jax.training.config import ConfigError

DEFAULT_MESHES = ("1,1,1,1", "2,1,1,4", "2,2,2,1")
AXES = ("data", "fsdp", "tensor", "expert")


def _records(run: str) -> list[dict]:
    return runs.read_jsonl(os.path.join(run, runs.METRICS_FILE)).records


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


class MeshRunError(RuntimeError):
    """The training run of one mesh failed (exit status 1); the message is one line."""


def parse_mesh(mesh: str) -> list[int]:
    """[data, fsdp, tensor, expert] of a `--meshes` entry such as "2,1,1,4" (-1: the remaining devices)."""
    try:
        sizes = [int(v) for v in mesh.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != 4 or any(v == 0 or v < -1 for v in sizes):
        raise ConfigError(f"--meshes: {mesh!r} is not data,fsdp,tensor,expert (four sizes >= 1, or -1)")
    return sizes


def run_mesh(mesh: str, config: str, out: str, devices: int, extra: list[str]) -> dict:
    sizes = parse_mesh(mesh)
    run = os.path.join(out, "mesh_" + "x".join(map(str, sizes)))
    env = dict(os.environ)
    if devices:
        flag = f"--xla_force_host_platform_device_count={devices}"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, "-m", "experiments.train", "--config", config, "run.iterations=1",
           f"run.out_dir={run}", "run.overwrite=true", "run.progress=false",
           *(f"mesh.{axis}={size}" for axis, size in zip(AXES, sizes)), *extra]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode:
        lines = result.stderr.strip().splitlines()
        reason = next((line for line in reversed(lines) if line.startswith("error: ")), None)
        reason = reason[len("error: "):] if reason else (lines[-1] if lines else "no output")
        error = ConfigError if result.returncode == 2 else MeshRunError  # 2: the run refused to start
        raise error(f"mesh {mesh} failed with exit status {result.returncode}: {reason} "
                    f"(command: {' '.join(cmd)})")
    records = _records(run)
    info = runs.read_json(os.path.join(run, runs.RUN_INFO_FILE))
    rl = next(r for r in records if r["phase"] == "rl")
    return {
        "mesh": dict(zip(AXES, sizes)),
        "warmup_losses": [r["sft_loss"] for r in records if r["phase"] == "warmup"],
        "loss": rl["loss"],
        "grad_norm": rl["grad_norm"],
        "score": rl["score"],
        "load_balancing_loss": rl.get("load_balancing_loss"),
        "param_bytes_total": info["param_bytes_total"],
        "param_bytes_max_per_device": info["param_bytes_max_per_device"],
        "param_fraction_max_per_device": info["param_bytes_max_per_device"] / info["param_bytes_total"],
        "devices": info["devices"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "toy_moe.py"))
    parser.add_argument("--meshes", nargs="+", default=list(DEFAULT_MESHES))
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (0: the real ones)")
    parser.add_argument("--out", default="runs/mesh_equivalence")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides for every run")
    args = parser.parse_args(argv)
    for mesh in args.meshes:  # every mesh checked before anything is written
        parse_mesh(mesh)
    if args.devices < 0:
        raise ConfigError(f"--devices {args.devices}: expected 0 (the real devices) or a number of CPU "
                          "devices")
    if not os.path.isfile(args.config):
        raise ConfigError(f"--config {args.config!r}: no such file")
    created = not os.path.isdir(args.out)
    os.makedirs(args.out, exist_ok=True)
    try:
        rows = [run_mesh(m, args.config, args.out, args.devices, args.overrides) for m in args.meshes]
    except ConfigError:  # a refused run wrote nothing: neither does this command
        if created and not os.listdir(args.out):
            os.rmdir(args.out)
        raise
    base = rows[0]
    for row in rows:
        diffs = [_rel(a, b) for a, b in zip(row["warmup_losses"], base["warmup_losses"])]
        row["max_rel_diff_warmup_loss"] = max(diffs) if diffs else 0.0
        row["rel_diff_loss"] = _rel(row["loss"], base["loss"])
        row["rel_diff_grad_norm"] = _rel(row["grad_norm"], base["grad_norm"])
    result = {"config": args.config, "overrides": args.overrides, "runs": rows}
    with open(os.path.join(args.out, "mesh_equivalence.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    lines = ["| mesh (data,fsdp,tensor,expert) | last warm-up loss | max rel. diff warm-up | loss | "
             "rel. diff | grad norm | rel. diff | params on one device |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {','.join(str(row['mesh'][a]) for a in AXES)} | {row['warmup_losses'][-1]:.6f} | "
            f"{row['max_rel_diff_warmup_loss']:.1e} | {row['loss']:.6g} | {row['rel_diff_loss']:.1e} | "
            f"{row['grad_norm']:.6g} | {row['rel_diff_grad_norm']:.1e} | "
            f"{100 * row['param_fraction_max_per_device']:.1f}% |")
    with open(os.path.join(args.out, "mesh_equivalence.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def cli(argv: list[str]) -> int:
    """`main` for the command line: exit status 2 on a bad flag, 1 when a mesh's run fails (one line)."""
    return run_cli(main, argv, failures=(MeshRunError,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
