"""Asynchronous rollouts (respo_jax.training.async_rollouts): the schedule, the decoupled objective against a
float64 reference, k = 0 through the rollout jobs equal to the synchronous loop, an async run independent
of the thread's timing, and kill -9 + resume of an async run bit-identical to an uninterrupted one."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.train import DEFAULT_CONFIG, load_config
from objective_refs import f32, make_batch, make_gspo_batch, ref_token_loss_and_coefficient, \
    ref_denominator_per_token
from respo_jax.objectives import decoupled_weights, get_objective
from respo_jax.training.async_rollouts import AsyncRollouts, behaviour_version
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.loop import RLTrainer
from tiny_runs import (TINY_RUN, fits_limits, kill_when, least_memory, max_iteration, raw_state, read_records,
                       train, without_timings)


# ----------------------------------------------------------------------------- the schedule


def test_the_batch_of_iteration_t_is_generated_by_the_policy_after_t_minus_1_minus_k():
    assert [behaviour_version(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]
    assert [behaviour_version(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [behaviour_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("overlap", [True, False])
def test_jobs_run_in_order_at_most_k_ahead_and_resume_from_their_behaviour_parameters(overlap):
    """A fake rollout records (iteration, the parameters it got); the parameters after iteration v are the
    array [v]. A checkpoint after iteration 3 holds jobs 4 and 5's parameters (also when the run ends at 3
    and no job beyond it was submitted); a fresh queue restored from them regenerates exactly what the
    uninterrupted one draws."""
    k, last = 2, 7

    def run(start=1, restored=None, last=last):
        calls = []
        queue = AsyncRollouts(k, lambda t, p: calls.append((t, int(p[0]))) or {"t": t}, lambda p: p, last,
                              overlap=overlap)
        if restored is not None:
            queue.restore(restored, start - 1)
        saved, versions = None, []
        for t in range(start, last + 1):
            sampled, job = queue.take(t, jnp.array([t - 1]))
            assert sampled == {"t": t} and job.version == behaviour_version(t, k)
            versions.append(job.version)
            assert len(queue._jobs) <= k  # the jobs in flight while iteration t trains
            if t == 3:
                saved = queue.behaviour_params(3, jnp.array([3]))
        queue.close()
        return calls, versions, saved

    calls, versions, saved = run()
    assert calls == [(t, behaviour_version(t, k)) for t in range(1, last + 1)]  # in order, each once
    assert versions == [0, 0, 0, 1, 2, 3, 4]
    assert [int(p[0]) for p in saved] == [1, 2]  # jobs 4 and 5: the policies after iterations 1 and 2
    assert [int(p[0]) for p in run(last=3)[2]] == [1, 2]  # a run ending at 3 saves the same (to extend it)
    resumed_calls, resumed_versions, _ = run(start=4, restored=saved)
    assert resumed_calls == calls[3:] and resumed_versions == versions[3:]


# ----------------------------------------------------------------------------- the decoupled objective


@pytest.mark.parametrize("name", ["grpo", "gspo", "vespo", "respo"])
def test_the_decoupled_objective_matches_a_float64_reference(name):
    """Held-out cases (seeds the objective tests do not use): loss and gradient of
    Σ_t π_prox/π_behav · token_loss(π_θ/π_prox) / denominator against a float64 transcription."""
    objective = get_objective(name)
    for seed in (21, 22):
        logp, prox, adv, mask = make_gspo_batch() if name == "gspo" \
            else make_batch(seed=seed)
        rng = np.random.default_rng(seed)
        behaviour = prox + rng.normal(0.0, 0.3, prox.shape)  # a staler policy than π_prox
        token_loss, coefficient = ref_token_loss_and_coefficient(name, dict(objective.hparams), logp, prox,
                                                                 adv, mask)
        weight = np.where(mask > 0, np.exp(prox - behaviour), 0.0)
        denominator = ref_denominator_per_token(mask, objective.aggregation)
        ref_loss = np.sum(np.where(mask > 0, weight * token_loss / denominator, 0.0))
        ref_grad = np.where(mask > 0, -weight * coefficient * adv[:, None] / denominator, 0.0)
        x, p, b, a, m = f32(logp, prox, behaviour, adv, mask)
        weights = decoupled_weights(p, b, m)
        np.testing.assert_allclose(np.asarray(weights), weight, rtol=1e-5, atol=1e-7)

        def loss_fn(z):
            return objective.evaluate(z, p, a, m, token_weight=weights).terms.loss()

        loss, grad = jax.jit(jax.value_and_grad(loss_fn))(x)
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- the trainer


def _config(*overrides):
    return apply_overrides(load_config(DEFAULT_CONFIG), [*TINY_RUN, "run.eval_problems=0", "run.iterations=3",
                                                         *overrides])


def _train(config, queue_steps=None, overlap=None):
    """(metric records without timings, the final parameters' leaves, the last rollout file, every
    iteration's) of `config`'s warm-up and iterations in this process; `queue_steps`: route the
    rollouts through `AsyncRollouts` with that staleness; `overlap=False`: its jobs run in the main
    thread."""
    trainer = RLTrainer(config)
    records = list(trainer.warmup())
    if queue_steps is not None or overlap is not None:
        trainer.start_async_rollouts(config.rollout.async_steps if queue_steps is None else queue_steps,
                                     overlap=overlap)
    rollouts = []
    for _ in range(config.num_iterations):
        records.append(trainer.iteration())
        rollouts.append(trainer.last_rollout)
    trainer.close()
    params = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    return without_timings(records), params, rollouts[-1], rollouts


def _assert_same(a, b):
    assert a[0] == b[0]
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a[1], b[1]))


@pytest.fixture(scope="module")
def synchronous_run():
    """The synchronous tiny run (`_train(_config())`), shared."""
    return _train(_config())


def test_k0_through_the_rollout_jobs_is_the_synchronous_loop_bit_for_bit(synchronous_run):
    sync = synchronous_run
    _assert_same(_train(_config(), queue_steps=0), sync)
    assert "staleness_mean" not in sync[0][-1]
    assert sync[2]["policy_version"].tolist() == [2] * 8  # iteration 3's batch: the policy after 2


def test_an_async_run_does_not_depend_on_the_threads_timing(synchronous_run):
    """k = 1 with the rollout thread twice and with the jobs run in the main thread: identical; and not
    the synchronous run (iteration 2 trains on the initial policy's batch)."""
    config = _config("rollout.async_steps=1")
    threaded = _train(config)
    _assert_same(_train(config), threaded)
    _assert_same(_train(config, overlap=False), threaded)
    rl = [r for r in threaded[0] if r["phase"] == "rl"]
    assert [(r["staleness_mean"], r["staleness_max"]) for r in rl] == [(0.0, 0), (1.0, 1), (1.0, 1)]
    assert threaded[2]["policy_version"].tolist() == [1] * 8
    sync = [r for r in synchronous_run[0] if r["phase"] == "rl"]
    assert rl[0]["log_w_mean"] == sync[0]["log_w_mean"] and rl[1]["log_w_mean"] != sync[1]["log_w_mean"]


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_the_decoupled_objective_runs_async_and_is_the_coupled_one_without_staleness():
    """Without staleness π_prox is the behaviour policy (weight 1): decoupled = coupled; with k = 1 the
    decoupled run's ratio is against π_prox, so its log W holds the drift of the iteration's own updates,
    not the lag (here about a fifth to a tenth of the coupled run's)."""
    recompute = "rollout.old_logprobs=recompute"
    coupled, decoupled = _train(_config(recompute)), _train(_config(recompute, "objective.decoupled=true"))
    for a, b in zip(coupled[0], decoupled[0]):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], str):
                assert a[key] == b[key], key
            else:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7, err_msg=key)
    stale = [r for r in _train(_config(recompute, "rollout.async_steps=1", "objective.decoupled=true"))[0]
             if r["phase"] == "rl"]
    stale_coupled = [r for r in _train(_config(recompute, "rollout.async_steps=1"))[0] if r["phase"] == "rl"]
    assert stale[0]["log_w_mean"] == stale_coupled[0]["log_w_mean"]  # iteration 1: no staleness yet
    for a, b in zip(stale[1:], stale_coupled[1:]):  # log W of the N updates' drift only, not the lag's
        assert abs(a["log_w_mean"]) < abs(b["log_w_mean"]) / 3


