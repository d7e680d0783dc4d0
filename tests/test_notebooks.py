"""The notebooks under notebooks/ run top to bottom on a fresh kernel (nbclient, their small size) and show
what they promise; they are stored without outputs and import their logic from the package.

Every test here has "notebook" in its name (`pytest -k notebook`). Content is checked against the files
the notebooks wrote and against the package's own functions, not only for the absence of errors.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re

import numpy as np
import pytest

from notebook_runner import NOTEBOOK_DIR, code_cells, execute_notebook, read_notebook
from respo_jax.eval import load_rollout_files
from respo_jax.eval.positive_branch import allocation_table
from respo_jax.objectives import BUILTIN_OBJECTIVES, respo_kernel
from respo_jax.symbolic import ALL_CLAIMS

NOTEBOOKS = ["derivations.ipynb", "objectives.ipynb", "toy_rl.ipynb", "analysis.ipynb"]
# What a notebook may import: the package, the standard library pieces they use, and the array/plot stack.
ALLOWED_IMPORTS = {"respo_jax", "experiments", "os", "io", "pathlib", "numpy", "jax", "sympy", "matplotlib",
                   "IPython"}


@pytest.fixture(scope="session")
def kernel_env():
    """The notebooks' kernels use the test session's persistent XLA compilation cache (tests/conftest.py,
    shared across pytest-xdist workers): the tiny model's warm-up, sampler and update programs recur
    across notebooks and runs. An entry read half written fails to decompress and is compiled instead,
    so concurrent kernels are safe."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"]}


def markdown_rows(markdown: str, first_cell: str) -> list[list[str]]:
    """The cells of every markdown-table row whose first cell is `first_cell`."""
    rows = []
    for line in markdown.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            rows.append(cells)
    return rows


def table_header(markdown: str) -> list[str]:
    return [cell.strip() for cell in markdown.splitlines()[0].strip().strip("|").split("|")]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs_and_imports_from_the_package(name):
    nb = read_notebook(name)
    assert set(NOTEBOOKS) == {path.name for path in NOTEBOOK_DIR.glob("*.ipynb")}
    for cell in code_cells(nb):
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
    imported = set()
    for cell in code_cells(nb):
        source = "\n".join(line for line in cell.source.splitlines() if not line.startswith("%"))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    assert "respo_jax" in imported
    # The size knob is read in the first code cell.
    assert "RESPO_NOTEBOOK_SIZE" in code_cells(nb)[0].source or name == "derivations.ipynb"


@pytest.mark.slow
def test_derivations_notebook_proves_every_claim_and_shows_equations_next_to_fig1(tmp_path, kernel_env):
    run = execute_notebook("derivations.ipynb", tmp_path, kernel_env)
    stdout = run.stdout()
    assert "FAILED" not in stdout
    assert stdout.count("[proved] ") == len(ALL_CLAIMS)
    assert f"{len(ALL_CLAIMS)}/{len(ALL_CLAIMS)} claims proved" in stdout
    assert len(run.images()) == 1
    latex = run.displayed("text/latex")
    # The kernels and the derived results (solved tilts, limits) are displayed as formulas ...
    assert len(latex) >= 8, latex
    assert any(r"\frac{e}{2}" in formula or r"\frac{e^{1}}{2}" in formula for formula in latex), latex
    # ... and the cell that draws Fig. 1 shows the closed forms it plots.
    fig_cell = next(cell for cell in code_cells(run.nb) if any("image/png" in out.get("data", {})
                                                               for out in cell.outputs))
    assert sum("text/latex" in out.get("data", {}) for out in fig_cell.outputs) >= 2
    print(f"derivations.ipynb executed in {run.seconds:.1f} s")


