"""Run reports: the paper's figures and tables for a set of training runs (§4.1-4.3, App. E.1-E.3).

A report compares runs (objectives, N, seeds) from what their directories hold, with the statistics of
`respo_jax.eval`; nothing is recomputed from a model. The builders return plain data, markdown and
matplotlib `Figure`s (no pyplot state), so notebooks display them and `experiments.report` writes them.

  load_run / load_runs         a run directory: config.json, metrics.jsonl, rollouts/, eval/ (checked)
  training_summary             early peak and late mean ± temporal std of the training score (§4.1, Tab. 8)
  metrics_comparison           every logged metric's mean per run, side by side (comparing objectives)
  curves_figure                score, response length, approx. KL, entropy vs policy updates (Figs. 3, 5)
  length_bin_groups            accuracy in shared response-length bins per N (App. E.2, Tab. 4, Fig. 3)
  evaluation_table             Tab. 1: pass@1 per benchmark and the macro average ± bootstrap SE
  positive_branch_tables       App. E.3's Tabs. 5-7 from the rollout files
  build_report / write_report  all of the above as one markdown document with its PNGs (and JSON)

Each table has a `*_markdown` renderer. Bad or mismatched inputs raise `ReportError` naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from respo_jax.eval import positive_branch
from respo_jax.eval.completions import load_completions, scores_by_problem
from respo_jax.eval.config import DISPLAY_NAMES, PAPER_BENCHMARKS
from respo_jax.eval.rollout_files import ROLLOUT_DIR, load_rollout_files
from respo_jax.eval.statistics import LengthBins, early_peak, late_mean, shared_length_bins

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"  # where `experiments.evaluate` writes for a run directory (its default out_dir)

# The paper's reporting protocol (§4.1, App. E.4): every run has 1,024 policy updates; the early peak is
# the maximum through update 256 and the late mean covers the last 128 updates.
PAPER_POLICY_UPDATES = 1024
PAPER_EARLY_UNTIL = 256
PAPER_LATE_WINDOW = 128
# App. E.3's diagnostic window: the first 16 rollout batches (Tab. 5 over batches 9-16, Tab. 7 over 1-16,
# Tab. 6 at batches 1, 8 and 16).
PAPER_E3_BATCHES = 16

SCORE_KEY = "train_accuracy"  # (score + 1) / 2 of the logged DAPO score (§4.1, App. D.1)
# (metrics key, axis label) of the curve panels: Fig. 3 (left) and Fig. 5.
CURVE_PANELS = (
    (SCORE_KEY, "training score (score+1)/2"),
    ("response_length", "response length (tokens)"),
    ("approx_kl", "approx. KL (k1)"),
    ("entropy", "entropy (nats)"),
)
OBJECTIVE_NAMES = {"respo": "ReSPO", "vespo": "VESPO", "grpo": "GRPO", "gspo": "GSPO", "cispo": "CISPO",
                   "sapo": "SAPO", "luspo": "LUSPO", "dr_grpo": "Dr.GRPO"}
DASH = "–"
CURVES_FIGURE, LENGTH_BINS_FIGURE = "training_curves.png", "length_bins.png"  # build_report's figures
REPORT_FIGURES = (CURVES_FIGURE, LENGTH_BINS_FIGURE)


class ReportError(ValueError):
    """A directory or file cannot be reported as asked (not a run, damaged, or files that disagree)."""


# ---------------------------------------------------------------------------------------------------
# Loading


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The outputs of `python -m experiments.evaluate` for one checkpoint, as summarized.

    summary: summary.json (Tab. 1 numbers); protocol: how the completions were made (sampling, cap,
    checkpoint); completions: exactly the summarized completion records (text dropped), i.e. those of
    the summary's benchmarks, problems and samples (completions.jsonl may hold more from other settings).
    """

    path: str
    summary: dict
    protocol: dict
    completions: list[dict]

    @property
    def benchmarks(self) -> list[str]:
        return list(self.summary["benchmarks"])

    @property
    def cap(self) -> int:
        """The generation cap (eval.max_new_tokens): a response of exactly this length was cut."""
        return int(self.protocol["max_new_tokens"])

    @property
    def step(self) -> int | None:
        """The evaluated checkpoint's step (a run's iteration), None for a Hugging Face directory."""
        return self.protocol.get("checkpoint_step")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run directory, read and cross-checked by `load_run`.

    config: config.json as a dict; records: every metrics.jsonl record (all phases) in file order;
    rollouts: the rollout files (`respo_jax.eval.rollout_files`), in iteration order, [] when the run
    wrote none; evaluation: its evaluation outputs or None; notes: things a reader should know (a torn
    last metrics line, an unfinished evaluation), shown in reports.
    """

    path: str
    label: str
    config: dict
    records: list[dict]
    rollouts: list[dict]
    evaluation: Evaluation | None
    notes: tuple[str, ...] = ()

    @property
    def objective(self) -> str:
        return self.config["objective"]["name"]

    @property
    def reuse(self) -> int:
        """N, the rollout-reuse ratio (policy updates per rollout batch)."""
        return int(self.config["rollout"]["reuse"])

    @property
    def seed(self) -> int:
        return int(self.config["run"]["seed"])

    @property
    def rl_records(self) -> list[dict]:
        return [record for record in self.records if record.get("phase") == "rl"]

    @property
    def policy_updates(self) -> int:
        """Policy updates done (the last RL record's)."""
        return int(self.rl_records[-1]["policy_updates"])

    @property
    def iterations(self) -> int:
        return int(self.rl_records[-1]["iteration"])

    def has_curve(self, key: str) -> bool:
        return all(key in record for record in self.rl_records)

    def curve(self, key: str = SCORE_KEY) -> tuple[np.ndarray, np.ndarray]:
        """(policy updates [points], values [points]) of a metrics key over the RL records, float64."""
        rl = self.rl_records
        missing = [record["iteration"] for record in rl if key not in record]
        if missing:
            raise ReportError(f"{self.path}: metrics.jsonl has no {key!r} at iteration(s) {missing[:5]}")
        steps = np.array([record["policy_updates"] for record in rl], np.float64)
        values = np.array([record[key] for record in rl], np.float64)
        return steps, values


def run_label(config: Mapping) -> str:
    """"ReSPO N=8 seed=0" from a run's config: objective, rollout-reuse ratio and seed."""
    name = config["objective"]["name"]
    return f"{OBJECTIVE_NAMES.get(name, name)} N={config['rollout']['reuse']} seed={config['run']['seed']}"


def _read_json(path: str) -> object:
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ReportError(f"{path}: not UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None


def _check_config(config: object, path: str) -> dict:
    """The fields a report reads, with their types; ReportError naming the file and key otherwise."""
    if not isinstance(config, dict):
        raise ReportError(f"{path}: expected a JSON object (a training config), got {type(config).__name__}")
    wanted = {("objective", "name"): str, ("rollout", "reuse"): int,
              ("rollout", "prompts_per_minibatch"): int, ("rollout", "group_size"): int, ("run", "seed"): int}
    for (section, field), kind in wanted.items():
        value = config.get(section, {}).get(field) if isinstance(config.get(section), dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ReportError(f"{path}: {section}.{field} must be a {kind.__name__}; got {value!r} "
                              "(is this a config.json written by python -m experiments.train?)")
    if config["rollout"]["reuse"] < 1:
        raise ReportError(f"{path}: rollout.reuse must be >= 1; got {config['rollout']['reuse']}")
    return config


def _read_metrics(path: str) -> tuple[list[dict], list[str]]:
    """(records, notes) of a metrics.jsonl. A torn last line (a killed writer) is skipped with a note;
    any other damaged line raises ReportError naming the file and line."""
    records, notes = [], []
    with open(path, "rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.endswith(b"\n"):
                if line.strip():
                    notes.append(f"{path}: skipped a torn last line ({len(line)} bytes without a newline)")
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ReportError(f"{path}:{lineno}: damaged record ({err})") from None
            if not isinstance(record, dict) or not isinstance(record.get("phase"), str):
                raise ReportError(f"{path}:{lineno}: expected a JSON object with a 'phase'; "
                                  f"got {line[:80]!r}")
            record["_line"] = lineno
            records.append(record)
    return records, notes


def _check_rl_records(records: list[dict], reuse: int, path: str) -> None:
    """RL records need iteration, policy_updates (= iteration * N) and a finite training score, once each."""
    seen: dict[int, int] = {}
    for record in records:
        if record["phase"] != "rl":
            continue
        where = f"{path}:{record['_line']}"
        for key in ("iteration", "policy_updates"):
            if not isinstance(record.get(key), int) or isinstance(record.get(key), bool):
                raise ReportError(f"{where}: an RL record needs an integer {key!r}; got {record.get(key)!r}")
        iteration = record["iteration"]
        if iteration in seen:
            raise ReportError(f"{where}: iteration {iteration} was already recorded on line "
                              f"{seen[iteration]} (a log appended to by a resumed run?)")
        if seen and iteration < max(seen):
            raise ReportError(f"{where}: iteration {iteration} follows iteration {max(seen)}")
        seen[iteration] = record["_line"]
        if record["policy_updates"] != iteration * reuse:
            raise ReportError(f"{where}: policy_updates={record['policy_updates']} at iteration {iteration}, "
                              f"but config.json's rollout.reuse={reuse} gives {iteration * reuse}")
        score = record.get(SCORE_KEY)
        if not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score):
            raise ReportError(f"{where}: {SCORE_KEY!r} must be a finite number; got {score!r}")
    if not seen:
        raise ReportError(f"{path}: no RL records (phase 'rl'); the run has not finished an iteration")


def _check_rollouts(rollouts: list[dict], rl: list[dict], config: dict, folder: str) -> None:
    """Each rollout file belongs to a logged iteration (same policy_updates) and has N*M*G rows."""
    by_iteration = {record["iteration"]: record for record in rl}
    r = config["rollout"]
    rows = r["reuse"] * r["prompts_per_minibatch"] * r["group_size"]
    for rollout in rollouts:
        iteration = int(rollout["iteration"])
        name = os.path.join(folder, f"iteration_{iteration:06d}.npz")
        if iteration not in by_iteration:
            raise ReportError(f"{name}: iteration {iteration} is not in metrics.jsonl (iterations "
                              f"{min(by_iteration)}..{max(by_iteration)}); the file is from another run")
        logged = by_iteration[iteration]["policy_updates"]
        if int(rollout["policy_updates"]) != logged:
            raise ReportError(f"{name}: policy_updates={int(rollout['policy_updates'])}, but metrics.jsonl "
                              f"logs {logged} at iteration {iteration}")
        if rollout["log_w"].shape[0] != rows:
            raise ReportError(f"{name}: {rollout['log_w'].shape[0]} responses, but config.json's rollout "
                              f"gives N*M*G = {r['reuse']}*{r['prompts_per_minibatch']}*{r['group_size']} "
                              f"= {rows}")


def _summarized_completions(records: list[dict], summary: dict) -> list[dict]:
    """The completions `summary` was computed from: its benchmarks' first `problems` problems and first
    `samples_per_problem` samples (what `experiments.evaluate` generates for those settings)."""
    rows = summary["benchmarks"]
    kept = []
    for record in records:
        row = rows.get(record["benchmark"])
        if row is None:
            continue
        samples = row["samples_per_problem"]
        samples = samples if isinstance(samples, int) else samples[-1]
        if record["problem_index"] < row["problems"] and record["sample"] < samples:
            kept.append(record)
    return kept


def load_evaluation(eval_dir: str) -> Evaluation:
    """An evaluation directory (summary.json, completions.jsonl, eval_config.json), cross-checked: the
    summary's per-benchmark completion counts and pass@1 must be those of completions.jsonl."""
    summary_path = os.path.join(eval_dir, "summary.json")
    completions_path = os.path.join(eval_dir, "completions.jsonl")
    for path in (summary_path, completions_path):
        if not os.path.isfile(path):
            raise ReportError(f"{eval_dir} is not a finished evaluation: {os.path.basename(path)} is missing "
                              "(python -m experiments.evaluate writes it)")
    summary = _read_json(summary_path)
    if not (isinstance(summary, dict) and isinstance(summary.get("benchmarks"), dict)
            and summary["benchmarks"] and isinstance(summary.get("macro_average"), dict)
            and isinstance(summary.get("protocol"), dict)):
        raise ReportError(f"{summary_path}: expected the summary python -m experiments.evaluate writes "
                          "(benchmarks, macro_average, protocol)")
    for name, row in summary["benchmarks"].items():
        fields = ("pass_at_1", "problems", "samples_per_problem", "completions")
        if not isinstance(row, dict) or any(field not in row for field in fields):
            raise ReportError(f"{summary_path}: benchmark {name!r} needs {', '.join(fields)}; got {row!r}")
    protocol = summary["protocol"]
    if not isinstance(protocol.get("max_new_tokens"), int):
        raise ReportError(f"{summary_path}: protocol.max_new_tokens must be an integer")
    config_path = os.path.join(eval_dir, "eval_config.json")
    if os.path.isfile(config_path):
        recorded = _read_json(config_path)
        recorded = recorded.get("protocol") if isinstance(recorded, dict) else None
        if recorded != protocol:
            changed = sorted(key for key in set(recorded or {}) | set(protocol)
                             if (recorded or {}).get(key) != protocol.get(key))
            raise ReportError(f"{summary_path} and {config_path} describe different evaluations (they differ "
                              f"in {changed}); rerun python -m experiments.evaluate to refresh the summary")
    try:
        records = load_completions(completions_path, with_text=False)
    except ValueError as err:
        raise ReportError(str(err)) from None
    records = _summarized_completions(records, summary)
    scores = scores_by_problem(records)
    for name, row in summary["benchmarks"].items():
        count = sum(record["benchmark"] == name for record in records)
        if count != row.get("completions"):
            raise ReportError(f"{summary_path} counts {row.get('completions')} completions of {name!r}; "
                              f"{completions_path} holds {count} of them: the files are from different "
                              "evaluations (rerun python -m experiments.evaluate to refresh the summary)")
        pass_at_1 = float(np.mean([np.mean(samples) for samples in scores[name]]))
        if not math.isclose(pass_at_1, row["pass_at_1"], rel_tol=1e-9, abs_tol=1e-12):
            raise ReportError(f"{summary_path} gives {name!r} pass@1 {row['pass_at_1']!r}; its completions "
                              f"in {completions_path} give {pass_at_1!r}: the files are from different "
                              "evaluations")
        over = [record["length"] for record in records
                if record["benchmark"] == name and record["length"] > protocol["max_new_tokens"]]
        if over:
            raise ReportError(f"{completions_path}: {name!r} has a response of {max(over)} tokens, past the "
                              f"cap max_new_tokens={protocol['max_new_tokens']} of {summary_path}")
    return Evaluation(path=eval_dir, summary=summary, protocol=protocol, completions=records)


def load_run(run_dir: str | os.PathLike, eval_dir: str | os.PathLike | None = None,
             label: str | None = None) -> Run:
    """Reads a training run directory (`python -m experiments.train`'s run.out_dir) and checks its files
    against each other.

    run_dir must hold config.json and metrics.jsonl; rollouts/iteration_*.npz are read when present (they
    must match the metrics' iterations and policy updates, and hold N*M*G responses each). eval_dir: the
    evaluation outputs to report (summary.json + completions.jsonl); by default run_dir/eval when it holds
    a summary (an eval/ without one is noted, not reported). label: default `run_label(config)`.
    Raises ReportError naming the directory or file when something is missing, damaged or inconsistent.
    """
    path = os.fspath(run_dir)
    if not os.path.isdir(path):
        raise ReportError(f"{path}: not a directory")
    config_path, metrics_path = os.path.join(path, CONFIG_FILE), os.path.join(path, METRICS_FILE)
    for file in (config_path, metrics_path):
        if not os.path.isfile(file):
            raise ReportError(f"{path} is not a training run directory: {os.path.basename(file)} is missing "
                              "(a run directory of python -m experiments.train holds config.json and "
                              "metrics.jsonl)")
    config = _check_config(_read_json(config_path), config_path)
    records, notes = _read_metrics(metrics_path)
    _check_rl_records(records, config["rollout"]["reuse"], metrics_path)
    rl = [record for record in records if record["phase"] == "rl"]

    rollouts: list[dict] = []
    folder = os.path.join(path, ROLLOUT_DIR)
    if os.path.isdir(folder) and os.listdir(folder):
        try:
            rollouts = load_rollout_files(path)
        except (ValueError, FileNotFoundError) as err:
            raise ReportError(str(err)) from None
        _check_rollouts(rollouts, rl, config, folder)

    evaluation = None
    if eval_dir is not None:
        eval_path = os.fspath(eval_dir)
        if not os.path.isdir(eval_path):
            raise ReportError(f"evaluation directory {eval_path} (for {path}) does not exist")
        evaluation = load_evaluation(eval_path)
    else:
        default = os.path.join(path, EVAL_DIR)
        if os.path.isfile(os.path.join(default, "summary.json")):
            evaluation = load_evaluation(default)
        elif os.path.isdir(default):
            notes.append(f"{default} has no summary.json (an unfinished evaluation?): not reported")
    if evaluation is not None:
        protocol = evaluation.protocol
        if protocol.get("checkpoint_kind") == "run" and protocol.get("checkpoint"):
            if os.path.realpath(protocol["checkpoint"]) != os.path.realpath(path):
                notes.append(f"{evaluation.path} evaluated the run directory {protocol['checkpoint']}, not "
                             f"{path} (moved or copied?)")
        if evaluation.step is not None and evaluation.step != rl[-1]["iteration"]:
            notes.append(f"{evaluation.path} evaluated the checkpoint of iteration {evaluation.step}; the "
                         f"run's log ends at iteration {rl[-1]['iteration']}")
    for record in records:
        record.pop("_line", None)
    return Run(path=path, label=label or run_label(config), config=config, records=records,
               rollouts=rollouts, evaluation=evaluation, notes=tuple(notes))


def load_runs(run_dirs: Sequence[str | os.PathLike],
              eval_dirs: Mapping[str, str] | None = None) -> list[Run]:
    """`load_run` for each directory, with labels made unique: runs whose configs give the same label are
    told apart by their directory names. eval_dirs: run directory -> its evaluation directory (matched by
    real path), for evaluations written elsewhere than run_dir/eval."""
    if not run_dirs:
        raise ReportError("no run directories given")
    eval_dirs = {os.path.realpath(os.fspath(k)): v for k, v in (eval_dirs or {}).items()}
    real = [os.path.realpath(os.fspath(d)) for d in run_dirs]
    if len(set(real)) != len(real):
        raise ReportError(f"a run directory is given twice: {[os.fspath(d) for d in run_dirs]}")
    unknown = sorted(set(eval_dirs) - set(real))
    if unknown:
        raise ReportError(f"evaluation directories given for {unknown}, which are not among the runs")
    runs = [load_run(d, eval_dirs.get(r)) for d, r in zip(run_dirs, real)]
    labels = [run.label for run in runs]
    for index, run in enumerate(runs):
        if labels.count(run.label) > 1:
            name = os.path.basename(os.path.normpath(run.path))
            runs[index] = dataclasses.replace(run, label=f"{run.label} ({name})")
    labels = [run.label for run in runs]
    for index, run in enumerate(runs):
        if labels.count(run.label) > 1:
            runs[index] = dataclasses.replace(run, label=f"{run.label} #{index + 1}")
    return runs


# ---------------------------------------------------------------------------------------------------
# Training summary (§4.1, App. E.1, Tab. 8)


@dataclasses.dataclass(frozen=True)
class SummaryWindows:
    """The early-peak and late-mean windows, in policy updates.

    early_until: the early peak is the maximum logged score at updates <= early_until.
    late_window: the late mean covers each run's last `late_window` updates [T - late_window, T].
    scale: the factor applied to the paper's windows (1.0: the paper's; None: both windows given
    explicitly); note: says how they were chosen, for the report.
    """

    early_until: float
    late_window: float
    scale: float | None
    note: str


def summary_windows(runs: Sequence[Run], early_until: float | None = None,
                    late_window: float | None = None) -> SummaryWindows:
    """The paper's windows (first 256 / last 128 policy updates of 1,024), scaled for short runs.

    When the shortest run has T < 1,024 updates, the windows keep the paper's proportions: the early
    window ends at 256 T / 1,024 (but at least at every run's first logged update, so each run has an
    early point) and the late window is 128 T / 1,024 updates. Explicit `early_until` / `late_window`
    are used as given.
    """
    if not runs:
        raise ReportError("no runs to summarize")
    for name, value in (("early_until", early_until), ("late_window", late_window)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ReportError(f"{name} must be a positive number of policy updates; got {value!r}")
    shortest = min(run.policy_updates for run in runs)
    scale = min(1.0, shortest / PAPER_POLICY_UPDATES)
    first_points = max(run.rl_records[0]["policy_updates"] for run in runs)
    paper = f"the paper's {PAPER_EARLY_UNTIL} and {PAPER_LATE_WINDOW} of {PAPER_POLICY_UPDATES:,} updates"
    reasons = []
    defaults = early_until is None or late_window is None
    if early_until is None:
        early_until = PAPER_EARLY_UNTIL * scale
        if early_until < first_points:
            early_until = float(first_points)
            reasons.append(f"early window widened to {first_points:g}, the latest first logged update "
                           "among the runs")
    else:
        reasons.append("early window as given")
    if late_window is None:
        late_window = PAPER_LATE_WINDOW * scale
    else:
        reasons.append("late window as given")
    if defaults and scale < 1.0:
        reasons.insert(0, f"{paper} scaled to the shortest run ({shortest} policy updates, "
                          f"{100 * scale:.3g}% of the paper's)")
    elif defaults:
        reasons.insert(0, paper + (" (§4.1)" if shortest == PAPER_POLICY_UPDATES
                                   else f"; the shortest run has {shortest:,}"))
    note = (f"Windows: early peak through update {early_until:g}, late mean over each run's last "
            f"{late_window:g} updates ({'; '.join(reasons)}).")
    return SummaryWindows(early_until=float(early_until), late_window=float(late_window),
                          scale=scale if defaults else None, note=note)


def training_summary(runs: Sequence[Run], windows: SummaryWindows | None = None,
                     key: str = SCORE_KEY) -> list[dict]:
    """One row per run: early peak (`early_peak` through windows.early_until), late mean and within-run
    temporal std (`late_mean` over [T - late_window, T], T the run's last logged update) and the final
    value, of metrics `key` (default the training score (score+1)/2).

    A late window that starts before the run's first logged update is clipped to it (the row's
    late_start says so); with a single logged point the late mean is None. Row keys: label, reuse,
    early_until, early_peak, late_start, late_end, late_mean, late_std, final, final_step, points.
    """
    windows = windows or summary_windows(runs)
    rows = []
    for run in runs:
        steps, values = run.curve(key)
        end = float(steps[-1])
        start = max(end - windows.late_window, float(steps[0]))
        mean = std = None
        if start < end:
            mean, std = late_mean(steps, values, start, end)
        peak = early_peak(steps, values, windows.early_until) if steps[0] <= windows.early_until else None
        rows.append({
            "label": run.label, "reuse": run.reuse, "early_until": windows.early_until, "early_peak": peak,
            "late_start": start, "late_end": end, "late_mean": mean, "late_std": std,
            "final": float(values[-1]), "final_step": end, "points": int(steps.size),
        })
    return rows


def _number(value, digits: int = 3, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return DASH
    return f"{scale * value:.{digits}f}"


def _steps(value: float) -> str:
    return f"{value:g}"


def training_summary_markdown(rows: Sequence[dict], windows: SummaryWindows, key: str = SCORE_KEY) -> str:
    """The summary rows as a markdown table in Tab. 8's format (values as fractions, 3 decimals)."""
    what = "training score (score+1)/2" if key == SCORE_KEY else key
    lines = [
        f"| Run | N | Early peak (≤ {_steps(windows.early_until)}) | Late mean ± temporal std | Late window "
        "| Final (update) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        late = DASH if row["late_mean"] is None else f"{row['late_mean']:.3f} ± {row['late_std']:.3f}"
        lines.append(f"| {row['label']} | {row['reuse']} | {_number(row['early_peak'])} | {late} "
                     f"| [{_steps(row['late_start'])}, {_steps(row['late_end'])}] "
                     f"| {row['final']:.3f} ({_steps(row['final_step'])}) |")
    lines += ["", f"Quantity: {what}. Early peak: the maximum logged value through the given policy update. "
              "Late mean: the policy-step-weighted trapezoidal mean over the window, ± the within-run "
              f"temporal standard deviation (§4.1, App. E.4). {windows.note}"]
    clipped = [row["label"] for row in rows
               if row["late_end"] - row["late_start"] < windows.late_window - 1e-9]
    if clipped:
        lines.append(f"The late window of {', '.join(clipped)} is clipped at its first logged update.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Metrics side by side


# Counters and wall-clock bookkeeping of an RL record (*_seconds too): not what an objective changes.
_NOT_COMPARED = frozenset({"iteration", "policy_updates", "phase", "compiles"})


def _compared_by_default(key: str, value) -> bool:
    return (key not in _NOT_COMPARED and not key.endswith("_seconds") and isinstance(value, (int, float))
            and not isinstance(value, bool))


def metrics_comparison(runs: Sequence[Run], keys: Sequence[str] | None = None) -> dict:
    """Every run's mean over its RL records of each metrics key, for comparing objectives side by side.

    keys: the metrics keys to compare (default: every numeric key some run logs, in the order the first
    run that logs a key logs it, except counters and wall-clock times (iteration, policy_updates,
    compiles, *_seconds), which depend on the machine and the compile cache rather than the objective). Returns {"labels": [run labels], "keys": [...],
    "means": {key: [mean per run, or None where the run never logs the key]}, "records": [RL records
    per run]}. A key a run logs at some iterations only is averaged over those; non-finite values are
    refused (ReportError naming the run and key), not averaged away.
    """
    if not runs:
        raise ReportError("no runs to compare")
    if keys is None:
        keys = []
        for run in runs:
            for record in run.rl_records:
                for key, value in record.items():
                    if key not in keys and _compared_by_default(key, value):
                        keys.append(key)
    else:
        keys = list(keys)
        unknown = [key for key in keys if not any(key in record for run in runs for record in run.rl_records)]
        if unknown:
            raise ReportError(f"no run logs {unknown} in its RL records")
    means: dict[str, list] = {}
    for key in keys:
        means[key] = []
        for run in runs:
            values = [record[key] for record in run.rl_records if key in record]
            if not values:
                means[key].append(None)
                continue
            if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                   for v in values):
                raise ReportError(f"{run.path}: metrics key {key!r} holds a non-finite or non-numeric value")
            means[key].append(float(np.mean(values)))
    return {"labels": [run.label for run in runs], "keys": keys, "means": means,
            "records": [len(run.rl_records) for run in runs]}


def metrics_comparison_markdown(comparison: dict, digits: int = 4) -> str:
    """`metrics_comparison` as a markdown table: one row per metrics key, one column per run."""
    labels = comparison["labels"]
    lines = ["| Metric | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for key in comparison["keys"]:
        lines.append(f"| {key} | " + " | ".join(_number(v, digits) for v in comparison["means"][key]) + " |")
    counts = ", ".join(f"{label}: {n}" for label, n in zip(labels, comparison["records"]))
    lines += ["", f"Means over each run's RL iterations ({counts}). {DASH}: the run does not log the key."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Curves (Figs. 3, 5)


def curves_figure(runs: Sequence[Run], panels: Sequence[tuple[str, str]] = CURVE_PANELS) -> Figure:
    """One panel per (metrics key, axis label), one line per run, against policy updates. Panels that no
    run logs are left out; a run that lacks a key has no line in that panel (`missing_curves`)."""
    panels = [(key, label) for key, label in panels if any(run.has_curve(key) for run in runs)]
    if not panels:
        raise ReportError("none of the runs logs any of the curve keys")
    fig = Figure(figsize=(4.2 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, label) in zip(axes, panels):
        for index, run in enumerate(runs):
            if run.has_curve(key):
                steps, values = run.curve(key)
                ax.plot(steps, values, lw=1.6, marker="o" if steps.size <= 16 else None, ms=3,
                        color=f"C{index % 10}", label=run.label)
        ax.set_xlabel("policy updates")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 4), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.07 * math.ceil(len(runs) / 4)))
    return fig


def missing_curves(runs: Sequence[Run], panels: Sequence[tuple[str, str]] = CURVE_PANELS) -> list[str]:
    """Human-readable notes on the (run, key) pairs `curves_figure` cannot draw."""
    notes = []
    for key, _ in panels:
        lacking = [run.label for run in runs if not run.has_curve(key)]
        if lacking:
            notes.append(f"{', '.join(lacking)}: metrics.jsonl has no {key!r} in every RL record (no line)")
    return notes


# ---------------------------------------------------------------------------------------------------
# Accuracy across response lengths (App. E.2)


@dataclasses.dataclass(frozen=True)
class LengthBinGroup:
    """The runs of one N with evaluations, binned with shared edges (App. E.2: one set of edges per N,
    from the pooled lengths of every method and benchmark).

    edges: int64 [num_bins] inclusive upper bounds (Q10 = the cap); bins: label -> `LengthBins`.
    """

    reuse: int
    cap: int
    edges: np.ndarray
    bins: dict[str, LengthBins]


def length_bin_groups(runs: Sequence[Run], num_bins: int = 10) -> list[LengthBinGroup]:
    """`shared_length_bins` of the evaluated runs, one group per N (in order of first appearance).

    Each run contributes its summarized completions pooled over benchmarks (length, Math-Verify score).
    The runs of a group must share the generation cap (else ReportError naming them). A group whose
    responses are all at the cap has no quantile bins and raises ReportError.
    """
    groups: dict[int, list[Run]] = {}
    for run in runs:
        if run.evaluation is not None:
            groups.setdefault(run.reuse, []).append(run)
    out = []
    for reuse, members in groups.items():
        caps = {run.label: run.evaluation.cap for run in members}
        if len(set(caps.values())) > 1:
            raise ReportError(f"N={reuse}: the evaluations have different generation caps {caps}; shared "
                              "length bins need one cap (evaluate with the same eval.max_new_tokens)")
        cap = next(iter(caps.values()))
        methods = {
            run.label: (np.array([r["length"] for r in run.evaluation.completions], np.int64),
                        np.array([r["score"] for r in run.evaluation.completions], np.float64))
            for run in members
        }
        pooled = np.concatenate([lengths for lengths, _ in methods.values()])
        if np.all(pooled >= cap):
            raise ReportError(f"N={reuse}: every evaluated response of {list(methods)} is at the cap ({cap} "
                              "tokens), so the quantile bins Q1-Q9 are undefined")
        edges, bins = shared_length_bins(methods, cap, num_bins)
        out.append(LengthBinGroup(reuse=reuse, cap=cap, edges=edges, bins=bins))
    return out


def length_bins_markdown(groups: Sequence[LengthBinGroup]) -> str:
    """Tab. 4's layout (upper bounds and counts per method) plus the accuracy (%) in each bin."""
    lines = []
    for group in groups:
        k = group.edges.size
        header = "| Entry | " + " | ".join(f"Q{i + 1}" for i in range(k)) + " |"
        lines += [f"**N = {group.reuse}** (cap {group.cap:,} tokens)", "", header, "|---" * (k + 1) + "|",
                  "| Upper bound | " + " | ".join(f"{int(b):,}" for b in group.edges) + " |"]
        for label, bins in group.bins.items():
            lines.append(f"| {label} count | " + " | ".join(f"{int(c):,}" for c in bins.counts) + " |")
        for label, bins in group.bins.items():
            lines.append(f"| {label} accuracy (%) | "
                         + " | ".join(_number(a, 1, 100.0) for a in bins.accuracy) + " |")
        lines.append("")
    quantiles = groups[0].edges.size - 1 if groups else 9
    lines.append(f"Shared bins per N over every evaluated run's completions, pooled over benchmarks "
                 f"(App. E.2): Q1-Q{quantiles} equal-frequency over the uncapped lengths, the last bin "
                 f"exactly the responses at the cap; {DASH}: an empty bin.")
    return "\n".join(lines) + "\n"


def length_bins_figure(groups: Sequence[LengthBinGroup]) -> Figure:
    """Accuracy per shared length bin, one panel per N, one line per run (Fig. 3 right, Fig. 4a)."""
    if not groups:
        raise ReportError("no evaluated runs: no length bins to plot")
    fig = Figure(figsize=(4.6 * len(groups), 3.6))
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups):
        x = np.arange(1, group.edges.size + 1)
        for index, (label, bins) in enumerate(group.bins.items()):
            ax.plot(x, 100 * bins.accuracy, marker="o", ms=4, lw=1.6, color=f"C{index % 10}", label=label)
        ax.set_xticks(x, [f"Q{i}" for i in x])
        ax.set_xlabel("response-length bin")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(f"N = {group.reuse}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------
# Tab. 1


def evaluation_table(runs: Sequence[Run]) -> dict:
    """Tab. 1 from the evaluated runs' summaries: pass@1 per benchmark and the macro average with its
    cluster-bootstrap SE (App. D.3), as `experiments.evaluate` computed them.

    Returns {"benchmarks": [names, the paper's order first], "rows": [{"label", "reuse", "step",
    "pass_at_1": {benchmark: value}, "average", "se", "benchmarks", "bootstrap"}]} (fractions, not %),
    rows sorted by N (stable in the given run order).
    """
    evaluated = sorted((run for run in runs if run.evaluation is not None), key=lambda run: run.reuse)
    names: list[str] = []
    for run in evaluated:
        for name in run.evaluation.benchmarks:
            if name not in names:
                names.append(name)
    names = [n for n in PAPER_BENCHMARKS if n in names] + [n for n in names if n not in PAPER_BENCHMARKS]
    rows = []
    for run in evaluated:
        summary = run.evaluation.summary
        rows.append({
            "label": run.label, "reuse": run.reuse, "step": run.evaluation.step,
            "pass_at_1": {name: row["pass_at_1"] for name, row in summary["benchmarks"].items()},
            "average": summary["macro_average"]["pass_at_1"], "se": summary["macro_average"]["se"],
            "benchmarks": list(summary["benchmarks"]), "bootstrap": summary.get("bootstrap"),
        })
    return {"benchmarks": names, "rows": rows}


def evaluation_markdown(table: dict) -> str:
    """Tab. 1's layout: pass@1 (%) per benchmark, Avg. = macro average ± cluster-bootstrap SE (pp)."""
    names, rows = table["benchmarks"], table["rows"]
    lines = ["| N | Run | Step | " + " | ".join(DISPLAY_NAMES.get(n, n) for n in names) + " | Avg. |",
             "|---" * (len(names) + 4) + "|"]
    for row in rows:
        cells = [_number(row["pass_at_1"].get(name), 1, 100.0) for name in names]
        step = DASH if row["step"] is None else str(row["step"])
        lines.append(f"| {row['reuse']} | {row['label']} | {step} | " + " | ".join(cells)
                     + f" | {100 * row['average']:.1f} ± {100 * row['se']:.1f} |")
    lines += ["", "pass@1 (%): mean over problems of the mean Math-Verify score over samples; Avg.: macro "
              "average over the run's benchmarks ± its cluster-bootstrap standard error over problems "
              "(App. D.3), as python -m experiments.evaluate computed them. Step: the evaluated "
              "checkpoint's iteration."]
    sets = {tuple(row["benchmarks"]) for row in rows}
    if len(sets) > 1:
        lines.append("The runs were evaluated on different benchmark sets: their averages are not "
                     "comparable.")
    boots = {json.dumps(row["bootstrap"], sort_keys=True) for row in rows}
    if len(boots) > 1:
        lines.append("The runs' bootstrap settings differ: "
                     + "; ".join(f"{row['label']}: {row['bootstrap']}" for row in rows) + ".")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# App. E.3 (Tabs. 5-7)


def e3_window(runs: Sequence[Run], batches: int = PAPER_E3_BATCHES) -> dict:
    """The diagnostic window in rollout batches: the first `batches` (paper: 16), cut to the shortest run
    with rollout files. Returns {"batches": W, "allocation": (first, last) of Tab. 5 = the second half
    (paper: 9-16), "length": (1, W) of Tab. 7, "trajectory": [1, W // 2, W] of Tab. 6 (paper: 1, 8, 16)}."""
    with_files = [run for run in runs if run.rollouts]
    if not with_files:
        raise ReportError("none of the runs has rollout files (rollouts/iteration_*.npz)")
    if not isinstance(batches, int) or batches < 1:
        raise ReportError(f"batches must be a positive int; got {batches!r}")
    window = min(batches, *(int(run.rollouts[-1]["iteration"]) for run in with_files))
    return {"batches": window, "allocation": (window // 2 + 1, window), "length": (1, window),
            "trajectory": sorted({1, max(1, window // 2), window})}


def positive_branch_tables(runs: Sequence[Run], batches: int = PAPER_E3_BATCHES) -> dict:
    """Tabs. 5-7 (App. E.3) for every run with rollout files, over `e3_window(runs, batches)`.

    Returns {"window": ..., "labels": [...], "allocation": {label: `allocation_table` or None},
    "trajectory": {label: {iteration: row of `weight_length_trajectory`}}, "length": {label:
    `length_by_bin` or None}, "missing": {label: [iterations of the window without a rollout file]}}.
    None: no positive response in the window.
    """
    window = e3_window(runs, batches)
    with_files = [run for run in runs if run.rollouts]
    out = {"window": window, "labels": [run.label for run in with_files], "allocation": {}, "trajectory": {},
           "length": {}, "missing": {}}
    for run in with_files:
        present = {int(r["iteration"]) for r in run.rollouts}
        out["missing"][run.label] = [i for i in range(1, window["batches"] + 1) if i not in present]
        inside = [r for r in run.rollouts if int(r["iteration"]) <= window["batches"]]
        first, last = window["allocation"]
        try:
            out["allocation"][run.label] = positive_branch.allocation_table(inside, first, last)
        except ValueError:  # no positive response (or no file) in the window
            out["allocation"][run.label] = None
        trajectory = {row["iteration"]: row for row in positive_branch.weight_length_trajectory(inside)}
        out["trajectory"][run.label] = {i: trajectory.get(i) for i in window["trajectory"]}
        try:
            out["length"][run.label] = positive_branch.length_by_bin(inside, *window["length"])
        except ValueError:
            out["length"][run.label] = None
    return out


def positive_branch_markdown(tables: dict) -> str:
    """Tabs. 5, 6 and 7 as markdown, one column (group) per run."""
    window, labels = tables["window"], tables["labels"]
    first, last = window["allocation"]
    lines = [f"**Tab. 5** — positive-branch allocation, means over rollout batches {first}–{last}", "",
             "| Statistic | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for region in (positive_branch.LOW_W[0], positive_branch.DEEP_TAIL[0]):
        for key, what, fmt in (("response_share", "Positive responses with", "pct"),
                               ("mass_share", "Coefficient mass on", "pct"),
                               ("amplification", "Amplification on", "x")):
            cells = []
            for label in labels:
                table = tables["allocation"][label]
                value = None if table is None else table[region][key]
                if key == "amplification" and table is not None and table[region]["response_share"] == 0:
                    value = None  # no positive response in the region: the ratio is undefined
                if value is None:
                    cells.append(DASH)
                else:
                    cells.append(f"{100 * value:.1f}%" if fmt == "pct" else f"{value:.2f}×")
            lines.append(f"| {what} {region} | " + " | ".join(cells) + " |")
    lines += ["", "**Tab. 6** — mean log W and response length of the positive responses", "",
              "| Batch | " + " | ".join(f"log W: {label}" for label in labels) + " | "
              + " | ".join(f"length: {label}" for label in labels) + " |",
              "|---" * (2 * len(labels) + 1) + "|"]
    for iteration in window["trajectory"]:
        rows = [tables["trajectory"][label][iteration] for label in labels]
        log_w = [DASH if row is None else _signed(row["positive_log_w_mean"]) for row in rows]
        length = [DASH if row is None else _number(row["positive_length_mean"], 1) for row in rows]
        lines.append(f"| {iteration} | " + " | ".join(log_w) + " | " + " | ".join(length) + " |")
    a, b = window["length"]
    lines += ["", f"**Tab. 7** — count-weighted positive-response length by log W bin, rollout batches "
              f"{a}–{b} (relative to the run's positive-branch mean)", "",
              "| log W bin | W range | " + " | ".join(f"{label} length | {label} n" for label in labels)
              + " |",
              "|---" * (2 * len(labels) + 2) + "|"]
    for j, name in enumerate(positive_branch.bin_labels()):
        lower, upper = positive_branch.LOG_W_BIN_EDGES[j], positive_branch.LOG_W_BIN_EDGES[j + 1]
        cells = []
        for label in labels:
            table = tables["length"][label]
            row = None if table is None else table["bins"][j]
            if row is None or row["length_mean"] is None:
                cells += [DASH, "0" if row is not None else DASH]
            else:
                cells += [f"{row['length_mean']:.1f} ({row['relative']:.2f}×)", str(row["count"])]
        lines.append(f"| {name} | {_w_range(lower, upper)} | " + " | ".join(cells) + " |")
    cells = []
    for label in labels:
        table = tables["length"][label]
        if table is None:
            cells += [DASH, DASH]
        else:
            cells += [f"{table['branch_mean']:.1f}", str(table["branch_count"])]
    lines.append("| Positive-branch mean | – | " + " | ".join(cells) + " |")
    lines += ["", f"Diagnostic window: the first {window['batches']} rollout batch(es) (paper: 16; Tab. 5 "
              "over batches 9–16, Tab. 6 at 1, 8, 16, Tab. 7 over 1–16). Shares are pooled over each batch's "
              f"positive responses (Â > 0); coefficient mass is |Â|·φ. {DASH}: no positive response."]
    for label, missing in tables["missing"].items():
        if missing:
            lines.append(f"{label}: no rollout file for batch(es) {missing} of the window.")
    return "\n".join(lines) + "\n"


def _signed(value: float) -> str:
    return DASH if value is None or math.isnan(value) else f"{value:+.3f}"


def _w_range(lower: float, upper: float) -> str:
    def fmt(x: float) -> str:
        w = math.exp(x)
        if math.isinf(w):
            return "∞"
        return f"{w:.2g}" if (w < 0.01 or w >= 1000) and w != 0 else f"{w:.3g}"

    return f"({fmt(lower)}, {fmt(upper)}{')' if math.isinf(upper) else ']'}"


# ---------------------------------------------------------------------------------------------------
# The whole report


@dataclasses.dataclass
class Report:
    """A built report: markdown (linking the figures by file name), figures (file name -> Figure) and
    data (every table's numbers, JSON-serializable)."""

    markdown: str
    figures: dict[str, Figure]
    data: dict


def _jsonable(value):
    if isinstance(value, LengthBins):  # a NamedTuple: as a mapping, before tuples become lists
        return {field: _jsonable(getattr(value, field)) for field in value._fields}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return None if math.isnan(value) else (str(value) if math.isinf(value) else value)
    return value


def build_report(runs: Sequence[Run], *, windows: SummaryWindows | None = None,
                 e3_batches: int = PAPER_E3_BATCHES, num_bins: int = 10, title: str = "Run report") -> Report:
    """Every section the runs have data for: runs, training curves, early/late summary, Tab. 1, length
    bins (runs with evaluations), Tabs. 5-7 (runs with rollout files). Sections without data say why."""
    runs = list(runs)
    if not runs:
        raise ReportError("no runs to report")
    windows = windows or summary_windows(runs)
    figures: dict[str, Figure] = {}
    data: dict = {"runs": [], "windows": dataclasses.asdict(windows)}
    md = [f"# {title}", "", "## Runs", "",
          "| Run | Directory | Objective | N | M × G | Seed | Iterations | Policy updates | Rollout files "
          "| Evaluation |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        r = run.config["rollout"]
        evaluation = DASH if run.evaluation is None else (
            f"{run.evaluation.path} (step {run.evaluation.step})" if run.evaluation.step is not None
            else run.evaluation.path)
        md.append(f"| {run.label} | {run.path} | {run.objective} | {run.reuse} | "
                  f"{r['prompts_per_minibatch']} × {r['group_size']} | {run.seed} | {run.iterations} | "
                  f"{run.policy_updates} | {len(run.rollouts)} | {evaluation} |")
        data["runs"].append({"label": run.label, "path": run.path, "objective": run.objective,
                             "reuse": run.reuse, "seed": run.seed, "iterations": run.iterations,
                             "policy_updates": run.policy_updates, "rollout_files": len(run.rollouts),
                             "evaluation": None if run.evaluation is None else run.evaluation.path,
                             "notes": list(run.notes)})
    notes = [note for run in runs for note in run.notes]
    if notes:
        md += [""] + [f"- {note}" for note in notes]

    figures[CURVES_FIGURE] = curves_figure(runs)
    md += ["", "## Training curves (Figs. 3, 5)", "", f"![training curves]({CURVES_FIGURE})", "",
           "Training score (score+1)/2 (§4.1), mean response length, approximate KL (k1) and rollout-time "
           "entropy per RL iteration, against policy updates."]
    md += [f"- {note}" for note in missing_curves(runs)]

    summary = training_summary(runs, windows)
    data["training_summary"] = summary
    md += ["", "## Early and late training score (§4.1, App. E.1)", "",
           training_summary_markdown(summary, windows)]

    evaluated = [run for run in runs if run.evaluation is not None]
    md += ["## Evaluation (Tab. 1)", ""]
    if evaluated:
        table = evaluation_table(runs)
        data["evaluation"] = table
        md.append(evaluation_markdown(table))
        groups = length_bin_groups(runs, num_bins)
        data["length_bins"] = [{"reuse": g.reuse, "cap": g.cap, "edges": g.edges, "bins": g.bins}
                               for g in groups]
        figures[LENGTH_BINS_FIGURE] = length_bins_figure(groups)
        md += ["## Accuracy across response lengths (App. E.2, Tab. 4, Fig. 3 right)", "",
               f"![accuracy per length bin]({LENGTH_BINS_FIGURE})", "", length_bins_markdown(groups)]
    else:
        md += ["No run has evaluation outputs (run_dir/eval/summary.json from python -m "
               "experiments.evaluate, or --eval RUN_DIR=EVAL_DIR): no Tab. 1 and no length bins.", ""]

    md += ["## Positive-branch weight and length dynamics (App. E.3, Tabs. 5–7)", ""]
    if any(run.rollouts for run in runs):
        tables = positive_branch_tables(runs, e3_batches)
        data["positive_branch"] = tables
        md.append(positive_branch_markdown(tables))
        lacking = [run.label for run in runs if not run.rollouts]
        if lacking:
            md.append(f"No rollout files (rollouts/iteration_*.npz): {', '.join(lacking)}.\n")
    else:
        md += ["No run has rollout files (rollouts/iteration_*.npz): no E.3 tables.", ""]
    return Report(markdown="\n".join(md).rstrip() + "\n", figures=figures, data=_jsonable(data))


def _write_atomic(path: str, payload: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    handle, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(payload)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise


def write_report(report: Report, out_dir: str | os.PathLike, dpi: int = 120) -> str:
    """Writes report.md, report.json and the figures (PNG) into `out_dir` (created; files replaced
    atomically; a figure of an earlier report that this one lacks is removed, so no stale PNG stays
    next to it); returns the path of report.md."""
    import io

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    for name in REPORT_FIGURES:
        if name not in report.figures and os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    for name, fig in report.figures.items():
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=dpi)
        _write_atomic(os.path.join(out_dir, name), buffer.getvalue())
    _write_atomic(os.path.join(out_dir, "report.json"),
                  (json.dumps(report.data, indent=2, allow_nan=False) + "\n").encode("utf-8"))
    path = os.path.join(out_dir, "report.md")
    _write_atomic(path, report.markdown.encode("utf-8"))
    return path
