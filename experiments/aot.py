"""Compile every program of a training run for a TPU topology on this host (no TPU needed) and report,
per program and per chip, what it holds against the chip's HBM (`respo_jax.training.aot`).

    python -m experiments.aot --config experiments/configs/qwen3_1p7b_dapo.py model.preset=qwen3-1.7b \\
        --topology v5p:2x2x2 --mesh fsdp=8 --out experiments/results/aot/qwen3_1p7b_v5p_2x2x2
    python -m experiments.aot --topology v5e:2x2 rollout.max_tokens_per_microbatch=4096

The model is the config's `model.preset` (or `model.checkpoint_dir`'s config.json; no weight is read),
the run's mesh is built on the topology's chips (`--mesh` sets `mesh.*`: `fsdp=8,expert=8`), and each
program the run would compile (the engine's, log π_old and the update step of each prompt bucket, the
held-out evaluation's) is lowered from abstract values in the run's shardings and compiled by XLA:TPU.
Writes `aot.json` and `aot.md` in `--out`. A program that does not fit a chip's HBM is one line on
stderr naming it, what it needs and the knob to turn, with exit status 2 (the reports are written
first); a bad flag or config is one line with exit status 2 before anything is compiled or written.
Needs libtpu (`pip install "jax[tpu]"`, in the `test` extra).
"""

from __future__ import annotations

import argparse
import os
import sys

# Nothing runs here: JAX's backend is the CPU even on a TPU host (whose chips a run may hold), and libtpu
# is loaded only to compile for a topology, by as many such processes at once as there are (libtpu's
# lock file otherwise aborts the second one).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import experiments.signals_at_start  # noqa: F401  (first: a signal during the imports below stops cleanly)
from experiments.cli import ArgumentParser, load_config, run_cli
from respo_jax.runs import atomic_write_bytes, atomic_write_json
from respo_jax.training.config import ConfigError, apply_overrides

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "respo_synthetic.py")


def mesh_overrides(mesh: str | None) -> list[str]:
    """`--mesh fsdp=8,expert=8` as the overrides `mesh.fsdp=8 mesh.expert=8`."""
    if not mesh:
        return []
    items = [item.strip() for item in mesh.split(",") if item.strip()]
    if not all("=" in item for item in items):
        raise ConfigError(f"--mesh {mesh!r}: expected axis=size pairs separated by commas, e.g. fsdp=8,expert=8")
    return [f"mesh.{item}" for item in items]


def parse_buckets(text: str) -> list[int] | None:
    """`--prompt-buckets 512,1024` as [512, 1024]; "all": None (every bucket up to task.max_prompt_tokens)."""
    if text == "all":
        return None
    try:
        buckets = sorted({int(item) for item in text.split(",")})
    except ValueError:
        buckets = []
    if not buckets or buckets[0] < 1:
        raise ConfigError(f"--prompt-buckets {text!r}: expected 'all' or positive integers separated by commas")
    return buckets


def markdown(report: dict) -> str:
    """aot.md: the run's header and one table row per program."""
    gib = 2**30
    lines = [f"# AOT compile for {report['topology']} ({report['chips']} {report['chip']} chips, "
             f"{report['hbm_bytes_per_chip'] / gib:.2f} GiB HBM each)", "",
             f"mesh {report['mesh']}; batch split over {report['batch_shards']} chips; K/V pool "
             f"{(report['kv_cache_bytes'] or 0) / gib:.2f} GiB budget, "
             + (f"{report['kv_pool_bytes_per_chip'] / gib:.2f} GiB held per chip"
                if report["kv_pool_bytes_per_chip"] is not None else "not compiled")
             + f"; fits: **{'yes' if report['fits'] else 'no'}**"
             + ("" if report["complete"] else " (so far: not every program is compiled yet)"), "",
             "Bytes are per chip, from the compiler (`memory_analysis`); peak = arguments + outputs - aliased "
             "(donated) + temporaries + code. Collectives are the ops in the compiled HLO (one in a loop "
             "body counted once) with their result bytes. FLOPs are analytic (2 per weight a token multiplies "
             "by plus 4·layers·heads·head_dim per attended key; update step: 3 forwards, 4 with remat), "
             "over all chips; the bound is a lower bound on one call: max(FLOPs per chip / peak bf16 FLOP/s, "
             "bytes that must cross HBM per chip / HBM bandwidth), those bytes being the arguments and outputs "
             "once and, in a decode segment, the parameters again at every step after the first.", "",
             "| program | arguments GiB | outputs GiB | temps GiB | code MiB | peak GiB | fits | collectives "
             "(count, MiB) | analytic TFLOPs | bound ms |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for p in report["programs"]:
        coll = ", ".join(f"{op} ×{c['count']} ({c['bytes'] / 2**20:.1f})" for op, c in sorted(p["collectives"].items()))
        flops = "" if p["flops"] is None else f"{p['flops'] / 1e12:.2f}"
        bound = "" if p["bound_seconds"] is None else f"{p['bound_seconds'] * 1e3:.2f}"
        lines.append(f"| {p['program']} | {p['argument_bytes'] / gib:.3f} | {p['output_bytes'] / gib:.3f} | "
                     f"{p['temp_bytes'] / gib:.3f} | {p['code_bytes'] / 2**20:.1f} | "
                     f"{p['peak_bytes_per_chip'] / gib:.3f} | {'yes' if p['fits'] else 'no'} | {coll or '-'} | "
                     f"{flops} | {bound} |")
        if p.get("error"):
            lines.append(f"|  | compiler: {p['error']} | | | | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("--topology", required=True, help="a TPU topology, e.g. v5e:2x2, v5p:2x2x2, v6e:2x2")
    parser.add_argument("--mesh", default=None, help="mesh axis sizes, e.g. fsdp=8,expert=8 (mesh.* overrides)")
    parser.add_argument("--out", default=None, help="where aot.json and aot.md go (default aot/<topology>)")
    parser.add_argument("--prompt-buckets", default="all",
                        help="the prompt buckets to compile: 'all' (up to task.max_prompt_tokens) or e.g. 1024")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    buckets = parse_buckets(args.prompt_buckets)
    from respo_jax.tpu_chips import chip_of
    from respo_jax.training import aot

    config = apply_overrides(aot.without_data(load_config(args.config)),
                             [*mesh_overrides(args.mesh), *args.overrides])
    devices = aot.topology_devices(args.topology)
    try:
        chip = chip_of(devices[0].device_kind)
    except ValueError as err:
        raise ConfigError(f"--topology {args.topology!r}: {err}") from None
    run = aot.AbstractRun(config, devices)
    out = args.out or os.path.join("aot", args.topology.replace(":", "_"))
    os.makedirs(out, exist_ok=True)

    def write(reports: list, complete: bool = False) -> dict:  # after each program: a long compile's so far
        report = {**aot.aot_report(run, args.topology, reports), "complete": complete}
        atomic_write_json(os.path.join(out, "aot.json"), report)
        atomic_write_bytes(os.path.join(out, "aot.md"), markdown(report).encode())
        return report

    reports = aot.compile_run(run, chip, buckets, on_report=write)
    report = write(reports, complete=True)
    for p in reports:
        print(f"{p.program}: peak {p.peak_bytes_per_chip / 2**30:.3f} GiB a chip "
              f"({'fits' if p.fits else 'does not fit'})", file=sys.stderr)
    refused = next((p for p in reports if not p.fits), None)
    if refused is not None:
        raise ConfigError(aot.refusal_line(refused, chip, args.topology))
    return report


def cli(argv: list[str]) -> int:
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
