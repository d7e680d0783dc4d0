"""Counts XLA compilations of this process, so a training run can report what recompilation costs it.

JAX reports every backend compilation, and the tracing and lowering before it, as duration events
(`jax.monitoring`); one listener, registered on first use, adds them up. A compilation served from
the in-memory jit caches emits nothing, so the count is the number of programs XLA actually compiled
(the persistent compilation cache still reports its cache hits as compilations: their backend time is
the cache read; `cache_hits` counts how many of them the cache served).

The persistent compilation cache is configured once per process by `configure_compilation_cache`, from
`run.compilation_cache_dir` (training, the sweep's cells) or `eval.compilation_cache_dir` (evaluation):
a researcher launches one configuration many times (seeds, objectives, N), and every launch after the
first reads its programs from disk instead of compiling them. JAX keys each entry by the program, the
compile options, the devices and the JAX/jaxlib versions, so an entry is only ever used for the very
program that produced it; a changed config lowers to another program and compiles anew.

The cache has no size cap (JAX's default). A cap makes JAX scan the whole cache directory on every write
to evict old entries, so compiling into a large capped cache is several times slower than compiling
without any cache (the README's numbers). Without a cap JAX would write an entry in place, without a
lock; this module has it write each entry to a temporary name and rename it (`_atomic_put`), so runs
and processes sharing the directory never read half an entry, and a kill or a full disk leaves none
(an entry damaged otherwise fails to decompress, and JAX compiles the program instead of using it).

The cache is an optimisation, so it can never stop or change a run: an existing directory this process
cannot write (a cluster's pre-warmed, read-only cache) is read and never written (JAX is told to keep
no program, and this module writes no record); a write that fails later (a full or failing disk) is one
line on stderr the first time (`cache_write_failed`; JAX's per-program warnings are folded into it),
the run goes on, and no compile-ahead record is written for programs that may not be there.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import threading
import warnings

from jax import monitoring

from respo_jax.compilation_cache import cache_read_only, cache_write_failed  # noqa: F401 - re-exported
from respo_jax.compilation_cache import state as _cache_state

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Tracing to a jaxpr and lowering to StableHLO: part of what a new shape costs besides XLA itself.
FRONTEND_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a program read from the persistent cache


@dataclasses.dataclass(frozen=True)
class CompilationTotals:
    """Compilations so far: XLA programs compiled, and the seconds spent tracing, lowering and compiling."""

    compiles: int
    seconds: float
    cache_hits: int = 0  # of `compiles`, those the persistent compilation cache served

    def __sub__(self, other: "CompilationTotals") -> "CompilationTotals":
        return CompilationTotals(self.compiles - other.compiles, self.seconds - other.seconds,
                                 self.cache_hits - other.cache_hits)


_lock = threading.Lock()
_totals = {"compiles": 0, "seconds": 0.0, "cache_hits": 0}
_registered = False


def _listener(event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _totals["compiles"] += 1
            _totals["seconds"] += duration
    elif event in FRONTEND_EVENTS:
        with _lock:
            _totals["seconds"] += duration


def _event_listener(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
        with _lock:
            _totals["cache_hits"] += 1


def compilation_totals() -> CompilationTotals:
    """This process's compilations since the first call of this function (which starts counting)."""
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_listener)
            monitoring.register_event_listener(_event_listener)
            _registered = True
        return CompilationTotals(_totals["compiles"], _totals["seconds"], _totals["cache_hits"])


def memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's per-process limit `vm.max_map_count`), or None
    where /proc does not say (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as handle:
            limit = int(handle.read())
        with open("/proc/self/maps", "rb") as handle:
            held = sum(1 for _ in handle)
    except (OSError, ValueError):
        return None
    return held, limit


def drop_programs_near_map_limit(fraction: float = 0.75) -> tuple[int, int] | None:
    """Drops every compiled program from JAX's in-memory caches (`jax.clear_caches`) when this process
    holds more than `fraction` of its memory-mapping limit; returns the (held, limit) that triggered
    it, else None.

    Why: XLA:CPU maps the code of every program it compiles into the process (~230 mappings for one
    program of a small model) and keeps it while the program is cached. A run that meets many shapes
    would reach `vm.max_map_count` and the next compilation would fail inside LLVM ("Cannot allocate
    memory", then a segmentation fault) with gigabytes of RAM free. Programs needed again afterwards
    are read back from the persistent compilation cache (or compiled anew without one)."""
    maps = memory_maps()
    if maps is None or maps[0] <= fraction * maps[1]:
        return None
    import jax

    jax.clear_caches()
    return maps


def resolve_cache_dir(setting: str) -> str | None:
    """The persistent compilation cache directory a `compilation_cache_dir` setting names: "none" is
    off (None); a path is that path; "" (the default) is `$JAX_COMPILATION_CACHE_DIR` when set, else
    `$XDG_CACHE_HOME/respo_jax/jax_compilation_cache` (`~/.cache/...` without XDG_CACHE_HOME)."""
    if setting.strip().lower() == "none":
        return None
    if setting:
        return os.path.abspath(os.path.expanduser(setting))
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["JAX_COMPILATION_CACHE_DIR"]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "respo_jax", "jax_compilation_cache")


