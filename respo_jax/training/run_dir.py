"""A run directory is the result of a run: the guards that keep runs from mixing, losing or tearing it.

Layout of `run.out_dir` (the names are a contract with readers such as the evaluation and report tools):

    config.json          the validated config of the run (rewritten on resume with the new run.* values)
    metrics.jsonl        one JSON record per warm-up step, RL iteration or evaluation, append-only
    summary.json         `experiments.train.summarize` of metrics.jsonl, written at the end
    training_curves.png  the curves of metrics.jsonl, written at the end
    checkpoints/<step>/  Orbax checkpoints with a SHA-256 manifest (`respo_jax.training.checkpoint`)
    rollouts/iteration_%06d.npz   per-response arrays of each iteration (`respo_jax.eval.rollout_files`)

Rules (`plan_run_dir` decides, before anything is written):
- a directory without these entries starts a fresh run (with or without `run.resume`);
- a directory holding a run is refused unless `run.resume=true` (its config must equal this one except
  for `RESUMABLE_KEYS`) or `run.overwrite=true` (its run entries are deleted first; other files stay);
- resume rewinds the log to the restored checkpoint (`rewind`): metrics records and rollout files after
  it are dropped, a torn last line with them, so the directory reads exactly as an uninterrupted run's;
  a log that is not one writer's (`check_log`: iterations repeated or out of order, as two runs in one
  directory leave them) is refused instead, since cutting it back would keep the wrong records.
- the lock file `.lock` (`respo_jax.training.run_lock`) is not a run entry.
Files that are replaced as a whole are written atomically (temp file + fsync + rename); metrics records
are appended and fsync'ed one by one, before any checkpoint that counts them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from typing import Any

from respo_jax.training.config import ConfigError, ExperimentConfig, config_from_dict
from respo_jax.training.write_errors import writing

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CURVES_FILE = "training_curves.png"
CHECKPOINT_DIR = "checkpoints"
ROLLOUT_DIR = "rollouts"
# devices, mesh axis sizes and where the parameters live (param_bytes_total, param_bytes_max_per_device)
RUN_INFO_FILE = "run_info.json"
# what respo_jax.training.trackers writes here: TensorBoard's event files, the W&B run id and last row
TENSORBOARD_DIR = "tensorboard"
WANDB_FILE = "wandb_run.json"
RUN_ENTRIES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CURVES_FILE, CHECKPOINT_DIR, ROLLOUT_DIR,
               RUN_INFO_FILE, TENSORBOARD_DIR, WANDB_FILE)
ROLLOUT_FILE = re.compile(r"iteration_(\d{6,})\.npz")
# What a run that failed to write (a full disk) tells the user to do: its checkpoints are intact.
RESUME_HINT = "the checkpoints written so far are kept; make room and rerun with run.resume=true"

# Config keys that may differ between a run and its resumption: how long it runs, how often it
# checkpoints, what it shows (progress, and the trackers besides metrics.jsonl: a tracker added on
# resume receives the whole log), where the directory lives, host-side allocator settings, and how much
# memory a step may use (rows per micro-batch of the update and of log π_old, rows per sampler chunk:
# the same computation split differently, so a resumed run that changes them equals the uninterrupted
# one to float round-off instead of bit for bit), when and where programs compile, and the device mesh (the same
# computation placed differently: a run preempted on one slice may continue on another). Everything
# else (model, task, rollout sizes and shape buckets, objective, optimizer, warm-up, seeds, held-out
# problems) defines the run; so does the learning-rate warm-up length that optim.warmup_ratio derives
# from the run length.
RESUMABLE_KEYS = frozenset({
    "run.iterations", "run.policy_updates", "run.checkpoint_every", "run.progress", "run.resume",
    "run.overwrite", "run.out_dir", "run.host_allocator", "rollout.max_tokens_per_microbatch",
    "rollout.sampler_max_rows", "rollout.compile_ahead", "rollout.max_prompt_buckets",
    "run.compilation_cache_dir", "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.expert", "run.loggers",
})


class RunDirError(ConfigError):
    """`run.out_dir` cannot be used as configured (another run, a config mismatch, a damaged log)."""


@dataclasses.dataclass(frozen=True)
class RunDirPlan:
    """What start-up will do with `out_dir`: "fresh" (nothing there), "resume" or "overwrite"."""

    out_dir: str
    mode: str
    entries: tuple[str, ...] = ()  # the run entries found there


def run_entries(out_dir: str) -> tuple[str, ...]:
    """The entries of `RUN_ENTRIES` present in `out_dir`."""
    return tuple(name for name in RUN_ENTRIES if os.path.lexists(os.path.join(out_dir, name)))


def flatten_config(config: dict) -> dict[str, Any]:
    """{"section.field": value} of a config dict (dict-valued fields such as objective.hparams stay whole)."""
    return {f"{section}.{name}": value
            for section, fields in config.items() for name, value in fields.items()}


def config_differences(saved: Any, current: ExperimentConfig) -> list[str]:
    """The keys, outside `RESUMABLE_KEYS`, whose value in `current` differs from the `saved` config.json;
    a key missing from `saved` (a field added since) matches when `current` has its default."""
    if not (isinstance(saved, dict) and saved and all(isinstance(v, dict) for v in saved.values())):
        return ["(the saved config.json is not a config written by this trainer)"]
    now = flatten_config(json.loads(json.dumps(current.to_dict())))  # the JSON view: tuples are lists
    default = flatten_config(json.loads(json.dumps(ExperimentConfig().to_dict())))
    before = flatten_config(saved)
    diffs = []
    for key in sorted(set(now) | set(before)):
        if key in RESUMABLE_KEYS:
            continue
        old = before.get(key, default.get(key))
        if key not in now:
            diffs.append(f"{key}: saved {old!r}, unknown now")
        elif old != now[key]:
            diffs.append(f"{key}: saved {old!r}, now {now[key]!r}")
    if not diffs:  # the run length may change, but not the learning-rate schedule it sets via warmup_ratio
        try:
            before_warmup = config_from_dict(ExperimentConfig, saved, validate=False).lr_warmup_steps
        except (KeyError, TypeError, ValueError) as err:
            return [f"(the saved config.json does not load: {err})"]
        if before_warmup != current.lr_warmup_steps:
            diffs.append(f"the learning-rate warm-up (optim.warmup_ratio x the run length): saved "
                         f"{before_warmup} steps, now {current.lr_warmup_steps}")
    return diffs


def read_json(path: str) -> Any:
    """A JSON file; RunDirError names the file and line when it is not valid JSON."""
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise RunDirError(f"{path}: not UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise RunDirError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None


def plan_run_dir(config: ExperimentConfig) -> RunDirPlan:
    """Decides what start-up does with `config.run.out_dir`; reads, never writes. Raises RunDirError
    when the directory holds a run and neither resume nor overwrite is asked, or the saved config differs."""
    run = config.run
    out_dir = run.out_dir
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise RunDirError(f"run.out_dir={out_dir!r}: expected a directory; a file of that name exists")
    entries = run_entries(out_dir) if os.path.isdir(out_dir) else ()
    if not entries:
        return RunDirPlan(out_dir, "fresh")
    if run.overwrite:
        return RunDirPlan(out_dir, "overwrite", entries)
    if not run.resume:
        raise RunDirError(
            f"run.out_dir={out_dir!r} already holds a run ({', '.join(entries)}); pass run.resume=true to "
            "continue it, run.overwrite=true to replace it, or another run.out_dir"
        )
    config_path = os.path.join(out_dir, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise RunDirError(f"run.resume=true: {out_dir!r} holds run files ({', '.join(entries)}) but no "
                          f"{CONFIG_FILE} to check this config against; run.overwrite=true replaces them")
    diffs = config_differences(read_json(config_path), config)
    if diffs:
        raise RunDirError(
            f"run.resume=true: this config differs from {config_path} in {'; '.join(diffs)} (only "
            f"{', '.join(sorted(RESUMABLE_KEYS))} may change on resume)"
        )
    return RunDirPlan(out_dir, "resume", entries)


# -------------------------------------------------------------------------------------- writing


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes `path` so that a kill leaves either the old file or the new one, never half of one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
    _fsync_dir(folder)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"))


def _fsync_dir(folder: str) -> None:
    """Makes a rename in `folder` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clear_run(out_dir: str) -> None:
    """Deletes the run entries (and temp files a killed write left) of `out_dir`; other files stay."""
    for name in run_entries(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    _remove_temp_files(out_dir)


def _remove_temp_files(out_dir: str) -> None:
    for name in os.listdir(out_dir):
        ours = any(name.startswith(f".{entry}.") for entry in RUN_ENTRIES)
        if ours and name.endswith(".tmp"):
            os.remove(os.path.join(out_dir, name))


def start_run_dir(plan: RunDirPlan, config: ExperimentConfig) -> None:
    """The first write of a run: clears an overwritten run, then writes config.json atomically."""
    if plan.mode == "overwrite":
        clear_run(plan.out_dir)
    os.makedirs(plan.out_dir, exist_ok=True)
    _remove_temp_files(plan.out_dir)
    atomic_write_json(os.path.join(plan.out_dir, CONFIG_FILE), config.to_dict())


def read_metrics(path: str, keep: int) -> tuple[list[dict], int]:
    """(records, bytes they take) of the first `keep` records of a metrics.jsonl.

    Whatever follows them is not read (records after a checkpoint, a line torn by a kill); a damaged
    line among them, or fewer than `keep` complete records, raises RunDirError naming the file and line.
    """
    if not os.path.isfile(path):
        if keep:
            raise RunDirError(f"{path} is missing; the checkpoint counts {keep} records in it")
        return [], 0
    with open(path, "rb") as handle:
        data = handle.read()
    records: list[dict] = []
    offset = 0
    lineno = 0
    while offset < len(data) and len(records) < keep:
        end = data.find(b"\n", offset)
        lineno += 1
        line = data[offset:] if end < 0 else data[offset:end]
        try:
            if end < 0:
                raise ValueError("no line end (torn write)")
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, expected an object")
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RunDirError(f"{path}:{lineno}: damaged record ({err}); the checkpoint counts {keep} "
                              "records") from None
        records.append(record)
        offset = end + 1
    if len(records) < keep:
        raise RunDirError(f"{path} holds {len(records)} complete records; the checkpoint counts {keep}")
    return records, offset


def log_problem(records: list[dict]) -> str | None:
    """None when `records` read as one writer's log: warm-up steps 1, 2, ... first, then RL iterations
    1, 2, ... in order (evaluations anywhere after the warm-up); else the first thing out of place, in a
    few words (two writers that shared a directory leave two warm-ups or an iteration twice)."""
    warmup_steps, iterations = 0, 0
    for index, record in enumerate(records, start=1):
        phase = record.get("phase")
        if phase == "warmup":
            if iterations or record.get("step") != warmup_steps + 1:
                return (f"record {index} is warm-up step {record.get('step')!r} after "
                        f"{warmup_steps} warm-up steps and {iterations} RL iterations")
            warmup_steps += 1
        elif phase == "rl":
            if record.get("iteration") != iterations + 1:
                return (f"record {index} is RL iteration {record.get('iteration')!r} after iteration "
                        f"{iterations}")
            iterations += 1
    return None


def check_log(out_dir: str, metrics_records: int, iteration: int) -> list[dict]:
    """The first `metrics_records` records of `out_dir`'s metrics.jsonl (what a checkpoint of RL
    iteration `iteration` counts), after checking that the whole log is one writer's (`log_problem`) and
    that those records hold exactly iterations 1..`iteration`. Reads only; RunDirError (one line) for a
    log resume would have to drop RL records from or reorder: a torn last line is the only damage a kill
    leaves, and records after the checkpoint may only continue it."""
    path = os.path.join(out_dir, METRICS_FILE)
    kept, size = read_metrics(path, metrics_records)
    tail: list[dict] = []
    if os.path.isfile(path):
        with open(path, "rb") as handle:
            handle.seek(size)
            lines = handle.read().split(b"\n")[:-1]  # the last piece is "" or a torn line
        for offset, line in enumerate(lines, start=len(kept) + 1):
            try:
                tail.append(json.loads(line.decode("utf-8")))
            except ValueError as err:
                raise RunDirError(f"{path}:{offset}: damaged record ({err}) before the log's end; only the "
                                  "last line may be torn by a kill") from None
    problem = log_problem(kept + tail)
    if problem is None:
        done = sum(1 for record in kept if record.get("phase") == "rl")
        if done != iteration:
            problem = f"the checkpoint's {metrics_records} records hold {done} RL iterations, not {iteration}"
    if problem:
        raise RunDirError(f"run.resume=true: {path} is not one run's log ({problem}); resuming would drop "
                          "or repeat RL records. Was the directory written by two runs at once? "
                          "run.overwrite=true starts afresh")
    return kept


def rewind(out_dir: str, metrics_records: int, iteration: int) -> list[dict]:
    """Cuts the run directory back to a checkpoint: metrics.jsonl keeps its first `metrics_records`
    records (rewritten atomically when anything follows them), rollout files after `iteration` go, and
    so do the end-of-run summary and curves (rewritten when the run ends). Returns the kept records."""
    for name in (SUMMARY_FILE, CURVES_FILE):
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    path = os.path.join(out_dir, METRICS_FILE)
    check_log(out_dir, metrics_records, iteration)
    records, size = read_metrics(path, metrics_records)
    if os.path.isfile(path) and os.path.getsize(path) != size:
        with open(path, "rb") as handle:
            atomic_write_bytes(path, handle.read(size))
    rollouts = os.path.join(out_dir, ROLLOUT_DIR)
    if os.path.isdir(rollouts):
        for name in sorted(os.listdir(rollouts)):
            match = ROLLOUT_FILE.fullmatch(name)
            if match and int(match.group(1)) > iteration:
                os.remove(os.path.join(rollouts, name))
    return records


class MetricsLog:
    """Append-only metrics.jsonl: each record is one line, written unbuffered and fsync'ed before `append`
    returns, so a checkpoint written afterwards never counts a record that is not on disk. A write that
    fails (a full disk) raises RunWriteError; at worst it leaves a torn last line, which resume cuts."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, METRICS_FILE)
        with writing("metrics.jsonl", self.path):
            self._file = open(self.path, "ab", buffering=0)

    def append(self, record: dict) -> None:
        data = memoryview((json.dumps(record) + "\n").encode("utf-8"))
        with writing("a metrics record", self.path, RESUME_HINT):
            while data:  # an unbuffered write may take only part of the line
                data = data[self._file.write(data):]
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
