"""Run files: the one place that names a run directory's files, writes them atomically and reads them back.

The trainer, the evaluation, the reports and the rollout files all go through this module, so a file is
written and read by one rule wherever it appears. Layout of a run directory (`run.out_dir`):

    config.json          the validated config of the run (rewritten on resume with the new run.* values)
    metrics.jsonl        one JSON record per warm-up step, RL iteration or evaluation, append-only
    summary.json         `respo_jax.training.run.summarize` of metrics.jsonl, written at the end
    training_curves.png  the curves of metrics.jsonl, written at the end
    run_info.json        devices, mesh axis sizes and where the parameters live
    checkpoints/<step>/  Orbax checkpoints with a SHA-256 manifest (`respo_jax.training.checkpoint`)
    rollouts/iteration_%06d.npz   per-response arrays of each iteration (`respo_jax.eval.rollout_files`)
    tensorboard/, wandb_run.json  what the trackers besides metrics.jsonl keep (`training.trackers`)
    eval/                an evaluation of the run (`python -m experiments.evaluate`'s default out_dir):
                         completions.jsonl, summary.json, summary.md, eval_config.json
    report/              `python -m experiments.report` of the run alone: report.md, report.json, PNGs

Writing. A file replaced as a whole goes through `atomic_write`: a temporary file in the same folder,
flushed and fsync'ed, renamed over the target, then the folder fsync'ed, so a kill or a power cut leaves
the old file or the new one, never half of one. Append-only JSONL files (metrics.jsonl, completions.jsonl)
are appended one whole line at a time and fsync'ed by their writers.

Reading. `read_json` and `read_jsonl` raise `RunFileError` naming the file (and line). The rule for a
torn last line, the same for every JSONL file: a record is a line *terminated by a newline*. A killed
appender can leave only one kind of damage, an unterminated last line; it is not a record, so every
reader leaves it out, returns its size (`JsonlFile.torn`) and says so where a user reads (a warning, a
report note), and a writer that continues the file cuts it first (`cut_torn_tail`; a resumed run
rewinds metrics.jsonl to its checkpoint, which drops it with the records after it). It is never parsed,
even when its bytes happen to be valid JSON: the writer did not finish it. Any other damage (a complete
line that is not a JSON object, bytes that are not UTF-8) is not what a kill leaves, so it raises: nothing
is dropped silently. Blank lines hold no record and are passed over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Any, BinaryIO, Callable

from respo_jax.json_files import JsonFileError, read_json

# ------------------------------------------------------------------------------------------ layout

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
# The entries a run writes (what makes a directory "hold a run"); eval/ and report/ are not among them.
RUN_ENTRIES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CURVES_FILE, CHECKPOINT_DIR, ROLLOUT_DIR,
               RUN_INFO_FILE, TENSORBOARD_DIR, WANDB_FILE)
ROLLOUT_FILE = re.compile(r"iteration_(\d{6,})\.npz")  # a file of rollouts/; group 1: the iteration

# An evaluation directory (`python -m experiments.evaluate`): RUN_DIR/eval by default.
EVAL_DIR = "eval"
COMPLETIONS_FILE = "completions.jsonl"
EVAL_SUMMARY_FILE = "summary.json"
EVAL_SUMMARY_MARKDOWN = "summary.md"
EVAL_CONFIG_FILE = "eval_config.json"

# A report directory (`python -m experiments.report`): RUN_DIR/report for one run.
REPORT_DIR = "report"
REPORT_FILE = "report.md"
REPORT_DATA_FILE = "report.json"
LENGTH_BINS_FIGURE = "length_bins.png"

TEMP_SUFFIX = ".tmp"  # atomic_write's temporary files: ".<name>.<random>.tmp" beside the target


def rollout_file_name(iteration: int) -> str:
    """``iteration_000001.npz``: the name of iteration `iteration`'s rollout file (1-based)."""
    return f"iteration_{int(iteration):06d}.npz"


# ----------------------------------------------------------------------------------------- writing


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Writes `path` by `write(handle)` (a binary file) so that a kill leaves the old file or the new
    one, never half of one: temp file in the same folder, flush + fsync, rename, fsync of the folder."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise
    fsync_dir(folder)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    """`obj` as indented JSON with a final newline."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent) + "\n").encode("utf-8"))


def fsync_dir(folder: str) -> None:
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


def is_temp_file(name: str, targets: tuple[str, ...]) -> bool:
    """Whether `name` is a temporary file that `atomic_write` of one of `targets` left (killed)."""
    return name.endswith(TEMP_SUFFIX) and any(name.startswith(f".{target}.") for target in targets)


# ----------------------------------------------------------------------------------------- reading


RunFileError = JsonFileError  # a run file that cannot be read (the name the run-file readers raise)


@dataclasses.dataclass(frozen=True)
class JsonlFile:
    """What `read_jsonl` read: records (what `keep` returned for each, in file order), lines (the line
    number of each), ends (the byte offset just past each record's newline), torn (bytes of the torn last
    line that was left out; 0 when the file ends with a newline)."""

    path: str
    records: list
    lines: list[int]
    ends: list[int]
    torn: int = 0

    @property
    def torn_note(self) -> str | None:
        """One sentence on the left-out torn last line, for a warning or a report; None without one."""
        if not self.torn:
            return None
        return (f"{self.path}: left out a torn last line ({self.torn} bytes without a newline: a writer "
                "was killed mid-line)")


def read_jsonl(path: str | os.PathLike, keep: Callable[[dict, str], Any] | None = None) -> JsonlFile:
    """The records of a JSONL file under the module's torn-line rule (an absent file reads as empty).

    Each newline-terminated line must be a JSON object; `keep(record, where)` ("path:line") may check it
    (raising naming `where`) and returns what is stored (e.g. the record without a bulky field). The file
    is read line by line. RunFileError names the file and line of a damaged complete line.
    """
    path = os.fspath(path)
    records, lines, ends = [], [], []
    if not os.path.exists(path):
        return JsonlFile(path, records, lines, ends)
    offset, torn = 0, 0
    with open(path, "rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.endswith(b"\n"):  # only the last line can lack one
                torn = len(line)
                break
            offset += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise RunFileError(path, f"invalid UTF-8 byte {line[err.start]:#04x}", lineno) from None
            except json.JSONDecodeError as err:
                raise RunFileError(path, f"invalid JSON ({err})", lineno) from None
            if not isinstance(record, dict):
                raise RunFileError(path, f"a JSON {type(record).__name__}, expected an object", lineno)
            records.append(record if keep is None else keep(record, f"{path}:{lineno}"))
            lines.append(lineno)
            ends.append(offset)
    return JsonlFile(path, records, lines, ends, torn)


def cut_torn_tail(path: str | os.PathLike) -> int:
    """Cuts a torn last line off a JSONL file before appending to it again; returns the bytes removed.
    Reads backwards from the end in blocks, so a large file is not read whole."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return 0
    with open(path, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:  # find the last newline
            start = max(0, keep - (1 << 16))
            handle.seek(start)
            newline = handle.read(keep - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
        if keep < size:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
    return size - keep
