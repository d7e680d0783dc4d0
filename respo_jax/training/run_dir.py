"""A run directory is the result of a run: the guards that keep runs from mixing, losing or tearing it.

Its layout, file names, atomic writer, readers and the rule for a torn last line are `respo_jax.runs`'s
(re-exported here for the trainer). Rules (`plan_run_dir` decides, before anything is written):
- a directory without the run entries (`RUN_ENTRIES`) starts a fresh run (with or without `run.resume`);
- a directory holding a run is refused unless `run.resume=true` (its config must equal this one except
  for `RESUMABLE_KEYS`) or `run.overwrite=true` (its run entries are deleted first; other files stay);
- resume rewinds the log to the restored checkpoint (`rewind`): metrics records and rollout files after
  it are dropped, a torn last line with them, so the directory reads exactly as an uninterrupted run's;
  a log that is not one writer's (`check_log`: iterations repeated or out of order, as two runs in one
  directory leave them) is refused instead, since cutting it back would keep the wrong records.
- the lock file `.lock` (`respo_jax.training.run_lock`) is not a run entry;
- every place a start will write, delete or rewrite is checked first (`check_writable`), so a start
  that cannot write one of them (a read-only tensorboard/, a folder on a read-only mount) is refused
  with the run directory as it was, never after deleting the end-of-run files.
Files that are replaced as a whole are written atomically (`respo_jax.runs.atomic_write`); metrics
records are appended and fsync'ed one by one, before any checkpoint that counts them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

from respo_jax import runs
from respo_jax.runs import (  # noqa: F401 - the layout, re-exported for the trainer and its tools
    CHECKPOINT_DIR,
    CONFIG_FILE,
    CURVES_FILE,
    METRICS_FILE,
    ROLLOUT_DIR,
    ROLLOUT_FILE,
    RUN_ENTRIES,
    RUN_INFO_FILE,
    SUMMARY_FILE,
    TENSORBOARD_DIR,
    WANDB_FILE,
    atomic_write_bytes,
    atomic_write_json,
)
from respo_jax.training.config import ConfigError, ExperimentConfig, config_from_dict
from respo_jax.training.write_errors import startup_write_error, writing

# What a run that failed to write (a full disk) tells the user to do: its checkpoints are intact.
RESUME_HINT = "the checkpoints written so far are kept; make room and rerun with run.resume=true"

# Config keys that may differ between a run and its resumption: how long it runs, how often it
# checkpoints, what it shows (progress, and the trackers besides metrics.jsonl: a tracker added on
# resume receives the whole log), where the directory lives, host-side allocator settings, and how much
# memory a step may use (rows per micro-batch of the update and of log π_old:
# the same computation split differently, so a resumed run that changes them equals the uninterrupted
# one to float round-off instead of bit for bit), the rollout engine and its memory (rollout.scheduler,
# slots, schedule length, pages, attention kernel: for one seed the same samples up to float round-off
# ties, so a run may resume with the memory its new devices allow), when and where programs compile,
# and the device mesh (the same computation placed differently: a run preempted on one slice may
# continue on another). Everything
# else (model, task, rollout sizes and shape buckets, objective, optimizer, warm-up, seeds, held-out
# problems) defines the run; so does the learning-rate warm-up length that optim.warmup_ratio derives
# from the run length.
RESUMABLE_KEYS = frozenset({
    "run.iterations", "run.policy_updates", "run.checkpoint_every", "run.checkpoint_every_minutes",
    "run.progress", "run.resume",
    "run.overwrite", "run.out_dir", "run.host_allocator", "rollout.max_tokens_per_microbatch",
    "rollout.compile_ahead", "rollout.max_prompt_buckets",
    "run.compilation_cache_dir", "run.export_programs", "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.expert",
    "run.loggers",
    "rollout.scheduler", "rollout.max_slots", "rollout.steps_per_schedule", "rollout.min_decode_slots",
    "rollout.decode_widths_per_octave",
    "rollout.page_size", "rollout.num_pages", "rollout.kv_cache_bytes", "rollout.paged_attention_impl",
    "rollout.paged_attention_interpret", "rollout.prompt_buckets", "rollout.share_prompts",
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
    retired = {f"{field.name}.{name}": why for field in dataclasses.fields(current)
               for name, why in getattr(getattr(current, field.name), "retired", {}).items()}
    diffs = []
    for key in sorted(set(now) | set(before)):
        if key in RESUMABLE_KEYS:
            continue
        old = before.get(key, default.get(key))
        if key in retired:
            diffs.append(f"{key}: saved {old!r}, no longer exists ({retired[key]})")
        elif key not in now:
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
    """`respo_jax.runs.read_json`, its error a RunDirError (a run directory that cannot be used)."""
    try:
        return runs.read_json(path)
    except runs.RunFileError as err:
        raise RunDirError(str(err)) from None


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


def check_writable(plan: RunDirPlan, loggers: tuple[str, ...]) -> None:
    """Before the first write of a start: every folder the run will create files in, delete from or
    rewrite (`out_dir`, checkpoints/, rollouts/, tensorboard/ and its runs when TensorBoard logs; with
    run.overwrite every folder of the old run) takes a new file, and metrics.jsonl opens for appending.
    ConfigError (exit status 2) naming the first that cannot; nothing is changed. A folder is probed by
    creating and removing a file in it (permission bits do not stop root; a read-only mount stops
    everyone); the folders inside an overwritten run by `os.access`."""
    out_dir = plan.out_dir
    if not os.path.isdir(out_dir):
        return  # created by the lock's probe, or refused there
    folders = [out_dir] + [os.path.join(out_dir, name) for name in (CHECKPOINT_DIR, ROLLOUT_DIR)]
    tensorboard = os.path.join(out_dir, TENSORBOARD_DIR)
    if "tensorboard" in loggers or plan.mode == "overwrite":
        folders.append(tensorboard)
        if os.path.isdir(tensorboard):
            folders += sorted(entry.path for entry in os.scandir(tensorboard) if entry.is_dir())
    for folder in folders:
        if os.path.isdir(folder):
            _probe(folder)
    if plan.mode == "overwrite":  # every folder the old run's entries hold is emptied
        for name in plan.entries:
            for root, dirs, _ in os.walk(os.path.join(out_dir, name)):
                for folder in [root, *(os.path.join(root, d) for d in dirs)]:
                    if not os.access(folder, os.W_OK | os.X_OK):
                        raise startup_write_error(PermissionError(13, "Permission denied", folder),
                                                  "run.out_dir", out_dir)
    metrics = os.path.join(out_dir, METRICS_FILE)
    if os.path.isfile(metrics):
        try:
            with open(metrics, "ab"):
                pass
        except OSError as err:
            raise startup_write_error(err, "run.out_dir", out_dir) from None


def _probe(folder: str) -> None:
    """Creates and removes a file in `folder`; ConfigError naming it when the file cannot be made."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".respo_jax_probe.", dir=folder)
    except OSError as err:
        err.filename = folder
        raise startup_write_error(err, "run.out_dir", os.path.dirname(folder)) from None
    os.close(fd)
    os.remove(probe)


