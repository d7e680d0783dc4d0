"""Gradient starvation at CPU scale: a matched sweep of objectives x rollout-reuse ratio N x seeds
(paper §3.2, §4.1-4.3, App. E.3) on the synthetic scratchpad task, and its report.

    python -m experiments.gradient_starvation                      # the full sweep, then its report
    python -m experiments.gradient_starvation --quick              # a reduced sweep in minutes
    python -m experiments.gradient_starvation sweep.seeds=0 sweep.reuse=1,32 optim.learning_rate=1e-3
    python -m experiments.gradient_starvation --report-only        # re-report the finished cells
    python -m experiments.gradient_starvation --config experiments/configs/gradient_starvation_v3.py \
        --pilot-report                                              # the third study's pilot decision

Steps: (1) the shared base model — the supervised warm-up of `sweep.base_seed`, saved once in
Hugging Face format under sweep.runs_dir/base; (2) every cell (`respo_jax.training.sweep`) trained by
the main trainer (`experiments.train.run_experiment`) from that base into sweep.runs_dir/cells/<name>;
(3) the report in sweep.out_dir: summary.json, summary.md and gradient_starvation.png, computed with
`respo_jax.eval` (early peak, late mean, App. E.3's positive-branch allocation) from the cells' run
directories by `experiments.starvation_summary`, laid out by `experiments.starvation_tables` (markdown)
and `experiments.starvation_figures`.

One sweep at a time per sweep.runs_dir: a second one is refused in one line naming the first (its
lock, `respo_jax.training.run_lock`, is held for the whole sweep; each cell's trainer also locks the
cell's directory). Resumable per cell: a cell trains in `<name>.partial/` and is renamed to `<name>/`
only when finished (metrics, rollout files, held-out evaluation; its checkpoints are deleted), so a
killed sweep resumes the unfinished cell from its latest checkpoint and never recomputes a finished one
(SIGTERM and SIGINT save a checkpoint at the iteration in flight and exit with status 143 / 130, see
respo_jax.training.preemption). A finished cell or
base model made with a different config is refused (ConfigError naming the keys), never mixed in. Exit
status 2 on a configuration error (one line on stderr), 1 when a run fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time

import experiments.signals_at_start  # noqa: F401  (first: a signal during the imports below stops cleanly)

import numpy as np
from tqdm import tqdm

from experiments.cli import ArgumentParser, load_config, run_cli, run_failures
from experiments.starvation_figures import controls_figure, grid_figure, starvation_figure
from experiments.starvation_summary import (THIRD_STUDY_TASK, cell_window, json_view, selection_score,
                                            settings_view, summarize)
from experiments.starvation_tables import second_study_markdown, summary_markdown
from respo_jax.eval.report import ReportError, load_run
from respo_jax.files import file_sha256
from respo_jax.runs import atomic_write_bytes
from respo_jax.training import preemption, run_dir
from respo_jax.training.compilation import configure_compilation_cache
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.run_lock import RunLock
from respo_jax.training.sweep import Cell, StarvationConfig, select_learning_rate

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "gradient_starvation.py")
BASE_INFO = "base.json"  # in the base model directory: the config that made it, its checksum, accuracy
CELL_INFO = "sweep_cell.json"  # in a finished cell: the cell and the base model it started from
SUMMARY_JSON, SUMMARY_MD, FIGURE = "summary.json", "summary.md", "gradient_starvation.png"
GRID_FIGURE, CONTROLS_FIGURE, LONG_FIGURE = "grid.png", "controls.png", "long_regime.png"  # second study
PILOT_JSON, PILOT_MD = "decision.json", "decision.md"  # third study: the pilot's decision (--pilot-report)


# ---------------------------------------------------------------------------------------------------
# Config


def load_sweep_config(path: str, quick: bool = False) -> StarvationConfig:
    """The config file's `get_config()` (or `get_quick_config()` with `quick`), a StarvationConfig."""
    function = "get_quick_config" if quick else "get_config"
    return load_config(path, StarvationConfig, function, "starvation_config")


