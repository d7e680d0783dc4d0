"""Live experiment tracking: every metric row the trainer logs to metrics.jsonl also goes to TensorBoard
(event files written by `tensorboardX`, no TensorFlow) and/or Weights & Biases (`wandb`), as chosen by
`run.loggers` (e.g. "jsonl,tensorboard,wandb"; jsonl is always on). Both libraries are optional
(`pip install -e ".[tracking]"`); asking for one that is missing fails at start-up (`check_available`).

What a tracker receives, and how a resumed run keeps it exact:
- Rows keep metrics.jsonl's keys; numbers (bools as 0/1) are logged, anything else (the `phase`
  string, lists) is not. The step is `policy_updates` for RL and evaluation rows and the warm-up's own
  `step` for warm-up rows, which run before any policy update.
- TensorBoard: runs `tensorboard/train` (RL and evaluation rows, scalars stored as float32 as
  TensorBoard does) and `tensorboard/warmup`, plus the config and run_info.json as text and the curves
  PNG as an image. A resumed run opens its writers with `purge_step=0` (TensorBoard then discards every
  earlier event of the run) and logs metrics.jsonl's rows as rewound to the checkpoint again, so the
  event files read exactly as metrics.jsonl, whatever the killed process had written.
- W&B: one history row per metric row, charted against `policy_updates` (warm-up rows against
  `step`) via `define_metric`; the config with run_info.json as the run's config; the curves as the
  image `training_curves`. The run id lives in `wandb_run.json` in the run directory, so a resumed
  run continues the same W&B run (`resume="allow"`). W&B cannot delete history (its rewind is a
  private preview), so `wandb_run.json` also records the last row W&B received and a resumed run does
  not send the rows it re-does up to that one again (a bit-identical resume recomputes the same values,
  timings aside); a run directory that had no W&B run yet sends its whole log. `WANDB_MODE`,
  `WANDB_PROJECT` (default "respo-jax"), `WANDB_ENTITY`, `WANDB_NAME` (default: the run directory's
  name), `WANDB_DIR` (default: the run directory) and the other `WANDB_*` variables apply as usual.
"""

from __future__ import annotations

import importlib
import json
import numbers
import os
import secrets
import sys

from respo_jax.training.config import TRACKERS, ConfigError, parse_loggers  # noqa: F401 - re-exported
from respo_jax.training.run_dir import TENSORBOARD_DIR, WANDB_FILE, atomic_write_json, read_json

_LIBRARIES = {"tensorboard": "tensorboardX", "wandb": "wandb"}
CURVES_TAG = "training_curves"
_WANDB_FLUSH_S = 0.2  # how often W&B writes the run's .wandb file (its default: 15 s)


class TrackerError(RuntimeError):
    """A tracker could not start (e.g. W&B without credentials outside offline mode)."""


def check_available(loggers: str) -> None:
    """ConfigError (one line: what to install) when a tracker's library cannot be imported."""
    for name in parse_loggers(loggers) or ():
        library = _LIBRARIES.get(name)
        if library is None:
            continue
        try:
            importlib.import_module(library)
        except ImportError:
            raise ConfigError(f"run.loggers={loggers!r}: {name} needs the {library} package, which is not "
                              f"installed for {sys.executable}; pip install -e \".[tracking]\" (or pip "
                              f"install {library})") from None


def row_step(record: dict) -> tuple[str, str]:
    """(TensorBoard run, step key) of a metrics row: warm-up rows step on "step", the others on
    "policy_updates"."""
    return ("warmup", "step") if record.get("phase") == "warmup" else ("train", "policy_updates")


def scalars(record: dict, step_key: str) -> dict[str, float]:
    """The numeric values of a row (bools as 0/1), without its step key and its strings."""
    return {key: float(value) for key, value in record.items()
            if key != step_key and isinstance(value, numbers.Real)}


class TensorBoardTracker:
    """Metric rows as TensorBoard scalars (see the module docstring)."""

    def __init__(self, out_dir: str, texts: dict[str, dict], resuming: bool):
        from tensorboardX import SummaryWriter

        self._writer_type, self._root = SummaryWriter, os.path.join(out_dir, TENSORBOARD_DIR)
        self._purge_step = 0 if resuming else None
        self._writers: dict = {}
        train = self._writer("train")
        for tag, value in texts.items():
            train.add_text(tag, "```\n" + json.dumps(value, indent=2, sort_keys=True) + "\n```", 0)
        train.flush()

    def _writer(self, run: str):
        if run not in self._writers:
            self._writers[run] = self._writer_type(logdir=os.path.join(self._root, run),
                                                   purge_step=self._purge_step)
        return self._writers[run]

    def log(self, record: dict) -> None:
        run, step_key = row_step(record)
        writer, step = self._writer(run), int(record[step_key])
        for key, value in scalars(record, step_key).items():
            writer.add_scalar(key, value, step)
        writer.flush()  # a killed run loses no row it logged

    def add_image(self, path: str, step: int) -> None:
        from matplotlib import image

        pixels = image.imread(path)[..., :3]  # [height, width, RGB] floats in [0, 1]
        self._writer("train").add_image(CURVES_TAG, pixels, step, dataformats="HWC")

    def close(self, failed: bool = False) -> None:
        for writer in self._writers.values():
            writer.close()


