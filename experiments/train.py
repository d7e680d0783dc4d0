"""Main job: train a policy with an RL objective and write metrics (JSONL), curves (PNG), per-iteration
rollout files (rollouts/iteration_*.npz: per-response log W, advantage, length, phi, reward) and a checkpoint.
The command line of `respo_jax.training.run.run` (which a notebook calls directly): arguments, one-line
errors, exit statuses.

    python -m experiments.train                                    # the default ReSPO CPU experiment
    python -m experiments.train objective.name=grpo rollout.reuse=8 run.out_dir=runs/grpo_n8
    python -m experiments.train --config experiments/configs/respo_synthetic.py run.iterations=10
    python -m experiments.train --config experiments/configs/qwen3_1p7b_dapo.py \
        model.checkpoint_dir=/ckpt/Qwen3-1.7B-Base task.data_dir=/data task.tokenizer_dir=/ckpt/Qwen3-1.7B-Base
    python -m experiments.train run.resume=true                    # continue a killed or finished run
    python -m experiments.train run.overwrite=true                 # replace the run in run.out_dir
    python -m experiments.train run.loggers=jsonl,tensorboard,wandb  # also to TensorBoard and W&B

Everything is checked before anything is written: the config, the run directory (one writer at a time,
see respo_jax.training.run_lock; a directory holding another run is refused without run.resume or
run.overwrite, see respo_jax.training.run_dir), the task data, the model, the limits (response length
against the model's positions, the sampler's memory) and, on resume, the checkpoint and its log. A
user error prints one line to stderr and exits with status 2 (nothing written); a run that fails after
it started (NaN/inf, no intact checkpoint, a damaged data file, a full disk) prints one line and exits
with status 1, its last good checkpoints kept.

SIGTERM (a preemptible VM, Slurm, Kubernetes) or SIGINT (Ctrl-C) stops the run at the next step
boundary (respo_jax.training.preemption): the policy update in flight finishes, a checkpoint is saved at
that iteration, the logs and trackers are closed, one line on stderr says what was kept and the command
that resumes it, and the exit status is 143 (SIGTERM) or 130 (SIGINT); a second signal exits at once.
A signal during the warm-up stops after the warm-up step in flight with a warm-up checkpoint
(respo_jax.training.warmup_checkpoint), from which the resume continues the warm-up; one while the
program imports stops it before it writes anything; one during the final evaluation lets it finish, and
the run ends normally (exit status 0) with a line saying so.
`run.checkpoint_every_minutes` adds time-based checkpoints, which bound what a hard kill loses.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import experiments.signals_at_start  # noqa: F401  (first: a signal during the imports below stops cleanly)

from experiments.cli import (  # noqa: F401 - the config-file readers, importable from here too
    ArgumentParser,
    call_config_file,
    config_file_error,
    load_config,
    run_cli,
    run_failures,
)
from respo_jax.training import preemption
from respo_jax.training.config import apply_overrides
from respo_jax.training.run import run as run_experiment
from respo_jax.training.run import summarize  # noqa: F401 - re-exported for this module's callers

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "respo_synthetic.py")


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    try:
        return run_experiment(apply_overrides(load_config(args.config), args.overrides))
    except preemption.Preempted as err:
        raise preemption.Preempted(f"{err}; resume: {resume_command(args.config, args.overrides)}",
                                   err.signum) from None


def resume_command(config_path: str, overrides: list[str]) -> str:
    """The command line that resumes the run `config_path` with `overrides` describes."""
    dropped = ("run.resume", "run.overwrite")
    kept = [item for item in overrides if item.split("=", 1)[0].strip() not in dropped]
    config = [] if config_path == DEFAULT_CONFIG else ["--config", config_path]
    return shlex.join(["python", "-m", "experiments.train", *config, *kept, "run.resume=true"])


def cli(argv: list[str]) -> int:
    """`main` for the command line: a user error (including a run-directory refusal; nothing written)
    exits with status 2, a run that fails after it started with status 1, each with one line on stderr."""
    return run_cli(main, argv, failures=run_failures())


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
