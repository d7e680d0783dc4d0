"""Runs that never mix, lose or poison results: validation before any write, run-directory
rules, exact resume after SIGKILL, NaN stops, verified checkpoints, atomic writes.

The end-to-end tests run `python -m experiments.train` in subprocesses with the tiny model of
tests/tiny_runs.py on the synthetic task; they share a persistent XLA compilation cache so that only
the first process compiles. Checked HF loading, data files, concurrency and faults (one writer per
directory, full or unwritable disks) are in tests/test_run_faults.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import typing

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments.train import DEFAULT_CONFIG, cli, load_config
from respo_jax.training import run_dir
from respo_jax.training.checkpoint import (
    CheckpointError,
    list_steps,
    restore_checkpoint,
    restore_latest_intact,
    save_cut_short,
    save_checkpoint,
    set_aside,
    step_dir,
    verify_files,
    write_manifest,
)
from respo_jax.training.config import ConfigError, ConfigKeyError, ExperimentConfig, apply_overrides
from respo_jax.config import config_from_dict
from respo_jax.training.iteration_metrics import check_finite_steps
from respo_jax.training.step import NonFiniteError
from tiny_runs import (
    REFERENCE_ARGS,
    TINY_RUN,
    assert_same_run,
    copy_run,
    flip_a_bit,
    kill_when,
    max_iteration,
    one_line_error,
    raw_state,
    read_records,
    snapshot,
    train,
)


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
    line = one_line_error(capsys.readouterr().err)
    assert "objective.hparams={'eps_hgh': 0.3}" in line and "eps_high" in line
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_retired_key_is_refused_naming_its_replacement(tmp_path, capsys):
    # The static engine's row chunks are gone: its key fails in one line, from the command line (exit 2,
    # nothing written) and from a config dict (a config file or a run's config.json) alike.
    assert cli([f"run.out_dir={tmp_path / 'run'}", "rollout.sampler_max_rows=64"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "rollout.sampler_max_rows no longer exists" in line and "rollout.max_slots" in line
    assert not (tmp_path / "run").exists()
    saved = json.loads(json.dumps(load_config(DEFAULT_CONFIG).to_dict()))
    saved["rollout"]["sampler_max_rows"] = 256
    with pytest.raises(ConfigKeyError, match=r"^rollout.sampler_max_rows no longer exists: .*max_slots"):
        config_from_dict(ExperimentConfig, saved)


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
    result = train(jit_cache, out, "run.iterations=3", "run.checkpoint_every=1", "optim.learning_rate=1e38",
                    "optim.warmup_steps=3", "warmup.steps=0", "run.eval_problems=0")  # fewer programs
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_line_error(result.stderr)
    assert "iteration 2, mini-batch 1/2:" in line and ("nan" in line or "NaN" in line), line
    assert list_steps(out / "checkpoints") == [1]
    state, meta = raw_state(out / "checkpoints", 1)
    assert meta["iteration"] == 1 and all(np.isfinite(v).all() for v in state.values())
    assert verify_files(step_dir(str(out / "checkpoints"), 1)) is None
    assert [r["iteration"] for r in read_records(out) if r["phase"] == "rl"] == [1]
    assert not (out / "summary.json").exists()


# ------------------------------------------ 1, 2, 4. run directories: refuse, resume exactly, overwrite


@pytest.mark.slow
def test_killed_runs_resume_bit_identical_to_an_uninterrupted_run(tmp_path, jit_cache, reference):
    """SIGKILL at random points (mid-iteration, between checkpoints, during saves, after the last
    iteration), each time rerun with run.resume=true: metrics, summary and parameters equal the
    uninterrupted run's bit for bit, with no repeated record."""
    args = REFERENCE_ARGS
    records = read_records(reference)
    assert sum(r["grad_norm"] > 0 for r in records if r["phase"] == "rl") >= 6  # it does learn something
    out = tmp_path / "killed"
    rng = random.Random(14)
    kills = []  # (last iteration logged, checkpoint steps) when each SIGKILL landed

    # (iterations to see first, extra random delay): the third kill lands after the last iteration.
    plan = [(2, rng.uniform(0.0, 0.4)), (2, rng.uniform(0.0, 0.4)), (None, rng.uniform(0.0, 0.6))]
    for target_step, delay in plan:
        target = 8 if target_step is None else min(max_iteration(out) + target_step, 8)
        killed = kill_when(jit_cache, out, args, target, delay)
        kills += [killed] if killed else []
    assert len(kills) >= 2, kills  # the run did not simply finish each time
    final = train(jit_cache, out, *args)
    assert final.returncode == 0, (kills, final.stderr[-3000:])

    assert_same_run(out, reference)
    print("kill points (last iteration logged, checkpoints):", kills)


