"""Tests of the gradient-starvation study: the scratchpad task with its held-out split, the
sweep config, and `python -m experiments.gradient_starvation` end to end on a tiny setting (it runs,
writes well-formed outputs, skips finished cells and refuses stale ones — not which method wins).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import sympy

from experiments import gradient_starvation as gs
from experiments.starvation_summary import long_acceptance
from respo_jax.data.synthetic import ArithmeticTask, CharTokenizer, get_task, scratchpad_steps
from respo_jax.rewards import strict_box_score
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.held_out import pass_at_1
from respo_jax.training.sweep import select_learning_rate
from tiny_runs import TINY_MODEL

CONFIG = gs.DEFAULT_CONFIG


# ---------------------------------------------------------------------------------------------------
# The scratchpad task


def test_scratchpad_steps_are_the_left_to_right_partial_results():
    assert scratchpad_steps("12+34-5=") == ["12+34=46", "46-5=41"]
    assert scratchpad_steps("   3-9+2=") == ["3-9=-6", "-6+2=-4"]
    with pytest.raises(ValueError, match="expected a"):
        scratchpad_steps("3*4=")


def test_scratchpad_responses_are_long_correct_and_scored_by_the_box_only():
    task, tok = get_task("scratchpad"), CharTokenizer()
    records = task.make_records(400, seed=5, split="train")
    lengths = []
    for record in records:
        response = task.reference_solution(record)
        steps = response.split(" ")[:-1]
        # each step is a true equation (SymPy) and the chain ends at the answer
        for step in steps:
            left, right = step.split("=")
            assert sympy.sympify(left) == int(right)
        assert steps[-1].split("=")[1] == record["answer"] == str(sympy.sympify(record["problem"][:-1]))
        assert len(tok.encode(response)) <= task.max_response_tokens()
        assert strict_box_score(task.prompt_format.solution_text(response), record["answer"]) == 1.0
        lengths.append(len(response) + 1)
    # responses grow with the number of operands: 16 tokens for two operands, up to ~46 for six
    assert min(lengths) >= 14 and max(lengths) >= 40 and 25 <= sum(lengths) / len(lengths) <= 40
    # aligned problems: every prompt has one length
    assert len({len(r["problem"]) for r in records}) == 1


def test_train_and_test_splits_share_no_problem():
    task = get_task("scratchpad", num_operands=3)  # a small problem space: overlaps would show
    train = task.make_records(3000, seed=0, split="train")
    test = task.make_records(200, seed=7919, split="test")
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert all(task.split_of(r["problem"]) == "test" for r in test)
    with pytest.raises(ValueError, match="test_fraction > 0"):
        get_task("easy").make_records(5, seed=0, split="test")
    with pytest.raises(ValueError, match="fewer than 1 problems"):  # none of the 100 sums "a+b=" is a test one
        ArithmeticTask(test_fraction=0.002).make_records(1, seed=0, split="test")
    with pytest.raises(ValueError, match="scratchpad=True needs"):
        ArithmeticTask(scratchpad=True)
    with pytest.raises(TypeError, match="unknown ArithmeticTask fields"):
        get_task("scratchpad", num_operand=3)


# ---------------------------------------------------------------------------------------------------
# The sweep


def tiny(tmp_path, *extra: str) -> list[str]:
    """Overrides that make the sweep a short test: the one-layer model of tests/tiny_runs.py, ReSPO x
    N in {1, 2}, one seed, 4 updates."""
    return [
        TINY_MODEL, "sweep.objectives=respo", "sweep.reuse=1,2", "sweep.seeds=0", "sweep.policy_updates=4",
        "warmup.steps=2", "warmup.batch_size=8", "run.eval_problems=4", "rollout.prompts_per_minibatch=2",
        "rollout.group_size=2", "rollout.max_new_tokens=32", 'task.overrides={"num_operands": 3}',
        f"sweep.runs_dir={tmp_path / 'runs'}", f"sweep.out_dir={tmp_path / 'out'}",
        "sweep.compilation_cache=false",  # a process-wide JAX setting: not for a test worker's other tests
        *extra,
    ]


def test_sweep_config_is_validated_and_matched():
    config = gs.load_sweep_config(CONFIG)
    assert len(config.cells()) == 36 and config.sweep.policy_updates % 32 == 0
    experiments = [config.experiment(c) for c in config.cells()]
    # only the objective, N and the seed differ between cells
    for exp, cell in zip(experiments, config.cells()):
        assert (exp.objective.name, exp.rollout.reuse, exp.run.seed) == (cell.objective, cell.reuse, cell.seed)
        assert exp.run.policy_updates == config.sweep.policy_updates and exp.warmup.steps == 0
        assert exp.model.checkpoint_dir == os.path.abspath(config.base_dir)
        assert (exp.task, exp.optim, exp.rollout.prompts_per_minibatch) == (
            experiments[0].task, experiments[0].optim, experiments[0].rollout.prompts_per_minibatch)
    quick = gs.load_sweep_config(CONFIG, quick=True)
    assert quick.sweep.out_dir != config.sweep.out_dir  # --quick never overwrites the committed results
    for bad, match in (("sweep.policy_updates=100", "multiple of every N"),
                       ("sweep.objectives=grpo,nope", "distinct comma-separated names"),
                       ("sweep.reuse=1,x", "comma-separated integers"),
                       ("model.checkpoint_dir=/x", "base model")):
        with pytest.raises(ConfigError, match=match):
            apply_overrides(config, [bad])
    # a config file can put anything in a section
    with pytest.raises(ConfigError, match="^sweep='1,8': expected a SweepConfig"):
        dataclasses.replace(config, sweep="1,8").validate()


@pytest.mark.slow
def test_sweep_runs_resumes_and_refuses_stale_cells(tmp_path, monkeypatch, capsys):
    # a SIGTERM in the base model's warm-up (after step 1 of 2) saves a warm-up checkpoint and exits 143;
    # the rerun goes on from it to the base model an uninterrupted warm-up makes, bit for bit
    from respo_jax.training import preemption

    stop_agreed = preemption.stop_agreed  # a SIGTERM at the first step boundary (the only one with a clock)
    monkeypatch.setattr(preemption, "stop_agreed",
                        lambda clock=None: (15, False) if clock else stop_agreed(clock))
    assert gs.cli(tiny(tmp_path)) == 143
    assert "after base warm-up step 1 of 2" in capsys.readouterr().err
    assert (tmp_path / "runs" / "base.partial" / "checkpoints" / "warmup" / "1").is_dir()
    monkeypatch.undo()
    summary = gs.main(tiny(tmp_path))
    whole_config = apply_overrides(gs.load_sweep_config(CONFIG), tiny(tmp_path / "whole"))
    whole = gs.prepare_base(whole_config, show=False)
    resumed = json.loads((tmp_path / "runs" / "base" / gs.BASE_INFO).read_text())
    assert resumed["sha256"] == whole["sha256"] and resumed["sft_loss_last"] == whole["sft_loss_last"]
    base_files = [sorted(os.listdir(p / "runs" / "base")) for p in (tmp_path, tmp_path / "whole")]
    assert base_files[0] == base_files[1] and gs.WARMUP_PROGRESS not in base_files[0]
    out = tmp_path / "out"
    for name in (gs.SUMMARY_JSON, gs.SUMMARY_MD, gs.FIGURE):
        assert (out / name).stat().st_size > 0
    saved = json.loads((out / gs.SUMMARY_JSON).read_text())
    assert saved == json.loads(json.dumps(summary))
    assert [(g["objective"], g["reuse"]) for g in saved["groups"]] == [("respo", 1), ("respo", 2)]
    assert len(saved["cells"]) == 2 and saved["missing_cells"] == []
    n1, n2 = saved["cells"]
    assert (n1["curve"]["policy_updates"], n2["curve"]["policy_updates"]) == ([1, 2, 3, 4], [2, 4])
    # blocks of the largest N (2): N=1's pairs of logged points are averaged, N=2's points are kept
    assert n1["blocked_curve"]["policy_updates"] == n2["blocked_curve"]["policy_updates"] == [2, 4]
    raw = n1["curve"]["train_accuracy"]
    assert n1["blocked_curve"]["train_accuracy"] == pytest.approx([(raw[0] + raw[1]) / 2, (raw[2] + raw[3]) / 2],
                                                                  abs=1e-4)
    assert n2["blocked_curve"]["train_accuracy"] == pytest.approx(n2["curve"]["train_accuracy"], abs=1e-4)
    for cell in (n1, n2):  # late window: the last quarter [3, 4]; early window (<= 1) holds no block
        assert cell["late_window"] == [3.0, 4.0] and cell["late_mean"] is not None and cell["early_peak"] is None
    for cell in saved["cells"]:
        assert 0.0 <= cell["heldout_accuracy"] <= 1.0 and cell["tab5"] is None or "log W < -1" in cell["tab5"]
        assert cell["drift"]["log_w_q05"] <= cell["drift"]["log_w_median"] <= cell["drift"]["log_w_q95"]
        assert set(cell["tab7_low_w_length"]) == {"count", "length_mean", "branch_mean", "relative"}
    assert n1["drift"]["log_w_abs_gt1_share"] == 0.0 and abs(n1["drift"]["log_w_q05"]) < 1e-4  # on-policy: W = 1
    table = (out / gs.SUMMARY_MD).read_text()
    assert table.count("\n| ReSPO | 1 |") == 2 and table.count("\n| ReSPO | 2 |") == 2
    cells_dir = tmp_path / "runs" / "cells"
    assert sorted(os.listdir(cells_dir)) == ["respo_n1_seed0", "respo_n2_seed0"]
    assert not any((cells_dir / name / "checkpoints").exists() for name in os.listdir(cells_dir))

    # a rerun trains nothing (the base model and every cell are finished) and reports the same numbers
    def fail(*args, **kwargs):
        raise AssertionError("a finished cell or base model was recomputed")

    monkeypatch.setattr(gs, "run_cell", fail)
    monkeypatch.setattr("respo_jax.training.loop.RLTrainer.warmup", fail)
    again = gs.main(tiny(tmp_path))
    assert json.loads(json.dumps(again))["groups"] == saved["groups"]

    # an unfinished cell (killed mid-run) is rerun; a cell from another config is refused, not mixed in
    monkeypatch.undo()
    os.rename(cells_dir / "respo_n2_seed0", cells_dir / "respo_n2_seed0.partial")
    gs.main(tiny(tmp_path, "sweep.reuse=2"))
    assert (cells_dir / "respo_n2_seed0").is_dir() and not (cells_dir / "respo_n2_seed0.partial").exists()
    assert gs.cli(tiny(tmp_path, "optim.learning_rate=0.123")) == 2
    assert "different config" in capsys.readouterr().err
    assert gs.cli(tiny(tmp_path, "warmup.steps=3")) == 2  # another base model
    assert "base model made with a different config" in capsys.readouterr().err


def test_a_malformed_data_file_is_one_line_and_exit_status_1(tmp_path, capsys):
    """The sweep's command line reports a damaged data file as the trainer's does: one line naming the
    file, exit status 1, no traceback (it fails while the base model's trainer loads its task)."""
    junk = tmp_path / "dapo_math_17k.parquet"
    junk.write_bytes(b"PAR1 this is not a parquet file")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tokenizer = os.path.join(repo, "..", "shared", "tokenizers", "qwen3")
    status = gs.cli(tiny(tmp_path, "task.name=dapo_math", "task.overrides={}", "warmup.steps=0",
                         f"task.data_dir={junk}", f"task.tokenizer_dir={tokenizer}"))
    err = capsys.readouterr().err
    assert status == 1, err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert f"{junk}: not a readable parquet file" in line and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------
# The second study

CONFIG_V2 = os.path.join(os.path.dirname(gs.DEFAULT_CONFIG), "gradient_starvation_v2.py")


def test_pass_at_1_is_the_mean_over_problems_with_a_calibrated_standard_error():
    correct = np.array([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]], bool)
    estimate, se = pass_at_1(correct)
    per_problem = np.array([0.75, 0.0, 0.25])
    assert estimate == pytest.approx(per_problem.mean(), abs=1e-15)
    assert se == pytest.approx(np.sqrt(np.sum((per_problem - per_problem.mean()) ** 2) / 2 / 3), abs=1e-15)
    assert pass_at_1([[1, 0]]) == (0.5, 0.0)
    with pytest.raises(ValueError, match="problems, samples"):
        pass_at_1(np.zeros(4))
    # the standard error covers the population pass@1 (problems drawn from a population of difficulties,
    # 8 samples each) 95% of the time at +-1.96 SE
    rng = np.random.default_rng(0)
    difficulty = rng.beta(0.5, 1.5, size=100_000)
    hits = 0
    for _ in range(800):
        p = rng.choice(difficulty, size=128)
        estimate, se = pass_at_1(rng.random((128, 8)) < p[:, None])
        hits += abs(estimate - difficulty.mean()) <= 1.96 * se
    assert 0.92 <= hits / 800 <= 0.975


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_evaluate_held_out_scores_greedy_and_sampled_responses_per_problem():
    """On a random tiny model: at a vanishing top-p each sample is the greedy response (same scores, per
    problem); at T = 1, top-p 1 the samples differ from it; pass@1 is the table's `pass_at_1`."""
    from respo_jax.models import qwen3
    from respo_jax.training.held_out import evaluate_held_out

    model = qwen3.init_model(qwen3.Qwen3Config.preset("tiny"), seed=0)
    prompts = [[1, 3 + i % 5, 4 + i] for i in range(12)]  # (a random model's greedy repeats the last token)
    records = [{"index": i} for i in range(12)]
    seen = []

    def score(tokens, lengths, recs):  # any property of each response's tokens, +1 / -1
        assert len(recs) == tokens.shape[0] == lengths.shape[0]
        scores = np.where(tokens[:, 0] % 2 == 0, 1.0, -1.0)
        seen.append(scores)
        return scores

    kwargs = dict(max_new_tokens=6, eos_token_ids=(2,), samples=3)
    out = evaluate_held_out(model, prompts, records, score, top_p=1e-6, **kwargs)
    greedy, sampled = seen
    assert 0.0 < out["greedy_accuracy"] == np.mean(greedy > 0) < 1.0
    np.testing.assert_array_equal(sampled.reshape(12, 3), np.repeat(greedy[:, None], 3, axis=1))
    assert (out["sampled_pass_at_1"], out["sampled_pass_at_1_se"]) == pass_at_1(sampled.reshape(12, 3) > 0)
    seen.clear()
    out = evaluate_held_out(model, prompts, records, score, top_p=1.0, **kwargs)
    greedy, sampled = seen
    assert np.any(sampled.reshape(12, 3) != greedy[:, None])
    assert (out["sampled_pass_at_1"], out["sampled_pass_at_1_se"]) == pass_at_1(sampled.reshape(12, 3) > 0)
    assert out["sampled_top_p"] == 1.0 and out["sampled_samples"] == 3
    # per problem, in the records' order: greedy 0/1 and the count of correct samples
    assert out["greedy_correct"] == (greedy > 0).astype(int).tolist()
    assert out["sampled_correct"] == (sampled.reshape(12, 3) > 0).sum(axis=1).tolist()
    assert "problem_ids" not in out  # these records carry no id


