"""Make XLA:CPU reuse its host memory between steps instead of page-faulting it in again each time.

Why: XLA:CPU allocates each execution's temporary buffer (all intermediates of the step, one block of
up to gigabytes for a train step) with `malloc`. glibc serves
a block that large with a fresh `mmap` and returns it with `munmap` when the step ends, so every step
page-faults its whole temp buffer in again, a large share of a CPU step's time.

Two settings remove this:
- glibc (`mallopt`): no `mmap` for large blocks (M_MMAP_MAX=0) and no trimming of the heap top
  (M_TRIM_THRESHOLD=-1, read by glibc as the largest size), so a freed block stays mapped for the next
  step. Only the main arena can grow its heap that far: a thread arena is capped at 64 MB and still
  hands larger blocks to `mmap`.
- JAX: synchronous dispatch on the CPU backend (`jax_cpu_enable_async_dispatch=False`), so an execution
  and its temp buffer are allocated on the calling (main) thread, from the main arena. Dispatch then
  returns when the computation is done; on a CPU the computation occupies the cores anyway.
Together they leave no page faults in a step. (Forcing all threads onto the main arena with
M_ARENA_MAX=1 also works, but lock contention makes the steps slower.)

A third setting keeps the heap's resident size what the process uses: NumPy advises transparent huge
pages (`madvise(MADV_HUGEPAGE)`) for each large array it allocates. Without `mmap` that array lies in
the heap, and the advice outlives it: a later fault anywhere in that range of the heap (a chunk header
written in memory `malloc_trim` returned, part of a temp) may bring in a whole 2 MiB page, so the
resident size grows past what the process holds, by an amount that depends on where the heap's blocks
happen to fall. `configure_host_allocator` turns NumPy's advice off (`numpy_madvise_hugepage: False`).

The cost: the process keeps its high-water mark of host memory instead of returning it to the OS
between steps, which is what a trainer wants (PyTorch's CUDA caching allocator and XLA's GPU allocator
do the same for device memory). One caveat: when the step's shape changes, a freed block too small for
the new step's temp buffer stays as a hole and the heap grows past it, so a sweep over growing shapes
accumulates.
`release_host_memory()` (glibc `malloc_trim`) returns the free parts of the heap to the OS; callers use
it when the shape of their steps changes. `release_host_memory(keep_free_bytes)` keeps a free heap up to
that size instead, for callers whose next steps need about as much again (the trainer's new batch
shapes: `respo_jax.training.shapes.KEEP_FREE_FRACTION`), since faulting it back in costs ~2 s per GB
on a VM.

Call `configure_host_allocator()` at the start of a program, before the first JAX computation (JAX
reads the dispatch flag when it creates the CPU client). A process-wide side effect, so the library
never calls it; `experiments/` entry points do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

# name -> (parameter, value); -1 as a trim threshold is SIZE_MAX (never trim).
MALLOPT_SETTINGS = {"M_MMAP_MAX": (M_MMAP_MAX, 0), "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, -1)}

_applied: dict | None = None


def _glibc():
    """This process's C library through ctypes if it is glibc on Linux, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def configure_host_allocator(jax_dispatch: bool = True) -> dict:
    """Applies `MALLOPT_SETTINGS` through glibc's `mallopt` and, with `jax_dispatch`, synchronous CPU
    dispatch, once per process (a process that runs no JAX, e.g. a PyTorch baseline given the same
    malloc settings, passes `jax_dispatch=False` and never imports JAX).

    Returns {"applied": True, "mallopt": {name: value}, "numpy_madvise_hugepage": False,
    "jax_cpu_enable_async_dispatch": False} (the last key only with `jax_dispatch`; the NumPy key None
    where this NumPy has no such switch) or, where there is no glibc (macOS, musl) and nothing was
    changed, {"applied": False, "reason": ...}. Raises RuntimeError if glibc refuses a setting.
    """
    global _applied
    if _applied is not None:
        return _applied
    libc = _glibc()
    if libc is None:
        libc_name = platform.libc_ver()[0] or "unknown libc"
        _applied = {"applied": False, "reason": f"not Linux with glibc ({platform.system()}, {libc_name})"}
        return _applied
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    for name, (parameter, value) in MALLOPT_SETTINGS.items():
        if libc.mallopt(parameter, value) != 1:
            raise RuntimeError(f"glibc mallopt refused {name}={value}")
    _applied = {"applied": True, "mallopt": {name: value for name, (_, value) in MALLOPT_SETTINGS.items()},
                "numpy_madvise_hugepage": _no_numpy_hugepages()}
    if jax_dispatch:
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)
        _applied["jax_cpu_enable_async_dispatch"] = False
    return _applied


def _no_numpy_hugepages() -> bool | None:
    """Turns off NumPy's huge-page advice on its large arrays (the switch behind its
    `NUMPY_MADVISE_HUGEPAGE` variable); returns the setting now in force, False, or None where this NumPy
    has no such switch."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        return None
    _set_madvise_hugepage(False)
    return False


def expected_platform() -> str:
    """The platform JAX will run on ("cpu", "gpu", "tpu"), decided without starting JAX (the allocator
    must be configured before): the first of `JAX_PLATFORMS` when set, else "cpu" unless a GPU plugin
    is installed or a TPU is attached. libtpu alone says nothing: it is installed to compile for TPU
    topologies on a CPU host (`experiments.aot`), where JAX runs on the CPU; a TPU host has its chips'
    device files (/dev/accel*, or /dev/vfio/<n> on v5e and later)."""
    import glob
    import importlib.util
    import os

    chosen = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if chosen:
        return "gpu" if chosen in ("cuda", "rocm", "gpu") else chosen
    plugins = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")
    if any(importlib.util.find_spec(module) is not None for module in plugins):
        return "gpu"
    if importlib.util.find_spec("libtpu") is not None and (glob.glob("/dev/accel*") or
                                                          glob.glob("/dev/vfio/[0-9]*")):
        return "tpu"
    return "cpu"


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (<malloc.h>, glibc 2.33+)."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_free_bytes() -> int | None:
    """The free bytes of the main malloc arena, its free chunks and the heap's top (glibc
    `mallinfo2().fordblks`); None where there is no glibc 2.33+."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.argtypes = ()
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().fordblks)


def release_host_memory(keep_free_bytes: int = 0) -> bool:
    """Returns the free memory of the malloc heap to the OS (glibc `malloc_trim(0)`, which also releases
    free pages in the middle of the heap), unless the heap holds at most `keep_free_bytes` free bytes
    (`heap_free_bytes`; 0: always). True if glibc released something; False where it released nothing,
    kept the heap or there is no glibc.

    Why keep some: on a VM the pages given back cost again when the next step touches them (~2 s per GB
    on this project's host), so a caller whose next step needs about as much keeps a bounded free heap."""
    libc = _glibc()
    if libc is None:
        return False
    if keep_free_bytes > 0:
        free = heap_free_bytes()
        if free is not None and free <= keep_free_bytes:
            return False
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))


def host_allocator_settings() -> dict:
    """What `configure_host_allocator` did in this process: its result, or {"applied": False, "reason":
    "not configured"} if it was not called (glibc and JAX defaults in force)."""
    return _applied if _applied is not None else {"applied": False, "reason": "not configured"}