def configure_compilation_cache(setting: str, key: str = "run.compilation_cache_dir") -> str | None:
    """Points this process's persistent compilation cache at `resolve_cache_dir(setting)` (None: turns
    it off) and returns the directory. Every program is cached, however fast it compiled (JAX's default
    skips those under a second, which on CPU are most of a small run's). Takes effect for the
    compilations that follow, also in a process that compiled before (the cache is re-initialised).
    ConfigError (one line naming `key`) when the directory cannot be created or written."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    from respo_jax.config import ConfigError

    path = resolve_cache_dir(setting)
    read_only = False
    if path is not None:
        try:
            existed = os.path.isdir(path)
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.R_OK | os.X_OK):
                raise PermissionError("not readable")
        except OSError as err:
            reason = err.strerror or str(err)
            raise ConfigError(f"{key}={setting!r}: cannot use {path!r} as the compilation cache ({reason}); "
                              "name a writable directory, or none to turn the cache off") from None
        read_only = existed and not _can_write(path)
    _install_warning_hook()
    _install_atomic_put()
    if (path == jax.config.jax_compilation_cache_dir and _configured.get("path", "unset") == path
            and _cache_state["read_only"] == read_only):
        return path  # already in force: keep the initialised cache
    _cache_state["read_only"], _cache_state["write_failed"] = read_only, None
    jax.config.update("jax_compilation_cache_dir", path)
    if read_only:  # JAX keeps no program compiled in under this many seconds: it reads, never writes
        print(f"compilation cache {path} is read-only: its programs are read, none is written",
              file=sys.stderr)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(2**40))
    elif path is not None:
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    _configured["path"] = path
    return path


_configured: dict[str, str | None] = {}
_JAX_WRITE_WARNING = "Error writing persistent compilation cache entry"


def _can_write(folder: str) -> bool:
    """Whether a file can be created in `folder` (tried: permission bits do not stop root, and a
    read-only mount stops everyone)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".respo_jax_probe.", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


def _install_atomic_put() -> None:
    """Makes JAX's file cache (`jax._src.lru_cache.LRUCache`, uncapped) write each entry whole: to a
    temporary file in the cache folder, then renamed; a failed write removes the temporary file and
    raises, which JAX reports as a warning (`_install_warning_hook`). A capped cache keeps JAX's own
    write (its eviction bookkeeping goes with it)."""
    try:
        from jax._src import lru_cache
    except ImportError:
        return
    cache_type, suffix = getattr(lru_cache, "LRUCache", None), getattr(lru_cache, "_CACHE_SUFFIX", None)
    if cache_type is None or suffix is None or getattr(cache_type.put, "_respo_jax_atomic", False):
        return
    original = cache_type.put

    def put(self, key: str, value: bytes) -> None:
        if getattr(self, "eviction_enabled", True) or not key:
            return original(self, key, value)
        path = os.path.join(str(self.path), f"{key}{suffix}")
        if os.path.exists(path):
            return
        fd, temp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=str(self.path))
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(value)
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.remove(temp)
            raise

    put._respo_jax_atomic = True
    cache_type.put = put


def _install_warning_hook() -> None:
    """Folds JAX's warning for each program it could not write into the cache into `cache_write_failed`."""
    if getattr(warnings.showwarning, "_respo_jax_cache_hook", False):
        return
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith(_JAX_WRITE_WARNING):
            import jax

            cache_write_failed(jax.config.jax_compilation_cache_dir or "", text.split(": ", 1)[-1])
            return
        previous(message, category, filename, lineno, file, line)

    show._respo_jax_cache_hook = True
    warnings.showwarning = show


COMPILED_AHEAD_DIR = "respo_jax_compiled_ahead"  # in the cache directory: one file per key, holding it


def compiled_ahead_key(programs: dict) -> str:
    """A key for a run's compile-ahead: a hash of `programs` (what decides the programs compiled ahead: the
    config's program-shaping fields and the prompt buckets, JSON-able) with the JAX and jaxlib versions,
    the devices, the process count and `XLA_FLAGS`."""
    import hashlib
    import json

    import jax
    import jaxlib

    payload = {"programs": programs, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
               "devices": sorted({(d.platform, d.device_kind) for d in jax.devices()}),
               "device_count": jax.device_count(), "processes": jax.process_count(),
               "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:40]


def cache_holds_compile_ahead(key: str) -> bool:
    """Whether this process's persistent compilation cache has recorded a finished compile-ahead under
    `key` (`record_compile_ahead`); False without a cache.

    Why: with a warm cache, compiling ahead is reading every bucket's programs from disk (a fraction of
    a second each on XLA:CPU, tens of seconds before the first rollout for many buckets); once recorded, a
    later launch of the same configuration reads each program when it is first needed instead. Nothing
    is ever compiled from the record: a program the cache lost (pruned, torn) is compiled where it is
    needed, so the record can only make a start slower or faster, never a run different."""
    import jax

    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        return False
    try:  # verified whole: a record holds its own key and nothing else
        with open(os.path.join(cache, COMPILED_AHEAD_DIR, key), "rb") as handle:
            return handle.read() == _record(key)
    except OSError:
        return False


def _record(key: str) -> bytes:
    return f"respo_jax compile-ahead {key}\n".encode()


def record_compile_ahead(key: str) -> None:
    """Records, in this process's persistent compilation cache (if any), that the compile-ahead of `key`
    has finished and its programs are in the cache. Atomic (`respo_jax.runs.atomic_write_bytes`), so
    concurrent runs may record the same key. Records nothing in a read-only cache or after a write into
    the cache failed (the programs may not be there); a record that cannot be written is
    `cache_write_failed`."""
    import jax

    from respo_jax.runs import atomic_write_bytes

    cache = jax.config.jax_compilation_cache_dir
    if not cache or _cache_state["read_only"] or _cache_state["write_failed"] is not None:
        return
    folder = os.path.join(cache, COMPILED_AHEAD_DIR)
    try:
        os.makedirs(folder, exist_ok=True)
        atomic_write_bytes(os.path.join(folder, key), _record(key))
    except OSError as err:
        cache_write_failed(folder, err)  # only a later start's speed depends on the record
