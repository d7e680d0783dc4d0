"""Runs that hold under faults: checked Hugging Face loading and data files, and concurrency and faults:
one writer per directory, a log two writers mixed refused on resume, a full disk or an unwritable
directory in one line, limits checked at start-up.

The end-to-end tests run `python -m experiments.train` in subprocesses with the tiny model of
tests/tiny_runs.py (see there).
"""

from __future__ import annotations

import errno
import json
import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.cli import run_cli
from experiments.train import DEFAULT_CONFIG, cli, load_config
from respo_jax.data import DataFileError, load_benchmark
from respo_jax.models import qwen3
from respo_jax.training import run_dir, run_lock
from respo_jax.training.checkpoint import list_steps, step_dir, verify_files
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.limits import check_limits, kv_cache_bytes
from respo_jax.training.run_lock import RunLock, RunLockedError
from respo_jax.training.write_errors import RunWriteError, writing
from tiny_runs import (
    REFERENCE_ARGS,
    ROOT,
    TINY_RUN,
    assert_same_run,
    copy_run,
    run_env,
    one_line_error,
    raw_state,
    snapshot,
    train,
    train_cmd,
)


# ---------------------------------------------------------- 7. Hugging Face checkpoints and data files


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from flax import nnx

    from respo_jax.models import qwen3

    cfg = qwen3.Qwen3Config.preset("tiny", num_hidden_layers=1, vocab_size=32, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("hf")
    qwen3.save_pretrained(qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), path)
    return path


def test_tied_config_with_a_different_lm_head_is_refused(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    from respo_jax.models import qwen3

    path = copy_run(hf_dir, tmp_path / "tied")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    with pytest.raises(ValueError, match="tie_word_embeddings=true, but lm_head.weight differs"):
        qwen3.from_pretrained(path)
    tensors = load_file(path / "model.safetensors")  # the same matrix stored twice is fine
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert qwen3.from_pretrained(path).config.tie_word_embeddings


def test_non_finite_weights_are_refused_naming_the_tensor(hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    from respo_jax.models import qwen3

    path = copy_run(hf_dir, tmp_path / "nan")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 1] = np.nan
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=rf"tensor '{name}' in .* 1 NaN/inf .*\[3, 1\]"):
        qwen3.from_pretrained(path)