def test_async_options_refused_at_start_up_in_one_line():
    with pytest.raises(ConfigError, match="mesh.rollout_devices=2: expected 0 with rollout.async_steps=0"):
        _config("mesh.rollout_devices=2").validate()
    with pytest.raises(ConfigError, match="objective.decoupled=True: expected false with objective.rollout"):
        _config('objective.rollout_correction={"level": "token", "mode": "truncate", "threshold": 2.0}',
                "objective.decoupled=true").validate()
    with pytest.raises(ConfigError, match="rollout.async_steps=-1"):
        _config("rollout.async_steps=-1").validate()


# ----------------------------------------------------------------------------- kill -9 and resume

ASYNC_ARGS = ("rollout.async_steps=2", "run.iterations=8", "run.checkpoint_every=3", "run.resume=true")


@pytest.mark.slow
def test_a_killed_async_run_resumes_bit_identical_to_an_uninterrupted_one(tmp_path, jit_cache):
    reference, out = tmp_path / "reference", tmp_path / "killed"
    assert train(jit_cache, reference, *ASYNC_ARGS).returncode == 0
    rng = random.Random(50)
    kills = []

    for target_step, delay in [(2, rng.uniform(0.0, 0.4)), (3, rng.uniform(0.0, 0.4))]:
        killed = kill_when(jit_cache, out, ASYNC_ARGS, min(max_iteration(out) + target_step, 8), delay)
        kills += [killed] if killed else []
    assert kills, "the run finished before any kill"
    final = train(jit_cache, out, *ASYNC_ARGS)
    assert final.returncode == 0, (kills, final.stderr[-3000:])
    assert without_timings(read_records(out)) == without_timings(read_records(reference))
    got, got_meta = raw_state(out / "checkpoints", 8)
    want, want_meta = raw_state(reference / "checkpoints", 8)
    assert got_meta == want_meta and got.keys() == want.keys()
    assert any("behaviour" in key for key in want)  # the in-flight batches' parameters are checkpointed
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key
    print("kill points (last iteration logged, checkpoints):", kills)


