"""The RL loop of paper §4.1 at any scale: sample a rollout batch, score it, reuse it for N updates.

One iteration = `reuse * prompts_per_minibatch` prompts × `group_size` responses from the jitted
sampler, the task's reward (strict box by default), group-normalized advantages, log π_old recomputed
by a forward pass of the rollout-time parameters (at the rollout temperature, with the entropy of the
full distribution), then `reuse` (N) mini-batch updates of the chosen objective — consecutive, or in
verl's length-balanced order.
This module is the thin shell around the pure parts: it owns the loop, progress and the metric records
(App. E.3 diagnostics pooled over the rollout batch) and keeps the per-response rollout of the last
iteration (`last_rollout`); writing files is the caller's (`experiments/train.py`).

Two options of verl's: DAPO dynamic sampling (`rollout.filter_groups`: only groups whose responses
differ in accuracy are trained on, more prompt batches drawn to fill the rollout batch) and rollout
correction (`objective.rollout_correction`: each token's loss weighted by π_old / π_sampler, bounded).
"""

from __future__ import annotations

import dataclasses
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
from respo_jax.data.prompts import PromptFormat, encode_prompt, filter_overlong
from respo_jax.data.records import load_dapo_math
from respo_jax.data.synthetic import CharTokenizer
from respo_jax.data.tokenizer import load_tokenizer
from respo_jax.distributed import (
    gather_rows,
    process_rows,
    process_share,
    rows_from_process,
    take_rows,
    to_host,
)
from respo_jax.eval.positive_branch import pooled_diagnostics
from respo_jax.host_allocator import host_allocator_settings, release_host_memory
from respo_jax.models import qwen3
from respo_jax.objectives import get_objective, group_advantages, rollout_correction_weights
from respo_jax.rewards import SCORED, TIMED_OUT, RewardScorer, get_reward, overlong_penalty
from respo_jax.sampling import EngineConfig, SamplingParams, compile_generate, generate
from respo_jax.sharding import (
    ShardingRules,
    bytes_per_device,
    init_optimizer_state,
    make_mesh,
    optimizer_state_shardings,
    state_shardings,
)
from respo_jax.training.batch import (
    PolicyBatch,
    batch_sharding,
    bucket_length,
    build_sequences,
    microbatch_size,
    replay_routing,
)
from respo_jax.training.compilation import compilation_totals, drop_programs_near_map_limit
from respo_jax.training.config import ConfigError, ExperimentConfig
from respo_jax.training.limits import check_limits, check_prompt_buckets, device_memory_bytes
from respo_jax.training.minibatches import minibatch_rows
from respo_jax.training.step import (
    NonFiniteError,
    StepShardings,
    learning_rate_schedule,
    make_logprob_fn,
    make_optimizer,
    make_policy_step,
    make_sft_step,
)


