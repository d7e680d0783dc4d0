"""The second study's report regenerates from its committed cells at another checkout path: the cells
and base-model records copied (no weights) under a fresh directory, `--report-only` run from there with the
study's config, and summary.json, summary.md and every figure compared byte for byte with the committed ones.
"""

import os
import shutil

import pytest

from experiments import gradient_starvation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("experiments", "results", "gradient_starvation_v2")
OUTPUTS = ("summary.json", "summary.md", "gradient_starvation.png", "grid.png", "controls.png",
           "long_regime.png")


@pytest.mark.slow
def test_second_study_report_regenerates_from_another_checkout_path(tmp_path, monkeypatch):
    checkout = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(ROOT, RESULTS, "runs"), checkout / RESULTS / "runs",
                    ignore=shutil.ignore_patterns("*.safetensors", ".jax_cache"))
    monkeypatch.chdir(checkout)
    gradient_starvation.main(["--config", os.path.join(ROOT, "experiments", "configs",
                                                       "gradient_starvation_v2.py"), "--report-only"])
    for name in OUTPUTS:
        with open(checkout / RESULTS / name, "rb") as new, open(os.path.join(ROOT, RESULTS, name), "rb") as old:
            assert new.read() == old.read(), name