def test_the_batches_in_flight_are_counted_by_the_start_up_limits():
    """k = 2 holds two more copies of the parameters: the least memory that fits is the sampler's cache
    plus two models' parameters, and less is refused in one line naming rollout.async_steps; with a
    rollout mesh the reshard's transient copies count too."""
    from respo_jax.models import qwen3
    from respo_jax.training.limits import check_limits, parameter_bytes

    model_cfg = qwen3.Qwen3Config.preset("tiny", vocab_size=64)
    base = load_config(DEFAULT_CONFIG)
    config = apply_overrides(base, ["rollout.async_steps=2"])
    params = parameter_bytes(model_cfg, config.model.dtype)

    cache = least_memory(base, model_cfg)  # the least memory that holds the sampler's cache alone
    assert not fits_limits(config, model_cfg, cache + 2 * params - 1)
    assert fits_limits(config, model_cfg, cache + 2 * params)
    with pytest.raises(ConfigError, match=r"^rollout\.async_steps=2: 2 more copies of the parameters"):
        check_limits(config, model_cfg, 10, cache + 2 * params - 1)

    # k = 1 on 4 trainer + 4 rollout devices: the snapshot, its rollout copy and the reshard's transient
    # replicated copy on each of the 8 devices
    split = apply_overrides(base, ["rollout.async_steps=1", "mesh.rollout_devices=4"])
    check_limits(split, model_cfg, 10, cache + 10 * params, trainer_devices=4)
    with pytest.raises(ConfigError, match=r"^rollout\.async_steps=1: 10 more copies .* the reshard onto "):
        check_limits(split, model_cfg, 10, cache + 10 * params - 1, trainer_devices=4)