# ---------------------------------------------------------------------------------------------------
# Running


def base_fingerprint(config: StarvationConfig, regime: str = "") -> dict:
    """The settings that define the base model and its held-out score: model, task, warm-up, its seed,
    the held-out problems and the generation cap (not the RL settings, which cells may vary)."""
    view = settings_view(config.base_experiment(regime))
    fingerprint = {"model": view["model"], "task": view["task"], "warmup": view["warmup"],
                   "run.seed": view["run"]["seed"], "run.eval_problems": view["run"]["eval_problems"],
                   "rollout.max_new_tokens": view["rollout"]["max_new_tokens"]}
    if config.run.eval_samples:  # the second study's sampled held-out score (absent: the first study's)
        fingerprint.update({f"run.{k}": view["run"][k] for k in ("eval_samples", "eval_temperature",
                                                                   "eval_top_p")})
    return fingerprint


def prepare_base(config: StarvationConfig, show: bool = True, regime: str = "") -> dict:
    """The shared base model of `regime`: reads sweep.runs_dir/base (base_long) when it was made by this
    config, else runs the warm-up, evaluates it on the held-out split and saves it (atomically: written to
    base.partial/, then renamed). Returns its base.json: {"config", "sha256", "greedy_accuracy",
    "sft_loss_last", "seconds"} and, with run.eval_samples, "held_out" (`RLTrainer.evaluation`)."""
    from respo_jax.models.qwen3 import save_pretrained
    from respo_jax.training.loop import RLTrainer

    base_dir, experiment = config.regime_base_dir(regime), config.base_experiment(regime)
    wanted = base_fingerprint(config, regime)
    info_path = os.path.join(base_dir, BASE_INFO)
    if os.path.isdir(base_dir):
        if not os.path.isfile(info_path):
            raise ConfigError(f"{base_dir} exists but has no {BASE_INFO} (not a base model of this sweep); "
                              "remove it or choose another sweep.runs_dir")
        info = run_dir.read_json(info_path)
        if info.get("config") != wanted:
            saved = info.get("config") or {}
            keys = sorted(k for k in wanted if saved.get(k) != wanted[k])
            raise ConfigError(f"{base_dir} holds a base model made with a different config (differs in "
                              f"{keys}); its cells would not be matched: choose another sweep.runs_dir "
                              "or delete that directory")
        return info
    trainer = RLTrainer(experiment)
    partial = base_dir + ".partial"
    losses, seconds = warm_up_base(trainer, partial, wanted, show)
    started = time.perf_counter()  # the evaluation and the save (the warm-up's own time: `seconds`)
    held_out = trainer.evaluation() or {}
    accuracy = held_out.get("greedy_accuracy")
    shutil.rmtree(os.path.join(partial, run_dir.CHECKPOINT_DIR), ignore_errors=True)
    if os.path.exists(os.path.join(partial, WARMUP_PROGRESS)):
        os.remove(os.path.join(partial, WARMUP_PROGRESS))
    save_pretrained(trainer.model(), partial)
    weights = sorted(f for f in os.listdir(partial) if f.endswith(".safetensors"))
    info = {
        "config": wanted,
        "sha256": hashlib.sha256("".join(file_sha256(os.path.join(partial, f)) for f in weights).encode())
        .hexdigest(),
        "greedy_accuracy": accuracy,
        "sft_loss_last": float(np.mean(losses[-10:])) if losses else None,
        "seconds": seconds + time.perf_counter() - started,
    }
    if config.run.eval_samples:
        info["held_out"] = held_out
    if len(losses) >= 2 * LOSS_CURVE_STEPS:  # a long warm-up: its plateau, checked before any cell runs
        info["sft_loss_curve"] = [float(np.mean(losses[i:i + LOSS_CURVE_STEPS]))
                                  for i in range(0, len(losses), LOSS_CURVE_STEPS)]
    run_dir.atomic_write_json(os.path.join(partial, BASE_INFO), info)
    os.replace(partial, base_dir)
    return info


