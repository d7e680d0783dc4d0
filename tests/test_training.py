"""The RL trainer: config overrides, sequence layout, log-prob alignment, updates and checkpoints."""

import dataclasses
import functools
import gc
import json
import os
import pathlib
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax import nnx

import jitted_model as jm
from experiments.train import DEFAULT_CONFIG, load_config, main, summarize
from respo_jax.data.batches import PromptBatches
from respo_jax.eval.positive_branch import pooled_diagnostics
from respo_jax.models import qwen3
from respo_jax.objectives import RolloutCorrection, get_objective
from respo_jax.training import shapes
from respo_jax.training.batch import (
    PolicyBatch,
    bucket_length,
    build_sequences,
    microbatch_size,
    response_logprobs,
)
from respo_jax.training.checkpoint import restore_checkpoint, save_checkpoint
from respo_jax.training.compilation import compilation_totals
from respo_jax.training import compile_ahead
from respo_jax.training.compile_ahead import compile_bucket
from respo_jax.sampling.params import padded_prompt_length
from respo_jax.training.config import ConfigError, ExperimentConfig, apply_overrides
from respo_jax.training.iteration_metrics import collect_rollout, iteration_record, logprob_metrics
from respo_jax.training.loop import RLTrainer
from respo_jax.training.model_setup import build_model
from respo_jax.training.placement import RowPlacer
from respo_jax.training.step import make_logprob_fn, make_policy_step, old_logprobs_from_update

TINY = [
    "warmup.steps=3",
    "warmup.batch_size=8",
    "rollout.prompts_per_minibatch=2",
    "rollout.group_size=4",
    "rollout.reuse=2",
    "run.iterations=2",
    "run.progress=false",
]


def test_default_config_is_valid_and_overridable():
    config = load_config(DEFAULT_CONFIG)
    assert isinstance(config, ExperimentConfig)
    assert config.objective.name == "respo"
    changed = apply_overrides(
        config, ["objective.name=grpo", "objective.hparams.eps_high=0.28", "rollout.reuse=8", "run.progress=false"]
    )
    assert changed.objective.name == "grpo" and changed.objective.hparams == {"eps_high": 0.28}
    assert changed.rollout.reuse == 8 and changed.run.progress is False
    assert config.rollout.reuse != 8  # the original is frozen and untouched


@pytest.mark.parametrize(
    "override, error, match",
    [
        ("rollout.reus=3", KeyError, "rollout has"),
        ("nosuch.x=1", KeyError, "sections are"),
        ("rollout.reuse=abc", ValueError, "cannot parse as int"),
        ("rollout.reuse=0", ValueError, "rollout.reuse=0: expected an integer >= 1"),
        ("run.progress=maybe", ValueError, "cannot parse as bool"),
        ("rollout.reuse", ValueError, "section.field=value"),
        ("optim.learning_rate.x=1", KeyError, "not a dict field"),
        ('model.overrides={"scan_layers": false}', ValueError, "model.scan_layers fields instead"),
        ("rollout.scheduler=paged", ValueError, r"rollout.scheduler='paged': expected 'continuous' or 'static'"),
        ("rollout.max_slots=0", ValueError, "rollout.max_slots=0: expected an integer >= 1"),
        ("rollout.steps_per_schedule=0", ValueError, "rollout.steps_per_schedule=0: expected an integer >= 1"),
        ("rollout.min_decode_slots=0", ValueError, "rollout.min_decode_slots=0: expected an integer >= 1"),
        ("rollout.decode_widths_per_octave=0", ValueError,
         "rollout.decode_widths_per_octave=0: expected an integer >= 1"),
        ("rollout.page_size=-4", ValueError, "rollout.page_size=-4: expected an integer >= 1"),
        ("rollout.num_pages=-1", ValueError, r"rollout.num_pages=-1: expected an integer >= 0 \(0: unset\)"),
        ("rollout.kv_cache_bytes=1.5", ValueError, "cannot parse as int"),
        ("rollout.paged_attention_impl=flash", ValueError,
         "rollout.paged_attention_impl='flash': expected one of 'gather', 'pallas_tpu', 'pallas_gpu'"),
    ],
)
def test_bad_overrides_fail_with_a_clear_error(override, error, match):
    with pytest.raises(error, match=match):
        apply_overrides(load_config(DEFAULT_CONFIG), [override])


def test_rollout_engine_fields_map_into_the_samplers_engine_config():
    from respo_jax.sampling import EngineConfig
    from respo_jax.training.run_dir import config_differences

    config = load_config(DEFAULT_CONFIG)
    r = config.rollout
    # The default run's rollout batch (N x M prompts x G) fits the default slots at once: one admission.
    assert r.engine_config() == EngineConfig(
        scheduler="continuous", prompt_bucket=r.prompt_bucket,
        max_slots=256, steps_per_schedule=64, page_size=16, num_pages=None, kv_cache_bytes=None)
    assert r.max_slots >= r.reuse * r.prompts_per_minibatch * r.group_size == 256
    knobs = ["rollout.scheduler=static", "rollout.max_slots=8", "rollout.steps_per_schedule=3",
             "rollout.page_size=4", "rollout.kv_cache_bytes=65536", "rollout.paged_attention_impl=pallas_tpu",
             "rollout.min_decode_slots=2", "rollout.decode_widths_per_octave=1"]
    changed = apply_overrides(config, knobs)
    assert changed.rollout.engine_config() == EngineConfig(
        scheduler="static", prompt_bucket=r.prompt_bucket, max_slots=8,
        steps_per_schedule=3, page_size=4, kv_cache_bytes=65536, paged_attention_impl="pallas_tpu",
        min_decode_slots=2, decode_widths_per_octave=1)
    pages = apply_overrides(config, ["rollout.num_pages=40"]).rollout.engine_config()
    assert (pages.num_pages, pages.kv_cache_bytes) == (40, None)
    with pytest.raises(ValueError, match=r"rollout.kv_cache_bytes=4096: expected 0 with rollout.num_pages=4 "
                                         r"\(both size the page pool: set one\)"):
        apply_overrides(config, ["rollout.num_pages=4", "rollout.kv_cache_bytes=4096"])
    # The engine changes speed and memory, not the samples: a run may resume with other engine settings,
    # not with another response budget.
    saved = json.loads(json.dumps(config.to_dict()))
    assert config_differences(saved, changed) == []
    other = apply_overrides(config, knobs + ["rollout.max_new_tokens=7"])
    assert config_differences(saved, other) == ["rollout.max_new_tokens: saved 6, now 7"]


def test_paper_configs_sample_with_the_continuous_engine_in_a_byte_budget():
    from respo_jax.training.limits import kv_cache_bytes

    configs = pathlib.Path(DEFAULT_CONFIG).parent
    for name, slots, kv_bytes_per_token in (("qwen3_1p7b_dapo", 64, 28 * 8 * 128 * 2 * 2),
                                            ("qwen3_30b_a3b_dapo", 128, 48 * 4 * 128 * 2 * 2)):
        engine = load_config(str(configs / f"{name}.py")).rollout.engine_config()
        assert (engine.scheduler, engine.max_slots, engine.page_size) == ("continuous", slots, 64)
        tokens = engine.kv_cache_bytes // kv_bytes_per_token  # the pool's tokens: ~300k and ~350k
        assert 2_000 < tokens / slots < 5_000  # a few thousand tokens per slot (Tab. 4's median: ~850)
    # A static batch's K/V for the 1.7B run: 256 rows x (prompt + 15,360), more than 10x.
    r = load_config(str(configs / "qwen3_1p7b_dapo.py")).rollout
    static = kv_cache_bytes(qwen3.Qwen3Config.preset("qwen3-1.7b"), 256, 1024 + r.max_new_tokens, "bfloat16")
    assert r.engine_config().kv_cache_bytes < static / 10