# -------------------------------------------------------------------------------------- writing


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
        if runs.is_temp_file(name, RUN_ENTRIES):
            os.remove(os.path.join(out_dir, name))


def start_run_dir(plan: RunDirPlan, config: ExperimentConfig) -> None:
    """The first write of a run: clears an overwritten run, then writes config.json atomically."""
    if plan.mode == "overwrite":
        clear_run(plan.out_dir)
    os.makedirs(plan.out_dir, exist_ok=True)
    _remove_temp_files(plan.out_dir)
    atomic_write_json(os.path.join(plan.out_dir, CONFIG_FILE), config.to_dict())


def _read_log(path: str, keep: int) -> tuple[list[dict], int]:
    """(every record, bytes the first `keep` take) of a metrics.jsonl by `respo_jax.runs.read_jsonl`, whose
    rule leaves a torn last line out; RunDirError naming the file (and line) for a damaged complete line,
    a missing file or fewer than `keep` complete records."""
    if not os.path.isfile(path):
        if keep:
            raise RunDirError(f"{path} is missing; the checkpoint counts {keep} records in it")
        return [], 0
    try:
        log = runs.read_jsonl(path)
    except runs.RunFileError as err:
        raise RunDirError(f"{err.where}: damaged record ({err.problem}) before the log's end; only the last "
                          f"line may be torn by a kill (the checkpoint counts {keep} records)") from None
    if len(log.records) < keep:
        raise RunDirError(f"{path} holds {len(log.records)} complete records; the checkpoint counts {keep}")
    return log.records, log.ends[keep - 1] if keep else 0


def read_metrics(path: str, keep: int) -> tuple[list[dict], int]:
    """(records, bytes they take) of the first `keep` records of a metrics.jsonl.

    The records after them and a torn last line (`respo_jax.runs`' rule) are not returned; a damaged
    line, or fewer than `keep` complete records, raises RunDirError naming the file (and line).
    """
    records, size = _read_log(path, keep)
    return records[:keep], size


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


def record_line(record: dict) -> bytes:
    """One metrics.jsonl line, as `MetricsLog` writes it."""
    return (json.dumps(record) + "\n").encode("utf-8")


