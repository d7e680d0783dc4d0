"""Multi-process (multi-host) start-up: `jax.distributed.initialize` from the environment.

A run launched as several processes (one per host, or several on one machine) sets, in every process:

    JAX_COORDINATOR_ADDRESS=host:port   (process 0's address; JAX reads it itself)
    JAX_NUM_PROCESSES=P                 JAX_PROCESS_ID=i  (0 <= i < P)

`initialize_from_env()` then joins the processes into one JAX runtime before anything else touches
JAX: `jax.devices()` lists every process's devices, the run's mesh spans them, and each process feeds
its own rows of every batch: it builds only the rows its devices hold (`process_rows`) and the global
array is assembled from every process's part (`rows_from_process`); host work on rows (rewards) is
split the same way and the results exchanged explicitly (`process_share`, `gather_rows`). On CPU the
processes exchange collectives over gloo (`jax_cpu_collectives_implementation`). Cluster managers that JAX detects itself (SLURM, Open MPI,
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


def process_rows(sharding, rows: int):
    """The rows of a ``[rows, ...]`` array placed by ``sharding`` (split along its first dimension) that
    this process's devices hold, ascending — the rows it must supply to `rows_from_process`, in that
    order: a ``slice`` (all rows in a single-process run or when they are one block), else an index
    array."""
    import numpy as np

    if sharding is None or _process_count() == 1:
        return slice(0, rows)
    held = np.zeros(rows, bool)
    for index in sharding.addressable_devices_indices_map((rows,)).values():
        held[index[0]] = True
    found = np.nonzero(held)[0]
    if found.size and found[-1] - found[0] + 1 == found.size:
        return slice(int(found[0]), int(found[-1]) + 1)
    return found


def take_rows(items, part):
    """``items[part]`` for a list or an array and a `process_rows` / `process_share` part."""
    if isinstance(part, slice) or not isinstance(items, (list, tuple)):
        return items[part]
    return [items[i] for i in part]


def rows_from_process(sharding, local, rows: int):
    """The global ``[rows, ...]`` array (placed by ``sharding``) of which this process supplies the rows
    ``process_rows(sharding, rows)`` as the host array ``local``; nothing of other processes' rows
    needs to exist here. Without a sharding (no mesh): ``local`` (all rows) on the default device."""
    import jax
    import numpy as np

    local = np.asarray(local)
    if sharding is None:
        return jax.device_put(local)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))


def process_share(count: int) -> slice:
    """An even split of ``count`` items (e.g. the responses to score) over the processes: this process's
    ``slice`` (all of them in a single-process run)."""
    index, processes = _process_index(), _process_count()
    return slice(index * count // processes, (index + 1) * count // processes)


def gather_rows(local, part: slice, rows: int):
    """Host values each process computed for its own rows ``part`` of ``rows`` (e.g. rewards of
    `process_share(rows)`), as the whole ``[rows, ...]`` NumPy array on every process. A collective:
    every process calls it; the parts must cover every row."""
    import numpy as np

    local = np.asarray(local)
    if _process_count() == 1:
        if not np.array_equal(np.arange(rows)[part], np.arange(rows)):
            raise ValueError(f"one process must supply every row of {rows}; got {part}")
        return local
    from jax.experimental import multihost_utils

    values = np.zeros((rows, *local.shape[1:]), local.dtype)
    have = np.zeros(rows, bool)
    values[part], have[part] = local, True
    # [processes, rows, ...] (through JAX: 64-bit values arrive as 32-bit unless jax_enable_x64)
    all_values, all_have = multihost_utils.process_allgather((values, have.astype(np.int8)))
    all_have = np.asarray(all_have) > 0
    out = np.zeros_like(values)
    for process_values, process_have in zip(np.asarray(all_values), all_have):
        out[process_have] = process_values[process_have]
    missing = np.nonzero(~all_have.any(axis=0))[0]
    if missing.size:
        raise ValueError(f"rows {missing[:5].tolist()} of {rows} were supplied by no process")
    return out


def _process_index() -> int:
    import jax

    return jax.process_index()


def _process_count() -> int:
    import jax

    return jax.process_count()
