"""DAPO dynamic sampling (`rollout.filter_groups`): which groups are kept and how many prompt
batches are drawn (against scripted accuracies, no model), and a real run whose trained groups all have
an advantage spread, whose counts are logged, and which resumes bit for bit after losing its last
checkpoint (the state a SIGKILL between an iteration and its checkpoint leaves). The same run has
rollout correction on (`objective.rollout_correction`) and shows its metrics."""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest

from experiments.train import DEFAULT_CONFIG, load_config
from respo_jax.data.batches import PromptBatches
from respo_jax.eval.rollout_files import load_rollout_files
from respo_jax.training.checkpoint import list_steps, step_dir
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.loop import RLTrainer
from tiny_runs import copy_run, raw_state, read_records, train, without_timings

N, M, G = 2, 2, 3  # reuse, prompts per mini-batch, group size: 4 groups per rollout batch


class _Stub:
    """What `RLTrainer.sample_groups` reads of a trainer, with a scripted sampler: generation batch b
    gives group g the accuracies `script[b][g]` (a string of G '1'/'0')."""

    def __init__(self, script, *overrides):
        self.config = apply_overrides(load_config(DEFAULT_CONFIG), [
            f"rollout.reuse={N}", f"rollout.prompts_per_minibatch={M}", f"rollout.group_size={G}",
            "rollout.filter_groups=true", "rollout.max_new_tokens=8", *overrides])
        records = [{"problem": f"p{i}", "answer": str(i)} for i in range(40)]
        self.batches = PromptBatches(records, batch_size=N * M, seed=0)
        self.state = types.SimpleNamespace(iteration=5)
        self.script, self.seeds, self.problems = list(script), [], []

    def rollout(self, records, seed, params=None, counts=None):
        self.seeds.append(seed)
        self.problems.append([r["problem"] for r in records])
        accuracy = np.array([[c == "1" for c in group] for group in self.script.pop(0)]).reshape(-1)
        rows = accuracy.size
        lengths = np.full(rows, 8, np.int32)  # at the limit: the overlong penalty's full -factor
        scores = np.where(accuracy, 1.0, -1.0).astype(np.float32)
        if self.config.task.overlong_buffer_length:
            scores -= self.config.task.overlong_penalty_factor
        out = types.SimpleNamespace(tokens=np.arange(rows * 8).reshape(rows, 8), lengths=lengths,
                                    logprobs=np.zeros((rows, 8), np.float32), prompt_routing=None,
                                    routing=None,
                                    entropy=np.arange(rows * 8, dtype=np.float32).reshape(rows, 8) + 0.5)
        prompts = [[len(self.seeds), i] for i in range(rows)]  # (generation batch, row)
        return prompts, out, scores

    rollout_seed = RLTrainer.rollout_seed
    sample = RLTrainer.sample_groups


