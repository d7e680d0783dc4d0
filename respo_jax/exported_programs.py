"""Traced programs kept on disk next to the compilation cache, so a relaunch neither traces nor lowers them.

Why: with the persistent compilation cache warm, a second launch still traces every program and lowers
it to StableHLO before XLA's cache can be asked for the executable, which for a large program takes
longer than reading the executable itself. A `ProgramCache` keeps
each program as a `jax.export` serialization (StableHLO bytecode in a flatbuffer, no pickle) under
`<compilation cache>/respo_jax_exported/`; a later process deserializes it and jits its `call`, whose
executable the compilation cache then serves (both launches compile the very same wrapper module).

An entry is only ever used for the program that wrote it. Its name hashes:
- the caller's `key`: what decides the program outside its arguments (the trainer passes its config's
  program-shaping sections and the model's config);
- the source of every module of the `respo_jax` package, the versions of JAX, jaxlib, Flax, Optax and
  NumPy, the JAX flags that change tracing (`TRACING_FLAGS`), the devices and the process count;
- the program's name, its static arguments and its arguments' tree structure, shapes and dtypes.
Code outside `respo_jax` that a program calls must be pinned by `key`, or the cache must not be used
(the trainer uses none with an objective registered outside the package: its code is not hashed).

Scope: one process on one device (a program's shardings are then the device itself); elsewhere
`ProgramCache.usable()` is False and the programs are plain `jax.jit`, as is a program `jax.export`
cannot serialize (a custom call without a compatibility guarantee). Entries are written to a temporary
name and renamed, so concurrent runs sharing the directory never read half a file.

An entry is verified whole before use: `MAGIC`, then the SHA-256 of every byte after it, then the
header's length, the JSON header (the output structure, `_describe`, and its tree as text) and the
serialized program. A changed byte anywhere (header or program) fails the checksum; a rebuilt output
tree must equal the tree the header declares and have the program's number of outputs, and the
program's inputs must be the arguments' shapes and dtypes. A damaged entry is ignored and written anew.
A cache that cannot be written (read-only, e.g. a cluster's pre-warmed one; full) is only read: the
program runs from its trace, and `respo_jax.compilation_cache.cache_write_failed` says so once.

Why written here: JAX's own caches are keyed by the lowered program, which is what a relaunch wants
to skip; `jax.export` is the serialization JAX keeps compatible, and this module only adds the key,
the file and the output structure (`_describe`: pytrees are rebuilt from the inputs' structures and
JSON, never unpickled).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np

from respo_jax.compilation_cache import cache_read_only, cache_write_failed
from respo_jax.runs import atomic_write_bytes

EXPORTED_DIR = "respo_jax_exported"  # in the compilation cache directory
MAGIC = b"respo_jax exported program v2\n"
# JAX flags whose value changes what tracing produces (dtypes, precision, random bits, checks).
TRACING_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                 "jax_numpy_dtype_promotion", "jax_default_prng_impl", "jax_threefry_partitionable",
                 "jax_enable_checks", "jax_debug_nans", "jax_debug_infs", "jax_disable_jit",
                 "jax_softmax_custom_jvp", "jax_use_shardy_partitioner")


def source_fingerprint(package_dir: str | None = None) -> str:
    """sha256 of every `.py` file under `package_dir` (default: the `respo_jax` package; relative paths
    and contents), the versions of the libraries a program is traced with and `TRACING_FLAGS`."""
    import flax
    import jaxlib
    import optax

    if package_dir is None:
        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(package_dir):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, package_dir).encode() + b"\0")
                with open(path, "rb") as handle:
                    digest.update(handle.read() + b"\0")
    flags = {name: str(jax.config.values[name]) for name in TRACING_FLAGS if name in jax.config.values}
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
                "optax": optax.__version__, "numpy": np.__version__}
    digest.update(json.dumps({"versions": versions, "flags": flags}, sort_keys=True).encode())
    return digest.hexdigest()


_SOURCE_FINGERPRINT: list[str] = []


def _package_fingerprint() -> str:
    if not _SOURCE_FINGERPRINT:  # the package's files are read once per process
        _SOURCE_FINGERPRINT.append(source_fingerprint())
    return _SOURCE_FINGERPRINT[0]


class ProgramCache:
    """The exported programs of one configuration: `jit(fun, ...)` returns a jitted-function look-alike
    that reads its programs from `directory/EXPORTED_DIR` or writes them there.

    `key`: a string that pins everything the programs depend on besides their arguments and the
    `respo_jax` sources (module docstring)."""

    def __init__(self, directory: str, key: str):
        self.directory = os.path.join(directory, EXPORTED_DIR)
        self.key = hashlib.sha256("\0".join((
            key, _package_fingerprint(), str(sorted({(d.platform, d.device_kind) for d in jax.devices()})),
            str(jax.process_count()))).encode()).hexdigest()
        self._functions: dict[str, ExportedProgram] = {}

    @staticmethod
    def usable() -> bool:
        """Whether this process can use exported programs: one process, one device."""
        return jax.process_count() == 1 and jax.device_count() == 1

    def jit(self, fun: Callable, name: str, *, static_argnums: Sequence[int] = (),
            static_argnames: Sequence[str] = (), donate_argnums: Sequence[int] = (),
            compiler_options: dict | None = None) -> "ExportedProgram":
        """`fun` as `jax.jit(fun, static_argnums=..., static_argnames=..., donate_argnums=...,
        compiler_options=...)` computes it (keyword arguments: static ones only), its programs kept in
        this cache under `name` (part of each entry's key). The same `name` gives the same function, so
        its programs are read once per process; another function under that name raises ValueError."""
        if name in self._functions and self._functions[name].fun is not fun:
            raise ValueError(f"ProgramCache.jit: {name!r} already names another function in this cache "
                             "(the entries of one name must come from one function)")
        if name not in self._functions:
            self._functions[name] = ExportedProgram(self, fun, name, tuple(static_argnums),
                                                    tuple(static_argnames), tuple(donate_argnums),
                                                    compiler_options)
        return self._functions[name]

    def path(self, name: str, signature: str) -> str:
        digest = hashlib.sha256(f"{self.key}\0{name}\0{signature}".encode()).hexdigest()[:48]
        return os.path.join(self.directory, f"{name}-{digest}.exported")


def _describe(tree: Any, inputs: Sequence[Any]) -> Any:
    """A JSON description of the output `tree` (placeholder leaves) from which `_rebuild` gives back its
    structure: a part structured as input i is {"input": i}; dicts (string keys), lists, tuples and None
    are spelled out; anything else raises ValueError (that program is not kept)."""
    structure = jax.tree.structure(tree)
    if structure == jax.tree.structure(0):
        return "leaf"
    for index, value in enumerate(inputs):
        if structure.num_leaves > 0 and structure == jax.tree.structure(value):
            return {"input": index}
    if tree is None:
        return {"none": True}
    if type(tree) is dict:
        if not all(isinstance(key, str) for key in tree):
            raise ValueError("an output dict with a key that is not a string")
        return {"dict": [[key, _describe(tree[key], inputs)] for key in sorted(tree)]}
    if type(tree) in (list, tuple):
        return {type(tree).__name__: [_describe(part, inputs) for part in tree]}
    raise ValueError(f"an output of type {type(tree).__name__} that cannot be described")


def _rebuild(description: Any, inputs: Sequence[Any]) -> Any:
    """A placeholder tree shaped as `description` says (`_describe`)."""
    if description == "leaf":
        return 0
    (kind, value), = description.items()
    if kind == "input":
        return inputs[value]
    if kind == "none":
        return None
    if kind == "dict":
        return {key: _rebuild(part, inputs) for key, part in value}
    parts = [_rebuild(part, inputs) for part in value]
    return parts if kind == "list" else tuple(parts)


_DIGEST = 32  # bytes of a SHA-256


def _read_entry(path: str) -> tuple[dict, bytes] | None:
    """(header, serialized program) of the entry at `path`; None when absent, torn, damaged anywhere
    (the checksum covers the header and the program) or of another format."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    start = len(MAGIC) + _DIGEST
    if not data.startswith(MAGIC) or len(data) < start + 8:
        return None
    if hashlib.sha256(data[start:]).digest() != data[len(MAGIC):start]:
        return None
    (size,) = struct.unpack("<Q", data[start:start + 8])
    try:
        header = json.loads(data[start + 8:start + 8 + size])
    except ValueError:
        return None
    if not isinstance(header, dict) or len(data) < start + 8 + size:
        return None
    return header, data[start + 8 + size:]


def _write_entry(path: str, header: dict, blob: bytes) -> None:
    """Writes the entry whole or not at all (`runs.atomic_write_bytes`: a temporary file renamed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    encoded = json.dumps(header, sort_keys=True).encode()
    body = struct.pack("<Q", len(encoded)) + encoded + blob
    atomic_write_bytes(path, MAGIC + hashlib.sha256(body).digest() + body)


def _matches(exported, out_tree, header: dict, leaves: list) -> bool:
    """Whether a read program fits its call: the rebuilt output tree is the one the header declares,
    with one leaf per program output, and the program takes the arguments' shapes and dtypes."""
    if str(out_tree) != header.get("tree") or out_tree.num_leaves != len(exported.out_avals):
        return False
    if len(exported.in_avals) != len(leaves):
        return False
    return all(tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
               for a, b in zip(exported.in_avals, map(jax.typeof, leaves)))


def _aval(x) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)  # arrays, and the ShapeDtypeStructs of a program lowered ahead
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


