"""Runs the benchmark suite and writes JSON + markdown (+ PNG) into the output directory.

    python -m experiments.benchmarks --quick            # < 5 min on 2 cores: quick.json / quick.md
    python -m experiments.benchmarks                    # everything (~20 min): full.json / .md / full_scaling.png
    python -m experiments.benchmarks --parts moe        # one part of the full run: full_moe.json / .md / full_moe_scaling.png
    python -m experiments.benchmarks --accelerator      # GPU/TPU: Qwen3-1.7B bf16 MFU + decode bandwidth
    python -m experiments.benchmarks.rl_iteration       # end-to-end RL iterations vs TRL (its own module)
    python -m experiments.benchmarks.rollout_engine     # static vs continuous engine vs transformers (its own module)

On a machine whose default JAX backend is a GPU or TPU the accelerator mode runs by default (the PyTorch
comparisons need both frameworks on the same CPU; force them there with JAX_PLATFORMS=cpu).
`--micro` swaps every model for a few-thousand-parameter one so the whole pipeline runs in seconds
(the smoke test uses it; its numbers mean nothing).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback

from experiments.cli import ArgumentParser, run_cli

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

PARTS = ("matmul_peak", "train_step", "objective_cost", "decode", "scaling", "moe")

# The headline keys, in the order the summary table shows them.
HEADLINE_KEYS = ("train_step_speedup", "train_step_speedup_tiny", "mfu", "decode_speedup_b1",
                 "decode_speedup_b32",
                 "objective_fraction")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one mode measures and how hard (rounds are A/B pairs after `warmup` untimed calls)."""

    name: str
    matmul_sizes: tuple[int, ...]
    matmul_rounds: int
    train: tuple[tuple[str, str, int, int], ...]  # (result key, case name, rounds, warmup)
    train_sides: tuple[str, ...]  # train_step.SIDES keys, alternated in every train-step case
    torch_compile: bool
    decode_config: object  # a decode_vs_transformers preset name or a Qwen3Config
    decode_batches: tuple[int, ...]
    decode_new_tokens: int
    decode_repeats: int
    objective_in_step: bool
    scaling: bool


def _plans():
    from experiments.benchmarks import matmul_peak, train_step

    return {
        "quick": Plan("quick", matmul_peak.QUICK_SIZES, 5, (("tiny", "tiny", 5, 2), ("small", "small", 2, 1)),
                      train_sides=("jax", "torch_eager", "torch_eager_glibc"),
                      torch_compile=False, decode_config="small", decode_batches=(1, 32), decode_new_tokens=32,
                      decode_repeats=2, objective_in_step=False, scaling=False),
        "full": Plan("full", matmul_peak.FULL_SIZES, 5,
                     (("tiny", "tiny", 10, 2), ("small", "small", 5, 1), ("small-moe", "small-moe", 3, 1)),
                     # PyTorch with glibc's defaults is in the quick plan; with torch.compile on top, the
                     # processes of the small case (each keeping its step's buffers) ran out of 24 GB.
                     train_sides=("jax", "torch_eager"), torch_compile=True, decode_config="small",
                     decode_batches=(1, 8, 32), decode_new_tokens=64,
                     decode_repeats=5, objective_in_step=True, scaling=True),
        "micro": Plan("micro", (128,), 2, (("tiny", "micro", 2, 1), ("small", "micro", 2, 1)),
                      train_sides=("jax", "torch_eager"), torch_compile=False,
                      decode_config=train_step.CASES["micro"].config, decode_batches=(1, 32),
                      decode_new_tokens=4, decode_repeats=1, objective_in_step=False, scaling=False),
    }