def test_uniform_groups_are_dropped_and_more_batches_drawn_until_the_rollout_batch_is_full():
    stub = _Stub([["111", "010", "000", "001"], ["000", "100", "111", "110"]])
    got = stub.sample()
    assert (got.groups_generated, got.groups_kept, got.generation_batches) == (8, 4, 2)
    # batch 1 keeps groups 1 and 3, batch 2 groups 1 and 3 (in order); the rows of each group together
    assert [p[:1] + [p[1] // G] for p in got.prompts[::G]] == [[1, 1], [1, 3], [2, 1], [2, 3]]
    np.testing.assert_array_equal(got.tokens[:G, 0], np.arange(G, 2 * G) * 8)
    np.testing.assert_array_equal(got.sampler_entropy, got.tokens + 0.5)  # the kept rows' entropies
    assert got.scores.reshape(4, G).std(axis=1).min() > 0
    assert got.all_scores.shape == (8 * G,)
    # the next prompt batches of the stream, each with its own seed; the first keeps the run's old seed
    assert stub.batches.step == 2
    assert stub.problems == [[r["problem"] for r in stub.batches.batch_at(i)] for i in range(2)]
    assert stub.seeds[0] == 5 and len(set(stub.seeds)) == 2  # run.seed * 1_000_003 + iteration
    assert _Stub([]).rollout_seed(1) == stub.seeds[1]  # a pure function of (seed, iteration, batch)


def test_extra_groups_are_dropped_and_the_limit_stops_with_what_was_kept():
    stub = _Stub([["010", "000", "000", "000"], ["011", "101", "110", "010"]])
    got = stub.sample()  # needs 3 more after batch 1; batch 2 has 4: the last one is dropped
    assert (got.groups_generated, got.groups_kept, got.generation_batches) == (8, 4, 2)
    assert [p[:1] + [p[1] // G] for p in got.prompts[::G]] == [[1, 0], [2, 0], [2, 1], [2, 2]]
    stub = _Stub([["111", "010", "000", "000"], ["000"] * 4, ["111"] * 4], "rollout.max_generation_batches=3")
    got = stub.sample()
    assert (got.groups_generated, got.groups_kept, got.generation_batches) == (12, 1, 3)
    assert got.scores.shape == (G,) and got.tokens.shape == (G, 8) and len(got.prompts) == G


def test_the_filter_uses_the_accuracy_before_the_overlong_penalty():
    """With factor 2 a correct response at the length limit scores -1, as an incorrect one without the
    penalty would: the group's scores are all equal, its accuracy is not, and it is kept."""
    stub = _Stub([["100", "000", "000", "000"]], "rollout.max_generation_batches=1",
                 "task.overlong_buffer_length=4", "task.overlong_penalty_factor=2.0")
    got = stub.sample()
    assert got.groups_kept == 1 and np.ptp(got.scores) == 2.0  # -1 (correct) vs -3 (wrong)
    unpenalised = _Stub([["000", "111", "000", "000"]], "rollout.max_generation_batches=1",
                        "task.overlong_buffer_length=4", "task.overlong_penalty_factor=2.0")
    assert unpenalised.sample().groups_kept == 0


# A real run: the tiny model of tests/tiny_runs.py, warmed up far enough that some groups are mixed; at
# most 3 generation batches, so some rollout batches are full, some short and some empty (seed 0). Rollout
# correction is on too (the options compose; tests/test_rollout_correction.py reads the same run): top-k
# 16 makes the sampler's distribution the renormalized kept set, and token-level mask mode with the
# lower bound 0.99 masks the tokens whose kept mass is below it.
FILTER_RUN = ("rollout.filter_groups=true", "rollout.max_generation_batches=3", "warmup.steps=40",
              "warmup.batch_size=16", "warmup.learning_rate=0.01", "run.iterations=4",
              "run.checkpoint_every=2", "run.resume=true", "rollout.top_k=16",
              'objective.rollout_correction={"level": "token", "mode": "mask", "threshold": 2.0, '
              '"threshold_lower": 0.99}')


@pytest.fixture(scope="session")
def filtered_run(tmp_path_factory, jit_cache):
    """The uninterrupted FILTER_RUN (tests work on copies)."""
    out = tmp_path_factory.mktemp("filtered") / "run"
    result = train(jit_cache, out, *FILTER_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_filtered_run_trains_only_on_informative_groups_and_logs_the_counts(filtered_run):
    out = filtered_run
    rl = [r for r in read_records(out) if r["phase"] == "rl"]
    group, per_minibatch, groups = 2, 2, 4  # tests/tiny_runs.py's TINY_RUN: G=2, M=2, N·M=4
    kept = [r["groups_kept"] for r in rl]
    assert len(rl) == 4 and max(kept) == groups and 0 in kept and set(kept) - {0, groups}, kept  # all cases
    updates = 0
    files = {int(f["iteration"]): f for f in load_rollout_files(out)}
    for r in rl:
        assert r["groups_generated"] == groups * r["generation_batches"]
        assert r["generation_batches"] == 3 or r["groups_kept"] == groups
        assert r["updates"] == -(-r["groups_kept"] // per_minibatch)
        updates += r["updates"]
        assert r["policy_updates"] == updates
        if r["groups_kept"] == 0:
            assert r["iteration"] not in files and "loss" not in r  # nothing trained, and it says so
            continue
        rollout = files[r["iteration"]]
        assert rollout["advantage"].shape == (r["groups_kept"] * group,)
        spread = rollout["advantage"].reshape(-1, group)
        assert np.all(spread.max(axis=1) - spread.min(axis=1) > 0)  # every trained group has a signal
        assert np.all(rollout["minibatch"] < r["updates"]) and np.isfinite(r["loss"]) and r["grad_norm"] > 0


@pytest.mark.slow
def test_a_filtered_run_resumes_bit_identical_after_losing_its_last_checkpoint(filtered_run, tmp_path,
                                                                              jit_cache):
    """Killed after iteration 4 was logged, before its checkpoint was saved: the resumed run redraws
    iterations 3 and 4 (their generation batches and seeds) exactly."""
    out = filtered_run
    copy = copy_run(out, tmp_path / "resumed")
    shutil.rmtree(step_dir(str(copy / "checkpoints"), 4))
    assert list_steps(copy / "checkpoints") == [2]
    result = train(jit_cache, copy, *FILTER_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert without_timings(read_records(copy)) == without_timings(read_records(out))
    got, got_meta = raw_state(copy / "checkpoints", 4)
    want, want_meta = raw_state(out / "checkpoints", 4)
    assert got_meta == want_meta and got.keys() == want.keys()
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key
    names = sorted(p.name for p in (out / "rollouts").iterdir())
    assert sorted(p.name for p in (copy / "rollouts").iterdir()) == names
    for path in (out / "rollouts").iterdir():
        assert (copy / "rollouts" / path.name).read_bytes() == path.read_bytes()


@pytest.mark.slow
def test_a_run_with_rollout_correction_under_top_k_trains_and_logs_the_ratio(filtered_run):
    """Under top-k the sampler's log-prob is that of the renormalized kept set, so π_old / π_sampler is the
    kept probability mass, <= 1 on every token: truncation never binds, and token-level mask mode with
    the lower bound 0.99 masks the tokens whose kept mass is below it. The run trains and logs the ratio's
    statistics on every iteration it trains (tests/test_rollout_correction.py checks the formulas)."""
    rl = [r for r in read_records(filtered_run) if r["phase"] == "rl" and r["updates"]]
    assert len(rl) >= 2
    for record in rl:
        assert np.isfinite(record["loss"]) and record["grad_norm"] > 0
        assert record["rollout_is_max"] <= 1.0 + 1e-5 and record["rollout_is_mean"] < 1.0
        assert record["rollout_is_fraction_high"] == 0.0
        assert 0.0 < record["rollout_is_fraction_low"] < 1.0
        assert record["rollout_is_corrected_fraction"] == record["rollout_is_fraction_low"]
    config = json.loads((filtered_run / "config.json").read_text())
    assert config["objective"]["rollout_correction"]["threshold_lower"] == 0.99


@pytest.mark.parametrize("override, message", [
    ("rollout.max_generation_batches=0", "rollout.max_generation_batches=0: expected an integer >= 1"),
    ("rollout.routing_replay=true", "rollout.filter_groups=True: expected false with rollout.routing_replay"),
])
def test_bad_dynamic_sampling_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(load_config(DEFAULT_CONFIG), ["rollout.filter_groups=true", override])
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)