@pytest.mark.slow
def test_a_reused_out_dir_is_refused_and_a_failed_start_changes_nothing(tmp_path, jit_cache, reference,
                                                                         capsys):
    out = copy_run(reference, tmp_path / "run")
    before = snapshot(out)
    assert {"config.json", "metrics.jsonl", "summary.json", "training_curves.png"} <= set(before)

    # The command a user would type: another objective into the same directory.
    second = train(jit_cache, out, "run.iterations=2", "objective.name=grpo")
    assert second.returncode == 2
    assert "already holds a run" in one_line_error(second.stderr) and "run.resume=true" in second.stderr
    assert snapshot(out) == before

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
        assert expected in one_line_error(capsys.readouterr().err), overrides
        assert snapshot(out) == before, overrides

    # A log that lost records the last checkpoint counts is refused before anything is rewritten.
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (out / "metrics.jsonl").write_bytes(b"".join(lines[:4]))
    shortened = snapshot(out)
    assert cli(base + ["run.iterations=9", "run.resume=true"]) == 2
    assert "holds 4 complete records; the checkpoint counts 11" in one_line_error(capsys.readouterr().err)
    assert snapshot(out) == shortened


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
                                       "rollout.max_tokens_per_microbatch=1000"])
    assert run_dir.config_differences(saved, changed) == []
    old = json.loads(json.dumps(saved))
    old["rollout"]["sampler_max_rows"] = 256  # a run saved when the static engine existed
    assert run_dir.config_differences(old, config) == [
        "rollout.sampler_max_rows: saved 256, no longer exists (the rollout engine decodes at most "
        "rollout.max_slots rows at once (rollout.scheduler=static: batches of rollout.max_slots rows))"]
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
    records = run_dir.rewind(str(tmp_path), run_dir.check_log(str(tmp_path), 3, 3), 3)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "rollouts"]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    assert sorted(os.listdir(tmp_path / "rollouts")) == [
        "iteration_000001.npz", "iteration_000002.npz", "iteration_000003.npz", "notes.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    with pytest.raises(run_dir.RunDirError, match="holds 3 complete records; the checkpoint counts 4"):
        run_dir.check_log(str(tmp_path), 4, 4)
    path.write_text(lines[0] + "\n{not json\n" + lines[2] + "\n")
    with pytest.raises(run_dir.RunDirError, match=r"metrics.jsonl:2: damaged record"):
        run_dir.check_log(str(tmp_path), 3, 3)
    with pytest.raises(run_dir.RunDirError, match=r"metrics.jsonl:2: damaged record .* before the log's end"):
        run_dir.check_log(str(tmp_path), 0, 0)  # a kill tears only the last line
    path.write_text(lines[0] + "\n" + lines[1][:9])
    assert run_dir.rewind(str(tmp_path), run_dir.check_log(str(tmp_path), 0, 0), 0) == []
    assert path.read_text() == ""


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
    flip_a_bit(step_dir(directory, 3))
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
        flip_a_bit(step_dir(directory, step))
    with pytest.raises(CheckpointError, match=r"no intact checkpoint under .*\(steps \[1, 2, 3\]"):
        restore_latest_intact(directory, *_tiny_state(), report=lambda _: None)
    assert restore_latest_intact(str(tmp_path / "none"), *_tiny_state()) is None


def test_unfinished_mismatched_and_non_finite_checkpoints_are_damaged(tmp_path):
    directory = str(tmp_path)
    save_checkpoint(directory, 1, *_tiny_state(), {"iteration": 1})
    os.remove(os.path.join(step_dir(directory, 1), "respo_manifest.json"))  # killed before the manifest
    with pytest.raises(CheckpointError, match="no respo_manifest.json"):
        restore_checkpoint(directory, *_tiny_state(), step=1)
    reports = []  # a save cut short is no checkpoint: with no other step, the run starts afresh
    assert save_cut_short(directory, 1) and restore_latest_intact(directory, *_tiny_state(),
                                                                  report=reports.append) is None
    assert len(reports) == 1 and "no respo_manifest.json" in reports[0]
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
    assert not save_cut_short(directory, 3)  # finished, then found damaged: never taken for a fresh start
    with pytest.raises(CheckpointError, match=r"steps \[1, 2, 3\] are all damaged"):
        restore_latest_intact(str(tmp_path), _tiny_state()[0], _tiny_state()[1] | {"extra": jnp.ones(1)},
                              report=lambda _: None)
    with pytest.raises(CheckpointError, match="already holds step 3"):
        save_checkpoint(directory, 3, *_tiny_state(), {})  # Orbax would skip it silently


@pytest.mark.slow
def test_resume_falls_back_from_a_damaged_checkpoint_and_repairs_the_log(tmp_path, jit_cache, reference):
    """A bit flip in the last checkpoint and a torn metrics line: resume reports the damage in one line,
    sets the step aside, redoes iterations 7-8 from checkpoint 6 and ends as the uninterrupted run."""
    out = copy_run(reference, tmp_path / "run")
    flip_a_bit(step_dir(str(out / "checkpoints"), 8))
    with open(out / "metrics.jsonl", "ab") as handle:
        handle.write(b'{"phase": "rl", "iter')
    resumed = train(jit_cache, out, *REFERENCE_ARGS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if "damaged" in line]
    assert len(warnings) == 2 and "step 8" in warnings[0] and "8.damaged" in warnings[1], resumed.stderr
    assert_same_run(out, reference)
    assert list_steps(out / "checkpoints") == [3, 6, 8] and (out / "checkpoints" / "8.damaged").is_dir()

    for step in (3, 6, 8):
        flip_a_bit(step_dir(str(out / "checkpoints"), step))
    damaged = snapshot(out)
    again = train(jit_cache, out, "run.iterations=9", "run.resume=true")
    assert again.returncode == 1
    assert "no intact checkpoint" in one_line_error(again.stderr)
    assert snapshot(out) == damaged  # nothing rewritten


@pytest.mark.slow
def test_a_first_save_cut_short_is_set_aside_and_the_run_starts_afresh(tmp_path, jit_cache, reference):
    """Killed while writing its first checkpoint (Orbax renamed step 3's folder, the manifest not yet
    written): the resume finds no checkpoint, sets the folder aside, reruns from the start and ends as
    the uninterrupted run."""
    out = copy_run(reference, tmp_path / "run")
    checkpoints = str(out / "checkpoints")
    for step in (6, 8):
        shutil.rmtree(step_dir(checkpoints, step))
    os.remove(os.path.join(step_dir(checkpoints, 3), "respo_manifest.json"))
    resumed = train(jit_cache, out, *REFERENCE_ARGS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "3.damaged" in resumed.stderr
    assert_same_run(out, reference)
    assert list_steps(checkpoints) == [3, 6, 8] and (out / "checkpoints" / "3.damaged").is_dir()
