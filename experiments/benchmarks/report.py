"""The benchmarks' results in the documentation, regenerated from the result files in `results/`.

    python -m experiments.benchmarks.report           # rewrites the generated blocks from results/*.json
    python -m experiments.benchmarks.report --check   # exit 1 if a generated block differs from the JSON

The RL race (`rl_iteration*.json`) and the rollout benchmark (`rollout_engine*.json`) write their JSON
and then call `regenerate()`, so the documentation's results are those files' and nothing else: the
race table file (`results/rl_iteration_table.md`), and the blocks between `<!-- generated: NAME -->`
and `<!-- end generated: NAME -->` in `experiments/benchmarks/README.md` and
`docs/results/benchmarks.md` (the rest of those pages is prose, not numbers of a run). A micro
pipeline check (`*_micro.json`) is never shown. The rollout block: one line per (shape, cap) case
(`speedup_vs_vllm`), then one per `decode_step_vs_pool` file (`cases[].step_ms_median` per pool multiple,
the kernel `impl`) and one per `decode_ragged` file (`cases.long_tail` / `cases.uniform`: per kernel
`step_ms_median`, and `gather_vs_ragged`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

from experiments.benchmarks.common import markdown_table
from experiments.cli import ArgumentParser, run_cli
from respo_jax.training.config import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
README = os.path.join(HERE, "README.md")
DOCS_PAGE = os.path.normpath(os.path.join(HERE, "..", "..", "docs", "results", "benchmarks.md"))
# What the issue asks of each headline: the race's speed-up (log π_old recomputed) per M and the
# continuous engine's useful tokens/s over vLLM's per (shape, cap).
RACE_TARGETS = {1: 5.0, 4: 7.0}
VLLM_TARGETS = {("race", 512): 2.0, ("race", 2048): 1.5}


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: {err}") from None


def result_files(pattern: str, results_dir: str = RESULTS) -> list[str]:
    """The result files `pattern` matches in `results_dir`, the stem without a suffix first, the rest by
    name; micro pipeline checks left out."""
    paths = [p for p in glob.glob(os.path.join(results_dir, pattern)) if not p.endswith("_micro.json")]
    return sorted(paths, key=lambda p: (os.path.basename(p) != pattern.replace("*", ""), os.path.basename(p)))


def _times(value) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def _number(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _target(value, target) -> str:
    """The issue's target for a headline and whether `value` meets it ("—": none for this row, e.g. a
    race whose respo-jax side did not recompute log π_old, which is not TRL's work)."""
    if target is None:
        return "—"
    if value is None:
        return f"≥ {target:g}× (not measured)"
    return f"≥ {target:g}× ({'met' if value >= target else 'missed'})"


def race_headline(payloads: list[tuple[str, dict]]) -> str:
    """One row per race case: where respo-jax took log π_old, the headline and sampler-mode speed-ups,
    the issue's target, peak RSS, the file."""
    from experiments.benchmarks.race_table import old_logprobs_of

    rows = []
    for name, payload in payloads:
        for r in payload["results"]:
            m = r["case"]["prompts_per_minibatch"]
            jax_side, trl_side = r.get("jax") or {}, r.get("trl") or {}
            same_work = bool(jax_side and trl_side) and old_logprobs_of(r) == "recompute"
            rows.append([f"M={m}", old_logprobs_of(r) if jax_side else "n/a", _times(r.get("speedup")),
                         _target(r.get("speedup"), RACE_TARGETS.get(m) if same_work else None),
                         _times(r.get("speedup_sampler_logprobs")),
                         f"{_number(jax_side.get('median_s'))} / {_number(trl_side.get('median_s'))}",
                         f"{_number(jax_side.get('peak_rss_mib'))} / {_number(trl_side.get('peak_rss_mib'))}",
                         f"`{name}`"])
    return markdown_table(["race case", "respo-jax log π_old", "speedup (TRL / respo-jax)", "target",
                           "speedup, sampler log-probs", "median s, respo-jax / TRL",
                           "peak RSS MiB, respo-jax / TRL", "file"], rows)


