"""The evaluation's `completions.jsonl`: one scored sample per line, read back and summarized as Tab. 1.

`python -m experiments.evaluate` appends one JSON object per completion:

  benchmark      str   evaluation name (aime25, ..., math500; or synthetic)
  problem_id     str   the source's problem id
  problem_index  int   the problem's position in the benchmark file
  sample         int   sample index within the problem (0-based)
  length         int   generated tokens, EOS excluded (App. E.2 counts the generated text's tokens):
                       == max_new_tokens exactly when the response was cut at the cap
  truncated      bool  no EOS within max_new_tokens
  score          float Math-Verify score, 0 or 1 (App. D.2)
  verify_status  str   "ok", or why the verifier scored 0 without answering ("timeout", "error", "crash")
  answer         str   the gold answer it was scored against
  text           str   the generated response (special tokens removed)

The file is append-only and read by `respo_jax.runs.read_jsonl`, under its rule for a torn last line: an
interrupted writer can leave an unterminated last line, which `load_completions` leaves out with a
warning and `repair_completions` cuts off before appending again. Any other malformed line is an error
naming the file and line: nothing is dropped silently.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from typing import Iterable, Sequence

import numpy as np

from respo_jax import runs
from respo_jax.eval.config import DISPLAY_NAMES
from respo_jax.eval.statistics import cluster_bootstrap

logger = logging.getLogger(__name__)

FIELDS: dict[str, tuple[type, ...]] = {
    "benchmark": (str,),
    "problem_id": (str,),
    "problem_index": (int,),
    "sample": (int,),
    "length": (int,),
    "truncated": (bool,),
    "score": (int, float),
    "verify_status": (str,),
    "answer": (str,),
    "text": (str,),
}


def completion_key(record: dict) -> tuple[str, str, int]:
    """What identifies a completion: (benchmark, problem_id, sample)."""
    return record["benchmark"], record["problem_id"], record["sample"]


def check_record(record: object, where: str) -> dict:
    """`record` if it has every field of FIELDS with the right type; else ValueError naming `where`."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name, types in FIELDS.items():
        if name not in record:
            raise ValueError(f"{where}: missing field {name!r}")
        value = record[name]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            expected = "/".join(t.__name__ for t in types)
            raise ValueError(f"{where}: field {name!r} must be {expected}; got {value!r}")
    if not 0.0 <= record["score"] <= 1.0:
        raise ValueError(f"{where}: score must be in [0, 1]; got {record['score']!r}")
    if record["length"] < 0 or record["sample"] < 0 or record["problem_index"] < 0:
        raise ValueError(f"{where}: length, sample and problem_index must be >= 0")
    return record


def load_completions(path: str | os.PathLike, with_text: bool = True) -> list[dict]:
    """Every complete record of a completions file, in file order (an absent file reads as empty).

    A torn last line (no newline: the writer was interrupted) is left out with a warning
    (`respo_jax.runs`' rule); a malformed complete line or a completion recorded twice raises ValueError
    naming the line. The file is read line by line; `with_text=False` drops each record's `text` (the
    bulk of a 16k-token evaluation's file) after checking it, for statistics that need only scores and
    lengths.
    """
    seen: dict[tuple, str] = {}

    def keep(record: dict, where: str) -> dict:
        key = completion_key(check_record(record, where))
        if key in seen:
            raise ValueError(f"{where}: completion {key} was already recorded on line {seen[key]}")
        seen[key] = where.rsplit(":", 1)[1]
        if not with_text:
            del record["text"]
        return record

    try:
        log = runs.read_jsonl(path, keep)
    except runs.RunFileError as err:
        raise ValueError(f"{err.where}: {err.problem}") from None
    if log.torn_note:
        logger.warning("%s", log.torn_note)
    return log.records


def repair_completions(path: str | os.PathLike) -> int:
    """Cuts a torn last line off a completions file so that appending can resume; returns bytes removed."""
    removed = runs.cut_torn_tail(path)
    if removed:
        logger.warning("%s: cut a torn last line (%d bytes) before resuming", os.fspath(path), removed)
    return removed