WARMUP_PROGRESS = "warmup_progress.json"  # in base.partial/: the fingerprint, losses and seconds so far
LOSS_CURVE_STEPS = 100  # base.json's "sft_loss_curve": the mean warm-up loss of each this many steps


def warm_up_base(trainer, partial: str, wanted: dict, show: bool) -> tuple[list[float], float]:
    """The base model's warm-up in `partial`/, resumable: (its per-step losses, its seconds of wall time).

    A signal (SIGTERM, SIGINT: `respo_jax.training.preemption`) or run.checkpoint_every_minutes saves a
    warm-up checkpoint (`respo_jax.training.warmup_checkpoint`) in partial/checkpoints with the losses so
    far; a signal then raises Preempted. A rerun with the same fingerprint goes on from the newest intact
    checkpoint, bit for bit; a partial of another fingerprint is discarded."""
    from respo_jax.training import warmup_checkpoint

    checkpoints = os.path.join(partial, run_dir.CHECKPOINT_DIR)
    progress_path = os.path.join(partial, WARMUP_PROGRESS)
    progress = run_dir.read_json(progress_path) if os.path.isfile(progress_path) else {}
    start = None
    if progress.get("config") == wanted:
        start = warmup_checkpoint.restore(trainer, checkpoints)[1]
    if start is None:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    losses = list(progress.get("losses", []))[:start.step] if start else []
    seconds = float(progress.get("seconds", 0.0)) if start else 0.0
    steps = trainer.config.warmup.steps
    clock, started = preemption.Clock(trainer.config.run.checkpoint_every_minutes), time.perf_counter()

    def save() -> str:
        kept = warmup_checkpoint.save(trainer, checkpoints, len(losses), "")
        run_dir.atomic_write_json(progress_path, {"config": wanted, "losses": losses,
                                                  "seconds": seconds + time.perf_counter() - started})
        clock.reset()
        return kept

    with tqdm(trainer.warmup(start), total=steps, initial=start.step if start else 0,
              desc="base model warm-up", disable=not show) as bar:
        for record in bar:
            losses.append(record["sft_loss"])
            signum, due = preemption.stop_agreed(clock)
            if signum or (due and record["step"] < steps):
                kept = save()
                if signum:
                    raise preemption.Preempted(f"{preemption.signal_name(signum)} after base warm-up step "
                                               f"{record['step']} of {steps}: {kept}", signum)
    return losses, seconds + time.perf_counter() - started


# A cell's config.json stores these paths relative to the working directory the sweep ran from (the
# repository root), so that its cells can be moved with the repository and read from any checkout path.
PORTABLE_PATHS = (("model", "checkpoint_dir"), ("run", "out_dir"), ("run", "compilation_cache_dir"))


def portable_paths(saved: dict, root: str | None = None) -> dict:
    """A copy of a cell's config.json with each of PORTABLE_PATHS that lies under `root` (default: the
    working directory) made relative to it."""
    root = os.path.abspath(root or os.getcwd())
    out = {section: dict(values) for section, values in saved.items()}
    for section, key in PORTABLE_PATHS:
        path = out.get(section, {}).get(key)
        if isinstance(path, str) and os.path.isabs(path) and os.path.commonpath([path, root]) == root:
            out[section][key] = os.path.relpath(path, root)
    return out


def resolved_paths(saved: dict) -> dict:
    """A copy of a cell's config.json with its relative model.checkpoint_dir resolved against the working
    directory, as `StarvationConfig.experiment` gives it (the other PORTABLE_PATHS are not compared)."""
    out = {section: dict(values) for section, values in saved.items()}
    path = out.get("model", {}).get("checkpoint_dir")
    if isinstance(path, str) and path and not os.path.isabs(path):
        out["model"]["checkpoint_dir"] = os.path.abspath(path)
    return out


