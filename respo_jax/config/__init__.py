"""Typed configuration shared by every command: the leaf package that training and evaluation both import.

Modules:
  typed       the machinery: `ConfigError` (one line naming key, value and what is allowed), the section
              base with its type checks, `validate_sections`, the `section.field=value` parser
              (`apply_overrides`), the loader of a config's `to_dict()` form (`config_from_dict`) and
              `derive` (a config file's changes to its base)
  engine      the rollout engine's fields, declared once for `rollout.*` and `eval.*` (`EngineSection`),
              with the defaults training and evaluation choose and why
  mesh        the device mesh section `mesh.*` (`MeshSection`)
  experiment  a training run's sections and `ExperimentConfig` (also named `respo_jax.training.config`)

The evaluation's sections are `respo_jax.eval.config` (`EvalConfig`), on top of `engine` and `mesh`. This
package imports nothing else of respo_jax at import time; its checks read the model presets, the task,
the objectives, the rewards and the sampler's constants when they run, never training or evaluation.
"""

from respo_jax.config.engine import (
    ENGINE_FIELDS,
    EVAL_ENGINE_DEFAULTS,
    ROLLOUT_ENGINE_DEFAULTS,
    EngineSection,
)
from respo_jax.config.experiment import (
    ExperimentConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    WarmupConfig,
)
from respo_jax.config.mesh import MeshSection
from respo_jax.config.typed import (
    ConfigError,
    ConfigKeyError,
    apply_overrides,
    config_from_dict,
    derive,
    validate_sections,
)

__all__ = [
    "ENGINE_FIELDS", "EVAL_ENGINE_DEFAULTS", "ROLLOUT_ENGINE_DEFAULTS", "ConfigError", "ConfigKeyError",
    "EngineSection", "ExperimentConfig", "MeshSection", "ModelConfig", "ObjectiveConfig", "OptimConfig",
    "RolloutConfig", "RunConfig", "TaskConfig", "WarmupConfig", "apply_overrides", "config_from_dict",
    "derive", "validate_sections",
]
