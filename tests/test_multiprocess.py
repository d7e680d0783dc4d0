"""Two processes on localhost train as one: `experiments.train` launched twice with JAX_NUM_PROCESSES=2
(respo_jax.distributed; CPU collectives over gloo), two CPU devices each, on the same (data=2, expert=2)
mesh as one process with four devices. In the same launch (one process start and one distributed
set-up, the slow part) the two processes first run one iteration — writing one run directory together
(process 0 its files, both the Orbax checkpoint) — and then resume that run from its checkpoint for a
second iteration; every metric of both iterations, and every rollout row (the continuous engine, its
scheduling decisions taken in each process from flags gathered across both), equals the uninterrupted
one-process run's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# toy_moe, as small as it gets: 2 warm-up steps, rollout batches of 16 responses used for 1 update each.
# The rollouts through the continuous engine with fewer slots than the 16 rows, segments of 2 steps and
# decode widths of 4 or 2 slots: every process refills slots from the done flags gathered across both.
ARGS = ["--config", "experiments/configs/toy_moe.py", "rollout.reuse=1", "warmup.steps=2",
        "run.eval_problems=0", "run.progress=false", "mesh.data=2", "mesh.expert=2",
        "rollout.scheduler=continuous", "rollout.max_slots=4", "rollout.steps_per_schedule=2",
        "rollout.min_decode_slots=2"]
# Same compile flags in every process (XLA:CPU's LLVM time dominates these tiny programs).
FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Each of the two processes: one iteration, then the same run resumed from its checkpoint for a second.
RUN_THEN_RESUME = ("import sys; from experiments.train import main; "
                   "main(sys.argv[1:] + ['run.iterations=1']); "
                   "main(sys.argv[1:] + ['run.iterations=2', 'run.resume=true'])")


def _env(devices: int, **extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {FLAGS}"
    for key in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _metrics(run) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["rollout.async_steps=1"]], ids=["sync", "async"])
def test_two_processes_train_like_one_and_resume_from_their_checkpoint(tmp_path, extra):
    """Synchronous, and asynchronous with k = 1 (iteration 2 trains on the initial policy's batch, which
    the resumed launch regenerates from the behaviour parameters of its checkpoint; every process runs
    the rollout jobs in the same order)."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    address = f"localhost:{_free_port()}"
    args = [*ARGS, *extra]
    workers = [subprocess.Popen([sys.executable, "-c", RUN_THEN_RESUME, *args, f"run.out_dir={two}"],
                                cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_env(2, JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=i,
                                         JAX_COORDINATOR_ADDRESS=address))
               for i in range(2)]
    single = subprocess.run([sys.executable, "-m", "experiments.train", *args, "run.iterations=2",
                             f"run.out_dir={one}"], cwd=REPO, capture_output=True, text=True, env=_env(4),
                            timeout=900)
    outputs = [w.communicate(timeout=900)[0] for w in workers]
    assert single.returncode == 0, single.stderr[-3000:]
    for i, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, f"process {i}:\n{output[-3000:]}"

    info = json.loads(open(os.path.join(two, "run_info.json")).read())
    assert info["processes"] == 2 and info["devices"] == 4
    assert info["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 2}
    want, got = _metrics(one), _metrics(two)
    # the resumed run kept the first run's records and added iteration 2 (no second warm-up)
    assert [r["phase"] for r in got] == [r["phase"] for r in want] == ["warmup", "warmup", "rl", "rl"]
    assert [r.get("iteration") for r in got] == [None, None, 1, 2]
    for a, b in zip(got, want):
        for key in ("sft_loss", "loss", "grad_norm", "score", "response_length", "log_w_mean",
                    "load_balancing_loss"):
            if key in b:
                # log W is ~0 at the first update (log π_old and the update's log-probs come from two
                # head kernels, equal to float32 round-off): compared to that round-off, 1e-6
                atol = 1e-6 if key == "log_w_mean" else 1e-7
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=atol,
                                           err_msg=f"{key}, iteration {a.get('iteration')}")
    # checkpoints written by both processes together, each with its manifest (process 0)
    steps = sorted(os.listdir(os.path.join(two, "checkpoints")))
    assert steps == ["1", "2"], steps
    assert os.path.isfile(os.path.join(two, "checkpoints", "2", "respo_manifest.json"))
    assert sorted(os.listdir(os.path.join(two, "rollouts"))) == ["iteration_000001.npz", "iteration_000002.npz"]
    for name in ("iteration_000001.npz", "iteration_000002.npz"):  # the same responses, row by row
        with np.load(os.path.join(two, "rollouts", name)) as got_rows, \
                np.load(os.path.join(one, "rollouts", name)) as want_rows:
            for key in ("length", "reward", "advantage"):
                np.testing.assert_array_equal(got_rows[key], want_rows[key], err_msg=f"{name}: {key}")
            np.testing.assert_allclose(got_rows["log_w"], want_rows["log_w"], atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_a_sigterm_to_one_process_stops_both_at_the_same_step_with_one_checkpoint(tmp_path):
    """SIGTERM reaches process 1 only, once RL iteration 1 is logged (by process 0): the processes agree
    at the next step boundary (respo_jax.training.preemption), save that step's checkpoint together
    and both exit 143, each with one line naming the same step."""
    import signal
    import time

    out = str(tmp_path / "run")
    address = f"localhost:{_free_port()}"
    workers = [subprocess.Popen([sys.executable, "-m", "experiments.train", *ARGS, "run.iterations=6",
                                 f"run.out_dir={out}"], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env=_env(2, JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=i,
                                         JAX_COORDINATOR_ADDRESS=address))
               for i in range(2)]
    metrics = os.path.join(out, "metrics.jsonl")
    while all(w.poll() is None for w in workers):
        if os.path.exists(metrics) and sum('"phase": "rl"' in line for line in open(metrics)) >= 1:
            workers[1].send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    errors = [w.communicate(timeout=900)[1] for w in workers]
    for i, (worker, stderr) in enumerate(zip(workers, errors)):
        assert worker.returncode == 143, f"process {i}:\n{stderr[-3000:]}"
    lines = [[line for line in stderr.splitlines() if line.startswith("stopped: ")] for stderr in errors]
    assert all(len(found) == 1 for found in lines), errors
    iterations = [r["iteration"] for r in _metrics(out) if r["phase"] == "rl"]
    step = iterations[-1]
    assert step < 6 and sorted(os.listdir(os.path.join(out, "checkpoints"))) == [str(step)]
    assert os.path.isfile(os.path.join(out, "checkpoints", str(step), "respo_manifest.json"))
    for found in lines:
        assert f"SIGTERM after RL iteration {step} of 6: checkpoint step {step} saved" in found[0], found