def append_completions(handle, records: Iterable[dict]) -> None:
    """Writes `records` as JSON lines to an open (binary, append) handle and makes them durable."""
    payload = b"".join(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n" for record in records)
    handle.write(payload)
    handle.flush()
    os.fsync(handle.fileno())


def scores_by_problem(records: Iterable[dict]) -> dict[str, list[list[float]]]:
    """benchmark -> per-problem lists of sample scores (problems by problem_index, samples by index):
    the input of `cluster_bootstrap`."""
    grouped: dict[str, dict[int, list[tuple[int, float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for record in records:
        problem = grouped[record["benchmark"]][record["problem_index"]]
        problem.append((record["sample"], float(record["score"])))
    return {
        benchmark: [[score for _, score in sorted(samples)] for _, samples in sorted(problems.items())]
        for benchmark, problems in grouped.items()
    }


def summarize_completions(
    records: Sequence[dict],
    benchmarks: Sequence[str] | None = None,
    num_resamples: int = 10_000,
    seed: int = 0,
) -> dict:
    """Tab. 1 from completion records: per-benchmark pass@1 and the macro average with its SE.

    pass@1 of a benchmark is the mean over its problems of the mean score over their samples; the
    macro average weighs benchmarks equally and its standard error is the cluster bootstrap over
    problems (App. D.3, `num_resamples` replicates from `seed`). Each benchmark also gets its own
    bootstrap SE, its mean response length, truncated fraction and verifier failures.
    `benchmarks` fixes the order (and requires each to have records); default: order of appearance.
    """
    records = list(records)
    if not records:
        raise ValueError("no completions to summarize")
    by_benchmark: dict[str, list[dict]] = {}
    for record in records:
        by_benchmark.setdefault(record["benchmark"], []).append(record)
    order = list(benchmarks) if benchmarks is not None else list(by_benchmark)
    missing = [name for name in order if name not in by_benchmark]
    if missing:
        raise ValueError(f"no completions for benchmark(s) {missing}")
    extra = sorted(set(by_benchmark) - set(order))
    if extra:
        raise ValueError(f"completions of benchmark(s) {extra} not in the requested list {order}")
    scores = scores_by_problem(records)
    rows = {}
    for name in order:
        group = by_benchmark[name]
        pass_at_1, se = cluster_bootstrap({name: scores[name]}, num_resamples, seed)
        counts = sorted({len(samples) for samples in scores[name]})
        rows[name] = {
            "pass_at_1": pass_at_1,
            "se": se,
            "problems": len(scores[name]),
            "samples_per_problem": counts[0] if len(counts) == 1 else [counts[0], counts[-1]],
            "completions": len(group),
            "mean_length": float(np.mean([r["length"] for r in group])),
            "truncated_fraction": float(np.mean([r["truncated"] for r in group])),
            "verify_failures": sum(r["verify_status"] != "ok" for r in group),
        }
    macro, macro_se = cluster_bootstrap({name: scores[name] for name in order}, num_resamples, seed)
    return {
        "benchmarks": rows,
        "macro_average": {"pass_at_1": macro, "se": macro_se, "benchmarks": order},
        "bootstrap": {"num_resamples": num_resamples, "seed": seed},
    }


def summary_markdown(summary: dict, label: str) -> str:
    """The summary as markdown: a Tab. 1 row (pass@1 in %, Avg. = macro average ± bootstrap SE) and a
    per-benchmark detail table."""
    rows = summary["benchmarks"]
    names = list(rows)
    macro = summary["macro_average"]
    title = [DISPLAY_NAMES.get(name, name) for name in names]
    bootstrap = summary["bootstrap"]
    lines = [
        "| Checkpoint | " + " | ".join(title) + " | Avg. |",
        "|---" * (len(names) + 2) + "|",
        f"| {label} | " + " | ".join(f"{100 * rows[n]['pass_at_1']:.1f}" for n in names)
        + f" | {100 * macro['pass_at_1']:.1f} ± {100 * macro['se']:.1f} |",
        "",
        "pass@1 (%): mean over problems of the mean Math-Verify score over samples. Avg.: macro average "
        f"over the {len(names)} benchmark(s), ± its cluster-bootstrap standard error over problems "
        f"(App. D.3; {bootstrap['num_resamples']:,} resamples, seed {bootstrap['seed']}).",
        "",
        "| Benchmark | Problems | Samples/problem | pass@1 (%) | SE (pp) | Mean length | Truncated (%) "
        "| Verifier failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        row = rows[name]
        samples = row["samples_per_problem"]
        samples = samples if isinstance(samples, int) else f"{samples[0]}–{samples[1]}"
        lines.append(
            f"| {DISPLAY_NAMES.get(name, name)} | {row['problems']} | {samples} "
            f"| {100 * row['pass_at_1']:.2f} | {100 * row['se']:.2f} | {row['mean_length']:.1f} "
            f"| {100 * row['truncated_fraction']:.1f} | {row['verify_failures']} |"
        )
    return "\n".join(lines) + "\n"
