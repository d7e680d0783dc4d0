"""Runs safe to preempt and caches safe to trust: SIGTERM / SIGINT stop a run at a step boundary with a
checkpoint (respo_jax.training.preemption), caches and run files are verified whole before use, a start
checks every writer before it changes anything, and every path or config error is one line.

The end-to-end tests run `python -m experiments.train` in subprocesses with the tiny model of
tests/tiny_runs.py and send real signals, at points chosen by what the run has written
(experiments/crash_suite.py). Tests run as root, which permission bits do not stop: a read-only
file system is made with a read-only bind mount in a private mount namespace (`unshare -m`), a full
disk with a tiny tmpfs there; EACCES (which root never gets from permission bits) and ENOSPC at
start-up are simulated by patching the call that meets them, as each test says.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import crash_suite
from experiments.train import DEFAULT_CONFIG, cli, load_config
from respo_jax import exported_programs
from respo_jax.exported_programs import EXPORTED_DIR, MAGIC, ProgramCache
from respo_jax.training import run_dir, warmup_checkpoint
from respo_jax.training.checkpoint import list_steps
from respo_jax.training.config import ConfigError, ConfigKeyError, apply_overrides
from tiny_runs import (
    REFERENCE_ARGS,
    ROOT,
    TINY_MODEL,
    TINY_RUN,
    assert_same_run,
    copy_run,
    one_line_error,
    raw_state,
    read_records,
    run_env,
    snapshot,
    train,
    train_cmd,
    without_timings,
)

# ------------------------------------------------------------------------------- one line everywhere


def _config():
    return load_config(DEFAULT_CONFIG)


@pytest.mark.parametrize("override", ["run.section=foo", "optim.section=x", "run.validate=1"])
def test_config_keys_are_the_dataclass_fields_only(override):
    with pytest.raises(ConfigKeyError, match=f"unknown config key '{override.split('=')[0]}'"):
        apply_overrides(_config(), [override])


@pytest.mark.parametrize("override", ["rollout.reuse=\u0664", "rollout.reuse=\uff14", "run.seed=1\u0967",
                                      "optim.learning_rate=1e-\u0663", "optim.learning_rate=\u0661.5"])
def test_numbers_are_ascii(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}=.*: cannot parse as (int|float)$"):
        apply_overrides(_config(), [override])
    assert apply_overrides(_config(), ["rollout.reuse=4"]).rollout.reuse == 4  # ASCII digits still parse


@pytest.mark.parametrize("source, line, kind", [
    ("def get_config(:\n    pass\n", 1, "SyntaxError"),
    ("import math\n\n\ndef helper():\n    return {}['missing']\n\n\ndef get_config():\n    return helper()\n",
     5, "KeyError: 'missing'"),
    ("x = 1\nraise RuntimeError('broken\\nconfig')\n", 2, "RuntimeError: broken config"),
])
def test_a_config_files_own_error_is_one_line_with_file_line_and_exception(tmp_path, capsys, source, line,
                                                                          kind):
    path = tmp_path / "config.py"
    path.write_text(source)
    assert cli(["--config", str(path), f"run.out_dir={tmp_path / 'run'}"]) == 2
    message = one_line_error(capsys.readouterr().err)
    assert message.startswith(f"error: --config {path}:{line}: {kind}"), message
    assert not (tmp_path / "run").exists()


def _os_error(code: int, monkeypatch, tmp_path) -> str:
    """A run.out_dir that meets `code` at start-up: the real one where the OS gives it to root, else the
    lock's first call patched to raise it (EACCES, ENOSPC, EROFS: simulated)."""
    if code == errno.ENAMETOOLONG:
        return str(tmp_path / ("x" * 300))
    if code == errno.ENOENT:
        return "/proc/no_such_process/run"  # a pseudo-file system
    if code == errno.ENOTDIR:
        (tmp_path / "a_file").write_text("")
        return str(tmp_path / "a_file" / "run")
    if code == errno.ELOOP:
        os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
        os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
        return str(tmp_path / "loop_a" / "run")
    real = os.makedirs

    def refuse(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", refuse)
    return str(tmp_path / "run")


@pytest.mark.parametrize("code", [errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES,
                                  errno.EROFS, errno.ENOSPC])
def test_every_os_error_of_the_run_directory_is_one_line_naming_the_path(tmp_path, capsys, monkeypatch, code):
    out_dir = _os_error(code, monkeypatch, tmp_path)
    assert cli([f"run.out_dir={out_dir}", "run.iterations=1"]) == 2
    message = one_line_error(capsys.readouterr().err)
    assert message.startswith(f"error: run.out_dir={out_dir!r}: cannot write the run directory to ")
    assert f"[errno {code}]" in message and os.strerror(code) in message


# ------------------------------------------------------------------------- exported programs, whole


def _update(params, x):
    return jax.tree.map(lambda p: p * jnp.sum(x), params), {"coef_mass_pos": jnp.sum(x), "loss": jnp.max(x)}


def _args():
    return {"w": jnp.arange(6.0).reshape(2, 3)}, jnp.linspace(0.0, 1.0, 4)


def _entry(directory) -> str:
    folder = os.path.join(directory, EXPORTED_DIR)
    (name,) = [n for n in os.listdir(folder) if not n.startswith(".")]
    return os.path.join(folder, name)


def _run_cached(directory):
    program = ProgramCache(str(directory), "k").jit(_update, "update")
    return program, program(*_args())


def _assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_byte_of_an_exported_entry_is_verified(tmp_path):
    _run_cached(tmp_path)
    path = _entry(tmp_path)
    data = open(path, "rb").read()
    assert exported_programs._read_entry(path) is not None
    damaged = tmp_path / "damaged.exported"
    for index in range(len(data)):  # every byte: magic, checksum, header length, header, program
        for flip in (0x01, 0x80):
            damaged.write_bytes(data[:index] + bytes([data[index] ^ flip]) + data[index + 1:])
            assert exported_programs._read_entry(str(damaged)) is None, index
    for size in (0, len(MAGIC), len(MAGIC) + 40, len(data) - 1):  # torn anywhere
        damaged.write_bytes(data[:size])
        assert exported_programs._read_entry(str(damaged)) is None, size


def test_a_damaged_entry_is_rejected_and_rewritten_with_the_same_results(tmp_path):
    want = jax.jit(_update)(*_args())
    _run_cached(tmp_path)
    path = _entry(tmp_path)
    data = open(path, "rb").read()
    header_at = data.index(b'"coef_mass_pos"')
    regions = {"magic": 3, "checksum": len(MAGIC) + 5, "header length": len(MAGIC) + 33,
               "header key": header_at + 1, "program": len(data) - 20}
    for region, index in regions.items():
        with open(path, "wb") as handle:
            handle.write(data[:index] + bytes([data[index] ^ 0x02]) + data[index + 1:])
        program, got = _run_cached(tmp_path)
        _assert_same(got, want)
        assert (program.entries_read, program.entries_written) == (0, 1), region
        again, got = _run_cached(tmp_path)  # written anew, whole: the next launch reads it
        _assert_same(got, want)
        assert (again.entries_read, again.entries_written) == (1, 0), region
        data = open(path, "rb").read()


def test_a_rebuilt_output_tree_must_be_the_declared_one(tmp_path):
    """A header whose checksum holds but whose output description is not the tree it declares (or not
    the program's outputs) is never used: the program is traced and the entry rewritten."""
    want = jax.jit(_update)(*_args())
    _run_cached(tmp_path)
    path = _entry(tmp_path)
    header, blob = exported_programs._read_entry(path)
    swapped = json.loads(json.dumps(header).replace('"coef_mass_pos"', '"aoef_mass_pos"'))
    for bad in (swapped, dict(header, outputs="leaf")):
        exported_programs._write_entry(path, bad, blob)
        program, got = _run_cached(tmp_path)
        _assert_same(got, want)
        assert (program.entries_read, program.entries_written) == (0, 1)


def test_every_byte_of_a_compile_ahead_record_is_verified():
    """A record (in this session's cache, under a key no run uses) is trusted only whole: any changed,
    missing or added byte makes the next start compile ahead again (and rewrite it)."""
    from respo_jax.training import compilation

    # the session's cache (an earlier in-process run with run.compilation_cache_dir=none may have
    # turned JAX's off in this worker)
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    assert cache, "the test session sets JAX_COMPILATION_CACHE_DIR (tests/conftest.py)"
    assert compilation.configure_compilation_cache(cache) == cache
    key = f"test-{os.getpid()}-{random.randrange(2**31)}"
    path = os.path.join(cache, compilation.COMPILED_AHEAD_DIR, key)
    try:
        compilation.record_compile_ahead(key)
        data = open(path, "rb").read()
        assert compilation.cache_holds_compile_ahead(key) and key.encode() in data
        for damaged in [data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:] for i in range(len(data))] + [
                b"", data[:-1], data + b"x"]:
            open(path, "wb").write(damaged)
            assert not compilation.cache_holds_compile_ahead(key), damaged
        compilation.record_compile_ahead(key)
        assert compilation.cache_holds_compile_ahead(key)
    finally:
        if os.path.exists(path):
            os.remove(path)


