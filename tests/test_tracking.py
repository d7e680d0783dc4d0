"""Live tracking: a tiny run with run.loggers=jsonl,tensorboard,wandb (W&B offline) trains a user
reward registered in its --config file; TensorBoard's event files, read back with TensorBoard's own
EventAccumulator, and the offline W&B run, read back with W&B's own `wandb leet inspect`, hold every
numeric metric of metrics.jsonl with its step; after a resume (the log rewound to the checkpoint)
neither holds a step twice. A missing tracker library or an unknown tracker is one line at start-up."""

from __future__ import annotations

import collections
import glob
import json
import math
import numbers
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_reward_registry import write_user_reward_config
from tiny_runs import ROOT, TIMING_KEYS, TINY_RUN, read_records, run_env

from experiments.train import cli

WANDB_KEYS = ("_step", "_runtime", "_timestamp")


def _tensorboard(run_dir: pathlib.Path, run: str) -> EventAccumulator:
    accumulator = EventAccumulator(str(run_dir / "tensorboard" / run),
                                   size_guidance={"scalars": 0, "images": 0})
    return accumulator.Reload()


def _expected_scalars(records: list[dict]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(TensorBoard run, tag) -> [(step, value)] as the module docstring of trackers promises them."""
    expected = collections.defaultdict(list)
    for record in records:
        run, step_key = ("warmup", "step") if record["phase"] == "warmup" else ("train", "policy_updates")
        for key, value in record.items():
            if key not in ("phase", step_key) and isinstance(value, numbers.Real):  # not lists or strings
                expected[(run, key)].append((record[step_key], float(value)))
    return expected


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _wandb_rows(wandb_file: str) -> list[dict]:
    """The history rows of an offline W&B run file, read by W&B's own reader (`wandb leet inspect`)."""
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "wandb"), "leet", "inspect", "--json",
                          wandb_file], capture_output=True, text=True, timeout=120, check=True).stdout
    rows = []
    for line in out.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            item = record["history"]["item"]
            rows.append({k: (math.nan if v == "NaN" else v) for k, v in item.items() if k not in WANDB_KEYS})
    return rows


def _as_wandb_row(record: dict) -> dict:
    return {k: float(v) for k, v in record.items() if k != "phase" and isinstance(v, numbers.Real)}


def _position(record: dict) -> tuple[int, int, int]:
    """A metrics row's place in the log's order: warm-up rows by step, then the others by
    policy_updates, an update count's RL row before the evaluation at it (wandb_run.json's last_row)."""
    if record["phase"] == "warmup":
        return (0, record["step"], 0)
    return (1, record["policy_updates"], int(record["phase"] == "eval"))


def _wandb_position(row: dict) -> tuple[int, int, int]:
    if "sft_loss" in row:
        return (0, row["step"], 0)
    return (1, row["policy_updates"], int("greedy_accuracy" in row))


def _same_row(row: dict, record: dict, skip: tuple[str, ...]) -> bool:
    want = {k: v for k, v in _as_wandb_row(record).items() if k not in skip}
    return row.keys() == _as_wandb_row(record).keys() and all(_same(row[k], v) for k, v in want.items())


