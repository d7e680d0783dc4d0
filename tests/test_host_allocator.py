"""`respo_jax.host_allocator`: after configuring, repeated XLA executions stop page-faulting their temps."""

import json
import os
import platform
import subprocess
import sys
import types

import pytest

from respo_jax import host_allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One jitted function whose [8192, 2048] float32 intermediate (64 MiB, 16,384 pages) is a temp buffer of
# every execution; prints the minor page faults per call after warm-up.
_PROBE = r"""
import json, resource, sys
if sys.argv[1] == "configure":
    from respo_jax.host_allocator import configure_host_allocator
    print(json.dumps(configure_host_allocator()))
import jax, jax.numpy as jnp
x = jnp.full((8192, 64), 0.01, jnp.float32)
w = jnp.full((64, 2048), 0.01, jnp.float32)
f = jax.jit(lambda x, w: jnp.sum(jnp.tanh(x @ w) @ w.T))
for _ in range(2):
    f(x, w).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    f(x, w).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
released = kept = free = None
if sys.argv[1] == "configure":  # release_host_memory hands the kept temp back: the next call faults again
    from respo_jax.host_allocator import heap_free_bytes, release_host_memory
    free = heap_free_bytes()
    kept_release = release_host_memory(keep_free_bytes=1 << 40)  # holds less than that free: kept
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    kept = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    release_host_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    released = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert kept_release is False
print(json.dumps({"faults_per_call": faults, "faults_after_release": released, "faults_after_keep": kept,
                  "heap_free_bytes": free}))
"""
TEMP_PAGES = 8192 * 2048 * 4 // 4096


def _faults_per_call(mode: str) -> tuple[dict, list[str]]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, check=True)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt and malloc_trim are glibc functions; elsewhere nothing changes "
                           "(tested below)")
def test_configured_process_does_not_fault_its_temp_buffer_in_again():
    configured, printed = _faults_per_call("configure")
    assert json.loads(printed[0]) == {"applied": True, "mallopt": {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": -1},
                                      "numpy_madvise_hugepage": False, "jax_cpu_enable_async_dispatch": False}
    faults = configured["faults_per_call"]
    assert faults < 0.05 * TEMP_PAGES, f"{faults} page faults per call after configuring"
    # release_host_memory returned the kept pages to the OS: the next call faults its temp in again.
    assert configured["faults_after_release"] > 0.5 * TEMP_PAGES / 512  # at least that many 2 MiB pages
    assert configured["faults_after_release"] > 10 * max(faults, 1.0)
    # Between calls the heap holds the freed 64 MiB temp; a release that may keep that much keeps it, and
    # the next call faults no more than a warm one.
    assert configured["heap_free_bytes"] >= TEMP_PAGES * 4096
    assert configured["faults_after_keep"] < 0.05 * TEMP_PAGES
    default, _ = _faults_per_call("default")
    # With glibc's defaults the 64 MiB temp is mmapped per call: 16,384 faults with 4 KiB pages (fewer
    # where transparent huge pages are always on, so only the direction is asserted).
    assert default["faults_per_call"] > faults


def test_without_glibc_nothing_is_changed(monkeypatch):
    monkeypatch.setattr(host_allocator, "_applied", None)
    monkeypatch.setattr(host_allocator.platform, "libc_ver", lambda: ("", ""))
    monkeypatch.setattr(host_allocator.ctypes, "CDLL",
                        lambda *a, **k: pytest.fail("mallopt must not be called"))
    result = host_allocator.configure_host_allocator()
    assert result["applied"] is False and "glibc" in result["reason"]
    assert host_allocator.configure_host_allocator() is result  # once per process


def test_a_refused_setting_raises(monkeypatch):
    def refuse(parameter, value):
        return 0

    monkeypatch.setattr(host_allocator, "_applied", None)
    monkeypatch.setattr(host_allocator.platform, "system", lambda: "Linux")
    monkeypatch.setattr(host_allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(host_allocator.ctypes, "CDLL", lambda *a, **k: types.SimpleNamespace(mallopt=refuse))
    with pytest.raises(RuntimeError, match="M_MMAP_MAX"):
        host_allocator.configure_host_allocator()


def test_entry_points_keep_jax_off_an_installed_libtpu_without_a_tpu(monkeypatch):
    """`import experiments` (every `python -m experiments.*`) sets JAX_PLATFORMS=cpu where libtpu is
    installed and no TPU is attached (JAX would otherwise start libtpu in every process); nothing where
    libtpu is absent or a TPU is attached, and never over the user's own JAX_PLATFORMS."""
    import importlib.util

    root = ROOT
    code = "import os, experiments; print(os.environ.get('JAX_PLATFORMS'))"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = root
    got = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # the conftest's; the host's own answer
    on_cpu = host_allocator.expected_platform() == "cpu"
    expected = "cpu" if importlib.util.find_spec("libtpu") is not None and on_cpu else "None"
    assert got == expected
    env["JAX_PLATFORMS"] = "cpu,tpu"
    got = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert got == "cpu,tpu"


_HUGEPAGE_PROBE = r"""
import sys
import numpy as np
if sys.argv[1] == "configure":
    from respo_jax.host_allocator import configure_host_allocator
    configure_host_allocator(jax_dispatch=False)
array = np.ones((64, 1024, 1024), np.uint8)  # 64 MiB: NumPy advises huge pages for it unless told not to
print(sum(1 for line in open("/proc/self/smaps") if line.startswith("VmFlags") and "hg" in line.split()))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                    or not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="NumPy advises huge pages only on Linux with transparent huge pages, and the heap it lands in "
                           "is glibc's; elsewhere there is no advice to turn off")
def test_configured_process_advises_no_huge_pages_for_numpy_arrays_in_the_heap():
    """Without `mmap` a large NumPy array lies in the heap; NumPy's huge-page advice on it would outlive
    it there. Configured: no mapping of the process is advised for huge pages; by default NumPy's is."""
    def advised(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _HUGEPAGE_PROBE, mode], capture_output=True, text=True,
                             cwd=ROOT, timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    assert advised("configure") == 0
    assert advised("default") >= 1
