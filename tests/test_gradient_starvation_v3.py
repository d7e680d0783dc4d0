"""The third gradient-starvation study's machinery: the mixed-length scratchpad task, the paired cluster
bootstrap over problems x seeds, the tail-cut arm against its float64 formula, and the pilot config with
its pre-registered acceptance rule.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest

from experiments import gradient_starvation as gs
from respo_jax.data.synthetic import get_task, operand_count, scratchpad_steps
from respo_jax.eval.statistics import paired_cluster_bootstrap
from respo_jax.training.config import apply_overrides

CONFIG_V3 = os.path.join(os.path.dirname(gs.DEFAULT_CONFIG), "gradient_starvation_v3.py")


def test_mixed_scratchpad_draws_every_count_from_2_to_16_and_its_responses_fit_193_tokens():
    task = get_task("scratchpad_mixed")
    records = task.make_records(800, seed=0, split="train")
    counts = [operand_count(r["problem"]) for r in records]
    assert set(counts) == set(range(2, 17))
    for record, count in zip(records[:50], counts):
        assert len(scratchpad_steps(record["problem"])) == count - 1
    # one character per token: the longest drawn correct responses (~160) and the task's bound, which
    # the trainer checks max_new_tokens against, fit the pilot's max_new_tokens with EOS
    longest = max(len(task.reference_solution(r)) for r in records)
    assert 130 <= longest < 170 and longest <= task.max_response_tokens() == 193 - 1
    assert operand_count("   3+4-5=") == 3 and operand_count("7+0=") == 2


def _reference(a, b, num_resamples, seed, level):
    """A float64 transcription with the documented draws: the seeds' indices, then the problems'."""
    d = a.mean(axis=2) - b.mean(axis=2)
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, d.shape[0], size=(num_resamples, d.shape[0]))
    problems = rng.integers(0, d.shape[1], size=(num_resamples, d.shape[1]))
    reps = np.array([d[seeds[r]][:, problems[r]].mean() for r in range(num_resamples)])
    return d.mean(), reps.std(ddof=1), *np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])


def test_paired_cluster_bootstrap_matches_its_float64_transcription():
    rng = np.random.default_rng(0)
    a = (rng.random((3, 40, 4)) < 0.4).astype(float)
    b = (rng.random((3, 40, 4)) < 0.3).astype(float)
    out = paired_cluster_bootstrap(a, b, num_resamples=400, seed=7, level=0.9)
    np.testing.assert_allclose(tuple(out), _reference(a, b, 400, 7, 0.9), rtol=1e-12, atol=1e-15)
    assert out.low < out.difference < out.high
    # [seeds, problems] is the samples-averaged form
    assert paired_cluster_bootstrap(a.mean(axis=2), b.mean(axis=2), 400, 7, 0.9) == out


def test_paired_bootstrap_cancels_shared_effects_and_has_the_closed_form_spread():
    """d = u_s + v_i gives D^(b) = mean(u[S]) + mean(v[I]): variance var(u)/seeds + var(v)/problems
    (population variances). A problem or seed effect common to both methods leaves everything unchanged."""
    rng = np.random.default_rng(1)
    u, v = rng.normal(size=5), rng.normal(size=200)
    d = u[:, None] + v[None, :]
    base = rng.normal(size=(5, 200))
    out = paired_cluster_bootstrap(base + d, base, num_resamples=20_000, seed=3)
    assert out.difference == pytest.approx(u.mean() + v.mean(), abs=1e-12)
    assert out.se == pytest.approx(np.sqrt(u.var() / 5 + v.var() / 200), rel=0.03)
    shared = rng.normal(size=(1, 200)) * 10 + rng.normal(size=(5, 1)) * 10
    moved = paired_cluster_bootstrap(base + d + shared, base + shared, num_resamples=20_000, seed=3)
    np.testing.assert_allclose(tuple(moved), tuple(out), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="one shape"):
        paired_cluster_bootstrap(base, base[:, :10])


def _config_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gradient_starvation_v3_config", CONFIG_V3)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_arms_are_the_stated_kernels():
    """respo_vespo and its tail-cut twin (registered by the config file) against float64 formulas: the
    twin uses VESPO's phi+ only on A > 0 with log W < -1."""
    gs.load_sweep_config(CONFIG_V3)
    from respo_jax.objectives import OBJECTIVES, get_objective

    module = _config_module()
    log_w = np.linspace(-4.0, 2.0, 25)
    w = np.exp(log_w)
    respo_pos = (1 + w) / 2 * np.exp(1 - w)
    vespo_pos, vespo_neg = w**2 * np.exp(3 * (1 - w)), w**3 * np.exp(2 * (1 - w))
    expected = {"respo_vespo": (respo_pos, vespo_neg),
                "respo_vespo_tailcut": (np.where(log_w < -1, vespo_pos, respo_pos), vespo_neg)}
    adv = np.repeat(np.float32([1.0, -1.0]), w.size)
    for name, (pos, neg) in expected.items():
        assert OBJECTIVES[name].aggregation == "token-mean"
        phi = np.asarray(module.ARMS[name](np.tile(log_w, 2).astype(np.float32), adv), np.float64)
        np.testing.assert_allclose(phi, np.concatenate([pos, neg]), rtol=2e-4, atol=1e-6)
    # the registered objective evaluates that kernel (one evaluation: the twin, both branches)
    mask = np.ones((2 * w.size, 3), np.float32)
    old = np.full(mask.shape, -2.0, np.float32)
    logp = old + np.tile(log_w / 3, 2)[:, None].astype(np.float32)
    phi = get_objective("respo_vespo_tailcut").evaluate(logp, old, adv, mask).responses["phi"]
    np.testing.assert_allclose(np.asarray(phi, np.float64), np.concatenate(expected["respo_vespo_tailcut"]),
                               rtol=2e-4, atol=1e-6)


