"""The command-line shell shared by the experiment entry points: a user's mistake or a run that fails
is one line on stderr and an exit status, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

from respo_jax.training.config import ConfigError
from respo_jax.training.preemption import Preempted


def run_failures() -> tuple[type[Exception], ...]:
    """What a training run raises when it fails after it started: no intact checkpoint, NaN/inf
    parameters, a damaged data file, a write that failed (a full disk, a read-only file system), a
    tracker that cannot start, each with a one-line message naming what is wrong."""
    from respo_jax.data.records import DataFileError
    from respo_jax.training.checkpoint import CheckpointError
    from respo_jax.training.step import NonFiniteError
    from respo_jax.training.trackers import TrackerError
    from respo_jax.training.write_errors import RunWriteError

    return (CheckpointError, NonFiniteError, DataFileError, RunWriteError, TrackerError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (an unknown flag, a bad value) are a ConfigError, so that `run_cli`
    reports them as one line with exit status 2 instead of argparse's usage block; --help still prints
    the help and exits 0."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def run_cli(main: Callable[[list[str]], object], argv: list[str],
            failures: tuple[type[Exception], ...] = (),
            usage_errors: tuple[type[Exception], ...] = (ConfigError,)) -> int:
    """Runs `main(argv)` and returns its exit status: the int `main` returns (0 when it returns
    anything else), 2 after one of `usage_errors` (the command could not start: nothing was written),
    1 after one of `failures` (it started and failed); both print `error: <message>` to stderr. A
    run stopped by a signal (`respo_jax.training.preemption.Preempted`) prints `stopped: <what was
    kept, how to resume>` and exits with 128 + the signal's number (143 SIGTERM, 130 SIGINT).
    Anything else is a bug and keeps its traceback."""
    try:
        status = main(argv)
    except Preempted as err:
        print(f"stopped: {err}", file=sys.stderr)
        return err.status
    except usage_errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except failures as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return status if isinstance(status, int) and not isinstance(status, bool) else 0
