"""The tiny end-to-end runs the run tests share: `python -m experiments.train` in a subprocess with a
tiny model (one layer, width 16) on the synthetic task, and the helpers that read what a run wrote
(metrics, checkpoints, files) or break it (a flipped bit). Launches share the session's persistent
XLA compilation cache and its cheap-compile flags (tests/conftest.py) so that only the first process
compiles, and compiles cheaply.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from respo_jax.training.checkpoint import list_steps, step_dir

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

# The session's `reference` run (tests/conftest.py).
REFERENCE_ARGS = ("run.iterations=8", "run.checkpoint_every=3", "run.resume=true")


def train_cmd(out_dir, *overrides) -> list[str]:
    return [sys.executable, "-m", "experiments.train", *TINY_RUN, f"run.out_dir={out_dir}", *overrides]


def run_env(jit_cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jit_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    # The session's compile flags (tests/conftest.py), on one host device as a user's run: every launch
    # compiles like every other, so runs compared bit for bit share their programs through the cache.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def train(jit_cache, out_dir, *overrides, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(out_dir, *overrides), cwd=ROOT, env=run_env(jit_cache),
                          capture_output=True, text=True, timeout=timeout)


def read_records(out_dir) -> list[dict]:
    path = pathlib.Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def snapshot(folder) -> dict[str, bytes]:
    """Every file under `folder` with its bytes."""
    folder = pathlib.Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def raw_state(checkpoints, step):
    """(state leaves by path, meta) of a checkpoint step read without a template (no trainer needed). The
    meta's metrics_sha256 is left out: it digests the log's bytes, timing keys included, which differ
    between processes (resume checks it against the log, tests/test_run_faults.py)."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(step_dir(str(checkpoints), step), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    leaves = jax.tree_util.tree_flatten_with_path(restored["state"])[0]
    meta = {key: value for key, value in restored["meta"].items() if key != "metrics_sha256"}
    if "metrics_sha256" in restored["meta"]:  # what it digests: the checkpoint's records as on disk
        log = pathlib.Path(checkpoints).parent / "metrics.jsonl"
        counted = b"".join(log.read_bytes().splitlines(keepends=True)[:meta["metrics_records"]])
        assert hashlib.sha256(counted).hexdigest() == restored["meta"]["metrics_sha256"]
    return {jax.tree_util.keystr(path): np.asarray(value) for path, value in leaves}, meta


def flip_a_bit(folder) -> str:
    """Flips one bit in the middle of the largest array file of a checkpoint step; returns its path."""
    files = [p for p in glob.glob(os.path.join(folder, "state", "**", "*"), recursive=True)
             if os.path.isfile(p) and os.sep + "d" + os.sep in p]
    path = max(files, key=os.path.getsize)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[len(data) // 2] ^= 0x10
    pathlib.Path(path).write_bytes(bytes(data))
    return path


def copy_run(src, dst) -> pathlib.Path:
    shutil.copytree(src, dst)
    return pathlib.Path(dst)


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def assert_same_run(out: pathlib.Path, reference: pathlib.Path) -> None:
    """Metrics (but timings), summary and the last checkpoint of `out` equal the reference's bit for bit."""
    records, expected = read_records(out), read_records(reference)
    assert without_timings(records) == without_timings(expected)
    assert [r["iteration"] for r in records if r["phase"] == "rl"] == list(range(1, 9))
    assert [r["phase"] for r in records].count("eval") == 2 and records[0]["phase"] == "warmup"
    assert (out / "summary.json").read_text() == (reference / "summary.json").read_text()
    assert json.loads((out / "summary.json").read_text())["iterations"] == 8
    assert list_steps(out / "checkpoints")[-1] == 8 and list_steps(reference / "checkpoints")[-1] == 8
    got, got_meta = raw_state(out / "checkpoints", 8)
    want, want_meta = raw_state(reference / "checkpoints", 8)
    assert got_meta == want_meta and got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].tobytes() == want[key].tobytes(), key


def max_iteration(out) -> int:
    """The last iteration `out`'s metrics.jsonl holds (0: none, or the file is being written)."""
    try:
        lines = (pathlib.Path(out) / "metrics.jsonl").read_bytes().split(b"\n")[:-1]
        return max([json.loads(line).get("iteration", 0) for line in lines] + [0])
    except (OSError, ValueError):
        return 0


def kill_when(jit_cache, out, args, target: int, delay: float) -> tuple[int, list[int]] | None:
    """Launches the run `out` with `args`, SIGKILLs it `delay` seconds after it logged iteration `target`
    (or finished); returns (the last iteration logged, the checkpoint steps) at the kill, None when the
    run finished first."""
    proc = subprocess.Popen(train_cmd(out, *args), cwd=ROOT, env=run_env(jit_cache),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and max_iteration(out) < target and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
    finally:
        killed = None
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed = (max_iteration(out), list_steps(pathlib.Path(out) / "checkpoints"))
        proc.wait()
    return killed


def fits_limits(config, model_cfg, memory: int) -> bool:
    """Whether `check_limits` accepts `config` on `model_cfg` (prompts of 10 tokens) with `memory` bytes."""
    from respo_jax.training.config import ConfigError
    from respo_jax.training.limits import check_limits

    try:
        check_limits(config, model_cfg, 10, memory)
    except ConfigError:
        return False
    return True


def least_memory(config, model_cfg) -> int:
    """The least memory in bytes `check_limits` accepts `config` with (a bisection of `fits_limits`)."""
    low, high = 0, 2**40
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits_limits(config, model_cfg, middle) else (middle, high)
    return high
