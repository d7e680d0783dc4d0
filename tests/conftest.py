"""Session-wide settings of the test suite.

One persistent XLA compilation cache per test session: the process that starts pytest makes a fresh
directory and names it in `JAX_COMPILATION_CACHE_DIR` (set here, before any test imports JAX), so its
xdist workers and every subprocess a test launches (training runs, evaluations, notebooks) share it,
and identical tiny programs compile once per session instead of once per process. A fresh directory
keeps sessions independent of each other and of the user's `~/.cache/respo_jax`; it is removed at the
end of the session. Tests about the cache itself give their launches caches of their own. The session
also compiles with XLA:CPU's cheap-compile flags (below).

The 8-device checks in tests/multi_device/ need `XLA_FLAGS=--xla_force_host_platform_device_count=8`
before JAX starts, so they are collected only in a process started with it: tests/test_multi_device.py
runs them in a subprocess pytest.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import tempfile

import pytest

SESSION_CACHE_VAR = "RESPO_JAX_TEST_SESSION_CACHE"  # set by the process that owns the session's cache
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"

_owned_cache: str | None = None
if not os.environ.get(SESSION_CACHE_VAR):
    _owned_cache = tempfile.mkdtemp(prefix="respo_jax_test_jit_cache_")
    os.environ[SESSION_CACHE_VAR] = _owned_cache
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[SESSION_CACHE_VAR]
# Every program is cached, as `run.compilation_cache_dir` does for a run (JAX's default skips programs
# that compiled in under a second, which on CPU are most of a tiny model's).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# XLA:CPU spends most of a tiny program's compile in LLVM; these two flags cut most of that and leave the
# program (its HLO) as it is. They reach this process and what it launches (test_multiprocess.py,
# test_multi_device.py and tiny_runs.py's launches pass the same two flags; test_compilation.py's launches
# run with a user's default flags).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in
                                             {g.split("=")[0] for g in _flags}])

# libtpu (the test extra) is installed for tests/test_aot.py, which compiles for TPU topologies; no test
# runs on a TPU. Without these, every JAX process would start libtpu as a backend (its warnings, ~125 MB)
# and hold libtpu's lock file, aborting a topology compile in the other xdist worker or a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

collect_ignore = [] if EIGHT_DEVICES in os.environ["XLA_FLAGS"] else ["multi_device"]


@pytest.fixture(scope="session")
def jit_cache() -> str:
    """The session's persistent XLA compilation cache, for the environment of a process a test launches."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory, jit_cache) -> pathlib.Path:
    """An uninterrupted run of 8 iterations, checkpoints at 3, 6, 8 (tests work on copies). One per
    session: the first xdist worker that needs it trains it under a file lock in the folder the workers
    share, the others wait for it and read it."""
    from tiny_runs import REFERENCE_ARGS, train  # imports JAX: not before the settings above

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out, done = shared / "reference" / "run", shared / "reference" / "done"
    with open(shared / "reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a failed try of another worker
            result = train(jit_cache, out, *REFERENCE_ARGS)
            assert result.returncode == 0, result.stderr[-3000:]
            done.touch()
    return out


def pytest_unconfigure(config):
    if _owned_cache is not None:
        shutil.rmtree(_owned_cache, ignore_errors=True)
