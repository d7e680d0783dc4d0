"""Imported first (before JAX) by the programs that stop cleanly on SIGTERM / SIGINT: when the program
running is one of them (`python -m experiments.train`, `.evaluate`, `.gradient_starvation`), a signal
from here on sets the stop flag instead of killing the process (respo_jax.training.preemption), so a
signal during the seconds of imports stops it in one line, exit status 143 / 130, nothing written.
Imported by a test or another program, it does nothing."""

import sys

from respo_jax.training import preemption

PROGRAMS = ("experiments.train", "experiments.evaluate", "experiments.gradient_starvation")

if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) in PROGRAMS:
    preemption.handle_from_start()