def rollout_cases(payloads: list[tuple[str, dict]]) -> str:
    """One row per rollout benchmark file: its shape and cap, each side's useful tokens/s, the
    continuous engine over vLLM (with the issue's target) and over the static schedule, peak RSS and
    peak KV bytes of the continuous engine and vLLM."""
    rows = []
    for name, r in payloads:
        shape, cap = r.get("shape", "race"), r["workload"]["max_new_tokens"]
        model = r["model"]
        sides = {k: r.get(k) or {} for k in ("continuous", "vllm", "static", "transformers")}

        def rate(kind):
            return _number(sides[kind].get("useful_tokens_per_s"))

        def mib(kind, key):
            value = sides[kind].get(key)
            return _number(None if value is None else value / 2**20 if key == "peak_kv_bytes" else value)

        vllm = ("skipped" if r.get("vllm_skipped") else _times(r.get("speedup_vs_vllm")))
        rows.append([f"{shape} (hidden {model['hidden_size']:,}, {model['num_hidden_layers']} layers)", cap,
                     r["workload"]["rows"], rate("continuous"), rate("vllm"), vllm,
                     _target(r.get("speedup_vs_vllm"), VLLM_TARGETS.get((shape, cap))), rate("static"),
                     _times(r.get("speedup_vs_static")), _times(r.get("speedup_vs_transformers")),
                     f"{mib('continuous', 'peak_rss_mb')} / {mib('vllm', 'peak_rss_mb')}",
                     f"{mib('continuous', 'peak_kv_bytes')} / {mib('vllm', 'peak_kv_bytes')}", f"`{name}`"])
    return markdown_table(["model", "cap", "rows", "continuous tokens/s", "vLLM tokens/s", "speedup_vs_vllm",
                           "target", "static tokens/s", "speedup_vs_static", "speedup_vs_transformers",
                           "peak RSS MiB, continuous / vLLM", "peak KV MiB, continuous / vLLM", "file"], rows)


def _runs(payloads: list[tuple[str, dict]]) -> str:
    """Each file's command, wall time where recorded and load averages."""
    lines = []
    for name, p in payloads:
        wall = f"{p['wall_s']:,.0f} s, " if "wall_s" in p else ""
        load = p.get("load_average_1_5_15") or (p.get("environment") or {}).get("load_average_1_5_15")
        load_text = f"load average after it {load}" if load else "load not recorded"
        lines.append(f"- `{name}`: `{p['command']}` ({wall}{load_text})")
    return "\n".join(lines)


def blocks(results_dir: str = RESULTS) -> dict[str, str]:
    """The generated blocks' text, by name, from the result files in `results_dir`."""
    race = [(os.path.basename(p), _load(p)) for p in result_files("rl_iteration*.json", results_dir)]
    files = [(os.path.basename(p), _load(p)) for p in result_files("rollout_engine*.json", results_dir)]
    rollout = [(name, p) for name, p in files if "decode_step_vs_pool" not in p and "decode_ragged" not in p]
    race_text = race_headline(race) + "\n\n" + _runs(race) if race else "No race result files."
    rollout_text = rollout_cases(rollout) + "\n\n" + _runs(rollout) if rollout else "No rollout result files."
    pools = [(name, p["decode_step_vs_pool"]) for name, p in files if "decode_step_vs_pool" in p]
    if pools:
        rollout_text += "\n\n" + decode_vs_pool(pools)
    ragged = [(name, p["decode_ragged"]) for name, p in files if "decode_ragged" in p]
    if ragged:
        rollout_text += "\n\n" + decode_per_kernel(ragged)
    return {"race": race_text, "rollout": rollout_text}