def test_the_trainer_samples_with_its_configured_engine():
    from respo_jax.training.config import ConfigError

    config = apply_overrides(load_config(DEFAULT_CONFIG), TINY + ["rollout.scheduler=static", "rollout.max_slots=4",
                                                                  "rollout.page_size=8"])
    trainer = RLTrainer(config)
    assert trainer.engine == config.rollout.engine_config()
    assert (trainer.engine.scheduler, trainer.engine.max_slots, trainer.engine.page_size) == ("static", 4, 8)
    # An accelerator kernel on the CPU mesh is refused at start-up, before the model is built, in either
    # schedule; so is one the model's head_dim (the tiny preset's 16) cannot lower.
    for scheduler in ("continuous", "static"):
        gpu = apply_overrides(config, [f"rollout.scheduler={scheduler}",
                                       "rollout.paged_attention_impl=pallas_gpu", "rollout.page_size=16"])
        with pytest.raises(ConfigError, match=r"^rollout.paged_attention_impl='pallas_gpu': runs on gpu "
                                              r"devices; the engine runs on cpu devices"):
            RLTrainer(gpu)
    tpu = apply_overrides(config, ["rollout.paged_attention_impl=pallas_tpu",
                                   "rollout.paged_attention_interpret=true"])
    with pytest.raises(ConfigError, match=r"^rollout.paged_attention_impl='pallas_tpu': needs head_dim a "
                                          r"multiple of 128 \(Pallas TPU blocks\); the model's is 16"):
        RLTrainer(tpu)


@pytest.mark.parametrize("scan_layers, remat", [(False, False), (True, True)])
def test_model_knobs_reach_the_model(tmp_path, scan_layers, remat):
    from respo_jax.models import qwen3

    overrides = [f"model.scan_layers={str(scan_layers).lower()}", f"model.remat={str(remat).lower()}"]
    config = apply_overrides(load_config(DEFAULT_CONFIG), overrides)
    model = build_model(config, vocab_size=64)
    assert (model.config.scan_layers, model.config.remat) == (scan_layers, remat)
    qwen3.save_pretrained(model, str(tmp_path))  # the same knobs apply to a checkpoint directory
    config = apply_overrides(config, [f"model.checkpoint_dir={tmp_path}"])
    loaded = build_model(config, vocab_size=64)
    assert (loaded.config.scan_layers, loaded.config.remat) == (scan_layers, remat)


def test_build_sequences_layout():
    prompts = [[5, 6, 7], [8]]
    responses = np.array([[1, 2, 9, 9], [3, 4, 5, 9]])
    ids, positions, attention, response_mask, prompt_len = build_sequences(prompts, responses, np.array([2, 3]), 0)
    assert prompt_len == 3
    np.testing.assert_array_equal(ids, [[5, 6, 7, 1, 2, 0, 0], [0, 0, 8, 3, 4, 5, 0]])
    np.testing.assert_array_equal(attention, [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(positions[:, :6], [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]])
    np.testing.assert_array_equal(response_mask, [[1, 1, 0, 0], [1, 1, 1, 0]])
    with pytest.raises(ValueError, match="lengths must lie"):
        build_sequences(prompts, responses, np.array([2, 5]), 0)
    with pytest.raises(ValueError, match="at least one token"):
        build_sequences([[1], []], responses, np.array([2, 3]), 0)


def test_bucketed_layout_and_microbatch_sizes():
    assert [bucket_length(n, 128) for n in (1, 128, 129, 300)] == [128, 128, 256, 384]
    assert bucket_length(40, 64, limit=48) == 48 and bucket_length(0, 8) == 0
    with pytest.raises(ValueError, match="length <= limit"):
        bucket_length(50, 64, limit=48)
    # Rows per micro-batch: within the budget, balanced, never more micro-batches than needed.
    assert microbatch_size(32, 320, 16384) == 32  # fits: one shot
    assert microbatch_size(256, 320, 16384) == 43  # 51 rows fit; 6 micro-batches of 43 (the last 41)
    assert microbatch_size(5, 100, 50) == 1  # a row longer than the budget still runs alone
    prompts = [[5, 6, 7], [8]]
    responses = np.array([[1, 2, 9, 9], [3, 4, 5, 9]])
    exact = build_sequences(prompts, responses, np.array([2, 3]), 0)
    padded = build_sequences(prompts, responses, np.array([2, 3]), 0, prompt_len=8, response_len=6)
    assert padded[4] == 8 and padded[0].shape == (2, 14) and padded[3].shape == (2, 6)
    for got, want in zip(padded[:3], exact[:3]):  # the same sequences, more padding on both ends
        np.testing.assert_array_equal(got[:, 5:8 + 3], want[:, :3 + 3])
    np.testing.assert_array_equal(padded[3][:, :3], exact[3][:, :3])
    assert padded[3][:, 3:].sum() == 0 and padded[2][:, :5].sum() == 0 and padded[2][:, 11:].sum() == 0
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        build_sequences(prompts, responses, np.array([2, 3]), 0, prompt_len=2)
    with pytest.raises(ValueError, match="shorter than the longest response"):
        build_sequences(prompts, responses, np.array([2, 3]), 0, response_len=2)


_TINY = qwen3.Qwen3Config.preset("tiny", vocab_size=64, num_hidden_layers=2)


@functools.cache
def _tiny_logprobs():
    """One jitted log-prob function for every tiny policy below (it compiles once per batch shape)."""
    return make_logprob_fn(nnx.graphdef(qwen3.Qwen3ForCausalLM(_TINY, rngs=nnx.Rngs(0))))


@functools.cache  # the arrays are never donated (steps get copies), so tests in one worker can share them
def _policy_setup(seed: int = 0, rows: int = 6, prompt_len: int | None = None, response_len: int | None = None):
    """A tiny model's (graphdef, params) and a ragged mini-batch whose old log-probs are the model's own
    plus noise (so log W, clip flags and φ are non-trivial), with ±1.5 / ±0.5 advantages."""
    graphdef, params = nnx.split(qwen3.Qwen3ForCausalLM(_TINY, rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 64, size=int(n)).tolist() for n in rng.integers(2, 9, size=rows)]
    lengths = rng.integers(1, 7, size=rows)
    responses = rng.integers(1, 64, size=(rows, 6))
    ids, positions, attention, response_mask, p_len = build_sequences(
        prompts, responses, lengths, 0, prompt_len=prompt_len, response_len=response_len)
    batch = PolicyBatch(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention), jnp.asarray(response_mask),
                        jnp.zeros(response_mask.shape), jnp.asarray(np.resize([1.5, -0.5, 0.5, -1.5], rows), jnp.float32),
                        p_len)
    old = _tiny_logprobs()(params, batch)
    noise = 0.3 * rng.standard_normal(response_mask.shape).astype(np.float32)
    return graphdef, params, batch.replace(old_logp=(old + noise) * batch.response_mask)


