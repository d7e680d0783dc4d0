"""`respo_jax.runs`: the one atomic writer, the one JSON/JSONL reader and its one torn-last-line rule, held
by every reader of run files (resume, reports, completions)."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
from test_report import _write_run

from respo_jax import runs
from respo_jax.eval.completions import load_completions, repair_completions
from respo_jax.eval.report import ReportError, load_run
from respo_jax.training import run_dir


def _completion(sample: int) -> dict:
    return {"benchmark": "b", "problem_id": "p0", "problem_index": 0, "sample": sample, "length": 5,
            "truncated": False, "score": 1.0, "verify_status": "ok", "answer": "1", "text": "t"}


def test_atomic_write_fsyncs_file_and_folder_and_keeps_the_old_file_when_killed(tmp_path, monkeypatch):
    synced = []  # (is a directory, size) of each fsync'ed descriptor, in order
    real_fsync = os.fsync

    def fsync(fd):
        info = os.fstat(fd)
        synced.append((stat.S_ISDIR(info.st_mode), info.st_size))
        real_fsync(fd)

    monkeypatch.setattr(runs.os, "fsync", fsync)
    path = tmp_path / "summary.json"
    runs.atomic_write_json(path, {"a": 1})
    data = path.read_bytes()
    assert json.loads(data) == {"a": 1} and data.endswith(b"\n")
    assert [is_dir for is_dir, _ in synced] == [False, True]  # the temp file with its bytes, then the folder
    assert synced[0][1] == len(data)
    assert os.listdir(tmp_path) == ["summary.json"]

    def killed(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        runs.atomic_write(path, lambda handle: handle.write(b"half of a new fi"))
    assert path.read_bytes() == data and os.listdir(tmp_path) == ["summary.json"]  # no temp file left


def test_read_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": 1,\n "b": }\n')
    with pytest.raises(runs.RunFileError, match=r"config.json:2: invalid JSON \(Expecting value\)"):
        runs.read_json(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(runs.RunFileError, match=r"config.json:1: invalid UTF-8 byte 0xff"):
        runs.read_json(path)
    with pytest.raises(run_dir.RunDirError, match=r"config.json:1: invalid UTF-8"):  # the trainer's error type
        run_dir.read_json(str(path))


def test_every_reader_leaves_out_a_torn_last_line_even_when_it_parses(tmp_path, caplog):
    """The one rule: a record is a newline-terminated line. An unterminated last line is what a killed
    appender leaves; every reader leaves it out (even when its bytes are valid JSON: the writer did not
    finish) and says so, and the writers that continue a file cut it."""
    # resume (metrics.jsonl): the torn record is not counted, the rewind cuts it
    out = tmp_path / "run"
    out.mkdir()
    complete = "".join(json.dumps({"phase": "rl", "iteration": i}) + "\n" for i in (1, 2))
    torn = json.dumps({"phase": "rl", "iteration": 3})  # parses, but has no newline
    metrics = out / "metrics.jsonl"
    metrics.write_text(complete + torn)
    log = runs.read_jsonl(metrics)
    assert [r["iteration"] for r in log.records] == [1, 2] and log.lines == [1, 2]
    assert log.ends == [len(complete) // 2, len(complete)] and log.torn == len(torn)
    assert "torn last line" in log.torn_note
    records, size = run_dir.read_metrics(str(metrics), 2)
    assert [r["iteration"] for r in records] == [1, 2] and size == len(complete)
    with pytest.raises(run_dir.RunDirError, match="holds 2 complete records; the checkpoint counts 3"):
        run_dir.read_metrics(str(metrics), 3)
    kept = run_dir.rewind(str(out), run_dir.check_log(str(out), 2, 2), 2)
    assert [r["iteration"] for r in kept] == [1, 2]
    assert metrics.read_text() == complete

    # the report: left out with a note
    run = _write_run(tmp_path / "reported", iterations=3, rollouts=False)
    full = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(full + json.dumps({"phase": "rl", "iteration": 4, "policy_updates": 8,
                                                         "train_accuracy": 0.5}))
    reported = load_run(run)
    assert reported.iterations == 3 and len(reported.records) == len(full.splitlines())
    assert any("torn last line" in note for note in reported.notes)

    # the evaluation's completions: left out with a warning, cut before appending
    completions = tmp_path / "completions.jsonl"
    good = json.dumps(_completion(0)) + "\n"
    completions.write_text(good + json.dumps(_completion(1)))
    with caplog.at_level(logging.WARNING):
        assert [r["sample"] for r in load_completions(completions)] == [0]
    assert "torn last line" in caplog.text
    assert repair_completions(completions) == len(json.dumps(_completion(1)))
    assert completions.read_text() == good and runs.cut_torn_tail(completions) == 0


def test_every_reader_refuses_a_damaged_complete_line_naming_it(tmp_path):
    """Damage a kill does not leave (a complete line that is not a JSON object) is never skipped."""
    out = tmp_path / "run"
    out.mkdir()
    first = json.dumps({"phase": "rl", "iteration": 1}) + "\n"
    for bad in ("{oops\n", "[1, 2]\n"):
        (out / "metrics.jsonl").write_text(first + bad + json.dumps({"phase": "rl", "iteration": 2}) + "\n")
        with pytest.raises(runs.RunFileError, match=r"metrics.jsonl:2: "):
            runs.read_jsonl(out / "metrics.jsonl")
        with pytest.raises(run_dir.RunDirError, match=r"metrics.jsonl:2: damaged record"):
            run_dir.check_log(str(out), 1, 1)
        completions = tmp_path / "completions.jsonl"
        completions.write_text(json.dumps(_completion(0)) + "\n" + bad)
        with pytest.raises(ValueError, match=r"completions.jsonl:2: "):
            load_completions(completions)
    run = _write_run(tmp_path / "reported", iterations=2, rollouts=False)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:2]) + "[1, 2]\n" + "".join(lines[2:]))
    with pytest.raises(ReportError, match=r"metrics.jsonl:3: damaged record \(a JSON list, expected an"):
        load_run(run)