def test_pilot_config_validates_and_states_its_acceptance_rule():
    config = gs.load_sweep_config(CONFIG_V3)
    assert config.task.difficulty == "scratchpad_mixed" and config.rollout.max_new_tokens == 193
    assert config.sweep.objectives == "grpo" and max(config.sweep.reuse_list) >= 128
    assert not os.path.isabs(config.sweep.runs_dir)
    gs.load_sweep_config(CONFIG_V3, quick=True)
    module = _config_module()
    assert module.pilot_accepted(0.009, 0.15) and not module.pilot_accepted(0.01, 0.5)
    assert not module.pilot_accepted(0.0, 0.149) and not module.pilot_accepted(None, 0.5)
    assert "PRE-REGISTERED ACCEPTANCE RULE" in module.__doc__


def test_pilot_settings_rebuild_the_committed_bases_and_differ_only_in_the_warm_up():
    """Settings 1-3 rebuild the base models committed for them (their base.json's fingerprints, made
    before the warm-up had an operand range); the current setting changes the warm-up (its operand range:
    2-11 of the task's 2-16), N, the step size and the directories, nothing else. Every setting has its own decision
    directory; settings that share a runs directory share its base model (the same fingerprint) and none
    of its cells (no cell name in common)."""
    module = _config_module()
    first, current = module.pilot_setting(1), gs.load_sweep_config(CONFIG_V3)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for setting in map(module.pilot_setting, (1, 2, 3)):
        with open(os.path.join(root, setting.base_dir, gs.BASE_INFO)) as fh:
            assert json.load(fh)["config"] == gs.base_fingerprint(setting)
    assert (first.warmup.steps, current.warmup.steps) == (2000, 2000)
    assert first.warmup.operand_range(get_task("scratchpad_mixed")) == (2, 16)
    assert current.warmup.operand_range(get_task(current.task.difficulty)) == (2, 11)
    assert gs.base_fingerprint(current)["warmup"]["max_operands"] == 11
    settings = [module.pilot_setting(k) for k in module.PILOT_SETTINGS]
    for k, setting in zip(module.PILOT_SETTINGS, settings):  # each setting's overrides are complete
        assert apply_overrides(current, list(module.PILOT_SETTINGS[k])) == setting
    assert len({s.sweep.out_dir for s in settings}) == len(settings)
    for a, b in itertools.combinations(settings, 2):
        if a.sweep.runs_dir == b.sweep.runs_dir:
            assert gs.base_fingerprint(a) == gs.base_fingerprint(b)
            assert not {c.name for c in a.cells()} & {c.name for c in b.cells()}
    same = dataclasses.replace(current, warmup=first.warmup, sweep=first.sweep, optim=first.optim)
    assert same == first


