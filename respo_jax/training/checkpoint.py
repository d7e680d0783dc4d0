"""Orbax checkpoints of a training run: parameters, optimizer state and the data position, verified.

A checkpoint must let a run resume exactly: the pytrees (params, opt_state) go through Orbax's
StandardSave, the counters and the prompt-stream position through JSON, both under one step folder.
Hours of compute depend on it, so a checkpoint is also checked on the way in and out:

- `save_checkpoint` refuses non-finite values (a diverged run must not replace good checkpoints) and a
  step Orbax would silently skip (one that already exists), and writes a manifest of SHA-256 digests of
  every file of the step once Orbax has finished it.
- `restore_checkpoint` accepts a step only if its manifest matches the files byte for byte (a bit flip
  or a save cut short by a kill is caught before Orbax reads anything), Orbax can read it, every array
  has the shape and dtype the run expects, and every value is finite.
- `restore_latest_intact` walks back from the newest step to the newest intact one, reporting each
  damaged step in one line.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from respo_jax.distributed import sync_processes
from respo_jax.files import file_sha256
from respo_jax.runs import atomic_write_bytes, read_json
from respo_jax.programs import Program, jit_program
from respo_jax.training.step import NonFiniteError, tree_all_finite
from respo_jax.training.write_errors import free_space

MANIFEST = "respo_manifest.json"  # inside each step folder, next to Orbax's own files


def _all_finite(tree) -> jax.Array:
    """`tree_all_finite(tree)` as one program (one fused reduction) on the devices its arrays are on (a
    host array's: the default device)."""
    tree = jax.tree.map(jnp.asarray, tree)
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    first = jax.tree.leaves(shardings)[0]
    scalar = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) else first
    return jit_program(Program(tree_all_finite, "all_finite", in_shardings=(shardings,),
                               out_shardings=scalar))(tree)


@dataclasses.dataclass
class TrainState:
    """What a checkpoint holds: parameters, optimizer state, counters (and the batches' position)."""

    graphdef: Any  # nnx.GraphDef
    params: Any  # nnx.State
    opt_state: object
    iteration: int = 0
    policy_updates: int = 0
    # The frozen reference policy (objective.kl_coef > 0 or log_kl_ref), on the parameters' shardings;
    # None when the run uses none (it is then neither allocated nor run).
    reference: Any = None
    # The reward's KL weight (objective.kl_in_reward; the adaptive controller's current value).
    kl_reward_coef: float = 0.0


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, or no intact checkpoint to restore; the message is one line."""


def _manager(directory: str, max_to_keep: int | None = 3) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        # Synchronous saves: the trainer waits for every save anyway, and a save that fails (a full disk)
        # then raises in the caller's thread instead of in Orbax's background threads.
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
            enable_async_checkpointing=False),
        item_names=("state", "meta"),
    )


def list_steps(directory: str) -> list[int]:
    """The steps under `directory`, oldest first (empty when there is none or no directory): the folders
    named by a step number. Orbax writes a step under a temporary name and renames it when finished;
    set-aside damaged steps are named `<step>.damaged`."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def step_dir(directory: str, step: int) -> str:
    return os.path.join(os.path.abspath(directory), str(step))


def _file_digests(folder: str) -> dict[str, str]:
    """{relative path: SHA-256} of every file under `folder` except the manifest. Files are hashed on
    several threads (hashlib releases the GIL): about 1 GB/s per core."""
    paths = {}
    for root, _, files in os.walk(folder):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST:
                paths[relative] = os.path.join(root, name)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(paths, pool.map(file_sha256, paths.values())))


def write_manifest(folder: str, step: int) -> None:
    """Writes `MANIFEST` (the SHA-256 of each file of a finished step folder) atomically."""
    manifest = {"step": step, "files": _file_digests(folder)}
    payload = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    atomic_write_bytes(os.path.join(folder, MANIFEST), payload)