def decode_vs_pool(payloads: list[tuple[str, dict]]) -> str:
    """One line per decode-vs-pool file: the median decode step at each pool size (the same live tokens
    and slots), which stays flat when attention reads only the live pages."""
    lines = []
    for name, d in payloads:
        steps = ", ".join(f"×{c['multiple']} ({c['pool_bytes'] / 2**20:,.0f} MiB): {c['step_ms_median']:.1f} ms"
                          for c in d["cases"])
        kernel = f" ({d['impl']})" if "impl" in d else ""  # files before the field: gather
        lines.append(f"- Decode step against the pool's size{kernel}, {d['live_tokens']} live tokens in each "
                     f"of {d['slots']} slots: {steps} (`{name}`: `{d['command']}`)")
    return "\n".join(lines)


def decode_per_kernel(payloads: list[tuple[str, dict]]) -> str:
    """One line per decode-per-kernel file (`rollout_engine --decode-ragged`): each kernel's median
    decode step at long-tailed lengths (one long slot, the rest short) and at uniform ones, and the
    quotient gather / ragged."""
    lines = []
    for name, d in payloads:
        cases = "; ".join(
            f"{label}: gather {c['gather']['step_ms_median']:.1f} ms, ragged "
            f"{c['ragged']['step_ms_median']:.1f} ms ({c['gather_vs_ragged']:.2f}×)"
            for label, c in (
                (f"one slot at {d['long_tokens']:,} tokens, the rest at {d['short_tokens'][0]}-"
                 f"{d['short_tokens'][1]}", d["cases"]["long_tail"]),
                (f"every slot at {d['uniform_tokens']:,}", d["cases"]["uniform"])))
        lines.append(f"- Decode step per attention kernel, {d['slots']} slots: {cases} (`{name}`: "
                     f"`{d['command']}`)")
    return "\n".join(lines)


BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated: \2 -->)", re.S)


def render(text: str, generated: dict[str, str]) -> str:
    """`text` with every generated block's body replaced by `generated[name]` (from `report`; do not
    edit it). ConfigError for a block whose name `generated` lacks."""
    def body(match):
        name = match.group(2)
        if name not in generated:
            raise ConfigError(f"unknown generated block {name!r}")
        return f"{match.group(1)}\n{generated[name]}\n\n{match.group(4)}"

    return BLOCK.sub(body, text)


def targets(results_dir: str = RESULTS) -> dict[str, str]:
    """Every file this step writes and its regenerated text."""
    from experiments.benchmarks import race_table

    generated = blocks(results_dir)
    out = {}
    for page in (README, DOCS_PAGE):
        with open(page, encoding="utf-8") as f:
            out[page] = render(f.read(), generated)
    race = result_files("rl_iteration*.json", results_dir)
    if race:
        table = os.path.join(results_dir, os.path.basename(race_table.TABLE_FILE))
        out[table] = race_table.table_block([(os.path.basename(p), _load(p)) for p in race])
    return out


def regenerate(results_dir: str = RESULTS) -> list[str]:
    """Rewrites the files `targets` names whose text changed; returns their paths."""
    from respo_jax.runs import atomic_write_bytes

    changed = []
    for path, text in targets(results_dir).items():
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if old != text:
            atomic_write_bytes(path, text.encode("utf-8"))
            changed.append(path)
    return changed


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m experiments.benchmarks.report",
                            description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file would change")
    args = parser.parse_args(argv)
    if args.check:
        stale = [p for p, text in targets().items()
                 if not os.path.exists(p) or open(p, encoding="utf-8").read() != text]
        print("stale: " + ", ".join(stale) if stale else "the generated results match results/*.json")
        return 1 if stale else 0
    changed = regenerate()
    print("rewrote " + ", ".join(changed) if changed else "nothing changed")
    return 0


if __name__ == "__main__":  # a bad flag: one line, exit status 2 (experiments.cli)
    sys.exit(run_cli(main, sys.argv[1:]))