def _max_iteration(out: pathlib.Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_bytes().split(b"\n")[:-1]
        return max([json.loads(line).get("iteration", 0) for line in lines] + [0])
    except (OSError, ValueError):
        return 0


def _check_tensorboard(out: pathlib.Path, records: list[dict]) -> None:
    expected = _expected_scalars(records)
    got = {}
    for run in ("train", "warmup"):
        accumulator = _tensorboard(out, run)
        for tag in accumulator.Tags()["scalars"]:
            got[(run, tag)] = [(event.step, event.value) for event in accumulator.Scalars(tag)]
    assert sorted(got) == sorted(expected)
    for key, events in expected.items():
        steps = [step for step, _ in got[key]]
        assert steps == [step for step, _ in events] and len(set(steps)) == len(steps), key
        for (_, value), (_, want) in zip(got[key], events):  # TensorBoard stores scalars as float32
            assert _same(value, float(np.float32(want))), (key, value, want)


@pytest.mark.slow
def test_tracked_run_holds_every_metric_and_resumes_without_duplicated_steps(
        tmp_path, jit_cache):
    config = write_user_reward_config(tmp_path)
    out = tmp_path / "run"
    env = dict(run_env(jit_cache), WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"),
               WANDB_SILENT="true", WANDB_PROJECT="respo-tests")
    os.makedirs(env["WANDB_DIR"])

    def train_cmd(*overrides):
        return [sys.executable, "-m", "experiments.train", "--config", str(config), *TINY_RUN,
                f"run.out_dir={out}", "run.loggers=jsonl,tensorboard,wandb", "run.checkpoint_every=1",
                *overrides]

    def train(*overrides):
        result = subprocess.run(train_cmd(*overrides), cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]

    train("run.iterations=2")
    first = read_records(out)
    rl = [r for r in first if r["phase"] == "rl"]
    # The user reward of the --config file trained, and its raising / NaN responses were counted.
    assert len(rl) == 2 and all(r["reward_timeouts"] == 0 for r in rl)
    responses = 2 * 2 * 2  # prompts x group size x reuse per iteration
    assert 0 < sum(r["reward_failures"] for r in rl) < len(rl) * responses
    _check_tensorboard(out, first)
    files = sorted(glob.glob(os.path.join(env["WANDB_DIR"], "wandb", "offline-run-*", "run-*.wandb")))
    assert len(files) == 1
    metric_rows = [row for row in _wandb_rows(files[0]) if "training_curves._type" not in row]
    assert len(metric_rows) == len(first)
    for row, record in zip(metric_rows, first):
        assert row.keys() == _as_wandb_row(record).keys()
        assert all(_same(row[k], v) for k, v in _as_wandb_row(record).items()), (row, record)

    # Resume the finished run to go longer, kill -9 it once iteration 3 is logged, resume it again. The log
    # is rewound to a checkpoint each time (the first run's final evaluation dropped): TensorBoard must
    # read as the final metrics.jsonl; W&B must continue the same run and never receive a row twice.
    proc = subprocess.Popen(train_cmd("run.iterations=4", "run.resume=true"), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None and _max_iteration(out) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL  # it was still running
    sent_before = json.loads((out / "wandb_run.json").read_text())
    last_sent = tuple(sent_before["last_row"])  # the last row the killed run sent to W&B
    train("run.iterations=4", "run.resume=true")
    final = read_records(out)
    assert final[:len(first) - 1] == first[:-1]
    assert [r["iteration"] for r in final if r["phase"] == "rl"] == [1, 2, 3, 4]
    _check_tensorboard(out, final)
    images = _tensorboard(out, "train").Images("training_curves")
    assert [image.step for image in images] == [final[-1]["policy_updates"]]  # earlier runs' were purged

    run_id = json.loads((out / "wandb_run.json").read_text())["run_id"]
    assert sent_before["run_id"] == run_id
    files = sorted(glob.glob(os.path.join(env["WANDB_DIR"], "wandb", "offline-run-*", "run-*.wandb")))
    assert len(files) == 3 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    killed, resumed = ([row for row in _wandb_rows(f) if "training_curves._type" not in row]
                       for f in files[1:])
    by_position = {_position(r): r for r in final}
    # The resumed run sent exactly the rows after the last one W&B had been sent, with their values.
    assert [_wandb_position(row) for row in resumed] == [p for p in by_position if p > last_sent]
    for row in resumed:
        assert _same_row(row, by_position[_wandb_position(row)], ())
    # The killed run's rows (those W&B wrote before the kill) followed the first run's and hold the values
    # the final run recomputed (bit-identical, timings aside).
    first_last = _position(first[-1])
    assert all(first_last < _wandb_position(row) <= last_sent for row in killed)
    for row in killed:
        assert _same_row(row, by_position[_wandb_position(row)], TIMING_KEYS)
    # No row twice across the three runs; W&B keeps the first run's final evaluation (it cannot delete it).
    positions = [_wandb_position(row) for row in metric_rows + killed + resumed]
    assert len(set(positions)) == len(positions), positions
    assert set(positions) - set(by_position) == {_position(first[-1])}


@pytest.mark.parametrize("loggers, library", [("jsonl,tensorboard", "tensorboardX"), ("wandb", "wandb")])
def test_a_missing_tracker_library_is_one_line_at_start_up(tmp_path, capsys, monkeypatch, loggers, library):
    monkeypatch.setitem(sys.modules, library, None)  # `import library` now raises ImportError
    out = tmp_path / "run"
    assert cli([f"run.loggers={loggers}", f"run.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"needs the {library} package" in err and '".[tracking]"' in err
    assert not out.exists()


def test_an_unknown_tracker_is_one_line_at_start_up(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli(["run.loggers=jsonl,tensorbord", f"run.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.loggers='jsonl,tensorbord'" in err and "'wandb'" in err
    assert not out.exists()


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    from experiments.train import DEFAULT_CONFIG, load_config
    from respo_jax.training import trackers
    from respo_jax.training.config import apply_overrides

    def refuse(*args, **kwargs):
        raise RuntimeError("api_key not configured\n(no-tty)")

    monkeypatch.setattr(trackers, "WandbTracker", refuse)
    config = apply_overrides(load_config(DEFAULT_CONFIG), ["run.loggers=wandb", f"run.out_dir={tmp_path}"])
    expected = (r"^run.loggers='wandb': W&B did not start \(RuntimeError: api_key not configured "
                r"\(no-tty\)\); set WANDB_MODE=offline")
    with pytest.raises(trackers.TrackerError, match=expected):
        trackers.open_trackers(config, {}, None)
