"""Per-iteration rollout files: what each response of a rollout batch did in its policy update (App. E.3).

The trainer writes one compressed ``.npz`` per iteration, ``<out_dir>/rollouts/iteration_000001.npz``
(1-based, the metrics record's "iteration"), atomically (`respo_jax.runs.atomic_write`), without pickle.
One entry per response, rows prompt-major (N·M·G rows; row r is sample r % G of prompt r // G):

  log_w      float32  clamped sequence log-weight log W that the objective saw at the update that used
                      the response (pi_theta before that update vs pi_old)
  advantage  float32  group-normalized advantage
  length     int32    response tokens, EOS included
  phi        float32  the objective's sequence coefficient (token mean of the gradient coefficient c;
                      phi(W) for ReSPO and VESPO)
  reward     float32  training reward (strict-box score + overlong penalty)
  minibatch  int32    which of the N updates used the response
  group      int32    prompt index within the rollout batch
  policy_version  int32  the policy that generated the response: the iterations it had done (t - 1 for
                      the synchronous loop's iteration t, t - 1 - k with rollout.async_steps = k); absent
                      from files written before it was recorded
  iteration, policy_updates   int64 scalars: the counters after this iteration

``load_rollout_files(run_dir)`` reads them all back, in iteration order, for the positive-branch tables
(``respo_jax.eval.positive_branch``), reports and notebooks.
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from respo_jax.runs import ROLLOUT_DIR, ROLLOUT_FILE, atomic_write, rollout_file_name
FIELDS: dict[str, type] = {
    "log_w": np.float32,
    "advantage": np.float32,
    "length": np.int32,
    "phi": np.float32,
    "reward": np.float32,
    "minibatch": np.int32,
    "group": np.int32,
}
OPTIONAL_FIELDS: dict[str, type] = {"policy_version": np.int32}
SCALARS = ("iteration", "policy_updates")


def rollout_path(out_dir: str | os.PathLike, iteration: int) -> str:
    """``<out_dir>/rollouts/iteration_<iteration:06d>.npz``."""
    return os.path.join(os.fspath(out_dir), ROLLOUT_DIR, rollout_file_name(iteration))


def _checked(rollout: Mapping, source: str) -> dict[str, np.ndarray]:
    """The rollout's arrays in their declared dtypes; ValueError naming `source` and the problem."""
    missing = [key for key in (*FIELDS, *SCALARS) if key not in rollout]
    if missing:
        raise ValueError(f"{source}: missing {missing}; a rollout file holds {list(FIELDS) + list(SCALARS)}")
    out: dict[str, np.ndarray] = {}
    rows = None
    for key, dtype in {**FIELDS, **{k: v for k, v in OPTIONAL_FIELDS.items() if k in rollout}}.items():
        value = np.asarray(rollout[key])
        if value.ndim != 1:
            raise ValueError(f"{source}: {key} must be one value per response, [rows]; got shape {value.shape}")
        if rows is None:
            rows = value.shape[0]
        elif value.shape[0] != rows:
            raise ValueError(f"{source}: {key} has {value.shape[0]} rows, log_w has {rows}")
        if np.issubdtype(dtype, np.floating):
            if not np.issubdtype(value.dtype, np.number) or not np.all(np.isfinite(value)):
                raise ValueError(f"{source}: {key} must hold finite numbers")
        elif not np.issubdtype(value.dtype, np.integer):
            raise ValueError(f"{source}: {key} must hold integers; got dtype {value.dtype}")
        out[key] = value.astype(dtype)
    for key in SCALARS:
        value = np.asarray(rollout[key])
        if value.shape != () or not np.issubdtype(value.dtype, np.integer):
            raise ValueError(f"{source}: {key} must be an integer scalar; got {value!r}")
        out[key] = value.astype(np.int64)
    if rows == 0:
        raise ValueError(f"{source}: no responses")
    if out["iteration"] < 1:
        raise ValueError(f"{source}: iteration must be >= 1 (1-based); got {int(out['iteration'])}")
    return out


def write_rollout_file(out_dir: str | os.PathLike, rollout: Mapping) -> str:
    """Writes `rollout` (the fields of the module docstring) to its iteration's file; returns the path.

    The file appears complete or not at all (`respo_jax.runs.atomic_write`), so a reader (or a crash)
    never sees a partial file.
    """
    arrays = _checked(rollout, "rollout")
    path = rollout_path(out_dir, int(arrays["iteration"]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, lambda handle: np.savez_compressed(handle, **arrays))
    return path


def read_rollout_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """One rollout file as a dict of arrays (scalars as 0-d int64 arrays)."""
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            raw = {key: data[key] for key in data.files}
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable rollout file ({err})") from None
    return _checked(raw, path)


def load_rollout_files(run_dir: str | os.PathLike) -> list[dict[str, np.ndarray]]:
    """Every rollout file of a run, in iteration order. `run_dir`: the run's out_dir or its rollouts/."""
    run_dir = os.fspath(run_dir)
    folder = os.path.join(run_dir, ROLLOUT_DIR)
    if not os.path.isdir(folder):
        folder = run_dir
    names = sorted(filter(ROLLOUT_FILE.fullmatch, os.listdir(folder))) if os.path.isdir(folder) else []
    if not names:
        raise FileNotFoundError(f"no rollout files (rollouts/iteration_*.npz) under {run_dir!r}")
    rollouts = [read_rollout_file(os.path.join(folder, name)) for name in names]
    for name, rollout in zip(names, rollouts):
        if int(ROLLOUT_FILE.fullmatch(name).group(1)) != int(rollout["iteration"]):
            raise ValueError(f"{os.path.join(folder, name)}: holds iteration {int(rollout['iteration'])}")
    return sorted(rollouts, key=lambda r: int(r["iteration"]))
