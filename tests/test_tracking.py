"""Live tracking (issue 27): a tiny run with run.loggers=jsonl,tensorboard,wandb (W&B offline) trains a user
reward registered in its --config file; TensorBoard's event files, read back with TensorBoard's own
EventAccumulator, and the offline W&B run, read back with W&B's own `wandb leet inspect`, hold every
numeric metric of metrics.jsonl with its step; after a resume (the log rewound to the checkpoint)
neither holds a step twice. A missing tracker library or an unknown tracker is one line at start-up."""

from __future__ import annotations

import collections
import glob
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_reward_registry import write_user_reward_config
from test_runs import ROOT, TINY_RUN, _env, _records, jit_cache  # noqa: F401 (a fixture)

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
            if key not in ("phase", step_key):
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
    return {k: float(v) for k, v in record.items() if k != "phase"}


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


def test_tracked_run_holds_every_metric_and_resumes_without_duplicated_steps(
        tmp_path, jit_cache):  # noqa: F811 (the fixture imported from test_runs)
    config = write_user_reward_config(tmp_path)
    out = tmp_path / "run"
    env = dict(_env(jit_cache), WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"), WANDB_SILENT="true",
               WANDB_PROJECT="respo-tests")
    os.makedirs(env["WANDB_DIR"])

    def train(*overrides):
        cmd = [sys.executable, "-m", "experiments.train", "--config", str(config), *TINY_RUN,
               f"run.out_dir={out}", "run.loggers=jsonl,tensorboard,wandb", "run.checkpoint_every=1",
               *overrides]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]

    train("run.iterations=2")
    first = _records(out)
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

    # Resume the finished run for one more iteration: the log is rewound to the checkpoint of iteration
    # 2 (its final evaluation dropped), so TensorBoard must purge that evaluation and W&B must continue
    # the same run without repeating a row.
    train("run.iterations=3", "run.resume=true")
    final = _records(out)
    assert final[:-2] == first[:-1] and final[-2]["iteration"] == 3 and final[-1]["phase"] == "eval"
    _check_tensorboard(out, final)
    images = _tensorboard(out, "train").Images("training_curves")
    assert [image.step for image in images] == [final[-1]["policy_updates"]]  # the first run's was purged

    run_id = json.loads((out / "wandb_run.json").read_text())["run_id"]
    files = sorted(glob.glob(os.path.join(env["WANDB_DIR"], "wandb", "offline-run-*", "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    resumed = [row for row in _wandb_rows(files[1]) if "training_curves._type" not in row]
    # W&B cannot delete a row: it keeps the first run's final evaluation (documented) and receives only
    # the rows after the last one it has, so no (kind, step) appears twice across both files.
    assert len(resumed) == 2
    for row, record in zip(resumed, final[-2:]):
        assert row.keys() == _as_wandb_row(record).keys()
        assert all(_same(row[k], v) for k, v in _as_wandb_row(record).items()), (row, record)
    positions = [("sft" if "sft_loss" in row else "eval" if "greedy_accuracy" in row else "rl",
                  row.get("step", row.get("policy_updates"))) for row in metric_rows + resumed]
    assert len(set(positions)) == len(positions), positions


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
