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

    The second study adds, each empty or off by default (the first study's sweep):
    learning_rates: a step-size grid; each lr runs policy_updates * max(lr) / lr updates (lr x updates
      fixed; policy_updates is the count at the largest lr), and optim.learning_rate is the common lr.
    on_policy_objectives: the objectives run at N = 1 ('' : all; at N = 1 W = 1, so GRPO, VESPO and
      ReSPO give one gradient and one of them stands for all).
    selection_seed: a seed (not among `seeds`) run over the lr grid to choose each method's best lr
      (`select_learning_rate`) before the report seeds are looked at; -1: none.
    controls: objectives (e.g. registered with `kernel_objective`) run only at the largest N, at the
      common lr and at their own best lr.
    long_difficulty: a task.difficulty for the long-response regime ('' : none), with its own base model;
      long_max_new_tokens its rollout cap, long_reuse and long_seeds its N and seeds, run for every
      objective at its best lr of the largest N.
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
    learning_rates: str = ""
    on_policy_objectives: str = ""
    selection_seed: int = -1
    controls: str = ""
    long_difficulty: str = ""
    long_max_new_tokens: int = 0  # the long-response regime's rollout cap (>= 1 when long_difficulty is set)
    long_reuse: str = "8,32"  # the long-response regime's N values
    long_seeds: str = "0,1,2"  # the long-response regime's seeds

    @property
    def objective_list(self) -> list[str]:
        return self.objectives.split(",")

    @property
    def control_list(self) -> list[str]:
        return self.controls.split(",") if self.controls else []

    @property
    def on_policy_list(self) -> list[str]:
        return self.on_policy_objectives.split(",") if self.on_policy_objectives else self.objective_list

    @property
    def learning_rate_list(self) -> list[float]:
        return [float(item) for item in self.learning_rates.split(",")] if self.learning_rates else []

    @property
    def long_reuse_list(self) -> list[int]:
        return _int_list(self.long_reuse)

    @property
    def long_seed_list(self) -> list[int]:
        return _int_list(self.long_seeds)

    def updates_for(self, learning_rate: float) -> int:
        """The run length at `learning_rate`: lr x updates as at the largest lr of the grid."""
        if not self.learning_rate_list:
            return self.policy_updates
        return round(self.policy_updates * max(self.learning_rate_list) / learning_rate)

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
        self._validate_second_study(OBJECTIVES)

    def _validate_second_study(self, objectives) -> None:
        number = r"\d+(\.\d*)?([eE][+-]?\d+)?"
        self._need("learning_rates", not self.learning_rates or bool(re.fullmatch(
            rf"{number}(,{number})*", self.learning_rates)) and all(lr > 0 for lr in self.learning_rate_list)
            and len(set(self.learning_rate_list)) == len(self.learning_rate_list),
            "'' or distinct comma-separated numbers > 0")
        if self.long_difficulty:
            self._need("long_reuse", bool(re.fullmatch(r"\d+(,\d+)*", self.long_reuse))
                       and min(self.long_reuse_list) >= 1, "comma-separated integers >= 1")
            self._need("long_seeds", bool(re.fullmatch(r"\d+(,\d+)*", self.long_seeds)),
                       "comma-separated integers >= 0")
        reuses = {*self.reuse_list, *(self.long_reuse_list if self.long_difficulty else ())}
        for lr in self.learning_rate_list:
            updates = self.policy_updates * max(self.learning_rate_list) / lr
            self._need("learning_rates", abs(updates - round(updates)) < 1e-6 and all(
                round(updates) % n == 0 for n in reuses),
                f"rates whose policy_updates * max(lr) / lr is a multiple of every N (lr {lr:g} gives "
                f"{updates:g})")
        for name, names in (("on_policy_objectives", self.on_policy_list), ("controls", self.control_list)):
            self._need(name, all(n in objectives for n in names) and len(set(names)) == len(names),
                       f"'' or distinct comma-separated names from {sorted(objectives)}")
        self._need("on_policy_objectives", set(self.on_policy_list) <= set(self.objective_list),
                   f"a subset of sweep.objectives={self.objectives}")
        self._need("controls", not set(self.control_list) & set(self.objective_list),
                   "objectives not in sweep.objectives")
        self._need("selection_seed", self.selection_seed == -1 or (
            0 <= self.selection_seed < 2**32 and self.selection_seed not in self.seed_list),
            "-1 (none) or an integer in [0, 2**32) not in sweep.seeds")
        self._need("selection_seed", self.selection_seed >= 0 or not (
            self.control_list or self.long_difficulty),
            "a seed: sweep.controls and sweep.long_difficulty run at each method's selected lr")
        self._need("learning_rates", bool(self.learning_rates) or self.selection_seed < 0,
                   "a grid to select from when sweep.selection_seed is set")
        if self.long_difficulty:
            from respo_jax.data.synthetic import DIFFICULTIES

            self._need("long_difficulty", self.long_difficulty in DIFFICULTIES,
                       f"'' or a synthetic difficulty from {sorted(DIFFICULTIES)}")
            self._need("long_max_new_tokens", self.long_max_new_tokens >= 1, "an integer >= 1")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the sweep: learning_rate 0 is optim.learning_rate at sweep.policy_updates (the first
    study's cells, named as before); regime "long" is the long-response regime."""

    objective: str
    reuse: int
    seed: int
    learning_rate: float = 0.0
    regime: str = ""

    @property
    def name(self) -> str:
        name = f"{self.objective}_n{self.reuse}_seed{self.seed}"
        if self.learning_rate:
            name += f"_lr{self.learning_rate:g}"
        return f"{self.regime}_{name}" if self.regime else name


def select_learning_rate(late_means: dict[float, float | None]) -> float | None:
    """The selection rule, fixed before any report seed is run: the lr whose run on the selection seed
    has the highest late-mean training score; a tie (within 1e-9) goes to the smaller lr, a run without
    a late mean never wins. None when no run has one."""
    scored = [(lr, value) for lr, value in late_means.items() if value is not None]
    if not scored:
        return None
    best = max(value for _, value in scored)
    return min(lr for lr, value in scored if value >= best - 1e-9)


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
        s = self.sweep
        for objective in s.objective_list + s.control_list:  # every (objective, N) must be a valid run
            for reuse in s.reuse_list:
                self.experiment(Cell(objective, reuse, s.seed_list[0])).validate()
        for lr in s.learning_rate_list:
            self.experiment(Cell(s.objective_list[0], s.reuse_list[0], s.seed_list[0], lr)).validate()
        if s.long_difficulty:
            self.base_experiment("long").validate()
            for reuse in s.long_reuse_list:
                self.experiment(Cell(s.objective_list[0], reuse, s.seed_list[0], 0.0, "long")).validate()
        return self

    def cells(self, best: dict[tuple[str, int], float] | None = None) -> list[Cell]:
        """All cells, seed-major: every (objective, N) of the first seed before any of the next, so a sweep
        cut short still covers every setting.

        With sweep.learning_rates (the second study), in the order they run: (1) the selection seed over
        the lr grid at the largest N (objectives and controls), (2) the report seeds over the grid at the
        largest N, (3) the controls at the common lr, then at their best lr, (4) the long regime at each
        objective's best lr of the largest N, (5) N < largest: selection seed, then report seeds. `best` maps
        (objective, N) to its selected lr (`select_learning_rate`); cells that need one it lacks are left
        out (they are listed once the selection cells have finished)."""
        s = self.sweep
        if not s.learning_rates:
            return [Cell(o, n, seed) for seed in s.seed_list for n in s.reuse_list for o in s.objective_list]
        best = best or {}
        largest, lrs = max(s.reuse_list), sorted(s.learning_rate_list, reverse=True)  # cheapest first
        selection = [s.selection_seed] if s.selection_seed >= 0 else []

        def grid(seeds, reuse, objectives):
            return [Cell(o, reuse, seed, lr) for seed in seeds for o in objectives for lr in lrs]

        cells = grid(selection, largest, s.objective_list + s.control_list)
        cells += grid(s.seed_list, largest, s.objective_list)
        common = self.optim.learning_rate
        cells += [Cell(o, largest, seed, common) for seed in s.seed_list for o in s.control_list]
        cells += [Cell(o, largest, seed, best[(o, largest)]) for seed in s.seed_list for o in s.control_list
                  if (o, largest) in best]
        if s.long_difficulty:
            cells += [Cell(o, n, seed, best[(o, largest)], "long") for seed in s.long_seed_list
                      for n in s.long_reuse_list for o in s.objective_list if (o, largest) in best]
        for reuse in sorted(set(s.reuse_list) - {largest}, reverse=True):
            objectives = s.on_policy_list if reuse == 1 else s.objective_list
            cells += grid(selection, reuse, objectives) + grid(s.seed_list, reuse, objectives)
        return list(dict.fromkeys(cells))  # a control's best lr may be the common one

    @property
    def base_dir(self) -> str:
        return os.path.join(self.sweep.runs_dir, BASE_DIR)

    def regime_base_dir(self, regime: str) -> str:
        """The base model of a regime: `base_dir`, or base_long/ for the long-response regime."""
        return f"{self.base_dir}_{regime}" if regime else self.base_dir

    def regime_sections(self, regime: str) -> tuple[TaskConfig, RolloutConfig]:
        """The task and rollout sections of a regime (the long one: sweep.long_difficulty and its cap)."""
        if not regime:
            return self.task, self.rollout
        return (dataclasses.replace(self.task, difficulty=self.sweep.long_difficulty),
                dataclasses.replace(self.rollout, max_new_tokens=self.sweep.long_max_new_tokens))

    @property
    def compilation_cache_dir(self) -> str:
        """Every cell's and the base run's `run.compilation_cache_dir`: the sweep's own cache, or none."""
        if not self.sweep.compilation_cache:
            return "none"
        return os.path.abspath(os.path.join(self.sweep.runs_dir, ".jax_cache"))

    def cell_dir(self, cell: Cell) -> str:
        return os.path.join(self.sweep.runs_dir, CELLS_DIR, cell.name)

    def base_experiment(self, regime: str = "") -> ExperimentConfig:
        """The warm-up run that makes the base model of `regime` (its RL part is never run)."""
        task, rollout = self.regime_sections(regime)
        return ExperimentConfig(
            model=self.model, task=task, rollout=rollout, optim=self.optim, warmup=self.warmup,
            run=dataclasses.replace(self.run, seed=self.sweep.base_seed, policy_updates=0, iterations=1,
                                    out_dir=self.regime_base_dir(regime), resume=False, overwrite=False,
                                    compilation_cache_dir=self.compilation_cache_dir),
        )

    def experiment(self, cell: Cell, out_dir: str | None = None) -> ExperimentConfig:
        """The training config of one cell, run into `out_dir` (default `cell_dir(cell)`); the base
        model's files are checked when the trainer starts (`check_paths`), not here."""
        task, rollout = self.regime_sections(cell.regime)
        optim, updates = self.optim, self.sweep.policy_updates
        if cell.learning_rate:
            optim = dataclasses.replace(optim, learning_rate=cell.learning_rate)
            updates = self.sweep.updates_for(cell.learning_rate)
        base_dir = os.path.abspath(self.regime_base_dir(cell.regime))
        return ExperimentConfig(
            model=dataclasses.replace(self.model, checkpoint_dir=base_dir, overrides={}),
            task=task,
            rollout=dataclasses.replace(rollout, reuse=cell.reuse),
            objective=ObjectiveConfig(name=cell.objective),
            optim=optim,
            warmup=dataclasses.replace(self.warmup, steps=0),
            run=dataclasses.replace(self.run, seed=cell.seed, policy_updates=updates,
                                    out_dir=out_dir or self.cell_dir(cell), resume=True, overwrite=False,
                                    compilation_cache_dir=self.compilation_cache_dir),
        )