def without_retired(saved: dict, expected) -> dict:
    """A copy of a finished cell's config.json without the keys retired since it ran (each section's
    `retired`): a finished cell is only read, never continued, and a retired key was one the engine's
    schedule read, which never changed a sample (a run directory that would be resumed is still refused)."""
    return {section: {key: value for key, value in values.items()
                      if key not in getattr(getattr(expected, section, None), "retired", {})}
            if isinstance(values, dict) else values
            for section, values in saved.items()}


def finished(config: StarvationConfig, cell: Cell, base: dict) -> bool:
    """Whether `cell` is done (its directory exists); ConfigError when it was run with another config
    or from another base model (a stale cell is never mixed into a report)."""
    path = config.cell_dir(cell)
    if not os.path.isdir(path):
        return False
    info_path, config_path = os.path.join(path, CELL_INFO), os.path.join(path, run_dir.CONFIG_FILE)
    if not (os.path.isfile(info_path) and os.path.isfile(config_path)):
        raise ConfigError(f"{path} is not a finished cell ({CELL_INFO} or config.json missing); remove it")
    info, saved = run_dir.read_json(info_path), resolved_paths(run_dir.read_json(config_path))
    expected = config.experiment(cell)
    problems = run_dir.config_differences(without_retired(saved, expected), expected)
    if saved.get("run", {}).get("policy_updates") != expected.run.policy_updates:
        problems.append(f"run.policy_updates: saved {saved.get('run', {}).get('policy_updates')!r}, "
                        f"now {expected.run.policy_updates!r}")
    if info.get("base_sha256") != base["sha256"]:
        problems.append("it started from another base model")
    if problems:
        raise ConfigError(f"{path} was run with a different config ({'; '.join(problems[:3])}); choose "
                          "another sweep.runs_dir or delete the cell")
    return True


def selected_learning_rates(config: StarvationConfig, bases: dict) -> tuple[dict, list[dict]]:
    """({(objective, N): best lr}, the selection records) from the finished selection-seed cells; an
    (objective, N) gets its lr only once every lr of the grid has finished on the selection seed."""
    s = config.sweep
    best, records = {}, []
    if s.selection_seed < 0:
        return best, records
    for reuse in s.reuse_list:
        objectives = s.on_policy_list if reuse == 1 < max(s.reuse_list) else s.objective_list
        if reuse == max(s.reuse_list):
            objectives = objectives + s.control_list
        for objective in objectives:
            scores = {}
            for lr in s.learning_rate_list:
                cell = Cell(objective, reuse, s.selection_seed, lr)
                if finished(config, cell, bases[""]):
                    info = run_dir.read_json(os.path.join(config.cell_dir(cell), CELL_INFO))
                    scores[lr] = info.get("selection_score")
            if len(scores) == len(s.learning_rate_list):
                best[(objective, reuse)] = select_learning_rate(scores)
                records.append({"objective": objective, "reuse": reuse, "seed": s.selection_seed,
                                "late_means": {f"{lr:g}": v for lr, v in scores.items()},
                                "best_learning_rate": best[(objective, reuse)]})
    return best, records


def run_cell(config: StarvationConfig, cell: Cell, base: dict) -> None:
    """Trains one cell in <cell>.partial/, drops its checkpoints and renames it to <cell>/."""
    from experiments.train import run_experiment

    final = config.cell_dir(cell)
    partial = final + ".partial"
    started = time.perf_counter()
    run_experiment(config.experiment(cell, out_dir=partial))
    shutil.rmtree(os.path.join(partial, run_dir.CHECKPOINT_DIR), ignore_errors=True)
    saved = run_dir.read_json(os.path.join(partial, run_dir.CONFIG_FILE))
    saved["run"]["out_dir"] = final
    run_dir.atomic_write_json(os.path.join(partial, run_dir.CONFIG_FILE), portable_paths(saved))
    run_dir.atomic_write_json(os.path.join(partial, CELL_INFO), {
        "cell": dataclasses.asdict(cell), "base_sha256": base["sha256"],
        "seconds": time.perf_counter() - started,
        "selection_score": selection_score(load_run(partial), cell_window(config, cell))})
    os.replace(partial, final)


