"""The training run's typed configuration, under the name the config files, notebooks and docs import it by.

The classes live in the leaf package `respo_jax.config` (`experiment`: the sections of a run and
`ExperimentConfig`; `typed`: the machinery; `engine`, `mesh`: the sections shared with the evaluation),
which training and evaluation both import; every name is the same object here.
"""

# Every name below is imported to be named here (the classes are documented under respo_jax.config).
from respo_jax.config.engine import ROLLOUT_ENGINE_DEFAULTS, EngineSection  # noqa: F401
from respo_jax.config.experiment import (  # noqa: F401
    MAX_STEPS,
    OLD_LOGPROBS,
    TRACKERS,
    ExperimentConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    WarmupConfig,
    parse_loggers,
)
from respo_jax.config.mesh import MeshSection  # noqa: F401
from respo_jax.config.typed import (  # noqa: F401
    ConfigError,
    ConfigKeyError,
    _Section,
    apply_overrides,
    config_from_dict,
    derive,
    validate_sections,
)