def run_cpu(plan: Plan, out_dir: str, command: str, parts: tuple[str, ...] = ()) -> dict:
    """The side-by-side suite on CPU; returns the report (also written to `{plan.name}.json/.md`, or
    `{plan.name}_{parts}.json/.md` when only some `parts` run)."""
    from experiments.benchmarks import common, matmul_peak, objective_cost, scaling, train_step

    started = time.perf_counter()
    threads = common.configure_threads()
    report: dict = {"mode": plan.name, "command": command, "threads": threads, "errors": {}}
    headline: dict = {}
    sections: list[tuple[str, str]] = []

    def part(name, fn):
        part_start = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 (a broken part is reported; the other parts still run)
            report["errors"][name] = traceback.format_exc(limit=8)
            print(f"[benchmarks] {name} FAILED:\n{report['errors'][name]}", file=sys.stderr, flush=True)
        print(f"[benchmarks] {name}: {time.perf_counter() - part_start:.1f} s", file=sys.stderr, flush=True)

    def matmul():
        result = matmul_peak.run(plan.matmul_sizes, rounds=plan.matmul_rounds)
        report["matmul_peak"] = result
        headline["xla_matmul_peak_gflops"] = result["xla_matmul_peak_gflops"]
        headline["numpy_matmul_peak_gflops"] = result["numpy_matmul_peak_gflops"]
        sections.append(("Matmul peak", matmul_peak.markdown(result)))

    def train():
        peak = headline.get("xla_matmul_peak_gflops")
        results = report.setdefault("train_step", {})
        by_case: dict[str, dict] = {}
        probed = {case for key, case, _, _ in plan.train if key == "small"}  # MFU is reported for `small`
        for key, case, rounds, warmup in plan.train:
            if case not in by_case:  # (micro runs one case for both slots)
                by_case[case] = train_step.run(case, rounds=rounds, warmup=warmup, sides=plan.train_sides,
                                               torch_compile=plan.torch_compile, peak_gflops=peak,
                                               probe_peak=case in probed)
            results[key] = by_case[case]
            print(f"[benchmarks]   train {key}: speedup {results[key]['speedup_vs_torch_eager']:.2f}",
                  file=sys.stderr, flush=True)
        headline["train_step_speedup"] = results["small"]["speedup_vs_torch_eager"]
        headline["train_step_speedup_tiny"] = results["tiny"]["speedup_vs_torch_eager"]
        for kind in plan.train_sides:  # e.g. train_step_speedup_tiny_vs_torch_eager_glibc
            if kind not in ("jax", "torch_eager"):
                headline[f"train_step_speedup_vs_{kind}"] = results["small"][f"speedup_vs_{kind}"]
                headline[f"train_step_speedup_tiny_vs_{kind}"] = results["tiny"][f"speedup_vs_{kind}"]
        headline["train_tokens_per_s"] = results["small"]["jax"]["tokens_per_s"]
        headline["train_tokens_per_s_torch_eager"] = results["small"]["torch_eager"]["tokens_per_s"]
        headline["mfu"] = results["small"]["mfu"]
        headline["mfu_paired"] = results["small"]["mfu_paired"]
        headline["mfu_torch_eager"] = results["small"]["mfu_torch_eager"]
        headline["mfu_cpu_time"] = results["small"]["mfu_cpu_time"]
        headline["xla_matmul_probe_gflops"] = results["small"]["matmul_probe"]["gflops"]
        sections.append(("Train step (forward + ReSPO + backward + AdamW)", train_step.markdown(list(results.values()))))

    def objective():
        small = report["train_step"]["small"]
        result = objective_cost.run(small["case"], small["jax"]["median_s"], with_in_step=plan.objective_in_step)
        report["objective_cost"] = result
        headline["objective_fraction"] = result["objective_fraction"]
        text = (f"ReSPO objective value + gradient: {1e6 * result['objective_seconds']:.0f} µs; train step "
                f"{result['step_seconds']:.2f} s; fraction {result['objective_fraction']:.2e}.")
        if "in_step" in result:
            text += (f" In-step A/B (ReSPO vs bare NLL step): fraction {result['in_step']['fraction']:+.3f}, "
                     f"time ratio {result['in_step']['ratio_respo_over_nll']:.3f} (noise level).")
        sections.append(("Objective cost", text))

    def decode():
        from experiments.benchmarks import decode_vs_transformers

        result = decode_vs_transformers.run(plan.decode_config, plan.decode_batches,
                                            max_new_tokens=plan.decode_new_tokens, repeats=plan.decode_repeats)
        report["decode"] = result
        for row in result["results"]:
            headline[f"decode_speedup_b{row['batch']}"] = row["speedup"]
            headline[f"decode_tokens_per_s_b{row['batch']}"] = row["jax_tokens_per_s"]
            headline[f"decode_tokens_per_s_b{row['batch']}_transformers"] = row["hf_tokens_per_s"]
        text = decode_vs_transformers.to_markdown(result)
        sections.append(("Decode (sampler vs transformers.generate)", text.replace("# ", "### ", 1)))

    def scale():
        result = scaling.run("small")
        report["scaling"] = result
        sections.append(("Scaling", scaling.markdown(result)))

    def moe():
        report["moe"] = scaling.run_moe()
        sections.append(("MoE expert block, forward + backward: ragged_dot vs tiled vs dense all-experts",
                         scaling.moe_markdown(report["moe"])))

    wanted = set(parts) if parts else None
    runs = [("matmul_peak", matmul), ("train_step", train), ("objective_cost", objective), ("decode", decode)]
    if plan.scaling or (wanted and wanted & {"scaling", "moe"}):
        runs += [("scaling", scale), ("moe", moe)]
    for name, fn in runs:
        if wanted is not None and name not in wanted:
            continue
        if name == "objective_cost" and "small" not in report.get("train_step", {}):
            report["errors"][name] = "needs the small train step (part train_step)"
            continue
        part(name, fn)
    stem = plan.name + ("_" + "_".join(parts) if parts else "")
    if "scaling" in report or "moe" in report:
        scaling.plot(report.get("scaling"), report.get("moe"), os.path.join(out_dir, f"{stem}_scaling.png"))
        sections.append(("Scaling plot", f"![scaling]({stem}_scaling.png)"))

    report["headline"] = headline
    report["peak_rss_mib"] = common.peak_rss_mib()
    report["environment"] = common.environment()
    report["wall_s"] = time.perf_counter() - started
    # quick.json carries the headline keys at top level, the details below them.
    payload = {**headline, **report}
    common.write_json(os.path.join(out_dir, f"{stem}.json"), payload)
    summary = common.markdown_table(
        ["metric", "value"], [[k, headline[k]] for k in HEADLINE_KEYS if k in headline])
    common.write_markdown(
        os.path.join(out_dir, f"{stem}.md"), f"respo-jax benchmarks ({plan.name})",
        [("Command", f"`{command}` — {report['wall_s']:.0f} s, peak RSS {report['peak_rss_mib']:.0f} MiB, "
                     f"environment {report['environment']}"), ("Headline", summary)] + sections
        + ([("Errors", "\n".join(f"- {k}: {v.strip().splitlines()[-1]}" for k, v in report["errors"].items()))]
           if report["errors"] else []))
    return payload


