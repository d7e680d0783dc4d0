"""The RL loop of paper §4.1 at any scale: sample a rollout batch, score it, reuse it for N updates.

One iteration = `reuse * prompts_per_minibatch` prompts × `group_size` responses from the jitted
sampler, the task's reward (strict box by default), group-normalized advantages, log π_old recomputed
by a forward pass of the rollout-time parameters (at the rollout temperature, with the entropy of the
full distribution), then `reuse` (N) mini-batch updates of the chosen objective — consecutive, or in
verl's length-balanced order. `RLTrainer.iteration` is that loop, one named call per step, each step
on typed values (`rows.SampledGroups`, `rows.TrainingRows`, `PolicyBatch`).

The rest lives beside it: start-up checks (`startup`), batch layout (`batch_layout`), compile-ahead
(`compile_ahead`), the supervised warm-up (`warmup`), reward scoring across processes (`scoring`),
held-out evaluation (`held_out`), metric records (`iteration_metrics`), and the whole run — checkpoints,
resume, logs — in `respo_jax.training.run`.

Two options of verl's: DAPO dynamic sampling (`rollout.filter_groups`: only groups whose responses
differ in accuracy are trained on, more prompt batches drawn to fill the rollout batch) and rollout
correction (`objective.rollout_correction`: each token's loss weighted by π_old / π_sampler, bounded).
"""

from __future__ import annotations

import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from respo_jax.data.batches import PromptBatches
from respo_jax.data.prompts import encode_prompt
from respo_jax.objectives import get_objective
from respo_jax.sampling import EngineConfig, SamplingParams, generate
from respo_jax.sharding import (ShardingRules, axis_size, init_optimizer_state, optimizer_state_shardings,
                                state_shardings)
from respo_jax.training import compile_ahead, startup
from respo_jax.training.async_rollouts import AsyncRollouts, Resharder, rollout_mesh_logprobs
from respo_jax.training.batch import PolicyBatch, batch_sharding
from respo_jax.training.batch_layout import BatchLayout
from respo_jax.training.compilation import compilation_totals
from respo_jax.training.checkpoint import TrainState
from respo_jax.training.config import ExperimentConfig
from respo_jax.training.held_out import trainer_held_out_record
from respo_jax.training.kl_reward import (advantages_program, kl_penalized_advantages, reference_policy,
                                          response_kl_program)
from respo_jax.training.limits import check_prompt_buckets
from respo_jax.training.iteration_metrics import check_finite_steps, rl_record
from respo_jax.training.minibatches import minibatch_rows
from respo_jax.training.model_setup import build_mesh, build_model, rollout_placement
from respo_jax.training.placement import RowPlacer
from respo_jax.programs import Program, jit_program
from respo_jax.training.rows import SampledGroups, TrainingRows
from respo_jax.training.scoring import ResponseScorer, raw_accuracy
from respo_jax.training.shapes import ShapeTracker
from respo_jax.training.step import (OLD_LOGPROBS_KEY, StepShardings, learning_rate_schedule,
                                     old_logprobs_from_update, run_optimizer, run_step_programs,
                                     schedule_updates)
from respo_jax.training.tasks import load_task
from respo_jax.training.warmup import WarmupPosition, sft_warmup