def test_the_update_program_keeps_ynnpack_to_its_matmuls_on_cpu_with_the_same_update():
    """`qwen3.kernels.update_compiler_options`: on CPU the policy step's elementwise and reduce fusions
    are XLA's own (YNNPACK takes only the matmuls), on accelerators the compiler's defaults; the update
    is the default program's to float32 round-off."""
    from respo_jax.models.qwen3.kernels import update_compiler_options

    options = update_compiler_options("cpu")
    assert options == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
    assert update_compiler_options("gpu") is None and update_compiler_options("tpu") is None
    graphdef, params, batch = _policy_setup(seed=5)
    tx = optax.adamw(1e-3, eps=1e-4)
    steps = {name: make_policy_step(graphdef, get_objective("respo"), tx, compiler_options=opts)
             for name, opts in (("default", None), ("cpu", options))}

    def ynn_reductions(step) -> list[str]:
        text = step.lower(params, tx.init(params), batch).compile().as_text()
        return [line for line in text.splitlines() if "__ynn_fusion" in line and "reduce" in line]

    assert ynn_reductions(steps["default"]) and not ynn_reductions(steps["cpu"])
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    (want, _, want_metrics), (got, _, got_metrics) = (
        step(copy(params), tx.init(params), batch) for step in steps.values())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(got_metrics["loss"]), float(want_metrics["loss"]), rtol=1e-5)


def _keep_gradient() -> optax.GradientTransformation:
    """Passes the updates on unchanged and keeps them as its state: chained before an optimizer, the
    state after a step is exactly the gradient that step applied."""
    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda updates, state, params=None: (updates, updates))


@pytest.mark.slow
@pytest.mark.parametrize("name, hparams", [
    ("grpo", dict(clip_ratio_c=1.1)),  # token-mean; the dual clip active on many negative tokens
    ("gspo", {}),  # seq-mean-token-mean
    ("respo", dict(aggregation="seq-mean-token-sum")),
    ("dr_grpo", dict(loss_scale_factor=6.0)),  # seq-mean-token-sum-norm, as the trainer sets it
])
def test_microbatched_update_equals_the_one_shot_update(name, hparams):
    """Every aggregation mode: the micro-batched step (gradients accumulated over micro-batches of 1 and
    4 rows, the last padded with filler rows) applies the one-shot gradient (kept by a pass-through
    transformation chained before AdamW) and gives the one-shot parameters after AdamW, loss and every
    metric (means, minima, maxima, fractions)."""
    graphdef, params, batch = _policy_setup()
    objective = get_objective(name, **hparams)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 (the step donates its inputs)
    # AdamW's first update is lr·g/(|g| + ε), whose slope in g is up to lr/ε: with the usual ε = 1e-8 the
    # round-off of a gradient entry near zero (~1e-9 here) moves that parameter by up to ~0.1·lr
    # (measured: 2e-3·lr for one entry in 16k). ε = 1e-4 bounds that by 1e-5·lr, so the parameters
    # after AdamW agree to 1e-3·lr.
    tx = optax.chain(_keep_gradient(), optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-4, weight_decay=0.01))
    step = make_policy_step(graphdef, objective, tx, temperature=0.8)  # one jit: a compile per rows

    def run(rows):  # (the gradient, the parameters after AdamW, the metrics)
        new_params, (gradient, _), metrics = step(copy(params), tx.init(params), batch, microbatch_rows=rows)
        return gradient, new_params, metrics

    one_grads, one_params, one_metrics = run(None)
    assert float(one_metrics["log_w_min"]) < float(one_metrics["log_w_max"])
    for rows in (1, 4):
        grads, got_params, got_metrics = run(rows)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(one_grads)):
            assert np.abs(np.asarray(want)).max() > 0
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                       atol=1e-5 * np.abs(np.asarray(want)).max())
        for got, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(one_params)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-3 * 1e-3)
        assert set(got_metrics) == set(one_metrics)
        for key, want in one_metrics.items():
            if key == "responses":  # per-response log W, φ and approx-KL of the whole mini-batch
                for field, values in want.items():  # (not `name`: the grpo check below reads it)
                    np.testing.assert_allclose(np.asarray(got_metrics[key][field]), np.asarray(values),
                                               rtol=1e-5, atol=1e-6, err_msg=field)
                continue
            np.testing.assert_allclose(float(got_metrics[key]), float(want), rtol=1e-5, atol=1e-7, err_msg=key)
    if name == "grpo":
        assert float(one_metrics["clip_fraction_dual"]) > 0


def test_microbatched_logprobs_and_entropy_equal_the_one_shot_pass():
    """The micro-batched log π_old and rollout-time entropy (micro-batches of 1 and 4 rows, the last
    padded) equal the one-shot pass, at a rollout temperature."""
    graphdef, params, batch = _policy_setup()
    logprobs = make_logprob_fn(graphdef, temperature=0.8, return_entropy=True)
    one_shot = logprobs(params, batch)
    assert np.asarray(one_shot[1]).max() > 0
    for rows in (1, 4):
        for got, want in zip(logprobs(params, batch, microbatch_rows=rows), one_shot):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_bucketed_batches_give_the_same_update():
    """Padding prompts and responses to bucket lengths changes shapes, not results: the same log-probs
    of the real response tokens, the same parameters after the update and the same metrics."""
    graphdef, params, exact = _policy_setup(seed=3)
    _, _, bucketed = _policy_setup(seed=3, prompt_len=16, response_len=12)
    assert bucketed.input_ids.shape == (6, 28) and exact.input_ids.shape != bucketed.input_ids.shape
    logprobs = _tiny_logprobs()  # compiled for both shapes by the set-ups
    np.testing.assert_allclose(np.asarray(logprobs(params, bucketed))[:, :6], np.asarray(logprobs(params, exact)),
                               rtol=1e-5, atol=1e-6)
    bucketed = bucketed.replace(old_logp=jnp.pad(exact.old_logp, ((0, 0), (0, 6))))
    tx = optax.adamw(1e-3, eps=1e-4)  # see test_microbatched_update_equals_the_one_shot_update
    step = make_policy_step(graphdef, get_objective("respo"), tx)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    want_params, _, want = step(copy(params), tx.init(params), exact)
    got_params, _, got = step(copy(params), tx.init(params), bucketed, microbatch_rows=4)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-3 * 1e-3)
    for key in set(want) - {"responses"}:
        np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-5, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(np.asarray(got["responses"]["log_w"]), np.asarray(want["responses"]["log_w"]),
                               rtol=1e-5, atol=1e-6)


def test_compilations_are_counted():
    five, other_five, six = np.ones(5, np.float32), np.zeros(5, np.float32), np.ones(6, np.float32)
    fresh = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    before = compilation_totals()
    fresh(five)
    after_first = compilation_totals()
    fresh(five)
    fresh(other_five)
    after_cached = compilation_totals()
    fresh(six)  # a new shape is a new program
    after_new_shape = compilation_totals()
    assert (after_first - before).compiles == 1 and (after_first - before).seconds > 0
    assert (after_cached - after_first).compiles == 0
    assert (after_new_shape - after_cached).compiles == 1


