"""Runs a notebook of notebooks/ on a fresh kernel with nbclient, as a reader would, and collects what it
showed. Used by tests/test_notebooks.py.

The kernel runs in the repository root with this checkout first on PYTHONPATH, and the run checks that
the kernel imported *this checkout's* respo_jax (an editable install of another checkout would
otherwise shadow it). RESPO_NOTEBOOK_SIZE=small selects each notebook's test-suite size and
RESPO_NOTEBOOK_OUT a scratch directory for what it writes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
_MODULE_PROBE = 'import respo_jax as _r, experiments as _e\nprint("MODULES", _r.__file__, _e.__file__)'


def code_cells(nb) -> list:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def read_notebook(name: str):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    nbformat.validate(nb)
    return nb


@dataclasses.dataclass
class ExecutedNotebook:
    """A notebook after execution: its cells (with outputs) and how long the kernel took."""

    nb: object
    seconds: float

    @property
    def outputs(self) -> list:
        return [out for cell in code_cells(self.nb) for out in cell.outputs]

    def stdout(self) -> str:
        return "".join(out.get("text", "") for out in self.outputs
                       if out.output_type == "stream" and out.name == "stdout")

    def displayed(self, mime: str) -> list:
        """The `mime` payloads of every display_data / execute_result output, in order."""
        return [out["data"][mime] for out in self.outputs
                if out.output_type in ("display_data", "execute_result") and mime in out.get("data", {})]

    def images(self) -> list:
        return self.displayed("image/png")

    def markdown(self) -> list[str]:
        return self.displayed("text/markdown")


def execute_notebook(name: str, out_dir: Path, env: dict | None = None, timeout: int = 300) -> ExecutedNotebook:
    """Executes notebooks/<name> top to bottom on a new python3 kernel (raises on the first failing cell)."""
    nb = read_notebook(name)
    nb.cells.append(nbformat.v4.new_code_cell(_MODULE_PROBE))
    kernel_env = dict(os.environ)
    kernel_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    kernel_env.update({"RESPO_NOTEBOOK_SIZE": "small", "RESPO_NOTEBOOK_OUT": str(out_dir)})
    kernel_env.update(env or {})
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO_ROOT)}})
    start = time.monotonic()
    client.execute(env=kernel_env)
    seconds = time.monotonic() - start
    probe = nb.cells.pop()
    printed = "".join(out.get("text", "") for out in probe.outputs).split()
    assert printed[:1] == ["MODULES"], probe.outputs
    for path in printed[1:]:
        assert Path(path).resolve().is_relative_to(REPO_ROOT), f"the kernel imported {path}, not {REPO_ROOT}'s"
    errors = [out for cell in code_cells(nb) for out in cell.outputs if out.output_type == "error"]
    assert not errors, errors
    return ExecutedNotebook(nb=nb, seconds=seconds)
