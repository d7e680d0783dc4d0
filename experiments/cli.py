"""The command-line shell shared by the experiment entry points: a user's mistake or a run that fails
is one line on stderr and an exit status, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import shlex
import sys
import traceback
from typing import Any, Callable, NoReturn

from respo_jax.training.config import ConfigError, ExperimentConfig
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

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if _parse_only:
            raise Parsed(parsed)
        return parsed


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


# ---------------------------------------------------------------------------------------------------
# Every `python -m` entry point, and a check of a command line that runs nothing

# `python -m NAME` -> the module whose `main(argv)` it runs.
ENTRY_POINTS = {
    "experiments.train": "experiments.train",
    "experiments.evaluate": "experiments.evaluate",
    "experiments.report": "experiments.report",
    "experiments.export": "experiments.export",
    "experiments.gradient_starvation": "experiments.gradient_starvation",
    "experiments.async_staleness": "experiments.async_staleness",
    "experiments.mesh_equivalence": "experiments.mesh_equivalence",
    "experiments.crash_suite": "experiments.crash_suite",
    "experiments.aot": "experiments.aot",
    "experiments.benchmarks": "experiments.benchmarks.__main__",
    "experiments.benchmarks.decode_vs_transformers": "experiments.benchmarks.decode_vs_transformers",
    "experiments.benchmarks.lm_head": "experiments.benchmarks.lm_head",
    "experiments.benchmarks.rl_iteration": "experiments.benchmarks.rl_iteration",
    "experiments.benchmarks.rollout_engine": "experiments.benchmarks.rollout_engine",
    "experiments.benchmarks.vllm_side": "experiments.benchmarks.vllm_side",
    "experiments.benchmarks.report": "experiments.benchmarks.report",
    "experiments.benchmarks.async_timeline": "experiments.benchmarks.async_timeline",
    "experiments.benchmarks.relaunch": "experiments.benchmarks.relaunch",
    "respo_jax.symbolic": "respo_jax.symbolic.verify",
}
_parse_only = False


class Parsed(Exception):
    """Raised by `ArgumentParser.parse_args` inside `parse_only()`: the parsed namespace, nothing run."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def parse_only():
    """Within it, an entry point's `main` stops right after its arguments parse (raising `Parsed`)."""
    global _parse_only
    _parse_only, before = True, _parse_only
    try:
        yield
    finally:
        _parse_only = before


def load_config(path: str, expected: type = ExperimentConfig, function: str = "get_config",
                module_name: str = "experiment_config"):
    """Imports a config file and calls its `function()` (`get_config()`), which must return an `expected`
    instance (`ExperimentConfig` for training, `respo_jax.eval.config.EvalConfig` for evaluation, the
    sweep's `StarvationConfig`)."""
    config = call_config_file(path, function, module_name)
    if not isinstance(config, expected):
        raise ConfigError(f"--config {path!r}: {function}() returned {type(config).__name__}, "
                          f"expected {expected.__name__}")
    return config