# ------------------------------------------------------------------------ mutate after checking


def test_a_start_that_cannot_write_a_folder_is_refused_before_it_changes_anything(tmp_path, monkeypatch,
                                                                                  capsys):
    """Simulated EACCES (root ignores permission bits; the real read-only mount is the slow test below):
    creating a file in tensorboard/ fails. Resuming a finished run (its end-of-run files, which a resume
    deletes first) with TensorBoard is refused in one line naming tensorboard/, everything unchanged."""
    out = tmp_path / "run"
    args = [*TINY_RUN, f"run.out_dir={out}", *REFERENCE_ARGS, "run.loggers=jsonl,tensorboard"]
    (out / "tensorboard" / "train").mkdir(parents=True)
    config = apply_overrides(_config(), args)
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    for name in ("summary.json", "training_curves.png", "metrics.jsonl"):
        (out / name).write_text("{}\n" if name != "metrics.jsonl" else "")
    before = snapshot(out)
    real = run_dir.tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and "tensorboard" in str(dir):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(run_dir.tempfile, "mkstemp", refuse)
    assert cli(args) == 2
    message = one_line_error(capsys.readouterr().err)
    assert f"cannot write the run directory to {out / 'tensorboard'}" in message and "[errno 13]" in message
    assert snapshot(out) == before


