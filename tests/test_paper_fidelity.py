"""The paper's configurations and how a run reproduces verl's: prompts, LR schedule, mini-batch order,
temperature-scaled log-probs and entropy, approx_kl, rollout files and the App. E.3 tables from them."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pyarrow.parquet as pq
import pytest

import jitted_model as jm
from experiments.train import DEFAULT_CONFIG, load_config, main
from respo_jax.data import PromptFormat, encode_prompt, load_tokenizer, render_prompt
from respo_jax.data.records import dapo_problem_text
from respo_jax.eval import (
    allocation_table,
    bin_allocation,
    length_by_bin,
    load_rollout_files,
    pooled_diagnostics,
    read_rollout_file,
    weight_length_trajectory,
    write_rollout_file,
)
from respo_jax.eval.positive_branch import DEEP_TAIL, LOW_W, bin_labels, log_w_bin
from respo_jax.objectives import get_objective
from respo_jax.training.batch import PolicyBatch, build_sequences
from respo_jax.training.config import apply_overrides
from respo_jax.training.loop import RLTrainer
from respo_jax.training.minibatches import (
    balanced_minibatches,
    consecutive_minibatches,
    equal_size_partitions,
    sequence_workload,
)
from respo_jax.training.model_setup import build_model
from respo_jax.training.step import learning_rate_schedule, make_optimizer, make_policy_step
from respo_jax.training.tasks import load_task

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
if not SHARED.is_dir():  # a worktree next to the main checkout
    SHARED = pathlib.Path("/work/shared")
DATA = SHARED / "data"
QWEN3 = SHARED / "tokenizers" / "qwen3"
CONFIG_1P7B = str(ROOT / "experiments" / "configs" / "qwen3_1p7b_dapo.py")
CONFIG_30B = str(ROOT / "experiments" / "configs" / "qwen3_30b_a3b_dapo.py")


# ----------------------------------------------------------------------------- the paper configurations


@pytest.mark.parametrize(
    "path, max_new_tokens, buffer", [(CONFIG_1P7B, 15_360, 0), (CONFIG_30B, 8_192, 4_096)]
)
def test_paper_configs_load_with_the_papers_values(path, max_new_tokens, buffer):
    config = load_config(path)  # get_config() needs no paths
    optim = config.optim
    assert (optim.learning_rate, optim.weight_decay, optim.max_grad_norm) == (1e-6, 0.1, 1.0)
    assert (optim.warmup_ratio, optim.schedule_per, optim.warmup_steps) == (0.05, "rollout", 0)
    assert (config.model.dtype, config.model.param_dtype, config.model.preset) == ("bfloat16", "float32", "")
    r = config.rollout
    assert (r.prompts_per_minibatch, r.group_size, r.reuse) == (32, 8, 8)
    assert (r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.minibatch_order) == (
        max_new_tokens, 1.0, 1.0, 0, "consecutive")
    task = config.task
    assert (task.name, task.chat_template, task.max_prompt_tokens) == ("dapo_math", True, 1024)
    assert (config.task.overlong_buffer_length, config.task.overlong_penalty_factor) == (buffer, 1.0)
    assert config.objective.name == "respo" and config.objective.hparams == {}
    assert get_objective(config.objective.name).aggregation == "token-mean"  # Tab. 2; no KL term exists
    assert config.run.policy_updates == 1024 and config.warmup.steps == 0
    # 1,024 updates at N = 8 are 128 rollout batches (32,768 prompts); warm-up int(0.05 * 128) = 6 batches.
    assert (config.num_iterations, config.lr_warmup_steps) == (128, 6)
    assert config.num_iterations * r.reuse * r.prompts_per_minibatch == 32_768
    for n, iterations, warmup in ((16, 64, 3), (32, 32, 1)):
        paths = ["model.checkpoint_dir=/ckpt", "task.data_dir=/data", "task.tokenizer_dir=/tok"]
        changed = apply_overrides(config, paths + [f"rollout.reuse={n}"])
        assert (changed.num_iterations, changed.lr_warmup_steps) == (iterations, warmup)


@pytest.mark.parametrize("path", [CONFIG_1P7B, CONFIG_30B])
def test_a_paper_config_without_paths_stops_at_start_up_naming_them(path, tmp_path):
    out_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="model.checkpoint_dir=.* task.data_dir=.* task.tokenizer_dir="):
        main(["--config", path, f"run.out_dir={out_dir}"])
    assert not out_dir.exists()  # nothing was started
    with pytest.raises(ValueError, match="pass them on the command line: task.tokenizer_dir="):
        apply_overrides(load_config(path), ["model.checkpoint_dir=/ckpt", "task.data_dir=/data"])


def test_run_length_in_policy_updates_must_divide_by_n():
    with pytest.raises(ValueError, match="run.policy_updates=10: expected a multiple of rollout.reuse=4"):
        apply_overrides(load_config(DEFAULT_CONFIG), ["run.policy_updates=10"])


# ----------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def dapo_head(tmp_path_factory):
    """The first 64 rows of the real DAPO-Math parquet (the reader and tokenizer are the real ones)."""
    path = tmp_path_factory.mktemp("dapo") / "dapo_math_17k.parquet"
    pq.write_table(pq.read_table(DATA / "dapo_math_17k" / "dapo_math_17k.parquet").slice(0, 64), path)
    return path


def _dapo_config(data, *extra):
    return apply_overrides(load_config(DEFAULT_CONFIG), [
        "task.name=dapo_math", f"task.data_dir={data}", f"task.tokenizer_dir={QWEN3}", "warmup.steps=0",
        "run.eval_problems=0", *extra,
    ])


def test_dapo_math_prompt_starts_with_the_chat_template_by_default(dapo_head):
    config = _dapo_config(dapo_head)
    assert config.task.chat_template  # default on
    tokenizer, fmt, train, *_ = load_task(config)
    record = train[0]
    ids = encode_prompt(record["problem"], tokenizer, fmt)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n")
    assert text == render_prompt(record["problem"], tokenizer, PromptFormat())
    assert record["problem"] == dapo_problem_text(record["problem"])  # prefix/suffix removed and stripped
    instruction = " Please reason step by step, and put your final answer within \\boxed{}."
    assert text.endswith(instruction + "<|im_end|>\n<|im_start|>assistant\n")


def test_load_task_counts_each_training_prompt_once(dapo_head):
    """`Task.train_prompt_lengths` (the trainer's prompt buckets) are the token counts of the training
    prompts, one by one, from the overlong filter's single tokenization; so too for the synthetic task."""
    config = _dapo_config(dapo_head)
    task = load_task(config)
    assert len(task.train_prompt_lengths) == len(task.train) > 0
    assert task.train_prompt_lengths == [
        len(encode_prompt(r["problem"], task.tokenizer, task.prompt_format)) for r in task.train]
    assert max(task.train_prompt_lengths) <= config.task.max_prompt_tokens
    synthetic = load_task(apply_overrides(load_config(DEFAULT_CONFIG), ["task.num_records=20"]))
    assert synthetic.train_prompt_lengths == [
        len(encode_prompt(r["problem"], synthetic.tokenizer, synthetic.prompt_format)) for r in synthetic.train]


def test_a_tokenizer_without_chat_template_fails_clearly(tmp_path, dapo_head):
    shutil.copy(QWEN3 / "tokenizer.json", tmp_path / "tokenizer.json")
    tokenizer_config = json.loads((QWEN3 / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match="has no chat template .* set task.chat_template=false"):
        load_task(_dapo_config(dapo_head, f"task.tokenizer_dir={tmp_path}"))
    raw = _dapo_config(dapo_head, f"task.tokenizer_dir={tmp_path}", "task.chat_template=false")
    tokenizer, fmt, train, *_ = load_task(raw)
    assert not fmt.chat and render_prompt(train[0]["problem"], tokenizer, fmt).startswith(train[0]["problem"])


# ----------------------------------------------------------------------------- learning-rate schedule


def test_rollout_step_warm_up_matches_verls_constant_schedule_with_warmup():
    # verl: lr_lambda(k) = k / W for k < W, else 1; stepped once per rollout batch of N updates.
    schedule = learning_rate_schedule(1e-6, warmup_steps=6, updates_per_step=8)
    counts = np.arange(64)
    expected = 1e-6 * np.minimum(1.0, (counts // 8) / 6)
    np.testing.assert_allclose(np.asarray(schedule(counts)), expected, rtol=1e-6, atol=0)
    assert float(schedule(7)) == 0.0 and float(schedule(8)) > 0.0  # the whole first rollout batch at lr 0
    np.testing.assert_allclose(float(schedule(10_000)), 1e-6, rtol=1e-6)
    per_update = learning_rate_schedule(1e-3, warmup_steps=4)
    expected = [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
    np.testing.assert_allclose(np.asarray(per_update(np.arange(6))), expected, rtol=1e-6)
    np.testing.assert_allclose(float(learning_rate_schedule(3e-4, 0)(0)), 3e-4, rtol=1e-6)


def test_adam_moments_advance_while_the_learning_rate_is_zero():
    """As torch's AdamW: the first rollout batch leaves the weights alone but its moments count."""
    tx = make_optimizer(1e-2, 0.1, 0.9, 0.999, 1.0, warmup_steps=1, updates_per_step=2)
    params = {"w": jnp.array([1.0, -2.0])}
    state = tx.init(params)
    grads = {"w": jnp.array([0.5, -0.25])}
    for _ in range(2):  # rollout batch 0: lr 0
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(np.asarray(params["w"]), [1.0, -2.0])
    mu = [leaf for leaf in jax.tree.leaves(state) if getattr(leaf, "shape", ()) == (2,)][0]
    assert np.all(np.asarray(mu) != 0)
    updates, state = tx.update(grads, state, params)  # rollout batch 1: full lr
    assert np.all(np.asarray(updates["w"]) != 0)


def test_config_warmup_ratio_counts_the_schedules_unit():
    base = load_config(DEFAULT_CONFIG)  # 300 iterations of N = 4
    per_rollout = apply_overrides(base, ["optim.warmup_ratio=0.05", "optim.schedule_per=rollout"])
    per_update = apply_overrides(base, ["optim.warmup_ratio=0.05"])
    assert (per_rollout.lr_warmup_steps, per_update.lr_warmup_steps) == (15, 60)
    with pytest.raises(ValueError, match="not both"):
        apply_overrides(base, ["optim.warmup_ratio=0.05", "optim.warmup_steps=3"])
    with pytest.raises(ValueError, match="optim.schedule_per='epoch': expected 'update' or 'rollout'"):
        apply_overrides(base, ["optim.schedule_per=epoch"])


# ----------------------------------------------------------------------------- mini-batch order


def test_consecutive_minibatches_are_the_papers_split():
    batches = consecutive_minibatches(12, 3)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="cannot be split"):
        consecutive_minibatches(10, 3)


def test_karmarkar_karp_partition_worked_by_hand():
    # Seeds {2},{1} / {4},{3} / {6},{5} (spread 1 each); the largest leading set pops first: {6,3},{5,4}
    # (spread 0); then {2} + {5,4} and {1} + {6,3}: sums 11 and 10.
    assert equal_size_partitions([1, 2, 3, 4, 5, 6], 2) == [[1, 3, 4], [0, 2, 5]]
    assert equal_size_partitions([7, 7, 7, 7], 4) == [[3], [2], [1], [0]]  # ties: by the items' order
    with pytest.raises(ValueError, match="equal-size sets"):
        equal_size_partitions([1, 2, 3], 2)


def test_balanced_order_reproduces_verls_balance_batch_layout():
    lengths = np.array([50, 10, 40, 30, 60, 20])  # workloads rank like lengths
    # One rank: sorted by workload [1, 5, 3, 2, 0, 4], small at both ends -> [1, 3, 0] + [4, 2, 5].
    one_rank = balanced_minibatches(lengths, num_minibatches=2, num_ranks=1)
    assert [b.tolist() for b in one_rank] == [[1, 3, 0], [4, 2, 5]]
    # Two ranks: partitions [1, 3, 4] and [0, 2, 5] of workload rank (as in the hand-worked case above),
    # each laid out small at both ends ([1, 4, 3], [5, 0, 2] by workload), then rank slices per update.
    ranked = np.argsort(np.argsort(lengths))  # lengths -> ranks 0..5 of the same order
    assert equal_size_partitions(sequence_workload(lengths).tolist(), 2) == \
        equal_size_partitions((ranked + 1).tolist(), 2)
    two_ranks = balanced_minibatches(lengths, num_minibatches=3, num_ranks=2)
    parts = equal_size_partitions(sequence_workload(lengths).tolist(), 2)
    laid_out = [sorted(p, key=lambda i: lengths[i]) for p in parts]
    laid_out = [p[::2] + p[1::2][::-1] for p in laid_out]
    assert [b.tolist() for b in two_ranks] == [[laid_out[0][k], laid_out[1][k]] for k in range(3)]
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 16_000, 256)
    batches = balanced_minibatches(lengths, num_minibatches=8, num_ranks=4)
    assert sorted(np.concatenate(batches).tolist()) == list(range(256))  # a permutation
    rank_sums = [sequence_workload(lengths)[p].sum() for p in equal_size_partitions(
        sequence_workload(lengths).tolist(), 4)]
    assert (max(rank_sums) - min(rank_sums)) / np.mean(rank_sums) < 0.01  # balanced ranks


# ----------------------------------------------------------------------------- model dtype, log-probs


def test_model_dtype_is_honoured_for_presets():
    config = load_config(DEFAULT_CONFIG)
    bf16 = build_model(apply_overrides(config, ["model.dtype=bfloat16"]), vocab_size=64)
    assert (bf16.config.dtype, bf16.config.param_dtype) == ("bfloat16", "bfloat16")
    mixed = build_model(apply_overrides(config, ["model.dtype=bfloat16", "model.param_dtype=float32"]), 64)
    assert (mixed.config.dtype, mixed.config.param_dtype) == ("bfloat16", "float32")
    assert mixed.embed_tokens[...].dtype == jnp.float32
    assert build_model(config, 64).config.dtype == "float32"


def test_trainer_logprobs_take_the_rollout_temperature_and_the_full_distributions_entropy():
    model = build_model(load_config(DEFAULT_CONFIG), vocab_size=64)
    prompts = [[1, 5, 13, 4], [1, 7, 13]]
    responses = np.array([[6, 24, 2], [9, 9, 24]])
    ids, positions, attention, mask, prompt_len = build_sequences(prompts, responses, np.array([3, 2]), 0)
    for temperature in (1.0, 0.7):
        logp, entropy = jm.response_logprobs(
            model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention), prompt_len,
            temperature=temperature, return_entropy=True,
        )
        for row, (prompt, length) in enumerate(zip(prompts, [3, 2])):
            seq = jnp.asarray([prompt + responses[row, :length].tolist()], jnp.int32)
            logits = np.asarray(jm.logits(model, seq)[0, len(prompt) - 1: -1], np.float64) / temperature
            top = logits.max(-1, keepdims=True)
            log_softmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
            expected = np.take_along_axis(log_softmax, responses[row, :length, None], axis=-1)[:, 0]
            expected_entropy = -(np.exp(log_softmax) * log_softmax).sum(-1)
            np.testing.assert_allclose(np.asarray(logp)[row, :length], expected, rtol=1e-5, atol=1e-5)
            got_entropy = np.asarray(entropy)[row, :length]
            np.testing.assert_allclose(got_entropy, expected_entropy, rtol=1e-5, atol=1e-5)


def test_policy_step_reports_k1_approx_kl_and_per_response_log_w_and_phi():
    config = load_config(DEFAULT_CONFIG)
    model = build_model(config, vocab_size=64)
    from flax import nnx

    graphdef, params = nnx.split(model)
    prompts = [[1, 5, 13, 4]] * 3
    responses = np.array([[6, 24, 2, 5], [7, 24, 2, 0], [8, 3, 0, 0]])
    lengths = np.array([4, 3, 2])
    ids, positions, attention, mask, prompt_len = build_sequences(prompts, responses, lengths, 0)
    logp = jm.response_logprobs(
        model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention), prompt_len
    )
    shift = np.array([[0.3, -0.2, 0.1, 0.4], [-0.5, 0.2, 0.6, 0.0], [0.25, -0.75, 0.0, 0.0]]) * mask
    old_logp = jnp.asarray(np.asarray(logp) * mask + shift, jnp.float32)
    batch = PolicyBatch(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention), jnp.asarray(mask),
                        old_logp, jnp.asarray([1.0, -0.5, 0.8]), prompt_len)
    objective = get_objective("respo")
    step = make_policy_step(graphdef, objective, make_optimizer(1e-3, 0.0, 0.9, 0.999, 1.0, 0))
    _, _, metrics = step(params, make_optimizer(1e-3, 0.0, 0.9, 0.999, 1.0, 0).init(params), batch)
    k1 = (shift.sum(axis=1) / lengths)  # old - new, token mean per response
    np.testing.assert_allclose(np.asarray(metrics["responses"]["approx_kl"]), k1, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["approx_kl"]), k1.mean(), rtol=1e-4, atol=1e-6)
    log_w = np.asarray(metrics["responses"]["log_w"])
    np.testing.assert_allclose(log_w, -shift.sum(axis=1), rtol=1e-4, atol=1e-5)
    evaluated = objective.evaluate(logp, old_logp, batch.advantages, batch.response_mask)
    phi = np.asarray(evaluated.responses["phi"])
    np.testing.assert_allclose(np.asarray(metrics["responses"]["phi"]), phi, rtol=1e-5)


