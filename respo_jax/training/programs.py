"""The one way a training program is jitted: library code builds a `Program` (a pure function with its
shardings, static and donated arguments and XLA options) and `jit_program` jits it, always with in/out
shardings on a mesh (a 1×1×1×1 mesh of one device when the program declares none), so unit tests, CPU
runs and pods compile the same wrapper, only on more devices.

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


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A pure function and how it is jitted: `in_shardings` (one per argument that is not static, or
    one for all) and `out_shardings` (None: everything on the one-device mesh), `static_argnums`,
    `donate_argnums`, XLA `compiler_options`. Called (or `.lower(...)`) like its `jit_program`, which is
    built at the first use; keyword arguments are passed by position."""

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

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        return inspect.signature(self.fun).bind(*args, **kwargs).args if kwargs else args

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
    default = one_device_sharding()
    return jax.jit(program.fun, static_argnums=program.static_argnums, donate_argnums=program.donate_argnums,
                   in_shardings=default if program.in_shardings is None else program.in_shardings,
                   out_shardings=default if program.out_shardings is None else program.out_shardings,
                   compiler_options=program.compiler_options)