def test_the_timeline_reads_each_devices_busy_time_from_the_traces_xla_events():
    """A Chrome-format trace as `jax.profiler` writes it: CPU thunks name their device in `device_ordinal`,
    an accelerator's kernels by their process; host events (no `hlo_module`) are left out."""
    from experiments.benchmarks.async_timeline import timeline, xla_events

    def op(device, ts, dur, pid=1):
        return {"ph": "X", "pid": pid, "tid": 1, "name": "fusion", "ts": ts, "dur": dur,
                "args": {"hlo_module": "jit_step",
                         **({} if device is None else {"device_ordinal": str(device)})}}

    trace = {"traceEvents": [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "X", "pid": 1, "tid": 2, "name": "PjitFunction(step)", "ts": 0.0, "dur": 9e6, "args": {}},
        op(0, 1e6, 2e6), op(0, 2.5e6, 1e6),  # trainer device 0 busy 1-3.5 s
        op(1, 3e6, 1e6), op(None, 4.5e6, 1e6, pid=7),  # rollout device 1 busy 3-4 s and 4.5-5.5 s
    ]}
    events = xla_events(trace)
    assert sorted(e[0] for e in events) == [0, 0, 1, 1] and events[0][2] == 1.0
    result = timeline(events, {"trainer": {0}, "rollout": {1}})
    assert result["meshes"]["trainer"]["busy"] == [(0.0, 2.5)]
    assert result["meshes"]["rollout"]["busy"] == [(2.0, 3.0), (3.5, 4.5)]
    assert result["both_busy_seconds"] == pytest.approx(0.5)
    assert result["overlapped_fraction"] == pytest.approx(0.5 / 2.5)
    assert result["span_seconds"] == pytest.approx(4.5)


def test_the_staleness_report_averages_the_seeds_of_each_cell():
    from experiments.async_staleness import means, summary_markdown

    rows = [{"objective": "grpo", "async_steps": 1, "seed": s, "staleness_mean": 1.0, "log_w_p10": -s,
             "log_w_p50": 0.0, "log_w_p90": s, "positive_below_minus_1": 0.1 * s, "clip_fraction": 0.2,
             "train_score_last_quarter": 0.5} for s in (1, 3)]
    rows.append(dict(rows[0], objective="respo", clip_fraction=None))
    table = means(rows)
    assert table[("grpo", 1)]["seeds"] == 2 and table[("grpo", 1)]["log_w_p10"] == -2.0
    assert table[("grpo", 1)]["positive_below_minus_1"] == pytest.approx(0.2)
    assert table[("respo", 1)]["clip_fraction"] is None
    lines = summary_markdown(rows).splitlines()
    assert lines[2] == "| grpo | 1 | 2 | 1.00 | -2.000 / +0.000 / +2.000 | 0.2000 | 0.2000 | 0.500 |"
    assert lines[3].endswith("| 0.1000 | — | 0.500 |")


# ----------------------------------------------------------------------------- async with the other options


class _FedSynchronously(RLTrainer):
    """The synchronous loop fed the batches an asynchronous run trains on: each iteration samples its
    batch now, in the main thread, with the parameters of its behaviour policy θ_{t-1-k} kept from
    earlier iterations: no rollout jobs, thread or queue."""

    def next_rollout(self):
        self.history = getattr(self, "history", {})
        self.history[self.state.iteration] = jax.tree.map(jnp.copy, self.state.params)
        version = behaviour_version(self.state.iteration + 1, self.config.rollout.async_steps)
        sampled = self.sample_groups(self.state.iteration, self.history[version])
        for key, value in sampled.reward_counts.items():
            self.scorer.counts[key] += value
        return sampled, (version, self.history[version])


def _train_fed(config):
    trainer = _FedSynchronously(config)
    records = list(trainer.warmup()) + [trainer.iteration() for _ in range(config.num_iterations)]
    return without_timings(records), [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]


TINY_MOE = ("model.preset=tiny-moe", 'model.overrides={"num_hidden_layers": 1, "hidden_size": 16, '
            '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_experts": 4, '
            '"moe_intermediate_size": 8}')


# Dynamic sampling needs groups whose raw accuracy differs: a warm-up that gets some answers right.
DYNAMIC_SAMPLING = ("rollout.filter_groups=true", "rollout.max_generation_batches=3", "warmup.steps=40",
                    "warmup.batch_size=16", "warmup.learning_rate=0.01")