def call_config_file(path: str, function: str, module_name: str = "experiment_config"):
    """Imports the config file `path` and returns what its `function()` returns; a ConfigError (one line,
    `config_file_error`) for a missing file or function, a syntax error or an exception raised in it."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: no such file")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, function):
            raise ConfigError(f"--config {path!r}: the file has no {function}()")
        return getattr(module, function)()
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - the config file's own error, whatever it raised
        raise ConfigError(config_file_error(path, err)) from None


def config_file_error(path: str, err: Exception) -> str:
    """'--config FILE:LINE: <exception>' for an error raised by (or a syntax error in) a config file; the
    line is the deepest one of that file in the traceback."""
    line = None
    if isinstance(err, SyntaxError) and err.filename and os.path.samefile(err.filename, path):
        line = err.lineno
    else:
        for frame in traceback.extract_tb(err.__traceback__):
            if os.path.exists(frame.filename) and os.path.samefile(frame.filename, path):
                line = frame.lineno
    message = err.msg if isinstance(err, SyntaxError) else str(err)
    where = f"{path}:{line}" if line else path
    return f"--config {where}: {type(err).__name__}: {' '.join(str(message).split())}"


def _train_config(namespace):
    return load_config(namespace.config)


def _aot_config(namespace):
    from respo_jax.training.aot import without_data

    return without_data(load_config(namespace.config))


def _eval_config(namespace):
    from respo_jax.eval.config import EvalConfig

    return load_config(namespace.config, EvalConfig)


def _sweep_config(namespace):
    from respo_jax.training.sweep import StarvationConfig

    function = "get_quick_config" if namespace.quick else "get_config"
    return load_config(namespace.config, StarvationConfig, function, "starvation_config")


# Entry points that take `section.field=value` overrides: the config their --config file gives.
CONFIGS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "experiments.train": _train_config,
    "experiments.evaluate": _eval_config,
    "experiments.gradient_starvation": _sweep_config,
    "experiments.async_staleness": _train_config,
    "experiments.mesh_equivalence": _train_config,
    "experiments.aot": _aot_config,
}


def check_override_keys(config, overrides: list[str]) -> None:
    """Each `section.field[.key]=value` names a field of `config` (ConfigError naming the first that
    does not); for a config file that is not at hand, where the values cannot be validated."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        section, _, field = key.partition(".")
        field = field.split(".")[0]
        sections = {f.name for f in dataclasses.fields(config)}
        fields = {f.name for f in dataclasses.fields(getattr(config, section))} if section in sections else ()
        if field not in fields:
            raise ConfigError(f"unknown config key {key!r}")


def check_command(command: str) -> argparse.Namespace | None:
    """Checks one `python -m NAME ARGS...` command line as NAME itself would at start-up, running nothing:
    its flags by its own parser and, for the entry points that take them, its `section.field=value`
    overrides applied to its --config file's config and validated. A --config file that does not exist
    here (a user's own) is replaced by the default config, and only the keys are checked. Environment
    assignments before `python`, a trailing `&` and `# comments` are ignored. Raises ConfigError (or
    the entry point's own usage error) for a command its entry point would refuse; returns the parsed
    namespace (None for `respo_jax.symbolic`, which has no parser)."""
    from respo_jax.training.config import apply_overrides

    words = shlex.split(command, comments=True)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]  # VAR=value before the command
    if words and words[-1] == "&":
        words = words[:-1]
    if len(words) < 3 or not words[0].split("/")[-1].startswith("python") or words[1] != "-m":
        raise ConfigError(f"not a `python -m NAME ...` command: {command!r}")
    name, argv = words[2], words[3:]
    if name not in ENTRY_POINTS:
        raise ConfigError(f"python -m {name}: not an entry point of this project ({sorted(ENTRY_POINTS)})")
    module = importlib.import_module(ENTRY_POINTS[name])
    if name == "respo_jax.symbolic":
        unknown = [a for a in argv if a not in ("-v", "--verbose")]
        if unknown:
            raise ConfigError(f"python -m respo_jax.symbolic: unknown argument(s) {unknown}")
        return None
    with parse_only():
        try:
            module.main(argv)
        except Parsed as parsed:
            namespace = parsed.namespace
        else:
            raise ConfigError(f"python -m {name}: main() returned without parsing its arguments")
    if name in CONFIGS:
        overrides = list(namespace.overrides)
        if os.path.isfile(namespace.config):
            config = CONFIGS[name](namespace)
            apply_overrides(config, overrides)
        else:
            default = argparse.Namespace(**{**vars(namespace), "config": _default_config(module)})
            check_override_keys(CONFIGS[name](default), overrides)
    if name == "experiments.mesh_equivalence":
        for mesh in namespace.meshes:
            module.parse_mesh(mesh)
    return namespace


def _default_config(module) -> str:
    with parse_only():
        try:
            module.main([])
        except Parsed as parsed:
            return parsed.namespace.config
    raise ConfigError(f"{module.__name__}: no default --config")