# ---------------------------------------------------------------------------------------------------
# Report (computed by experiments.starvation_summary, laid out by starvation_tables and starvation_figures)


def report_markdown(summary: dict) -> str:
    """summary.md: the first study's tables, the second study's, or (third study) the first study's with
    the paired endpoint tables."""
    if "selection" in summary:
        return second_study_markdown(summary)
    text = summary_markdown(summary)
    if "paired" in summary:
        from experiments.starvation_v3 import paired_markdown

        text += "\n## Paired endpoints (cluster bootstrap over problems x seeds)\n\n" + paired_markdown(
            summary["paired"])
    return text


def pilot_report(config: StarvationConfig) -> dict:
    """The third study's pilot decision from its base model and finished GRPO cells (trains nothing):
    decision.json and decision.md in sweep.out_dir (`experiments.starvation_v3.pilot_decision`)."""
    from experiments.starvation_v3 import pilot_decision, pilot_markdown

    if not os.path.isfile(os.path.join(config.base_dir, BASE_INFO)):
        raise ConfigError(f"--pilot-report: no base model in {config.base_dir} (its warm-up has not "
                          "finished)")
    base = prepare_base(config, show=False)  # checks that it was made by this config
    cells = [c for c in config.cells() if c.objective == "grpo"]
    runs = {c.name: load_run(config.cell_dir(c)) for c in cells if finished(config, c, base)}
    decision = pilot_decision(base, json_view(config.base_experiment().to_dict()), runs,
                              [c.name for c in cells if c.name not in runs])
    os.makedirs(config.sweep.out_dir, exist_ok=True)
    texts = {PILOT_JSON: json.dumps(decision, indent=1) + "\n", PILOT_MD: pilot_markdown(decision)}
    for name, text in texts.items():
        atomic_write_bytes(os.path.join(config.sweep.out_dir, name), text.encode())
        os.chmod(os.path.join(config.sweep.out_dir, name), 0o644)
    print(pilot_markdown(decision))
    return decision


def _curves_of(summary: dict, keep) -> dict:
    """`summary` restricted to the cells `keep(cell)` accepts (for `starvation_figure`)."""
    return dict(summary, cells=[c for c in summary["cells"] if keep(c)])


def write_outputs(summary: dict, out_dir: str) -> list[str]:
    """summary.json, summary.md and the figures in out_dir (each written atomically): the curves, and in
    the second study the grid, the controls and the long regime."""
    import io

    os.makedirs(out_dir, exist_ok=True)
    second = "selection" in summary
    paths = [os.path.join(out_dir, name) for name in (SUMMARY_JSON, SUMMARY_MD)]
    atomic_write_bytes(paths[0], (json.dumps(summary, indent=1) + "\n").encode())
    atomic_write_bytes(paths[1], report_markdown(summary).encode())
    figures = {FIGURE: lambda: starvation_figure(summary)}
    if second:
        settings = summary["settings"]
        common, selection_seed = settings["optim"]["learning_rate"], settings["sweep"]["selection_seed"]
        figures[FIGURE] = lambda: starvation_figure(_curves_of(summary, lambda c: (
            c["regime"] == "" and c["seed"] != selection_seed and math.isclose(c["learning_rate"], common))))
        figures[GRID_FIGURE] = lambda: grid_figure(summary)
        figures[CONTROLS_FIGURE] = lambda: controls_figure(summary)
        if summary["long_regime"]:
            figures[LONG_FIGURE] = lambda: starvation_figure(
                _curves_of(summary, lambda c: c["regime"] == "long"))
    for name, make in figures.items():
        buffer = io.BytesIO()
        make().savefig(buffer, format="png", dpi=90)
        paths.append(os.path.join(out_dir, name))
        atomic_write_bytes(paths[-1], buffer.getvalue())
    for path in paths:  # results to share (the temp files are private)
        os.chmod(path, 0o644)
    return paths


