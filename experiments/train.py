"""Main job: train a policy with an RL objective and write metrics (JSONL), curves (PNG), per-iteration
rollout files (rollouts/iteration_*.npz: per-response log W, advantage, length, phi, reward) and a checkpoint.

    python -m experiments.train                                    # the default ReSPO CPU experiment
    python -m experiments.train objective.name=grpo rollout.reuse=8 run.out_dir=runs/grpo_n8
    python -m experiments.train --config experiments/configs/respo_synthetic.py run.iterations=10
    python -m experiments.train --config experiments/configs/qwen3_1p7b_dapo.py \
        model.checkpoint_dir=/ckpt/Qwen3-1.7B-Base task.data_dir=/data task.tokenizer_dir=/ckpt/Qwen3-1.7B-Base
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from tqdm import tqdm

from respo_jax.eval.rollout_files import write_rollout_file
from respo_jax.host_allocator import configure_host_allocator
from respo_jax.training.checkpoint import restore_checkpoint, save_checkpoint
from respo_jax.training.config import ExperimentConfig, apply_overrides
from respo_jax.training.loop import RLTrainer
from respo_jax.training.plots import plot_training_curves

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "respo_synthetic.py")


def load_config(path: str, expected: type = ExperimentConfig):
    """Imports a config file and calls its `get_config()`, which must return an `expected` instance
    (`ExperimentConfig` for training, `respo_jax.eval.config.EvalConfig` for evaluation)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location("experiment_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"config file {path!r} has no get_config()")
    config = module.get_config()
    if not isinstance(config, expected):
        raise TypeError(f"{path}: get_config() returned {type(config).__name__}, expected {expected.__name__}")
    return config


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    config = apply_overrides(load_config(args.config), args.overrides)
    if config.run.host_allocator:  # before the first JAX computation starts XLA's threads
        configure_host_allocator()
    out_dir = config.run.out_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)

    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    trainer = RLTrainer(config)
    checkpoint_dir = os.path.join(out_dir, "checkpoints")
    resumed = config.run.resume and os.path.isdir(checkpoint_dir)
    if resumed:
        s = trainer.state
        s.params, s.opt_state, meta = restore_checkpoint(checkpoint_dir, s.params, s.opt_state)
        trainer.restore_meta(meta)
    records: list[dict] = []
    if resumed and os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    show = config.run.progress
    with open(metrics_path, "a" if resumed else "w") as log:

        def emit(record: dict) -> None:
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()

        def evaluate() -> None:
            accuracy = trainer.evaluate()
            if accuracy is not None:
                emit({"phase": "eval", "policy_updates": trainer.state.policy_updates, "greedy_accuracy": accuracy})

        if not resumed:
            for record in tqdm(trainer.warmup(), total=config.warmup.steps, desc="warm-up", disable=not show):
                emit(record)
            evaluate()
        remaining = config.num_iterations - trainer.state.iteration
        bar = tqdm(range(remaining), desc=f"{config.objective.name} N={config.rollout.reuse}", disable=not show)
        for _ in bar:
            record = trainer.iteration()
            write_rollout_file(out_dir, trainer.last_rollout)  # rollouts/iteration_*.npz (App. E.3)
            emit(record)
            bar.set_postfix(score=f"{record['train_accuracy']:.3f}", logW=f"{record.get('log_w_mean', 0.0):+.2f}",
                            len=f"{record['response_length']:.1f}")
            every = config.run.checkpoint_every
            if every and trainer.state.iteration % every == 0:
                _checkpoint(trainer, checkpoint_dir)
        evaluate()
    _checkpoint(trainer, checkpoint_dir)
    plot_path = plot_training_curves(records, os.path.join(out_dir, "training_curves.png"),
                                     title=f"{config.objective.name}, N={config.rollout.reuse}")
    summary = summarize(records)
    print(json.dumps(summary, indent=2))
    print(f"metrics: {metrics_path}\ncurves:  {plot_path}")
    return summary


def _checkpoint(trainer: RLTrainer, checkpoint_dir: str) -> None:
    s = trainer.state
    save_checkpoint(checkpoint_dir, s.iteration, s.params, s.opt_state, trainer.checkpoint_meta())


def summarize(records: list[dict]) -> dict:
    """First/last training accuracy (means over the first and last quarter of iterations) and greedy evals."""
    rl = [r for r in records if r["phase"] == "rl"]
    evals = [r["greedy_accuracy"] for r in records if r["phase"] == "eval"]
    quarter = max(1, len(rl) // 4)
    return {
        "iterations": len(rl),
        "policy_updates": rl[-1]["policy_updates"] if rl else 0,
        "train_accuracy_first_quarter": sum(r["train_accuracy"] for r in rl[:quarter]) / quarter if rl else None,
        "train_accuracy_last_quarter": sum(r["train_accuracy"] for r in rl[-quarter:]) / quarter if rl else None,
        "greedy_accuracy_before": evals[0] if evals else None,
        "greedy_accuracy_after": evals[-1] if evals else None,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
