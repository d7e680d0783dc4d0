"""The exported-program cache (`respo_jax.exported_programs`): a later launch reads a program instead of
tracing it, gets the same results as `jax.jit`, and never reads an entry written for another program."""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from respo_jax.exported_programs import EXPORTED_DIR, ProgramCache, source_fingerprint
from respo_jax.models import qwen3
from respo_jax.objectives import get_objective
from respo_jax.programs import jit_program
from respo_jax.training.step import make_policy_step

TRACES: list[str] = []  # what the functions below were traced for (tracing runs their Python)


def update(params, x, steps, *, scale):
    """(params moved, metrics): a pytree input, a donated one, a static positional and a static keyword."""
    TRACES.append("update")
    new = jax.tree.map(lambda p: p - scale * jnp.sum(x) * p, params)
    for _ in range(steps):
        new = jax.tree.map(lambda p: p * 0.5, new)
    return new, {"sum": jnp.sum(x), "parts": [jnp.max(x), None], "pair": (x * 2, jnp.min(x))}


def _args():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    return params, jnp.linspace(0.0, 1.0, 4)


def _assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _entries(directory) -> list[str]:
    path = os.path.join(directory, EXPORTED_DIR)
    return sorted(name for name in os.listdir(path) if not name.startswith(".")) if os.path.isdir(path) else []


def test_a_new_process_reads_the_program_without_tracing_and_gets_jits_results(tmp_path):
    want = jax.jit(update, static_argnums=(2,), static_argnames=("scale",))(*_args(), 2, scale=0.1)
    TRACES.clear()
    first = ProgramCache(str(tmp_path), "config A").jit(update, "update", static_argnums=(2,),
                                                        static_argnames=("scale",), donate_argnums=(0,))
    _assert_same(first(*_args(), 2, scale=0.1), want)
    _assert_same(first(*_args(), 2, scale=0.1), want)  # the same program, not traced again
    assert TRACES == ["update"] and first.entries_written == 1 and len(_entries(tmp_path)) == 1
    # A later launch: a cache of its own over the same directory and key.
    later = ProgramCache(str(tmp_path), "config A").jit(update, "update", static_argnums=(2,),
                                                        static_argnames=("scale",), donate_argnums=(0,))
    params, x = _args()
    _assert_same(later(params, x, 2, scale=0.1), want)
    assert TRACES == ["update"] and later.entries_read == 1 and later.entries_written == 0
    assert params["w"].is_deleted()  # donated, as jax.jit(..., donate_argnums=0) does
    compiled = later.lower(*_args(), 2, scale=0.1).compile()  # ahead of time: out_info as the output
    assert jax.tree.structure(compiled.out_info) == jax.tree.structure(want)


