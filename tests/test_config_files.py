"""The config files under experiments/configs/ say only what differs from their base: each returns its
config class's defaults, or `derive(base, section={field: value, ...})` calls in which every value given
differs from the base's (a value equal to the base's is noise a reader must check). That the files
build the same configs as before they were written this way was checked once, value by value."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest

from experiments.cli import call_config_file
from respo_jax.training import config as training_config

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"
FILES = sorted(path for path in CONFIGS.glob("*.py") if not path.name.startswith("_"))
FUNCTIONS = ("get_config", "get_quick_config")


def _calls(path: pathlib.Path, function: str, monkeypatch) -> tuple[object, list]:
    """(the config `function` returns, every derive(base, **sections) call made while building it)."""
    calls = []
    real = training_config.derive

    def recording(base, **sections):
        calls.append((base, sections))
        return real(base, **sections)

    monkeypatch.setattr(training_config, "derive", recording)
    for name in [name for name in sys.modules if name.startswith("experiments.configs.")]:
        monkeypatch.delitem(sys.modules, name)  # files a config imports bind `derive` anew
    return call_config_file(str(path), function, f"config_under_test_{path.stem}"), calls


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_a_config_file_states_only_what_differs_from_its_base(path, monkeypatch):
    source = path.read_text(encoding="utf-8")
    functions = [function for function in FUNCTIONS if f"def {function}(" in source]
    assert functions, f"{path.name} defines no get_config()"
    for function in functions:
        config, calls = _calls(path, function, monkeypatch)
        if not calls:
            assert config == type(config)(), f"{path.name}:{function}() neither derives nor is the defaults"
            continue
        for base, sections in calls:
            for section, fields in sections.items():
                assert fields, f"{path.name}:{function}(): derive(..., {section}={{}}) changes nothing"
                for name, value in fields.items():
                    assert getattr(getattr(base, section), name) != value, \
                        f"{path.name}:{function}(): {section}.{name}={value!r} is the base's value already"


def test_derive_replaces_the_named_fields_and_refuses_unknown_ones():
    base = training_config.ExperimentConfig()
    derived = training_config.derive(base, rollout={"reuse": 8}, run={"iterations": 3})
    assert derived.rollout == dataclasses.replace(base.rollout, reuse=8)
    assert derived.run.iterations == 3 and derived.model == base.model and base.rollout.reuse == 4
    with pytest.raises(training_config.ConfigKeyError, match=r"unknown config section 'rollouts'"):
        training_config.derive(base, rollouts={"reuse": 8})
    with pytest.raises(training_config.ConfigKeyError, match=r"unknown config fields rollout\.\['reus'\]"):
        training_config.derive(base, rollout={"reus": 8})
