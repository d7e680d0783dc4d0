"""The staleness experiment (`python -m experiments.async_staleness`): the default synthetic task and
tiny Qwen3 of `respo_synthetic.py` at N = 4 (its 80-step warm-up), shortened to 48 iterations (192
policy updates) so that the whole grid fits in about 25 minutes of one shared CPU core; every cell
overrides objective.name, rollout.async_steps and run.seed (the grid is
`experiments.async_staleness.GRID`)."""

from experiments.configs.respo_synthetic import get_config as default_config
from respo_jax.training.config import derive


def get_config():
    return derive(default_config(), run={"iterations": 48, "eval_problems": 0, "progress": False,
                                         "out_dir": "runs/async_staleness",
                                         "compilation_cache_dir": "runs/jit_cache"})