@pytest.mark.slow
def test_objectives_notebook_plots_weights_registers_kernels_and_trains_them_side_by_side(
        tmp_path, kernel_env):
    run = execute_notebook("objectives.ipynb", tmp_path, kernel_env)
    stdout = run.stdout()
    for name in BUILTIN_OBJECTIVES:
        assert re.search(rf"^{name}\s", stdout, re.M), name
    assert stdout.count("refused:") == 4
    assert len(run.images()) == 3  # Fig. 1, the new kernels, the side-by-side curves

    weight_tables = [md for md in run.markdown() if md.startswith("| objective | sign |")]
    assert len(weight_tables) == 2
    fig1 = weight_tables[0]
    assert table_header(fig1)[2:] == [f"log W = {x:g}" for x in (-5, -2, -1, 0, 1, 2)]
    for label in ("GRPO", "GSPO", "VESPO", "CISPO", "ReSPO"):
        assert [row[1] for row in markdown_rows(fig1, label)] == ["A > 0", "A < 0"], label
    respo_pos = markdown_rows(fig1, "ReSPO")[0]
    w = math.exp(-5.0)
    assert float(respo_pos[2]) == pytest.approx((1 + w) / 2 * math.exp(1 - w), rel=1e-3)
    assert [float(v) for v in markdown_rows(fig1, "GRPO")[0][2:]] == pytest.approx(
        [math.exp(-5), math.exp(-2), math.exp(-1), 1.0, 0.0, 0.0], rel=1e-3)
    # Each off-policy mask swapped in on the hand-made batch removes some of its tokens and moves the loss.
    masks = next(md for md in run.markdown() if md.startswith("| mask |"))
    (plain,) = markdown_rows(masks, "none")
    assert float(plain[1]) == 0.0
    for kind in ("deepseek_v32", "geometric", "m2po"):
        (row,) = markdown_rows(masks, kind)
        assert 0.0 < float(row[1]) < 1.0 and row[2] != plain[2], row
    new = weight_tables[1]
    assert [row[0] for row in markdown_rows(new, "log-Gaussian")] == ["log-Gaussian"] * 2
    gauss_pos, gauss_neg = markdown_rows(new, "log-Gaussian")
    assert [float(v) for v in gauss_pos[2:]] == pytest.approx(
        [1.0, 1.0, 1.0, math.exp(-0.5), math.exp(-12.5)], rel=1e-3)
    assert [float(v) for v in gauss_neg[2:]] == pytest.approx(
        [math.exp(-12.5), math.exp(-0.5), 1.0, math.exp(-0.5), math.exp(-12.5)], rel=1e-3)

    # The side-by-side table compares both trained objectives on every key they log.
    comparison = next(md for md in run.markdown() if md.startswith("| Metric |"))
    labels = table_header(comparison)[1:]
    assert labels == ["ReSPO N=16 seed=0", "log_gauss N=16 seed=0"]
    for key in ("train_accuracy", "log_w_mean", "coef_mean_pos", "approx_kl", "entropy"):
        (row,) = markdown_rows(comparison, key)
        assert all(re.fullmatch(r"-?\d+\.\d{4}", cell) for cell in row[1:]), row
    # N = 16 drifts log W far enough from 0 that the two kernels weigh the responses differently.
    (row,) = markdown_rows(comparison, "coef_mean_pos")
    assert row[1] != row[2], row
    for name in ("respo", "log_gauss"):
        run_dir = tmp_path / "objectives" / name
        config = json.loads((run_dir / "config.json").read_text())
        assert config["objective"]["name"] == name
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rl = [record for record in records if record["phase"] == "rl"]
        assert [record["policy_updates"] for record in rl] == [16, 32, 48]
        (row,) = markdown_rows(comparison, "log_w_mean")
        shown = float(row[labels.index(f"{'ReSPO' if name == 'respo' else name} N=16 seed=0") + 1])
        assert shown == pytest.approx(np.mean([record["log_w_mean"] for record in rl]), abs=1e-4)
    # The user kernel is what weighed the log_gauss run's responses (read back from its rollout files).
    for rollout in load_rollout_files(tmp_path / "objectives" / "log_gauss"):
        log_w, positive = rollout["log_w"].astype(np.float64), rollout["advantage"] >= 0
        expected = np.where(positive, np.exp(-0.5 * np.maximum(log_w, 0.0) ** 2), np.exp(-0.5 * log_w**2))
        np.testing.assert_allclose(rollout["phi"], expected, rtol=1e-5, atol=1e-7)
    print(f"objectives.ipynb executed in {run.seconds:.1f} s")


@pytest.mark.slow
def test_toy_rl_notebook_runs_two_objectives_at_n16_with_curves_and_e3_tables(tmp_path, kernel_env):
    run = execute_notebook("toy_rl.ipynb", tmp_path, kernel_env)
    assert len(run.images()) == 1
    labels = ["GRPO N=16 seed=0", "ReSPO N=16 seed=0"]
    summary = next(md for md in run.markdown() if md.startswith("| Run | N | Early peak"))
    assert [row[0] for row in markdown_rows(summary, labels[0]) + markdown_rows(summary, labels[1])] == labels
    e3 = next(md for md in run.markdown() if md.startswith("**Tab. 5**"))
    assert "**Tab. 6**" in e3 and "**Tab. 7**" in e3
    rollouts = {name: load_rollout_files(tmp_path / "toy_rl" / f"{name}_n16") for name in ("grpo", "respo")}
    for name, label in zip(("grpo", "respo"), labels):
        files = rollouts[name]
        assert [int(r["iteration"]) for r in files] == [1, 2, 3]
        assert all(r["log_w"].size == 16 * 2 * 4 for r in files)
        # Tab. 5 shows what positive_branch computes from the files (window: batches 2-3 of 3).
        assert any(np.any(r["advantage"] > 0) for r in files[1:]), "no positive response to diagnose"
        table = allocation_table(files, 2, 3)["log W < -1"]
        (row,) = markdown_rows(e3, "Positive responses with log W < -1")
        assert row[1 + labels.index(label)] == f"{100 * table['response_share']:.1f}%"
        (row,) = markdown_rows(e3, "Coefficient mass on log W < -1")
        assert row[1 + labels.index(label)] == f"{100 * table['mass_share']:.1f}%"
    (mean_row,) = markdown_rows(e3, "Positive-branch mean")
    assert all(cell != "–" for cell in mean_row[2:]), mean_row
    # ReSPO's rollout coefficient is its kernel; GRPO's stays within its clip (ratio <= 1 + eps or dual).
    for rollout in rollouts["respo"]:
        expected = np.asarray(respo_kernel(rollout["log_w"], rollout["advantage"]))
        np.testing.assert_allclose(rollout["phi"], expected, rtol=1e-5, atol=1e-7)
    assert "rollout files" in run.stdout()
    print(f"toy_rl.ipynb executed in {run.seconds:.1f} s")


