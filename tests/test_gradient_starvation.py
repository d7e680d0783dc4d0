"""Tests of the gradient-starvation study (issue 17): the scratchpad task with its held-out split, the
sweep config, and `python -m experiments.gradient_starvation` end to end on a tiny setting (it runs,
writes well-formed outputs, skips finished cells and refuses stale ones — not which method wins).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import sympy

from experiments import gradient_starvation as gs
from respo_jax.data.synthetic import ArithmeticTask, CharTokenizer, get_task, scratchpad_steps
from respo_jax.rewards import strict_box_score
from respo_jax.training.config import ConfigError, apply_overrides

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
    """Overrides that make the sweep a ~minute test: ReSPO x N in {1, 2}, one seed, 4 updates."""
    return [
        "sweep.objectives=respo", "sweep.reuse=1,2", "sweep.seeds=0", "sweep.policy_updates=4",
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
    summary = gs.main(tiny(tmp_path))
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
