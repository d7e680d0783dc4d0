"""The RL race's table: one markdown row per case from the race's JSON records, and the race table file
(`results/rl_iteration_table.md`) the documentation includes. Read by the race (`rl_iteration`) after a
run and by the benchmarks' report step (`report`), so that neither imports the other's module."""

from __future__ import annotations

import json
import os

from respo_jax.training.config import ConfigError

THREADS = 2  # threads per side (PyTorch's and XLA's intra-op pools)

# The race table's own file, generated from the race result files (`--table`) and included by the
# documentation's benchmark page; nothing else writes it.
TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rl_iteration_table.md")
TABLE_COLUMNS = ("case", "respo-jax log π_old", "respo-jax 1st iteration, cold cache (s)",
                 "respo-jax 1st iteration, 2nd launch (s)", "respo-jax median (s)", "TRL 1st iteration (s)",
                 "TRL 1st iteration, 2nd launch (s)", "TRL median (s)", "speedup (TRL / respo-jax)",
                 "respo-jax, sampler log-probs: median (s)", "speedup, sampler log-probs",
                 "respo-jax 2nd-launch 1st / median", "respo-jax cold 1st / TRL 1st",
                 "peak RSS MiB, respo-jax / sampler log-probs / TRL")


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def _second_launch_cell(side: dict) -> str:
    launch = side.get("second_launch") or {}
    if "compiles" not in launch:
        return _number(side.get("second_launch_first_s"))
    return (f"{_number(side['second_launch_first_s'])} ({launch['compile_cache_hits']} of {launch['compiles']} "
            "programs from the cache)")


def old_logprobs_of(result: dict) -> str:
    """Where the `jax` side of a race record took log π_old: "recompute" or "sampler" (records written
    before the side named it ran `rollout.old_logprobs=auto`, the sampler's on this float32 model, unless
    `--jax-set` asked for a recomputation)."""
    side = result.get("jax") or {}
    if "old_logprobs" in side:
        return side["old_logprobs"]
    asked = "rollout.old_logprobs=recompute" in result["case"].get("jax_overrides", ())
    return "recompute" if asked else "sampler (auto)"


def race_table(results: list[dict]) -> str:
    """The race as one markdown table, a row per case, from the JSON records (`summary`); a value the
    record lacks (a side or a launch that did not run) is "n/a"."""
    from experiments.benchmarks.common import markdown_table

    rows = []
    for r in results:
        c, jax_side, trl_side = r["case"], r.get("jax") or {}, r.get("trl") or {}
        sampler_side = r.get("jax_sampler") or {}
        rss = " / ".join(_number(side.get("peak_rss_mib")) for side in (jax_side, sampler_side, trl_side))
        rows.append([f"M={c['prompts_per_minibatch']}, G={c['group_size']}, N={c['reuse']}",
                     old_logprobs_of(r) if jax_side else "n/a",
                     _number(jax_side.get("first_s")), _second_launch_cell(jax_side), _number(jax_side.get("median_s")),
                     _number(trl_side.get("first_s")), _number(trl_side.get("second_launch_first_s")),
                     _number(trl_side.get("median_s")), _times(r.get("speedup")),
                     _number(sampler_side.get("median_s")), _times(r.get("speedup_sampler_logprobs")),
                     _times(r.get("second_launch_vs_median")), _times(r.get("cold_first_vs_trl_first")), rss])
    return markdown_table(TABLE_COLUMNS, rows)


def _sides_text(results: list[dict]) -> str:
    version = next((r["trl_version"] for r in results if r.get("trl_version")), None)
    return f"TRL {version}, {THREADS} threads per side" if version else f"respo-jax only, {THREADS} threads"


def _median_text(results: list[dict]) -> str:
    texts = []
    for r in results:
        n = r["case"]["iterations"]
        text = f"medians over iterations 2…{n}" if n > 1 else "one iteration (no median)"
        texts += [] if text in texts else [text]
    if len(texts) == 1:
        return texts[0]
    return ", ".join(f"M={r['case']['prompts_per_minibatch']}: "
                     + (f"medians over iterations 2…{r['case']['iterations']}" if r["case"]["iterations"] > 1
                        else "one iteration (no median)") for r in results)


def run_description(payload: dict) -> str:
    """What one result file measured: its command, wall time, sides and iterations."""
    results = payload["results"]
    return (f"`{payload['command']}` ({payload['wall_s']:,.0f} s; {_sides_text(results)}; "
            f"{_median_text(results)})")


def table_block(sources: list[tuple[str, dict]]) -> str:
    """The race table file's text: the table of every result file's cases, then each file's name and
    what it ran. sources: (the file's name as shown, its JSON payload)."""
    results = [r for _, payload in sources for r in payload["results"]]
    lines = [f"<!-- generated by `python -m experiments.benchmarks.rl_iteration --table ...`; do not edit -->",
             "", race_table(results), ""]
    lines += [f"- `{name}`: {run_description(payload)}" for name, payload in sources]
    return "\n".join(lines + [""])


def write_table(json_paths: list[str], out: str = TABLE_FILE) -> str:
    """Writes the race table file `out` from the race result files `json_paths` (in that order); returns
    its text. ConfigError (one line) for a file that cannot be read or is not a race's result."""
    from respo_jax.runs import atomic_write_bytes

    sources = []
    for path in json_paths:
        try:
            with open(path, encoding="utf-8") as f:
                payload = json.load(f)
        except OSError as err:
            raise ConfigError(f"--table {path}: {err.strerror or err}") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"--table {path}: not JSON ({err.msg}, line {err.lineno})") from None
        if not isinstance(payload, dict) or not payload.get("results") or "command" not in payload:
            raise ConfigError(f"--table {path}: not a result file of this race (no 'command' and 'results')")
        sources.append((os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.abspath(out))), payload))
    text = table_block(sources)
    atomic_write_bytes(out, text.encode("utf-8"))
    return text
