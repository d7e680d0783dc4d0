"""Reading runs for a report: a run directory and its evaluation, read and checked against each other.

`load_run` reads config.json (by the config's own loader and validator), metrics.jsonl, rollouts/ and
eval/ through `respo_jax.runs` (so a torn last metrics line is left out with a note, as every reader
does) and checks that the files belong to one run; `load_runs` does it for several with unique labels.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping, Sequence

import numpy as np

from respo_jax import runs as run_files
from respo_jax.eval.completions import load_completions, scores_by_problem
from respo_jax.eval.rollout_files import load_rollout_files
from respo_jax.runs import (
    COMPLETIONS_FILE,
    CONFIG_FILE,
    EVAL_CONFIG_FILE,
    EVAL_DIR,
    EVAL_SUMMARY_FILE,
    METRICS_FILE,
    ROLLOUT_DIR,
    RunFileError,
)
from respo_jax.config import ConfigError, ExperimentConfig, config_from_dict

# The paper's reporting protocol (§4.1, App. E.4): every run has 1,024 policy updates; the early peak is
# the maximum through update 256 and the late mean covers the last 128 updates.
PAPER_POLICY_UPDATES = 1024
PAPER_EARLY_UNTIL = 256
PAPER_LATE_WINDOW = 128
# App. E.3's diagnostic window: the first 16 rollout batches (Tab. 5 over batches 9-16, Tab. 7 over 1-16,
# Tab. 6 at batches 1, 8 and 16).
PAPER_E3_BATCHES = 16

SCORE_KEY = "train_accuracy"  # (score + 1) / 2 of the logged DAPO score (§4.1, App. D.1)
OBJECTIVE_NAMES = {"respo": "ReSPO", "vespo": "VESPO", "grpo": "GRPO", "gspo": "GSPO", "cispo": "CISPO",
                   "sapo": "SAPO", "luspo": "LUSPO", "dr_grpo": "Dr.GRPO"}


class ReportError(ValueError):
    """A directory or file cannot be reported as asked (not a run, damaged, or files that disagree)."""


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

    config: config.json as its loader reads it (`ExperimentConfig.to_dict()`, defaults for fields it
    lacks); records: every metrics.jsonl record (all phases) in file order; rollouts: the rollout files
    (`respo_jax.eval.rollout_files`), in iteration order, [] when the run wrote none; evaluation: its
    evaluation outputs or None; notes: things a reader should know (a torn last metrics line left out,
    an unfinished evaluation), shown in reports.
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
        return run_files.read_json(path)
    except RunFileError as err:
        raise ReportError(str(err)) from None


def _check_config(config: object, path: str) -> dict:
    """config.json read by the config's own loader and validator (`config_from_dict`), as a dict (a field
    the file lacks, written before the field existed, has its default; a key retired since is left out:
    a finished run is only read); ReportError naming the file and the key otherwise."""
    try:
        loaded = config_from_dict(ExperimentConfig, config, drop_retired=True)
    except ConfigError as err:
        raise ReportError(f"{path}: {err} (is this a config.json written by python -m experiments.train?)"
                          ) from None
    return loaded.to_dict()


def _read_metrics(path: str) -> tuple[list[dict], list[str]]:
    """(records, notes) of a metrics.jsonl by `respo_jax.runs.read_jsonl`: a torn last line (a killed
    writer) is left out with a note; any other damaged line raises ReportError naming the file and line."""

    def keep(record: dict, where: str) -> dict:
        if not isinstance(record.get("phase"), str):
            raise ReportError(f"{where}: expected a JSON object with a 'phase'; got {record!r:.80}")
        record["_line"] = int(where.rsplit(":", 1)[1])
        return record

    try:
        log = run_files.read_jsonl(path, keep)
    except RunFileError as err:
        raise ReportError(f"{err.where}: damaged record ({err.problem})") from None
    return log.records, [log.torn_note] if log.torn_note else []


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
    summary_path = os.path.join(eval_dir, EVAL_SUMMARY_FILE)
    completions_path = os.path.join(eval_dir, COMPLETIONS_FILE)
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
    config_path = os.path.join(eval_dir, EVAL_CONFIG_FILE)
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
        if os.path.isfile(os.path.join(default, EVAL_SUMMARY_FILE)):
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