def test_the_warm_up_stream_draws_only_from_its_operand_range_and_its_default_is_the_task_stream():
    """`warmup.max_operands=11` on the 2-16-operand task: every warm-up problem is a training-split record
    of the task's warm-up stream (rebuilt from its id) with 2-11 operands, each count about equally often
    (the task draws the count uniformly); the default range is the task's and leaves the stream as it was
    (the same records as without a range)."""
    from respo_jax.training.config import WarmupConfig
    from respo_jax.training.warmup import warmup_records

    task = get_task("scratchpad_mixed")
    ranged = WarmupConfig(max_operands=11).operand_range(task)
    records = warmup_records(task, 0, np.random.default_rng(1), 2200, ranged)
    counts = np.array([operand_count(r["problem"]) for r in records])
    assert ranged == (2, 11) and len(records) == 2200 and counts.min() == 2 and counts.max() == 11
    # uniform over the 10 counts: 220 each, binomial sd ~14
    assert np.all(np.abs(np.bincount(counts, minlength=12)[2:] - 220) < 70)
    for record in records[:200]:
        seed, index = map(int, record["id"].split("-"))
        assert seed == 1_000_003 and task.record(seed, index) == record
        assert task.split_of(record["problem"]) == "train"
    assert WarmupConfig(min_operands=5, max_operands=5).operand_range(task) == (5, 5)
    fixed = get_task("scratchpad", min_operands=0)  # every problem has 6 operands
    assert WarmupConfig().operand_range(fixed) == (6, 6)

    default = WarmupConfig().operand_range(task)
    assert default == (2, 16)
    full = warmup_records(task, 0, np.random.default_rng(1), 300, default)
    assert full == warmup_records(task, 0, np.random.default_rng(1), 300)
    assert max(operand_count(r["problem"]) for r in full) == 16


@pytest.mark.parametrize("override, field, message", [
    ("warmup.max_operands=1", "warmup.max_operands", "an integer >= 2"),
    ("warmup.max_operands=17", "warmup.max_operands", "inside the task's 2-16 operands"),
    ("warmup.min_operands=12", "warmup.max_operands", "got 12-11"),
])
def test_a_warm_up_operand_range_outside_the_task_is_one_line_naming_it(override, field, message):
    from respo_jax.training.config import ConfigError

    with pytest.raises(ConfigError) as err:
        apply_overrides(gs.load_sweep_config(CONFIG_V3), [override])
    assert str(err.value).startswith(f"{field}=") and message in str(err.value) and "\n" not in str(err.value)


def test_long_positive_tail_share_counts_positives_to_long_problems_below_the_cut():
    """Two rollout batches of a hand-built run on the mixed task: only positives whose problem (rebuilt
    from the config) has 12-16 operands count, and the E.3 window (first half) keeps batch 1 only."""
    from respo_jax.eval.report.loading import Run
    from respo_jax.training.config import ExperimentConfig, RolloutConfig, RunConfig, TaskConfig

    from experiments.starvation_problems import long_positive_tail_share, rollout_problems

    task = TaskConfig(name="synthetic", difficulty="scratchpad_mixed", num_records=400)
    config = ExperimentConfig(task=task,
                              rollout=RolloutConfig(prompts_per_minibatch=8, group_size=2, reuse=1,
                                                    max_new_tokens=193),
                              run=RunConfig(eval_problems=0))
    problems = rollout_problems(config, 2)
    assert [len(batch) for batch in problems] == [8, 8] and problems[0] != problems[1]
    counts = np.array([operand_count(rec["problem"]) for rec in problems[0]])
    rng = np.random.default_rng(0)
    rollouts = []
    for iteration in (1, 2):
        group = np.repeat(np.arange(8), 2)
        rollouts.append({"iteration": np.int64(iteration), "group": group,
                         "advantage": np.tile([1.0, -1.0], 8),
                         "log_w": rng.uniform(-2.0, 0.5, size=16)})
    first = rollouts[0]
    long_pos = (first["advantage"] > 0) & (counts[first["group"]] >= 12)
    expected = long_pos & (first["log_w"] < -1)
    records = [{"phase": "rl", "iteration": 2, "policy_updates": 2}]
    run = Run("x", "x", config.to_dict(), records, rollouts, None)
    share, total = long_positive_tail_share(run)
    assert total == long_pos.sum() > 0 and 0 < expected.sum() < total
    assert share == (expected.sum() / total if total else None)
    both = long_positive_tail_share(run, batches=2)[1]
    second = rollouts[1]
    counts2 = np.array([operand_count(rec["problem"]) for rec in problems[1]])
    assert both == total + ((second["advantage"] > 0) & (counts2[second["group"]] >= 12)).sum()


