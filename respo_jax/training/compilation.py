"""Counts XLA compilations of this process, so a training run can report what recompilation costs it.

JAX reports every backend compilation, and the tracing and lowering before it, as duration events
(`jax.monitoring`); one listener, registered on first use, adds them up. A compilation served from
the in-memory jit caches emits nothing, so the count is the number of programs XLA actually compiled
(the persistent compilation cache, when enabled, still reports its cache hits as compilations: their
backend time is the cache read).
"""

from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Tracing to a jaxpr and lowering to StableHLO: part of what a new shape costs besides XLA itself.
FRONTEND_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")


@dataclasses.dataclass(frozen=True)
class CompilationTotals:
    """Compilations so far: XLA programs compiled, and the seconds spent tracing, lowering and compiling."""

    compiles: int
    seconds: float

    def __sub__(self, other: "CompilationTotals") -> "CompilationTotals":
        return CompilationTotals(self.compiles - other.compiles, self.seconds - other.seconds)


_lock = threading.Lock()
_totals = {"compiles": 0, "seconds": 0.0}
_registered = False


def _listener(event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _totals["compiles"] += 1
            _totals["seconds"] += duration
    elif event in FRONTEND_EVENTS:
        with _lock:
            _totals["seconds"] += duration


def compilation_totals() -> CompilationTotals:
    """This process's compilations since the first call of this function (which starts counting)."""
    global _registered
    with _lock:
        if not _registered:
            monitoring.register_event_duration_secs_listener(_listener)
            _registered = True
        return CompilationTotals(_totals["compiles"], _totals["seconds"])
