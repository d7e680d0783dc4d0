"""The programs a run compiles before its first rollout, and the keys that let a relaunch reuse them.

`compile_ahead` lowers and compiles the sampler's programs and the mini-batch's log π_old and update
programs for every prompt bucket of the training prompts (`rollout.compile_ahead`), so a batch whose
longest prompt first reaches a bucket does not stop a later iteration to compile (seconds per program at
the real vocabulary). With a warm compilation cache that holds this configuration's record, nothing is
compiled ahead: each program is read from the cache when first needed. `program_cache` is where the
update step keeps its traced programs for the next launch (`respo_jax.exported_programs`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from typing import Callable

import jax
import numpy as np
from flax import nnx

from respo_jax.exported_programs import ProgramCache
from respo_jax.models import qwen3
from respo_jax.objectives import BUILTIN_OBJECTIVES
from respo_jax.sampling import compile_generate
from respo_jax.training.compilation import cache_holds_compile_ahead, compiled_ahead_key, record_compile_ahead
from respo_jax.training.config import ExperimentConfig
from respo_jax.training.shapes import ShapeTracker
from respo_jax.training.step import old_logprobs_from_update


def program_config(config: ExperimentConfig) -> dict:
    """The config's sections that shape a run's programs, JSON-able: every section but the run's
    bookkeeping (paths, seeds, length, logging, evaluation) and the warm-up, with the learning-rate
    warm-up length, the one thing the run's length changes in a program (`optim.warmup_ratio` of the
    policy updates)."""
    sections = config.to_dict()
    task = sections.pop("task")
    sections.pop("run")
    sections.pop("warmup")
    sections["task"] = {key: value for key, value in task.items() if key != "seed"}
    sections["lr_warmup_steps"] = config.lr_warmup_steps
    return sections


def compile_ahead_key(config: ExperimentConfig, shapes: ShapeTracker) -> str:
    """The key of a run's compile-ahead in the compilation cache (`compiled_ahead_key`): the config's
    `program_config` and the prompt buckets; a relaunch with more iterations or another seed reads the
    same programs."""
    return compiled_ahead_key({"config": program_config(config), "prompt_buckets": shapes.prompt_buckets()})


def program_cache(config: ExperimentConfig, model_config: qwen3.Qwen3Config) -> ProgramCache | None:
    """Where the update step keeps its traced programs (`respo_jax.exported_programs`, a later launch
    reads them instead of tracing them): the compilation cache's directory, keyed by the config's
    `program_config` and the model's config (read from the checkpoint). None without a compilation
    cache, with run.export_programs=false, on several devices or processes, or with an objective
    registered outside respo_jax (its code is not part of the key)."""
    directory = jax.config.jax_compilation_cache_dir
    if (not directory or not config.run.export_programs or not ProgramCache.usable()
            or config.objective.name not in BUILTIN_OBJECTIVES):
        return None
    return ProgramCache(directory, json.dumps({"config": program_config(config),
                                               "model": dataclasses.asdict(model_config)},
                                              sort_keys=True, default=str))


def compile_ahead(trainer) -> int:
    """Compiles `trainer`'s (an `RLTrainer`) sampler, log π_old and update programs for every prompt
    bucket of the training prompts, with responses at the longest response bucket; returns the number
    of buckets (0: skipped, the cache holds them). A mini-batch whose responses all end early (a smaller
    response bucket) still compiles when it first occurs. Nothing runs: the programs are lowered from
    the shapes and shardings of placeholder batches built as the trainer's `BatchLayout` builds real
    ones."""
    key = compile_ahead_key(trainer.config, trainer.shapes)
    if cache_holds_compile_ahead(key):  # a warm cache: each program is read when first needed
        trainer.shapes.skip_compile_ahead()
        print("compile-ahead skipped: the compilation cache holds this configuration's programs "
              f"(record {key[:12]}); each is read from it when first needed", file=sys.stderr)
        return 0
    model = trainer.model()
    buckets = trainer.shapes.compile_ahead(lambda prompt_len: compile_bucket(trainer, model, prompt_len))
    record_compile_ahead(key)
    return buckets


def _collected_compile(name: str, lowered):
    """`lowered.compile()` after a garbage collection. Why: tracing and lowering a program leave reference
    cycles (tracers, Flax's traversals, the lowered modules of the programs before) that hold their
    intermediate representation until Python's collector next runs; freed here, they do not stay
    resident beside what XLA allocates to compile this program, whatever the collector's timing."""
    gc.collect()
    return lowered.compile()


def compile_bucket(trainer, model: nnx.Module, prompt_len: int, compile: Callable | None = None) -> None:
    """`compile_ahead` of one prompt bucket of `prompt_len` tokens. `compile(name, lowered) -> compiled`
    compiles each program (default `lowered.compile()`; `respo_jax.training.aot` keeps them)."""
    compile = compile or _collected_compile
    config, r, pad_id = trainer.config, trainer.config.rollout, trainer.tokenizer.pad_id
    rows = r.prompts_per_minibatch * r.group_size
    responses = np.full((rows, r.max_new_tokens), pad_id, np.int32)
    lengths = np.full(rows, r.max_new_tokens, np.int32)
    compile_generate(model, prompt_len, r.reuse * r.prompts_per_minibatch, trainer.sampling_params(0),
                     engine=trainer.engine, return_routing=r.routing_replay,
                     compile=compile)
    routing = None
    if r.routing_replay:
        cfg = trainer.model_config
        routing = tuple(np.zeros((cfg.num_moe_layers, rows, length, cfg.num_experts_per_tok), np.int32)
                        for length in (prompt_len, r.max_new_tokens))
    sampler_logp = np.zeros(responses.shape, np.float32) if trainer.correction else None
    batch, micro = trainer.layout.policy_batch([[pad_id] * prompt_len] * rows, responses, lengths,
                                               np.zeros(rows, np.float32), routing, sampler_logp)
    state, objective = trainer.state, config.objective
    from_update = old_logprobs_from_update(config, trainer.old_logprobs_source)
    recomputed = trainer.old_logprobs_source == "recompute" and not (from_update and r.reuse == 1)
    if recomputed or objective.uses_reference or objective.decoupled:
        compile("log_pi_old", trainer.old_logprobs.lower(state.params, batch, micro))
    if objective.uses_reference:  # the update's batches carry the reference's log-probs
        batch = batch.replace(ref_logp=batch.old_logp)
    if objective.decoupled:  # and the behaviour policy's
        batch = batch.replace(behaviour_logp=batch.old_logp)
    compile("update_step", trainer.policy_step.lower(state.params, state.opt_state, batch, micro))
    if from_update:  # the first update of a rollout batch, log π_old from its own forward
        compile("update_step_old_logprobs",
                trainer.policy_step.lower(state.params, state.opt_state, batch.replace(old_logp=None), micro))
