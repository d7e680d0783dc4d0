"""The command-line shell shared by the experiment entry points: a user's mistake or a run that fails
is one line on stderr and an exit status, never a traceback."""

from __future__ import annotations

import sys
from typing import Callable

from respo_jax.training.config import ConfigError


def run_failures() -> tuple[type[Exception], ...]:
    """What a training run raises when it fails after it started: no intact checkpoint, NaN/inf
    parameters, a damaged data file, a tracker that cannot start (each with a one-line message naming
    what is wrong)."""
    from respo_jax.data.records import DataFileError
    from respo_jax.training.checkpoint import CheckpointError
    from respo_jax.training.step import NonFiniteError
    from respo_jax.training.trackers import TrackerError

    return (CheckpointError, NonFiniteError, DataFileError, TrackerError)


def run_cli(main: Callable[[list[str]], object], argv: list[str],
            failures: tuple[type[Exception], ...] = (),
            usage_errors: tuple[type[Exception], ...] = (ConfigError,)) -> int:
    """Runs `main(argv)` and returns its exit status: 0, 2 after one of `usage_errors` (the command
    could not start: nothing was written), 1 after one of `failures` (it started and failed); both
    print `error: <message>` to stderr. Anything else is a bug and keeps its traceback."""
    try:
        main(argv)
    except usage_errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except failures as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