class ExportedProgram:
    """`ProgramCache.jit`'s function: called (or `.lower(...)`) like the `jax.jit` of `fun` it stands for.

    Each combination of static arguments and argument structure/shapes/dtypes is one program: its
    entry is read from the cache (not traced) or traced with `jax.export` and written; either way the
    program runs as `jax.jit(exported.call)` on the flattened arguments, donating the leaves of the
    donated arguments, so the compilation cache serves the same executable to both. A program whose
    outputs `_describe` cannot spell out runs from its export without being written."""

    def __init__(self, cache: ProgramCache, fun: Callable, name: str, static_argnums: tuple[int, ...],
                 static_argnames: tuple[str, ...], donate_argnums: tuple[int, ...],
                 compiler_options: dict | None):
        self.cache, self.fun, self.name = cache, fun, name
        self.static_argnums, self.static_argnames = static_argnums, static_argnames
        self.donate_argnums, self.compiler_options = donate_argnums, compiler_options
        # signature -> (jitted call of the flat leaves, output tree), or (jit of `fun`, None) where the
        # program could not be exported
        self._programs: dict[tuple, tuple[Callable, Any]] = {}
        self.entries_read = 0  # programs this process read from the cache rather than traced
        self.entries_written = 0

    def _program(self, args: tuple, kwargs: dict) -> tuple[Callable, Any, list]:
        unknown = set(kwargs) - set(self.static_argnames)
        if unknown:
            raise TypeError(f"{self.name}: keyword arguments {sorted(unknown)} are not static arguments")
        statics = (tuple(args[i] for i in self.static_argnums if i < len(args)),
                   tuple(sorted(kwargs.items())))
        positions = [i for i in range(len(args)) if i not in self.static_argnums]  # of the dynamic ones
        dynamic = tuple(args[i] for i in positions)
        leaves, treedef = jax.tree.flatten(dynamic)
        avals = tuple((aval.shape, str(aval.dtype), aval.weak_type) for aval in map(jax.typeof, leaves))
        signature = (treedef, statics, avals)
        if signature not in self._programs:
            self._programs[signature] = self._load(args, kwargs, positions, dynamic, leaves, treedef,
                                                   repr((str(treedef), repr(statics), avals)))
        call, out_tree = self._programs[signature]
        return call, out_tree, leaves

    def _load(self, args: tuple, kwargs: dict, positions: list[int], dynamic: tuple, leaves: list, treedef,
              signature: str) -> tuple[Callable, Any]:
        from jax import export

        path = self.cache.path(self.name, signature)
        exported = out_tree = None
        entry = _read_entry(path)
        if entry is not None:
            header, blob = entry
            try:
                exported = export.deserialize(bytearray(blob))
                out_tree = jax.tree.structure(_rebuild(header["outputs"], dynamic))
                if not _matches(exported, out_tree, header, leaves):
                    exported = None
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                exported = None
            self.entries_read += exported is not None
        if exported is None:
            try:
                exported, out_tree = self._export(args, kwargs, positions, dynamic, leaves, treedef, path)
            except Exception as err:  # noqa: BLE001 - e.g. a custom call jax.export cannot serialize
                # Plain jit: the program runs as it would without the cache (an error in it raises there).
                print(f"warning: program {self.name!r} was not exported ({type(err).__name__}: "
                      f"{' '.join(str(err).split())[:200]}); it runs as a plain jit and a later launch "
                      "traces it again", file=sys.stderr)
                return jax.jit(self.fun, static_argnums=self.static_argnums,
                               static_argnames=self.static_argnames, donate_argnums=self.donate_argnums,
                               compiler_options=self.compiler_options), None
        donated, position = [], 0  # the flat leaves of the donated arguments
        for index, arg in zip(positions, dynamic):
            count = len(jax.tree.leaves(arg))
            if index in self.donate_argnums:
                donated.extend(range(position, position + count))
            position += count
        call = jax.jit(exported.call, donate_argnums=tuple(donated), compiler_options=self.compiler_options)
        return call, out_tree

    def _export(self, args: tuple, kwargs: dict, positions: list[int], dynamic: tuple, leaves: list, treedef,
                path: str):
        from jax import export

        boxes: dict[str, Any] = {}

        def flat(*flat_leaves):
            full = list(args)
            for position, value in zip(positions, jax.tree.unflatten(treedef, flat_leaves)):
                full[position] = value
            out_leaves, boxes["tree"] = jax.tree.flatten(self.fun(*full, **kwargs))
            return tuple(out_leaves)

        exported = export.export(jax.jit(flat))(*map(_aval, leaves))
        out_tree = boxes["tree"]
        try:
            description = _describe(jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves), dynamic)
            described = jax.tree.structure(_rebuild(description, dynamic)) == out_tree
        except ValueError:
            described = False
        if described:
            blob = bytes(exported.serialize())
            if not cache_read_only():  # a read-only cache is never written
                try:
                    _write_entry(path, {"name": self.name, "outputs": description, "tree": str(out_tree)},
                                 blob)
                    self.entries_written += 1
                except OSError as err:  # an unwritable cache costs the next launch a trace, nothing else
                    cache_write_failed(path, err)
            # Run what the next launch will read: the same bytes, so the same executable in the cache.
            exported = export.deserialize(bytearray(blob))
        return exported, out_tree

    def __call__(self, *args, **kwargs):
        call, out_tree, leaves = self._program(args, kwargs)
        if out_tree is None:  # not exported: the plain jit of `fun`
            return call(*args, **kwargs)
        return jax.tree.unflatten(out_tree, call(*leaves))

    def lower(self, *args, **kwargs):
        """The lowering of the program for `args` (arrays or ShapeDtypeStructs): `.compile()` it ahead of
        the first call; the compiled program's `out_info` is structured as the function's output."""
        call, out_tree, leaves = self._program(args, kwargs)
        if out_tree is None:
            return call.lower(*args, **kwargs)
        return _Lowered(call.lower(*leaves), out_tree)


class _Lowered:
    def __init__(self, lowered, out_tree):
        self.lowered, self.out_tree = lowered, out_tree

    def compile(self) -> "_Compiled":
        return _Compiled(self.lowered.compile(), self.out_tree)


class _Compiled:
    def __init__(self, compiled, out_tree):
        self.compiled = compiled
        self.out_info = jax.tree.unflatten(out_tree, jax.tree.leaves(compiled.out_info))