class RLTrainer:
    """Runs warm-up and RL iterations for an `ExperimentConfig`; yields one metrics record per step."""

    def __init__(self, config: ExperimentConfig, checked: bool = False):
        """`checked`: the caller has validated `config` and checked its paths (`run.run` does, before it
        takes the run directory), so they are not checked twice."""
        self.config = config if checked else config.validate().check_paths()
        task = load_task(config)
        self.tokenizer, self.prompt_format, self.held_out = task.tokenizer, task.prompt_format, task.held_out
        self.task, self.train_records, self.prompt_ids = task.synthetic, task.train, task.prompt_ids
        r, objective = config.rollout, config.objective
        self.batches = PromptBatches(task.train, batch_size=r.reuse * r.prompts_per_minibatch,
                                     seed=config.task.seed)
        # The training prompts' lengths (load_task tokenized them): the limits and compile_ahead need them.
        self.shapes = ShapeTracker(task.train_prompt_lengths, r.padded_prompt_length,
                                   compile_ahead=r.compile_ahead)
        # before the model is built or read: a refusal costs seconds, not minutes
        check_prompt_buckets(self.shapes.prompt_lengths, r.prompt_bucket, r.max_prompt_buckets,
                             r.prompt_buckets)
        self.objective = get_objective(objective.name, **objective.hparams).for_budget(r.max_new_tokens)
        self.correction = objective.correction()  # rollout correction, None when off
        startup.check_reference_checkpoint(config)
        self.engine: EngineConfig = r.engine_config()  # the rollouts' and the held-out evaluation's
        # per-response arrays of the last iteration (rollout file); None when it trained on no response
        self.last_rollout: dict | None = None
        self.mesh, self.rules = build_mesh(config), ShardingRules()
        held_out_lengths = [len(self.encode(rec)) for rec in self.held_out]
        startup.check_before_build(config, self.mesh, max([*self.shapes.prompt_lengths, *held_out_lengths]))
        model = build_model(config, self.tokenizer.vocab_size, self.mesh, self.rules)
        self.model_config = model.config
        startup.check_mesh_fits(config, model.config, self.mesh, self.rules)
        graphdef, params = nnx.split(model)
        self.tx = run_optimizer(config)
        param_sh = state_shardings(params, self.mesh, self.rules)
        self.shardings = StepShardings(
            params=param_sh, opt_state=optimizer_state_shardings(self.tx, params, param_sh),
            batch=batch_sharding(self.mesh, self.rules), replicated=NamedSharding(self.mesh, PartitionSpec()))
        # One program each, not one per jnp op: the schedule, the group advantages, the reward's KL.
        schedule = learning_rate_schedule(config.optim.learning_rate, config.lr_warmup_steps,
                                          schedule_updates(config))
        replicated = self.shardings.replicated
        self.learning_rate = jit_program(Program(schedule, "learning_rate", in_shardings=replicated,
                                                 out_shardings=replicated))
        self.group_advantages = jit_program(advantages_program(replicated))
        self.response_kl = jit_program(response_kl_program(self.shardings.batch))
        self.placer = RowPlacer(self.shardings.batch)  # each process's rows of every batch
        self.scorer = ResponseScorer(config, self.tokenizer, self.prompt_format, self.placer)
        # Rows per shared prompt in the update's batches (`rollout.share_prompts`; 1: none), resolved once.
        shards = axis_size(self.mesh, self.rules.mesh_axes("batch"))  # devices a batch is split over
        prompt_group = r.group_size if (r.share_prompts and r.minibatch_order == "consecutive"
                                        and not model.config.is_moe and shards == 1) else 1
        self.layout = BatchLayout(r, self.tokenizer.pad_id, self.placer, shards, prompt_group)
        self.state = TrainState(graphdef, params, init_optimizer_state(self.tx, params, param_sh),
                                kl_reward_coef=float(objective.kl_coef))
        # traced programs kept for the next launch (one device, with a compilation cache; else None)
        self.programs = compile_ahead.program_cache(config, model.config)
        # (params, opt_state, batch, micro) -> (params, opt_state, metrics), and
        # (params, batch, micro) -> (old_logp, token entropy) [rows, response_len].
        self.policy_step, self.old_logprobs = run_step_programs(config, graphdef, self.tx, self.shardings,
                                                                self.mesh, cache=self.programs)
        # log π_old from the sampler or a forward pass of its own (`rollout.old_logprobs`), decided once
        self.old_logprobs_source = r.old_logprobs_source(dtype=config.model.dtype, moe=model.config.is_moe,
                                                         correction=self.correction is not None)
        # synchronous rollouts, log π_old recomputed: the first update's forward gives mini-batch 1's
        self.old_logprobs_from_update = old_logprobs_from_update(config, self.old_logprobs_source)
        # the sampler's mesh, model structure and parameter shardings (mesh.rollout_devices)
        self.rollout_mesh, self.rollout_graphdef, self.rollout_shardings = rollout_placement(
            config, model.config, self.mesh, self.rules, graphdef, param_sh)
        # the rollout jobs of an asynchronous run (rollout.async_steps >= 1), started by the first iteration
        self.async_rollouts: AsyncRollouts | None = None
        self._batches_resume_state = None  # async: the prompt stream's position after the last trained batch
        self.restored_behaviour = None  # async: a checkpoint's behaviour parameters of the jobs in flight
        self.warmup_position: WarmupPosition | None = None  # after each warm-up step (`warmup`)
        self._resharder: Resharder | None = None  # trainer -> rollout mesh, built at the first reshard
        # log π_behaviour recomputed on the rollout mesh, under the copy held there (None on one mesh)
        self.rollout_logprobs = rollout_mesh_logprobs(self)

    def model(self) -> nnx.Module:
        return nnx.merge(self.state.graphdef, self.state.params)

    def encode(self, record: dict) -> list[int]:
        """The prompt tokens of a record, in the task's prompt format (the task's own were tokenized once,
        by `load_task`)."""
        ids = self.prompt_ids.get(record["problem"])
        if ids is None:
            return encode_prompt(record["problem"], self.tokenizer, self.prompt_format)
        return ids.tolist()

    def warmup(self, start: WarmupPosition | None = None) -> Iterator[dict]:
        """Supervised steps on reference responses, with their own AdamW, from the first step or from a
        warm-up checkpoint's `start` (`respo_jax.training.warmup`); sets `warmup_position`."""
        return sft_warmup(self, start)

    def evaluation(self) -> dict | None:
        """The held-out record (`held_out.trainer_held_out_record`): greedy accuracy (the share of responses
        whose `task.reward` + penalty is > 0), and sampled pass@1 ± its standard error when
        run.eval_samples > 0; None when there are no held-out records."""
        return trainer_held_out_record(self)

    # -- what a checkpoint holds besides the parameters (`respo_jax.training.run`) ----------------------
    def batches_position(self) -> dict:
        """The prompt stream's resumable position; asynchronous: after the last trained batch (the jobs in
        flight drew beyond it and are regenerated from it on resume)."""
        resume = self._batches_resume_state
        return self.batches.get_state() if resume is None else resume

    def ensure_reference(self) -> None:
        """Holds the frozen reference once RL starts, after any warm-up (`kl_reward.reference_policy`); a
        resumed run's comes from its checkpoint."""
        if self.config.objective.uses_reference and self.state.reference is None:
            self.state.reference = reference_policy(self.config.objective, self.state.params)

    # -- RL --------------------------------------------------------------------------------------------
    def iteration(self) -> dict:
        """One rollout batch and its N policy updates (paper §4.1); returns the iteration's metrics record."""
        started, compiled_before = time.perf_counter(), compilation_totals()
        # the programs of every prompt bucket, in the first iteration's compiles and time
        self.shapes.compile_ahead_once(lambda: compile_ahead.compile_ahead(self))
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
            policy_batches, batch, kl_reward, self.state.kl_reward_coef = kl_penalized_advantages(
                batch, minibatches, policy_batches, self.state.kl_reward_coef, self.config.objective,
                self.objective.scale_advantages, self.config.rollout.group_size, self.placer,
                self.response_kl, self.group_advantages)
        learning_rate = self.learning_rate_of_updates(len(policy_batches))
        step_metrics = self.update(policy_batches, logprob_parts)  # the N policy updates
        record = self.report(sampled, batch, minibatches, logprob_parts, step_metrics, learning_rate,
                             timing=(started, compiled_before, rollout_seconds), version=behaviour[0])
        return {**record, **kl_reward}

    def rollout(self, records: list[dict], seed: int, params=None, counts: dict | None = None):
        """Samples `group_size` responses per record with `params` (on the rollout mesh; None: the
        trainer's current ones); returns prompts, sampler output and scores (the reward's failures
        counted into `counts`, default the trainer's)."""
        r = self.config.rollout
        prompts = [self.encode(rec) for rec in records]
        model = self.model() if params is None else nnx.merge(self.rollout_graphdef, params)
        out = generate(model, prompts, self.sampling_params(seed), engine=self.engine,
                       return_routing=r.routing_replay)
        # Every process gets every response (a gather across processes): the layout of the policy
        # batches (bucketed lengths, verl's balanced order), the metrics and the rollout file need them.
        out = self.placer.fetch(out)
        expanded = [rec for rec in records for _ in range(r.group_size)]
        scores = self.scorer.score_shared(np.asarray(out.tokens), np.asarray(out.lengths), expanded,
                                          counts=counts)
        return [p for p in prompts for _ in range(r.group_size)], out, scores

    def sampling_params(self, seed: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            seed=seed, eos_token_ids=self.tokenizer.eos_ids, num_samples=r.group_size,
            return_entropy=self.old_logprobs_source == "sampler")

    def rollout_seed(self, generation_batch: int, iteration: int | None = None) -> int:
        """The sampler seed of a generation batch of this iteration: the first one's is the run's
        seed + iteration, later ones (dynamic sampling) one derived from (seed, iteration,
        index): a pure function of the counters a checkpoint holds, so a resumed run draws the same.
        `iteration`: the iterations done before the batch's (default: the trainer's count)."""
        seed = self.config.run.seed
        iteration = self.state.iteration if iteration is None else iteration
        if generation_batch == 0:
            return seed * 1_000_003 + iteration
        sequence = np.random.SeedSequence([seed, iteration, generation_batch])
        return int(sequence.generate_state(1, np.uint64)[0])

    def sample_groups(self, iteration: int | None = None, params=None) -> SampledGroups:
        """The groups to train on and the counts of how they were drawn (`SampledGroups`).

        Without `rollout.filter_groups`: the next prompt batch's N·M groups. With it (verl's DAPO
        recipe): generation batches of N·M prompts (the next prompt batches, each its own seed) are
        drawn until N·M groups whose responses differ in raw accuracy are kept, in order, the extras of
        the last batch dropped, or `rollout.max_generation_batches` were drawn.

        `iteration` (the iterations done before the batch's; default the trainer's count) picks the
        sampler seeds and `params` the sampling parameters (`rollout`): an asynchronous rollout job's.
        The reward's failures are counted in `reward_counts` when `iteration` is given."""
        r = self.config.rollout
        num_prompts, group = r.reuse * r.prompts_per_minibatch, r.group_size
        counts = None if iteration is None else {"reward_failures": 0, "reward_timeouts": 0}
        parts, all_scores, all_lengths = [], [], []
        kept = generated = batches = 0
        while True:
            records = next(self.batches)
            seed = self.rollout_seed(batches, iteration)
            prompts, out, scores = self.rollout(records, seed, params, counts)
            batches += 1
            lengths = np.asarray(out.lengths)
            drawn = SampledGroups(
                prompts=prompts, tokens=np.asarray(out.tokens), lengths=lengths,
                sampler_logp=np.asarray(out.logprobs),
                sampler_entropy=None if out.entropy is None else np.asarray(out.entropy), scores=scores,
                prompt_routing=out.prompt_routing, routing=out.routing, all_scores=scores,
                all_lengths=lengths,
                groups_generated=num_prompts, groups_kept=num_prompts, generation_batches=1)
            generated += num_prompts
            if not r.filter_groups:
                sampled = drawn
                break
            all_scores.append(scores)
            all_lengths.append(lengths)
            accuracy = raw_accuracy(self.config, scores, lengths).reshape(num_prompts, group)
            informative = np.nonzero(accuracy.any(axis=1) & ~accuracy.all(axis=1))[0][:num_prompts - kept]
            parts.append(drawn.take((informative[:, None] * group + np.arange(group)).reshape(-1)))
            kept += len(informative)
            if kept == num_prompts or batches == r.max_generation_batches:
                sampled = SampledGroups.concatenate(
                    parts, all_scores=np.concatenate(all_scores), all_lengths=np.concatenate(all_lengths),
                    groups_generated=generated, groups_kept=kept, generation_batches=batches)
                break
        sampled.reward_counts, sampled.batches_after = counts, self.batches.get_state()
        return sampled

    def training_rows(self, sampled: SampledGroups) -> TrainingRows:
        """The kept groups' rows with their group-normalized advantages.

        With `rollout.filter_groups`, a rollout batch that ends with K < N·M informative groups (after
        `rollout.max_generation_batches`) is trained on as verl's actor splits a smaller batch: ceil(K/M)
        mini-batches of M groups, the last one holding the rest, filled up to the compiled shape with
        rows whose response mask is zero (they add nothing to any loss, denominator or gradient); K = 0
        makes no update. The record says so: groups_generated, groups_kept, generation_batches and
        updates (the policy updates made)."""
        r = self.config.rollout
        kept, group = sampled.groups_kept, r.group_size
        scores = jnp.asarray(sampled.scores.reshape(kept, group))
        advantages = self.group_advantages(scores, self.objective.scale_advantages)
        updates = -(-kept // r.prompts_per_minibatch)  # N unless dynamic sampling fell short
        rows = updates * r.prompts_per_minibatch * group
        return TrainingRows.of(sampled, np.asarray(advantages).reshape(-1), rows, self.tokenizer.pad_id)

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
        current ones); the recomputation runs under them, on the rollout mesh when `rollout_behaviour`
        (their copy there) is given and the rollout mesh is not the trainer's (`rollout_logprobs`).

        `objective.decoupled`: log π_old is π_prox's, a forward pass under the current parameters, and
        the batch carries log π_behaviour (the sampler's or the recomputed) for the weight
        π_prox / π_behaviour (the same pass when both policies are the current one).

        Synchronous rollouts with log π_old recomputed (`old_logprobs_from_update`): the first
        mini-batch's old_logp (and its entropy) is None here, taken by `update` from that update's own
        forward, whose parameters are the rollout's."""
        from_sampler = self.old_logprobs_source == "sampler"
        current = self.state.params
        behaviour = current if behaviour is None else behaviour
        decoupled = self.config.objective.decoupled
        from_update = (self.old_logprobs_from_update and behaviour is current and rollout_behaviour is None
                       and self.async_rollouts is None)
        policy_batches, parts = [], []
        for index, rows in enumerate(minibatches):
            replay = ((batch.prompt_routing[:, rows], batch.routing[:, rows])
                      if self.config.rollout.routing_replay else None)
            policy, micro = self.layout.policy_batch([batch.prompts[i] for i in rows], batch.tokens[rows],
                                              batch.lengths[rows], batch.advantages[rows], replay,
                                              batch.sampler_logp[rows] if self.correction or from_sampler
                                              else None)
            self.shapes.batch_shape(policy.input_ids.shape)
            if from_sampler:  # the sampler's log-probs laid out as policy_batch lays them out (masked)
                old_logp, policy = policy.sampler_logp, policy.replace(sampler_logp=None)
                token_entropy = batch.sampler_entropy[rows, :old_logp.shape[1]]  # logprob_metrics masks it
            elif from_update and index == 0:
                old_logp = token_entropy = None
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

    def learning_rate_of_updates(self, updates: int) -> float | None:
        """The mean learning rate of the next `updates` policy updates (the optimizer counts them in
        policy_updates); None for none."""
        first = self.state.policy_updates
        return float(np.mean(np.asarray(self.learning_rate(np.arange(first, first + updates))))) if updates \
            else None

    def update(self, policy_batches: list[tuple[PolicyBatch, int]],
               logprob_parts: list | None = None) -> list[dict]:
        """One policy update per mini-batch, in order; advances the counters. Returns each update's
        metrics on the host (one transfer for all), NonFiniteError when one is not finite. A mini-batch
        without old_logp (`with_old_logprobs`) takes it from its update's forward: it is written into
        `policy_batches` and (log π_old, entropy) into `logprob_parts` (`with_old_logprobs`' lists)."""
        step_metrics = []
        for batch, micro in policy_batches:
            params, opt_state, metrics = self.policy_step(self.state.params, self.state.opt_state, batch, micro)
            # In the trainer's shardings again (a relabelling, no copy): a program read back from the
            # exported-program cache returns them replicated, and the next update's program (of another
            # trace, when log π_old came from this one) would otherwise be lowered, and cached, for those.
            self.state.params, self.state.opt_state = jax.device_put(
                (params, opt_state), (self.shardings.params, self.shardings.opt_state))
            step_metrics.append(metrics)
        self.state.policy_updates += len(policy_batches)
        self.state.iteration += 1
        step_metrics = jax.device_get(step_metrics)
        for index, metrics in enumerate(step_metrics):
            if OLD_LOGPROBS_KEY in metrics:
                fresh = metrics.pop(OLD_LOGPROBS_KEY)
                batch, micro = policy_batches[index]
                policy_batches[index] = (batch.replace(old_logp=fresh["old_logp"]), micro)
                if logprob_parts is not None:
                    mask = logprob_parts[index][0]
                    logprob_parts[index] = (mask, fresh["old_logp"], fresh["token_entropy"])
        check_finite_steps(step_metrics, self.state.iteration)
        return step_metrics

    def report(self, sampled: SampledGroups, batch: TrainingRows, minibatches: list[np.ndarray],
               logprob_parts: list, step_metrics: list[dict], learning_rate: float | None, timing: tuple,
               version: int | None = None) -> dict:
        """The iteration's metrics record (`iteration_metrics.rl_record`; timing: the iteration's start,
        the compile totals then and the rollout's seconds), its rows trained on kept as `last_rollout`.
        `version`: the policy version that generated the batch (default: the one before the updates)."""
        started, compiled_before, rollout_seconds = timing
        compiled = compilation_totals() - compiled_before
        timings = {"rollout_seconds": rollout_seconds, "iteration_seconds": time.perf_counter() - started,
                   "compiles": compiled.compiles, "compile_seconds": compiled.seconds,
                   **self.scorer.take_counts(), "compile_cache_hits": compiled.cache_hits}
        s, r = self.state, self.config.rollout
        counters = {"phase": "rl", "iteration": s.iteration, "policy_updates": s.policy_updates}
        record, self.last_rollout = rl_record(
            counters, sampled, batch, minibatches, self.placer.fetch(logprob_parts), step_metrics, timings,
            learning_rate, self.correction, r.group_size, s.iteration - 1 if version is None else version,
            r.filter_groups, r.async_steps)
        return record

    # -- asynchronous rollouts (`respo_jax.training.async_rollouts`) -----------------------------------
    def next_rollout(self) -> tuple[SampledGroups, tuple[int, object, object]]:
        """The sampled batch of the next iteration (`sample_groups`) and its behaviour policy: (version,
        parameters on the trainer's shardings, on the rollout mesh's or None). Synchronous: sampled now
        by the current parameters; asynchronous: the rollout job submitted k iterations ago (the jobs up
        to k ahead submitted)."""
        if self.async_rollouts is None and self.config.rollout.async_steps:
            self.start_async_rollouts(self.config.rollout.async_steps)
        if self.async_rollouts is None:
            return self.sample_groups(), (self.state.iteration, self.state.params, None)
        sampled, job = self.async_rollouts.take(self.state.iteration + 1, self.state.params)
        for key, value in sampled.reward_counts.items():
            self.scorer.counts[key] += value
        self._batches_resume_state = sampled.batches_after
        return sampled, (job.version, job.params, job.rollout_params)

    def start_async_rollouts(self, steps: int, overlap: bool | None = None) -> None:
        """Routes the rollouts through `AsyncRollouts` with `steps` of staleness (0: the synchronous
        schedule through the same jobs), resuming the in-flight jobs of a restored checkpoint. `overlap`:
        the jobs run in their own thread (default: in a single-process run) or in the main thread."""
        overlap = jax.process_count() == 1 if overlap is None else overlap
        self.async_rollouts = AsyncRollouts(
            steps, lambda iteration, params: self.sample_groups(iteration - 1, params), self.to_rollout_mesh,
            self.config.num_iterations, overlap=overlap)
        if self.restored_behaviour is not None:
            self.async_rollouts.restore(self.restored_behaviour, self.state.iteration)
            self.restored_behaviour = None

    def to_rollout_mesh(self, params):
        """Trainer-side parameters on the rollout mesh's shardings (the same arrays on one mesh)."""
        if self.rollout_mesh is self.mesh:
            return params
        if self._resharder is None:
            self._resharder = Resharder(self.shardings.params, self.rollout_shardings)
        return self._resharder(params)

    def close(self) -> None:
        """Stops the rollout jobs of an asynchronous run (the one running finishes first) and joins their
        thread; `with trainer:` does it however the block ends (its end, an exception, a stop)."""
        if self.async_rollouts is not None:
            self.async_rollouts.close()

    def __enter__(self) -> "RLTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