def test_response_logprobs_match_a_teacher_forced_forward_per_sequence():
    """Left padding and batching must not change log π(o_t | q, o_<t) of any response token."""
    trainer = RLTrainer(apply_overrides(load_config(DEFAULT_CONFIG), TINY))
    model = trainer.model()
    prompts = [[1, 5, 13, 4], [1, 7, 13]]
    responses = np.array([[6, 24, 2], [9, 9, 24]])
    ids, positions, attention, _, prompt_len = build_sequences(prompts, responses, np.array([3, 2]), 0)
    batched = np.asarray(jm.response_logprobs(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention),
                                           prompt_len))
    for row, (prompt, length) in enumerate(zip(prompts, [3, 2])):
        seq = jnp.asarray([prompt + responses[row, :length].tolist()], jnp.int32)
        logits = jm.logits(model, seq)
        reference = jax.nn.log_softmax(logits[0, len(prompt) - 1 : -1], axis=-1)
        expected = np.take_along_axis(np.asarray(reference), responses[row, :length, None], axis=-1)[:, 0]
        np.testing.assert_allclose(batched[row, :length], expected, rtol=1e-5, atol=1e-5)


def test_policy_update_raises_logp_of_positive_and_lowers_negative_responses():
    trainer = RLTrainer(apply_overrides(load_config(DEFAULT_CONFIG), TINY + ["optim.learning_rate=3e-3"]))
    prompts = [[1, 5, 13, 4, 16]] * 4
    responses = np.array([[6, 24, 2], [7, 24, 2], [8, 24, 2], [9, 24, 2]])
    ids, positions, attention, response_mask, prompt_len = build_sequences(prompts, responses, np.full(4, 3), 0)
    batch = PolicyBatch(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention), jnp.asarray(response_mask),
                        jnp.zeros(response_mask.shape), jnp.asarray([1.5, -0.5, -0.5, -0.5]), prompt_len)
    old = trainer.old_logprobs(trainer.state.params, batch, None)[0]
    batch = batch.replace(old_logp=old)
    for _ in range(3):
        trainer.state.params, trainer.state.opt_state, metrics = trainer.policy_step(
            trainer.state.params, trainer.state.opt_state, batch)
    change = np.asarray((trainer.old_logprobs(trainer.state.params, batch, None)[0] - old).sum(-1))
    assert change[0] > 0 and np.all(change[1:] < 0), change
    assert np.isfinite(float(metrics["loss"])) and float(metrics["approx_kl"]) > 0


