"""The command-line shell shared by the experiment entry points: a user's mistake or a run that fails
is one line on stderr and an exit status, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from respo_jax.training.config import ConfigError


def run_failures() -> tuple[type[Exception], ...]:
    """What a training run raises when it fails after it started: no intact checkpoint, NaN/inf
    parameters, a damaged data file (each with a one-line message naming what is wrong)."""
    from respo_jax.data.records import DataFileError
    from respo_jax.training.checkpoint import CheckpointError
    from respo_jax.training.step import NonFiniteError

    return (CheckpointError, NonFiniteError, DataFileError)


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


class ArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors (an unknown flag, a bad flag value) raise
    ConfigError, so that `run_cli` prints them as one line with exit status 2 instead of argparse's
    usage text."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see --help)")