@pytest.mark.parametrize("change", ["key", "static", "keyword", "shape", "dtype"])
def test_another_program_is_traced_and_kept_apart(tmp_path, change):
    program = ProgramCache(str(tmp_path), "config A").jit(update, "update", static_argnums=(2,),
                                                          static_argnames=("scale",))
    program(*_args(), 2, scale=0.1)
    params, x = _args()
    key, steps, scale = "config A", 2, 0.1
    if change == "key":
        key = "config B"
    elif change == "static":
        steps = 3
    elif change == "keyword":
        scale = 0.2
    elif change == "shape":
        x = jnp.linspace(0.0, 1.0, 5)
    else:
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    want = jax.jit(update, static_argnums=(2,), static_argnames=("scale",))(params, x, steps, scale=scale)
    TRACES.clear()
    other = ProgramCache(str(tmp_path), key).jit(update, "update", static_argnums=(2,), static_argnames=("scale",))
    _assert_same(other(params, x, steps, scale=scale), want)
    assert TRACES == ["update"] and other.entries_read == 0 and len(_entries(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage"])
def test_a_damaged_entry_is_never_read_and_is_written_anew(tmp_path, damage):
    ProgramCache(str(tmp_path), "k").jit(update, "update", static_argnums=(2,), static_argnames=("scale",))(
        *_args(), 2, scale=0.1)
    (name,) = _entries(tmp_path)
    path = os.path.join(tmp_path, EXPORTED_DIR, name)
    data = open(path, "rb").read()
    damaged = {"truncated": data[:len(data) // 2], "garbage": b"\x00" * 64,
               "flipped": data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:]}[damage]
    open(path, "wb").write(damaged)
    want = jax.jit(update, static_argnums=(2,), static_argnames=("scale",))(*_args(), 2, scale=0.1)
    TRACES.clear()
    later = ProgramCache(str(tmp_path), "k").jit(update, "update", static_argnums=(2,), static_argnames=("scale",))
    _assert_same(later(*_args(), 2, scale=0.1), want)
    assert TRACES == ["update"] and later.entries_read == 0 and later.entries_written == 1
    third = ProgramCache(str(tmp_path), "k").jit(update, "update", static_argnums=(2,), static_argnames=("scale",))
    _assert_same(third(*_args(), 2, scale=0.1), want)
    assert third.entries_read == 1 and TRACES == ["update"]  # the entry written anew is whole


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array


def test_outputs_it_cannot_spell_out_run_without_being_kept(tmp_path):
    def pair(x):
        return Pair(x + 1, x * 2)

    program = ProgramCache(str(tmp_path), "k").jit(pair, "pair")
    out = program(jnp.arange(3.0))
    assert isinstance(out, Pair) and _entries(tmp_path) == []
    np.testing.assert_array_equal(np.asarray(out.b), [0.0, 2.0, 4.0])


def test_a_program_jax_export_refuses_runs_as_plain_jit_and_says_so(tmp_path, capsys):
    def with_callback(x):
        return jax.pure_callback(lambda v: np.asarray(v) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    program = ProgramCache(str(tmp_path), "k").jit(with_callback, "with_callback")
    np.testing.assert_array_equal(np.asarray(program(jnp.arange(3.0))), [1.0, 2.0, 3.0])
    assert _entries(tmp_path) == []
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: program 'with_callback' was not exported (")


def test_the_source_fingerprint_follows_every_file_of_the_package(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("X = 1\n")
    (package / "sub" / "b.py").write_text("Y = 2\n")
    (package / "notes.txt").write_text("not code\n")
    before = source_fingerprint(str(package))
    assert source_fingerprint(str(package)) == before
    (package / "notes.txt").write_text("still not code\n")
    assert source_fingerprint(str(package)) == before
    (package / "sub" / "b.py").write_text("Y = 3\n")
    assert source_fingerprint(str(package)) != before


_TINY = qwen3.Qwen3Config.preset("tiny", initializer_range=0.3, tie_word_embeddings=False)


def test_the_policy_step_through_the_cache_is_the_jitted_step(tmp_path):
    from test_training import _policy_setup

    graphdef, params, batch = _policy_setup(seed=3)
    tx = optax.adamw(1e-3, eps=1e-4)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    want = make_policy_step(graphdef, get_objective("respo"), tx)(copy(params), tx.init(params), batch)
    for launch in ("first", "later"):
        step = jit_program(make_policy_step(graphdef, get_objective("respo"), tx),
                           cache=ProgramCache(str(tmp_path), "tiny respo"))
        got = step(copy(params), tx.init(params), batch)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        assert (step.entries_written, step.entries_read) == ((1, 0) if launch == "first" else (0, 1))


def test_the_trainers_program_cache_is_keyed_by_its_program_shaping_config_and_model(monkeypatch):
    """`compile_ahead.program_cache`: the same key for another seed or run length, another for a changed
    program-shaping field or model config; none for an objective registered outside respo_jax."""
    from experiments.train import DEFAULT_CONFIG, load_config
    from respo_jax.training import compile_ahead
    from respo_jax.training.config import apply_overrides
    from test_compilation import TINY

    def key(*overrides: str, model=_TINY):
        config = apply_overrides(load_config(DEFAULT_CONFIG), TINY + list(overrides))
        cache = compile_ahead.program_cache(config, model)
        return None if cache is None else cache.key

    base = key()
    assert base is not None  # the test session has a compilation cache (conftest)
    assert key("run.seed=3") == key("run.iterations=7") == base
    assert key("optim.learning_rate=0.5") != base and key("rollout.temperature=0.7") != base
    assert key(model=qwen3.Qwen3Config.preset("tiny", rope_theta=5000.0)) != base
    monkeypatch.setattr(compile_ahead, "BUILTIN_OBJECTIVES", frozenset())
    assert key() is None


def test_one_name_is_one_function(tmp_path):
    cache = ProgramCache(str(tmp_path), "k")
    assert cache.jit(update, "update") is cache.jit(update, "update")
    with pytest.raises(ValueError, match="already names another function"):
        cache.jit(lambda x: x, "update")