@pytest.mark.slow
def test_pilot_smoke_run_trains_the_tailcut_arm_and_reports_paired_endpoints(tmp_path, monkeypatch):
    """The quick config end to end (GRPO and the tail-cut arm, a few updates from a 4-step warm-up, not a
    result): the cell's config stores its paths relative to the working directory, both arms sample the
    same problems, its eval records carry the per-problem outcomes, the rollout file's phi is the tail-cut
    kernel of its (log W, A); --report-only rewrites the same report, whose paired held-out endpoint is
    the difference on the long problems; --pilot-report applies the rule to GRPO's cell."""
    import json

    from respo_jax.eval import load_rollout_files
    from respo_jax.eval.report import load_run
    from respo_jax.training import warmup

    from respo_jax.training.config import ExperimentConfig, config_from_dict
    from respo_jax.training.loop import RLTrainer

    from experiments.starvation_problems import long_positive_tail_share, rollout_problems

    used = []  # the records of each rollout batch, as the trainer sampled them
    rollout = RLTrainer.rollout

    def logged(self, records, *args, **kwargs):
        used.append([dict(record) for record in records])
        return rollout(self, records, *args, **kwargs)

    monkeypatch.setattr(RLTrainer, "rollout", logged)
    drawn = []  # the operand counts of the warm-up's problems (the quick config: at most 11)
    records_of = warmup.warmup_records

    def counted(*args, **kwargs):
        records = records_of(*args, **kwargs)
        drawn.extend(operand_count(r["problem"]) for r in records)
        return records

    monkeypatch.setattr(warmup, "warmup_records", counted)
    monkeypatch.chdir(tmp_path)
    args = ["--config", CONFIG_V3, "--quick", "sweep.runs_dir=runs/v3", "sweep.out_dir=runs/v3/results"]
    summary = gs.main(args)
    names = ("grpo_n2_seed0", "respo_vespo_tailcut_n2_seed0")
    cells = {name: tmp_path / "runs/v3/cells" / name for name in names}
    cell = cells["respo_vespo_tailcut_n2_seed0"]
    saved = json.loads((cell / "config.json").read_text())
    assert len(drawn) == 4 * 8 and max(drawn) <= saved["warmup"]["max_operands"] == 11
    assert saved["model"]["checkpoint_dir"] == os.path.join("runs", "v3", "base")
    # the problems rebuilt from the cell's config are those the trainer sampled, the same for both arms
    assert len(used) == 2 and used[0] == used[1]
    assert rollout_problems(config_from_dict(ExperimentConfig, saved, validate=False), 1) == used[:1]
    evals = {name: [r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
                    if r.get("phase") == "eval"] for name, path in cells.items()}
    for record in evals["respo_vespo_tailcut_n2_seed0"]:
        lists = ("greedy_correct", "sampled_correct", "problem_ids")
        assert [len(record[key]) for key in lists] == [8, 8, 8]
        assert np.mean(record["greedy_correct"]) == record["greedy_accuracy"]
        assert np.sum(record["sampled_correct"]) / 16 == pytest.approx(record["sampled_pass_at_1"])
    rollout = load_rollout_files(cell)[0]
    log_w, adv = rollout["log_w"].astype(np.float64), rollout["advantage"].astype(np.float64)
    w = np.exp(log_w)
    respo_pos, vespo_pos = (1 + w) / 2 * np.exp(1 - w), w**2 * np.exp(3 * (1 - w))
    expected = np.where(adv < 0, w**3 * np.exp(2 * (1 - w)),
                        np.where((adv > 0) & (log_w < -1), vespo_pos, respo_pos))
    np.testing.assert_allclose(rollout["phi"], expected, rtol=2e-4, atol=1e-6)

    # the paired report: the tail-cut arm against GRPO, each endpoint; held-out on the long problems
    test = get_task("scratchpad_mixed").make_records(8, saved["task"]["seed"] + 7919, split="test")
    assert [str(r["id"]) for r in test] == evals["grpo_n2_seed0"][-1]["problem_ids"]
    long = np.array([12 <= operand_count(r["problem"]) <= 16 for r in test])
    rows = {r["endpoint"]: r for r in summary["paired"]}
    contrast = [("respo_vespo_tailcut", "grpo", 2)] * 3
    assert [(r["a"], r["b"], r["reuse"]) for r in summary["paired"]] == contrast
    held = rows["heldout_long_pass_at_1"]
    final = {name: np.asarray(e[-1]["sampled_correct"], np.float64)[long] / 2 for name, e in evals.items()}
    assert held["units"] == long.sum() > 0
    assert held["difference"] == pytest.approx(np.mean(final["respo_vespo_tailcut_n2_seed0"]
                                                       - final["grpo_n2_seed0"]), abs=1e-12)
    results = tmp_path / "runs/v3/results"
    written = {name: (results / name).read_bytes() for name in (gs.SUMMARY_JSON, gs.SUMMARY_MD)}
    assert b"### Held-out sampled pass@1, 12-16 operands" in written[gs.SUMMARY_MD]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    gs.main(args + ["--report-only"])
    assert all((results / name).read_bytes() == text for name, text in written.items())

    # the pilot's decision: the rule on GRPO's cell, and the base model's accuracy by length
    decision = gs.main(args + ["--pilot-report"])
    grpo = decision["cells"]["grpo_n2_seed0"]
    metrics = (cells["grpo_n2_seed0"] / "metrics.jsonl").read_text().splitlines()
    clip = [r["clip_fraction"] for r in map(json.loads, metrics) if r.get("phase") == "rl"]
    assert grpo["clip_fraction"] == pytest.approx(np.mean(clip))
    share, count = long_positive_tail_share(load_run(cells["grpo_n2_seed0"]))
    assert (grpo["long_positive_tail_share"], grpo["long_positives"]) == (share, count)
    assert grpo["accepted"] == _config_module().pilot_accepted(grpo["clip_fraction"], share)
    assert decision["decision"] == ("accepted: grpo_n2_seed0" if grpo["accepted"] else "not accepted")
    base = json.loads((tmp_path / "runs/v3/base" / gs.BASE_INFO).read_text())["held_out"]
    by_length = decision["base_model"]["held_out"]
    assert by_length["long"]["problems"] == long.sum() and by_length["short"]["problems"] == 8 - long.sum()
    long_greedy = np.mean(np.asarray(base["greedy_correct"])[long])
    assert by_length["long"]["greedy_accuracy"] == pytest.approx(long_greedy)
    assert json.loads((results / gs.PILOT_JSON).read_text()) == decision
    assert (results / gs.PILOT_MD).read_text().startswith("# Third study: pilot decision")
    assert "warm-up 4 steps (at most 11 operands)," in (results / gs.PILOT_MD).read_text()