def test_scratchpad_long_responses_are_around_a_hundred_tokens():
    task, tok = get_task("scratchpad_long"), CharTokenizer()
    records = task.make_records(300, seed=3, split="train")
    lengths = [len(tok.encode(task.reference_solution(r))) + 1 for r in records]
    assert min(lengths) >= 70 and max(lengths) <= task.max_response_tokens() + 1
    assert 100 <= np.mean(lengths) <= 125
    for record in records[:20]:
        response = task.reference_solution(record)
        assert response.split(" ")[-2].split("=")[1] == record["answer"] == str(
            sympy.sympify(record["problem"].strip()[:-1]))
    assert len({len(r["problem"]) for r in records}) == 1
    assert get_task("scratchpad").num_operands == 6  # the first study's task is unchanged


def test_the_controls_are_the_stated_kernels():
    """The config file registers the controls with `kernel_objective`; their phi against float64 formulas."""
    gs.load_sweep_config(CONFIG_V2)
    from respo_jax.objectives import OBJECTIVES, get_objective

    log_w = np.linspace(-4.0, 2.0, 25)
    w = np.exp(log_w)
    respo_pos, respo_neg = (1 + w) / 2 * np.exp(1 - w), np.sqrt(w) * np.exp(2 * (1 - np.sqrt(w)))
    vespo_pos, vespo_neg = w**2 * np.exp(3 * (1 - w)), w**3 * np.exp(2 * (1 - w))
    expected = {"reinforce": (np.ones_like(w), np.ones_like(w)), "respo_vespo": (respo_pos, vespo_neg),
                "vespo_respo": (vespo_pos, respo_neg)}
    for name, (pos, neg) in expected.items():
        objective = get_objective(name)
        assert OBJECTIVES[name].aggregation == "token-mean"
        mask = np.ones((2 * w.size, 3), np.float32)
        old = np.full(mask.shape, -2.0, np.float32)
        logp = old + np.tile(log_w / 3, 2)[:, None].astype(np.float32)
        adv = np.repeat(np.float32([1.0, -1.0]), w.size)
        out = objective.evaluate(logp, old, adv, mask)
        phi = np.asarray(out.responses["phi"], np.float64)
        np.testing.assert_allclose(phi, np.concatenate([pos, neg]), rtol=2e-4, atol=1e-6)


