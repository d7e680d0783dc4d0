"""Named device meshes and the one table that maps logical axis names to mesh axes.

Every parameter of the model carries logical axis names as metadata (``embed``, ``heads``, ``experts``,
…; see ``respo_jax/models/qwen3/layers.py``) and every activation constraint names its axes the same
way (``batch``, ``sequence``, ``activation_embed``, …). ``ShardingRules`` is the one frozen table that
turns those names into mesh axes of a ``make_mesh`` mesh ``(data, fsdp, tensor, expert)``; nothing
else in the code base places an array on devices. A lookup that would put one mesh axis on two
dimensions of an array raises: silently replicating a dimension hides a wrong table.

Typical use (what the trainer and the loader do)::

    mesh = make_mesh(MeshConfig(data=2, expert=4))          # 8 devices: (data, fsdp, tensor, expert)
    rules = ShardingRules()                                  # or ShardingRules().replace(embed="fsdp")
    cfg = qwen3.Qwen3Config.preset("tiny-moe", mesh=mesh, rules=rules)
    model = qwen3.init_model(cfg, seed=0)                    # parameters created sharded (jit out_shardings)
    model = qwen3.from_pretrained(path, mesh=mesh, rules=rules)   # each process reads only its slices
    params = nnx.state(model)
    param_sh = state_shardings(params, mesh, rules)          # NamedSharding per parameter (a State prefix)
    opt_state = init_optimizer_state(tx, params, param_sh)   # moments sharded like their parameters
    step = jax.jit(update, in_shardings=(param_sh, optimizer_state_shardings(tx, params, param_sh), ...),
                   out_shardings=..., donate_argnums=(0, 1))
    batch_sh = rules.sharding(mesh, ("batch", "sequence"))   # inputs [batch, seq]; the batch must divide
                                                             # the product of the batch axes

The model reads the mesh and the rules from its config (``Qwen3Config.mesh`` / ``.rules``; never from a
global context; a model built without one gets the 1×1×1×1 mesh, ``qwen3.resolve_config``): its
activation constraints use them, and its MoE layers run expert parallel inside ``shard_map``
(``Qwen3Config.moe_dispatch`` picks the exchange, ``moe_impl`` the grouped matmul).

Default table (FSDP + tensor + expert parallelism, as MaxText's defaults; justification on the fields):
activations split their batch over ``(data, fsdp, expert)``; parameters split ``embed`` over
``(fsdp, expert)`` and ``heads`` / ``kv_heads`` / ``mlp`` / ``vocab`` / ``expert_mlp`` over
``tensor``; expert weights split ``experts`` over ``expert`` and their embed dimension
(``expert_embed``) over ``fsdp``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

AxisSpec = str | tuple[str, ...] | None


# --------------------------------------------------------------------------------------------- meshes


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes ``(data, fsdp, tensor, expert)``; one of them may be -1 (all devices the
    others leave). The product must equal the device count.

    data: pure data parallelism (parameters replicated); fsdp: data parallelism with parameters,
    gradients and optimizer state sharded (ZeRO-3); tensor: Megatron-style splitting of heads, MLP and
    vocabulary; expert: expert parallelism (MoE experts split, tokens exchanged by all-to-all).
    allow_split_physical_axes: let one physical axis of a TPU torus span several mesh axes (e.g. fsdp 8
    x expert 8 on a 4x4x4 slice), which `make_mesh` otherwise refuses.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    allow_split_physical_axes: bool = False

    def __post_init__(self):
        sizes = {name: getattr(self, name) for name in MESH_AXES}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool)
               or (v < 1 and v != -1)}
        if bad:
            raise ValueError(f"mesh axis sizes must be positive integers or -1 (fill); got {bad}")
        fills = [k for k, v in sizes.items() if v == -1]
        if len(fills) > 1:
            raise ValueError(f"at most one mesh axis may be -1 (fill with the remaining devices); got {fills}")

    def axis_sizes(self, device_count: int) -> tuple[int, int, int, int]:
        """The four axis sizes for ``device_count`` devices (resolving a -1), or a ValueError that says
        why the sizes do not fit."""
        sizes = [getattr(self, name) for name in MESH_AXES]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if device_count % fixed:
                raise ValueError(
                    f"mesh {self._describe()} cannot fill {device_count} devices: the fixed axes multiply "
                    f"to {fixed}, which does not divide {device_count}")
            sizes = [device_count // fixed if s == -1 else s for s in sizes]
        elif fixed != device_count:
            raise ValueError(f"mesh {self._describe()} has {fixed} devices, but {device_count} are available; "
                             "the axis sizes must multiply to the device count (or set one axis to -1)")
        return tuple(sizes)

    def _describe(self) -> str:
        return "(" + ", ".join(f"{name}={getattr(self, name)}" for name in MESH_AXES) + ")"


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes ``(data, fsdp, tensor, expert)`` over ``devices`` (default: all devices, of
    every process; or a TPU topology's, `jax.experimental.topologies`, to compile for it ahead). Axis
    types are ``Auto``: shardings are declared at jit boundaries and by logical constraints, the compiler
    propagates the rest. The devices are laid out along the physical torus (`mesh_utils`), splitting a
    physical axis over several mesh axes only with ``config.allow_split_physical_axes``."""
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    sizes = config.axis_sizes(len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if not config.allow_split_physical_axes:
        return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
    grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


# ---------------------------------------------------------------------------------------------- rules


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axes (a name, a tuple of names, or None for replicated).

    Activations:
      batch: split over every data-parallel axis, ``expert`` included — outside the MoE layers the
        expert axis is data parallelism (otherwise its devices would repeat the same attention work),
        inside them tokens are exchanged with the devices owning their experts (MaxText does the same).
      sequence: not split (no context parallelism); activation_embed: the embed dimension of
        activations, not split (tensor parallelism splits heads / mlp / vocab instead).
    Parameters:
      embed: FSDP over ``(fsdp, expert)`` (gathered for each matmul, gradients reduce-scattered);
      heads, kv_heads, mlp, vocab: tensor parallelism; head_dim, layers: not split;
      experts: expert parallelism; expert_embed: the embed dimension of expert weights, FSDP over
        ``fsdp`` (not ``expert``, which already splits their ``experts`` dimension);
      expert_mlp: tensor parallelism inside each expert.
    KV cache ([layers, batch, cache_sequence, kv_heads, head_dim]): cache_sequence not split.
    """

    batch: AxisSpec = ("data", "fsdp", "expert")
    sequence: AxisSpec = None
    activation_embed: AxisSpec = None
    vocab: AxisSpec = "tensor"
    embed: AxisSpec = ("fsdp", "expert")
    heads: AxisSpec = "tensor"
    kv_heads: AxisSpec = "tensor"
    head_dim: AxisSpec = None
    mlp: AxisSpec = "tensor"
    experts: AxisSpec = "expert"
    expert_embed: AxisSpec = "fsdp"
    expert_mlp: AxisSpec = "tensor"
    layers: AxisSpec = None
    cache_sequence: AxisSpec = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            ok = value is None or isinstance(value, (str, tuple, list))
            axes = (value,) if isinstance(value, str) else tuple(value or ()) if ok else ()
            if not ok or not all(isinstance(a, str) and a for a in axes):
                raise ValueError(f"rule {field.name!r} must name mesh axes (a string, a tuple of strings or "
                                 f"None); got {value!r}")
            if len(set(axes)) != len(axes):
                raise ValueError(f"rule {field.name!r} repeats a mesh axis: {value!r}")
            object.__setattr__(self, field.name, axes)  # normalised: always a tuple

    @classmethod
    def logical_axes(cls) -> tuple[str, ...]:
        """Every logical axis name the table knows."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: AxisSpec) -> "ShardingRules":
        unknown = sorted(set(changes) - set(self.logical_axes()))
        if unknown:
            raise KeyError(f"unknown logical axes {unknown}; known: {list(self.logical_axes())}")
        return dataclasses.replace(self, **changes)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes of one logical axis (``None``: never split)."""
        if logical is None:
            return ()
        if logical not in self.logical_axes():
            raise KeyError(f"unknown logical axis {logical!r}; known: {list(self.logical_axes())}")
        return getattr(self, logical)

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec of an array whose dimensions have these logical names. Raises if two
        dimensions would be split over the same mesh axis."""
        used: dict[str, str] = {}
        parts: list[Any] = []
        for name in logical_axes:
            axes = self.mesh_axes(name)
            for axis in axes:
                if axis in used:
                    raise ValueError(
                        f"logical axes {tuple(logical_axes)} map both {used[axis]!r} and {name!r} to mesh axis "
                        f"{axis!r}; a mesh axis can split only one dimension of an array (fix the rules)")
                used[axis] = name
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*parts)

    def sharding(self, mesh: Mesh, logical_axes: Sequence[str | None],
                 shape: Sequence[int] | None = None, what: str = "array") -> NamedSharding:
        """NamedSharding of ``logical_axes`` on ``mesh``; with ``shape``, also checks each split
        dimension divides evenly (naming ``what`` in the error)."""
        spec = self.spec(logical_axes)
        missing = sorted({a for part in spec for a in _as_tuple(part)} - set(mesh.axis_names))
        if missing:
            raise ValueError(f"rules map {tuple(logical_axes)} to mesh axes {missing}, which the mesh "
                             f"{dict(mesh.shape)} lacks; build it with respo_jax.sharding.make_mesh or "
                             "pass rules for its axes")
        if shape is not None:
            check_divisible(shape, spec, mesh, logical_axes, what)
        return NamedSharding(mesh, spec)

    def check_mesh(self, mesh: Mesh) -> None:
        """Every mesh axis this table names exists on ``mesh``, and its axis types are Auto."""
        named = {a for f in dataclasses.fields(self) for a in getattr(self, f.name)}
        missing = sorted(named - set(mesh.axis_names))
        if missing:
            raise ValueError(f"sharding rules name mesh axes {missing} that the mesh {dict(mesh.shape)} lacks; "
                             "build it with respo_jax.sharding.make_mesh or pass rules for its axes")
        if any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
            raise ValueError(f"the model needs a mesh with Auto axis types, got {mesh.axis_types}; "
                             "build it with respo_jax.sharding.make_mesh")


