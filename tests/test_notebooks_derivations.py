"""Executes notebooks/derivations.ipynb (the walk-through of the symbolic claims and Fig. 1) with
nbclient, and checks that it is stored without outputs."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from respo_jax.symbolic import ALL_CLAIMS

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO_ROOT / "notebooks" / "derivations.ipynb"


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_notebook_is_stored_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in _code_cells(nb):
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_notebook_executes_proves_every_claim_and_draws_fig1():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(REPO_ROOT)}}
    )
    start = time.monotonic()
    client.execute()  # raises CellExecutionError on the first failing cell (a failed claim asserts)
    elapsed = time.monotonic() - start
    outputs = [out for cell in _code_cells(nb) for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    stdout = "".join(
        out.get("text", "") for out in outputs if out.output_type == "stream" and out.name == "stdout"
    )
    assert "FAILED" not in stdout
    assert stdout.count("[proved] ") == len(ALL_CLAIMS)
    assert f"{len(ALL_CLAIMS)}/{len(ALL_CLAIMS)} claims proved" in stdout
    figures = [
        out for out in outputs if out.output_type == "display_data" and "image/png" in out.get("data", {})
    ]
    assert len(figures) == 1
    # The SymPy kernels are displayed as rendered formulas.
    assert any("text/latex" in out.get("data", {}) for out in outputs if out.output_type == "display_data")
    print(f"notebook executed in {elapsed:.1f} s")