def test_select_learning_rate_takes_the_best_late_mean_and_the_smaller_lr_on_a_tie():
    assert select_learning_rate({1e-4: 0.20, 5e-5: 0.25, 2.5e-5: 0.22}) == 5e-5
    assert select_learning_rate({1e-4: 0.25, 5e-5: 0.25, 2.5e-5: None}) == 5e-5
    assert select_learning_rate({1e-4: None}) is None


def test_second_study_config_orders_and_matches_its_cells():
    config = gs.load_sweep_config(CONFIG_V2)
    s = config.sweep
    cells = config.cells()
    # lr x updates fixed: 1,024 / 512 / 256
    assert {c.learning_rate: config.experiment(c).run.policy_updates for c in cells} == {
        2.5e-5: 1024, 5e-5: 512, 1e-4: 256}
    assert all(config.experiment(c).optim.learning_rate == c.learning_rate for c in cells)
    # first the selection seed at N = 32 (objectives and controls), then the report seeds' N = 32 grid
    head = cells[:21]
    assert {(c.seed, c.reuse) for c in head} == {(3, 32)} and {c.objective for c in head} == {
        "grpo", "gspo", "vespo", "respo", "reinforce", "respo_vespo", "vespo_respo"}
    assert {(c.seed, c.reuse) for c in cells[21:57]} == {(0, 32), (1, 32), (2, 32)}
    # N = 1: only the objectives that differ there; controls only at N = 32; no long cell before selection
    assert {c.objective for c in cells if c.reuse == 1} == {"grpo", "gspo"}
    assert {c.reuse for c in cells if c.objective in s.control_list} == {32}
    assert not [c for c in cells if c.regime] and len(cells) == len(set(cells)) == 90
    best = {(o, 32): 5e-5 for o in s.objective_list + s.control_list}
    more = config.cells(best)
    long = [c for c in more if c.regime == "long"]
    assert [c.name for c in long[:2]] == ["long_grpo_n8_seed0_lr5e-05", "long_gspo_n8_seed0_lr5e-05"]
    exp = config.experiment(long[0])
    assert (exp.task.difficulty, exp.rollout.max_new_tokens, exp.run.policy_updates) == (
        "scratchpad_long", 200, 512)
    assert exp.model.checkpoint_dir == os.path.abspath(config.regime_base_dir("long"))
    assert exp.model.checkpoint_dir != os.path.abspath(config.base_dir)
    # the controls at the common lr (1e-4) and at their best (5e-5), three seeds each
    assert len([c for c in more if c.objective in s.control_list and c.seed != 3]) == 18
    assert config.run.eval_samples == 8 and config.run.eval_problems == 512
    # the first study's cells keep their names and settings
    v1 = gs.load_sweep_config(CONFIG)
    assert [c.name for c in v1.cells()][:2] == ["grpo_n1_seed0", "gspo_n1_seed0"]
    for bad, match in (("sweep.learning_rates=1e-4,3e-5", "multiple of every N"),
                       ("sweep.selection_seed=0", "not in sweep.seeds"),
                       ("sweep.controls=grpo", "not in sweep.objectives"),
                       ("sweep.on_policy_objectives=reinforce", "subset of sweep.objectives"),
                       ("sweep.long_difficulty=nope", "synthetic difficulty"),
                       ("run.eval_top_p=0", r"run.eval_top_p=0.*\(0, 1\]")):
        with pytest.raises(ConfigError, match=match):
            apply_overrides(config, [bad])