def test_checkpoint_round_trip(tmp_path):
    trainer = RLTrainer(apply_overrides(load_config(DEFAULT_CONFIG), TINY))
    s = trainer.state
    save_checkpoint(str(tmp_path), 7, s.params, s.opt_state, {"next_prompt_index": 42})
    zeros = jax.tree.map(jnp.zeros_like, s.params)
    params, opt_state, meta = restore_checkpoint(str(tmp_path), zeros, s.opt_state)
    assert meta == {"next_prompt_index": 42}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(s.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(FileNotFoundError):
        restore_checkpoint(str(tmp_path / "missing"), zeros, s.opt_state)


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_main_writes_metrics_curves_and_checkpoint(tmp_path):
    # programs an earlier test of this worker compiled under another cache setting are dropped from
    # memory first, so every program this run uses is in this run's compilation cache (see below)
    jax.clear_caches()
    summary = main(TINY + [f"run.out_dir={tmp_path}", "objective.name=grpo"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == 2 and rl[-1]["policy_updates"] == 4
    for key in ("train_accuracy", "score", "log_w_mean", "clip_fraction", "sampler_trainer_logp_gap", "approx_kl",
                "compiles", "compile_seconds", "compile_cache_hits"):
        assert key in rl[0], key
    # Bucketed shapes: the first iteration compiles the sampler, log-prob and update programs, the
    # second (same buckets) compiles nothing new. It may read programs from the session's compilation
    # cache: when an earlier test of this worker left this configuration's compile-ahead record there
    # (the programs are then read when first needed), or when the worker nears its memory-map limit and
    # the programs are dropped and read again (both said on stderr).
    assert rl[0]["compiles"] > 0 and rl[0]["compile_seconds"] > 0
    assert rl[1]["compiles"] == rl[1]["compile_cache_hits"], rl[1]
    # the sampler's log-probs are those the trainer recomputes for the rollout-time parameters
    assert rl[0]["sampler_trainer_logp_gap"] < 1e-4
    assert (tmp_path / "training_curves.png").stat().st_size > 1000
    assert (tmp_path / "checkpoints").is_dir()
    rollout_files = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert rollout_files == ["iteration_000001.npz", "iteration_000002.npz"]
    assert summary == summarize(records)
    assert json.loads((tmp_path / "config.json").read_text())["objective"]["name"] == "grpo"


def test_resume_continues_the_run_exactly(tmp_path):
    """`respo_jax.training.run.run(config)` from Python, as a notebook calls it, and its resume: params,
    optimizer state and the batches' position come back, 2 + 1 iterations == 3 iterations, record for
    record (but the timings) and in the last checkpoint's parameters."""
    from respo_jax.training.run import run
    from tiny_runs import raw_state, read_records, without_timings

    def config(out: str, *overrides: str) -> ExperimentConfig:
        return apply_overrides(load_config(DEFAULT_CONFIG),
                               TINY + ["run.eval_problems=0", f"run.out_dir={tmp_path / out}", *overrides])

    straight = run(config("a", "run.iterations=3"))
    run(config("b", "run.iterations=2"))
    resumed = run(config("b", "run.iterations=3", "run.resume=true"))
    assert resumed == straight and straight["iterations"] == 3
    assert without_timings(read_records(tmp_path / "b")) == without_timings(read_records(tmp_path / "a"))
    got, want = (raw_state(tmp_path / out / "checkpoints", 3)[0] for out in ("b", "a"))
    assert got.keys() == want.keys() and all(got[key].tobytes() == want[key].tobytes() for key in want)


SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


@pytest.mark.slow
def test_dapo_math_task_with_the_real_tokenizer_and_overlong_penalty(tmp_path):
    """The paper's training data path: DAPO-Math prompts, the Qwen3 tokenizer, strict box + overlong penalty."""
    # A worker of the full suite may hold earlier tests' programs near its memory-map limit, and the
    # trainer would then drop its own programs mid-test (`drop_programs_near_map_limit`), after which some
    # are compiled again rather than read from the cache: start from a process holding none.
    jax.clear_caches()
    config = apply_overrides(load_config(DEFAULT_CONFIG), [
        "task.name=dapo_math", f"task.data_dir={SHARED / 'data'}", f"task.tokenizer_dir={SHARED / 'tokenizers' / 'qwen3'}",
        "task.max_prompt_tokens=160", "task.overlong_buffer_length=2", "warmup.steps=0", "run.eval_problems=4",
        "rollout.prompts_per_minibatch=1", "rollout.group_size=2", "rollout.reuse=1", "rollout.max_new_tokens=4",
        "rollout.prompt_bucket=128",
        'model.overrides={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}',
    ])
    trainer = RLTrainer(config)
    assert trainer.tokenizer.vocab_size > 150_000 and len(trainer.held_out) == 4
    # The draw order of the prompt batches, to know each iteration's prompt bucket.
    shadow = PromptBatches(trainer.train_records, batch_size=1, seed=config.task.seed)
    buckets = [bucket_length(len(trainer.encode(next(shadow)[0])), 128) for _ in range(40)]
    other = 128 if buckets[0] == 256 else 256
    assert trainer.shapes.prompt_buckets() == [128, 256] and other in buckets
    record = trainer.iteration()
    # a random policy never writes the right box in 4 tokens; responses at the limit get the full penalty -1
    assert -2.0 <= record["score"] <= -1.0
    # rollout.compile_ahead: the first iteration compiled both buckets, so the first batch of the other
    # bucket (a new sampler, log π_old and update shape) compiles nothing (or, when the worker holds this
    # configuration's compile-ahead record from an earlier test, only reads programs from the cache).
    for _ in range(buckets.index(other)):
        record = trainer.iteration()
        assert record["compiles"] == record["compile_cache_hits"], record
    assert trainer.evaluation()["greedy_accuracy"] == 0.0
    tokens = np.array([trainer.tokenizer.encode("\\boxed{12}")])
    np.testing.assert_allclose(trainer.scorer.score(tokens, np.array([tokens.shape[1]]), [{"answer": "12"}])[0], [1.0 - 1.0])
    with pytest.raises(ValueError, match="warmup.steps=3: expected 0 with task.name='dapo_math'"):
        apply_overrides(config, ["warmup.steps=3"])


# ------------------------------------------------------------- the loop's helpers: placer, shapes, metrics
def test_row_placer_in_one_process_places_fetches_and_shares_every_row():
    mesh = jax.make_mesh((1,), ("data",))
    placer = RowPlacer(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    assert placer.rows(5) == slice(0, 5) and placer.share(5) == slice(0, 5)
    assert placer.take([[1], [2], [3]], np.array([2, 0])) == [[3], [1]]
    local = {"ids": np.arange(10, dtype=np.int32).reshape(5, 2), "mask": np.ones((5, 3), np.float32)}
    placed = placer.place(local, 5)
    assert placed["ids"].sharding == placer.sharding
    fetched = placer.fetch(placed)
    assert all(isinstance(v, np.ndarray) for v in fetched.values())
    np.testing.assert_array_equal(fetched["ids"], local["ids"])
    np.testing.assert_array_equal(placer.gather(np.arange(4), placer.share(4), 4), np.arange(4))
    with pytest.raises(ValueError, match="one process must supply every row of 4"):
        placer.gather(np.arange(2), slice(0, 2), 4)


def test_shape_tracker_compiles_ahead_once_and_trims_the_heap_only_for_new_shapes(monkeypatch):
    calls = []
    monkeypatch.setattr(shapes, "host_allocator_settings", lambda: {"applied": True})
    monkeypatch.setattr(shapes, "release_host_memory", lambda keep_free_bytes: calls.append(("release",
                                                                                             keep_free_bytes)))
    monkeypatch.setattr(shapes, "drop_programs_near_map_limit", lambda: calls.append("drop"))
    linear = functools.partial(padded_prompt_length, bucket=16, scheme="linear")
    tracker = shapes.ShapeTracker([3, 16, 17, 40, 5], linear, compile_ahead=True)
    assert tracker.prompt_buckets() == [16, 32, 48]
    geometric = shapes.ShapeTracker([3, 16, 17, 40, 5, 100],
                                    functools.partial(padded_prompt_length, bucket=16), compile_ahead=True)
    assert geometric.prompt_buckets() == [16, 32, 64, 128]
    compiled = []
    tracker.compile_ahead_once(lambda: tracker.compile_ahead(compiled.append))
    tracker.compile_ahead_once(lambda: tracker.compile_ahead(compiled.append))  # the second: nothing
    assert compiled == [16, 32, 48] and calls == ["drop"] * 3 + [("release", 0)]  # all that compiling freed
    calls.clear()
    for shape in [(4, 22), (4, 22), (4, 38), (4, 22)]:
        tracker.batch_shape(shape)
    # Once per new shape, keeping a free heap up to a sixth of the machine's memory.
    keep = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 6
    assert calls == ["drop", ("release", pytest.approx(keep, abs=1))] * 2
    off = shapes.ShapeTracker([3], linear, compile_ahead=False)
    off.compile_ahead_once(lambda: compiled.append("never"))
    assert compiled == [16, 32, 48]


def test_compiling_ahead_frees_the_reference_cycles_tracing_left(monkeypatch):
    """Reference cycles (as tracing and lowering leave) are freed before each program of the
    compile-ahead compiles and before the heap is trimmed, with the collector's own runs off."""
    class Node:
        pass

    def cycle() -> weakref.ref:
        node = Node()
        node.itself = node
        return weakref.ref(node)

    monkeypatch.setattr(shapes, "host_allocator_settings", lambda: {"applied": False})
    monkeypatch.setattr(shapes, "drop_programs_near_map_limit", lambda: None)
    tracker = shapes.ShapeTracker([3], functools.partial(padded_prompt_length, bucket=16, scheme="linear"),
                                  compile_ahead=True)
    left = []
    lowered = types.SimpleNamespace(compile=lambda: [ref() for ref in left])  # what is alive as it compiles
    enabled = gc.isenabled()
    gc.disable()
    try:
        left.append(cycle())
        alive_while_compiling = compile_ahead._collected_compile("update_step", lowered)
        tracker.compile_ahead(lambda prompt_len: left.append(cycle()))
        assert left[1]() is None
    finally:
        if enabled:
            gc.enable()
    assert alive_while_compiling == [None]


def test_logprob_metrics_pool_the_mini_batches_as_float64_numpy_does():
    """Two mini-batches of different widths in a permuted (balanced) row order: the gap and entropy per
    response token over the whole rollout batch, and the correction metrics of the stacked batch."""
    rng = np.random.default_rng(0)
    sampler = rng.normal(size=(6, 5)).astype(np.float32)
    minibatches = [np.array([4, 0, 2]), np.array([1, 5, 3])]
    parts = []
    for rows, width in zip(minibatches, (3, 5)):
        mask = (rng.random((3, width)) < 0.7).astype(np.float32)
        old, entropy = rng.normal(size=(3, width)), rng.random((3, width))
        parts.append((mask, old.astype(np.float32), entropy.astype(np.float32)))
    correction = RolloutCorrection.from_dict({"level": "token", "mode": "truncate", "threshold": 2.0})
    got = logprob_metrics(parts, minibatches, sampler, correction)
    tokens = sum(mask.astype(np.float64).sum() for mask, _, _ in parts)
    gap = sum(np.abs(sampler[rows, :mask.shape[1]].astype(np.float64) * mask - old).sum()
              for rows, (mask, old, _) in zip(minibatches, parts))
    np.testing.assert_allclose(got["sampler_trainer_logp_gap"], gap / tokens, rtol=1e-6)
    entropy = sum((e.astype(np.float64) * m).sum() for m, _, e in parts)  # masked tokens' do not count
    np.testing.assert_allclose(got["entropy"], entropy / tokens, rtol=1e-6)
    ratio = np.concatenate([np.exp(old - sampler[rows, :mask.shape[1]])[mask > 0]
                            for rows, (mask, old, _) in zip(minibatches, parts)])
    np.testing.assert_allclose(got["rollout_is_mean"], ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose([got["rollout_is_max"], got["rollout_is_min"]], [ratio.max(), ratio.min()],
                               rtol=1e-5)
    assert set(logprob_metrics(parts, minibatches, sampler, None)) == {"sampler_trainer_logp_gap", "entropy"}
    assert logprob_metrics([], [], sampler, correction) == {"sampler_trainer_logp_gap": 0.0, "entropy": 0.0}


def test_iteration_record_keeps_its_key_order_and_pools_over_the_rows_trained_on():
    steps = [{"loss": 1.0, "log_w_mean": -0.5}, {"loss": 3.0, "log_w_mean": -1.5}]
    responses = [{"log_w": [-2.0, 0.1], "phi": [0.2, 0.9], "approx_kl": [0.5, 9.0]},
                 {"log_w": [-0.3, -3.0], "phi": [0.7, 0.1], "approx_kl": [1.5, 2.0]}]
    minibatches = [np.array([0, 2]), np.array([1, 3])]
    trained = collect_rollout(minibatches, responses, np.array([1.0, -1.0, 1.0, 0.5], np.float32),
                              np.array([3, 0, 4, 2], np.int32), np.array([1, -1, 1, 1]), 2, 7, 14)
    assert trained["minibatch"].tolist() == [0, 1, 0, 1] and trained["group"].tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(trained["log_w"], np.float32([-2.0, -0.3, 0.1, -3.0]))
    assert (trained["iteration"], trained["policy_updates"]) == (7, 14)
    sampled = types.SimpleNamespace(all_scores=np.array([1.0, -1.0, 1.0, 1.0, -1.0, -1.0]),
                                    all_lengths=np.array([3, 0, 4, 2, 6, 6]), groups_generated=3, groups_kept=2,
                                    generation_batches=2)
    timings = {"rollout_seconds": 0.1, "iteration_seconds": 0.2, "reward_failures": 0}
    logprob = {"sampler_trainer_logp_gap": 0.25, "entropy": 1.5, "rollout_is_mean": 1.1}
    record = iteration_record({"phase": "rl", "iteration": 7}, sampled, timings, logprob, steps, trained,
                              0.01, filter_groups=True)
    assert list(record) == [
        "phase", "iteration", "score", "train_accuracy", "response_length", "sampler_trainer_logp_gap",
        "rollout_seconds", "iteration_seconds", "reward_failures", "groups_generated", "groups_kept",
        "generation_batches", "updates", "loss", "log_w_mean", "log_w_mean_last_minibatch", "rollout_is_mean",
        *pooled_diagnostics(trained["log_w"], trained["advantage"], trained["phi"], trained["length"]),
        "positive_low_w_fraction", "approx_kl", "entropy", "learning_rate"]
    assert record["score"] == 0.0 and record["train_accuracy"] == 0.5 and record["response_length"] == 3.5
    assert (record["loss"], record["log_w_mean"], record["log_w_mean_last_minibatch"]) == (2.0, -1.0, -1.5)
    assert record["updates"] == 2  # the responses of length 0 are out of the approx-KL mean:
    assert record["approx_kl"] == pytest.approx((0.5 + 9.0 + 2.0) / 3)
    # positives (advantage > 0): rows 0, 2, 3 with log W -2, 0.1, -3: two of three below -1
    assert record["positive_low_w_fraction"] == pytest.approx(2 / 3)
    empty = iteration_record({"phase": "rl"}, sampled, {"rollout_seconds": 0.1}, logprob, [],
                             {k: v[:0] if np.ndim(v) else v for k, v in trained.items()}, None, False)
    assert "updates" not in empty and "learning_rate" not in empty and empty["approx_kl"] == 0.0
    assert "positive_low_w_fraction" not in empty


TINY_MODEL = ('model.overrides={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, '
              '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}')


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_log_pi_old_from_the_sampler_is_the_recomputed_one_to_float32_round_off(scheduler):
    """`rollout.old_logprobs="sampler"` (both engines): the same responses are drawn, the sampler's
    log π_old and rollout entropy equal a forward pass's under the same parameters to float32 round-off,
    updates from them give the same parameters to round-off, and the log π_old program is neither run
    nor compiled ahead."""
    trainers = {source: RLTrainer(apply_overrides(load_config(DEFAULT_CONFIG), TINY + [
        "warmup.steps=0", "run.eval_problems=0", TINY_MODEL, f"rollout.scheduler={scheduler}",
        f"rollout.old_logprobs={source}"])) for source in ("recompute", "sampler")}
    assert {t.old_logprobs_source for t in trainers.values()} == {"recompute", "sampler"}
    got, uses = {}, {}
    for source, trainer in trainers.items():
        program, uses[source] = trainer.old_logprobs, []

        class Recorded:  # the log π_old program, its calls and compilations recorded
            def __call__(self, *args, program=program, used=uses[source]):
                used.append("run")
                return program(*args)

            def lower(self, *args, program=program, used=uses[source]):
                used.append("compile")
                return program.lower(*args)

        trainer.old_logprobs = Recorded()
        compile_bucket(trainer, trainer.model(), 16)  # what compile_ahead does for a bucket
        rows = trainer.training_rows(trainer.sample_groups())
        rows = dataclasses.replace(rows, advantages=np.random.default_rng(0).normal(
            size=rows.advantages.shape).astype(np.float32))  # a random model's rewards are all alike
        minibatches = trainer.minibatch_rows(rows)
        policy_batches, parts = trainer.with_old_logprobs(rows, minibatches)
        trainer.update(policy_batches, parts)  # the first mini-batch's recomputed log π_old: its update's
        metrics = logprob_metrics(trainer.placer.fetch(parts), minibatches, rows.sampler_logp, None)
        got[source] = (rows, [np.asarray(b.old_logp) for b, _ in policy_batches], parts, metrics,
                       jax.tree.leaves(trainer.state.params))
    (rows, old, parts, metrics, params), (rows_s, old_s, parts_s, metrics_s, params_s) = got.values()
    np.testing.assert_array_equal(rows.tokens, rows_s.tokens)
    assert rows.sampler_entropy is None and rows_s.sampler_entropy.shape == rows_s.tokens.shape
    for recomputed, sampled in zip(old, old_s):
        assert np.abs(recomputed).max() > 1.0  # real log-probs, not zeros
        np.testing.assert_allclose(sampled, recomputed, atol=2e-6, rtol=1e-6)
    for (mask, _, entropy), (_, _, entropy_s) in zip(parts, parts_s):
        mask = np.asarray(mask)
        np.testing.assert_allclose(np.asarray(entropy_s) * mask, np.asarray(entropy), atol=5e-6, rtol=1e-6)
    assert metrics_s["sampler_trainer_logp_gap"] == 0.0 < metrics["sampler_trainer_logp_gap"] < 1e-6
    assert metrics_s["entropy"] == pytest.approx(metrics["entropy"], rel=1e-6)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(params, jax.tree.leaves(
        RLTrainer(trainers["sampler"].config).state.params)))
    assert moved > 1e-4  # the updates did change the parameters
    for a, b in zip(params, params_s):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-5)
    assert uses == {"recompute": ["compile", "run"], "sampler": []}


def _recorded_old_logprobs(trainer) -> list:
    """Counts the calls of `trainer`'s log π_old program (a list that grows by one per call)."""
    program, calls = trainer.old_logprobs, []

    def recorded(*args):
        calls.append(args[1].input_ids.shape)
        return program(*args)

    trainer.old_logprobs = type("Recorded", (), {"__call__": staticmethod(recorded),
                                                 "lower": staticmethod(program.lower)})()
    return calls


def test_log_pi_old_from_the_first_update_is_the_recomputed_one_and_trains_the_same():
    """Synchronous rollouts, log π_old recomputed: the first update of a rollout batch takes mini-batch 1's
    log π_old (and rollout entropy) from its own forward instead of a separate pass. Against the same
    trainer with a separate pass for every mini-batch (float32, N = 2, two iterations): the stored log π_old
    and entropy agree to round-off, and so do the trained parameters; one pass fewer per iteration."""
    config = apply_overrides(load_config(DEFAULT_CONFIG), TINY + [
        "warmup.steps=0", "run.eval_problems=0", TINY_MODEL, "rollout.old_logprobs=recompute"])
    fused, plain = RLTrainer(config), RLTrainer(config)
    initial = [np.asarray(x) for x in jax.tree.leaves(fused.state.params)]
    assert fused.old_logprobs_from_update
    plain.old_logprobs_from_update = False  # every mini-batch's log π_old from a pass of its own
    calls = {"fused": _recorded_old_logprobs(fused), "plain": _recorded_old_logprobs(plain)}
    got = {}
    for name, trainer in (("fused", fused), ("plain", plain)):
        rows = trainer.training_rows(trainer.sample_groups())
        rows = dataclasses.replace(rows, advantages=np.random.default_rng(0).normal(
            size=rows.advantages.shape).astype(np.float32))  # a random model's rewards are all alike
        minibatches = trainer.minibatch_rows(rows)
        policy_batches, parts = trainer.with_old_logprobs(rows, minibatches)
        assert (policy_batches[0][0].old_logp is None) == (name == "fused")
        trainer.update(policy_batches, parts)
        record = trainer.iteration()  # a second rollout batch, from the updated parameters
        got[name] = ([np.asarray(b.old_logp) for b, _ in policy_batches], trainer.placer.fetch(parts), record,
                     jax.tree.leaves(trainer.state.params))
    assert [len(c) for c in calls.values()] == [2, 4]  # N - 1 passes per iteration instead of N
    (old, parts, record, params), (old_p, parts_p, record_p, params_p) = got.values()
    assert np.abs(old_p[0]).max() > 1.0  # real log-probs, not zeros
    for a, b in zip(old, old_p):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
    for (mask, logp, entropy), (mask_p, logp_p, entropy_p) in zip(parts, parts_p):
        np.testing.assert_array_equal(mask, mask_p)
        np.testing.assert_allclose(logp, logp_p, atol=1e-6, rtol=1e-6)
        assert np.abs(entropy_p).max() > 1.0
        np.testing.assert_allclose(entropy, entropy_p, atol=1e-5, rtol=1e-6)
    assert record["entropy"] == pytest.approx(record_p["entropy"], rel=1e-6)
    assert record["loss"] == pytest.approx(record_p["loss"], rel=1e-5, abs=1e-7)
    assert max(float(np.abs(a - b).max()) for a, b in zip(params, initial)) > 1e-4  # the updates moved them
    for a, b in zip(params, params_p):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_log_pi_old_of_stale_rollouts_is_recomputed_for_every_minibatch():
    """The first update's forward stands for π_old only when the rollout's parameters are the update's:
    asynchronous rollouts (`rollout.async_steps`), the rollout jobs' schedule even at no staleness, and
    the KL in the reward (read before any update) recompute log π_old of every mini-batch."""
    base = TINY + ["warmup.steps=0", "run.eval_problems=0", TINY_MODEL, "rollout.old_logprobs=recompute"]
    for overrides in (["rollout.async_steps=1"], ["objective.kl_in_reward=true", "objective.kl_coef=0.01"]):
        assert not old_logprobs_from_update(apply_overrides(load_config(DEFAULT_CONFIG), base + overrides),
                                            "recompute")
    assert not old_logprobs_from_update(apply_overrides(load_config(DEFAULT_CONFIG), base), "sampler")
    trainer = RLTrainer(apply_overrides(load_config(DEFAULT_CONFIG), base))
    assert trainer.old_logprobs_from_update
    calls = _recorded_old_logprobs(trainer)
    trainer.start_async_rollouts(0, overlap=False)  # the synchronous schedule through the rollout jobs
    try:
        trainer.iteration()
    finally:
        trainer.close()
    assert len(calls) == 2  # both mini-batches


@pytest.mark.parametrize("overrides,dtype,moe,correction,source", [
    ([], "float32", False, False, "sampler"),
    ([], "bfloat16", False, False, "recompute"),  # the sampler's bf16 kernels are not the trainer's
    ([], "float32", True, False, "recompute"),  # experts may differ at router ties
    (["rollout.routing_replay=true"], "float32", True, False, "sampler"),
    ([], "float32", False, True, "recompute"),  # the correction measures the sampler/trainer gap
    (["rollout.top_p=0.9"], "float32", False, False, "recompute"),  # a truncated distribution
    (["rollout.top_k=20"], "float32", False, False, "recompute"),
    (["rollout.old_logprobs=recompute"], "float32", False, False, "recompute"),
    (["rollout.old_logprobs=sampler"], "bfloat16", True, False, "sampler"),  # asked for: verl's bypass mode
    # the attention kernel exact for the dtype (paged_kernels.KERNEL_PRECISION) or not
    (["rollout.paged_attention_impl=pallas_tpu"], "float32", False, False, "recompute"),  # bf16 K/V inside
    (["rollout.paged_attention_impl=pallas_gpu"], "float32", False, False, "sampler"),
    (["rollout.paged_attention_impl=pallas_tpu", "rollout.old_logprobs=sampler", "model.dtype=bfloat16"],
     "bfloat16", False, False, "sampler"),
])
def test_old_logprobs_auto_takes_the_sampler_only_where_it_is_exact(overrides, dtype, moe, correction,
                                                                    source):
    rollout = apply_overrides(load_config(DEFAULT_CONFIG), overrides).rollout
    assert rollout.old_logprobs_source(dtype=dtype, moe=moe, correction=correction) == source


@pytest.mark.parametrize("overrides,message", [
    (["rollout.old_logprobs=forward"], r"^rollout.old_logprobs='forward': expected one of auto, sampler, "
                                       r"recompute$"),
    (["rollout.old_logprobs=sampler", "rollout.top_p=0.9"], r"^rollout.old_logprobs='sampler': expected "
                                                            r"'auto' or 'recompute' with rollout.top_k"),
    (["rollout.old_logprobs=sampler", 'objective.rollout_correction={"level": "token", "mode": "truncate", '
      '"threshold": 2.0}'], r"^rollout.old_logprobs='sampler': expected 'auto' or 'recompute' with "
                             r"objective.rollout_correction set"),
    (["rollout.old_logprobs=sampler", "rollout.paged_attention_impl=pallas_tpu"],
     r"^rollout.old_logprobs='sampler': expected 'auto' or 'recompute' with rollout.paged_attention_impl="
     r"'pallas_tpu' and model.dtype='float32': that kernel is not exact for that dtype"),
])
def test_old_logprobs_that_cannot_hold_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        apply_overrides(load_config(DEFAULT_CONFIG), overrides).validate()
    assert "\n" not in str(err.value)


def test_the_named_steps_of_an_iteration_compose_to_the_iteration():
    """`iteration()` is its named steps (README "The RL loop, step by step"): called one by one they
    give the same updates, counters and metrics as the whole."""
    config = apply_overrides(load_config(DEFAULT_CONFIG), TINY + [
        "warmup.steps=0", "run.eval_problems=0", 'model.overrides={"num_hidden_layers": 1, "hidden_size": 16, '
        '"intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}'])
    by_steps, whole = RLTrainer(config), RLTrainer(config)
    rows = by_steps.training_rows(by_steps.sample_groups())  # rollout, reward; advantages
    assert rows.real_rows == len(rows.prompts) == 2 * 2 * 4 and abs(rows.advantages.sum()) < 1e-5
    minibatches = by_steps.minibatch_rows(rows)
    assert [m.tolist() for m in minibatches] == [list(range(8)), list(range(8, 16))]  # consecutive
    policy_batches, _ = by_steps.with_old_logprobs(rows, minibatches)
    steps = by_steps.update(policy_batches)
    record = whole.iteration()
    assert (by_steps.state.iteration, by_steps.state.policy_updates) == (1, 2) == (whole.state.iteration,
                                                                                 whole.state.policy_updates)
    for key in ("loss", "grad_norm"):
        assert record[key] == float(np.mean([float(s[key]) for s in steps]))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(by_steps.state.params),
                                                      jax.tree.leaves(whole.state.params)))


@functools.cache
def _grouped_batch(group: int = 4, prompts: int = 3):
    """A tiny model's (graphdef, params) and a mini-batch of `prompts` prompt-major groups of `group`
    responses each (prompts of different lengths, so rows are left-padded; responses of 0 to 6
    tokens), with its own log-probs plus noise as log π_old."""
    graphdef, params = nnx.split(qwen3.Qwen3ForCausalLM(_TINY, rngs=nnx.Rngs(3)))
    rng = np.random.default_rng(3)
    rows = [p for n in (3, 7, 5)[:prompts] for p in [rng.integers(1, 64, size=n).tolist()] * group]
    lengths = np.resize([6, 0, 2, 5, 1, 6, 3], len(rows))
    responses = rng.integers(1, 64, size=(len(rows), 6))
    ids, positions, attention, response_mask, p_len = build_sequences(rows, responses, lengths, 0,
                                                                      prompt_len=8)
    batch = PolicyBatch(*map(jnp.asarray, (ids, positions, attention, response_mask)),
                        jnp.zeros(response_mask.shape),
                        jnp.asarray(rng.standard_normal(len(rows)), jnp.float32), p_len)
    old = _tiny_logprobs()(params, batch)
    noise = 0.3 * rng.standard_normal(response_mask.shape).astype(np.float32)
    return graphdef, params, batch.replace(old_logp=(old + noise) * batch.response_mask)


def test_a_shared_prompt_gives_each_rows_log_probs_entropy_and_gradient():
    """`prompt_group`: each group's prompt runs once into a KV cache its rows attend to; log-probs,
    entropies and the gradient of every parameter equal the rows' own forward to float32 round-off."""
    graphdef, params, batch = _grouped_batch()
    mask = np.asarray(batch.response_mask)
    weights = jnp.asarray(np.random.default_rng(0).standard_normal(mask.shape), jnp.float32) * mask

    def loss(params, group):
        model = nnx.merge(graphdef, params)
        logp = response_logprobs(model, batch.input_ids, batch.positions, batch.attention_mask,
                                 batch.prompt_len, prompt_group=group)
        return jnp.sum(logp * weights), logp

    loss_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (plain, plain_logp), plain_grad = loss_and_grad(params, 1)
    (shared, shared_logp), shared_grad = loss_and_grad(params, 4)
    np.testing.assert_allclose(np.asarray(shared_logp) * mask, np.asarray(plain_logp) * mask, rtol=0,
                               atol=2e-5)
    np.testing.assert_allclose(float(shared), float(plain), rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(plain_grad))
    for a, b in zip(jax.tree.leaves(shared_grad), jax.tree.leaves(plain_grad)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale)
    # without positions and mask (every token real) alike
    ids = batch.input_ids
    token_logprobs = jax.jit(lambda params, group: nnx.merge(graphdef, params).token_logprobs(
        ids[:, :-1], ids[:, 1:], start=batch.prompt_len - 1, prompt_group=group), static_argnums=1)
    want, got = (token_logprobs(params, group) for group in (1, 4))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)
    # the forward-only pass (log π_old and its entropy) through the same path
    logprobs = make_logprob_fn(graphdef, return_entropy=True)
    (want_logp, want_entropy), (got_logp, got_entropy) = (
        logprobs(params, batch.replace(prompt_group=group)) for group in (1, 4))
    np.testing.assert_allclose(np.asarray(got_logp), np.asarray(want_logp), rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_entropy), np.asarray(want_entropy), rtol=0, atol=2e-5)


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_a_policy_step_over_shared_prompts_is_the_step_over_the_rows_with_micro_batches_too():
    graphdef, params, batch = _grouped_batch()
    tx = optax.adamw(1e-3, eps=1e-4)
    step = make_policy_step(graphdef, get_objective("respo"), tx)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    for micro in (None, 4):  # one shot, and 3 micro-batches of one group each
        (want, _, want_metrics), (got, _, got_metrics) = (
            step(copy(params), tx.init(params), batch.replace(prompt_group=group), micro) for group in (1, 4))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)
        for key in ("loss", "grad_norm", "approx_kl"):
            np.testing.assert_allclose(float(got_metrics[key]), float(want_metrics[key]), rtol=1e-5,
                                       atol=1e-7)


