"""The RL loop of paper §4.1 at any scale: sample a rollout batch, score it, reuse it for N updates.

One iteration = `reuse * prompts_per_minibatch` prompts × `group_size` responses from the jitted
sampler, the task's reward (strict box by default), group-normalized advantages, log π_old recomputed
by a forward pass of the rollout-time parameters (at the rollout temperature, with the entropy of the
full distribution), then `reuse` (N) mini-batch updates of the chosen objective — consecutive, or in
verl's length-balanced order.
This module is the thin shell around the pure parts: it owns the loop (`RLTrainer.iteration`, one named
call per step), keeps the per-response rollout of the last iteration (`last_rollout`) and delegates
the row placement over processes (`placement.RowPlacer`), the compiled shapes and heap upkeep
(`shapes.ShapeTracker`) and the metric records (`iteration_metrics`: App. E.3 diagnostics pooled over
the rollout batch); writing files is the caller's (`experiments/train.py`).

Two options of verl's: DAPO dynamic sampling (`rollout.filter_groups`: only groups whose responses
differ in accuracy are trained on, more prompt batches drawn to fill the rollout batch) and rollout
correction (`objective.rollout_correction`: each token's loss weighted by π_old / π_sampler, bounded).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from respo_jax.data.batches import PromptBatches
from respo_jax.data.prompts import encode_prompt
from respo_jax.exported_programs import ProgramCache
from respo_jax.models import qwen3
from respo_jax.objectives import BUILTIN_OBJECTIVES, get_objective, group_advantages
from respo_jax.objectives.regularizers import adaptive_kl_coef, response_kl
from respo_jax.rewards import SCORED, TIMED_OUT, RewardScorer, get_reward, overlong_penalty
from respo_jax.sampling import EngineConfig, SamplingParams, compile_generate, generate
from respo_jax.models.qwen3.paged_attention import check_paged_attention_impl
from respo_jax.sharding import (
    ShardingRules,
    bytes_per_device,
    init_optimizer_state,
    optimizer_state_shardings,
    state_shardings,
)
from respo_jax.training.async_rollouts import AsyncRollouts, Resharder, rollout_mesh_logprobs
from respo_jax.training.batch import (
    PolicyBatch,
    batch_sharding,
    bucket_length,
    build_sequences,
    microbatch_size,
    replay_routing,
)
from respo_jax.training.compilation import (cache_holds_compile_ahead, compilation_totals, compiled_ahead_key,
                                            record_compile_ahead)
from respo_jax.training.config import ConfigError, ExperimentConfig
from respo_jax.training.held_out import evaluate_held_out
from respo_jax.training.iteration_metrics import (
    check_finite_steps,
    collect_rollout,
    iteration_record,
    logprob_metrics,
)
from respo_jax.training.limits import check_limits, check_prompt_buckets, device_memory_bytes
from respo_jax.training.minibatches import minibatch_rows
from respo_jax.training.model_setup import build_mesh, build_model, rollout_devices
from respo_jax.training.placement import RowPlacer
from respo_jax.training.shapes import ShapeTracker
from respo_jax.training.step import (
    NonFiniteError,
    StepShardings,
    learning_rate_schedule,
    make_logprob_fn,
    make_optimizer,
    make_policy_step,
    make_sft_step,
)
from respo_jax.training.tasks import load_task


@dataclasses.dataclass
class TrainState:
    """What a checkpoint holds: parameters, optimizer state, counters (and the batches' position)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    opt_state: object
    iteration: int = 0
    policy_updates: int = 0
    # The frozen reference policy (objective.kl_coef > 0 or log_kl_ref), on the parameters' shardings;
    # None when the run uses none (it is then neither allocated nor run).
    reference: nnx.State | None = None
    # The reward's KL weight (objective.kl_in_reward; the adaptive controller's current value).
    kl_reward_coef: float = 0.0


@dataclasses.dataclass(frozen=True)
class WarmupPosition:
    """Where the supervised warm-up stands: `step` steps done, its AdamW's `opt_state` and the
    problem stream's random-generator state (NumPy's `bit_generator.state`, a JSON-able dict)."""

    step: int
    opt_state: object
    rng_state: dict


@dataclasses.dataclass(frozen=True)
class TrainingRows:
    """One iteration's rows to train on, host arrays in prompt-major order (G rows per group): the kept
    groups' `real_rows` rows, then any filler rows of no weight that complete the last mini-batch."""

    prompts: list[list[int]]  # [rows] prompt tokens
    tokens: np.ndarray  # [rows, max_new_tokens]
    lengths: np.ndarray  # [rows] response tokens
    sampler_logp: np.ndarray  # [rows, max_new_tokens]
    sampler_entropy: np.ndarray | None  # [rows, max_new_tokens] with rollout.old_logprobs = "sampler"
    scores: np.ndarray  # [rows]
    advantages: np.ndarray  # [rows]
    prompt_routing: np.ndarray | None  # Routing Replay only: the sampler's experts of the prompts
    routing: np.ndarray | None  # and of the responses
    real_rows: int

    def filled(self, filler: int, pad_id: int) -> "TrainingRows":
        """These rows and `filler` more of no weight: pad tokens, length, score and advantage 0."""
        if not filler:
            return self

        def zeros(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros(filler, a.dtype)])

        def zero_rows(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.concatenate([a, np.zeros((filler, a.shape[1]), a.dtype)])

        return dataclasses.replace(
            self, prompts=self.prompts + [self.prompts[0]] * filler,
            tokens=np.concatenate([self.tokens,
                                   np.full((filler, self.tokens.shape[1]), pad_id, self.tokens.dtype)]),
            sampler_logp=zero_rows(self.sampler_logp), sampler_entropy=zero_rows(self.sampler_entropy),
            lengths=zeros(self.lengths), scores=zeros(self.scores), advantages=zeros(self.advantages))


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


# The group advantages (and the reward's KL) as one program each (rewards are checked finite where they
# are scored, `respo_jax.rewards.scoring`). Why: run eagerly, each jnp op of a host-side function is a
# program of its own, compiled in a cold start and read from the compilation cache in every later launch.
_group_advantages = jax.jit(group_advantages, static_argnames=("normalize_by_std", "eps"))
_response_kl = jax.jit(response_kl, static_argnames=("estimator",))


def prompt_groups_hold(prompts: list[list[int]], group: int) -> bool:
    """Whether the rows' prompts come in consecutive groups of `group` equal prompts (a mini-batch's
    prompt-major order: `PolicyBatch.prompt_group`)."""
    return group > 1 and len(prompts) % group == 0 and all(
        prompts[i] == prompts[i - i % group] for i in range(len(prompts)))


class RLTrainer:
    """Runs warm-up and RL iterations for an `ExperimentConfig`; yields one metrics record per step."""

    def __init__(self, config: ExperimentConfig):
        self.config = config.validate().check_paths()
        task = load_task(config)
        self.tokenizer, self.prompt_format, self.held_out = task.tokenizer, task.prompt_format, task.held_out
        self.task, train_records = task.synthetic, task.train
        r = config.rollout
        self.batches = PromptBatches(train_records, batch_size=r.reuse * r.prompts_per_minibatch, seed=config.task.seed)
        self.train_records = train_records
        # The training prompts' lengths (load_task tokenized them): the limits and compile_ahead need them.
        self.shapes = ShapeTracker(task.train_prompt_lengths, r.padded_prompt_length,
                                   compile_ahead=r.compile_ahead)
        # before the model is built: a refusal costs seconds, not minutes
        check_prompt_buckets(self.shapes.prompt_lengths, r.prompt_bucket, r.max_prompt_buckets,
                             r.prompt_buckets)
        self.objective = get_objective(config.objective.name, **config.objective.hparams)
        if self.objective.aggregation == "seq-mean-token-sum-norm" and self.objective.loss_scale_factor is None:
            # Dr.GRPO's constant is the generation budget, not the padded width of a batch.
            self.objective = dataclasses.replace(self.objective, loss_scale_factor=float(r.max_new_tokens))
        self.correction = config.objective.correction()  # rollout correction, None when off
        self.regularizers = config.objective.regularizers()  # KL in the loss, entropy bonus, off-policy mask
        if config.objective.reference_checkpoint:
            from respo_jax.training.checkpoint import latest_step

            if latest_step(config.objective.reference_checkpoint) is None:
                raise ConfigError(f"objective.reference_checkpoint="
                                  f"{config.objective.reference_checkpoint!r}: expected a checkpoints folder "
                                  "holding at least one step")
        self.engine: EngineConfig = r.engine_config()  # the rollouts' and the held-out evaluation's
        # per-response arrays of the last iteration (rollout file); None when it trained on no response
        self.last_rollout: dict | None = None
        self.reward, self.reward_counts = RewardScorer(get_reward(config.task.reward)), {}
        self.take_reward_counts()
        self.mesh, self.rules = build_mesh(config), ShardingRules()
        self._check_limits()  # before the model is built or read
        model = build_model(config, self.tokenizer.vocab_size, self.mesh, self.rules)
        self.model_config = model.config
        self._check_mesh_fits(model.config)
        graphdef, params = nnx.split(model)
        opt = config.optim
        updates_per_step = r.reuse if opt.schedule_per == "rollout" else 1
        # Jitted, as `_group_advantages` is: one program, not one per jnp op of the schedule.
        self.learning_rate = jax.jit(learning_rate_schedule(opt.learning_rate, config.lr_warmup_steps,
                                                            updates_per_step))
        self.tx = make_optimizer(opt.learning_rate, opt.weight_decay, opt.b1, opt.b2, opt.max_grad_norm,
                                 config.lr_warmup_steps, updates_per_step)
        param_sh = state_shardings(params, self.mesh, self.rules)
        self.shardings = StepShardings(
            params=param_sh, opt_state=optimizer_state_shardings(self.tx, params, param_sh),
            batch=batch_sharding(self.mesh, self.rules),
            replicated=NamedSharding(self.mesh, PartitionSpec()))
        self.placer = RowPlacer(self.shardings.batch)  # each process's rows of every batch
        # Rows per shared prompt in the update's batches (`rollout.share_prompts`; 1: none), resolved once
        # (Routing Replay needs a MoE model: `_check_mesh_fits`).
        self.prompt_group = r.group_size if (
            r.share_prompts and r.minibatch_order == "consecutive" and not model.config.is_moe
            and self.batch_shards == 1) else 1
        self.state = TrainState(graphdef, params, init_optimizer_state(self.tx, params, param_sh),
                                kl_reward_coef=float(config.objective.kl_coef))
        self.programs = self.program_cache(model.config)  # traced programs kept for the next launch
        # The jitted programs: (params, opt_state, batch, micro) -> (params, opt_state, metrics), and
        # (params, batch, micro) -> (old_logp, token entropy) [rows, response_len].
        self.policy_step = make_policy_step(graphdef, self.objective, self.tx, temperature=r.temperature,
                                            shardings=self.shardings,
                                            load_balancing_weight=config.objective.load_balancing_weight,
                                            rollout_correction=self.correction,
                                            compiler_options=qwen3.kernels.update_compiler_options(
                                                qwen3.kernels.platform(self.mesh)),
                                            program_cache=self.programs,
                                            regularizers=self.regularizers,
                                            decoupled=config.objective.decoupled)
        self.old_logprobs = make_logprob_fn(graphdef, temperature=r.temperature, return_entropy=True,
                                            shardings=self.shardings)
        # log π_old from the sampler or a forward pass of its own (`rollout.old_logprobs`), decided once
        self.old_logprobs_source = r.old_logprobs_source(dtype=config.model.dtype, moe=model.config.is_moe,
                                                         correction=self.correction is not None)
        # the sampler's mesh, model structure and parameter shardings (mesh.rollout_devices)
        self.rollout_mesh, self.rollout_graphdef, self.rollout_shardings = self._rollout_placement(
            model.config)
        # the rollout jobs of an asynchronous run (rollout.async_steps >= 1), started by the first iteration
        self.async_rollouts: AsyncRollouts | None = None
        self._batches_resume_state = None  # async: the prompt stream's position after the last trained batch
        self._restored_behaviour = None  # async: a checkpoint's behaviour parameters of the jobs in flight
        self.warmup_position: WarmupPosition | None = None  # after each warm-up step (`warmup`)
        self._resharder: Resharder | None = None  # trainer -> rollout mesh, built at the first reshard
        # log π_behaviour recomputed on the rollout mesh, under the copy held there (None on one mesh)
        self.rollout_logprobs = rollout_mesh_logprobs(self)

    def _rollout_placement(self, model_cfg) -> tuple:
        """The sampler's mesh, model structure and parameter shardings: the trainer's, or with
        `mesh.rollout_devices` a rollout mesh of their own (the last devices, `mesh.rollout_tensor` of
        them on its tensor axis, the rest on data) under the same `ShardingRules`."""
        devices = self.config.mesh.rollout_devices
        if not devices:
            return self.mesh, self.state.graphdef, self.shardings.params
        from respo_jax.sharding import MeshConfig, make_mesh

        tensor = self.config.mesh.rollout_tensor
        mesh = make_mesh(MeshConfig(data=devices // tensor, tensor=tensor), rollout_devices(self.config))
        abstract = nnx.eval_shape(lambda: qwen3.init_model(model_cfg.replace(mesh=mesh), seed=0))
        graphdef, params = nnx.split(abstract)
        return mesh, graphdef, state_shardings(params, mesh, self.rules)

    def _check_limits(self) -> None:
        """Response length against the model's positions and the sampler's KV cache against the devices'
        memory (`respo_jax.training.limits`), from the model's config alone (a checkpoint's config.json);
        the continuous engine's attention kernel against the mesh's platform."""
        model, r = self.config.model, self.config.rollout
        if r.scheduler == "continuous":
            try:
                check_paged_attention_impl(r.paged_attention_impl, qwen3.kernels.platform(self.mesh))
            except ValueError as err:
                raise ConfigError(f"rollout.paged_attention_impl={r.paged_attention_impl!r}: {err}") from None
        if model.checkpoint_dir:
            try:
                model_cfg = qwen3.load_config(model.checkpoint_dir)
            except (OSError, ValueError, KeyError) as err:
                raise ConfigError(f"model.checkpoint_dir={model.checkpoint_dir!r}: {err}") from None
        else:
            fields = {f.name for f in dataclasses.fields(qwen3.Qwen3Config)}
            model_cfg = qwen3.Qwen3Config.preset(
                model.preset, **{k: v for k, v in model.overrides.items() if k in fields})
        longest = max([*self.shapes.prompt_lengths, *(len(self.encode(rec)) for rec in self.held_out)])
        check_limits(self.config, model_cfg, longest,
                     device_memory_bytes([*self.mesh.devices.flat, *rollout_devices(self.config)]),
                     trainer_devices=self.mesh.devices.size)

    def _check_mesh_fits(self, model_cfg) -> None:
        """What the mesh and the MoE options need, checked before any compute (ConfigError)."""
        cfg, shards = self.config, self.batch_shards
        r = cfg.rollout
        if (r.routing_replay or cfg.objective.load_balancing_weight) and not model_cfg.is_moe:
            key = "rollout.routing_replay" if r.routing_replay else "objective.load_balancing_weight"
            raise ConfigError(f"{key}: needs an MoE model (num_experts > 0); the model is dense")
        sizes = {"rollout.prompts_per_minibatch * rollout.group_size": r.prompts_per_minibatch * r.group_size}
        if cfg.warmup.steps:
            sizes["warmup.batch_size"] = cfg.warmup.batch_size
        for key, rows in sizes.items():
            if rows % shards:
                raise ConfigError(f"{key}={rows}: expected a multiple of the {shards} devices the batch is "
                                  f"split over (mesh axes {self.rules.mesh_axes('batch')} of "
                                  f"{dict(self.mesh.shape)})")

    @property
    def batch_shards(self) -> int:
        """Devices a batch's rows are split over (the "batch" rule's mesh axes)."""
        return math.prod(self.mesh.shape[a] for a in self.rules.mesh_axes("batch"))

    def run_info(self) -> dict:
        """The run's devices, mesh and where the parameters live (written as run_info.json)."""
        held = max(bytes_per_device(self.state.params).values())  # this process's devices
        if jax.process_count() > 1:  # a collective: every process calls run_info
            from jax.experimental import multihost_utils

            held = int(np.max(multihost_utils.process_allgather(np.array([held], np.int64))))
        total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self.state.params))
        return {
            "devices": int(self.mesh.devices.size),
            "devices_available": jax.device_count(),
            "processes": jax.process_count(),
            "platform": qwen3.kernels.platform(self.mesh),
            "mesh": {name: int(size) for name, size in self.mesh.shape.items()},
            "param_bytes_total": int(total),
            "param_bytes_max_per_device": int(held),
            "kernels": {k: getattr(self.model_config, k)
                        for k in ("attention_impl", "moe_impl", "moe_dispatch")},
        }

    # -- data ------------------------------------------------------------------------------------------
    def checkpoint_meta(self) -> dict:
        """The JSON part of a checkpoint: counters, the prompt batches' resumable position (and the
        reward's KL weight with objective.kl_in_reward)."""
        # Asynchronous: the position after the last trained batch (the jobs in flight drew beyond it
        # and are regenerated from it on resume).
        batches = self._batches_resume_state if self._batches_resume_state is not None \
            else self.batches.get_state()
        meta = {"iteration": self.state.iteration, "policy_updates": self.state.policy_updates,
                "batches": batches}
        if self.config.objective.kl_in_reward:
            meta["kl_reward_coef"] = self.state.kl_reward_coef
        return meta

    def restore_meta(self, meta: dict) -> None:
        self.state.iteration, self.state.policy_updates = int(meta["iteration"]), int(meta["policy_updates"])
        self.batches.set_state(meta["batches"])
        if self.config.objective.kl_in_reward:
            self.state.kl_reward_coef = float(meta["kl_reward_coef"])

    # -- reference policy --------------------------------------------------------------------------------
    def reference_like(self):
        """The reference's structure for a checkpoint restore (the parameters'); None without one."""
        return self.state.params if self.config.objective.uses_reference else None

    def ensure_reference(self) -> None:
        """Holds the frozen reference once RL starts (after any warm-up): objective.reference_checkpoint's
        parameters, else a copy of the current ones, on the parameters' shardings. A resumed run's comes
        from its checkpoint."""
        objective = self.config.objective
        if not objective.uses_reference or self.state.reference is not None:
            return
        if objective.reference_checkpoint:
            from respo_jax.training.checkpoint import restore_params

            self.state.reference, _, _ = restore_params(objective.reference_checkpoint, self.state.params)
        else:
            self.state.reference = jax.tree.map(jnp.copy, self.state.params)

    def score(self, tokens: np.ndarray, lengths: np.ndarray,
              records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """The `task.reward` of each response (`respo_jax.rewards.scoring`; strict box ±1 by default) + the
        overlong penalty when configured: scores [batch] float32, and each reward's status [batch] int8
        (SCORED, FAILED or TIMED_OUT: a failed reward scores its `failure_score`, penalty added)."""
        task_cfg = self.config.task
        texts = [self.prompt_format.solution_text(self.tokenizer.decode(tokens[i, : lengths[i]]))
                 for i in range(len(records))]
        scores, status = self.reward(records, texts)
        if task_cfg.overlong_buffer_length > 0:
            scores += overlong_penalty(lengths, self.config.rollout.max_new_tokens, task_cfg.overlong_buffer_length,
                                       task_cfg.overlong_penalty_factor)
        return scores, status

    def _score_shared(self, tokens: np.ndarray, lengths: np.ndarray, records: list[dict],
                      count: bool = True, counts: dict | None = None) -> np.ndarray:
        """`score` of every response, each process verifying its even share of them (`RowPlacer.share`;
        all in one process) and the scores then exchanged, so
        the (host-bound) reward work is split over the hosts and every process ends up with all scores.
        With `count`, the failed and timed-out rewards are added to `reward_counts` (the next metrics
        record's `reward_failures` / `reward_timeouts`, see `take_reward_counts`), or to `counts` when
        given (a rollout job's own)."""
        share = self.placer.share(len(records))
        scores, status = self.score(tokens[share], lengths[share], self.placer.take(records, share))
        status = self.placer.gather(status, share, len(records))
        if count:
            counts = self.reward_counts if counts is None else counts
            counts["reward_failures"] += int(np.sum(status != SCORED))
            counts["reward_timeouts"] += int(np.sum(status == TIMED_OUT))
        return self.placer.gather(scores, share, len(records))

    def take_reward_counts(self) -> dict:
        """The failed / timed-out rewards counted since the last call (responses, this iteration's)."""
        counts, self.reward_counts = self.reward_counts, {"reward_failures": 0, "reward_timeouts": 0}
        return counts

    def encode(self, record: dict) -> list[int]:
        """The prompt tokens of a record, in the task's prompt format."""
        return encode_prompt(record["problem"], self.tokenizer, self.prompt_format)

    def model(self) -> nnx.Module:
        return nnx.merge(self.state.graphdef, self.state.params)

    # -- supervised warm-up ----------------------------------------------------------------------------
    def warmup(self, start: WarmupPosition | None = None) -> Iterator[dict]:
        """Supervised steps on reference responses, with their own AdamW (a weak 'base model'), from the
        first step or from `start` (a warm-up checkpoint's position; the trainer holds its parameters).
        After each step `warmup_position` is what resumes the warm-up there, bit for bit."""
        cfg = self.config.warmup
        if cfg.steps == 0:
            return
        if self.task is None:
            raise ValueError("warmup needs reference responses: only the synthetic task has them")
        tx, opt_shardings = self._warmup_optimizer()
        opt_state = start.opt_state if start else init_optimizer_state(tx, self.state.params,
                                                                        self.shardings.params)
        step = make_sft_step(self.state.graphdef, tx, self.shardings.params, opt_shardings,
                             self.shardings.batch)
        rng = np.random.default_rng(self.config.run.seed + 1)
        if start:
            rng.bit_generator.state = start.rng_state
        for index in range(start.step if start else 0, cfg.steps):
            records = self._warmup_records(rng, cfg.batch_size)
            prompts = [self.encode(r) for r in records]
            responses = [self.tokenizer.encode(self.task.reference_solution(r)) + [self.tokenizer.eos_id]
                         for r in records]
            width = max(len(r) for r in responses)
            padded = np.array([r + [self.tokenizer.pad_id] * (width - len(r)) for r in responses], np.int32)
            lengths = np.array([len(r) for r in responses], np.int32)
            part = self.placer.rows(len(records))  # this process's rows only
            ids, positions, attention, response_mask, prompt_len = build_sequences(
                self.placer.take(prompts, part), padded[part], lengths[part], self.tokenizer.pad_id,
                prompt_len=max(len(p) for p in prompts))
            loss_mask = np.zeros(ids.shape, np.float32)
            loss_mask[:, prompt_len:] = response_mask
            inputs = self.placer.place([ids, positions, attention, loss_mask], len(records))
            self.state.params, opt_state, loss, finite = step(self.state.params, opt_state, *inputs)
            loss = float(loss)
            if not (np.isfinite(loss) and bool(finite)):
                quantity = f"sft_loss is {loss}" if not np.isfinite(loss) else "the parameters hold NaN/inf"
                raise NonFiniteError(f"warm-up step {index + 1}: {quantity}; the run stops before any "
                                     "checkpoint")
            self.warmup_position = WarmupPosition(index + 1, opt_state, rng.bit_generator.state)
            yield {"phase": "warmup", "step": index + 1, "sft_loss": loss}

    def _warmup_optimizer(self):
        """The warm-up's AdamW and its state's shardings."""
        tx = make_optimizer(self.config.warmup.learning_rate, 0.0, 0.9, 0.999, 1.0, 0)
        return tx, optimizer_state_shardings(tx, self.state.params, self.shardings.params)

    def warmup_opt_state_like(self):
        """A fresh state of the warm-up optimizer: the structure, shapes and shardings a restore fills."""
        tx, _ = self._warmup_optimizer()
        return init_optimizer_state(tx, self.state.params, self.shardings.params)

    def _warmup_records(self, rng: np.random.Generator, count: int) -> list[dict]:
        """`count` random problems of the warm-up stream; never a held-out test problem when the task
        has a test split."""
        records: list[dict] = []
        while len(records) < count:
            for i in rng.integers(0, 2**31, size=count - len(records)):
                record = self.task.record(self.config.task.seed + 1_000_003, int(i))
                if not self.task.test_fraction or self.task.split_of(record["problem"]) == "train":
                    records.append(record)
        return records

    # -- RL --------------------------------------------------------------------------------------------
    def rollout(self, records: list[dict], seed: int, params=None, counts: dict | None = None):
        """Samples `group_size` responses per record with `params` (on the rollout mesh; None: the
        trainer's current ones); returns prompts, sampler output and ±1 scores (the reward's failures
        counted into `counts`, default the trainer's)."""
        r = self.config.rollout
        prompts = [self.encode(rec) for rec in records]
        model = self.model() if params is None else nnx.merge(self.rollout_graphdef, params)
        programs = self.programs if self.rollout_mesh is self.mesh else None
        out = generate(model, prompts, self._sampling_params(seed), engine=self.engine,
                       return_routing=r.routing_replay, programs=programs)
        # Every process gets every response (a gather across processes): the layout of the policy
        # batches (bucketed lengths, verl's balanced order), the metrics and the rollout file need them.
        out = self.placer.fetch(out)
        scores = self._score_shared(np.asarray(out.tokens), np.asarray(out.lengths),
                                    [rec for rec in records for _ in range(r.group_size)], counts=counts)
        expanded_prompts = [p for p in prompts for _ in range(r.group_size)]
        return expanded_prompts, out, scores

    def _sampling_params(self, seed: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            seed=seed, eos_token_ids=self.tokenizer.eos_ids, num_samples=r.group_size,
            return_entropy=self.old_logprobs_source == "sampler",
        )

    def compile_ahead(self) -> int:
        """Compiles the rollout's sampler programs and the mini-batch's log π_old and update programs for
        every prompt bucket of the training prompts, with responses at the longest response bucket
        (`rollout.compile_ahead`: the first iteration does it); returns the number of buckets.

        Why: a batch whose longest prompt first reaches a bucket would otherwise stop a later
        iteration to compile (seconds per program at the real vocabulary); compiled here, the run
        pays it once at its start. A mini-batch whose responses all end early (a smaller response
        bucket) still compiles when it first occurs. Nothing runs: the programs are lowered from the
        shapes and shardings of placeholder batches built as `policy_batch` builds real ones."""
        key = self.compile_ahead_key()
        if cache_holds_compile_ahead(key):  # a warm cache: each program is read when first needed
            self.shapes.skip_compile_ahead()
            print("compile-ahead skipped: the compilation cache holds this configuration's programs "
                  f"(record {key[:12]}); each is read from it when first needed", file=sys.stderr)
            return 0
        model = self.model()
        buckets = self.shapes.compile_ahead(lambda prompt_len: self._compile_bucket(model, prompt_len))
        record_compile_ahead(key)
        return buckets

    def compile_ahead_key(self) -> str:
        """The key of this run's compile-ahead in the compilation cache (`compiled_ahead_key`): the
        config's `program_config` and the prompt buckets; a relaunch with more iterations or another
        seed reads the same programs."""
        return compiled_ahead_key({"config": program_config(self.config),
                                   "prompt_buckets": self.shapes.prompt_buckets()})

    def program_cache(self, model_config: qwen3.Qwen3Config) -> ProgramCache | None:
        """Where the update step and the sampler keep their traced programs (`respo_jax.exported_programs`,
        a later launch reads them instead of tracing them): the compilation cache's directory, keyed by
        the config's `program_config` and the model's config (read from the checkpoint). None without a
        compilation cache, on several devices or processes, or with an objective registered outside
        respo_jax (its code is not part of the key)."""
        directory = jax.config.jax_compilation_cache_dir
        if not directory or not ProgramCache.usable() or self.config.objective.name not in BUILTIN_OBJECTIVES:
            return None
        return ProgramCache(directory, json.dumps({"config": program_config(self.config),
                                                   "model": dataclasses.asdict(model_config)},
                                                  sort_keys=True, default=str))

    def _compile_bucket(self, model: nnx.Module, prompt_len: int) -> None:
        """`compile_ahead` of one prompt bucket."""
        r = self.config.rollout
        rows = r.prompts_per_minibatch * r.group_size
        responses = np.full((rows, r.max_new_tokens), self.tokenizer.pad_id, np.int32)
        lengths = np.full(rows, r.max_new_tokens, np.int32)
        compile_generate(model, prompt_len, r.reuse * r.prompts_per_minibatch, self._sampling_params(0),
                         engine=self.engine, return_routing=r.routing_replay, programs=self.programs)
        routing = None
        if r.routing_replay:
            cfg = self.model_config
            routing = tuple(np.zeros((cfg.num_moe_layers, rows, length, cfg.num_experts_per_tok), np.int32)
                            for length in (prompt_len, r.max_new_tokens))
        sampler_logp = np.zeros(responses.shape, np.float32) if self.correction else None
        batch, micro = self.policy_batch([[self.tokenizer.pad_id] * prompt_len] * rows, responses, lengths,
                                         np.zeros(rows, np.float32), routing, sampler_logp)
        if (self.old_logprobs_source == "recompute" or self.config.objective.uses_reference
                or self.config.objective.decoupled):
            self.old_logprobs.lower(self.state.params, batch, micro).compile()
        if self.config.objective.uses_reference:  # the update's batches carry the reference's log-probs
            batch = batch.replace(ref_logp=batch.old_logp)
        if self.config.objective.decoupled:  # and the behaviour policy's
            batch = batch.replace(behaviour_logp=batch.old_logp)
        self.policy_step.lower(self.state.params, self.state.opt_state, batch, micro).compile()

    def policy_batch(self, prompts: list[list[int]], tokens: np.ndarray, lengths: np.ndarray,
                     advantages: np.ndarray, sampler_routing: tuple | None = None,
                     sampler_logp: np.ndarray | None = None) -> tuple[PolicyBatch, int]:
        """A mini-batch laid out with bucketed prompt and response lengths (old_logp still zero), placed on
        the devices in the step's batch sharding, and the rows per micro-batch that keep it within
        `rollout.max_tokens_per_microbatch` (a multiple of the batch devices, so every micro-batch is
        spread over all of them). `sampler_routing`: (prompt_routing, routing) of these rows from the
        sampler, to replay (Routing Replay). `sampler_logp`: [rows, >= response length] the sampler's
        log-probs of these rows (rollout correction).

        The lengths come from all rows (every process computes the same shapes); each process then lays
        out only the rows its devices hold and the global batch is assembled from the processes' parts
        (`RowPlacer`)."""
        r = self.config.rollout
        rows = len(prompts)
        prompt_len = r.padded_prompt_length(max(len(p) for p in prompts))
        response_len = bucket_length(max(int(lengths.max()), 1), r.response_bucket, r.max_new_tokens)
        part = self.placer.rows(rows)
        ids, positions, attention, response_mask, prompt_len = build_sequences(
            self.placer.take(prompts, part), tokens[part], lengths[part], self.tokenizer.pad_id,
            prompt_len=prompt_len, response_len=response_len)
        shape = (rows, ids.shape[1])
        routing = None
        if sampler_routing is not None:  # the sampler's experts, laid out like the model input (R3)
            routing = replay_routing(*(a[:, part] for a in sampler_routing), prompt_len, response_len)
        local = PolicyBatch(
            input_ids=ids, positions=positions, attention_mask=attention, response_mask=response_mask,
            old_logp=np.zeros(response_mask.shape, np.float32),
            advantages=np.asarray(advantages, np.float32)[part], routing=routing, prompt_len=prompt_len,
            sampler_logp=None if sampler_logp is None
            else np.asarray(sampler_logp, np.float32)[part, :response_len] * response_mask,
        )
        group = self.prompt_group if prompt_groups_hold(prompts, self.prompt_group) else 1
        batch = self.placer.place(local.replace(prompt_group=group), rows)
        micro = microbatch_size(rows, shape[1], r.max_tokens_per_microbatch)
        unit = math.lcm(self.batch_shards, group)  # every micro-batch spread over all devices, whole groups
        return batch, min(rows, -(-micro // unit) * unit)

    def rollout_seed(self, generation_batch: int, iteration: int | None = None) -> int:
        """The sampler seed of a generation batch of this iteration: the first one's is the run's
        historical seed + iteration, later ones (dynamic sampling) one derived from (seed, iteration,
        index): a pure function of the counters a checkpoint holds, so a resumed run draws the same.
        `iteration`: the iterations done before the batch's (default: the trainer's count)."""
        seed = self.config.run.seed
        iteration = self.state.iteration if iteration is None else iteration
        if generation_batch == 0:
            return seed * 1_000_003 + iteration
        sequence = np.random.SeedSequence([seed, iteration, generation_batch])
        return int(sequence.generate_state(1, np.uint64)[0])

    def raw_accuracy(self, scores: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Whether each response is correct: its reward before the overlong penalty is > 0, [batch] bool
        (DAPO's filter metric "acc")."""
        task_cfg = self.config.task
        raw = np.asarray(scores, np.float64)
        if task_cfg.overlong_buffer_length > 0:
            raw = raw - overlong_penalty(lengths, self.config.rollout.max_new_tokens,
                                         task_cfg.overlong_buffer_length, task_cfg.overlong_penalty_factor)
        return raw > 0

    def sample_groups(self, iteration: int | None = None, params=None) -> dict:
        """The groups to train on and the counts of how they were drawn.

        Without `rollout.filter_groups`: the next prompt batch's N·M groups. With it (verl's DAPO
        recipe): generation batches of N·M prompts (the next prompt batches, each its own seed) are
        drawn until N·M groups whose responses differ in raw accuracy are kept, in order, the extras of
        the last batch dropped, or `rollout.max_generation_batches` were drawn. Returns host arrays of
        the kept rows (prompt-major, G per group): prompts, tokens, lengths, sampler_logp, sampler_entropy
        (None unless `rollout.old_logprobs` resolved to "sampler"), scores,
        prompt_routing/routing (None unless routing_replay), and every generated response's scores and
        lengths ("all_scores", "all_lengths") and the counts.

        `iteration` (the iterations done before the batch's; default the trainer's count) picks the
        sampler seeds and `params` the sampling parameters (`rollout`): an asynchronous rollout job's.
        The reward's failures are counted in "reward_counts" when `iteration` is given, and the
        prompt stream's position after the draws is "batches_after"."""
        r = self.config.rollout
        counts = None if iteration is None else {"reward_failures": 0, "reward_timeouts": 0}
        sampled = self._sample_groups(iteration, params, counts)
        if counts is not None:
            sampled["reward_counts"] = counts
        sampled["batches_after"] = self.batches.get_state()
        return sampled

    def _sample_groups(self, iteration: int | None, params, counts: dict | None) -> dict:
        """`sample_groups`' draws."""
        r = self.config.rollout
        num_prompts, group = r.reuse * r.prompts_per_minibatch, r.group_size
        parts, all_scores, all_lengths = [], [], []
        kept = generated = batches = 0
        while True:
            records = next(self.batches)
            seed = self.rollout_seed(batches, iteration)
            prompts, out, scores = self.rollout(records, seed=seed, params=params, counts=counts)
            batches += 1
            lengths = np.asarray(out.lengths)
            all_scores.append(scores)
            all_lengths.append(lengths)
            generated += num_prompts
            if not r.filter_groups:
                return {"prompts": prompts, "tokens": np.asarray(out.tokens), "lengths": lengths,
                        "sampler_logp": np.asarray(out.logprobs),
                        "sampler_entropy": None if out.entropy is None else np.asarray(out.entropy),
                        "scores": scores,
                        "prompt_routing": out.prompt_routing, "routing": out.routing,
                        "all_scores": scores, "all_lengths": lengths,
                        "groups_generated": generated, "groups_kept": num_prompts, "generation_batches": 1}
            accuracy = self.raw_accuracy(scores, lengths).reshape(num_prompts, group)
            informative = np.nonzero(accuracy.any(axis=1) & ~accuracy.all(axis=1))[0][:num_prompts - kept]
            rows = (informative[:, None] * group + np.arange(group)).reshape(-1)
            parts.append(([prompts[i] for i in rows], np.asarray(out.tokens)[rows], lengths[rows],
                          np.asarray(out.logprobs)[rows], scores[rows],
                          None if out.entropy is None else np.asarray(out.entropy)[rows]))
            kept += len(informative)
            if kept == num_prompts or batches == r.max_generation_batches:
                break
        return {"prompts": [p for part in parts for p in part[0]],
                **{key: np.concatenate([part[i] for part in parts])
                   for i, key in enumerate(("tokens", "lengths", "sampler_logp", "scores"), start=1)},
                "sampler_entropy": None if out.entropy is None
                else np.concatenate([part[5] for part in parts]),
                "prompt_routing": None, "routing": None,
                "all_scores": np.concatenate(all_scores), "all_lengths": np.concatenate(all_lengths),
                "groups_generated": generated, "groups_kept": kept, "generation_batches": batches}

    def iteration(self) -> dict:
        """One rollout batch and its N policy updates (paper §4.1); returns the iteration's metrics record."""
        started, compiled_before = time.perf_counter(), compilation_totals()
        self.shapes.compile_ahead_once(self.compile_ahead)  # in the first iteration's compiles and time
        rollout_started = time.perf_counter()  # after compile_ahead: rollout_seconds is the rollout alone
        # rollout and reward (dynamic sampling: until enough groups differ), and the policy that generated it
        sampled, behaviour = self.next_rollout()
        rollout_seconds = time.perf_counter() - rollout_started
        batch = self.training_rows(sampled)  # group-normalized advantages
        minibatches = self.minibatch_rows(batch)  # N mini-batches: consecutive or verl's balanced order
        self.ensure_reference()
        # log π_old (and log π_behaviour, decoupled), no update yet
        policy_batches, logprob_parts = self.with_old_logprobs(batch, minibatches, *behaviour[1:])
        kl_reward = {}
        if self.config.objective.kl_in_reward:  # verl's apply_kl_penalty: the scores, then the advantages
            policy_batches, batch, kl_reward = self.kl_penalized_advantages(batch, minibatches,
                                                                            policy_batches)
        learning_rate = self.learning_rate_of_updates(len(policy_batches))
        step_metrics = self.update(policy_batches)  # the N policy updates
        record = self.report(sampled, batch, minibatches, logprob_parts, step_metrics, learning_rate,
                             timing=(started, compiled_before, rollout_seconds), version=behaviour[0])
        return {**record, **kl_reward}

    # -- asynchronous rollouts (`respo_jax.training.async_rollouts`) -----------------------------------
    def next_rollout(self) -> tuple[dict, tuple[int, object, object]]:
        """The sampled batch of the next iteration (`sample_groups`) and its behaviour policy: (version,
        parameters on the trainer's shardings, on the rollout mesh's or None). Synchronous: sampled now
        by the current parameters; asynchronous: the rollout job submitted k iterations ago (the jobs up
        to k ahead submitted)."""
        if self.async_rollouts is None and self.config.rollout.async_steps:
            self.start_async_rollouts(self.config.rollout.async_steps)
        if self.async_rollouts is None:
            return self.sample_groups(), (self.state.iteration, self.state.params, None)
        sampled, job = self.async_rollouts.take(self.state.iteration + 1, self.state.params)
        for key, value in sampled.pop("reward_counts").items():
            self.reward_counts[key] += value
        self._batches_resume_state = sampled["batches_after"]
        return sampled, (job.version, job.params, job.rollout_params)

    def start_async_rollouts(self, steps: int, overlap: bool | None = None) -> None:
        """Routes the rollouts through `AsyncRollouts` with `steps` of staleness (0: the synchronous
        schedule through the same jobs), resuming the in-flight jobs of a restored checkpoint. `overlap`:
        the jobs run in their own thread (default: in a single-process run) or in the main thread."""
        overlap = jax.process_count() == 1 if overlap is None else overlap
        self.async_rollouts = AsyncRollouts(
            steps, lambda iteration, params: self.sample_groups(iteration - 1, params), self.to_rollout_mesh,
            self.config.num_iterations, overlap=overlap)
        if self._restored_behaviour is not None:
            self.async_rollouts.restore(self._restored_behaviour, self.state.iteration)
            self._restored_behaviour = None

    def to_rollout_mesh(self, params):
        """Trainer-side parameters on the rollout mesh's shardings (the same arrays on one mesh)."""
        if self.rollout_mesh is self.mesh:
            return params
        if self._resharder is None:
            self._resharder = Resharder(self.shardings.params, self.rollout_shardings)
        return self._resharder(params)

    def behaviour_like(self):
        """The structure of the behaviour parameters a checkpoint holds (k copies of the parameters'), or
        None for a synchronous run."""
        steps = self.config.rollout.async_steps
        return [self.state.params] * steps if steps else None

    def behaviour_params(self):
        """The behaviour parameters of the rollout jobs in flight after this iteration (k entries, the
        current parameters for jobs not yet submitted), for a checkpoint; None for a synchronous run."""
        steps = self.config.rollout.async_steps
        if not steps:
            return None
        if self.async_rollouts is None:
            return list(self._restored_behaviour or [self.state.params] * steps)
        return self.async_rollouts.behaviour_params(self.state.iteration, self.state.params)

    def restore_behaviour(self, behaviour) -> None:
        """A checkpoint's behaviour parameters (`behaviour_params`): the first iteration regenerates the
        in-flight jobs from them."""
        self._restored_behaviour = None if behaviour is None else list(behaviour)

    def close(self) -> None:
        """Stops the rollout jobs of an asynchronous run (the one running finishes first) and joins their
        thread; `with trainer:` does it however the block ends (its end, an exception, a stop)."""
        if self.async_rollouts is not None:
            self.async_rollouts.close()

    def __enter__(self) -> "RLTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def training_rows(self, sampled: dict) -> TrainingRows:
        """The kept groups' rows (`sample_groups`) with their group-normalized advantages.

        With `rollout.filter_groups`, a rollout batch that ends with K < N·M informative groups (after
        `rollout.max_generation_batches`) is trained on as verl's actor splits a smaller batch: ceil(K/M)
        mini-batches of M groups, the last one holding the rest, filled up to the compiled shape with
        rows whose response mask is zero (they add nothing to any loss, denominator or gradient); K = 0
        makes no update. The record says so: groups_generated, groups_kept, generation_batches and
        updates (the policy updates made)."""
        r = self.config.rollout
        kept, group = sampled["groups_kept"], r.group_size
        scores = jnp.asarray(sampled["scores"].reshape(kept, group))
        advantages = np.asarray(_group_advantages(scores, normalize_by_std=self.objective.scale_advantages))
        advantages = advantages.reshape(-1)
        rows = TrainingRows(
            prompts=sampled["prompts"], tokens=sampled["tokens"], lengths=sampled["lengths"],
            sampler_logp=sampled["sampler_logp"], sampler_entropy=sampled["sampler_entropy"],
            scores=sampled["scores"], advantages=advantages,
            prompt_routing=sampled["prompt_routing"], routing=sampled["routing"], real_rows=kept * group)
        updates = -(-kept // r.prompts_per_minibatch)  # N unless dynamic sampling fell short
        return rows.filled((updates * r.prompts_per_minibatch - kept) * group, self.tokenizer.pad_id)

    def minibatch_rows(self, batch: TrainingRows) -> list[np.ndarray]:
        """The rows of each of the N mini-batches of M prompts × G responses: consecutive (paper §4.1) or
        verl's length-balanced order; none when no group was kept."""
        r = self.config.rollout
        updates = batch.lengths.shape[0] // (r.prompts_per_minibatch * r.group_size)
        if not updates:
            return []
        sequence_lengths = np.array([len(p) for p in batch.prompts]) + batch.lengths
        return minibatch_rows(r.minibatch_order, sequence_lengths, updates, r.balance_ranks)

    def with_old_logprobs(self, batch: TrainingRows, minibatches: list[np.ndarray],
                          behaviour=None, rollout_behaviour=None) -> tuple[list, list]:
        """Each mini-batch in its own bucketed shape (`policy_batch`) with log π_old and the rollout-time
        entropy under the rollout-time parameters, before any update: [(policy batch, micro-batch rows)]
        and, for the metrics, [(response_mask, old_logp, entropy)] (device arrays; the entropy a host
        array when it is the sampler's). Both come from the sampler or from a forward pass
        (`rollout.old_logprobs`). `behaviour`: the parameters that generated the batch (default: the
        current ones); the recomputation runs under them, on the rollout mesh when `rollout_behaviour` (their
        copy there) is given and the rollout mesh is not the trainer's (`rollout_logprobs`).

        `objective.decoupled`: log π_old is π_prox's, a forward pass under the current parameters, and
        the batch carries log π_behaviour (the sampler's or the recomputed) for the weight
        π_prox / π_behaviour (the same pass when both policies are the current one)."""
        from_sampler = self.old_logprobs_source == "sampler"
        current = self.state.params
        behaviour = current if behaviour is None else behaviour
        decoupled = self.config.objective.decoupled
        policy_batches, parts = [], []
        for rows in minibatches:
            replay = ((batch.prompt_routing[:, rows], batch.routing[:, rows])
                      if self.config.rollout.routing_replay else None)
            policy, micro = self.policy_batch([batch.prompts[i] for i in rows], batch.tokens[rows],
                                              batch.lengths[rows], batch.advantages[rows], replay,
                                              batch.sampler_logp[rows] if self.correction or from_sampler
                                              else None)
            self.shapes.batch_shape(policy.input_ids.shape)
            if from_sampler:  # the sampler's log-probs laid out as policy_batch lays them out (masked)
                old_logp, policy = policy.sampler_logp, policy.replace(sampler_logp=None)
                token_entropy = batch.sampler_entropy[rows, :old_logp.shape[1]]  # logprob_metrics masks it
            else:
                old_logp, token_entropy = (
                    self.old_logprobs(behaviour, policy, micro)
                    if self.rollout_logprobs is None or rollout_behaviour is None
                    else self.rollout_logprobs(rollout_behaviour, policy, micro))
            if decoupled:  # old_logp so far is the behaviour policy's; the ratio's is π_prox's
                behaviour_logp = old_logp
                if from_sampler or behaviour is not current:
                    old_logp, token_entropy = self.old_logprobs(current, policy, micro)
                policy = policy.replace(behaviour_logp=behaviour_logp)
            if self.state.reference is not None:  # the same forward program, of the frozen reference
                policy = policy.replace(ref_logp=self.old_logprobs(self.state.reference, policy, micro)[0])
            policy_batches.append((policy.replace(old_logp=old_logp), micro))
            parts.append((policy.response_mask, old_logp, token_entropy))
        return policy_batches, parts

    def kl_penalized_advantages(self, batch: TrainingRows, minibatches: list[np.ndarray],
                                policy_batches: list) -> tuple[list, TrainingRows, dict]:
        """objective.kl_in_reward (verl's ``apply_kl_penalty``): each response's score loses
        β Σ_t kl(log π_old, log π_ref), the group advantages are recomputed from the penalized scores and
        placed in the mini-batches, and β is updated by the adaptive controller when one is configured.
        Returns the batches, the rows with their new advantages, and the metrics kl_reward (the batch
        mean of each response's token-mean KL) and kl_reward_coef (the β used)."""
        objective, r = self.config.objective, self.config.rollout
        beta = self.state.kl_reward_coef
        kl_sum = np.zeros(batch.lengths.shape[0], np.float64)
        kl_mean = np.zeros_like(kl_sum)
        for rows, (policy, _) in zip(minibatches, policy_batches):
            kl = _response_kl(policy.old_logp, policy.ref_logp, policy.response_mask,
                              estimator=objective.kl_estimator)
            total, mean = self.placer.fetch(kl)
            kl_sum[rows], kl_mean[rows] = total, mean
        real = batch.real_rows
        scores = batch.scores[:real] - beta * kl_sum[:real]
        grouped = jnp.asarray(scores.reshape(-1, r.group_size), jnp.float32)
        advantages = np.asarray(_group_advantages(grouped, normalize_by_std=self.objective.scale_advantages))
        advantages = advantages.reshape(-1)
        advantages = np.concatenate([advantages, np.zeros(batch.advantages.shape[0] - real, np.float32)])
        placed = []
        for rows, (policy, micro) in zip(minibatches, policy_batches):
            local = advantages[rows][self.placer.rows(len(rows))]
            placed.append((policy.replace(advantages=self.placer.place(local, len(rows))), micro))
        current = float(kl_mean[:real].mean()) if real else 0.0
        if objective.kl_target and real:
            self.state.kl_reward_coef = adaptive_kl_coef(beta, current, real, objective.kl_target,
                                                         objective.kl_horizon)
        return placed, dataclasses.replace(batch, advantages=advantages), {"kl_reward": current,
                                                                           "kl_reward_coef": beta}

    def learning_rate_of_updates(self, updates: int) -> float | None:
        """The mean learning rate of the next `updates` policy updates (the optimizer counts them in
        policy_updates); None for none."""
        first = self.state.policy_updates
        return float(np.mean(np.asarray(self.learning_rate(np.arange(first, first + updates))))) if updates \
            else None

    def update(self, policy_batches: list[tuple[PolicyBatch, int]]) -> list[dict]:
        """One policy update per mini-batch, in order; advances the counters. Returns each update's
        metrics on the host (one transfer for all), NonFiniteError when one is not finite."""
        step_metrics = []
        for batch, micro in policy_batches:
            self.state.params, self.state.opt_state, metrics = self.policy_step(
                self.state.params, self.state.opt_state, batch, micro)
            step_metrics.append(metrics)
        self.state.policy_updates += len(policy_batches)
        self.state.iteration += 1
        step_metrics = jax.device_get(step_metrics)
        check_finite_steps(step_metrics, self.state.iteration)
        return step_metrics

    def report(self, sampled: dict, batch: TrainingRows, minibatches: list[np.ndarray], logprob_parts: list,
               step_metrics: list[dict], learning_rate: float | None, timing: tuple,
               version: int | None = None) -> dict:
        """The iteration's metrics record (`respo_jax.training.iteration_metrics`; timing: the iteration's
        start, the compile totals then and the rollout's seconds), and its rows trained on as
        `last_rollout` (the rollout file; None when no group was trained on). `version`: the policy
        version that generated the batch (default: the one before this iteration's updates); an
        asynchronous run's record has its staleness (iterations of lag behind the policy before the
        updates) as staleness_mean / staleness_max over the responses."""
        started, compiled_before, rollout_seconds = timing
        logprob = logprob_metrics(self.placer.fetch(logprob_parts), minibatches, batch.sampler_logp,
                                  self.correction)
        rollout = collect_rollout(minibatches, [m.pop("responses") for m in step_metrics], batch.advantages,
                                  batch.lengths, batch.scores, self.config.rollout.group_size,
                                  self.state.iteration, self.state.policy_updates)
        rollout = {key: value[:batch.real_rows] if np.ndim(value) else value for key, value in rollout.items()}
        before = self.state.iteration - 1  # the policy version before this iteration's updates
        version = before if version is None else version
        rollout["policy_version"] = np.full(batch.real_rows, version, np.int32)
        compiled = compilation_totals() - compiled_before
        timings = {"rollout_seconds": rollout_seconds, "iteration_seconds": time.perf_counter() - started,
                   "compiles": compiled.compiles, "compile_seconds": compiled.seconds,
                   **self.take_reward_counts(), "compile_cache_hits": compiled.cache_hits}
        counters = {"phase": "rl", "iteration": self.state.iteration,
                    "policy_updates": self.state.policy_updates}
        record = iteration_record(counters, sampled, timings, logprob, step_metrics, rollout, learning_rate,
                                  self.config.rollout.filter_groups)
        if self.config.rollout.async_steps:
            staleness = before - rollout["policy_version"]
            record["staleness_mean"] = float(staleness.mean()) if staleness.size else 0.0
            record["staleness_max"] = int(staleness.max()) if staleness.size else 0
        rollout.pop("approx_kl")  # in the record, not in the rollout file
        self.last_rollout = rollout if batch.real_rows else None
        return record

    def evaluate(self) -> float | None:
        """Greedy accuracy (the share of responses whose `task.reward` + penalty is > 0; strict box by
        default) on the held-out records; None when there are none."""
        result = self.evaluation()
        return None if result is None else result["greedy_accuracy"]

    def evaluation(self) -> dict | None:
        """The held-out record (`respo_jax.training.held_out`): greedy accuracy, and sampled pass@1 ± its
        standard error when run.eval_samples > 0; None when there are no held-out records."""
        if not self.held_out:
            return None
        run = self.config.run
        return evaluate_held_out(
            self.model(), [self.encode(rec) for rec in self.held_out], self.held_out,
            lambda tokens, lengths, records: self._score_shared(tokens, lengths, records, count=False),
            max_new_tokens=self.config.rollout.max_new_tokens, eos_token_ids=self.tokenizer.eos_ids,
            engine=self.engine, samples=run.eval_samples, temperature=run.eval_temperature,
            top_p=run.eval_top_p)