def tiny_v2(tmp_path, *extra: str) -> list[str]:
    """The second study's --quick config shrunk to a test: the one-layer model of tests/tiny_runs.py,
    ReSPO x lr in {1e-4, 2e-4} at N = 2, a selection seed and one report seed, the long regime (here the
    small task again) at the best lr. The sampled evaluation keeps only the most likely token (top-p
    1e-6): its pass@1 must be greedy's."""
    return [
        "--config", CONFIG_V2, "--quick", TINY_MODEL, "sweep.objectives=respo",
        "sweep.on_policy_objectives=respo", "sweep.controls=", "sweep.reuse=2", "sweep.seeds=0",
        "sweep.selection_seed=1",
        "sweep.learning_rates=1e-4,2e-4", "sweep.policy_updates=2", "sweep.long_difficulty=scratchpad",
        "sweep.long_reuse=2", "sweep.long_max_new_tokens=32", "warmup.steps=2", "warmup.batch_size=8",
        "run.eval_problems=4", "run.eval_samples=2", "run.eval_top_p=1e-6",
        "rollout.prompts_per_minibatch=2", "rollout.group_size=2", "rollout.max_new_tokens=32",
        'task.overrides={"num_operands": 3}',
        f"sweep.runs_dir={tmp_path / 'runs'}", f"sweep.out_dir={tmp_path / 'out'}",
        "sweep.compilation_cache=false", *extra,
    ]