def verify_files(folder: str) -> str | None:
    """None when the step folder matches its manifest; else what is wrong, in a few words."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return f"no {MANIFEST} (the save did not finish)"
    try:
        expected = read_json(path)["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MANIFEST} ({err})"
    actual = _file_digests(folder)
    for name in sorted(expected):
        if name not in actual:
            return f"file {name} is missing"
        if actual[name] != expected[name]:
            return f"file {name} does not match its SHA-256 in {MANIFEST}"
    extra = sorted(set(actual) - set(expected))
    if extra:
        return f"unexpected file {extra[0]}"
    return None


def save_checkpoint(directory: str, step: int, params, opt_state, meta: dict, reference=None,
                    behaviour=None) -> None:
    """Writes `{params, opt_state}` and the JSON-able `meta` (counters, data position) as step `step`;
    `reference` (a frozen reference policy's parameters, or None) and `behaviour` (a list of the
    parameters of an asynchronous run's rollouts in flight, or None) are written beside them.

    Raises NonFiniteError (nothing written) when a value is NaN/inf, CheckpointError when `step`
    already exists (Orbax would skip it silently) or cannot be written (a full disk, a read-only file
    system: one line naming the folder, the reason and the free space; the earlier steps are untouched,
    and the unfinished step has no manifest, so resume skips it).
    """
    state = {"params": params, "opt_state": opt_state}
    if reference is not None:
        state["reference"] = reference
    if behaviour is not None:
        state["behaviour"] = list(behaviour)
    if not bool(_all_finite(state)):
        raise NonFiniteError(f"checkpoint step {step}: parameters or optimizer state hold NaN/inf; not saved")
    earlier = list_steps(directory)
    try:
        with _manager(directory) as manager:
            saved = manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            )
            manager.wait_until_finished()
        if saved and jax.process_index() == 0:  # one writer; the step folder is shared by all processes
            write_manifest(step_dir(directory, step), step)
    except Exception as err:  # noqa: BLE001 (Orbax and TensorStore raise many types for a failed write)
        raise CheckpointError(_save_failure(directory, step, err, earlier)) from None
    if not saved:
        raise CheckpointError(f"checkpoint step {step} was not saved: {directory} already holds step "
                              f"{max(list_steps(directory), default=None)}")
    # No process goes on before the step is complete with its manifest: one that resumed from it at once
    # (or that read it for any other reason) would otherwise take it for a cut-short save.
    sync_processes(f"checkpoint step {step} written")


def _save_failure(directory: str, step: int, err: BaseException, earlier: list[int]) -> str:
    """The one line for a save of `step` that raised `err`: where, why, the free space, what is kept."""
    kept = [s for s in list_steps(directory) if s in earlier and s != step]
    keeps = (f"the earlier checkpoints (steps {kept}) are kept; make room and rerun with run.resume=true"
             if kept else "no earlier checkpoint")
    if isinstance(err, OSError):
        reason = f"{err.strerror or type(err).__name__} [errno {err.errno}]"
    else:
        reason = _first_line(err)
        for marker in ("RESOURCE_EXHAUSTED", "No space left on device", "Read-only file system"):
            if marker in str(err) and marker not in reason:
                reason = f"{marker}: {reason}"
    return (f"cannot write checkpoint step {step} to {step_dir(directory, step)}: {reason} "
            f"({free_space(directory)}); {keeps}")


def _leaf_name(path) -> str:
    return "/".join(_key_names(path))


def _key_names(path) -> tuple[str, ...]:
    """A pytree path as plain names: dict keys, attribute names and sequence indices alike (Orbax's
    metadata spells a namedtuple field or an nnx.State entry as a dict key)."""
    return tuple(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _compare_with_stored(folder: str, expected) -> str | None:
    """None when the arrays stored in a step (Orbax's metadata: names, shapes, dtypes) are exactly those
    of `expected` (`tree_flatten_with_path` of ShapeDtypeStructs); else what differs, in a few words."""
    try:
        stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(folder) / "state").tree
        stored = {_key_names(path): meta for path, meta in jax.tree_util.tree_flatten_with_path(stored)[0]}
    except Exception as err:  # noqa: BLE001
        return f"unreadable array metadata ({_first_line(err)})"
    names = {_key_names(path) for path, _ in expected}
    extra = sorted(set(stored) - names)
    if extra:
        return f"holds {'/'.join(extra[0])}, which this run's state does not have"
    for path, spec in expected:
        meta = stored.get(_key_names(path))
        if meta is None:
            return f"lacks {_leaf_name(path)}"
        if tuple(meta.shape) != tuple(spec.shape) or np.dtype(meta.dtype) != np.dtype(spec.dtype):
            return (f"{_leaf_name(path)} is {np.dtype(meta.dtype)}{list(meta.shape)}; this run expects "
                    f"{np.dtype(spec.dtype)}{list(spec.shape)}")
    return None


def restore_checkpoint(directory: str, params_like, opt_state_like, step: int | None = None,
                       reference_like=None, behaviour_like=None):
    """Restores and verifies (params, opt_state, meta) of `step` (default: the latest) onto the given
    pytree structure; with `reference_like`, (params, opt_state, meta, reference); with `behaviour_like`
    (a list), the behaviour parameters appended last.
    Raises FileNotFoundError when there is no checkpoint, CheckpointError (one line)
    when the step is damaged: files that do not match the manifest, unreadable, wrong shapes or dtypes,
    non-finite values."""
    steps = list_steps(directory)
    step = (steps[-1] if steps else None) if step is None else step
    if step is None or step not in steps:
        raise FileNotFoundError(f"no checkpoint {'' if step is None else f'step {step} '}under {directory!r}")
    where = f"checkpoint step {step} in {directory}"
    problem = verify_files(step_dir(directory, step))
    if problem:
        raise CheckpointError(f"{where} is damaged: {problem}")
    like = {"params": params_like, "opt_state": opt_state_like}
    if reference_like is not None:
        like["reference"] = reference_like
    if behaviour_like is not None:
        like["behaviour"] = list(behaviour_like)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    expected = jax.tree_util.tree_flatten_with_path(abstract)[0]
    problem = _compare_with_stored(step_dir(directory, step), expected)  # before Orbax reads any array
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(
                step_dir(directory, step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
            )
    except Exception as err:  # noqa: BLE001 (Orbax and TensorStore raise many types for a bad file)
        raise CheckpointError(f"{where} is unreadable: {_first_line(err)}") from None
    state, meta = restored["state"], restored["meta"]
    if not bool(_all_finite(state)):  # one fused reduction; name the first bad array only when needed
        for (path, _), value in zip(expected, jax.tree.leaves(state)):
            if not bool(_all_finite(value)):
                raise CheckpointError(f"{where}: {_leaf_name(path)} holds NaN/inf")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: its meta item is {type(meta).__name__}, expected a JSON object")
    result = (state["params"], state["opt_state"], meta)
    if reference_like is not None:
        result += (state["reference"],)
    if behaviour_like is not None:
        result += (state["behaviour"],)
    return result


@dataclasses.dataclass
class Restored:
    """The newest intact checkpoint and the newer, damaged steps skipped on the way to it."""

    params: Any
    opt_state: Any
    meta: dict
    step: int
    damaged: list[int]
    reference: Any = None  # the frozen reference policy, when the run keeps one
    behaviour: Any = None  # the parameters of an asynchronous run's rollouts in flight (a list)


def restore_latest_intact(directory: str, params_like, opt_state_like,
                          report: Callable[[str], None] | None = None,
                          reference_like=None, behaviour_like=None) -> Restored | None:
    """The newest intact checkpoint (with its reference policy when `reference_like` is given), or None
    when there is no checkpoint at all, or only saves cut short (`save_cut_short`: a process killed
    while writing the first one; the caller sets them aside and starts afresh). Each damaged step newer
    than it is reported (one line each) through `report` (default: stderr) and listed in `damaged`;
    CheckpointError when no step is intact and some finished step is damaged."""
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    steps = list_steps(directory)
    damaged: list[int] = []
    for step in reversed(steps):
        try:
            params, opt_state, meta, *extra = restore_checkpoint(directory, params_like, opt_state_like,
                                                                  step, reference_like, behaviour_like)
        except CheckpointError as err:
            report(f"warning: {err}; falling back to an earlier checkpoint")
            damaged.append(step)
            continue
        reference = extra.pop(0) if reference_like is not None else None
        return Restored(params, opt_state, meta, step, damaged, reference, extra[0] if extra else None)
    if any(not save_cut_short(directory, step) for step in steps):
        raise CheckpointError(f"no intact checkpoint under {directory} (steps {steps} are all damaged; "
                              "run.overwrite=true starts the run afresh)")
    return None  # no step, or only saves cut short before any finished: nothing was committed


def save_cut_short(directory: str, step: int) -> bool:
    """Step `step`'s folder lacks its manifest: its save was interrupted (the manifest is written last,
    after Orbax's rename), so the step never held a checkpoint, unlike a finished step damaged later."""
    return not os.path.isfile(os.path.join(step_dir(directory, step), MANIFEST))


def set_aside(directory: str, step: int) -> str:
    """Renames a damaged step folder to `<step>.damaged` (Orbax ignores it; a new save of the step can
    proceed) and returns the new path; the files are kept for inspection."""
    source = step_dir(directory, step)
    target = source + ".damaged"
    suffix = 1
    while os.path.exists(target):
        suffix += 1
        target = f"{source}.damaged{suffix}"
    os.replace(source, target)
    return target


def latest_step(directory: str) -> int | None:
    """The newest checkpoint step under `directory`, or None when it holds none (or does not exist)."""
    steps = list_steps(directory)
    return steps[-1] if steps else None


def restore_params(directory: str, params_like, step: int | None = None):
    """Restores only the parameters of `step` (default: the latest) onto `params_like`'s structure.

    For evaluation: the optimizer state is left on disk (never materialized). `params_like` may be
    abstract (`jax.ShapeDtypeStruct` leaves, e.g. from `nnx.eval_shape`); arrays come back in its
    dtypes and shardings. The step's files are checked against its manifest first (CheckpointError
    when damaged). Reads only: a run that is still training can be evaluated. Returns (params, meta, step).
    """
    step = latest_step(directory) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {directory!r}")
    problem = verify_files(step_dir(directory, step))
    if problem:
        raise CheckpointError(f"checkpoint step {step} in {directory} is damaged: {problem}")
    abstract = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, params_like)}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            step_dir(directory, step),
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