# ------------------------------------------------------------------------------- warm-up checkpoints


def test_a_warmup_checkpoint_resumes_the_warmup_bit_for_bit(tmp_path):
    """A warm-up saved after its step 1 of 3 and restored into a trainer whose parameters were reset
    continues with steps 2 and 3 exactly as an uninterrupted warm-up: the same losses, parameters,
    optimizer state and problem-stream position (the end-to-end stop is the crash suite's warm-up
    point)."""
    from respo_jax.training.loop import RLTrainer

    config = apply_overrides(_config(), [*TINY_RUN, "warmup.steps=3", f"run.out_dir={tmp_path / 'run'}"])
    trainer = RLTrainer(config)
    initial = jax.tree.map(jnp.copy, trainer.state.params)  # a step donates the parameters it updates
    trainer.state.params = jax.tree.map(jnp.copy, initial)
    want = list(trainer.warmup())
    whole_params, whole = trainer.state.params, trainer.warmup_position

    trainer.state.params = jax.tree.map(jnp.copy, initial)
    steps = trainer.warmup()
    got = [next(steps)]
    steps.close()
    checkpoints = str(tmp_path / "checkpoints")
    line = warmup_checkpoint.save(trainer, checkpoints, 1, "0" * 64)
    assert line == f"warm-up checkpoint at step 1 of 3 saved in {checkpoints}/warmup"
    trainer.state.params = jax.tree.map(jnp.copy, initial)  # the restore sets them
    restored, start = warmup_checkpoint.restore(trainer, checkpoints)
    assert start.step == 1 and restored.meta["metrics_records"] == 1 and restored.meta["iteration"] == 0
    got += list(trainer.warmup(start))
    assert got == want and [r["step"] for r in got] == [1, 2, 3]
    assert trainer.warmup_position.rng_state == whole.rng_state
    for name, tree, expected in (("params", trainer.state.params, whole_params),
                                 ("opt_state", trainer.warmup_position.opt_state, whole.opt_state)):
        leaves, expected_leaves = jax.tree.leaves(tree), jax.tree.leaves(expected)
        assert len(leaves) == len(expected_leaves) > 0, name
        for a, b in zip(leaves, expected_leaves):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
    warmup_checkpoint.discard(checkpoints)
    assert warmup_checkpoint.restore(trainer, checkpoints) == (None, None)


