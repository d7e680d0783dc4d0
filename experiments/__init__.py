"""The command-line entry points (`python -m experiments.<name>`; `experiments.cli.ENTRY_POINTS`) and the
experiment configs they read.

  cli                 the shell they share: argument parsing, config files (`load_config`), one-line errors
                      and exit codes, the entry-point registry
  train               train a policy (the default run: configs/respo_synthetic.py)
  evaluate            evaluate a checkpoint with the paper's protocol (configs/eval_paper.py)
  export              a training run's policy as a Hugging Face directory
  report              the paper's curves and tables for a set of runs
  gradient_starvation the matched sweep of objectives x N x seeds (with starvation_summary,
                      starvation_tables, starvation_figures: its summary, tables and figures)
  async_staleness     what rollout staleness does, objective by objective
  mesh_equivalence    the same run on several device meshes
  crash_suite         randomized kills of training, evaluation and sweep runs
  configs/            the config files (each says what differs from its base)
  benchmarks/         the benchmark suite (`python -m experiments.benchmarks`)
"""

import importlib.util as _util
import os as _os

from respo_jax.host_allocator import expected_platform as _expected_platform

# A CPU host with libtpu installed (the test extra: it compiles for TPU topologies, `experiments.aot`)
# and no TPU attached: JAX runs on the CPU either way, but would also start libtpu as a backend in every
# process (its warnings, ~125 MB, and a lock file on which a second such process aborts). The entry
# points keep JAX on the CPU there; a JAX_PLATFORMS set by the user wins.
if "JAX_PLATFORMS" not in _os.environ and _util.find_spec("libtpu") is not None and _expected_platform() == "cpu":
    _os.environ["JAX_PLATFORMS"] = "cpu"