def _paired_runs():
    """Hand-built runs of two arms x two seeds on the mixed task (random rewards and held-out samples),
    their summary cell records, and the config they share."""
    from respo_jax.eval.report.loading import Run
    from respo_jax.training.config import ExperimentConfig, RolloutConfig, RunConfig, TaskConfig

    task = TaskConfig(name="synthetic", difficulty="scratchpad_mixed", num_records=400)
    rng = np.random.default_rng(3)
    runs, cells = {}, []
    for objective in ("vespo", "respo_vespo"):
        for seed in (0, 1):
            rollout = RolloutConfig(prompts_per_minibatch=12, group_size=4, reuse=1, max_new_tokens=193)
            config = ExperimentConfig(task=task, rollout=rollout,
                                      run=RunConfig(eval_problems=24, eval_samples=3, seed=seed)).to_dict()
            rollouts = [{"iteration": np.int64(k), "policy_updates": np.int64(k),
                         "group": np.repeat(np.arange(12), 4), "reward": rng.choice([-1.0, 1.0], size=48),
                         "advantage": np.zeros(48), "log_w": np.zeros(48)} for k in (1, 2, 3)]
            records = [{"phase": "rl", "iteration": 8, "policy_updates": 8},
                       {"phase": "eval", "sampled_samples": 3,
                        "sampled_correct": rng.integers(0, 4, size=24).tolist(),
                        "greedy_correct": [0] * 24}]
            name = f"{objective}_n1_seed{seed}"
            runs[name] = Run(name, name, config, records, rollouts, None)
            cells.append({"objective": objective, "reuse": 1, "seed": seed, "name": name,
                          "late_mean": float(rng.uniform())})
    return runs, cells, config


