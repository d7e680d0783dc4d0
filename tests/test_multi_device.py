"""The 8-device checks of respo_jax.sharding and the sharded Qwen3 (tests/multi_device/: parameter
shardings, sharded init and loading, expert parallelism, sharded forward/backward, decoding and sampling,
each against one device), run as an ordinary pytest in a subprocess: XLA_FLAGS must ask for 8 simulated
CPU devices before JAX starts, and this process has started JAX with one. One subprocess per file, so a
file's tests share the sharded models and programs they build; pytest-xdist runs the files side by side.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(REPO, "tests", "multi_device", "test_*.py")))
assert FILES, "no tests/multi_device/test_*.py"
# 8 simulated devices; the two compile flags cut XLA:CPU's LLVM time ~5x (these tiny programs are all
# compile): every check compares programs compiled with the same flags.
XLA_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_on_8_simulated_devices(path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS,
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    command = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:randomly", "-p", "no:xdist", "-p",
               "no:cacheprovider"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-3000:]