def test_json_errors_name_the_file_and_line(hf_dir, tmp_path):
    from respo_jax.models import qwen3

    path = copy_run(hf_dir, tmp_path / "json")
    text = (path / "config.json").read_text().splitlines()
    text[2] = text[2] + ",,"
    (path / "config.json").write_text("\n".join(text))
    with pytest.raises(ValueError, match=r"config.json:3: invalid JSON"):
        qwen3.from_pretrained(path)
    sharded = tmp_path / "sharded"
    qwen3.save_pretrained(qwen3.from_pretrained(hf_dir), sharded, max_shard_bytes=4096)
    index = sharded / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"weight_map": {', '"weight_map": {{', 1))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json:\d+: invalid JSON"):
        qwen3.from_pretrained(sharded)
    (path / "config.json").write_bytes(b'{\n "model_type": "qwen3\xff"\n}')
    with pytest.raises(ValueError, match=r"config.json:2: invalid UTF-8 byte 0xff"):
        qwen3.from_pretrained(path)
    config = apply_overrides(load_config(DEFAULT_CONFIG), [f"model.checkpoint_dir={path}"])  # pure: passes
    with pytest.raises(ConfigError, match=r"^model.checkpoint_dir=.*config.json:2: invalid UTF-8"):
        config.check_paths()  # the trainer's start-up check of the files a config names


def test_a_bad_utf8_byte_in_a_data_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_bytes(b'{"problem": "1+1", "answer": "2", "id": 0}\n'
                     b'{"problem": "caf\xe9", "answer": "3", "id": 1}\n')
    with pytest.raises(DataFileError, match=r"test.jsonl:2: invalid UTF-8 byte 0xe9"):
        load_benchmark("aime24", str(path))



# ------------------------------------------------ one writer per directory, full and unwritable disks


def test_a_second_writer_is_refused_and_the_lock_goes_with_its_holder(tmp_path):
    out = tmp_path / "new" / "run"
    lock = RunLock.acquire(str(out), "training")
    holder = json.loads((out / ".lock").read_text())
    assert holder["pid"] == os.getpid() and holder["what"] == "training"
    held = f"being written by another process \\(training, pid {os.getpid()} "
    with pytest.raises(RunLockedError, match=held):
        RunLock.acquire(str(out), "evaluation")  # another open file description: flock refuses it
    assert run_dir.run_entries(str(out)) == ()  # the lock file is not a run entry
    lock.release(remove_if_created=True)
    assert not out.exists() and (tmp_path / "new").is_dir()  # only what acquire created goes
    kept = RunLock.acquire(str(tmp_path), "training")
    (tmp_path / "notes.txt").write_text("x")
    kept.release(remove_if_created=True)
    assert sorted(os.listdir(tmp_path)) == ["new", "notes.txt"]  # no .lock left behind


def test_an_unwritable_out_dir_is_refused_at_start_up_in_one_line(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    below = afile / "run"
    assert cli([*TINY_RUN, f"run.out_dir={below}"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"error: run.out_dir='{below}': cannot write the run directory"), line
    assert "Not a directory" in line and "MiB free" in line
    assert afile.read_text() == "not a directory" and sorted(os.listdir(tmp_path)) == ["afile"]

    # A read-only file system (root ignores chmod, so the lock file's open is made to fail as it would).
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(run_lock, "open", read_only, raising=False)
    out = tmp_path / "ro"
    assert cli([*TINY_RUN, f"run.out_dir={out}"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"run.out_dir='{out}'" in line and "Read-only file system" in line and ".lock" in line
    assert not out.exists()  # the directory acquire had created is gone again


@pytest.mark.parametrize("override, expected", [
    ("rollout.max_new_tokens=10000000", "rollout.max_new_tokens=10000000: the longest prompt ("),
    (f"run.iterations={10**20}", f"run.iterations={10**20}: expected an integer in [1, 1_000_000_000]"),
    ("run.policy_updates=4000000000", "run.policy_updates=4000000000: expected an integer in [0, "),
    ("warmup.steps=10000000000", "warmup.steps=10000000000: expected an integer in [0, 1_000_000_000]"),
])
def test_limits_are_checked_at_start_up_with_nothing_written(tmp_path, capsys, override, expected):
    out = tmp_path / "run"
    assert cli([*TINY_RUN, f"run.out_dir={out}", override]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"error: {expected}"), line
    assert os.listdir(tmp_path) == []


def test_the_kv_cache_is_checked_against_the_devices_memory():
    tiny = qwen3.Qwen3Config.preset("tiny")
    per_token = 2 * tiny.num_hidden_layers * tiny.num_key_value_heads * tiny.head_dim * 4  # float32 k and v
    assert kv_cache_bytes(tiny, 3, 5, "float32") == 3 * 5 * per_token
    paper = load_config(os.path.join(ROOT, "experiments", "configs", "qwen3_1p7b_dapo.py"))
    model = qwen3.Qwen3Config.preset("qwen3-1.7b")
    assert kv_cache_bytes(model, 256, 16384, "bfloat16") == 256 * 16384 * 28 * 8 * 128 * 2 * 2
    with pytest.raises(ConfigError, match=r"\(40960\); expected at most 0$"):
        check_limits(paper, model, 40960, memory_bytes=None)
    # The engine's page pool of the paper config (its kv_cache_bytes) fits one 141 GB device, in either
    # schedule (a static batch is the same engine over the same pool).
    assert paper.rollout.scheduler == "continuous" and paper.rollout.kv_cache_bytes > 0
    for scheduler in ("continuous", "static"):
        config = dataclasses.replace(paper, rollout=dataclasses.replace(paper.rollout, scheduler=scheduler))
        check_limits(config, model, 1024, memory_bytes=141 * 10**9)
        with pytest.raises(ConfigError, match=r"^rollout.kv_cache_bytes=\d+: the rollout engine's page pool"):
            check_limits(config, model, 1024, memory_bytes=paper.rollout.kv_cache_bytes // 2)


def test_the_continuous_engines_pool_is_checked_at_start_up():
    tiny = qwen3.Qwen3Config.preset("tiny")
    config = apply_overrides(load_config(DEFAULT_CONFIG), ["rollout.max_new_tokens=1000"])
    r = config.rollout
    page = 2 * tiny.num_hidden_layers * tiny.num_key_value_heads * tiny.head_dim * 4 * r.page_size
    # Default pool: every slot holds a row of the 16-token prompt bucket + 1000 tokens (63 pages), plus
    # one partial prompt page per slot, plus the scratch page.
    pool = r.max_slots * (-(-(16 + 1000) // r.page_size) + 1) + 1
    check_limits(config, tiny, 12, memory_bytes=pool * page)
    with pytest.raises(ConfigError, match=rf"^rollout.max_slots={r.max_slots}: the rollout engine's page pool"):
        check_limits(config, tiny, 12, memory_bytes=pool * page - 1)
    # Fewer rows than max_slots: the engine runs as many slots as rows (here the 128 held-out problems,
    # more than the 4 x 1 x 8 rollout rows), and its default pool is sized for those.
    fewer = apply_overrides(config, ["rollout.prompts_per_minibatch=1"])
    small_pool = 128 * (-(-(16 + 1000) // r.page_size) + 1) + 1
    check_limits(fewer, tiny, 12, memory_bytes=small_pool * page)
    with pytest.raises(ConfigError, match=r"^rollout.max_slots=256: the rollout engine's page pool \(8320 pages"):
        check_limits(fewer, tiny, 12, memory_bytes=small_pool * page - 1)
    # A pool that cannot hold one row is refused by the engine scheduler's own rule, naming the key.
    small = apply_overrides(config, ["rollout.num_pages=10"])
    with pytest.raises(ConfigError, match=r"^rollout.num_pages=10: the page pool \(10 pages of 16 tokens\) is "
                                          r"too small for row 0"):
        check_limits(small, tiny, 12, memory_bytes=None)
    check_limits(apply_overrides(config, ["rollout.num_pages=65"]), tiny, 12, memory_bytes=None)  # 64 + 1 partial
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_bytes=1: kv_cache_bytes=1 holds no page"):
        check_limits(apply_overrides(config, ["rollout.kv_cache_bytes=1"]), tiny, 12, memory_bytes=None)


def test_log_problem_finds_a_second_writer_in_the_log():
    def warm(i):
        return {"phase": "warmup", "step": i}

    def rl(i):
        return {"phase": "rl", "iteration": i}

    evals = {"phase": "eval"}
    assert run_dir.log_problem([warm(1), warm(2), evals, rl(1), rl(2), evals]) is None
    assert run_dir.log_problem([rl(1), rl(2)]) is None  # no warm-up
    # The mixed log: two warm-ups interleaved, then iteration 1 twice.
    assert run_dir.log_problem([warm(1), warm(1), warm(2), warm(2), evals, rl(1), rl(1)]) == (
        "record 2 is warm-up step 1 after 1 warm-up steps and 0 RL iterations")
    assert run_dir.log_problem([warm(1), evals, rl(1), rl(1)]) == (
        "record 4 is RL iteration 1 after iteration 1")
    assert run_dir.log_problem([rl(1), rl(3)]) == "record 2 is RL iteration 3 after iteration 1"
    assert "warm-up step 1 after 1 warm-up steps and 1 RL" in run_dir.log_problem([warm(1), rl(1), warm(1)])


@pytest.mark.slow
def test_resume_refuses_a_log_with_duplicated_iterations(tmp_path, reference, capsys):
    out = copy_run(reference, tmp_path / "run")
    base = [*TINY_RUN, f"run.out_dir={out}", "run.iterations=9", "run.resume=true"]
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    rl = [i for i, line in enumerate(lines) if json.loads(line)["phase"] == "rl"]
    (out / "metrics.jsonl").write_bytes(b"".join(lines[:rl[1]] + [lines[rl[0]]] + lines[rl[1]:]))
    before = snapshot(out)
    assert cli(base) == 2  # iteration 1 twice among the records the checkpoint counts
    line = one_line_error(capsys.readouterr().err)
    assert "is not one run's log (record 5 is RL iteration 1 after iteration 1)" in line, line
    assert "drop or repeat RL records" in line and "run.overwrite=true" in line
    assert snapshot(out) == before
    counted = json.loads((out / "checkpoints" / "8" / "meta" / "metadata").read_text())["metrics_records"]
    for broken, where in [
        (lines + [lines[rl[2]]], "record 13 is RL iteration 3 after iteration 8"),  # after those records
        ([lines[0], lines[0]] + lines[1:], "record 2 is warm-up step 1 after 1 warm-up steps"),
    ]:
        (out / "metrics.jsonl").write_bytes(b"".join(broken))
        with pytest.raises(run_dir.RunDirError, match=f"is not one run's log \\({where}"):
            run_dir.check_log(str(out), counted, 8)


def test_rewind_refuses_a_log_changed_after_its_checkpoint(tmp_path):
    """A checkpoint keeps the SHA-256 of the records it counts; a byte changed in them afterwards (still
    valid JSON, still one run's order) is refused in one line, records after them may change freely."""
    records = [{"phase": "warmup", "step": 1, "loss": 0.5}, {"phase": "rl", "iteration": 1, "score": 0.25},
               {"phase": "rl", "iteration": 2, "score": 0.125}]
    with run_dir.MetricsLog(str(tmp_path)) as log:
        for record in records:
            log.append(record)
        assert log.sha256() == run_dir.log_digest(records)  # the running digest: the whole log's
    digest = run_dir.log_digest(records[:2])
    path = tmp_path / "metrics.jsonl"
    original = path.read_bytes()
    assert run_dir.rewind(str(tmp_path), run_dir.check_log(str(tmp_path), 2, 1, digest), 1) == records[:2]
    assert path.read_bytes() == original[:len(b"".join(map(run_dir.record_line, records[:2])))]  # cut
    path.write_bytes(original)
    path.write_bytes(original.replace(b'"score": 0.125', b'"score": 0.925'))  # after the counted ones
    assert run_dir.check_log(str(tmp_path), 2, 1, digest).records == records[:2]
    path.write_bytes(original.replace(b'"score": 0.25', b'"score": 0.75'))
    assert run_dir.log_problem([json.loads(line) for line in path.read_bytes().splitlines()]) is None
    with pytest.raises(run_dir.RunDirError, match="first 2 records of .* are not the bytes its checkpoint "
                                                  r"saw \(SHA-256 differs\)"):
        run_dir.check_log(str(tmp_path), 2, 1, digest)
    assert run_dir.check_log(str(tmp_path), 2, 1) is not None  # a checkpoint without a digest: not checked


@pytest.mark.slow
def test_resume_refuses_a_log_whose_counted_records_changed(tmp_path, reference, capsys):
    out = copy_run(reference, tmp_path / "run")
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    rl = [i for i, line in enumerate(lines) if json.loads(line)["phase"] == "rl"]
    record = json.loads(lines[rl[1]])
    record["train_accuracy"] = record["train_accuracy"] + 0.5  # valid JSON, the order of one run
    lines[rl[1]] = (json.dumps(record) + "\n").encode()
    (out / "metrics.jsonl").write_bytes(b"".join(lines))
    before = snapshot(out)
    assert cli([*TINY_RUN, f"run.out_dir={out}", "run.iterations=9", "run.resume=true"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "are not the bytes its checkpoint saw (SHA-256 differs)" in line, line
    assert snapshot(out) == before


_FULL_DISK = """
import builtins, errno, os, sys
real_open = builtins.open
def full_disk(file, mode="r", *args, **kwargs):  # the disk fills while checkpoint step 6 is written
    name = os.fspath(file) if isinstance(file, (str, os.PathLike)) else ""
    if any(c in mode for c in "wax+") and os.sep + "checkpoints" + os.sep + "6" in name:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
    return real_open(file, mode, *args, **kwargs)
builtins.open = full_disk
from experiments.train import cli
sys.exit(cli(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_resume_after_making_room_is_exact(
        tmp_path, jit_cache, reference):
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", _FULL_DISK, *train_cmd(out, *REFERENCE_ARGS)[3:]]
    result = subprocess.run(cmd, cwd=ROOT, env=run_env(jit_cache), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_line_error(result.stderr)
    assert line.startswith(f"error: cannot write checkpoint step 6 to {out / 'checkpoints' / '6'}"), line
    assert "No space left on device" in line and "MiB free" in line and "steps [3]) are kept" in line
    assert "ImportError" not in result.stderr and len(result.stderr.strip().splitlines()) <= 3, result.stderr
    assert list_steps(out / "checkpoints") == [3] and not (out / ".lock").exists()
    assert verify_files(step_dir(str(out / "checkpoints"), 3)) is None  # intact, and as the reference's
    (got, got_meta), (want, want_meta) = (raw_state(d / "checkpoints", 3) for d in (out, reference))
    assert got_meta == want_meta and all(got[k].tobytes() == want[k].tobytes() for k in want)

    final = train(jit_cache, out, *REFERENCE_ARGS)  # space is back
    assert final.returncode == 0, final.stderr[-3000:]
    assert_same_run(out, reference)


@pytest.mark.slow
def test_two_concurrent_trainings_into_one_out_dir_one_refused_the_other_a_lone_run(
        tmp_path, jit_cache, reference):
    out = tmp_path / "run"
    first = subprocess.Popen(train_cmd(out, *REFERENCE_ARGS), cwd=ROOT, env=run_env(jit_cache),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while first.poll() is None and time.monotonic() < deadline:  # until the first holds the lock
            try:
                if json.loads((out / ".lock").read_text())["pid"] == first.pid:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
        second = train(jit_cache, out, *REFERENCE_ARGS)
        assert second.returncode == 2, second.stderr[-3000:]
        line = one_line_error(second.stderr)
        assert f"{str(out)!r} is being written by another process (training, pid {first.pid} " in line, line
        assert "train.py" in line  # the holder's command
        _, stderr = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-3000:]
    assert_same_run(out, reference)
    assert not (out / ".lock").exists()


def test_mesh_equivalence_and_the_benchmarks_give_one_line_and_exit_2_for_a_bad_flag(tmp_path, capsys):
    from experiments import mesh_equivalence
    from experiments.benchmarks import __main__ as bench_main
    from experiments.benchmarks import rl_iteration

    out = tmp_path / "mesh"
    for argv, expected in [(["--frobnicate"], "unrecognized arguments: --frobnicate"),
                           (["--meshes", "1,2", "--out", str(out)], "--meshes: '1,2' is not data,fsdp"),
                           (["--devices", "-1", "--out", str(out)], "--devices -1: expected 0")]:
        assert mesh_equivalence.cli(argv) == 2, argv
        assert expected in one_line_error(capsys.readouterr().err), argv
    assert not out.exists()
    for main, argv, expected in [
        (bench_main.main, ["--parts", "nope"], "argument --parts: invalid choice"),
        (rl_iteration.main, ["--iterations", "x"], "argument --iterations: invalid int"),
    ]:
        assert run_cli(main, argv) == 2
        assert expected in one_line_error(capsys.readouterr().err)
    result = subprocess.run([sys.executable, "-m", "experiments.benchmarks", "--bogus"], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in one_line_error(result.stderr)


def test_a_second_sweep_into_one_runs_dir_is_refused_before_it_writes(tmp_path, capsys):
    from experiments import gradient_starvation

    runs = tmp_path / "runs"
    holder = RunLock.acquire(str(runs), "gradient-starvation sweep")
    try:
        argv = ["--quick", f"sweep.runs_dir={runs}", f"sweep.out_dir={tmp_path / 'report'}"]
        assert gradient_starvation.cli(argv) == 2
        line = one_line_error(capsys.readouterr().err)
        assert "is being written by another process (gradient-starvation sweep" in line
        assert os.listdir(runs) == [".lock"] and not (tmp_path / "report").exists()
    finally:
        holder.release(remove_if_created=True)
    assert not runs.exists()


def test_a_full_disk_while_logging_is_one_line_naming_the_file_and_the_free_space(tmp_path, monkeypatch):
    class FullDisk:
        def __init__(self, real):
            self.real, self.full = real, False

        def write(self, data):  # once full, the disk takes half of the line, then nothing
            if not self.full:
                return self.real.write(data)
            if len(data) > 4:
                return self.real.write(bytes(data[:len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.real, name)

    files = []

    def opening(*args, **kwargs):  # the log's file, as the operating system hands it out
        files.append(FullDisk(open(*args, **kwargs)))
        return files[-1]

    monkeypatch.setattr(run_dir, "open", opening, raising=False)
    with run_dir.MetricsLog(str(tmp_path)) as log:
        log.append({"phase": "rl", "iteration": 1})
        files[-1].full = True
        with pytest.raises(RunWriteError) as info:
            log.append({"phase": "rl", "iteration": 2})
    message = str(info.value)
    assert message.startswith(f"cannot write a metrics record to {tmp_path / 'metrics.jsonl'}: No space left")
    assert "MiB free of" in message and "\n" not in message
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(b'{"phase": "rl", "iteration": 1}\n{"phase"')
    with pytest.raises(KeyError):  # anything but a write error keeps its type (and traceback)
        with writing("x", str(tmp_path)):
            raise KeyError("a bug")