def log_digest(records: list[dict]) -> str:
    """The SHA-256 (hex) of the metrics.jsonl lines of `records`, as `MetricsLog` wrote them: a checkpoint
    keeps it, so a resume can tell that the log it continues is byte for byte the one the checkpoint saw."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(record_line(record))
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class CheckedLog:
    """A run's metrics.jsonl as far as a checkpoint counts it (`check_log`): its first records and the
    bytes they take; what `rewind` cuts the log back to."""

    path: str
    records: list[dict]
    size: int


def check_log(out_dir: str, metrics_records: int, iteration: int, digest: str | None = None) -> CheckedLog:
    """The first `metrics_records` records of `out_dir`'s metrics.jsonl (what a checkpoint of RL
    iteration `iteration` counts) and their bytes, after checking that the whole log is one writer's
    (`log_problem`), that those records hold exactly iterations 1..`iteration` and, given the
    checkpoint's `digest` (`log_digest`), that their bytes are the ones the checkpoint saw. Reads only; RunDirError (one line)
    for a log resume would have to drop RL records from or reorder, or one changed after the checkpoint:
    a torn last line is the only damage a kill leaves, and records after the checkpoint may only continue
    it."""
    path = os.path.join(out_dir, METRICS_FILE)
    records, size = _read_log(path, metrics_records)
    kept = records[:metrics_records]
    problem = log_problem(records)
    if problem is None:
        done = sum(1 for record in kept if record.get("phase") == "rl")
        if done != iteration:
            problem = f"the checkpoint's {metrics_records} records hold {done} RL iterations, not {iteration}"
    if problem:
        raise RunDirError(f"run.resume=true: {path} is not one run's log ({problem}); resuming would drop "
                          "or repeat RL records. Was the directory written by two runs at once? "
                          "run.overwrite=true starts afresh")
    if digest is not None and size:
        with open(path, "rb") as handle:
            if hashlib.sha256(handle.read(size)).hexdigest() != digest:
                raise RunDirError(f"run.resume=true: the first {metrics_records} records of {path} are not "
                                  "the bytes its checkpoint saw (SHA-256 differs): the log was changed or "
                                  "damaged after it was written; run.overwrite=true starts afresh")
    return CheckedLog(path, kept, size)


def rewind(out_dir: str, log: CheckedLog, iteration: int) -> list[dict]:
    """Cuts the run directory back to a checkpoint of RL iteration `iteration`: metrics.jsonl keeps the
    records `log` (`check_log`) holds (rewritten atomically when anything follows them), rollout files
    after `iteration` go, and so do the end-of-run summary and curves (rewritten when the run ends).
    Returns the kept records."""
    for name in (SUMMARY_FILE, CURVES_FILE):
        if os.path.isfile(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    if os.path.isfile(log.path) and os.path.getsize(log.path) != log.size:
        with open(log.path, "rb") as handle:
            atomic_write_bytes(log.path, handle.read(log.size))
    rollouts = os.path.join(out_dir, ROLLOUT_DIR)
    if os.path.isdir(rollouts):
        for name in sorted(os.listdir(rollouts)):
            match = ROLLOUT_FILE.fullmatch(name)
            if match and int(match.group(1)) > iteration:
                os.remove(os.path.join(rollouts, name))
    return log.records


class MetricsLog:
    """Append-only metrics.jsonl: each record is one line, written unbuffered and fsync'ed before `append`
    returns, so a checkpoint written afterwards never counts a record that is not on disk. A write that
    fails (a full disk) raises RunWriteError; at worst it leaves a torn last line, which resume cuts.

    `records`: those the file already holds (a resumed run's, `rewind`). `records` and `sha256()` are
    the log so far, the latter its `log_digest` kept up to date line by line. With `out_dir` None
    nothing is written (the processes of a multi-process run other than process 0) and the two are kept
    all the same."""

    def __init__(self, out_dir: str | None, records: list[dict] = ()):
        self.records = list(records)
        self._digest = hashlib.sha256()
        for record in self.records:
            self._digest.update(record_line(record))
        self.path, self._file = None, None
        if out_dir is not None:
            self.path = os.path.join(out_dir, METRICS_FILE)
            with writing("metrics.jsonl", self.path):
                self._file = open(self.path, "ab", buffering=0)

    def append(self, record: dict) -> None:
        line = record_line(record)
        if self._file is not None:
            data = memoryview(line)
            with writing("a metrics record", self.path, RESUME_HINT):
                while data:  # an unbuffered write may take only part of the line
                    data = data[self._file.write(data):]
                os.fsync(self._file.fileno())
        self._digest.update(line)
        self.records.append(record)

    def sha256(self) -> str:
        """`log_digest(self.records)`: what a checkpoint keeps as `metrics_sha256`."""
        return self._digest.hexdigest()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
