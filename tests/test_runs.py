"""Runs that never mix, lose or poison results (issue 14): validation before any write, run-directory
rules, exact resume after SIGKILL, NaN stops, verified checkpoints, atomic writes, checked HF loading;
and that hold under concurrency and faults (issue 25): one writer per directory, a log two writers
mixed refused on resume, a full disk or an unwritable directory in one line, limits checked at start-up.

The end-to-end tests run `python -m experiments.train` in subprocesses with a tiny model (one layer,
width 16) on the synthetic task; they share a persistent XLA compilation cache so that only the first
process compiles.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.cli import run_cli
from experiments.train import DEFAULT_CONFIG, cli, load_config
from respo_jax.data import DataFileError, load_benchmark
from respo_jax.models import qwen3
from respo_jax.training import run_dir, run_lock
from respo_jax.training.checkpoint import (
    CheckpointError,
    list_steps,
    restore_checkpoint,
    restore_latest_intact,
    save_checkpoint,
    set_aside,
    step_dir,
    verify_files,
    write_manifest,
)
from respo_jax.training.config import ConfigError, ConfigKeyError, ExperimentConfig, apply_overrides
from respo_jax.training.iteration_metrics import check_finite_steps
from respo_jax.training.limits import check_limits, kv_cache_bytes
from respo_jax.training.run_lock import RunLock, RunLockedError
from respo_jax.training.step import NonFiniteError
from respo_jax.training.write_errors import RunWriteError, writing

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_MODEL = ('model.overrides={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, '
              '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}')
# A run of seconds that still learns: a 2-step warm-up, 2 prompts x 2 responses x 2 mini-batches, the
# overlong penalty so that rewards (and advantages) differ within a group, a 4-problem greedy eval.
TINY_RUN = [
    TINY_MODEL, "warmup.steps=2", "warmup.batch_size=4", "rollout.prompts_per_minibatch=2",
    "rollout.group_size=2", "rollout.reuse=2", "rollout.max_new_tokens=6", "task.overlong_buffer_length=4",
    "task.num_records=64", "run.eval_problems=4", "run.progress=false", "run.host_allocator=false",
]
# Depend on the process, not the run: a resumed process compiles its programs again.
TIMING_KEYS = ("rollout_seconds", "iteration_seconds", "compiles", "compile_seconds", "compile_cache_hits")


# ----------------------------------------------------------------------------------------- helpers


REFERENCE_ARGS = ("run.iterations=8", "run.checkpoint_every=3", "run.resume=true")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, jit_cache) -> pathlib.Path:
    """An uninterrupted run of 8 iterations, checkpoints at 3, 6, 8 (tests work on copies)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = _train(jit_cache, out, *REFERENCE_ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _train_cmd(out_dir, *overrides) -> list[str]:
    return [sys.executable, "-m", "experiments.train", *TINY_RUN, f"run.out_dir={out_dir}", *overrides]


def _env(jit_cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jit_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)  # one host device, as a user's run
    return env


def _train(jit_cache, out_dir, *overrides, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(_train_cmd(out_dir, *overrides), cwd=ROOT, env=_env(jit_cache), capture_output=True,
                          text=True, timeout=timeout)


def _records(out_dir) -> list[dict]:
    path = pathlib.Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def _snapshot(folder) -> dict[str, bytes]:
    """Every file under `folder` with its bytes."""
    folder = pathlib.Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _raw_state(checkpoints, step):
    """(state leaves by path, meta) of a checkpoint step read without a template (no trainer needed)."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(step_dir(str(checkpoints), step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    leaves = jax.tree_util.tree_flatten_with_path(restored["state"])[0]
    return {jax.tree_util.keystr(path): np.asarray(value) for path, value in leaves}, restored["meta"]


def _flip_a_bit(folder) -> str:
    """Flips one bit in the middle of the largest array file of a checkpoint step; returns its path."""
    files = [p for p in glob.glob(os.path.join(folder, "state", "**", "*"), recursive=True)
             if os.path.isfile(p) and os.sep + "d" + os.sep in p]
    path = max(files, key=os.path.getsize)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[len(data) // 2] ^= 0x10
    pathlib.Path(path).write_bytes(bytes(data))
    return path


def _copy(src, dst) -> pathlib.Path:
    shutil.copytree(src, dst)
    return pathlib.Path(dst)


def _one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ------------------------------------------------------------------- 6. validation before any write


@pytest.mark.parametrize("override, key", [
    ("rollout.group_size=1", "rollout.group_size=1"),
    ("optim.b1=2", "optim.b1=2.0"),
    ("optim.b2=1", "optim.b2=1.0"),
    ("optim.weight_decay=-5", "optim.weight_decay=-5.0"),
    ("run.checkpoint_every=-1", "run.checkpoint_every=-1"),
    ("rollout.top_p=0", "rollout.top_p=0.0"),
    ("rollout.top_p=2", "rollout.top_p=2.0"),
    ("rollout.top_k=-3", "rollout.top_k=-3"),
    ("rollout.temperature=0", "rollout.temperature=0.0"),
    ("run.eval_problems=-1", "run.eval_problems=-1"),
    ("run.seed=-1", "run.seed=-1"),
    ("task.seed=-2", "task.seed=-2"),
    ("task.difficulty=impossible", "task.difficulty='impossible'"),
    ("warmup.batch_size=0", "warmup.batch_size=0"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1"),
    ("rollout.max_new_tokens=3", "rollout.max_new_tokens=3"),  # the easy task's answers need 4 tokens
    ("task.overlong_buffer_length=99", "task.overlong_buffer_length=99"),
    ("objective.name=ppo", "objective.name='ppo'"),
    ("objective.hparams.eps_hgh=0.3", "objective.hparams={'eps_hgh': 0.3}"),
    ("objective.hparams.lam=[1, -1]", "objective.hparams={'lam': [1, -1]}"),
    ("model.preset=qwen9", "model.preset='qwen9'"),
    ('model.overrides={"hidden_sise": 8}', "model.overrides={'hidden_sise': 8}"),
    ("task.name=dapo_math", "this configuration reads local files that are not set"),
    ("run.out_dir=", "run.out_dir=''"),
])
def test_bad_values_fail_validation_with_key_value_and_what_is_allowed(override, key):
    config = load_config(DEFAULT_CONFIG)
    with pytest.raises(ConfigError) as info:
        apply_overrides(config, [override])
    message = str(info.value)
    assert message.startswith(key) and "\n" not in message, message
    assert "expected" in message or ":" in message


def _float_keys() -> list[str]:
    sections = typing.get_type_hints(ExperimentConfig)
    return [f"{section}.{field.name}" for section, cls in sections.items()
            for field in dataclasses.fields(cls) if typing.get_type_hints(cls)[field.name] is float]


@pytest.mark.parametrize("key", _float_keys())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_field_rejects_nan_and_inf(key, value):
    with pytest.raises(ConfigError, match=f"^{key}={value}: expected a finite number$"):
        apply_overrides(load_config(DEFAULT_CONFIG), [f"{key}={value}"])


def test_missing_files_fail_the_start_up_check_not_the_pure_validation(tmp_path):
    paths = ["task.name=dapo_math", "warmup.steps=0", f"task.data_dir={tmp_path}",
             f"task.tokenizer_dir={tmp_path}"]
    config = apply_overrides(load_config(DEFAULT_CONFIG), paths)  # a saved config stays valid anywhere
    with pytest.raises(ConfigError, match=f"^task.data_dir='{tmp_path}': no data file for 'dapo_math'"):
        config.check_paths()
    missing = apply_overrides(load_config(DEFAULT_CONFIG), ["model.checkpoint_dir=/nonexistent"])
    with pytest.raises(ConfigError, match="^model.checkpoint_dir='/nonexistent': expected a Hugging Face"):
        missing.check_paths()


def test_fields_of_the_wrong_type_from_a_config_file_are_refused():
    config = load_config(DEFAULT_CONFIG)
    with pytest.raises(ConfigError, match=r"^run.iterations=2.5: expected an integer$"):
        dataclasses.replace(config, run=dataclasses.replace(config.run, iterations=2.5)).validate()
    with pytest.raises(ConfigError, match=r"^run.resume='yes': expected true or false$"):
        dataclasses.replace(config, run=dataclasses.replace(config.run, resume="yes")).validate()
    with pytest.raises(ConfigKeyError, match="^unknown config key 'run.overwrit'") as info:
        apply_overrides(config, ["run.overwrit=true"])
    assert isinstance(info.value, KeyError)
    with pytest.raises(ConfigError, match="^run.overwrite=True: expected false with run.resume=true"):
        apply_overrides(config, ["run.resume=true", "run.overwrite=true"])


def test_cli_prints_one_line_and_exits_2_for_a_user_error(tmp_path, capsys):
    overrides = [f"run.out_dir={tmp_path / 'run'}", "objective.hparams.eps_hgh=0.3", "objective.name=grpo"]
    assert cli(overrides) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "objective.hparams={'eps_hgh': 0.3}" in line and "eps_high" in line
    assert not (tmp_path / "run").exists()  # nothing written


# ----------------------------------------------------- 3. non-finite values stop the run in time


def test_check_finite_steps_names_the_iteration_mini_batch_and_quantity():
    good = {"loss": 0.5, "grad_norm": 1.0, "params_finite": True}
    steps = [dict(good), dict(good)]
    check_finite_steps(steps, 3)
    assert all("params_finite" not in m for m in steps)  # not a metric
    for bad, expected in [({"loss": float("nan")}, "iteration 7, mini-batch 2/2: loss is nan"),
                          ({"grad_norm": float("inf")}, "iteration 7, mini-batch 2/2: grad_norm is inf"),
                          ({"params_finite": False}, "iteration 7, mini-batch 2/2: the updated parameters")]:
        with pytest.raises(NonFiniteError, match=expected):
            check_finite_steps([dict(good), dict(good, **bad)], 7)


@pytest.mark.slow
def test_a_diverging_run_exits_1_and_keeps_only_finite_checkpoints(tmp_path, jit_cache):
    """lr = 1e38 (warmed up from 0, so iteration 1 is still finite) blows up in iteration 2."""
    out = tmp_path / "run"
    result = _train(jit_cache, out, "run.iterations=3", "run.checkpoint_every=1", "optim.learning_rate=1e38",
                    "optim.warmup_steps=3", "warmup.steps=0", "run.eval_problems=0")  # fewer programs
    assert result.returncode == 1, result.stderr[-3000:]
    line = _one_line_error(result.stderr)
    assert "iteration 2, mini-batch 1/2:" in line and ("nan" in line or "NaN" in line), line
    assert list_steps(out / "checkpoints") == [1]
    state, meta = _raw_state(out / "checkpoints", 1)
    assert meta["iteration"] == 1 and all(np.isfinite(v).all() for v in state.values())
    assert verify_files(step_dir(str(out / "checkpoints"), 1)) is None
    assert [r["iteration"] for r in _records(out) if r["phase"] == "rl"] == [1]
    assert not (out / "summary.json").exists()


# ------------------------------------------ 1, 2, 4. run directories: refuse, resume exactly, overwrite


def _assert_same_run(out: pathlib.Path, reference: pathlib.Path) -> None:
    """Metrics (but timings), summary and the last checkpoint of `out` equal the reference's bit for bit."""
    records, expected = _records(out), _records(reference)
    assert _without_timings(records) == _without_timings(expected)
    assert [r["iteration"] for r in records if r["phase"] == "rl"] == list(range(1, 9))
    assert [r["phase"] for r in records].count("eval") == 2 and records[0]["phase"] == "warmup"
    assert (out / "summary.json").read_text() == (reference / "summary.json").read_text()
    assert json.loads((out / "summary.json").read_text())["iterations"] == 8
    assert list_steps(out / "checkpoints")[-1] == 8 and list_steps(reference / "checkpoints")[-1] == 8
    got, got_meta = _raw_state(out / "checkpoints", 8)
    want, want_meta = _raw_state(reference / "checkpoints", 8)
    assert got_meta == want_meta and got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key


@pytest.mark.slow
def test_killed_runs_resume_bit_identical_to_an_uninterrupted_run(tmp_path, jit_cache, reference):
    """SIGKILL at random points (mid-iteration, between checkpoints, during saves, after the last
    iteration), each time rerun with run.resume=true: metrics, summary and parameters equal the
    uninterrupted run's bit for bit, with no repeated record."""
    args = REFERENCE_ARGS
    records = _records(reference)
    assert sum(r["grad_norm"] > 0 for r in records if r["phase"] == "rl") >= 6  # it does learn something
    out = tmp_path / "killed"
    rng = random.Random(14)
    kills = []  # (last iteration logged, checkpoint steps) when each SIGKILL landed

    def max_iteration() -> int:
        try:
            lines = (out / "metrics.jsonl").read_bytes().split(b"\n")[:-1]
            return max([json.loads(line).get("iteration", 0) for line in lines] + [0])
        except (OSError, ValueError):
            return 0

    # (iterations to see first, extra random delay): the third kill lands after the last iteration.
    plan = [(2, rng.uniform(0.0, 0.4)), (2, rng.uniform(0.0, 0.4)), (None, rng.uniform(0.0, 0.6))]
    for target_step, delay in plan:
        target = 8 if target_step is None else min(max_iteration() + target_step, 8)
        proc = subprocess.Popen(_train_cmd(out, *args), cwd=ROOT, env=_env(jit_cache),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 240
            while proc.poll() is None and max_iteration() < target and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(delay)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills.append((max_iteration(), list_steps(out / "checkpoints")))
            proc.wait()
    assert len(kills) >= 2, kills  # the run did not simply finish each time
    final = _train(jit_cache, out, *args)
    assert final.returncode == 0, (kills, final.stderr[-3000:])

    _assert_same_run(out, reference)
    print("kill points (last iteration logged, checkpoints):", kills)


@pytest.mark.slow
def test_a_reused_out_dir_is_refused_and_a_failed_start_changes_nothing(tmp_path, jit_cache, reference,
                                                                         capsys):
    out = _copy(reference, tmp_path / "run")
    before = _snapshot(out)
    assert {"config.json", "metrics.jsonl", "summary.json", "training_curves.png"} <= set(before)

    # The command a user would type: another objective into the same directory.
    second = _train(jit_cache, out, "run.iterations=2", "objective.name=grpo")
    assert second.returncode == 2
    assert "already holds a run" in _one_line_error(second.stderr) and "run.resume=true" in second.stderr
    assert _snapshot(out) == before

    # Each of these fails before anything is written (in-process: the same code path as above).
    base = [*TINY_RUN, f"run.out_dir={out}"]
    for overrides, expected in [
        (["run.iterations=2"], "already holds a run"),
        (["run.iterations=9", "run.resume=true", "objective.name=grpo"],
         "objective.name: saved 'respo', now 'grpo'"),
        (["run.iterations=9", "run.resume=true", "rollout.top_p=0"], "rollout.top_p=0.0"),
        (["run.iterations=2", "run.overwrite=true", "objective.hparams.eps_hgh=0.3"], "eps_hgh"),
        (["run.iterations=7", "run.resume=true"], "run.iterations=7: expected at least the 8 iterations"),
        (["run.iterations=9", "run.resume=true", "model.preset=nope"], "model.preset='nope'"),
    ]:
        assert cli(base + overrides) == 2, overrides
        assert expected in _one_line_error(capsys.readouterr().err), overrides
        assert _snapshot(out) == before, overrides

    # A log that lost records the last checkpoint counts is refused before anything is rewritten.
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (out / "metrics.jsonl").write_bytes(b"".join(lines[:4]))
    shortened = _snapshot(out)
    assert cli(base + ["run.iterations=9", "run.resume=true"]) == 2
    assert "holds 4 complete records; the checkpoint counts 11" in _one_line_error(capsys.readouterr().err)
    assert _snapshot(out) == shortened


def test_overwrite_clears_the_old_run_and_keeps_foreign_files(tmp_path):
    out = tmp_path / "run"
    for name in ("metrics.jsonl", "summary.json", "config.json", ".metrics.jsonl.abc.tmp"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("old\n")
    (out / "checkpoints" / "7").mkdir(parents=True)
    (out / "rollouts").mkdir()
    (out / "rollouts" / "iteration_000001.npz").write_bytes(b"old")
    (out / "notes.txt").write_text("mine")
    config = apply_overrides(load_config(DEFAULT_CONFIG), [f"run.out_dir={out}", "run.overwrite=true"])
    plan = run_dir.plan_run_dir(config)
    assert plan.mode == "overwrite" and "checkpoints" in plan.entries
    run_dir.start_run_dir(plan, config)
    assert sorted(os.listdir(out)) == ["config.json", "notes.txt"]
    assert json.loads((out / "config.json").read_text()) == config.to_dict()
    fresh = apply_overrides(load_config(DEFAULT_CONFIG),
                            [f"run.out_dir={tmp_path / 'new'}", "run.resume=true"])
    assert run_dir.plan_run_dir(fresh).mode == "fresh"  # resume of nothing starts afresh
    (tmp_path / "file").write_text("x")
    with pytest.raises(run_dir.RunDirError, match="expected a directory"):
        run_dir.plan_run_dir(apply_overrides(fresh, [f"run.out_dir={tmp_path / 'file'}"]))


def test_resume_may_change_only_the_resumable_keys(tmp_path):
    config = load_config(DEFAULT_CONFIG)
    saved = json.loads(json.dumps(config.to_dict()))
    changed = apply_overrides(config, ["run.iterations=999", "run.checkpoint_every=5", "run.progress=false",
                                       "run.resume=true", f"run.out_dir={tmp_path}",
                                       "rollout.max_tokens_per_microbatch=1000", "rollout.sampler_max_rows=7"])
    assert run_dir.config_differences(saved, changed) == []
    assert run_dir.config_differences(saved, apply_overrides(config, ["rollout.response_bucket=8"])) == [
        "rollout.response_bucket: saved 64, now 8"]
    assert run_dir.config_differences(saved, apply_overrides(config, ["run.seed=1", "optim.b2=0.99"])) == [
        "optim.b2: saved 0.999, now 0.99", "run.seed: saved 0, now 1"]
    del saved["rollout"]["top_k"]  # a field added after the run was saved matches its default
    assert run_dir.config_differences(saved, config) == []
    assert run_dir.config_differences(saved, apply_overrides(config, ["rollout.top_k=5"])) == [
        "rollout.top_k: saved 0, now 5"]
    assert run_dir.config_differences([1, 2], config)  # not a config at all
    ratio = apply_overrides(config, ["optim.warmup_ratio=0.1"])  # 300 iterations x N=4: W = 120 updates
    saved = json.loads(json.dumps(ratio.to_dict()))
    assert run_dir.config_differences(saved, apply_overrides(ratio, ["run.iterations=400"])) == [
        "the learning-rate warm-up (optim.warmup_ratio x the run length): saved 120 steps, now 160"]


def test_rewind_drops_records_and_rollouts_after_the_checkpoint_and_repairs_a_torn_line(tmp_path):
    lines = [json.dumps({"phase": "rl", "iteration": i}) for i in range(1, 6)]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"phase": "rl", "itera')  # killed mid-write
    (tmp_path / "rollouts").mkdir()
    for i in range(1, 6):
        (tmp_path / "rollouts" / f"iteration_{i:06d}.npz").write_bytes(b"x")
    (tmp_path / "rollouts" / "notes.txt").write_text("kept")
    (tmp_path / "summary.json").write_text("{}")  # of a finished run that is now extended
    (tmp_path / "training_curves.png").write_bytes(b"png")
    records = run_dir.rewind(str(tmp_path), metrics_records=3, iteration=3)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "rollouts"]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    assert sorted(os.listdir(tmp_path / "rollouts")) == [
        "iteration_000001.npz", "iteration_000002.npz", "iteration_000003.npz", "notes.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    with pytest.raises(run_dir.RunDirError, match="holds 3 complete records; the checkpoint counts 4"):
        run_dir.rewind(str(tmp_path), metrics_records=4, iteration=4)
    path.write_text(lines[0] + "\n{not json\n" + lines[2] + "\n")
    with pytest.raises(run_dir.RunDirError, match=r"metrics.jsonl:2: damaged record"):
        run_dir.rewind(str(tmp_path), metrics_records=3, iteration=3)
    with pytest.raises(run_dir.RunDirError, match=r"metrics.jsonl:2: damaged record .* before the log's end"):
        run_dir.rewind(str(tmp_path), metrics_records=0, iteration=0)  # a kill tears only the last line
    path.write_text(lines[0] + "\n" + lines[1][:9])
    assert run_dir.rewind(str(tmp_path), metrics_records=0, iteration=0) == [] and path.read_text() == ""


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    run_dir.atomic_write_json(str(path), {"a": 1})

    def killed(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_dir.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run_dir.atomic_write_json(str(path), {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["config.json"]


# --------------------------------------------------------------- 5. checkpoints verified on restore


def _tiny_state(scale: float = 1.0):
    params = {"w": jnp.arange(12.0).reshape(3, 4) * scale, "b": jnp.ones(3)}
    opt_state = {"mu": jnp.zeros(3), "count": jnp.asarray(3, jnp.int32)}
    return params, opt_state


def test_a_bit_flip_is_reported_and_the_latest_intact_checkpoint_restored(tmp_path):
    directory = str(tmp_path)
    for step in (1, 2, 3):
        params, opt_state = _tiny_state(step)
        save_checkpoint(directory, step, params, opt_state, {"iteration": step})
    _flip_a_bit(step_dir(directory, 3))
    with pytest.raises(CheckpointError, match=r"step 3 .* is damaged: file state/.* does not match"):
        restore_checkpoint(directory, *_tiny_state())
    reports = []
    restored = restore_latest_intact(directory, *_tiny_state(), report=reports.append)
    assert (restored.step, restored.damaged, restored.meta) == (2, [3], {"iteration": 2})
    np.testing.assert_array_equal(restored.params["w"], _tiny_state(2)[0]["w"])
    assert len(reports) == 1 and "step 3" in reports[0] and "\n" not in reports[0]
    assert set_aside(directory, 3).endswith("3.damaged") and list_steps(directory) == [1, 2]
    save_checkpoint(directory, 3, *_tiny_state(), {"iteration": 3})  # the step can be written again
    for step in (1, 2, 3):
        _flip_a_bit(step_dir(directory, step))
    with pytest.raises(CheckpointError, match=r"no intact checkpoint under .*\(steps \[1, 2, 3\]"):
        restore_latest_intact(directory, *_tiny_state(), report=lambda _: None)
    assert restore_latest_intact(str(tmp_path / "none"), *_tiny_state()) is None


def test_unfinished_mismatched_and_non_finite_checkpoints_are_damaged(tmp_path):
    directory = str(tmp_path)
    save_checkpoint(directory, 1, *_tiny_state(), {"iteration": 1})
    os.remove(os.path.join(step_dir(directory, 1), "respo_manifest.json"))  # killed before the manifest
    with pytest.raises(CheckpointError, match="no respo_manifest.json"):
        restore_checkpoint(directory, *_tiny_state(), step=1)
    save_checkpoint(directory, 2, *_tiny_state(), {"iteration": 2})
    wrong = {"w": jnp.zeros((4, 4)), "b": jnp.ones(3)}
    with pytest.raises(CheckpointError, match=r"step 2 .*: params/w is float32\[3, 4\]; this run expects "
                                              r"float32\[4, 4\]"):
        restore_checkpoint(directory, wrong, _tiny_state()[1], step=2)
    with pytest.raises(CheckpointError, match="step 2 .*: lacks params/extra"):
        restore_checkpoint(directory, dict(_tiny_state()[0], extra=jnp.ones(2)), _tiny_state()[1], step=2)
    with pytest.raises(CheckpointError, match="step 2 .*: holds params/b, which this run's state does not"):
        restore_checkpoint(directory, {"w": _tiny_state()[0]["w"]}, _tiny_state()[1], step=2)
    # A NaN written by some other tool (save_checkpoint itself refuses it), with a valid manifest.
    params, opt_state = _tiny_state()
    with pytest.raises(NonFiniteError, match="step 3"):
        save_checkpoint(directory, 3, {"w": params["w"] * jnp.nan, "b": params["b"]}, opt_state, {})
    assert list_steps(directory) == [1, 2]
    with ocp.CheckpointManager(directory, item_names=("state", "meta")) as manager:
        manager.save(3, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": {"w": params["w"].at[1, 2].set(jnp.inf), "b": params["b"]},
                                         "opt_state": opt_state}),
            meta=ocp.args.JsonSave({"iteration": 3})))
    write_manifest(step_dir(directory, 3), 3)
    with pytest.raises(CheckpointError, match="params/w holds NaN/inf"):
        restore_checkpoint(directory, *_tiny_state(), step=3)
    with pytest.raises(CheckpointError, match="already holds step 3"):
        save_checkpoint(directory, 3, *_tiny_state(), {})  # Orbax would skip it silently


@pytest.mark.slow
def test_resume_falls_back_from_a_damaged_checkpoint_and_repairs_the_log(tmp_path, jit_cache, reference):
    """A bit flip in the last checkpoint and a torn metrics line: resume reports the damage in one line,
    sets the step aside, redoes iterations 7-8 from checkpoint 6 and ends as the uninterrupted run."""
    out = _copy(reference, tmp_path / "run")
    _flip_a_bit(step_dir(str(out / "checkpoints"), 8))
    with open(out / "metrics.jsonl", "ab") as handle:
        handle.write(b'{"phase": "rl", "iter')
    resumed = _train(jit_cache, out, *REFERENCE_ARGS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if "damaged" in line]
    assert len(warnings) == 2 and "step 8" in warnings[0] and "8.damaged" in warnings[1], resumed.stderr
    _assert_same_run(out, reference)
    assert list_steps(out / "checkpoints") == [3, 6, 8] and (out / "checkpoints" / "8.damaged").is_dir()

    for step in (3, 6, 8):
        _flip_a_bit(step_dir(str(out / "checkpoints"), step))
    damaged = _snapshot(out)
    again = _train(jit_cache, out, "run.iterations=9", "run.resume=true")
    assert again.returncode == 1
    assert "no intact checkpoint" in _one_line_error(again.stderr)
    assert _snapshot(out) == damaged  # nothing rewritten


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

    path = _copy(hf_dir, tmp_path / "tied")
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

    path = _copy(hf_dir, tmp_path / "nan")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 1] = np.nan
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=rf"tensor '{name}' in .* 1 NaN/inf .*\[3, 1\]"):
        qwen3.from_pretrained(path)


def test_json_errors_name_the_file_and_line(hf_dir, tmp_path):
    from respo_jax.models import qwen3

    path = _copy(hf_dir, tmp_path / "json")
    text = (path / "config.json").read_text().splitlines()
    text[2] = text[2] + ",,"
    (path / "config.json").write_text("\n".join(text))
    with pytest.raises(ValueError, match=r"config.json:3:\d+: invalid JSON"):
        qwen3.from_pretrained(path)
    sharded = tmp_path / "sharded"
    qwen3.save_pretrained(qwen3.from_pretrained(hf_dir), sharded, max_shard_bytes=4096)
    index = sharded / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"weight_map": {', '"weight_map": {{', 1))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json:\d+:\d+: invalid JSON"):
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



# ------------------------------------- issue 25: one writer per directory, full and unwritable disks


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
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith(f"error: run.out_dir='{below}': cannot write the run directory"), line
    assert "Not a directory" in line and "MiB free" in line
    assert afile.read_text() == "not a directory" and sorted(os.listdir(tmp_path)) == ["afile"]

    # A read-only file system (root ignores chmod, so the lock file's open is made to fail as it would).
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(run_lock, "open", read_only, raising=False)
    out = tmp_path / "ro"
    assert cli([*TINY_RUN, f"run.out_dir={out}"]) == 2
    line = _one_line_error(capsys.readouterr().err)
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
    line = _one_line_error(capsys.readouterr().err)
    assert line.startswith(f"error: {expected}"), line
    assert os.listdir(tmp_path) == []


def test_the_kv_cache_is_checked_against_the_devices_memory():
    tiny = qwen3.Qwen3Config.preset("tiny")
    config = apply_overrides(load_config(DEFAULT_CONFIG), ["rollout.max_new_tokens=1000"])
    check_limits(config, tiny, 12, memory_bytes=None)  # memory unknown: only the positions are checked
    r = config.rollout
    rows = min(r.sampler_max_rows, r.reuse * r.prompts_per_minibatch * r.group_size)  # 256
    slots = 1024  # 12 -> a 16-token prompt bucket, + 1000 new tokens, rounded up to the cache's 16
    per_token = 2 * tiny.num_hidden_layers * tiny.num_key_value_heads * tiny.head_dim * 4  # float32 k and v
    assert kv_cache_bytes(tiny, rows, slots, "float32") == rows * slots * per_token
    check_limits(config, tiny, 12, memory_bytes=rows * slots * per_token)
    with pytest.raises(ConfigError, match=f"^rollout.sampler_max_rows=256: the sampler's KV cache for {rows} "
                                          f"rows of {slots} tokens .* expected at most {rows - 1} rows"):
        check_limits(config, tiny, 12, memory_bytes=rows * slots * per_token - 1)
    # The paper's 1.7B run (M=32, G=8, N=8, 15,360 new tokens, bf16) fits the memory of eight 141 GB
    # accelerators, not of one: 256 rows x 16,384 slots x 28 layers x 8 kv heads x 128 x 2 x 2 bytes.
    paper = load_config(os.path.join(ROOT, "experiments", "configs", "qwen3_1p7b_dapo.py"))
    model = qwen3.Qwen3Config.preset("qwen3-1.7b")
    assert kv_cache_bytes(model, 256, 16384, "bfloat16") == 256 * 16384 * 28 * 8 * 128 * 2 * 2
    check_limits(paper, model, 1024, memory_bytes=8 * 141 * 10**9)
    with pytest.raises(ConfigError, match="rollout.sampler_max_rows=256"):
        check_limits(paper, model, 1024, memory_bytes=141 * 10**9)
    with pytest.raises(ConfigError, match=r"\(40960\); expected at most 0$"):
        check_limits(paper, model, 40960, memory_bytes=None)


def test_log_problem_finds_a_second_writer_in_the_log():
    def warm(i):
        return {"phase": "warmup", "step": i}

    def rl(i):
        return {"phase": "rl", "iteration": i}

    evals = {"phase": "eval"}
    assert run_dir.log_problem([warm(1), warm(2), evals, rl(1), rl(2), evals]) is None
    assert run_dir.log_problem([rl(1), rl(2)]) is None  # no warm-up
    # The log: two warm-ups interleaved, then iteration 1 twice.
    assert run_dir.log_problem([warm(1), warm(1), warm(2), warm(2), evals, rl(1), rl(1)]) == (
        "record 2 is warm-up step 1 after 1 warm-up steps and 0 RL iterations")
    assert run_dir.log_problem([warm(1), evals, rl(1), rl(1)]) == (
        "record 4 is RL iteration 1 after iteration 1")
    assert run_dir.log_problem([rl(1), rl(3)]) == "record 2 is RL iteration 3 after iteration 1"
    assert "warm-up step 1 after 1 warm-up steps and 1 RL" in run_dir.log_problem([warm(1), rl(1), warm(1)])


@pytest.mark.slow
def test_resume_refuses_a_log_with_duplicated_iterations(tmp_path, reference, capsys):
    out = _copy(reference, tmp_path / "run")
    base = [*TINY_RUN, f"run.out_dir={out}", "run.iterations=9", "run.resume=true"]
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    rl = [i for i, line in enumerate(lines) if json.loads(line)["phase"] == "rl"]
    (out / "metrics.jsonl").write_bytes(b"".join(lines[:rl[1]] + [lines[rl[0]]] + lines[rl[1]:]))
    before = _snapshot(out)
    assert cli(base) == 2  # iteration 1 twice among the records the checkpoint counts
    line = _one_line_error(capsys.readouterr().err)
    assert "is not one run's log (record 5 is RL iteration 1 after iteration 1)" in line, line
    assert "drop or repeat RL records" in line and "run.overwrite=true" in line
    assert _snapshot(out) == before
    counted = json.loads((out / "checkpoints" / "8" / "meta" / "metadata").read_text())["metrics_records"]
    for broken, where in [
        (lines + [lines[rl[2]]], "record 13 is RL iteration 3 after iteration 8"),  # after those records
        ([lines[0], lines[0]] + lines[1:], "record 2 is warm-up step 1 after 1 warm-up steps"),
    ]:
        (out / "metrics.jsonl").write_bytes(b"".join(broken))
        with pytest.raises(run_dir.RunDirError, match=f"is not one run's log \\({where}"):
            run_dir.rewind(str(out), counted, 8)


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
    cmd = [sys.executable, "-c", _FULL_DISK, *_train_cmd(out, *REFERENCE_ARGS)[3:]]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(jit_cache), capture_output=True, text=True, timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    line = _one_line_error(result.stderr)
    assert line.startswith(f"error: cannot write checkpoint step 6 to {out / 'checkpoints' / '6'}"), line
    assert "No space left on device" in line and "MiB free" in line and "steps [3]) are kept" in line
    assert "ImportError" not in result.stderr and len(result.stderr.strip().splitlines()) <= 3, result.stderr
    assert list_steps(out / "checkpoints") == [3] and not (out / ".lock").exists()
    assert verify_files(step_dir(str(out / "checkpoints"), 3)) is None  # intact, and as the reference's
    (got, got_meta), (want, want_meta) = (_raw_state(d / "checkpoints", 3) for d in (out, reference))
    assert got_meta == want_meta and all(got[k].tobytes() == want[k].tobytes() for k in want)

    final = _train(jit_cache, out, *REFERENCE_ARGS)  # space is back
    assert final.returncode == 0, final.stderr[-3000:]
    _assert_same_run(out, reference)


@pytest.mark.slow
def test_two_concurrent_trainings_into_one_out_dir_one_refused_the_other_a_lone_run(
        tmp_path, jit_cache, reference):
    out = tmp_path / "run"
    first = subprocess.Popen(_train_cmd(out, *REFERENCE_ARGS), cwd=ROOT, env=_env(jit_cache),
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
        second = _train(jit_cache, out, *REFERENCE_ARGS)
        assert second.returncode == 2, second.stderr[-3000:]
        line = _one_line_error(second.stderr)
        assert f"{str(out)!r} is being written by another process (training, pid {first.pid} " in line, line
        assert "train.py" in line  # the holder's command
        _, stderr = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-3000:]
    _assert_same_run(out, reference)
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
        assert expected in _one_line_error(capsys.readouterr().err), argv
    assert not out.exists()
    for main, argv, expected in [
        (bench_main.main, ["--parts", "nope"], "argument --parts: invalid choice"),
        (rl_iteration.main, ["--iterations", "x"], "argument --iterations: invalid int"),
    ]:
        assert run_cli(main, argv) == 2
        assert expected in _one_line_error(capsys.readouterr().err)
    result = subprocess.run([sys.executable, "-m", "experiments.benchmarks", "--bogus"], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus" in _one_line_error(result.stderr)


def test_a_second_sweep_into_one_runs_dir_is_refused_before_it_writes(tmp_path, capsys):
    from experiments import gradient_starvation

    runs = tmp_path / "runs"
    holder = RunLock.acquire(str(runs), "gradient-starvation sweep")
    try:
        argv = ["--quick", f"sweep.runs_dir={runs}", f"sweep.out_dir={tmp_path / 'report'}"]
        assert gradient_starvation.cli(argv) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert "is being written by another process (gradient-starvation sweep" in line
        assert os.listdir(runs) == [".lock"] and not (tmp_path / "report").exists()
    finally:
        holder.release(remove_if_created=True)
    assert not runs.exists()


def test_a_full_disk_while_logging_is_one_line_naming_the_file_and_the_free_space(tmp_path):
    class FullDisk:
        def __init__(self, real):
            self.real = real

        def write(self, data):  # the disk takes half of the line, then is full
            if len(data) > 4:
                return self.real.write(bytes(data[:len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.real, name)

    with run_dir.MetricsLog(str(tmp_path)) as log:
        log.append({"phase": "rl", "iteration": 1})
        log._file = FullDisk(log._file)
        with pytest.raises(RunWriteError) as info:
            log.append({"phase": "rl", "iteration": 2})
    message = str(info.value)
    assert message.startswith(f"cannot write a metrics record to {tmp_path / 'metrics.jsonl'}: No space left")
    assert "MiB free of" in message and "\n" not in message
    assert (tmp_path / "metrics.jsonl").read_bytes().startswith(b'{"phase": "rl", "iteration": 1}\n{"phase"')
    with pytest.raises(KeyError):  # anything but a write error keeps its type (and traceback)
        with writing("x", str(tmp_path)):
            raise KeyError("a bug")