def test_paired_endpoints_are_the_bootstrap_of_the_long_problem_scores(monkeypatch):
    """The three endpoints of respo_vespo - vespo, each against a float64 transcription: the long groups'
    correct share over the first quarter's batches (updates <= 2 of 8), the long held-out problems'
    sampled outcomes, the late means; each passed to the paired cluster bootstrap over seeds x problems."""
    from respo_jax.training.config import ExperimentConfig, config_from_dict
    from respo_jax.training.tasks import load_task

    from experiments.starvation_problems import rollout_problems
    from experiments import starvation_v3
    from experiments.starvation_v3 import BOOTSTRAP_SEED, paired_endpoints

    monkeypatch.setattr(starvation_v3, "BOOTSTRAP_RESAMPLES", 500)  # the report's 10,000: the same code
    runs, cells, config = _paired_runs()
    experiment = config_from_dict(ExperimentConfig, config, validate=False)
    batches = rollout_problems(experiment, 2)
    held_long = np.array([12 <= operand_count(r["problem"]) <= 16 for r in load_task(experiment).held_out])
    assert 0 < held_long.sum() < 24

    def quarter(run):
        return np.array([np.mean(run.rollouts[k]["reward"][run.rollouts[k]["group"] == g] > 0)
                         for k in (0, 1) for g in range(12)
                         if 12 <= operand_count(batches[k][g]["problem"]) <= 16])

    def held(run):
        correct = np.asarray(run.records[1]["sampled_correct"])[held_long]
        return np.array([[1.0 if j < c else 0.0 for j in range(3)] for c in correct])

    late = {c["name"]: c["late_mean"] for c in cells}
    expected = {"long_first_quarter": quarter, "heldout_long_pass_at_1": held,
                "late_mean": lambda run: np.array([late[run.path]])}
    rows = paired_endpoints(cells, runs)
    assert [(r["a"], r["b"], r["endpoint"]) for r in rows] == [
        ("respo_vespo", "vespo", e) for e in ("long_first_quarter", "heldout_long_pass_at_1", "late_mean")]
    for row in rows:
        a = np.stack([expected[row["endpoint"]](runs[f"respo_vespo_n1_seed{s}"]) for s in (0, 1)])
        b = np.stack([expected[row["endpoint"]](runs[f"vespo_n1_seed{s}"]) for s in (0, 1)])
        assert row["seeds"] == [0, 1] and row["units"] == a.shape[1] > 0
        reference = paired_cluster_bootstrap(a, b, num_resamples=500, seed=BOOTSTRAP_SEED)
        assert row["difference"] == pytest.approx(a.mean() - b.mean(), abs=1e-12)
        assert (row["difference"], row["se"], row["low"], row["high"]) == pytest.approx(tuple(reference))
        assert (row["mean_a"], row["mean_b"]) == pytest.approx((a.mean(), b.mean()))
