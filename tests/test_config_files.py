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


def test_the_engine_fields_are_declared_once_for_rollout_and_eval():
    """`rollout.*` and `eval.*` take the engine's fields from `EngineSection` (their class bodies declare
    none of them: the comments, the checks and the mapping to `EngineConfig` are one), and differ only in
    the defaults each states with its reasons."""
    import ast
    import inspect
    import textwrap

    from respo_jax.config.engine import (ENGINE_FIELDS, EVAL_ENGINE_DEFAULTS, ROLLOUT_ENGINE_DEFAULTS,
                                         EngineSection)
    from respo_jax.eval.config import EvalSettings

    for cls, changed in ((training_config.RolloutConfig, ROLLOUT_ENGINE_DEFAULTS),
                         (EvalSettings, EVAL_ENGINE_DEFAULTS)):
        assert issubclass(cls, EngineSection)
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        declared = {node.target.id for node in body if isinstance(node, ast.AnnAssign)}
        assert not declared & set(ENGINE_FIELDS), sorted(declared & set(ENGINE_FIELDS))
        section = cls()
        for name in ENGINE_FIELDS:
            assert getattr(section, name) == changed.get(name, getattr(EngineSection(), name)), name
        engine = section.engine_config()
        assert (engine.max_slots, engine.page_size, engine.prompt_bucket) == \
            (section.max_slots, section.page_size, section.prompt_bucket)
    with pytest.raises(TypeError, match="engine_defaults names 'slots', not an engine field"):
        class Wrong(EngineSection, engine_defaults={"slots": 3}):  # noqa: F841
            pass