# --------------------------------------------------------------------------- end to end, slow

UNSHARE = ["unshare", "-m", "--propagation", "private"]


def _in_mount_namespace(mounts: str, command: list[str], env: dict, timeout: int = 240, after: str = ""):
    """`command` after `mounts` (shell lines) in a private mount namespace, then `after` (shell lines;
    its output goes to stdout); the mounts vanish with the namespace. The exit status is `command`'s."""
    script = f"set -e\n{mounts}\nset +e\n\"$@\"\nstatus=$?\n{after}\nexit $status\n"
    return subprocess.run([*UNSHARE, "sh", "-c", script, "sh", *command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


SHORT = 3  # RL iterations of a run compared with the start of the reference run (checkpoint step 3)


def assert_same_start(out, reference) -> None:
    """`out`, a run of the reference's config stopped after `SHORT` iterations (the learning-rate
    schedule does not depend on the run's length), equals the reference's first `SHORT` iterations bit
    for bit: its records up to the last RL one (timings aside) and its last checkpoint."""
    records, expected = read_records(out), read_records(reference)
    count = 2 + 1 + SHORT  # warm-up steps, the first evaluation, the RL iterations
    assert without_timings(records[:count]) == without_timings(expected[:count])
    assert [r["iteration"] for r in records if r["phase"] == "rl"] == list(range(1, SHORT + 1))
    assert list_steps(out / "checkpoints")[-1] == SHORT
    got, got_meta = raw_state(out / "checkpoints", SHORT)
    want, want_meta = raw_state(reference / "checkpoints", SHORT)
    assert got_meta == want_meta and got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key


def _stopped_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("stopped: ")]
    assert len(lines) == 1 and "Traceback" not in stderr and "error:" not in stderr, stderr
    return lines[0]


@pytest.mark.slow
def test_a_read_only_tensorboard_is_refused_before_resume_deletes_anything(tmp_path, jit_cache, reference):
    """The real case: tensorboard/ on a read-only mount (EROFS); the finished run stays as it was."""
    out = copy_run(reference, tmp_path / "run")
    (out / "tensorboard").mkdir()
    before = snapshot(out)
    result = _in_mount_namespace(f"mount --bind -o ro {out / 'tensorboard'} {out / 'tensorboard'}",
                                 train_cmd(out, *REFERENCE_ARGS, "run.loggers=jsonl,tensorboard"),
                                 run_env(jit_cache))
    assert result.returncode == 2, result.stderr[-3000:]
    message = one_line_error(result.stderr)
    assert f"cannot write the run directory to {out / 'tensorboard'}: Read-only file system" in message
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_the_resume_repairs_what_it_left(tmp_path, jit_cache, reference):
    """SIGTERM repeated every 0.1 s from the first periodic checkpoint on (Python runs a handler once for
    signals that arrive together, hence the spacing): the first sets the stop flag, the second, during
    the stop's checkpoint save, exits at once (143) with its own line and no traceback. The resume
    repairs what it left (a save cut short is never restored) and equals the uninterrupted run bit for
    bit. (SIGINT stops like SIGTERM: one of the crash suite's points.)"""
    out = tmp_path / "run"
    process = crash_suite.launch(train_cmd(out, *REFERENCE_ARGS), run_env(jit_cache), str(ROOT))
    first = crash_suite._checkpoint_finished(3)
    while process.poll() is None and not first(str(out)):
        time.sleep(0.01)
    while process.poll() is None:
        process.send_signal(signal.SIGTERM)
        time.sleep(0.1)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 143, stderr[-3000:]
    assert "error: second SIGTERM: exiting at once" in stderr and "Traceback" not in stderr
    assert 3 in list_steps(out / "checkpoints")

    final = train(jit_cache, out, *REFERENCE_ARGS)
    assert final.returncode == 0, final.stderr[-3000:]
    assert_same_run(out, reference)


def _sigterm_at_start(commands: list[list[str]], env: dict) -> list[tuple[int, str, bool]]:
    """Launches `commands` side by side and sends each process SIGTERM as soon as it catches it
    (SIGTERM's bit in the SigCgt mask of /proc/PID/status: the handler is installed); returns, per
    process, (its exit status, its stderr, whether JAX's compiled library was loaded when the signal
    came)."""
    processes = [crash_suite.launch(command, env, str(ROOT)) for command in commands]
    bit, jax_loaded = 1 << (signal.SIGTERM - 1), {}
    while len(jax_loaded) < len(processes) and any(p.poll() is None for p in processes):
        for index, process in enumerate(processes):
            if index in jax_loaded or process.poll() is not None:
                continue
            with open(f"/proc/{process.pid}/status", encoding="utf-8") as handle:
                caught = [int(line.split()[1], 16) for line in handle if line.startswith("SigCgt:")]
            if caught and caught[0] & bit:
                process.send_signal(signal.SIGTERM)
                with open(f"/proc/{process.pid}/maps", encoding="utf-8") as handle:
                    jax_loaded[index] = "jaxlib" in handle.read()
        time.sleep(0.001)
    errors = [process.communicate(timeout=240)[1] for process in processes]
    return [(p.returncode, errors[i], jax_loaded.get(i)) for i, p in enumerate(processes)]


@pytest.mark.slow
def test_sigterm_while_a_program_imports_stops_it_in_one_line_with_nothing_written(tmp_path, jit_cache,
                                                                                   reference):
    """SIGTERM to training, an evaluation and a sweep while each is still importing (before JAX's
    library is loaded): exit 143, one `stopped:` line, nothing written (not the default death: -15 and
    an empty stderr)."""
    out = {name: tmp_path / name for name in ("train", "evaluate", "sweep")}
    commands = [train_cmd(out["train"], *REFERENCE_ARGS),
                [sys.executable, "-m", "experiments.evaluate", f"eval.checkpoint={reference}",
                 "eval.benchmarks=synthetic", "eval.synthetic_problems=8", f"eval.out_dir={out['evaluate']}"],
                [*SWEEP, f"sweep.runs_dir={out['sweep']}", f"sweep.out_dir={out['sweep'] / 'report'}"]]
    for name, (status, stderr, jax_loaded) in zip(out, _sigterm_at_start(commands, run_env(jit_cache))):
        assert status == 143, f"{name}: {stderr[-3000:]}"
        assert _stopped_line(stderr).startswith("stopped: SIGTERM during start-up: nothing was written"), name
        assert jax_loaded is False and not out[name].exists(), name


def _crash_seed() -> int:
    seed = int(os.environ.get("RESPO_CRASH_SEED", random.randrange(2**31)))
    print(f"crash suite seed {seed} (RESPO_CRASH_SEED={seed} replays it)")
    return seed


@pytest.mark.slow
@pytest.mark.parametrize("choose", ["sigterm_everywhere", "sigkill_somewhere"])
def test_randomized_crash_suite_training(tmp_path, jit_cache, reference, choose):
    """experiments/crash_suite.py: one run stopped at a point of each phase — start-up, warm-up, rollout,
    update, checkpoint save, final evaluation — each by SIGTERM (one line, the checkpoint of the step in
    flight: in the warm-up a warm-up checkpoint, which the resume continues), one of the RL phases by
    SIGINT instead (exit status 130), or at three of them by SIGKILL; points drawn from the printed seed
    by what the run has written, the run resumed after each. The last resume equals the uninterrupted
    run bit for bit."""
    seed = _crash_seed()
    chooser = (crash_suite.every_phase_one_sigint if choose == "sigterm_everywhere"
               else crash_suite.some_phases(signal.SIGKILL, 3))
    out = tmp_path / "run"
    log, problems = crash_suite.crash_training(
        lambda out_dir, *extra: train_cmd(out_dir, *REFERENCE_ARGS, *extra), run_env(jit_cache), str(ROOT),
        str(out), seed, warmup_steps=2, iterations=8, checkpoint_every=3, evaluates=True, choose=chooser)
    print("\n".join(log))
    assert not problems, "\n".join(problems)
    assert len(log) == (6 if choose == "sigterm_everywhere" else 3)
    assert choose != "sigterm_everywhere" or sum("SIGINT at" in line and line.endswith("exit status 130")
                                                 for line in log) == 1
    assert_same_run(out, reference)


@pytest.mark.slow
def test_randomized_crash_suite_evaluation(tmp_path, jit_cache, reference):
    """An evaluation of the reference run killed (SIGTERM or SIGKILL, from the printed seed) after its
    first sampler call and rerun: its completions and summary equal an uninterrupted evaluation's."""
    seed = _crash_seed()
    env = run_env(jit_cache)
    rng = random.Random(seed)
    evaluation = [sys.executable, "-m", "experiments.evaluate", f"eval.checkpoint={reference}",
                  "eval.benchmarks=synthetic", "eval.synthetic_problems=8", "eval.batch_size=2",
                  "eval.samples=1", "eval.max_new_tokens=6", "eval.num_workers=1", "eval.progress=false",
                  "eval.dtype=float32"]
    want, got = tmp_path / "eval_whole", tmp_path / "eval_killed"
    whole = subprocess.run([*evaluation, f"eval.out_dir={want}"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=240)
    assert whole.returncode == 0, whole.stderr[-3000:]
    signum = rng.choice((signal.SIGTERM, signal.SIGKILL))
    status, problem = crash_suite.crash_command(
        [*evaluation, f"eval.out_dir={got}"], env, str(ROOT),
        lambda: crash_suite.complete_records(os.path.join(got, "completions.jsonl")), 2, signum, "evaluation")
    print(f"evaluation: {signal.Signals(signum).name} after the first sampler call: exit status {status}")
    assert status is not None and not problem, problem
    for name in ("completions.jsonl", "summary.json"):
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


SWEEP = [sys.executable, "-m", "experiments.gradient_starvation", "--quick", TINY_MODEL,
         "sweep.objectives=respo", "sweep.reuse=1", "sweep.seeds=0", "sweep.policy_updates=4", "warmup.steps=2", "warmup.batch_size=8",
         "run.eval_problems=4", "rollout.prompts_per_minibatch=2", "rollout.group_size=2",
         "rollout.max_new_tokens=32", 'task.overrides={"num_operands": 3}']


@pytest.mark.slow
def test_randomized_crash_suite_sweep(tmp_path, jit_cache):
    """A sweep cell killed (SIGTERM or SIGKILL, from the printed seed) at its RL iteration 2 and the sweep
    rerun: the cell's log and the sweep's summary equal an uninterrupted sweep's."""
    rng = random.Random(_crash_seed())
    env = run_env(jit_cache)
    sweep = SWEEP
    want, got = tmp_path / "sweep_whole", tmp_path / "sweep_killed"
    whole = subprocess.run([*sweep, f"sweep.runs_dir={want}", f"sweep.out_dir={want / 'out'}"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    os.makedirs(got)
    for name in ("base", ".jax_cache"):  # the base model and the sweep's programs: only the cell is killed
        shutil.copytree(want / name, got / name)
    cell = "respo_n1_seed0"
    signum = rng.choice((signal.SIGTERM, signal.SIGKILL))
    status, problem = crash_suite.crash_command(
        [*sweep, f"sweep.runs_dir={got}", f"sweep.out_dir={got / 'out'}"], env, str(ROOT),
        lambda: crash_suite.complete_records(os.path.join(got, "cells", f"{cell}.partial", "metrics.jsonl")),
        1 + 2, signum, "sweep cell")
    print(f"sweep: {signal.Signals(signum).name} at RL iteration 2 of its cell: exit status {status}")
    assert status is not None and not problem, problem
    got_cell, want_cell = got / "cells" / cell, want / "cells" / cell
    assert without_timings(read_records(got_cell)) == without_timings(read_records(want_cell))
    summaries = [json.loads((w / "out" / "summary.json").read_text()) for w in (got, want)]
    assert summaries[0]["groups"] == summaries[1]["groups"]


@pytest.mark.slow
def test_read_only_prewarmed_cache_is_used_and_a_full_one_is_one_line(tmp_path, jit_cache, reference):
    """A copy of the session's warm cache on a read-only mount: the run reads it (the compile-ahead is
    skipped by its record), writes nothing into it, says so in one line and equals the reference run
    (each run here is its first `SHORT` iterations).
    The same cache with half its programs removed, on a full tmpfs: one warning line, the run goes on
    and equals the reference, and no compile-ahead record is written for programs that are not there.
    An exported program whose header is damaged ("coef_mass_pos" -> "aoef_mass_pos") is rejected and
    rewritten in the writable run."""
    warm = tmp_path / "warm"
    shutil.copytree(jit_cache, warm)
    before = snapshot(warm)
    out = tmp_path / "read_only"
    env = run_env(jit_cache)
    result = _in_mount_namespace(f"mount --bind -o ro {warm} {warm}",
                                 train_cmd(out, *REFERENCE_ARGS, f"run.iterations={SHORT}",
                                           f"run.compilation_cache_dir={warm}"), env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"compilation cache {warm} is read-only: its programs are read, none is written" in result.stderr
    assert "compile-ahead skipped" in result.stderr and "warning" not in result.stderr.lower()
    assert snapshot(warm) == before
    assert_same_start(out, reference)

    full = tmp_path / "full"
    full.mkdir()
    partial = tmp_path / "partial"
    shutil.copytree(jit_cache, partial)
    shutil.rmtree(partial / "respo_jax_compiled_ahead")
    for name in sorted(os.listdir(partial))[::2]:  # half the programs are gone
        if name.startswith("jit_"):
            os.remove(partial / name)
    # A tmpfs just large enough for the copy (whole pages per file, room for the folders), then filled:
    # the session's cache grows with the tests that ran before this one.
    pages = sum(-(-os.path.getsize(os.path.join(folder, name)) // 4096)
                for folder, _, names in os.walk(partial) for name in names)
    mounts = textwrap.dedent(f"""\
        mount -t tmpfs -o size={4 * pages + 1024}k tmpfs {full}
        cp -r {partial}/. {full}/
        dd if=/dev/zero of={full}/filler bs=64k 2>/dev/null || true""")
    out = tmp_path / "full_disk"
    result = _in_mount_namespace(mounts, train_cmd(out, *REFERENCE_ARGS, f"run.iterations={SHORT}",
                                                   f"run.compilation_cache_dir={full}"),
                                 env, after=f"echo records: $(ls -A {full}/respo_jax_compiled_ahead "
                                            "2>/dev/null | wc -l)\n"
                                            f"echo temporary files: $(ls -A {full} | grep -c '[.]tmp$')")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "records: 0\n" in result.stdout and "temporary files: 0\n" in result.stdout, result.stdout[-500:]
    warnings = [line for line in result.stderr.splitlines() if "cache" in line.lower()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: cannot write the compilation cache"), \
        result.stderr[-3000:]
    assert "No space left on device" in warnings[0]
    assert_same_start(out, reference)

    damaged = tmp_path / "damaged"
    shutil.copytree(jit_cache, damaged)
    entries = [os.path.join(damaged, EXPORTED_DIR, name) for name in os.listdir(damaged / EXPORTED_DIR)]
    flipped = [path for path in entries if b'"coef_mass_pos"' in open(path, "rb").read()]
    assert flipped
    for path in flipped:
        data = open(path, "rb").read()
        open(path, "wb").write(data.replace(b'"coef_mass_pos"', b'"aoef_mass_pos"', 1))
    out = tmp_path / "damaged_run"
    result = train(jit_cache, out, *REFERENCE_ARGS, f"run.iterations={SHORT}",
                   f"run.compilation_cache_dir={damaged}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_start(out, reference)
    assert any(exported_programs._read_entry(path) is not None for path in flipped)  # rewritten whole