def _as_tuple(part) -> tuple[str, ...]:
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)


def axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
    """Number of devices along ``axes`` of ``mesh`` (1 for no axes)."""
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh, logical_axes: Sequence[str | None],
                    what: str = "array") -> None:
    """Each dimension split by ``spec`` must be a multiple of its mesh axes' size."""
    for dim, (size, part, name) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape), logical_axes)):
        parts = axis_size(mesh, _as_tuple(part))
        if size % parts:
            raise ValueError(
                f"{what}: dimension {dim} ({name!r}, size {size}) does not split evenly over mesh axes "
                f"{_as_tuple(part)} ({parts} devices); change the mesh or the rule for {name!r}")


# ------------------------------------------------------------------------------------ model state


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def variable_axes(variable: nnx.Variable, path: str = "parameter") -> tuple[str | None, ...]:
    """The logical axis names a model declared for one variable (its ``out_sharding`` metadata)."""
    axes = variable.get_metadata().get("out_sharding")
    if axes is None or len(axes) != len(variable.shape):
        raise ValueError(f"{path} of shape {tuple(variable.shape)} has no logical axis names "
                         f"(out_sharding metadata {axes!r}); declare them where the parameter is created")
    return tuple(axes)


def state_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> nnx.State:
    """NamedSharding of every variable of a model state (abstract or concrete), from its logical axis
    metadata. The result has one NamedSharding where the state has a Variable, so it is a pytree
    prefix of the state: pass it as ``in_shardings`` / ``out_shardings`` of a jit."""

    def one(path, variable):
        name = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        return rules.sharding(mesh, variable_axes(variable, name), variable.shape, what=name)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def sharded_init(create: Callable[[], nnx.Module], mesh: Mesh, rules: ShardingRules) -> nnx.Module:
    """``create()`` (an NNX module constructor call, e.g. with a seeded ``nnx.Rngs``) run under a
    jit whose ``out_shardings`` place every parameter by ``rules``: each device computes only its own
    shards, nothing is materialised whole on one device. Same values as calling ``create()`` eagerly
    (JAX's random bits do not depend on the sharding)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(create))
    shardings = state_shardings(abstract, mesh, rules)
    state = jax.jit(lambda: nnx.state(create()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def optimizer_state_shardings(tx: optax.GradientTransformation, params, param_shardings):
    """Shardings of ``tx.init(params)``: every per-parameter entry (Adam moments, …) follows its
    parameter's sharding; everything else (step counts, schedules' state) is replicated. ``params``
    may be abstract; ``param_shardings`` is ``state_shardings(params, …)``."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(tx, lambda _, sharding: sharding, abstract, param_shardings,
                                 transform_non_params=lambda _: replicated, is_leaf=_is_variable)


def init_optimizer_state(tx: optax.GradientTransformation, params, param_shardings):
    """``tx.init(params)`` created directly in ``optimizer_state_shardings``."""
    shardings = optimizer_state_shardings(tx, params, param_shardings)
    return jax.jit(tx.init, out_shardings=shardings)(params)


def bytes_per_device(tree) -> dict[jax.Device, int]:
    """Bytes of the arrays of ``tree`` held by each (addressable) device — e.g. to check how evenly a
    sharded model's parameters are spread."""
    held: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + int(np.prod(shard.data.shape)) * leaf.dtype.itemsize
    return held