@dataclasses.dataclass
class TrainState:
    """What a checkpoint holds: parameters, optimizer state, counters (and the batches' position)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    opt_state: object
    iteration: int = 0
    policy_updates: int = 0


def load_task(config: ExperimentConfig):
    """(tokenizer, prompt format, training records, held-out records, synthetic task or None)."""
    task_cfg, num_eval = config.task, config.run.eval_problems
    if task_cfg.name == "synthetic":
        task = task_cfg.synthetic_task()
        train_split, test_split = ("train", "test") if task.test_fraction else ("all", "all")
        train = task.make_records(task_cfg.num_records, task_cfg.seed, split=train_split)
        held_out = task.make_records(num_eval, task_cfg.seed + 7919, split=test_split) if num_eval else []
        return CharTokenizer(), task.prompt_format, train, held_out, task
    try:
        tokenizer = load_tokenizer(task_cfg.tokenizer_dir)
    except (OSError, ValueError) as err:
        raise ConfigError(f"task.tokenizer_dir={task_cfg.tokenizer_dir!r}: {err}") from None
    if task_cfg.chat_template and not tokenizer.has_chat_template:
        raise ConfigError(
            f"task.chat_template=true (the default for dapo_math, as the official data preparation renders every "
            f"prompt as a chat message) but the tokenizer in {task_cfg.tokenizer_dir!r} has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja); set task.chat_template=false to "
            "render raw prompts"
        )
    prompt_format = PromptFormat(chat=task_cfg.chat_template)
    records = load_dapo_math(task_cfg.data_dir)
    records, _ = filter_overlong(records, lambda p: encode_prompt(p, tokenizer, prompt_format), task_cfg.max_prompt_tokens)
    if len(records) <= num_eval:
        raise ConfigError(f"run.eval_problems={num_eval}: expected fewer than the task's {len(records)} "
                          f"prompts of at most task.max_prompt_tokens={task_cfg.max_prompt_tokens} tokens")
    order = np.random.default_rng(task_cfg.seed).permutation(len(records))
    records = [records[i] for i in order]
    return tokenizer, prompt_format, records[num_eval:], records[:num_eval], None


def build_mesh(config: ExperimentConfig) -> jax.sharding.Mesh:
    """The run's (data, fsdp, tensor, expert) mesh (`config.mesh`) over every device of every process;
    in a single process, explicit sizes multiplying to fewer devices use the first ones (e.g. a
    one-device run on a host with eight). ConfigError when the sizes do not fit the devices."""
    devices = jax.devices()
    sizes = [getattr(config.mesh, axis) for axis in ("data", "fsdp", "tensor", "expert")]
    if -1 not in sizes and math.prod(sizes) < len(devices) and jax.process_count() == 1:
        devices = devices[:math.prod(sizes)]
    config.mesh.axis_sizes(len(devices))  # a ConfigError naming the mesh keys
    return make_mesh(config.mesh.mesh_config(), devices)


def build_model(config: ExperimentConfig, vocab_size: int, mesh: jax.sharding.Mesh | None = None,
                rules: ShardingRules = ShardingRules()) -> nnx.Module:
    """A fresh Qwen3 from the preset (vocabulary sized to the task's tokenizer), or a local HF checkpoint;
    both in `model.dtype` compute with `model.param_dtype` parameters, kernels chosen for the mesh's
    platform by `qwen3.resolve_config` unless `model.overrides` names them. With `mesh`, every
    parameter is created (or read) directly in its sharding by `rules`, and the model's forward runs
    under them (None: the one-device mesh)."""
    dtype = config.model.dtype
    param_dtype = config.model.param_dtype or dtype
    if config.model.checkpoint_dir:
        try:
            return qwen3.from_pretrained(config.model.checkpoint_dir, dtype=jnp.dtype(param_dtype),
                                         compute_dtype=jnp.dtype(dtype), remat=config.model.remat,
                                         scan_layers=config.model.scan_layers, mesh=mesh, rules=rules)
        except (OSError, ValueError, KeyError) as err:  # a damaged or foreign checkpoint: the user's to fix
            raise ConfigError(f"model.checkpoint_dir={config.model.checkpoint_dir!r}: {err}") from None
    model_cfg = qwen3.Qwen3Config.preset(config.model.preset)
    overrides = dict(config.model.overrides)
    overrides.setdefault("vocab_size", vocab_size)
    overrides.update(remat=config.model.remat, scan_layers=config.model.scan_layers, dtype=dtype,
                     param_dtype=param_dtype)
    model_cfg = dataclasses.replace(model_cfg, **overrides)
    if model_cfg.vocab_size < vocab_size:
        raise ConfigError(f"model.overrides.vocab_size={model_cfg.vocab_size}: expected at least the "
                          f"tokenizer's {vocab_size}")
    try:  # kernels the overrides leave None are chosen for the mesh's platform
        model_cfg = qwen3.resolve_config(model_cfg.replace(rules=rules), mesh)
    except ValueError as err:  # e.g. experts that do not split over mesh.expert
        raise ConfigError(f"mesh: {err}") from None
    return qwen3.init_model(model_cfg, seed=config.run.seed)


class RLTrainer:
    """Runs warm-up and RL iterations for an `ExperimentConfig`; yields one metrics record per step."""

    def __init__(self, config: ExperimentConfig):
        self.config = config.validate().check_paths()
        self.tokenizer, self.prompt_format, train_records, self.held_out, self.task = load_task(config)
        r = config.rollout
        self.batches = PromptBatches(train_records, batch_size=r.reuse * r.prompts_per_minibatch, seed=config.task.seed)
        self.train_records, self._prompt_lengths = train_records, None
        self.prompt_buckets()  # tokenizes the training prompts once (the limits and compile_ahead need them)
        # before the model is built: a refusal costs seconds, not minutes
        check_prompt_buckets(self._prompt_lengths, r.prompt_bucket, r.max_prompt_buckets)
        self._compiled_ahead = not r.compile_ahead  # compile_ahead() runs at the first iteration
        self.objective = get_objective(config.objective.name, **config.objective.hparams)
        if self.objective.aggregation == "seq-mean-token-sum-norm" and self.objective.loss_scale_factor is None:
            # Dr.GRPO's constant is the generation budget, not the padded width of a batch.
            self.objective = dataclasses.replace(self.objective, loss_scale_factor=float(r.max_new_tokens))
        self.correction = config.objective.correction()  # rollout correction, None when off
        self._batch_shapes: set[tuple] = set()  # policy-batch shapes run so far
        self.engine = EngineConfig(prompt_bucket=r.prompt_bucket, max_batch_rows=r.sampler_max_rows)
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
        self.learning_rate = learning_rate_schedule(opt.learning_rate, config.lr_warmup_steps, updates_per_step)
        self.tx = make_optimizer(opt.learning_rate, opt.weight_decay, opt.b1, opt.b2, opt.max_grad_norm,
                                 config.lr_warmup_steps, updates_per_step)
        param_sh = state_shardings(params, self.mesh, self.rules)
        self.shardings = StepShardings(
            params=param_sh, opt_state=optimizer_state_shardings(self.tx, params, param_sh),
            batch=batch_sharding(self.mesh, self.rules),
            replicated=NamedSharding(self.mesh, PartitionSpec()))
        self.state = TrainState(graphdef, params, init_optimizer_state(self.tx, params, param_sh))
        self._policy_step = make_policy_step(graphdef, self.objective, self.tx, temperature=r.temperature,
                                             shardings=self.shardings,
                                             load_balancing_weight=config.objective.load_balancing_weight,
                                             rollout_correction=self.correction)
        self._old_logprobs = make_logprob_fn(graphdef, temperature=r.temperature, return_entropy=True,
                                             shardings=self.shardings)

    def _check_limits(self) -> None:
        """Response length against the model's positions and the sampler's KV cache against the devices'
        memory (`respo_jax.training.limits`), from the model's config alone (a checkpoint's config.json)."""
        model = self.config.model
        if model.checkpoint_dir:
            try:
                model_cfg = qwen3.load_config(model.checkpoint_dir)
            except (OSError, ValueError, KeyError) as err:
                raise ConfigError(f"model.checkpoint_dir={model.checkpoint_dir!r}: {err}") from None
        else:
            fields = {f.name for f in dataclasses.fields(qwen3.Qwen3Config)}
            model_cfg = qwen3.Qwen3Config.preset(
                model.preset, **{k: v for k, v in model.overrides.items() if k in fields})
        longest = max([*self._prompt_lengths, *(len(self._encode(rec)) for rec in self.held_out)])
        check_limits(self.config, model_cfg, longest, device_memory_bytes(self.mesh.devices.flat))

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
        """The JSON part of a checkpoint: counters and the prompt batches' resumable position."""
        return {"iteration": self.state.iteration, "policy_updates": self.state.policy_updates,
                "batches": self.batches.get_state()}

    def restore_meta(self, meta: dict) -> None:
        self.state.iteration, self.state.policy_updates = int(meta["iteration"]), int(meta["policy_updates"])
        self.batches.set_state(meta["batches"])

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
                      count: bool = True) -> np.ndarray:
        """`score` of every response, each process verifying its even share of them
        (`respo_jax.distributed.process_share`; all in one process) and the scores then exchanged, so
        the (host-bound) reward work is split over the hosts and every process ends up with all scores.
        With `count`, the failed and timed-out rewards are added to `reward_counts` (the next metrics
        record's `reward_failures` / `reward_timeouts`, see `take_reward_counts`)."""
        share = process_share(len(records))
        scores, status = self.score(tokens[share], lengths[share], take_rows(records, share))
        status = gather_rows(status, share, len(records))
        if count:
            self.reward_counts["reward_failures"] += int(np.sum(status != SCORED))
            self.reward_counts["reward_timeouts"] += int(np.sum(status == TIMED_OUT))
        return gather_rows(scores, share, len(records))

    def take_reward_counts(self) -> dict:
        """The failed / timed-out rewards counted since the last call (responses, this iteration's)."""
        counts, self.reward_counts = self.reward_counts, {"reward_failures": 0, "reward_timeouts": 0}
        return counts

    def _encode(self, record: dict) -> list[int]:
        return encode_prompt(record["problem"], self.tokenizer, self.prompt_format)

    def model(self) -> nnx.Module:
        return nnx.merge(self.state.graphdef, self.state.params)

    # -- supervised warm-up ----------------------------------------------------------------------------
    def warmup(self) -> Iterator[dict]:
        """Supervised steps on reference responses, with their own AdamW (a weak 'base model')."""
        cfg = self.config.warmup
        if cfg.steps == 0:
            return
        if self.task is None:
            raise ValueError("warmup needs reference responses: only the synthetic task has them")
        tx = make_optimizer(cfg.learning_rate, 0.0, 0.9, 0.999, 1.0, 0)
        opt_shardings = optimizer_state_shardings(tx, self.state.params, self.shardings.params)
        opt_state = init_optimizer_state(tx, self.state.params, self.shardings.params)
        step = make_sft_step(self.state.graphdef, tx, self.shardings.params, opt_shardings,
                             self.shardings.batch)
        rng = np.random.default_rng(self.config.run.seed + 1)
        for index in range(cfg.steps):
            records = self._warmup_records(rng, cfg.batch_size)
            prompts = [self._encode(r) for r in records]
            responses = [self.tokenizer.encode(self.task.reference_solution(r)) + [self.tokenizer.eos_id]
                         for r in records]
            width = max(len(r) for r in responses)
            padded = np.array([r + [self.tokenizer.pad_id] * (width - len(r)) for r in responses], np.int32)
            lengths = np.array([len(r) for r in responses], np.int32)
            part = process_rows(self.shardings.batch, len(records))  # this process's rows only
            ids, positions, attention, response_mask, prompt_len = build_sequences(
                take_rows(prompts, part), padded[part], lengths[part], self.tokenizer.pad_id,
                prompt_len=max(len(p) for p in prompts))
            loss_mask = np.zeros(ids.shape, np.float32)
            loss_mask[:, prompt_len:] = response_mask
            inputs = [rows_from_process(self.shardings.batch, a, len(records))
                      for a in (ids, positions, attention, loss_mask)]
            self.state.params, opt_state, loss, finite = step(self.state.params, opt_state, *inputs)
            loss = float(loss)
            if not (np.isfinite(loss) and bool(finite)):
                quantity = f"sft_loss is {loss}" if not np.isfinite(loss) else "the parameters hold NaN/inf"
                raise NonFiniteError(f"warm-up step {index + 1}: {quantity}; the run stops before any "
                                     "checkpoint")
            yield {"phase": "warmup", "step": index + 1, "sft_loss": loss}

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
    def rollout(self, records: list[dict], seed: int):
        """Samples `group_size` responses per record; returns prompts, sampler output and ±1 scores."""
        r = self.config.rollout
        prompts = [self._encode(rec) for rec in records]
        out = generate(self.model(), prompts, self._sampling_params(seed), engine=self.engine,
                       return_routing=r.routing_replay)
        # Every process gets every response (a gather across processes): the layout of the policy
        # batches (bucketed lengths, verl's balanced order), the metrics and the rollout file need them.
        out = jax.tree.map(to_host, out)
        scores = self._score_shared(np.asarray(out.tokens), np.asarray(out.lengths),
                                    [rec for rec in records for _ in range(r.group_size)])
        expanded_prompts = [p for p in prompts for _ in range(r.group_size)]
        return expanded_prompts, out, scores

    def _sampling_params(self, seed: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            seed=seed, eos_token_ids=self.tokenizer.eos_ids, num_samples=r.group_size,
        )

    def prompt_buckets(self) -> list[int]:
        """The padded prompt lengths the training prompts can need (every batch's longest prompt falls
        in the bucket of one of them), ascending."""
        if self._prompt_lengths is None:  # tokenizes every training prompt once (seconds for DAPO-Math)
            self._prompt_lengths = {len(self._encode(rec)) for rec in self.train_records}
        bucket = self.config.rollout.prompt_bucket
        return sorted({bucket_length(length, bucket) for length in self._prompt_lengths})

    def compile_ahead(self) -> int:
        """Compiles the rollout's sampler programs and the mini-batch's log π_old and update programs for
        every prompt bucket of the training prompts, with responses at the longest response bucket
        (`rollout.compile_ahead`); returns the number of buckets.

        Why: a batch whose longest prompt first reaches a bucket would otherwise stop a later
        iteration to compile (seconds per program at the real vocabulary); compiled here, the run
        pays it once at its start. A mini-batch whose responses all end early (a smaller response
        bucket) still compiles when it first occurs. Nothing runs: the programs are lowered from the
        shapes and shardings of placeholder batches built as `policy_batch` builds real ones."""
        r = self.config.rollout
        model, rows = self.model(), r.prompts_per_minibatch * r.group_size
        responses = np.full((rows, r.max_new_tokens), self.tokenizer.pad_id, np.int32)
        lengths = np.full(rows, r.max_new_tokens, np.int32)
        buckets = self.prompt_buckets()
        for prompt_len in buckets:
            compile_generate(model, prompt_len, r.reuse * r.prompts_per_minibatch, self._sampling_params(0),
                             engine=self.engine, return_routing=r.routing_replay)
            routing = None
            if r.routing_replay:
                cfg = self.model_config
                routing = tuple(np.zeros((cfg.num_moe_layers, rows, length, cfg.num_experts_per_tok), np.int32)
                                for length in (prompt_len, r.max_new_tokens))
            sampler_logp = np.zeros(responses.shape, np.float32) if self.correction else None
            batch, micro = self.policy_batch([[self.tokenizer.pad_id] * prompt_len] * rows, responses, lengths,
                                             np.zeros(rows, np.float32), routing, sampler_logp)
            self._old_logprobs.lower(self.state.params, batch, micro).compile()
            self._policy_step.lower(self.state.params, self.state.opt_state, batch, micro).compile()
            _drop_programs_near_map_limit()
        self._release_host_memory()  # what compiling freed, before the first step allocates
        return len(buckets)

    def _release_host_memory(self, shape: tuple | None = None) -> None:
        """Return the heap's free memory to the OS (`respo_jax.host_allocator`, when configured: CPU runs)
        when a policy batch of a new `shape` first runs (the last shapes' freed temp buffers would stay
        as holes the new one does not fit), or unconditionally when `shape` is None."""
        if shape is not None:
            if shape in self._batch_shapes:
                return
            self._batch_shapes.add(shape)
            _drop_programs_near_map_limit()  # a new shape: new programs follow
        if host_allocator_settings()["applied"]:
            release_host_memory()

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
        (`respo_jax.distributed.rows_from_process`)."""
        r = self.config.rollout
        rows = len(prompts)
        prompt_len = bucket_length(max(len(p) for p in prompts), r.prompt_bucket)
        response_len = bucket_length(max(int(lengths.max()), 1), r.response_bucket, r.max_new_tokens)
        part = process_rows(self.shardings.batch, rows)
        ids, positions, attention, response_mask, prompt_len = build_sequences(
            take_rows(prompts, part), tokens[part], lengths[part], self.tokenizer.pad_id,
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
        batch = jax.tree.map(lambda x: rows_from_process(self.shardings.batch, x, rows), local)
        micro = microbatch_size(rows, shape[1], r.max_tokens_per_microbatch)
        shards = self.batch_shards
        return batch, min(rows, -(-micro // shards) * shards)

    def _rollout_seed(self, generation_batch: int) -> int:
        """The sampler seed of a generation batch of this iteration: the first one's is the run's
        historical seed + iteration, later ones (dynamic sampling) one derived from (seed, iteration,
        index): a pure function of the counters a checkpoint holds, so a resumed run draws the same."""
        seed, iteration = self.config.run.seed, self.state.iteration
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

    def _sample_groups(self) -> dict:
        """The groups to train on and the counts of how they were drawn.

        Without `rollout.filter_groups`: the next prompt batch's N·M groups. With it (verl's DAPO
        recipe): generation batches of N·M prompts (the next prompt batches, each its own seed) are
        drawn until N·M groups whose responses differ in raw accuracy are kept, in order, the extras of
        the last batch dropped, or `rollout.max_generation_batches` were drawn. Returns host arrays of
        the kept rows (prompt-major, G per group): prompts, tokens, lengths, sampler_logp, scores,
        prompt_routing/routing (None unless routing_replay), and every generated response's scores and
        lengths ("all_scores", "all_lengths") and the counts."""
        r = self.config.rollout
        num_prompts, group = r.reuse * r.prompts_per_minibatch, r.group_size
        parts, all_scores, all_lengths = [], [], []
        kept = generated = batches = 0
        while True:
            records = next(self.batches)
            prompts, out, scores = self.rollout(records, seed=self._rollout_seed(batches))
            batches += 1
            lengths = np.asarray(out.lengths)
            all_scores.append(scores)
            all_lengths.append(lengths)
            generated += num_prompts
            if not r.filter_groups:
                return {"prompts": prompts, "tokens": np.asarray(out.tokens), "lengths": lengths,
                        "sampler_logp": np.asarray(out.logprobs), "scores": scores,
                        "prompt_routing": out.prompt_routing, "routing": out.routing,
                        "all_scores": scores, "all_lengths": lengths,
                        "groups_generated": generated, "groups_kept": num_prompts, "generation_batches": 1}
            accuracy = self.raw_accuracy(scores, lengths).reshape(num_prompts, group)
            informative = np.nonzero(accuracy.any(axis=1) & ~accuracy.all(axis=1))[0][:num_prompts - kept]
            rows = (informative[:, None] * group + np.arange(group)).reshape(-1)
            parts.append(([prompts[i] for i in rows], np.asarray(out.tokens)[rows], lengths[rows],
                          np.asarray(out.logprobs)[rows], scores[rows]))
            kept += len(informative)
            if kept == num_prompts or batches == r.max_generation_batches:
                break
        return {"prompts": [p for part in parts for p in part[0]],
                **{key: np.concatenate([part[i] for part in parts])
                   for i, key in enumerate(("tokens", "lengths", "sampler_logp", "scores"), start=1)},
                "prompt_routing": None, "routing": None,
                "all_scores": np.concatenate(all_scores), "all_lengths": np.concatenate(all_lengths),
                "groups_generated": generated, "groups_kept": kept, "generation_batches": batches}

    def iteration(self) -> dict:
        """One rollout batch and its N policy updates; returns the iteration's metrics record.

        With `rollout.filter_groups`, a rollout batch that ends with K < N·M informative groups (after
        `rollout.max_generation_batches`) is trained on as verl's actor splits a smaller batch: ceil(K/M)
        mini-batches of M groups, the last one holding the rest, filled up to the compiled shape with
        rows whose response mask is zero (they add nothing to any loss, denominator or gradient); K = 0
        makes no update. The record says so: groups_generated, groups_kept, generation_batches and
        updates (the policy updates made)."""
        cfg = self.config
        r = cfg.rollout
        started = time.perf_counter()
        compiled_before = compilation_totals()
        if not self._compiled_ahead:  # counted in this (the first) iteration's compiles and time
            self.compile_ahead()
            self._compiled_ahead = True
        rollout_started = time.perf_counter()  # after compile_ahead: rollout_seconds is the rollout alone
        sampled = self._sample_groups()
        rollout_seconds = time.perf_counter() - rollout_started
        kept, group, per_minibatch = sampled["groups_kept"], r.group_size, r.prompts_per_minibatch
        updates = -(-kept // per_minibatch)  # N unless dynamic sampling fell short
        prompts, scores = sampled["prompts"], sampled["scores"]
        lengths, tokens, sampler_logp = sampled["lengths"], sampled["tokens"], sampled["sampler_logp"]
        prompt_routing, routing = sampled["prompt_routing"], sampled["routing"]  # None unless routing_replay
        advantages = np.asarray(group_advantages(jnp.asarray(scores.reshape(kept, group)),
                                                 normalize_by_std=self.objective.scale_advantages)).reshape(-1)
        real_rows = kept * group
        filler = (updates * per_minibatch - kept) * group  # rows of no weight completing the last mini-batch
        if filler:
            prompts = prompts + [prompts[0]] * filler
            pad_tokens = np.full((filler, tokens.shape[1]), self.tokenizer.pad_id, tokens.dtype)
            tokens = np.concatenate([tokens, pad_tokens])
            pad_logp = np.zeros((filler, sampler_logp.shape[1]), np.float32)
            sampler_logp = np.concatenate([sampler_logp, pad_logp])
            lengths, scores, advantages = (np.concatenate([a, np.zeros(filler, a.dtype)])
                                           for a in (lengths, scores, advantages))

        # N mini-batches of M prompts × G responses: consecutive (paper §4.1) or verl's balanced order.
        sequence_lengths = np.array([len(p) for p in prompts]) + lengths
        minibatches = []
        if updates:
            minibatches = minibatch_rows(r.minibatch_order, sequence_lengths, updates, r.balance_ranks)
        # Each mini-batch in its own bucketed shape; log π_old (and the rollout-time entropy) of all of
        # them under the rollout-time parameters, before any update.
        batches, gap, entropy, response_tokens, pooled = [], 0.0, 0.0, 0.0, []
        for rows in minibatches:
            replay = (prompt_routing[:, rows], routing[:, rows]) if r.routing_replay else None
            batch, micro = self.policy_batch([prompts[i] for i in rows], tokens[rows], lengths[rows],
                                             advantages[rows], replay,
                                             sampler_logp[rows] if self.correction else None)
            self._release_host_memory(batch.input_ids.shape)
            old_logp, token_entropy = self._old_logprobs(self.state.params, batch, micro)
            batches.append((batch.replace(old_logp=old_logp), micro))
            mask = to_host(batch.response_mask)
            gap += float(np.abs(sampler_logp[rows, :mask.shape[1]] * mask - to_host(old_logp)).sum())
            entropy += float(to_host(token_entropy).sum())
            response_tokens += float(mask.sum())
            if self.correction:
                pooled.append((to_host(old_logp), sampler_logp[rows, :mask.shape[1]], mask))
        response_tokens = max(response_tokens, 1.0)

        # The optimizer's update count is policy_updates; the learning rate of each update, for the record.
        first = self.state.policy_updates
        learning_rates = np.asarray(self.learning_rate(np.arange(first, first + max(updates, 1))))
        step_metrics = []
        for batch, micro in batches:
            self.state.params, self.state.opt_state, metrics = self._policy_step(
                self.state.params, self.state.opt_state, batch, micro)
            step_metrics.append(metrics)
        self.state.policy_updates += updates
        self.state.iteration += 1
        step_metrics = jax.device_get(step_metrics)
        check_finite_steps(step_metrics, self.state.iteration)
        rollout = self._collect_rollout(minibatches, [m.pop("responses") for m in step_metrics],
                                        advantages, lengths, scores)
        rollout = {key: value[:real_rows] if np.ndim(value) else value for key, value in rollout.items()}
        lengths, advantages = lengths[:real_rows], advantages[:real_rows]
        compiled = compilation_totals() - compiled_before
        all_scores = sampled["all_scores"]
        record = {
            "phase": "rl",
            "iteration": self.state.iteration,
            "policy_updates": self.state.policy_updates,
            "score": float(all_scores.mean()),
            "train_accuracy": float((all_scores.mean() + 1.0) / 2.0),
            "response_length": float(sampled["all_lengths"].mean()),
            "sampler_trainer_logp_gap": gap / response_tokens,
            "rollout_seconds": rollout_seconds,
            "iteration_seconds": time.perf_counter() - started,
            "compiles": compiled.compiles,
            "compile_seconds": compiled.seconds,
            **self.take_reward_counts(),
            "compile_cache_hits": compiled.cache_hits,
        }
        if r.filter_groups:
            record.update(groups_generated=sampled["groups_generated"], groups_kept=kept,
                          generation_batches=sampled["generation_batches"], updates=updates)
        for key in (step_metrics[0] if step_metrics else ()):
            values = np.array([float(m[key]) for m in step_metrics])
            record[key] = float(values.mean())
            if key == "log_w_mean":
                record["log_w_mean_last_minibatch"] = float(values[-1])
        if pooled:  # the sampler/trainer ratio over the whole rollout batch
            record.update(rollout_correction_metrics(pooled, self.correction))
        if real_rows:
            # Pooled over the whole rollout batch (not means of the N mini-batches' ratios).
            diagnostics = pooled_diagnostics(rollout["log_w"], advantages, rollout["phi"], lengths)
            record.update(diagnostics)
            record["positive_low_w_fraction"] = diagnostics["positive_low_w_share"]
        non_empty = lengths > 0
        record["approx_kl"] = float(rollout.pop("approx_kl")[non_empty].mean()) if non_empty.any() else 0.0
        record["entropy"] = entropy / response_tokens
        if updates:
            record["learning_rate"] = float(np.mean(learning_rates))
        self.last_rollout = rollout if real_rows else None  # None: no group was trained on
        return record

    def _collect_rollout(self, minibatches, responses, advantages, lengths, scores) -> dict:
        """The per-response arrays of one iteration in prompt-major row order (the rollout file's layout,
        `respo_jax.eval.rollout_files`), plus the responses' k1 approx-KL under key "approx_kl"."""
        rows = advantages.shape[0]
        out = {key: np.zeros(rows, np.float32) for key in ("log_w", "phi", "approx_kl")}
        minibatch = np.full(rows, -1, np.int32)
        for index, (row_ids, values) in enumerate(zip(minibatches, responses)):
            minibatch[row_ids] = index
            for key in out:
                out[key][row_ids] = np.asarray(values[key], np.float32)
        if np.any(minibatch < 0):
            raise AssertionError(f"rows {np.nonzero(minibatch < 0)[0][:5].tolist()} belong to no mini-batch")
        return {
            **out,
            "advantage": advantages.astype(np.float32),
            "length": lengths.astype(np.int32),
            "reward": np.asarray(scores, np.float32),
            "minibatch": minibatch,
            "group": (np.arange(rows) // self.config.rollout.group_size).astype(np.int32),
            "iteration": np.int64(self.state.iteration),
            "policy_updates": np.int64(self.state.policy_updates),
        }

    def evaluate(self) -> float | None:
        """Greedy accuracy (the share of responses whose `task.reward` + penalty is > 0; strict box by
        default) on the held-out records; None when there are none."""
        if not self.held_out:
            return None
        prompts = [self._encode(rec) for rec in self.held_out]
        params = SamplingParams(max_new_tokens=self.config.rollout.max_new_tokens, temperature=0.0,
                                eos_token_ids=self.tokenizer.eos_ids)
        out = jax.tree.map(to_host, generate(self.model(), prompts, params, engine=self.engine))
        scores = self._score_shared(np.asarray(out.tokens), np.asarray(out.lengths), self.held_out,
                                    count=False)
        return float(np.mean(scores > 0))


def _drop_programs_near_map_limit() -> None:
    """`respo_jax.training.compilation.drop_programs_near_map_limit`, said on stderr when it drops."""
    maps = drop_programs_near_map_limit()
    if maps is not None:
        print(f"dropped the compiled programs from memory: this process held {maps[0]:,} of its {maps[1]:,} "
              "memory mappings (vm.max_map_count); programs needed again are reloaded from the compilation "
              "cache", file=sys.stderr)


def rollout_correction_metrics(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], correction) -> dict:
    """The rollout-correction metrics (`rollout_correction_weights`) pooled over mini-batches given as
    (old_logp, sampler_logp, mask) of [rows, width_k] each: the rows padded to one width and stacked."""
    width = max(mask.shape[1] for _, _, mask in parts)

    def stacked(index: int) -> np.ndarray:
        return np.concatenate([np.pad(part[index], ((0, 0), (0, width - part[index].shape[1])))
                               for part in parts])

    _, metrics = rollout_correction_weights(stacked(0), stacked(1), stacked(2), correction)
    return {key: float(value) for key, value in metrics.items()}


def check_finite_steps(step_metrics: list[dict], iteration: int) -> None:
    """Raises NonFiniteError naming the first mini-batch of `iteration` whose loss, gradient norm or updated
    parameters are not finite; removes the `params_finite` flags (not a metric) from `step_metrics`."""
    problem = None
    for index, metrics in enumerate(step_metrics, start=1):
        finite = bool(metrics.pop("params_finite", True))
        if problem is not None:
            continue
        for key in ("loss", "grad_norm"):
            if not np.isfinite(float(metrics[key])):
                problem = f"mini-batch {index}/{len(step_metrics)}: {key} is {float(metrics[key])}"
                break
        else:
            if not finite:
                problem = f"mini-batch {index}/{len(step_metrics)}: the updated parameters hold NaN/inf"
    if problem is not None:
        raise NonFiniteError(f"iteration {iteration}, {problem}; the run stops before any checkpoint is "
                             "written")