def test_long_regime_acceptance_needs_little_clipping_and_a_heavy_positive_tail():
    def group(objective, reuse, clip, tail):
        return {"objective": objective, "reuse": reuse, "clip_fraction": clip,
                "positive_log_w_lt_minus1_share": tail}

    groups = [group("grpo", 8, 0.004, 0.2), group("gspo", 8, 0.009, 0.16), group("respo", 8, None, 0.5),
              group("grpo", 32, 0.004, 0.3), group("gspo", 32, 0.02, 0.3)]
    accepted = {row["reuse"]: row["accepted"] for row in long_acceptance(groups)["by_reuse"]}
    assert accepted == {8: True, 32: False}  # GSPO clips 2% at N = 32
    assert not long_acceptance([group("grpo", 8, 0.004, 0.1)])["by_reuse"][0]["accepted"]  # tail too light
    assert not long_acceptance([group("respo", 8, None, 0.5)])["by_reuse"][0]["accepted"]  # no baseline


@pytest.mark.slow
def test_second_study_runs_selects_and_reports(tmp_path):
    summary = json.loads(json.dumps(gs.main(tiny_v2(tmp_path))))
    out = tmp_path / "out"
    for name in (gs.SUMMARY_JSON, gs.SUMMARY_MD, gs.FIGURE, gs.GRID_FIGURE, gs.CONTROLS_FIGURE,
                 gs.LONG_FIGURE):
        assert (out / name).stat().st_size > 0
    assert summary == json.loads((out / gs.SUMMARY_JSON).read_text()) and summary["missing_cells"] == []
    cells = {c["name"]: c for c in summary["cells"]}
    (record,) = summary["selection"]["records"]
    late = {lr: cells[f"respo_n2_seed1_lr{lr}"]["late_mean"] for lr in ("0.0001", "0.0002")}
    assert record["late_means"] == pytest.approx(late)  # chosen on what the report shows
    chosen = select_learning_rate({float(k): v for k, v in late.items()})
    assert record["best_learning_rate"] == chosen
    assert sorted(cells) == sorted(["respo_n2_seed1_lr0.0001", "respo_n2_seed1_lr0.0002",
                                    "respo_n2_seed0_lr0.0001", "respo_n2_seed0_lr0.0002",
                                    f"long_respo_n2_seed0_lr{chosen:g}"])
    updates = {c["policy_updates"] for c in summary["cells"]
               if c["learning_rate"] == 1e-4 and not c["regime"]}
    assert updates == {4}  # lr x updates fixed: 2 updates at 2e-4, 4 at 1e-4
    # groups over the report seed only; the selected one is each method's best
    groups = [(g["regime"], g["learning_rate"]) for g in summary["groups"]]
    assert groups == [("", 2e-4), ("", 1e-4), ("long", chosen)]
    assert [g["learning_rate"] for g in summary["best"]] == [chosen] and summary["best"][0]["seeds"] == [0]
    for cell in summary["cells"]:
        # the sampled evaluation's machinery against greedy decoding (top-p 1e-6 keeps the argmax only)
        assert cell["sampled_pass_at_1_after"] == cell["heldout_accuracy"]
        assert cell["sampled_pass_at_1_before"] == cell["heldout_accuracy_before"]
        assert cell["sampled_pass_at_1_se_after"] >= 0.0
        d = cell["diagnostics"]
        assert d["approx_kl"] is not None and d["clip_fraction"] is None  # ReSPO does not clip
        assert d["negative_log_w_lt0_share"] is None or 0.0 <= d["negative_log_w_lt0_share"] <= 1.0
    base = summary["base_held_out"]
    assert set(base) == {"main", "long"} and all(b["sampled_samples"] == 2 for b in base.values())
    assert all(b["sampled_pass_at_1"] == b["greedy_accuracy"] for b in base.values())
    assert [r["reuse"] for r in summary["long_acceptance"]["by_reuse"]] == [2]
    table = (out / gs.SUMMARY_MD).read_text()
    assert "## Each method at its own best lr" in table
    assert "NOT accepted (no clipped baseline finished)" in table