def run_accelerator(out_dir: str, command: str, preset: str, batch: int, seq: int, remat: bool,
                    decode_new_tokens: tuple[int, int], matmul_sizes: tuple[int, ...] | None) -> dict:
    from experiments.benchmarks import accelerator, common, matmul_peak

    kwargs = dict(preset=preset, batch=batch, seq=seq, remat=remat, new_tokens=decode_new_tokens,
                  matmul_sizes=matmul_sizes or matmul_peak.ACCELERATOR_SIZES)
    if preset in ("tiny", "tiny-moe"):  # CPU check of the code path: small enough to run anywhere
        kwargs.update(dtype="float32", prompt_len=8, bandwidth_mb=16, rounds=1, decode_batches=(1, 2))
    result = accelerator.run(**kwargs)
    result["command"] = command
    result["peak_rss_mib"] = common.peak_rss_mib()
    result["environment"] = common.environment()
    common.write_json(os.path.join(out_dir, "accelerator.json"), result)
    common.write_markdown(os.path.join(out_dir, "accelerator.md"), "respo-jax accelerator benchmarks",
                          [("Command", f"`{command}`"), ("Results", accelerator.markdown(result))])
    return result


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m experiments.benchmarks", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the < 5 min subset; writes quick.json")
    mode.add_argument("--micro", action="store_true", help="pipeline check on a micro model; writes micro.json")
    mode.add_argument("--accelerator", action="store_true", help="GPU/TPU mode (default when JAX has one)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=(),
                        help="run only these parts (output files get the part names appended)")
    parser.add_argument("--preset", default="qwen3-1.7b", help="accelerator mode: model preset")
    parser.add_argument("--batch", type=int, default=8, help="accelerator mode: train batch")
    parser.add_argument("--seq", type=int, default=2048, help="accelerator mode: train sequence length")
    parser.add_argument("--remat", action="store_true", help="accelerator mode: rematerialize layers")
    parser.add_argument("--decode-new-tokens", type=int, nargs=2, default=(64, 320),
                        help="accelerator mode: the two generate lengths whose difference times decode")
    parser.add_argument("--matmul-sizes", type=int, nargs="+", default=None, help="accelerator mode: matmul sizes")
    args = parser.parse_args(argv)
    command = "python -m experiments.benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])

    from respo_jax.host_allocator import configure_host_allocator

    configure_host_allocator()  # before JAX starts its threads: see respo_jax/host_allocator.py

    import jax

    os.makedirs(args.out, exist_ok=True)
    if args.accelerator or (jax.default_backend() != "cpu" and not args.micro):
        run_accelerator(args.out, command.strip(), args.preset, args.batch, args.seq, args.remat,
                        tuple(args.decode_new_tokens), tuple(args.matmul_sizes) if args.matmul_sizes else None)
        return 0
    plan = _plans()["quick" if args.quick else "micro" if args.micro else "full"]
    report = run_cpu(plan, args.out, command.strip(), tuple(args.parts))
    for key in HEADLINE_KEYS:
        if key in report:
            print(f"{key:28s} {report[key]:.4g}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":  # a bad flag: one line, exit status 2 (experiments.cli)
    sys.exit(run_cli(main, sys.argv[1:]))
