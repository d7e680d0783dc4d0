"""Typed configs: frozen dataclasses of sections, checked field by field, overridable by dotted keys.

The machinery every config of the project shares (`respo_jax.training.config.ExperimentConfig`, the
evaluation's `EvalConfig`, the sweep's `StarvationConfig`): the one-line `ConfigError`, the section base
with its type checks, the check of a config made of sections (`validate_sections`), the
`section.field=value` command-line parser (values parsed with the field's declared type) and the loader
of a config's `to_dict()` form (a run's `config.json`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")


class ConfigError(ValueError):
    """A configuration a run cannot start with. The message is one line that names the key, the value
    and what is allowed; `experiments/train.py` prints it without a traceback."""


class ConfigKeyError(ConfigError, KeyError):
    """An unknown config key (also a KeyError, so `except KeyError` callers keep working)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raises `ConfigError("key=value: expected <allowed>")` unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {allowed}")


class _Section:
    """What every config section shares: its key prefix, the checks of its fields, and its retired keys
    (`retired`: {field: what replaces it}), refused by name wherever a config is read to run."""

    section: typing.ClassVar[str] = ""
    retired: typing.ClassVar[dict[str, str]] = {}

    def _need(self, name: str, ok: bool, allowed: str) -> None:
        """Raises `ConfigError("section.name=value: expected <allowed>")` unless `ok`."""
        _require(ok, f"{self.section}.{name}", getattr(self, name), allowed)

    def _check_types(self) -> None:
        """Every field has its declared type (a config file can pass anything); floats are finite."""
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            annotation, value = hints[field.name], getattr(self, field.name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if annotation is bool:
                self._need(field.name, isinstance(value, bool), "true or false")
            elif annotation is int:
                self._need(field.name, is_number and isinstance(value, int), "an integer")
            elif annotation is float:
                self._need(field.name, is_number, "a number")
                self._need(field.name, math.isfinite(value), "a finite number")
            elif annotation is str:
                self._need(field.name, isinstance(value, str), "a string")
            elif annotation is dict:
                self._need(field.name, isinstance(value, dict), "a dict (JSON object)")


def _parse_value(raw: str, annotation: Any, key: str) -> Any:
    """Parses a command-line string as the field's declared type (`dict` fields take JSON). Numbers are
    ASCII: Python's int() would read other scripts' digits (`٤` as 4), which a config never means."""
    target = annotation if isinstance(annotation, type) else typing.get_origin(annotation) or annotation
    try:
        if target in (int, float) and not raw.isascii():
            raise ValueError(raw)
        if target is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return lowered in ("true", "1")
        if target is int:
            return int(raw)
        if target is float:
            return float(raw)
        if target is str:
            return raw
        if target is dict:
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: cannot parse as {getattr(target, '__name__', target)}") from None
    raise TypeError(f"override {key}: unsupported field type {annotation!r}")


def apply_overrides(config: ConfigT, overrides: list[str]) -> ConfigT:
    """Returns `config` with `section.field=value` overrides applied and validated.

    Unknown keys raise `ConfigKeyError` (a KeyError), bad values `ConfigError` (a ValueError).

    `config` is any frozen dataclass whose fields are frozen section dataclasses and which has a
    `validate()` returning itself (`ExperimentConfig`, `respo_jax.eval.config.EvalConfig`).
    Sub-keys of dict fields are allowed too: `objective.hparams.eps_high=0.28` (the value parsed as JSON,
    falling back to a plain string).
    """
    sections = {field.name: type(getattr(config, field.name)) for field in dataclasses.fields(config)}
    hints = {name: _field_types(cls) for name, cls in sections.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in sections:
            raise ConfigKeyError(f"unknown config key {key!r}; sections are {sorted(sections)}")
        section_name, field_name, rest = parts[0], parts[1], parts[2:]
        section = getattr(config, section_name)
        _refuse_retired(sections[section_name], [field_name])
        field_types = hints[section_name]
        if field_name not in field_types:
            raise ConfigKeyError(f"unknown config key {key!r}; {section_name} has {sorted(field_types)}")
        if rest:
            if field_types[field_name] is not dict and typing.get_origin(field_types[field_name]) is not dict:
                raise ConfigKeyError(f"config key {key!r}: {section_name}.{field_name} is not a dict field")
            try:
                sub_value = json.loads(raw)
            except json.JSONDecodeError:
                sub_value = raw
            value = dict(getattr(section, field_name))
            value[".".join(rest)] = sub_value
        else:
            value = _parse_value(raw, field_types[field_name], key)
        config = dataclasses.replace(config, **{section_name: dataclasses.replace(section, **{field_name: value})})
    return config.validate()


def _refuse_retired(section_type: type, names) -> None:
    """ConfigKeyError (one line) for the first retired key among `names`, naming its replacement."""
    retired = getattr(section_type, "retired", {})
    for name in names:
        if name in retired:
            key = f"{section_type.section}.{name}"
            raise ConfigKeyError(f"{key} no longer exists: {retired[name]}; remove {key} from the config")


def _field_types(section_type: type) -> dict[str, Any]:
    """{field name: declared type} of a section: its dataclass fields only (not its class attributes,
    such as `section`, which no override may set)."""
    hints = typing.get_type_hints(section_type)
    return {field.name: hints[field.name] for field in dataclasses.fields(section_type)}


def config_from_dict(config_type: type[ConfigT], data: dict, validate: bool = True,
                     drop_retired: bool = False) -> ConfigT:
    """Rebuilds a config from its `to_dict()` form (e.g. a run's `config.json`), then validates it
    (`validate=False`: only its structure, e.g. to compare a saved config with a new one).

    A section or field missing from `data` takes its default (a file written before the field existed);
    an unknown section or field raises ConfigKeyError (a KeyError) naming it, and so does a retired one
    (a config that would run again), unless `drop_retired` (a finished run's config only read, e.g. for
    a report: its retired keys are left out).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"a {config_type.__name__} dict must be a JSON object; got {type(data).__name__}")
    section_types = typing.get_type_hints(config_type)
    unknown = sorted(set(data) - set(section_types))
    if unknown:
        raise ConfigKeyError(
            f"unknown config sections {unknown}; {config_type.__name__} has {sorted(section_types)}"
        )
    sections = {}
    for name, section_type in section_types.items():
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"config section {name!r} must be an object; got {values!r}")
        if drop_retired:
            values = {key: value for key, value in values.items() if key not in section_type.retired}
        else:
            _refuse_retired(section_type, values)
        known = {field.name for field in dataclasses.fields(section_type)}
        extra = sorted(set(values) - known)
        if extra:
            raise ConfigKeyError(f"unknown config fields {name}.{extra}; {name} has {sorted(known)}")
        sections[name] = section_type(**values)
    config = config_type(**sections)
    return config.validate() if validate else config


def _one_line(err: BaseException) -> str:
    """An exception's message on one line (KeyError's quotes removed)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(str(text).split())


def validate_sections(config) -> None:
    """Every section of a config made of sections (`ExperimentConfig`, `EvalConfig`, the sweep's
    `StarvationConfig`) has its declared type (a config file can pass anything) and passes its own checks."""
    section_types = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        section, cls = getattr(config, field.name), section_types[field.name]
        _require(isinstance(section, cls), field.name, section, f"a {cls.__name__}")
        section.validate()


def derive(config: ConfigT, **sections: dict) -> ConfigT:
    """`config` with, in each named section, the fields of its dict replaced: a config file states what
    differs from its base, `derive(ExperimentConfig(), rollout={"reuse": 8}, run={"iterations": 20})`.
    An unknown section or field raises ConfigKeyError naming it; nothing is validated here (the entry
    point validates the config it runs)."""
    known = {field.name for field in dataclasses.fields(config)}
    replaced = {}
    for name, fields in sections.items():
        if name not in known:
            raise ConfigKeyError(f"unknown config section {name!r}; {type(config).__name__} has "
                                 f"{sorted(known)}")
        section = getattr(config, name)
        unknown = sorted(set(fields) - {field.name for field in dataclasses.fields(section)})
        if unknown:
            raise ConfigKeyError(f"unknown config fields {name}.{unknown}")
        replaced[name] = dataclasses.replace(section, **fields)
    return dataclasses.replace(config, **replaced)