def _position(record: dict) -> list[int]:
    """Where a row stands in the log's order: warm-up rows by step, then the others by policy_updates,
    the RL row of an update count before the evaluation at it."""
    if record.get("phase") == "warmup":
        return [0, int(record["step"]), 0]
    return [1, int(record["policy_updates"]), int(record.get("phase") == "eval")]


class WandbTracker:
    """Metric rows as W&B history rows (see the module docstring)."""

    def __init__(self, out_dir: str, config: dict, info: dict):
        import wandb

        self._state_path = os.path.join(out_dir, WANDB_FILE)
        self._state = read_json(self._state_path) if os.path.isfile(self._state_path) else {}
        run_id = self._state.get("run_id") or os.environ.get("WANDB_RUN_ID") or secrets.token_hex(6)
        kwargs = dict(project=os.environ.get("WANDB_PROJECT", "respo-jax"), id=run_id, resume="allow",
                      name=os.environ.get("WANDB_NAME") or os.path.basename(os.path.abspath(out_dir)))
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = out_dir
        if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):
            # the .wandb file is written every 15 s by default: a killed run would lose up to that much
            kwargs["settings"] = wandb.Settings(x_transaction_log_flush_interval=_WANDB_FLUSH_S)
        self._wandb, self.run = wandb, wandb.init(**kwargs)
        self.run.config.update({**config, "run_info": info}, allow_val_change=True)
        self._state = {"run_id": run_id, "last_row": self._state.get("last_row")}
        atomic_write_json(self._state_path, self._state)
        self._defined: set[str] = set()

    def log(self, record: dict) -> None:
        position = _position(record)
        if self._state["last_row"] is not None and position <= self._state["last_row"]:
            return  # W&B has this row from before the interruption
        _, step_key = row_step(record)
        values = scalars(record, step_key)
        for key in values.keys() - self._defined:
            self.run.define_metric(key, step_metric=step_key)
        self._defined |= values.keys()
        self._state["last_row"] = position  # first: a kill in between loses the row, never doubles it
        atomic_write_json(self._state_path, self._state)
        self.run.log({**values, step_key: int(record[step_key])})

    def add_image(self, path: str, step: int) -> None:
        self.run.log({CURVES_TAG: self._wandb.Image(path), "policy_updates": step})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackers:
    """The run's trackers besides metrics.jsonl, behind one small interface:

        trackers = open_trackers(config, run_info, resumed_records)
        with trackers:              # on an exception the trackers are closed as failed
            ... trackers.log(record) for every metrics row ...
        trackers.finish(curves_png, policy_updates)   # after a successful run
    """

    def __init__(self, trackers: list):
        self._trackers = trackers

    def log(self, record: dict) -> None:
        for tracker in self._trackers:
            tracker.log(record)

    def finish(self, curves_path: str | None, policy_updates: int) -> None:
        for tracker in self._trackers:
            if curves_path is not None:
                tracker.add_image(curves_path, policy_updates)
            tracker.close()
        self._trackers = []

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            for tracker in self._trackers:
                tracker.close(failed=True)
            self._trackers = []


def open_trackers(config, info: dict, resumed: list[dict] | None, enabled: bool = True) -> Trackers:
    """The trackers `config.run.loggers` asks for besides jsonl (none when not `enabled`: only process 0
    logs). `resumed`: metrics.jsonl's rows as rewound to the restored checkpoint when the run resumes
    (None for a new run); they are logged again as the module docstring says."""
    names = parse_loggers(config.run.loggers) if enabled else ()
    out_dir, as_dict = config.run.out_dir, config.to_dict()
    trackers: list = []
    if "wandb" in names:  # first: the one that can fail to start
        try:
            trackers.append(WandbTracker(out_dir, as_dict, info))
        except Exception as err:  # wandb's own errors (no credentials, no network): one line, exit 1
            detail = " ".join(str(err).split())[:300]
            raise TrackerError(f"run.loggers={config.run.loggers!r}: W&B did not start "
                               f"({type(err).__name__}: {detail}); set WANDB_MODE=offline to log without a "
                               "server") from None
    if "tensorboard" in names:
        texts = {"config": as_dict, "run_info": info}
        trackers.append(TensorBoardTracker(out_dir, texts, resuming=resumed is not None))
    opened = Trackers(trackers)
    for record in resumed or ():
        opened.log(record)
    return opened
