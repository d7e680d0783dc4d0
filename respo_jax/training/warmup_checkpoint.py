"""Checkpoints inside the supervised warm-up, so that a stop there loses nothing.

The warm-up has its own AdamW and its own stream of problems, so what resumes it exactly is the
parameters, that optimizer's state and the stream's random-generator state at the warm-up step reached.
They are saved in `checkpoints/warmup/<step>/`, in the verified format of the RL checkpoints
(respo_jax.training.checkpoint), with the count and digest of the metrics records they cover, so a
resume rewinds the log to them as it does for an RL checkpoint. A resume that finds no RL checkpoint
continues the warm-up from the newest intact one; the first RL checkpoint makes them obsolete, and
`discard` removes them then.
"""

from __future__ import annotations

import json
import os
import shutil

from respo_jax.distributed import is_primary_process
from respo_jax.training.checkpoint import Restored, restore_latest_intact, save_checkpoint
from respo_jax.training.config import ConfigError
from respo_jax.training.loop import RLTrainer
from respo_jax.training.warmup import WarmupPosition, warmup_opt_state_like

WARMUP_DIR = "warmup"  # inside the run's checkpoints/ (Orbax ignores a folder whose name is not a step)


def folder(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, WARMUP_DIR)


def save(trainer: RLTrainer, checkpoint_dir: str, metrics_records: int, metrics_sha256: str) -> str:
    """Saves the warm-up where it stands (after `trainer.warmup_position.step` steps, the log holding
    `metrics_records` records of digest `metrics_sha256`); returns the line saying what was kept."""
    position = trainer.warmup_position
    meta = {"iteration": 0, "warmup_step": position.step, "warmup_rng": json.dumps(position.rng_state),
            "metrics_records": metrics_records, "metrics_sha256": metrics_sha256}
    save_checkpoint(folder(checkpoint_dir), position.step, trainer.state.params, position.opt_state, meta)
    return describe(checkpoint_dir, position.step, trainer.config.warmup.steps)


def describe(checkpoint_dir: str, step: int, steps: int) -> str:
    return f"warm-up checkpoint at step {step} of {steps} saved in {folder(checkpoint_dir)}"


def restore(trainer: RLTrainer, checkpoint_dir: str) -> tuple[Restored | None, WarmupPosition | None]:
    """The newest intact warm-up checkpoint and the position it resumes the warm-up at ((None, None):
    none); the trainer's parameters are set to it."""
    restored = restore_latest_intact(folder(checkpoint_dir), trainer.state.params,
                                     warmup_opt_state_like(trainer))
    if restored is None:
        return None, None
    step = int(restored.meta["warmup_step"])
    if step > trainer.config.warmup.steps:
        raise ConfigError(f"warmup.steps={trainer.config.warmup.steps}: expected at least the {step} "
                          f"warm-up steps the run in {trainer.config.run.out_dir!r} has done")
    trainer.state.params = restored.params
    return restored, WarmupPosition(step, restored.opt_state, json.loads(restored.meta["warmup_rng"]))


def discard(checkpoint_dir: str) -> None:
    """Removes the warm-up checkpoints (process 0; called once an RL checkpoint is saved)."""
    if is_primary_process():
        shutil.rmtree(folder(checkpoint_dir), ignore_errors=True)