# ---------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("--quick", action="store_true", help="the config file's get_quick_config()")
    parser.add_argument("--report-only", action="store_true", help="report the finished cells, train nothing")
    parser.add_argument("--pilot-report", action="store_true",
                        help="the pilot's decision from its base and finished GRPO cells; train nothing")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    config = apply_overrides(load_sweep_config(args.config, args.quick), args.overrides)
    if args.pilot_report:
        configure_compilation_cache(config.compilation_cache_dir, key="sweep.compilation_cache")
        return pilot_report(config)
    if args.report_only:  # reads the cells (a running sweep may go on) and writes only the report
        return _sweep(config, args.report_only)
    # One sweep per runs_dir (the base model and the cells are its files); each cell's training also
    # holds its own directory's lock (experiments.train.run_experiment).
    preemption.stop_at_start()  # a signal that came while the program started: before the first write
    lock = RunLock.acquire(config.sweep.runs_dir, "gradient-starvation sweep", key="sweep.runs_dir")
    try:
        with preemption.handling():  # a cell stopped by a signal keeps its checkpoint (experiments.train)
            return _sweep(config, args.report_only)
    except preemption.Preempted as err:
        raise preemption.Preempted(f"{err}; resume the sweep: rerun the same command", err.signum) from None
    finally:
        lock.release(remove_if_created=True)


def _sweep(config: StarvationConfig, report_only: bool) -> dict:
    configure_compilation_cache(config.compilation_cache_dir, key="sweep.compilation_cache")
    if report_only:
        base_dir = config.base_dir
        if not os.path.isfile(os.path.join(base_dir, BASE_INFO)):
            raise ConfigError(f"--report-only: no base model in {base_dir} (nothing was run)")
    bases = {"": prepare_base(config, show=True)}
    long_info = os.path.join(config.regime_base_dir("long"), BASE_INFO)
    if config.sweep.long_difficulty and os.path.isfile(long_info):
        bases["long"] = prepare_base(config, show=True, regime="long")  # checks a finished one matches
    best, selection = selected_learning_rates(config, bases)
    cells = config.cells(best)
    todo = [c for c in cells if not (c.regime in bases and finished(config, c, bases[c.regime]))]
    if not report_only:
        # The cell list grows as the selection cells finish (the cells at a selected lr), so the list
        # is rebuilt after every cell; the order is `StarvationConfig.cells`'.
        bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc="cells", disable=False)
        try:
            while todo:
                cell = todo[0]
                if cell.regime not in bases:
                    bases[cell.regime] = prepare_base(config, show=True, regime=cell.regime)
                bar.set_postfix_str(cell.name)
                run_cell(config, cell, bases[cell.regime])
                best, selection = selected_learning_rates(config, bases)
                cells = config.cells(best)
                todo = [c for c in cells if not (c.regime in bases and finished(config, c, bases[c.regime]))]
                bar.total = len(cells)
                bar.update(1)
        finally:  # also when a cell stops on a signal: its one line then starts a line of its own
            bar.close()
    runs = {c: load_run(config.cell_dir(c)) for c in cells
            if c.regime in bases and finished(config, c, bases[c.regime])}
    if not runs:
        raise ConfigError(f"no finished cell in {os.path.join(config.sweep.runs_dir, 'cells')}")
    summary = summarize(config, bases, runs, best, selection)
    if config.task.difficulty == THIRD_STUDY_TASK:  # the mixed lengths: paired endpoints on long problems
        from experiments.starvation_v3 import paired_endpoints

        summary["paired"] = paired_endpoints(summary["cells"], {c.name: run for c, run in runs.items()})
    paths = write_outputs(summary, config.sweep.out_dir)
    print(report_markdown(summary))
    print("\n".join(paths))
    return summary


def cli(argv: list[str]) -> int:
    """`main` for the command line: exit status 2 on a configuration error, 1 when a run or the report
    fails, each with one line on stderr."""
    return run_cli(main, argv, failures=run_failures() + (ReportError,))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