@pytest.mark.parametrize("options,fed", [
    ((*DYNAMIC_SAMPLING, "objective.kl_coef=0.05", "rollout.old_logprobs=recompute",
      'objective.rollout_correction={"level": "token", "mode": "truncate", "threshold": 2.0}',
      'objective.off_policy_mask={"kind": "deepseek_v32", "delta": 0.05}'), True),
    ((*TINY_MOE, "rollout.routing_replay=true", "rollout.old_logprobs=recompute"), False),
], ids=["dynamic-sampling+kl-reference+rollout-correction+off-policy-mask", "routing-replay-moe"])
def test_async_works_with_dynamic_sampling_routing_replay_correction_kl_and_masks(options, fed):
    """k = 2 with the other options. Through the rollout thread it equals, bit for bit, the synchronous
    loop that samples each batch with its behaviour parameters (`_FedSynchronously`; checked for the
    dense options, the MoE run's path is the same). What each option promises holds under the lag: log
    π_old recomputed under the behaviour parameters (with the behaviour's routing, Routing Replay) is the
    sampler's to float32 round-off while log W shows the lag (so neither the current parameters nor the
    current routing were used); dynamic sampling keeps only groups whose rewards differ; the KL reference
    and the off-policy mask are measured."""
    config = _config("rollout.async_steps=2", *options)
    records, params, _, rollouts = _train(config)
    if fed:
        reference = _train_fed(config)
        assert records == reference[0]
        assert all(x.tobytes() == y.tobytes() for x, y in zip(params, reference[1]))
    rl = [r for r in records if r["phase"] == "rl"]
    trained = [(t, r, rollout) for t, (r, rollout) in enumerate(zip(rl, rollouts), start=1) if rollout]
    assert [t for t, *_ in trained][:2] == [1, 2]  # (dynamic sampling keeps no group in iteration 3)
    for t, r, rollout in trained:
        assert r["staleness_max"] == t - 1 and (rollout["policy_version"] == 0).all()
        assert r["sampler_trainer_logp_gap"] < 1e-5, r["sampler_trainer_logp_gap"]
        if t > 1:
            assert abs(r["log_w_mean"]) > 1e3 * r["sampler_trainer_logp_gap"]
        if config.rollout.filter_groups:
            rewards = rollout["reward"].reshape(-1, config.rollout.group_size)
            assert (rewards.min(axis=1) < rewards.max(axis=1)).all()
            assert r["groups_generated"] >= r["groups_kept"] > 0
            assert np.isfinite(r["kl_ref"]) and 0.0 <= r["off_policy_masked_fraction"] <= 1.0


# ----------------------------------------------------------------------------- shutdown


@pytest.mark.parametrize("stop", ["end", "exception", "SIGTERM"])
def test_a_stopped_async_run_leaves_no_rollout_thread(stop, tmp_path, monkeypatch):
    """`run_experiment` of k = 1 joins the rollout thread however the run stops: at its end, by an
    exception in iteration 1, or by SIGTERM (a stop at the step boundary after iteration 1)."""
    import os
    import signal
    import threading

    from experiments.train import run_experiment
    from respo_jax.training import preemption

    def rollout_threads():
        return [t for t in threading.enumerate() if t.name.startswith("rollout") and t.is_alive()]

    assert not rollout_threads()
    seen, iteration = [], RLTrainer.iteration

    def stopping(self):
        record = iteration(self)
        seen.extend(rollout_threads())
        if stop == "exception":
            raise RuntimeError("stopped in iteration 1")
        if stop == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the flag; the boundary stops the run
        return record

    monkeypatch.setattr(RLTrainer, "iteration", stopping)
    config = _config("rollout.async_steps=1", "run.iterations=1", f"run.out_dir={tmp_path / 'run'}")
    expected = {"end": None, "exception": RuntimeError, "SIGTERM": preemption.Preempted}[stop]
    if expected is None:
        run_experiment(config)
    else:
        with pytest.raises(expected):
            run_experiment(config)
    assert seen, "no rollout thread ran"
    assert not rollout_threads()
