"""Multi-process (multi-host) start-up: `jax.distributed.initialize` from the environment.

A run launched as several processes (one per host, or several on one machine) sets, in every process:

    JAX_COORDINATOR_ADDRESS=host:port   (process 0's address; JAX reads it itself)
    JAX_NUM_PROCESSES=P                 JAX_PROCESS_ID=i  (0 <= i < P)

`initialize_from_env()` then joins the processes into one JAX runtime before anything else touches
JAX: `jax.devices()` lists every process's devices, the run's mesh spans them, and each process feeds
its own rows of every batch (`respo_jax.training.loop`). On CPU the processes exchange collectives over
gloo (`jax_cpu_collectives_implementation`). Cluster managers that JAX detects itself (SLURM, Open MPI,
Cloud TPU) need only `RESPO_DISTRIBUTED=1`. Without these variables the run is one process.
"""

from __future__ import annotations

import os

ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_AUTO = "RESPO_DISTRIBUTED"

_state: dict | None = None


def distributed_env(environ=None) -> dict | None:
    """The launch described by the environment: {"coordinator_address", "num_processes", "process_id"}
    (None values: JAX's cluster auto-detection fills them), or None for a single-process run. Malformed
    values raise ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    raw_num = environ.get(ENV_NUM_PROCESSES, "").strip()
    auto = environ.get(ENV_AUTO, "").strip().lower() in ("1", "true")
    if not raw_num and not auto:
        return None
    out = {"coordinator_address": environ.get(ENV_COORDINATOR) or None, "num_processes": None,
           "process_id": None}
    if raw_num:
        try:
            num = int(raw_num)
            pid = int(environ.get(ENV_PROCESS_ID, ""))
        except ValueError:
            raise ValueError(f"{ENV_NUM_PROCESSES}={raw_num!r} and {ENV_PROCESS_ID}="
                             f"{environ.get(ENV_PROCESS_ID)!r}: expected integers with 0 <= "
                             f"{ENV_PROCESS_ID} < {ENV_NUM_PROCESSES}") from None
        if num < 1 or not 0 <= pid < num:
            raise ValueError(f"{ENV_NUM_PROCESSES}={num}, {ENV_PROCESS_ID}={pid}: expected 0 <= "
                             f"{ENV_PROCESS_ID} < {ENV_NUM_PROCESSES}")
        if num == 1:
            return None
        if out["coordinator_address"] is None:
            raise ValueError(f"{ENV_NUM_PROCESSES}={num} needs {ENV_COORDINATOR}=host:port "
                             "(process 0's address)")
        out.update(num_processes=num, process_id=pid)
    return out


def initialize_from_env(environ=None) -> dict:
    """Joins this process to the others of its launch (see the module docstring), once per process; call
    it before the first JAX computation. Returns {"processes", "process_id"}."""
    global _state
    if _state is not None:
        return _state
    import jax

    launch = distributed_env(environ)
    if launch is None:
        _state = {"processes": 1, "process_id": 0}
        return _state
    platforms = (jax.config.jax_platforms or "").split(",")[0]
    if platforms in ("", "cpu"):
        # CPU devices of several processes talk over gloo (a no-op setting for GPU/TPU runs).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**launch)
    _state = {"processes": jax.process_count(), "process_id": jax.process_index()}
    return _state


def is_primary_process() -> bool:
    """True in process 0 (the one that writes a run's files), and in a single-process run."""
    import jax

    return jax.process_index() == 0


def sync_processes(name: str) -> None:
    """Waits until every process reached the point `name` (nothing to wait for in one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def to_host(x):
    """A (possibly multi-process) array as a NumPy array holding all of it, on every process: arrays
    split over other processes' devices are gathered (a collective: every process must call it)."""
    import jax
    import numpy as np

    if x is None:
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