def test_a_prompt_group_that_does_not_fit_the_batch_or_the_model_is_refused():
    graphdef, params, batch = _grouped_batch()
    model = nnx.merge(graphdef, params)
    with pytest.raises(ValueError, match="prompt_group must be >= 1 and divide the batch"):
        response_logprobs(model, batch.input_ids, batch.positions, batch.attention_mask, batch.prompt_len,
                          prompt_group=5)
    moe = qwen3.Qwen3ForCausalLM(qwen3.Qwen3Config.preset("tiny-moe"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a dense model without routing"):
        response_logprobs(moe, batch.input_ids, batch.positions, batch.attention_mask, batch.prompt_len,
                          prompt_group=4)


def test_the_trainer_shares_prompts_of_consecutive_groups_only():
    """`rollout.share_prompts`: mini-batches in "consecutive" order are prompt-major groups of G rows
    (PolicyBatch.prompt_group = G, micro-batches of whole groups); rows that are not (a batch whose
    groups differ, verl's balanced order, the option off) run their own prompts."""
    from respo_jax.training.batch_layout import prompt_groups_hold

    assert prompt_groups_hold([[1, 2]] * 4 + [[3]] * 4, 4)
    assert not prompt_groups_hold([[1, 2]] * 3 + [[3]] * 5, 4)
    assert not prompt_groups_hold([[1, 2]] * 6, 4) and not prompt_groups_hold([[1, 2]] * 4, 1)
    prompts = [[1, 5, 13, 4]] * 4 + [[1, 7, 13]] * 4
    responses, lengths, advantages = np.full((8, 3), 6), np.full(8, 3), np.zeros(8, np.float32)
    config = apply_overrides(load_config(DEFAULT_CONFIG), TINY + ["rollout.max_tokens_per_microbatch=12"])
    trainer = RLTrainer(config)
    batch, micro = trainer.layout.policy_batch(prompts, responses, lengths, advantages)
    assert batch.prompt_group == 4 and micro == 4  # 12 tokens hold one 11-token row; a group is 4
    assert batch.take(np.array([0, 5, 2, 7])).prompt_group == 1  # any rows: no sharing assumed
    mixed = prompts[:3] + prompts[4:] + prompts[3:4]  # A A A B B B B A
    assert trainer.layout.policy_batch(mixed, responses, lengths, advantages)[0].prompt_group == 1
    for override in ("rollout.minibatch_order=balanced", "rollout.share_prompts=false"):
        other = RLTrainer(apply_overrides(config, [override]))
        assert other.layout.prompt_group == 1
        assert other.layout.policy_batch(prompts, responses, lengths, advantages)[0].prompt_group == 1
