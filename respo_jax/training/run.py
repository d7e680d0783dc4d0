"""A whole training run: `run(config)` trains an `ExperimentConfig` into its run directory (metrics
JSONL, curves, per-iteration rollout files, checkpoints) and returns the summary; `experiments.train` is
its command line, and a notebook calls it the same way.

Everything is checked before anything is written: the config, the run directory (one writer at a time,
see `run_lock`; a directory holding another run is refused without run.resume or run.overwrite, see
`run_dir`), the task data, the model, the limits and, on resume, the checkpoint and its log. A user error
raises `ConfigError` with nothing written; a run that fails after it started (NaN/inf, no intact
checkpoint, a damaged data file, a full disk) raises with its last good checkpoints kept.

A resume (`run.resume=true`) restores the latest intact checkpoint (a damaged one is set aside) and
rewinds metrics.jsonl to what that checkpoint counts, so the log is the one an uninterrupted run writes.
Checkpoints are saved every `run.checkpoint_every` iterations, every `run.checkpoint_every_minutes`, at
the end, and at a step boundary where SIGTERM / SIGINT asks the run to stop (`preemption`: the update in
flight finishes, a checkpoint is saved — in the warm-up a warm-up checkpoint, `warmup_checkpoint`, from
which a resume continues it — and `preemption.Preempted` is raised).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
from tqdm import tqdm

from respo_jax.distributed import initialize_from_env, is_primary_process, sync_processes
from respo_jax.eval.rollout_files import write_rollout_file
from respo_jax.host_allocator import configure_host_allocator, expected_platform
from respo_jax.models import qwen3
from respo_jax.sharding import bytes_per_device
from respo_jax.training import preemption, run_dir, warmup_checkpoint
from respo_jax.training.checkpoint import (CheckpointError, Restored, list_steps, restore_latest_intact,
                                           save_checkpoint, set_aside)
from respo_jax.training.compilation import configure_compilation_cache
from respo_jax.training.config import ConfigError, ExperimentConfig
from respo_jax.training.loop import RLTrainer
from respo_jax.training.plots import plot_training_curves
from respo_jax.training.run_lock import RunLock
from respo_jax.training.trackers import check_available, open_trackers, parse_loggers
from respo_jax.training.write_errors import writing


def run(config: ExperimentConfig) -> dict:
    """Trains `config` into its run.out_dir (checked first, see the module docstring); returns the summary
    (`summarize`). The same from a notebook as from the command line; `run.resume=true` continues the
    run the directory holds.

    Process 0 holds the directory's lock (respo_jax.training.run_lock) for the whole run: a second
    writer is refused in one line before it reads or writes anything, and the lock file is the first
    write, so an unwritable run.out_dir is refused here too (exit status 2)."""
    config = config.validate().check_paths()
    check_available(config.run.loggers)  # run.loggers' libraries (respo_jax.training.trackers)
    # Once, before the first JAX computation: join the other processes of a multi-process launch
    # (respo_jax.distributed), and on CPU keep XLA's host buffers mapped (respo_jax.host_allocator).
    try:
        initialize_from_env()
    except ValueError as err:
        raise ConfigError(f"multi-process launch: {err}") from None
    with preemption.handling():  # SIGTERM / SIGINT: stop at the next step boundary with a checkpoint
        preemption.stop_at_start()  # one that came while the program started: before the first write
        lock = _lock_run_dir(config.run.out_dir)
        try:
            return _run_locked(config)
        finally:
            if lock is not None:  # a refused start removes the directory it created (nothing else in it)
                lock.release(remove_if_created=True)


def _lock_run_dir(out_dir: str) -> RunLock | None:
    """Process 0's lock on `out_dir` (None in the other processes). In a multi-process run every process
    learns whether process 0 was refused, so that none of them goes on into a collective alone."""
    lock, refusal = None, None
    if is_primary_process():
        try:
            lock = RunLock.acquire(out_dir, "training")
        except ConfigError as err:
            refusal = err
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        refused = multihost_utils.process_allgather(np.array([refusal is not None], np.int32))
        if refusal is None and int(np.max(refused)):
            raise ConfigError(f"run.out_dir={out_dir!r}: process 0 could not take the run directory "
                              "(see its error); nothing was written")
    if refusal is not None:
        raise refusal
    return lock


def _run_locked(config: ExperimentConfig) -> dict:
    """`run` once the run directory is this process's (or process 0's) alone."""
    plan = run_dir.plan_run_dir(config)
    run_dir.check_writable(plan, parse_loggers(config.run.loggers))  # before anything is deleted or rewritten
    if config.run.host_allocator and expected_platform() == "cpu":
        configure_host_allocator()
    configure_compilation_cache(config.run.compilation_cache_dir)
    out_dir = config.run.out_dir
    checkpoint_dir = os.path.join(out_dir, run_dir.CHECKPOINT_DIR)
    trainer = RLTrainer(config, checked=True)  # checked at the start of `run`
    restored = _restore(trainer, checkpoint_dir) if plan.mode == "resume" else None
    warm, start = (None, None) if plan.mode != "resume" or restored else \
        warmup_checkpoint.restore(trainer, checkpoint_dir)  # stopped in the warm-up: it goes on from there
    kept = restored or warm  # the checkpoint the log is rewound to
    kept_records = kept.meta["metrics_records"] if kept else 0
    checked_log = None
    if plan.mode == "resume":  # a log that lacks records the checkpoint counts, or that another writer
        # mixed into (duplicated or out-of-order iterations), fails here, unchanged
        checked_log = run_dir.check_log(out_dir, kept_records, int(kept.meta["iteration"]) if kept else 0,
                                        kept.meta.get("metrics_sha256") if kept else None)

    # -- nothing was written above this line: a failed start leaves an existing run untouched ---------
    # Several processes (respo_jax.distributed) share out_dir: process 0 writes the run's files, all of
    # them write the checkpoints together (Orbax).
    primary = is_primary_process()
    info = run_info(trainer)  # a collective in a multi-process run: every process computes it
    if primary:
        with writing("the run's config.json and run_info.json", out_dir):
            run_dir.start_run_dir(plan, config)
            run_dir.atomic_write_json(os.path.join(out_dir, run_dir.RUN_INFO_FILE), info)
    sync_processes("run directory ready")
    records: list[dict] = []
    last_saved = None
    if restored is not None:
        s = trainer.state
        s.params, s.opt_state, last_saved = restored.params, restored.opt_state, restored.step
        s.reference = restored.reference  # None: the run keeps none, or the checkpoint predates it
        restore_counters(trainer, restored.meta)
        # asynchronous: the behaviour parameters of the rollouts in flight, regenerated by the first iteration
        trainer.restored_behaviour = None if restored.behaviour is None else list(restored.behaviour)
    # The damaged steps skipped, or, resuming from no checkpoint, the saves cut short before any finished:
    # moved aside so that the steps can be written again (one process moves the shared folders). The
    # warm-up's own folder likewise when the run resumes in the warm-up.
    folders = [(checkpoint_dir, restored)] + ([(warmup_checkpoint.folder(checkpoint_dir), warm)]
                                             if restored is None else [])
    for directory, found in folders if primary and plan.mode == "resume" else ():
        for step in found.damaged if found is not None else list_steps(directory):
            moved = set_aside(directory, step)
            print(f"moved damaged checkpoint step {step} to {moved}", file=sys.stderr)
    if plan.mode == "resume" and primary:  # the log as an uninterrupted run would have it at this checkpoint
        with writing("the rewound metrics.jsonl", out_dir):
            records = run_dir.rewind(out_dir, checked_log, trainer.state.iteration)
    show = config.run.progress and primary
    clock = preemption.Clock(config.run.checkpoint_every_minutes)
    trackers = open_trackers(config, info, records if plan.mode == "resume" else None, enabled=primary)
    # metrics.jsonl (process 0 writes it), its records and their running digest
    with run_dir.MetricsLog(out_dir if primary else None, records) as log, trackers, trainer:
        records = log.records

        def emit(record: dict) -> None:
            log.append(record)
            trackers.log(record)  # TensorBoard / W&B (run.loggers), process 0

        warm_kept = plan.mode == "resume"  # warm-up checkpoints may be on disk (discarded once RL saves)

        def checkpoint() -> None:
            nonlocal last_saved, warm_kept
            s = trainer.state
            trainer.ensure_reference()  # a run of no iteration still saves the reference it would use
            meta = dict(checkpoint_meta(trainer), metrics_records=len(records),
                        metrics_sha256=log.sha256())
            save_checkpoint(checkpoint_dir, s.iteration, s.params, s.opt_state, meta, reference=s.reference,
                            behaviour=behaviour_params(trainer))
            last_saved = s.iteration
            clock.reset()
            if warm_kept:
                warmup_checkpoint.discard(checkpoint_dir)
                warm_kept = False

        warm_saved = None if start is None else warmup_checkpoint.describe(checkpoint_dir, start.step,
                                                                           config.warmup.steps)

        def save_warmup() -> None:
            nonlocal warm_saved, warm_kept
            warm_kept = True
            warm_saved = warmup_checkpoint.save(trainer, checkpoint_dir, len(records), log.sha256())
            clock.reset()

        def boundary(where: str, save=checkpoint) -> None:
            """A step boundary: every process agrees on a stop a signal asks for and on a checkpoint the
            clock asks for (run.checkpoint_every_minutes); a stop `save`s this step and raises Preempted."""
            signum, due = preemption.stop_agreed(clock)
            if save and (signum or due) and last_saved != trainer.state.iteration:
                save()
            if signum:
                saved = (f"checkpoint step {last_saved} saved in {checkpoint_dir}" if last_saved is not None
                         else warm_saved or "no checkpoint yet (the resume starts from the beginning)")
                raise preemption.Preempted(f"{preemption.signal_name(signum)} {where}: {saved}",
                                           signum)

        def evaluate() -> None:
            held_out = trainer.evaluation()  # greedy, and sampled pass@1 with run.eval_samples
            if held_out is not None:
                emit({"phase": "eval", "policy_updates": trainer.state.policy_updates, **held_out})

        boundary("before its first step", save=None)
        if restored is None:
            # `with`: a bar is closed before a stop's one line is printed
            with tqdm(trainer.warmup(start), total=config.warmup.steps, initial=start.step if start else 0,
                      desc="warm-up", disable=not show) as steps:
                for record in steps:
                    emit(record)
                    boundary(f"after warm-up step {record['step']} of {config.warmup.steps}",
                             save=save_warmup)
            evaluate()
            boundary("after the warm-up and the first evaluation")  # checkpoint step 0
        remaining = config.num_iterations - trainer.state.iteration
        with tqdm(range(remaining), desc=f"{config.objective.name} N={config.rollout.reuse}",
                  disable=not show) as bar:
            for _ in bar:
                record = trainer.iteration()  # NonFiniteError before anything of a diverged step is kept
                if primary and trainer.last_rollout is not None:  # None: dynamic sampling kept no group
                    with writing(f"the rollout file of iteration {trainer.state.iteration}",
                                 os.path.join(out_dir, run_dir.ROLLOUT_DIR), run_dir.RESUME_HINT):
                        write_rollout_file(out_dir, trainer.last_rollout)  # rollouts/iteration_*.npz (E.3)
                emit(record)
                bar.set_postfix(score=f"{record['train_accuracy']:.3f}",
                                logW=f"{record.get('log_w_mean', 0.0):+.2f}",
                                len=f"{record['response_length']:.1f}")
                every = config.run.checkpoint_every
                if every and trainer.state.iteration % every == 0:
                    checkpoint()
                boundary(f"after RL iteration {trainer.state.iteration} of {config.num_iterations}")
        if last_saved != trainer.state.iteration:
            checkpoint()
        boundary("before the final evaluation")
        evaluate()  # after the last checkpoint: a resumed finished run re-evaluates instead of repeating it
        if preemption.requested() and primary:  # it came during the final evaluation, which finished
            print(f"{preemption.signal_name(preemption.requested())} came during the final evaluation: it "
                  "finished, and so did the run (nothing to resume)", file=sys.stderr)
    summary = summarize(records)
    if not primary:
        return summary
    with writing("the training curves and summary.json", out_dir):
        plot_path = plot_training_curves(records, os.path.join(out_dir, run_dir.CURVES_FILE),
                                         title=f"{config.objective.name}, N={config.rollout.reuse}")
        run_dir.atomic_write_json(os.path.join(out_dir, run_dir.SUMMARY_FILE), summary)
    trackers.finish(plot_path, trainer.state.policy_updates)
    print(json.dumps(summary, indent=2))
    print(f"metrics: {log.path}\ncurves:  {plot_path}")
    return summary


def _restore(trainer: RLTrainer, checkpoint_dir: str) -> Restored | None:
    """The latest intact checkpoint of the run being resumed (None: none yet), checked against the config."""
    s, config = trainer.state, trainer.config
    steps = config.rollout.async_steps  # asynchronous: k behaviour parameters in each checkpoint
    restored = restore_latest_intact(checkpoint_dir, s.params, s.opt_state,
                                     reference_like=s.params if config.objective.uses_reference else None,
                                     behaviour_like=[s.params] * steps if steps else None)
    if restored is None:
        return None
    if "metrics_records" not in restored.meta:
        raise CheckpointError(f"checkpoint step {restored.step} in {checkpoint_dir} has no metrics_records "
                              "(written by an older trainer); it cannot resume this run's log exactly")
    if restored.meta["iteration"] > config.num_iterations:
        length = (f"run.policy_updates={config.run.policy_updates}" if config.run.policy_updates
                  else f"run.iterations={config.run.iterations}")
        raise ConfigError(f"{length}: expected at least the {restored.meta['iteration']} iterations the run "
                          f"in {config.run.out_dir!r} has done")
    return restored


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


def run_info(trainer: RLTrainer) -> dict:
    """The run's devices, mesh and where the parameters live (written as run_info.json); a collective in
    a multi-process run: every process calls it."""
    params = trainer.state.params
    held = max(bytes_per_device(params).values())  # this process's devices
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        held = int(np.max(multihost_utils.process_allgather(np.array([held], np.int64))))
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    return {
        "devices": int(trainer.mesh.devices.size),
        "devices_available": jax.device_count(),
        "processes": jax.process_count(),
        "platform": qwen3.kernels.platform(trainer.mesh),
        "mesh": {name: int(size) for name, size in trainer.mesh.shape.items()},
        "param_bytes_total": int(total),
        "param_bytes_max_per_device": int(held),
        "kernels": {k: getattr(trainer.model_config, k)
                    for k in ("attention_impl", "moe_impl", "moe_dispatch")},
    }


def checkpoint_meta(trainer: RLTrainer) -> dict:
    """The JSON part of a checkpoint: counters, the prompt batches' resumable position (and the reward's
    KL weight with objective.kl_in_reward)."""
    s = trainer.state
    meta = {"iteration": s.iteration, "policy_updates": s.policy_updates,
            "batches": trainer.batches_position()}
    if trainer.config.objective.kl_in_reward:
        meta["kl_reward_coef"] = s.kl_reward_coef
    return meta


def restore_counters(trainer: RLTrainer, meta: dict) -> None:
    """A checkpoint's counters and prompt-stream position (`checkpoint_meta`) into `trainer`."""
    s = trainer.state
    s.iteration, s.policy_updates = int(meta["iteration"]), int(meta["policy_updates"])
    trainer.batches.set_state(meta["batches"])
    if trainer.config.objective.kl_in_reward:
        s.kl_reward_coef = float(meta["kl_reward_coef"])


def behaviour_params(trainer: RLTrainer) -> list | None:
    """The behaviour parameters of the rollout jobs in flight after this iteration (k entries, the current
    parameters for jobs not yet submitted), for a checkpoint; None for a synchronous run."""
    steps, s = trainer.config.rollout.async_steps, trainer.state
    if not steps:
        return None
    if trainer.async_rollouts is None:
        return list(trainer.restored_behaviour or [s.params] * steps)
    return trainer.async_rollouts.behaviour_params(s.iteration, s.params)
