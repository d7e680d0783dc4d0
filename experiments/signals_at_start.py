"""Imported first (before JAX) by the programs that stop cleanly on SIGTERM / SIGINT: when the module
importing it is the program running (`python -m experiments.train`, `.evaluate`, `.gradient_starvation`:
its `__name__` is "__main__"), a signal from here on sets the stop flag instead of killing the process
(respo_jax.training.preemption), so a signal during the seconds of imports stops it in one line, exit
status 143 / 130, nothing written. Imported by a test or another program, it does nothing."""

import sys

from respo_jax.training import preemption


def _imported_by_main() -> bool:
    """Whether the module whose import runs this one is `__main__` (the import machinery's frames
    skipped)."""
    frame = sys._getframe(2)  # past this function and the module calling it
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "__main__"


if _imported_by_main():
    preemption.handle_from_start()
