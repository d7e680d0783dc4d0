"""Ending a run at a step boundary when its machine is taken away, and checkpointing on a clock.

Preemptible TPU VMs, spot GPUs, Kubernetes and Slurm send SIGTERM and allow tens of seconds before they
kill; Ctrl-C sends SIGINT. While `handling()` is active, the first of these signals only sets a flag:
the trainer (the evaluation, the sweep) finishes the policy update or evaluation batch in flight, asks
`stop_agreed()` at its next step boundary, saves a checkpoint at that step (flushes what is done), closes
its logs and trackers and raises `Preempted`, which the command line prints as one line (what was saved,
how to resume) before exiting with `exit_status(signal)`: 128 + the signal number (143 for SIGTERM, 130
for SIGINT), the status a shell reports for a process that signal ended. No KeyboardInterrupt is ever
raised, so no library callback can swallow it.

A second signal exits at once (`os._exit`, same status). Nothing is left half-written: every file a run
replaces is written to a temporary name and renamed (`respo_jax.runs.atomic_write`), metrics lines are
appended whole (a torn last line is the only damage, and readers leave it out), and a checkpoint step
without its manifest is never restored (`respo_jax.training.checkpoint`) — exactly what a kill -9 leaves.

Several processes stop at the same step: `stop_agreed()` is a small all-gather of every process's flags
through JAX's distributed runtime (`multihost_utils.process_allgather`), called by every process at
every step boundary, so a signal that reached only some hosts stops them all after the same step (the
agreement `multihost_utils.reached_preemption_sync_point` gives, for signals JAX's own notifier sees;
this one also covers SIGINT and the clock below). The same gather agrees on a time-based checkpoint
(`run.checkpoint_every_minutes`), whose clock each process reads for itself.

A signal can also come while a program starts (importing JAX and the model code takes seconds): the
entry points that promise a clean stop import `experiments.signals_at_start` before anything heavy,
which calls `handle_from_start()` (this module imports only the standard library), and ask
`stop_at_start()` before their first write, so such a signal stops them in one line with nothing written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The exit status of a run a signal stopped: 128 + its number (143 SIGTERM, 130 SIGINT)."""
    return 128 + int(signum)


class Preempted(Exception):
    """A run stopped at a step boundary by a signal; the message is one line (what was kept, how to
    resume) and `status` the process's exit status."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.status = int(signum), exit_status(signum)


_state: dict = {"signal": None, "active": 0, "previous": {}, "held": False}


def _handler(signum, frame) -> None:
    if _state["signal"] is not None:  # the second signal: at once (every write is atomic or whole-line)
        os.write(2, f"error: second {signal.Signals(signum).name}: exiting at once; the last checkpoint "
                    "is intact\n".encode())
        os._exit(exit_status(signum))
    _state["signal"] = signum


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """SIGTERM and SIGINT set the stop flag while inside (module docstring); nested uses share one flag.
    Outside the main thread (where Python cannot take signals) it only yields."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _state["active"] == 0:
        # Installed again even when held from the start: JAX's distributed runtime sets its own SIGTERM
        # handler when it starts, between the two.
        previous = {signum: signal.signal(signum, _handler) for signum in SIGNALS}
        if not _state["held"]:
            _state["signal"], _state["previous"] = None, previous
    _state["active"] += 1
    try:
        yield
    finally:
        _state["active"] -= 1
        if _state["active"] == 0 and not _state["held"]:
            for signum, previous in _state["previous"].items():
                signal.signal(signum, previous)
            # the flag belongs to the block: a later program in this process (a notebook's next run)
            # starts without it
            _state["signal"] = None


def handle_from_start() -> None:
    """Sets the stop flag on SIGTERM / SIGINT from now until the process exits (for a program's start,
    before its heavy imports): the `handling()` blocks inside keep a signal that came before them."""
    import threading

    if threading.current_thread() is threading.main_thread() and not _state["held"] and not _state["active"]:
        _state["signal"] = None
        for signum in SIGNALS:
            signal.signal(signum, _handler)
        _state["held"] = True  # the handlers stay until the process exits


def stop_at_start() -> None:
    """Raises Preempted when a signal came while the program started (every process agrees; a
    collective in a multi-process run): called before the program's first write."""
    signum, _ = stop_agreed()
    if signum:
        raise Preempted(f"{signal_name(signum)} during start-up: nothing was written, no checkpoint yet",
                        signum)


def requested() -> int | None:
    """The signal received by this process (None: none)."""
    return _state["signal"]


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Clock:
    """When a time-based checkpoint is due: every `minutes` minutes of wall time since the last one
    (0: never)."""

    def __init__(self, minutes: float):
        self.seconds = 60.0 * minutes
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def reset(self) -> None:
        self.last = time.monotonic()


def stop_agreed(clock: Clock | None = None) -> tuple[int | None, bool]:
    """(the signal to stop on, or None; whether a time-based checkpoint is due), the same in every
    process. A collective in a multi-process run: every process calls it at the same step boundary."""
    import jax
    import numpy as np

    signum = requested() or 0
    due = bool(clock is not None and clock.due())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = np.asarray(multihost_utils.process_allgather(np.array([signum, int(due)], np.int32)))
        flags = flags.reshape(-1, 2)
        stopping = [int(s) for s in flags[:, 0] if s]
        signum = min(stopping) if stopping else 0  # the same choice everywhere
        due = bool(flags[:, 1].max())
    return (signum or None), due
