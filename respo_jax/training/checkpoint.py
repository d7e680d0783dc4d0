"""Orbax checkpoints of a training run: parameters, optimizer state and the data position.

A checkpoint must let a run resume exactly: the pytrees (params, opt_state) go through Orbax's
StandardSave, the counters and the prompt-stream position through JSON, both under one step folder.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def _manager(directory: str, max_to_keep: int | None = 3) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "meta"),
    )


def save_checkpoint(directory: str, step: int, params, opt_state, meta: dict) -> None:
    """Writes `{params, opt_state}` and the JSON-able `meta` (counters, data position) as step `step`."""
    with _manager(directory) as manager:
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                meta=ocp.args.JsonSave(meta),
            ),
        )
        manager.wait_until_finished()


def restore_checkpoint(directory: str, params_like, opt_state_like, step: int | None = None):
    """Restores (params, opt_state, meta) of `step` (default: the latest) onto the given pytree structure."""
    with _manager(directory) as manager:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {directory!r}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params_like, "opt_state": opt_state_like})
        restored = manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
        )
    return restored["state"]["params"], restored["state"]["opt_state"], restored["meta"]


def latest_step(directory: str) -> int | None:
    """The newest checkpoint step under `directory`, or None when it holds none (or does not exist)."""
    if not os.path.isdir(directory):
        return None
    with ocp.CheckpointManager(os.path.abspath(directory), item_names=("state", "meta")) as manager:
        return manager.latest_step()


def restore_params(directory: str, params_like, step: int | None = None):
    """Restores only the parameters of `step` (default: the latest) onto `params_like`'s structure.

    For evaluation: the optimizer state is left on disk (never materialized). `params_like` may be
    abstract (`jax.ShapeDtypeStruct` leaves, e.g. from `nnx.eval_shape`); arrays come back in its
    dtypes and shardings. Returns (params, meta, step).
    """
    step = latest_step(directory) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {directory!r}")
    abstract = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params_like)}
    with _manager(directory) as manager:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    abstract,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=True,
                ),
                meta=ocp.args.JsonRestore(),
            ),
        )
    return restored["state"]["params"], restored["meta"], step