@pytest.mark.slow
def test_analysis_notebook_rebuilds_tab1_length_bins_and_e3_from_runs_it_makes(tmp_path, kernel_env):
    run = execute_notebook("analysis.ipynb", tmp_path, kernel_env)
    assert len(run.images()) == 2  # curves, length bins
    labels = ["GRPO N=16 seed=0", "ReSPO N=16 seed=0"]
    tab1 = next(md for md in run.markdown() if md.startswith("| N | Run | Step |"))
    assert table_header(tab1)[3:] == ["Synthetic", "Avg."]
    for name, label in zip(("grpo", "respo"), labels):
        summary = json.loads((tmp_path / "analysis" / f"{name}_n16" / "eval" / "summary.json").read_text())
        (row,) = [cells for cells in markdown_rows(tab1, "16") if cells[1] == label]
        macro = summary["macro_average"]
        assert row[4] == f"{100 * macro['pass_at_1']:.1f} ± {100 * macro['se']:.1f}"
        assert summary["benchmarks"]["synthetic"]["completions"] == 32 * 4
    bins = next(md for md in run.markdown() if md.startswith("**N = 16**"))
    assert table_header(bins.split("\n\n")[1]) == ["Entry"] + [f"Q{i}" for i in range(1, 11)]
    for label in labels:
        (counts,) = markdown_rows(bins, f"{label} count")
        assert sum(int(c.replace(",", "")) for c in counts[1:]) == 32 * 4
    e3 = next(md for md in run.markdown() if md.startswith("**Tab. 5**"))
    assert all(label in e3 for label in labels)
    report = (tmp_path / "analysis" / "report" / "report.md").read_text()
    assert "## Evaluation (Tab. 1)" in report
    assert (tmp_path / "analysis" / "report" / "length_bins.png").is_file()
    print(f"analysis.ipynb executed in {run.seconds:.1f} s")


@pytest.mark.slow
def test_analysis_notebook_analyses_user_supplied_run_directories(tmp_path, kernel_env):
    """RESPO_ANALYSIS_RUNS: the notebook trains nothing and reports the given directories; a run without
    evaluation outputs or rollout files is reported without those sections instead of failing."""
    from test_report import _completions, _write_evaluation, _write_run

    respo = _write_run(tmp_path / "given" / "respo", objective="respo", reuse=2, iterations=5)
    grpo = _write_run(tmp_path / "given" / "grpo", objective="grpo", reuse=2, iterations=5, rollouts=False)
    records = _completions(np.random.default_rng(3), benchmarks=("math500", "aime25"), problems=6, samples=2)
    _write_evaluation(respo / "eval", records, cap=20, run_dir=respo, step=5)
    env = dict(kernel_env, RESPO_ANALYSIS_RUNS=os.pathsep.join([str(respo), str(grpo)]))
    run = execute_notebook("analysis.ipynb", tmp_path, env)
    assert not (tmp_path / "analysis").exists() or os.listdir(tmp_path / "analysis") == ["report"]  # no training
    stdout = run.stdout()
    assert ("ReSPO N=2 seed=0: 5 iterations, 10 updates, 5 rollout files, evaluation ['math500', 'aime25']"
            in stdout)
    assert "GRPO N=2 seed=0: 5 iterations, 10 updates, 0 rollout files, no evaluation" in stdout
    summary = json.loads((respo / "eval" / "summary.json").read_text())
    tab1 = next(md for md in run.markdown() if md.startswith("| N | Run | Step |"))
    header = table_header(tab1)
    assert sorted(header[3:-1]) == ["AIME25", "MATH-500"] and header[-1] == "Avg."
    (row,) = markdown_rows(tab1, "2")
    assert row[1] == "ReSPO N=2 seed=0" and row[2] == "5"
    macro = summary["macro_average"]
    assert row[-1] == f"{100 * macro['pass_at_1']:.1f} ± {100 * macro['se']:.1f}"
    bins = next(md for md in run.markdown() if md.startswith("**N = 2**"))
    (counts,) = markdown_rows(bins, "ReSPO N=2 seed=0 count")
    assert sum(int(c.replace(",", "")) for c in counts[1:]) == len(records)
    e3 = next(md for md in run.markdown() if md.startswith("**Tab. 5**"))
    assert "ReSPO N=2 seed=0" in e3 and "GRPO" not in e3
    report = (tmp_path / "analysis" / "report" / "report.md").read_text()
    assert "No rollout files (rollouts/iteration_*.npz): GRPO N=2 seed=0." in report
    print(f"analysis.ipynb (given runs) executed in {run.seconds:.1f} s")
