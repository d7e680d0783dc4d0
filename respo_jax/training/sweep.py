"""A matched sweep of objectives x rollout-reuse ratios x seeds (paper §4.1-4.3 at any scale): its typed
config and the cells it runs. `experiments/gradient_starvation.py` is the shell that runs and reports it.

Every cell of a sweep shares the model, task, rollout sizes (M, G), optimizer, run length in policy
updates and one supervised base model; only the objective (by registry name, with its registry
defaults), N (`rollout.reuse`) and the RL seed (`run.seed`: sampling) change. The base model is the
warm-up of `sweep.base_seed` (the paper starts every run from one pretrained base model), written once
and loaded by every cell through `model.checkpoint_dir`.
"""

from __future__ import annotations

import dataclasses
import os
import re

from respo_jax.training.config import (
    ExperimentConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
    WarmupConfig,
    _Section,
    validate_sections,
)

BASE_DIR = "base"  # under sweep.runs_dir: the shared base model (Hugging Face format)
CELLS_DIR = "cells"  # under sweep.runs_dir: one training run directory per finished cell


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


@dataclasses.dataclass(frozen=True)
class SweepConfig(_Section):
    """What varies across cells, the run length and where things go.

    objectives, reuse, seeds: comma-separated lists (command line: `sweep.reuse=1,8,32`).
    policy_updates: every cell's length (a multiple of every N: the paper fixes 1,024 for every N).
    base_seed: the seed of the shared base model's initialisation and warm-up.
    runs_dir: the cells' run directories and the base model (large: not committed).
    out_dir: summary.json, summary.md and the figure (small: committed for the full sweep).
    compilation_cache: keep XLA's compiled programs in runs_dir/.jax_cache, so cells with the same
      shapes compile once across cells and restarts.
    """

    section = "sweep"
    objectives: str = "grpo,gspo,vespo,respo"
    reuse: str = "1,8,32"
    seeds: str = "0,1,2"
    policy_updates: int = 256
    base_seed: int = 0
    runs_dir: str = "runs/gradient_starvation"
    out_dir: str = "experiments/results/gradient_starvation"
    compilation_cache: bool = True

    @property
    def objective_list(self) -> list[str]:
        return self.objectives.split(",")

    @property
    def reuse_list(self) -> list[int]:
        return _int_list(self.reuse)

    @property
    def seed_list(self) -> list[int]:
        return _int_list(self.seeds)

    def validate(self) -> None:
        from respo_jax.objectives import OBJECTIVES

        self._check_types()
        names = self.objectives.split(",")
        self._need("objectives", all(n in OBJECTIVES for n in names) and len(set(names)) == len(names),
                   f"distinct comma-separated names from {sorted(OBJECTIVES)}")
        for name in ("reuse", "seeds"):
            value = getattr(self, name)
            self._need(name, bool(re.fullmatch(r"\d+(,\d+)*", value)), "comma-separated integers >= 0")
            self._need(name, len(set(_int_list(value))) == len(_int_list(value)), "distinct integers")
        self._need("reuse", min(self.reuse_list) >= 1, "integers >= 1")
        self._need("policy_updates", self.policy_updates >= 1 and all(
            self.policy_updates % n == 0 for n in self.reuse_list),
            f"a positive multiple of every N in sweep.reuse={self.reuse}")
        self._need("base_seed", 0 <= self.base_seed < 2**32, "an integer in [0, 2**32)")
        for name in ("runs_dir", "out_dir"):
            self._need(name, bool(getattr(self, name).strip()), "a directory path")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the sweep."""

    objective: str
    reuse: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.objective}_n{self.reuse}_seed{self.seed}"


@dataclasses.dataclass(frozen=True)
class StarvationConfig:
    """The sections every cell shares (those of `ExperimentConfig`, without `objective`: each cell takes
    its objective's registry defaults) plus `sweep`.

    Per cell, `experiment()` sets objective.name, rollout.reuse, run.seed, run.policy_updates,
    run.out_dir, model.checkpoint_dir (the base model) and warmup.steps=0; the `warmup` section and
    model.preset/overrides describe the base model (`base_experiment()`).
    """

    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    optim: OptimConfig = OptimConfig()
    warmup: WarmupConfig = WarmupConfig()
    run: RunConfig = RunConfig()
    sweep: SweepConfig = SweepConfig()

    def validate(self) -> "StarvationConfig":
        validate_sections(self)
        self.model._need("checkpoint_dir", not self.model.checkpoint_dir,
                         "'' (the sweep makes its base model from model.preset and the warm-up)")
        self.base_experiment().validate()
        for objective in self.sweep.objective_list:  # every (objective, N) must be a valid run
            for reuse in self.sweep.reuse_list:
                self.experiment(Cell(objective, reuse, self.sweep.seed_list[0])).validate()
        return self

    def cells(self) -> list[Cell]:
        """All cells, seed-major: every (objective, N) of the first seed before any of the next, so a sweep
        cut short still covers every setting."""
        s = self.sweep
        return [Cell(o, n, seed) for seed in s.seed_list for n in s.reuse_list for o in s.objective_list]

    @property
    def base_dir(self) -> str:
        return os.path.join(self.sweep.runs_dir, BASE_DIR)

    @property
    def compilation_cache_dir(self) -> str:
        """Every cell's and the base run's `run.compilation_cache_dir`: the sweep's own cache, or none."""
        if not self.sweep.compilation_cache:
            return "none"
        return os.path.abspath(os.path.join(self.sweep.runs_dir, ".jax_cache"))

    def cell_dir(self, cell: Cell) -> str:
        return os.path.join(self.sweep.runs_dir, CELLS_DIR, cell.name)

    def base_experiment(self) -> ExperimentConfig:
        """The warm-up run that makes the base model (its RL part is never run)."""
        return ExperimentConfig(
            model=self.model, task=self.task, rollout=self.rollout, optim=self.optim, warmup=self.warmup,
            run=dataclasses.replace(self.run, seed=self.sweep.base_seed, policy_updates=0, iterations=1,
                                    out_dir=self.base_dir, resume=False, overwrite=False,
                                    compilation_cache_dir=self.compilation_cache_dir),
        )

    def experiment(self, cell: Cell, out_dir: str | None = None) -> ExperimentConfig:
        """The training config of one cell, run into `out_dir` (default `cell_dir(cell)`); the base
        model's files are checked when the trainer starts (`check_paths`), not here."""
        return ExperimentConfig(
            model=dataclasses.replace(self.model, checkpoint_dir=os.path.abspath(self.base_dir), overrides={}),
            task=self.task,
            rollout=dataclasses.replace(self.rollout, reuse=cell.reuse),
            objective=ObjectiveConfig(name=cell.objective),
            optim=self.optim,
            warmup=dataclasses.replace(self.warmup, steps=0),
            run=dataclasses.replace(self.run, seed=cell.seed, policy_updates=self.sweep.policy_updates,
                                    out_dir=out_dir or self.cell_dir(cell), resume=False, overwrite=True,
                                    compilation_cache_dir=self.compilation_cache_dir),
        )