# ----------------------------------------------------------------------------- rollout files


def _rollout(iteration=1, rows=8, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "log_w": rng.normal(0, 2, rows).astype(np.float32),
        "advantage": rng.normal(0, 1, rows).astype(np.float32),
        "length": rng.integers(1, 100, rows).astype(np.int32),
        "phi": rng.uniform(0, 1.3, rows).astype(np.float32),
        "reward": rng.choice([-1.0, 1.0], rows).astype(np.float32),
        "minibatch": (np.arange(rows) // (rows // 2)).astype(np.int32),
        "group": (np.arange(rows) // 2).astype(np.int32),
        "iteration": np.int64(iteration),
        "policy_updates": np.int64(2 * iteration),
    }


def test_rollout_files_round_trip_without_pickle_and_atomically(tmp_path):
    written = [_rollout(i, seed=i) for i in (2, 1, 3)]
    for rollout in written:
        path = write_rollout_file(tmp_path, rollout)
    assert path == str(tmp_path / "rollouts" / "iteration_000003.npz")
    assert sorted(os.listdir(tmp_path / "rollouts")) == [f"iteration_00000{i}.npz" for i in (1, 2, 3)]
    with np.load(path, allow_pickle=False) as data:
        assert set(data.files) == set(written[2])
    loaded = load_rollout_files(tmp_path)
    assert [int(r["iteration"]) for r in loaded] == [1, 2, 3]
    for key, value in written[1].items():
        np.testing.assert_array_equal(loaded[0][key], value)
        assert loaded[0][key].dtype == np.asarray(value).dtype
    assert len(load_rollout_files(tmp_path / "rollouts")) == 3


def test_rollout_files_reject_bad_input_with_the_problem_named(tmp_path):
    bad = _rollout()
    bad["phi"] = bad["phi"][:-1]
    with pytest.raises(ValueError, match="phi has 7 rows, log_w has 8"):
        write_rollout_file(tmp_path, bad)
    bad = _rollout()
    bad["log_w"][0] = np.nan
    with pytest.raises(ValueError, match="log_w must hold finite numbers"):
        write_rollout_file(tmp_path, bad)
    bad = {k: v for k, v in _rollout().items() if k != "reward"}
    with pytest.raises(ValueError, match=r"missing \['reward'\]"):
        write_rollout_file(tmp_path, bad)
    with pytest.raises(ValueError, match="iteration must be >= 1"):
        write_rollout_file(tmp_path, _rollout(iteration=0))
    assert not (tmp_path / "rollouts").exists() or not os.listdir(tmp_path / "rollouts")
    with pytest.raises(FileNotFoundError, match="no rollout files"):
        load_rollout_files(tmp_path)
    (tmp_path / "rollouts").mkdir(exist_ok=True)
    (tmp_path / "rollouts" / "iteration_000001.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="iteration_000001.npz: not a readable rollout file"):
        read_rollout_file(tmp_path / "rollouts" / "iteration_000001.npz")


# ----------------------------------------------------------------------------- App. E.3 tables


def _reference_shares(log_w, adv, phi, inside):
    pos = adv > 0
    mass = np.abs(adv) * phi
    return (pos & inside).sum() / pos.sum(), mass[pos & inside].sum() / mass[pos].sum()


def test_e3_tables_from_rollout_files_match_a_direct_count(tmp_path):
    rng = np.random.default_rng(7)
    for iteration in range(1, 5):
        rollout = _rollout(iteration, rows=64, seed=iteration)
        values = [-25.0, -20.0, -12.0, -5.0, -3.0, -2.0, -1.5, -1.0, -0.7, -0.2, 0.0, 0.3, 0.8, 1.5, 3.0, 7.0,
                  15.0, 20.0]
        rollout["log_w"] = rng.choice(values, 64).astype(np.float32)
        write_rollout_file(tmp_path, rollout)
    rollouts = load_rollout_files(tmp_path)

    # Tab. 5 over batches 2-4: mean shares, amplification = ratio of the means.
    table = allocation_table(rollouts, first=2, last=4)
    for region, inside_fn in ((LOW_W, lambda x: x < -1), (DEEP_TAIL, lambda x: (x > -5) & (x <= -2))):
        shares = np.array([_reference_shares(r["log_w"].astype(np.float64), r["advantage"].astype(np.float64),
                                             r["phi"].astype(np.float64), inside_fn(r["log_w"]))
                           for r in rollouts[1:]])
        row = table[region[0]]
        np.testing.assert_allclose([row["response_share"], row["mass_share"]], shares.mean(axis=0), rtol=1e-6)
        mean_share, mean_mass_share = shares.mean(axis=0)
        np.testing.assert_allclose(row["amplification"], mean_mass_share / mean_share, rtol=1e-6)
        assert row["batches"] == 3

    # Tab. 6: per batch.
    trajectory = weight_length_trajectory(rollouts)
    for row, rollout in zip(trajectory, rollouts):
        pos = rollout["advantage"] > 0
        assert row["iteration"] == int(rollout["iteration"]) and row["positive_count"] == pos.sum()
        np.testing.assert_allclose(row["positive_log_w_mean"], rollout["log_w"][pos].mean(), rtol=1e-5)
        np.testing.assert_allclose(row["positive_length_mean"], rollout["length"][pos].mean(), rtol=1e-6)

    # Tab. 7: 14 right-closed bins, pooled count-weighted lengths relative to the branch mean.
    tab7 = length_by_bin(rollouts)
    assert [row["bin"] for row in tab7["bins"]] == bin_labels() and len(bin_labels()) == 14
    assert tab7["bins"][3]["bin"] == "(-5, -2]"
    log_w = np.concatenate([r["log_w"][r["advantage"] > 0] for r in rollouts]).astype(np.float64)
    length = np.concatenate([r["length"][r["advantage"] > 0] for r in rollouts]).astype(np.float64)
    edges = [-np.inf, -20, -10, -5, -2, -1, -0.5, 0, 0.5, 1, 2, 5, 10, 20, np.inf]
    counts = collections.Counter()
    for j, row in enumerate(tab7["bins"]):
        inside = (log_w > edges[j]) & (log_w <= edges[j + 1])
        counts[j] = inside.sum()
        assert row["count"] == inside.sum()
        if inside.any():
            np.testing.assert_allclose(row["length_mean"], length[inside].mean(), rtol=1e-9)
            np.testing.assert_allclose(row["relative"], length[inside].mean() / length.mean(), rtol=1e-9)
        else:
            assert row["length_mean"] is None and row["relative"] is None
    assert counts[0] > 0 and counts[13] == 0  # -25 and -20 fall in (-inf, -20]; 20 is in (10, 20]
    assert tab7["branch_count"] == log_w.size and tab7["branch_mean"] == pytest.approx(length.mean())

    per_bin = bin_allocation(rollouts[0])
    np.testing.assert_allclose(per_bin["share"].sum(), 1.0)
    np.testing.assert_allclose(per_bin["mass_share"].sum(), 1.0)
    assert np.array_equal(log_w_bin([-20.0, -19.9, -2.0, -1.99, 20.0, 25.0]), [0, 1, 3, 4, 12, 13])
    with pytest.raises(ValueError, match=r"no rollout batch in iterations \[9, 16\]"):
        allocation_table(rollouts, first=9, last=16)


def test_pooled_diagnostics_on_a_hand_built_batch():
    # Positives: log W -2 (A 1, phi 1.2), -0.5 (A 2, phi 1.0), -3 (A 1, phi 1.3); one negative, one A = 0.
    log_w = np.array([-2.0, -0.5, -3.0, -4.0, -6.0])
    adv = np.array([1.0, 2.0, 1.0, -1.0, 0.0])
    phi = np.array([1.2, 1.0, 1.3, 0.5, 1.1])
    length = np.array([10, 20, 30, 40, 50])
    d = pooled_diagnostics(log_w, adv, phi, length)
    assert d["positive_low_w_share"] == pytest.approx(2 / 3)
    assert d["positive_low_w_mass_share"] == pytest.approx(2.5 / 4.5)
    assert d["positive_low_w_amplification"] == pytest.approx((2.5 / 4.5) / (2 / 3))
    assert d["positive_log_w_mean"] == pytest.approx(-5.5 / 3)
    assert d["positive_length_mean"] == pytest.approx(20.0)
    assert set(pooled_diagnostics(log_w, -np.abs(adv), phi, length).values()) == {0.0}


def test_the_policy_updates_e3_metrics_are_the_pooled_records_definitions():
    """One definition of App. E.3's statistics: the jitted update's per-mini-batch metrics and the pooled
    record (float64 on the host) agree on one batch, an empty response (length 0) counting in neither."""
    import jax

    from respo_jax.objectives.policy_losses import sequence_metrics
    from respo_jax.objectives.positive_branch import positive_branch_statistics

    log_w = np.array([-2.0, -0.5, -3.0, -4.0, -6.0, -5.0], np.float32)
    adv = np.array([1.0, 2.0, 1.0, -1.0, 0.0, 3.0], np.float32)
    phi = np.array([1.2, 1.0, 1.3, 0.5, 1.1, 0.7], np.float32)
    length = np.array([3, 2, 4, 1, 2, 0])
    mask = (np.arange(4)[None, :] < length[:, None]).astype(np.float32)
    step = jax.jit(sequence_metrics)(log_w, adv, mask, phi)
    pooled = positive_branch_statistics(log_w, adv, phi, length, xp=np)
    assert float(step["positive_low_w_fraction"]) == pytest.approx(pooled["positive_low_w_share"], rel=1e-6)
    assert float(step["positive_low_w_mass_share"]) == pytest.approx(pooled["positive_low_w_mass_share"],
                                                                     rel=1e-6)
    assert pooled["positive_low_w_share"] == pytest.approx(2 / 3)  # the empty positive response is out
    assert pooled == pooled_diagnostics(log_w, adv, phi, length)


# ----------------------------------------------------------------------------- the 1.7B config, scaled down


def _equal_length_dapo_subset(path: pathlib.Path, rows: int = 8, max_tokens: int = 96) -> pathlib.Path:
    """A parquet of `rows` DAPO-Math rows whose chat prompts all have one token length, so every rollout
    batch has the same shape (one compile of each program)."""
    table = pq.read_table(DATA / "dapo_math_17k" / "dapo_math_17k.parquet").slice(0, 600)
    tokenizer = load_tokenizer(QWEN3)
    lengths = [len(encode_prompt(dapo_problem_text(p[0]["content"]), tokenizer, PromptFormat()))
               for p in table.column("prompt").to_pylist()]
    by_length = collections.defaultdict(list)
    for index, length in enumerate(lengths):
        by_length[length].append(index)
    chosen = max((ix for n, ix in by_length.items() if n <= max_tokens), key=len)[:rows]
    assert len(chosen) == rows
    pq.write_table(table.take(chosen), path)
    return path


@pytest.mark.slow
def test_two_iterations_of_the_1p7b_config_scaled_down_run_on_cpu(tmp_path):
    """The paper's 1.7B settings (bf16 compute on fp32 weights, chat-templated DAPO prompts, rollout-step
    warm-up, ReSPO token-mean) on a tiny Qwen3 with the real tokenizer's vocabulary, M = 1, G = 2, N = 2."""
    data = _equal_length_dapo_subset(tmp_path / "dapo_math_17k.parquet")
    out_dir = tmp_path / "run"
    main([
        "--config", CONFIG_1P7B, "model.preset=tiny", f"task.data_dir={data}", f"task.tokenizer_dir={QWEN3}",
        "rollout.prompts_per_minibatch=1", "rollout.group_size=2", "rollout.reuse=2",
        "rollout.max_new_tokens=8", "rollout.kv_cache_bytes=0",  # the default pool: 32 GiB is an accelerator's
        "run.policy_updates=4", "optim.warmup_ratio=0.5", f"run.out_dir={out_dir}", "run.progress=false",
    ])
    saved = json.loads((out_dir / "config.json").read_text())
    assert saved["model"]["dtype"] == "bfloat16" and saved["optim"]["learning_rate"] == 1e-6
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["policy_updates"] for r in rl] == [2, 4]
    # W = int(0.5 * 2) = 1 rollout batch of warm-up: the first batch runs at lr 0, the second at 1e-6.
    assert rl[0]["learning_rate"] == 0.0 and rl[1]["learning_rate"] == pytest.approx(1e-6)
    for record in rl:
        assert 0.0 < record["entropy"] <= np.log(151_669) + 1e-3  # full-distribution entropy, nats
        keys = ("approx_kl", "positive_low_w_share", "positive_low_w_mass_share",
                "positive_low_w_amplification", "positive_log_w_mean", "positive_length_mean",
                "sampler_trainer_logp_gap")
        for key in keys:
            assert np.isfinite(record[key]), key
    rollouts = load_rollout_files(out_dir)
    assert [int(r["iteration"]) for r in rollouts] == [1, 2]
    for record, rollout in zip(rl, rollouts):
        assert rollout["log_w"].shape == (4,) and int(rollout["policy_updates"]) == record["policy_updates"]
        np.testing.assert_array_equal(rollout["minibatch"], [0, 0, 1, 1])
        np.testing.assert_array_equal(rollout["group"], [0, 0, 1, 1])
        assert set(rollout["reward"].tolist()) <= {-1.0, 1.0}  # strict box, no overlong penalty for 1.7B
        assert record["score"] == pytest.approx(rollout["reward"].mean())
        assert record["response_length"] == pytest.approx(rollout["length"].mean())
        pooled = pooled_diagnostics(rollout["log_w"], rollout["advantage"], rollout["phi"], rollout["length"])
        for key, value in pooled.items():
            assert record[key] == pytest.approx(value, abs=1e-6), key
    # At lr 0 the first rollout batch's second update still sees pi_theta = pi_old: log W ~ 0, phi ~ 1.
    np.testing.assert_allclose(rollouts[0]["log_w"], 0.0, atol=2e-2)
    trajectory = weight_length_trajectory(rollouts)  # Tab. 6 rows, one per rollout batch
    assert [row["iteration"] for row in trajectory] == [1, 2]


def test_trainer_runs_drgrpo_in_verls_balanced_order():
    """One synthetic iteration with rollout.minibatch_order=balanced and objective dr_grpo: the mini-batches
    are verl's, Dr.GRPO's constant is the generation budget and its advantages are not std-scaled."""
    config = apply_overrides(load_config(DEFAULT_CONFIG), [
        "warmup.steps=0", "rollout.prompts_per_minibatch=2", "rollout.group_size=4", "rollout.reuse=2",
        "rollout.minibatch_order=balanced", "rollout.balance_ranks=2", "objective.name=dr_grpo",
        "run.eval_problems=0", "run.progress=false",
    ])
    trainer = RLTrainer(config)
    assert trainer.objective.loss_scale_factor == config.rollout.max_new_tokens
    records = trainer.batches.get_state()
    record = trainer.iteration()
    rollout = trainer.last_rollout
    trainer.batches.set_state(records)
    prompts = [trainer.encode(r) for r in next(trainer.batches) for _ in range(4)]
    sequence_lengths = np.array([len(p) for p in prompts]) + rollout["length"]
    expected = np.zeros(16, np.int32)
    for index, rows in enumerate(balanced_minibatches(sequence_lengths, 2, 2)):
        expected[rows] = index
    np.testing.assert_array_equal(rollout["minibatch"], expected)
    assert np.bincount(rollout["minibatch"]).tolist() == [8, 8]
    assert trainer.objective.scale_advantages is False
    rewards = rollout["reward"].reshape(4, 4)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(rollout["advantage"].reshape(4, 4), centred, atol=1e-6)
    assert record["policy_updates"] == 2 and np.isfinite(record["loss"])
