"""Two processes on localhost train as one: `python -m experiments.train` launched twice with
JAX_NUM_PROCESSES=2 (respo_jax.distributed; CPU collectives over gloo), two CPU devices each, gives the
same metrics as one process with four devices on the same (data=2, expert=2) mesh, and the processes
write one run directory together (process 0 its files, both the Orbax checkpoint)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# toy_moe, as small as it gets: 2 warm-up steps, one rollout batch of 16 responses used for 1 update.
ARGS = ["--config", "experiments/configs/toy_moe.py", "run.iterations=1", "rollout.reuse=1", "warmup.steps=2",
        "run.eval_problems=0", "run.progress=false", "mesh.data=2", "mesh.expert=2"]
# Same compile flags in every process (XLA:CPU's LLVM time dominates these tiny programs).
FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


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


def test_two_processes_train_like_one(tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    command = [sys.executable, "-m", "experiments.train", *ARGS]
    address = f"localhost:{_free_port()}"
    workers = [subprocess.Popen(command + [f"run.out_dir={two}"], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env=_env(2, JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=i,
                                         JAX_COORDINATOR_ADDRESS=address))
               for i in range(2)]
    single = subprocess.run(command + [f"run.out_dir={one}"], cwd=REPO, capture_output=True, text=True,
                            env=_env(4), timeout=900)
    outputs = [w.communicate(timeout=900)[0] for w in workers]
    assert single.returncode == 0, single.stderr[-3000:]
    for i, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 0, f"process {i}:\n{output[-3000:]}"

    info = json.loads(open(os.path.join(two, "run_info.json")).read())
    assert info["processes"] == 2 and info["devices"] == 4
    assert info["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 2}
    want, got = _metrics(one), _metrics(two)
    assert [r["phase"] for r in got] == [r["phase"] for r in want] == ["warmup", "warmup", "rl"]
    for a, b in zip(got, want):
        for key in ("sft_loss", "loss", "grad_norm", "score", "response_length", "log_w_mean"):
            if key in b:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # one checkpoint, written by both processes together, with its manifest (process 0)
    steps = os.listdir(os.path.join(two, "checkpoints"))
    assert steps == ["1"], steps
    assert os.path.isfile(os.path.join(two, "checkpoints", "1", "respo_manifest.json"))
