"""Run reports (`respo_jax.eval.report`, `python -m experiments.report`).

References: the numbers of every table recomputed here from the same files with `respo_jax.eval`
(metrics.jsonl -> `early_peak` / `late_mean`; completions.jsonl -> `summarize_completions`,
`shared_length_bins`; rollout files -> `allocation_table`, `weight_length_trajectory`, `length_by_bin`),
with the windows derived by hand from the paper's rules; hand-computed trapezoid means on a logged curve
of the paper's length (1,024 policy updates); hand-made run directories whose files disagree.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import pathlib
import re

import numpy as np
import pytest

from experiments.report import cli, default_out_dir
from experiments.report import main as report_main
from respo_jax.eval import (
    allocation_table,
    early_peak,
    late_mean,
    length_by_bin,
    load_rollout_files,
    shared_length_bins,
    weight_length_trajectory,
    write_rollout_file,
)
from respo_jax.eval.completions import load_completions, summarize_completions
from respo_jax.eval.report import (
    ReportError,
    build_report,
    curves_figure,
    e3_window,
    length_bin_groups,
    load_run,
    load_runs,
    metrics_comparison,
    metrics_comparison_markdown,
    summary_windows,
    training_summary,
    training_summary_markdown,
)
from respo_jax.training.config import ExperimentConfig, apply_overrides

# ------------------------------------------------------------------------------- helpers


def _table_row(markdown: str, section: str, first_cell: str) -> list[str]:
    """The cells of the first table row starting with `first_cell` after the heading line `section`."""
    text = markdown[markdown.index(section):]
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} after {section!r}")


def _metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _score_curve(run_dir) -> tuple[np.ndarray, np.ndarray]:
    rl = [r for r in _metrics(run_dir) if r["phase"] == "rl"]
    return (np.array([r["policy_updates"] for r in rl], float),
            np.array([(r["score"] + 1) / 2 for r in rl], float))


def _write_run(path: pathlib.Path, objective="respo", reuse=2, iterations=4, scores=None, rollouts=True,
               seed=0, extra=None) -> pathlib.Path:
    """A run directory as the trainer writes it: config.json, metrics.jsonl (warm-up, RL and eval records)
    and one rollout file per iteration with N*M*G = reuse*2*4 rows."""
    config = apply_overrides(ExperimentConfig(), [f"objective.name={objective}", f"rollout.reuse={reuse}",
                                                  "rollout.prompts_per_minibatch=2", "rollout.group_size=4",
                                                  f"run.seed={seed}", f"run.out_dir={path}"])
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    rng = np.random.default_rng(seed + 17 * reuse)
    records = [{"phase": "warmup", "step": 1, "loss": 1.0}]
    for i in range(1, iterations + 1):
        score = scores(i) if scores else float(rng.uniform())
        records.append({"phase": "rl", "iteration": i, "policy_updates": i * reuse, "score": 2 * score - 1,
                        "train_accuracy": score, "response_length": 3.0 + i, "approx_kl": 0.01 * i,
                        "entropy": 1.0 - 0.01 * i, **(extra or {})})
        if rollouts:
            rows = reuse * 2 * 4
            write_rollout_file(path, {
                "log_w": rng.normal(-1.0, 2.0, rows).astype(np.float32),
                "advantage": rng.normal(0, 1, rows).astype(np.float32),
                "length": rng.integers(1, 50, rows).astype(np.int32),
                "phi": rng.uniform(0, 1.3, rows).astype(np.float32),
                "reward": rng.choice([-1.0, 1.0], rows).astype(np.float32),
                "minibatch": (np.arange(rows) // 8).astype(np.int32),
                "group": (np.arange(rows) // 4).astype(np.int32),
                "iteration": np.int64(i), "policy_updates": np.int64(i * reuse),
            })
    records.append({"phase": "eval", "policy_updates": iterations * reuse, "greedy_accuracy": 0.5})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _write_evaluation(eval_dir: pathlib.Path, records: list[dict], cap: int, run_dir=None, step=None):
    """An evaluation directory as `experiments.evaluate` writes it, for the given completion records."""
    eval_dir.mkdir(parents=True, exist_ok=True)
    protocol = {"checkpoint": str(run_dir or eval_dir),
                "checkpoint_kind": "run" if run_dir else "huggingface", "checkpoint_step": step,
                "max_new_tokens": cap, "samples": 0, "seed": 0}
    summary = {"checkpoint": "x", "protocol": protocol, **summarize_completions(records, num_resamples=200)}
    (eval_dir / "summary.json").write_text(json.dumps(summary))
    (eval_dir / "eval_config.json").write_text(json.dumps({"config": {}, "protocol": protocol}))
    (eval_dir / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _completions(rng, benchmarks=("math500", "aime25"), problems=5, samples=2, cap=20) -> list[dict]:
    records = []
    for benchmark in benchmarks:
        for p in range(problems):
            for s in range(samples):
                length = int(rng.integers(1, cap + 1))
                records.append({"benchmark": benchmark, "problem_id": f"{benchmark}-{p}", "problem_index": p,
                                "sample": s, "length": length, "truncated": length == cap,
                                "score": float(rng.uniform() < 0.5), "verify_status": "ok", "answer": "1",
                                "text": "t"})
    return records


# ------------------------------------------------------------------------------- two trained runs


@pytest.mark.slow
def test_report_over_two_trained_runs_matches_respo_jax_eval(tmp_path):
    """ReSPO (4 iterations) and GRPO (3 iterations) at N=2 on the synthetic task, both evaluated on the
    synthetic benchmark (GRPO's evaluation kept outside its run directory, given with --eval). Every
    number of the report equals what respo_jax.eval computes from the same files."""
    from experiments.evaluate import main as evaluate
    from experiments.train import main as train

    common = ["warmup.steps=30", "warmup.batch_size=32", "rollout.prompts_per_minibatch=2",
              "rollout.group_size=4", "rollout.reuse=2", "run.eval_problems=0", "run.progress=false"]
    respo, grpo, grpo_eval = tmp_path / "respo", tmp_path / "grpo", tmp_path / "grpo_eval"
    train(common + ["run.iterations=4", f"run.out_dir={respo}"])
    train(common + ["objective.name=grpo", "run.iterations=3", f"run.out_dir={grpo}"])
    protocol = ["eval.benchmarks=synthetic", "eval.synthetic_problems=12", "eval.samples=2",
                "eval.max_new_tokens=6", "eval.dtype=float32", "eval.num_workers=1", "eval.progress=false",
                "eval.bootstrap_resamples=200"]
    evaluate(protocol + [f"eval.checkpoint={respo}"])
    evaluate(protocol + [f"eval.checkpoint={grpo}", f"eval.out_dir={grpo_eval}"])

    out = tmp_path / "report"
    path = report_main([str(respo), str(grpo), "--out", str(out), "--eval", f"{grpo}={grpo_eval}"])
    assert path == str(out / "report.md")
    markdown = (out / "report.md").read_text()
    data = json.loads((out / "report.json").read_text())
    labels = ["ReSPO N=2 seed=0", "GRPO N=2 seed=0"]
    assert [run["label"] for run in data["runs"]] == labels

    # Every linked image exists and is a PNG matplotlib can read.
    import matplotlib.image

    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert links == ["training_curves.png", "length_bins.png"]
    for name in links:
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    # Early/late summary: the shortest run has 6 updates (GRPO, 3 x N=2), so the paper's windows scale by
    # 6/1024: early 1.5 -> widened to update 2 (both runs' first logged update), late window 0.75 updates.
    assert data["windows"]["early_until"] == 2.0
    assert data["windows"]["late_window"] == pytest.approx(128 * 6 / 1024)
    assert "scaled to the shortest run" in markdown
    for run_dir, label, row in zip((respo, grpo), labels, data["training_summary"]):
        steps, values = _score_curve(run_dir)
        end = steps[-1]
        mean, std = late_mean(steps, values, end - 0.75, end)
        assert row["early_peak"] == pytest.approx(early_peak(steps, values, 2.0), abs=1e-12)
        assert (row["late_mean"], row["late_std"]) == pytest.approx((mean, std), abs=1e-12)
        assert row["final"] == pytest.approx(values[-1], abs=1e-12)
        cells = _table_row(markdown, "## Early and late", label)
        assert cells[2] == f"{early_peak(steps, values, 2.0):.3f}"
        assert cells[3] == f"{mean:.3f} ± {std:.3f}"
        assert cells[4] == f"[{end - 0.75:g}, {end:g}]"

    # Tab. 1: the evaluations' summaries, which are the completions' statistics.
    for eval_dir, label, row in zip((respo / "eval", grpo_eval), labels, data["evaluation"]["rows"]):
        records = load_completions(eval_dir / "completions.jsonl")
        expected = summarize_completions(records, ["synthetic"], num_resamples=200, seed=0)
        assert row["label"] == label and row["step"] == (4 if label.startswith("ReSPO") else 3)
        pass_at_1 = expected["benchmarks"]["synthetic"]["pass_at_1"]
        assert row["pass_at_1"]["synthetic"] == pytest.approx(pass_at_1)
        assert (row["average"], row["se"]) == pytest.approx(
            (expected["macro_average"]["pass_at_1"], expected["macro_average"]["se"]))
        cells = [c for c in _rows_of(markdown, "## Evaluation") if c[1] == label][0]
        assert cells[3] == f"{100 * expected['benchmarks']['synthetic']['pass_at_1']:.1f}"
        assert cells[4] == (f"{100 * expected['macro_average']['pass_at_1']:.1f} ± "
                            f"{100 * expected['macro_average']['se']:.1f}")

    # Length bins: one set of edges from both runs' pooled completions (same N), cap 6.
    methods = {}
    for eval_dir, label in zip((respo / "eval", grpo_eval), labels):
        records = load_completions(eval_dir / "completions.jsonl")
        methods[label] = ([r["length"] for r in records], [r["score"] for r in records])
    edges, bins = shared_length_bins(methods, 6)
    (group,) = data["length_bins"]
    assert group["reuse"] == 2 and group["cap"] == 6 and group["edges"] == edges.tolist()
    upper = _table_row(markdown, "## Accuracy across response lengths", "Upper bound")
    assert upper[1:] == [f"{int(b):,}" for b in edges]
    for label in labels:
        assert group["bins"][label]["counts"] == bins[label].counts.tolist()
        assert sum(group["bins"][label]["counts"]) == 24  # 12 problems x 2 samples
        counts = _table_row(markdown, "## Accuracy across response lengths", f"{label} count")
        assert counts[1:] == [str(c) for c in bins[label].counts]
        accuracy = _table_row(markdown, "## Accuracy across response lengths", f"{label} accuracy (%)")
        assert accuracy[1:] == ["–" if math.isnan(a) else f"{100 * a:.1f}" for a in bins[label].accuracy]

    # E.3: the window is the first 16 batches cut to the shortest run (GRPO: 3) -> Tab. 5 over batches
    # 2-3 (the second half), Tab. 6 at batches 1 and 3, Tab. 7 over 1-3 (ReSPO's batch 4 left out).
    tables = data["positive_branch"]
    assert tables["window"] == {"batches": 3, "allocation": [2, 3], "length": [1, 3], "trajectory": [1, 3]}
    for run_dir, label in zip((respo, grpo), labels):
        rollouts = [r for r in load_rollout_files(run_dir) if int(r["iteration"]) <= 3]
        assert any((r["advantage"] > 0).any() for r in rollouts[1:])  # Tab. 5 has positives to count
        expected = allocation_table(rollouts, 2, 3)
        for region, values in expected.items():
            assert tables["allocation"][label][region] == pytest.approx(values)
            cells = _table_row(markdown, "**Tab. 5**", f"Positive responses with {region}")
            assert cells[1 + labels.index(label)] == f"{100 * values['response_share']:.1f}%"
        tab7 = length_by_bin(rollouts, 1, 3)
        assert tables["length"][label]["branch_count"] == tab7["branch_count"]
        assert tables["length"][label]["branch_mean"] == pytest.approx(tab7["branch_mean"])
        counts = [row["count"] for row in tab7["bins"]]
        assert [row["count"] for row in tables["length"][label]["bins"]] == counts
        mean_row = _table_row(markdown, "**Tab. 7**", "Positive-branch mean")
        assert mean_row[2 + 2 * labels.index(label):4 + 2 * labels.index(label)] == [
            f"{tab7['branch_mean']:.1f}", str(tab7["branch_count"])]
        trajectory = {row["iteration"]: row for row in weight_length_trajectory(rollouts)}
        for iteration in (1, 3):
            got = tables["trajectory"][label][str(iteration)]
            want = trajectory[iteration]
            assert got["positive_count"] == want["positive_count"]
            if want["positive_count"]:
                assert got["positive_log_w_mean"] == pytest.approx(want["positive_log_w_mean"])

    # The curves: one line per run per panel, holding exactly the logged values.
    runs = load_runs([respo, grpo], {str(grpo): str(grpo_eval)})
    figure = curves_figure(runs)
    keys = ["train_accuracy", "response_length", "approx_kl", "entropy"]
    assert len(figure.axes) == 4
    for ax, key in zip(figure.axes, keys):
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == labels
        for line, run_dir in zip(lines, (respo, grpo)):
            rl = [r for r in _metrics(run_dir) if r["phase"] == "rl"]
            np.testing.assert_array_equal(line.get_xdata(), [r["policy_updates"] for r in rl])
            np.testing.assert_array_equal(line.get_ydata(), [r[key] for r in rl])


def _rows_of(markdown: str, section: str) -> list[list[str]]:
    """The body rows (cells) of the first table after `section`."""
    rows, started = [], False
    for line in markdown[markdown.index(section):].splitlines()[1:]:
        if line.startswith("|"):
            started = True
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-"):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # without the header


# ------------------------------------------------------------------------------- summary windows


def _alternating(i: int) -> float:
    """0.25 on even iterations, 0.75 on odd ones; 0.9 at iteration 32 (update 256) and 0.95 at 33 (264)."""
    return {32: 0.9, 33: 0.95}.get(i, 0.25 + 0.5 * (i % 2))


def test_paper_windows_on_a_run_of_the_papers_length_by_hand(tmp_path):
    """N=8, 128 iterations = 1,024 updates (the paper's runs). Early peak through 256: 0.9 (the 0.95 at 264 is
    outside). Late window [896, 1024] = iterations 112..128, knots 8 updates apart, both ends even (0.25):
    trapezoid weights 4 at the ends and 8 inside; 8 odd knots (0.75) weigh 64, the 0.25s weigh 4+4+7*8 = 64,
    so the mean is 0.5 and the weighted std 0.25."""
    run = load_run(_write_run(tmp_path / "long", reuse=8, iterations=128, scores=_alternating,
                              rollouts=False))
    windows = summary_windows([run])
    assert (windows.early_until, windows.late_window, windows.scale) == (256, 128, 1.0)
    (row,) = training_summary([run], windows)
    assert row["early_peak"] == 0.9
    assert (row["late_start"], row["late_end"]) == (896, 1024)
    assert (row["late_mean"], row["late_std"]) == pytest.approx((0.5, 0.25), abs=1e-15)
    assert row["final"] == 0.25 and row["final_step"] == 1024
    line = training_summary_markdown([row], windows).splitlines()[2]
    assert line == "| ReSPO N=8 seed=0 | 8 | 0.900 | 0.500 ± 0.250 | [896, 1024] | 0.250 (1024) |"

    # Half the length (512 updates): the windows keep the paper's proportions, early 128 and late 64.
    # Late [448, 512] = iterations 56..64: ends even; odd 57, 59, 61, 63 weigh 32 = the even ones' 4+4+3*8.
    short = load_run(_write_run(tmp_path / "short", reuse=8, iterations=64, scores=_alternating,
                                rollouts=False))
    windows = summary_windows([run, short])
    assert (windows.early_until, windows.late_window, windows.scale) == (128, 64, 0.5)
    assert "scaled to the shortest run (512 policy updates, 50% of the paper's)" in windows.note
    long_row, short_row = training_summary([run, short], windows)
    assert short_row["early_peak"] == 0.75 and long_row["early_peak"] == 0.75
    assert (short_row["late_start"], short_row["late_end"]) == (448, 512)
    assert (short_row["late_mean"], short_row["late_std"]) == pytest.approx((0.5, 0.25), abs=1e-15)
    assert (long_row["late_start"], long_row["late_end"]) == (960, 1024)  # every run's own last 64 updates

    # Explicit windows are used as given; a late window longer than the run is clipped at its first update.
    windows = summary_windows([short], early_until=300, late_window=600)
    assert windows.note == ("Windows: early peak through update 300, late mean over each run's last 600 "
                            "updates (early window as given; late window as given).")
    (row,) = training_summary([short], windows)
    assert row["early_peak"] == 0.95 and row["late_start"] == 8
    assert row["late_mean"] == pytest.approx(late_mean(*run_curve(short), 8, 512)[0])
    assert "clipped at its first logged update" in training_summary_markdown([row], windows)
    with pytest.raises(ReportError, match="late_window must be a positive number"):
        summary_windows([short], late_window=0)


def run_curve(run):
    return run.curve("train_accuracy")


def test_metrics_comparison_means_every_logged_key_per_run_side_by_side(tmp_path):
    a = _write_run(tmp_path / "a", objective="respo", reuse=2, iterations=3,
                   extra={"log_w_mean": -0.5, "clip_fraction": 0.25, "rollout_seconds": 2.0, "compiles": 3})
    b = _write_run(tmp_path / "b", objective="grpo", reuse=2, iterations=4, extra={"log_w_mean": 0.125})
    runs = load_runs([a, b])
    comparison = metrics_comparison(runs)
    assert comparison["labels"] == ["ReSPO N=2 seed=0", "GRPO N=2 seed=0"]
    # Numeric keys in the order the first run logs them; counters and wall-clock times are not compared.
    assert comparison["keys"] == ["score", "train_accuracy", "response_length", "approx_kl", "entropy",
                                  "log_w_mean", "clip_fraction"]
    means = comparison["means"]
    assert means["response_length"] == [pytest.approx(5.0), pytest.approx(5.5)]  # 3 + iteration
    assert means["approx_kl"] == [pytest.approx(0.02), pytest.approx(0.025)]
    assert means["log_w_mean"] == [-0.5, 0.125]
    assert means["clip_fraction"] == [0.25, None]  # GRPO's run never logs it
    for run, mean in zip(runs, means["train_accuracy"]):
        assert mean == pytest.approx(np.mean(run.curve("train_accuracy")[1]))
    markdown = metrics_comparison_markdown(comparison)
    assert markdown.splitlines()[0] == "| Metric | ReSPO N=2 seed=0 | GRPO N=2 seed=0 |"
    assert "| log_w_mean | -0.5000 | 0.1250 |" in markdown and "| clip_fraction | 0.2500 | – |" in markdown
    assert "ReSPO N=2 seed=0: 3, GRPO N=2 seed=0: 4" in markdown

    only = metrics_comparison(runs, keys=["approx_kl", "rollout_seconds"])  # asked for: compared
    assert only["keys"] == ["approx_kl", "rollout_seconds"] and only["means"]["rollout_seconds"] == [2.0, None]
    with pytest.raises(ReportError, match=r"no run logs \['log_w_mena'\]"):
        metrics_comparison(runs, keys=["log_w_mena"])
    c = _write_run(tmp_path / "c", iterations=2, extra={"log_w_mean": float("nan")})
    with pytest.raises(ReportError, match="'log_w_mean' holds a non-finite"):
        metrics_comparison(load_runs([c]))
    with pytest.raises(ReportError, match="no runs"):
        metrics_comparison([])


def test_e3_window_follows_the_paper_and_cuts_to_the_shortest_run(tmp_path):
    long = load_run(_write_run(tmp_path / "a", iterations=20))
    assert e3_window([long]) == {"batches": 16, "allocation": (9, 16), "length": (1, 16),
                                 "trajectory": [1, 8, 16]}
    short = load_run(_write_run(tmp_path / "b", objective="vespo", iterations=5))
    bare = load_run(_write_run(tmp_path / "c", objective="grpo", iterations=2, rollouts=False))
    assert e3_window([long, short, bare]) == {"batches": 5, "allocation": (3, 5), "length": (1, 5),
                                              "trajectory": [1, 2, 5]}
    report = build_report([long, short, bare])
    assert report.data["positive_branch"]["labels"] == ["ReSPO N=2 seed=0", "VESPO N=2 seed=0"]
    assert "No rollout files (rollouts/iteration_*.npz): GRPO N=2 seed=0." in report.markdown
    assert "No run has evaluation outputs" in report.markdown
    expected = allocation_table(load_rollout_files(tmp_path / "a")[:5], 3, 5)
    assert report.data["positive_branch"]["allocation"]["ReSPO N=2 seed=0"] == expected


# ------------------------------------------------------------------------------- evaluations


def test_length_bins_are_shared_per_n_and_tab1_groups_runs_by_n(tmp_path):
    rng = np.random.default_rng(3)
    dirs, completions = [], {}
    for name, objective, reuse in (("a", "respo", 2), ("b", "grpo", 2), ("c", "respo", 4)):
        run_dir = _write_run(tmp_path / name, objective=objective, reuse=reuse, iterations=3)
        completions[name] = _completions(rng)
        _write_evaluation(run_dir / "eval", completions[name], cap=20, run_dir=run_dir, step=3)
        dirs.append(run_dir)
    runs = load_runs(dirs)
    groups = length_bin_groups(runs)
    assert [group.reuse for group in groups] == [2, 4]
    edges, bins = shared_length_bins({name: ([r["length"] for r in completions[name]],
                                             [r["score"] for r in completions[name]]) for name in "ab"}, 20)
    np.testing.assert_array_equal(groups[0].edges, edges)
    for label, name in zip(groups[0].bins, "ab"):
        np.testing.assert_array_equal(groups[0].bins[label].counts, bins[name].counts)
        np.testing.assert_array_equal(groups[0].bins[label].accuracy, bins[name].accuracy)
    report = build_report([runs[2], runs[0], runs[1]])
    assert [row["reuse"] for row in report.data["evaluation"]["rows"]] == [2, 2, 4]
    assert report.data["evaluation"]["benchmarks"] == ["aime25", "math500"]  # the paper's order
    row = _table_row(report.markdown, "## Evaluation", "2")
    summary = summarize_completions(completions["a"], num_resamples=200)
    assert row[3:] == [f"{100 * summary['benchmarks']['aime25']['pass_at_1']:.1f}",
                       f"{100 * summary['benchmarks']['math500']['pass_at_1']:.1f}",
                       f"{100 * summary['macro_average']['pass_at_1']:.1f} ± "
                       f"{100 * summary['macro_average']['se']:.1f}"]

    # Only the summarized completions count: a second sample-count's extra records are ignored.
    extra = [dict(r, sample=r["sample"] + 2) for r in completions["a"][:4]]
    with open(tmp_path / "a" / "eval" / "completions.jsonl", "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in extra))
    assert len(load_run(tmp_path / "a").evaluation.completions) == len(completions["a"])

    # One N, two caps: no shared bins.
    _write_evaluation(tmp_path / "b" / "eval", completions["b"], cap=30, run_dir=tmp_path / "b", step=3)
    with pytest.raises(ReportError, match=r"N=2: the evaluations have different generation caps"):
        length_bin_groups(load_runs(dirs[:2]))


# ------------------------------------------------------------------------------- bad input


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not captured.out, captured
    return lines[0]


def test_command_line_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """Bad flags, a directory that is not a run, a log with a duplicated iteration, an unwritable --out:
    one line and exit status 2, nothing written; a report that cannot be written once built: exit 1."""
    import experiments.report as report_module

    run = _write_run(tmp_path / "run", iterations=3)
    (tmp_path / "a_file").write_text("")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    duplicated = _write_run(tmp_path / "duplicated", iterations=3)
    (duplicated / "metrics.jsonl").write_text("\n".join(lines[:3] + lines[2:]) + "\n")
    for argv, message in [
        ([str(run), "--no-such-flag"], "error: unrecognized arguments: --no-such-flag (see --help)"),
        ([], "error: the following arguments are required: RUN_DIR (see --help)"),
        ([str(run), "--bins", "two"], "error: argument --bins: invalid int value: 'two' (see --help)"),
        ([str(run), "--bins", "2"], "error: --bins must be >= 3 (two quantile bins and the cap bin); got 2 "
                                    "(see --help)"),
        ([str(run), "--eval", "x"], "error: --eval 'x': expected RUN_DIR=EVAL_DIR"),
        ([str(tmp_path / "a_file")], f"error: {tmp_path / 'a_file'}: not a directory"),
        ([str(duplicated)], f"error: {duplicated / 'metrics.jsonl'}:4: iteration 2 was already recorded on "
                            "line 3 (a log appended to by a resumed run?)"),
        ([str(run), "--out", str(tmp_path / "a_file" / "report")],
         f"error: --out '{tmp_path / 'a_file' / 'report'}': {tmp_path / 'a_file'} is a file, not a "
         "directory"),
    ]:
        assert cli(argv) == 2, argv
        assert _one_error_line(capsys) == message
    assert not (run / "report").exists() and not (duplicated / "report").exists()

    def full_disk(report, out_dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(out_dir, "report.md"))

    monkeypatch.setattr(report_module, "write_report", full_disk)
    assert cli([str(run)]) == 1
    assert _one_error_line(capsys) == (f"error: writing the report to {run / 'report'} failed: [Errno 28] No "
                                       f"space left on device: '{run / 'report' / 'report.md'}'")


def test_not_a_run_and_mismatched_files_are_named(tmp_path, capsys):
    with pytest.raises(ReportError, match="not a directory"):
        load_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=r"empty is not a training run directory: config.json is missing"):
        load_run(tmp_path / "empty")
    assert cli([str(tmp_path / "empty")]) == 2
    assert "error: " in capsys.readouterr().err

    run = _write_run(tmp_path / "run", iterations=3)
    metrics = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(metrics + '{"phase": "rl", "iter')  # a torn last line: a note
    assert any("torn last line" in note for note in load_run(run).notes)
    lines = metrics.splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:2] + ["{oops"] + lines[2:]) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl:3: damaged record"):
        load_run(run)
    (run / "metrics.jsonl").write_text("\n".join(lines[:3] + lines[2:]) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl:4: iteration 2 was already recorded on line 3"):
        load_run(run)
    (run / "metrics.jsonl").write_text(metrics)

    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(dict(config, rollout=dict(config["rollout"], reuse=4))))
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: policy_updates=2 at iteration 1, but "
                                          r"config.json's rollout.reuse=4 gives 4"):
        load_run(run)
    # config.json is read by the config's own loader and validator: a bad value, an unknown field
    (run / "config.json").write_text(json.dumps(dict(config, objective=dict(config["objective"], name=7))))
    with pytest.raises(ReportError, match=r"config.json: objective.name=7: expected a string"):
        load_run(run)
    (run / "config.json").write_text(json.dumps(dict(config, rollout=dict(config["rollout"], reuse=0))))
    with pytest.raises(ReportError, match=r"config.json: rollout.reuse=0: expected"):
        load_run(run)
    (run / "config.json").write_text(json.dumps(dict(config, run=dict(config["run"], sed=1))))
    with pytest.raises(ReportError, match=r"config.json: unknown config fields run.\['sed'\]"):
        load_run(run)

    other = _write_run(tmp_path / "other", iterations=5)
    run = _write_run(tmp_path / "run2", iterations=3)
    os.replace(other / "rollouts" / "iteration_000004.npz", run / "rollouts" / "iteration_000004.npz")
    with pytest.raises(ReportError, match=r"iteration_000004.npz: iteration 4 is not in metrics.jsonl"):
        load_run(run)
    wide = _write_run(tmp_path / "wide", reuse=4, iterations=1)
    os.replace(wide / "rollouts" / "iteration_000001.npz", run / "rollouts" / "iteration_000001.npz")
    os.remove(run / "rollouts" / "iteration_000004.npz")
    with pytest.raises(ReportError, match=r"iteration_000001.npz: policy_updates=4, but metrics.jsonl "
                                          r"logs 2"):
        load_run(run)

    # Evaluation files that disagree with each other.
    run = _write_run(tmp_path / "evaluated", iterations=2)
    records = _completions(np.random.default_rng(0))
    _write_evaluation(run / "eval", records, cap=20, run_dir=run, step=2)
    assert load_run(run).evaluation.step == 2
    flipped = [dict(r, score=1.0 - r["score"]) if i == 0 else r for i, r in enumerate(records)]
    (run / "eval" / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in flipped))
    with pytest.raises(ReportError, match=r"summary.json gives 'math500' pass@1 .* the files are from "
                                          r"different"):
        load_run(run)
    (run / "eval" / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[1:]))
    with pytest.raises(ReportError, match=r"summary.json counts 10 completions of 'math500'; .* holds 9"):
        load_run(run)
    _write_evaluation(run / "eval", records, cap=20, run_dir=run, step=2)
    recorded = json.loads((run / "eval" / "eval_config.json").read_text())
    recorded["protocol"]["max_new_tokens"] = 64
    (run / "eval" / "eval_config.json").write_text(json.dumps(recorded))
    with pytest.raises(ReportError, match=r"describe different evaluations \(they differ in "
                                          r"\['max_new_tokens'\]"):
        load_run(run)
    os.remove(run / "eval" / "summary.json")
    assert load_run(run).evaluation is None and "no summary.json" in load_run(run).notes[0]
    with pytest.raises(ReportError, match="summary.json is missing"):
        load_run(run, eval_dir=run / "eval")

    with pytest.raises(ReportError, match="a run directory is given twice"):
        load_runs([run, str(run) + "/"])
    with pytest.raises(ReportError, match="evaluation directories given for"):
        load_runs([run], {str(tmp_path / "other"): str(run / "eval")})


def test_labels_are_unique_and_the_default_out_dir(tmp_path):
    a = _write_run(tmp_path / "x" / "seed_a", iterations=2)
    b = _write_run(tmp_path / "y" / "seed_b", iterations=2)
    assert [run.label for run in load_runs([a, b])] == ["ReSPO N=2 seed=0 (seed_a)",
                                                        "ReSPO N=2 seed=0 (seed_b)"]
    assert default_out_dir([str(a)]) == os.path.join(str(a), "report")
    assert default_out_dir([str(a), str(b)]) == str(tmp_path / "report")
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "length_bins.png").write_bytes(b"from an earlier report with evaluations")
    path = report_main([str(a), str(b)])
    assert not (tmp_path / "report" / "length_bins.png").exists()  # no stale figure next to the new report
    assert path == str(tmp_path / "report" / "report.md")
    assert os.path.isfile(tmp_path / "report" / "training_curves.png")
    # A run without approx_kl / entropy (logged before they existed) has no line there; the report says so.
    old = _write_run(tmp_path / "old", iterations=2)
    records = [{k: v for k, v in r.items() if k not in ("approx_kl", "entropy")} for r in _metrics(old)]
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = load_runs([a, old])
    figure = curves_figure(runs)
    assert [len(ax.get_lines()) for ax in figure.axes] == [2, 2, 1, 1]
    assert "metrics.jsonl has no 'approx_kl'" in build_report(runs).markdown
    assert dataclasses.is_dataclass(runs[0])
