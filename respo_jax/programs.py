"""The one way a program is jitted (the trainer's, the evaluation's and the rollout engine's): library
code builds a `Program` (a pure function with its shardings, static and donated arguments and XLA
options) and `jit_program` jits it, always with in/out shardings on a mesh (a 1×1×1×1 mesh of one device
when the program declares none), so unit tests, CPU runs and pods compile the same wrapper, only on more
devices. A program whose arguments arrive already placed on the model's mesh and whose body fixes its
outputs' layout (the engine's, `sharding_constraint`s of the model's logical axes) declares
`FROM_ARGUMENTS`: JAX takes the shardings from the arguments.

An entry point may opt in to a `respo_jax.exported_programs.ProgramCache` (the trainer does, with a
compilation cache on one device in one process, unless `run.export_programs=false`): the traced program
is kept on disk and a relaunch reads it instead of tracing and lowering it again. Elsewhere the
persistent compilation cache alone serves a relaunch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from respo_jax.exported_programs import ProgramCache
from respo_jax.sharding import MeshConfig, make_mesh


class _FromArguments:
    """The shardings of a `Program`'s arguments or results left to JAX: those the arguments carry, those
    the body's sharding constraints give."""

    def __repr__(self) -> str:
        return "FROM_ARGUMENTS"


FROM_ARGUMENTS = _FromArguments()


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A pure function and how it is jitted: `in_shardings` (one per argument that is not static, or
    one for all) and `out_shardings` (None: everything on the one-device mesh; `FROM_ARGUMENTS`: JAX's
    choice), `static_argnums`, `donate_argnums`, XLA `compiler_options`. Called (or `.lower(...)`) like
    its `jit_program`, which is built at the first use, once: a call with new static arguments compiles,
    one with the same ones does not. Keyword arguments are passed by position, and a static argument
    left out takes its default."""

    fun: Callable
    name: str
    in_shardings: Any = None
    out_shardings: Any = None
    static_argnums: tuple[int, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    compiler_options: dict | None = None

    @functools.cached_property
    def jitted(self):
        return jit_program(self)

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self.fun)

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        last_static = max(self.static_argnums, default=-1)
        if not kwargs and len(args) > last_static:
            return args
        bound = self._signature.bind(*args, **kwargs)
        if len(bound.args) <= last_static:
            bound.apply_defaults()
        return bound.args

    def __call__(self, *args, **kwargs):
        return self.jitted(*self._positional(args, kwargs))

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*self._positional(args, kwargs))


@functools.cache
def one_device_sharding() -> NamedSharding:
    """Replicated on the 1×1×1×1 mesh of the default device: a program's sharding where it declares none."""
    return NamedSharding(make_mesh(MeshConfig(), jax.devices()[:1]), PartitionSpec())


def jit_program(program: Program, cache: ProgramCache | None = None) -> Callable:
    """`program` jitted with its shardings (`Program`); with `cache` (one process on one device, where
    the shardings are that device) its traced programs are kept there for the next launch."""
    if cache is not None and cache.usable():
        return cache.jit(program.fun, program.name, static_argnums=program.static_argnums,
                         donate_argnums=program.donate_argnums, compiler_options=program.compiler_options)
    shardings = {key: one_device_sharding() if value is None else value
                 for key, value in (("in_shardings", program.in_shardings),
                                    ("out_shardings", program.out_shardings)) if value is not FROM_ARGUMENTS}
    return jax.jit(program.fun, static_argnums=program.static_argnums, donate_argnums=program.donate_argnums,
                   compiler_options=program.compiler_options, **shardings)
