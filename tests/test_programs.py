"""The one jit wrapper of the trainer's, the evaluation's and the engine's programs (`respo_jax.programs`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from respo_jax.objectives import get_objective
from respo_jax.programs import FROM_ARGUMENTS, Program
from respo_jax.training.step import make_logprob_fn, make_policy_step


def _scaled(x, y, scale: int = 2):
    return {"sum": (x + y) * scale}


def test_a_program_without_shardings_runs_on_the_one_device_mesh():
    program = Program(_scaled, "scaled", static_argnums=(2,))
    compiled = program.lower(jnp.ones(3), jnp.arange(3.0), scale=3).compile()
    for sharding in [*jax.tree.leaves(compiled.input_shardings), *jax.tree.leaves(compiled.output_shardings)]:
        assert isinstance(sharding, NamedSharding)
        assert dict(sharding.mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    np.testing.assert_array_equal(program(jnp.ones(3), jnp.arange(3.0), scale=3)["sum"], [3.0, 6.0, 9.0])
    np.testing.assert_array_equal(program(jnp.ones(3), jnp.arange(3.0))["sum"], [2.0, 4.0, 6.0])
    assert program.jitted is program.jitted  # one jit per program


def test_a_program_compiles_once_per_static_argument_and_defaults_a_left_out_one():
    traces = []

    def scaled(x, scale: int = 2):
        traces.append(scale)
        return x * scale

    program = Program(scaled, "scaled", FROM_ARGUMENTS, FROM_ARGUMENTS, static_argnums=(1,))
    for args, kwargs, want in [((), {}, 2.0), ((), {"scale": 2}, 2.0), ((2,), {}, 2.0), ((3,), {}, 3.0)]:
        np.testing.assert_array_equal(program(jnp.ones(3), *args, **kwargs), np.full(3, want))
    assert traces == [2, 3]  # the default is the static argument 2: one trace for the first three calls


def test_the_engines_programs_are_programs_with_the_state_donated():
    """The rollout engine's programs go through the one wrapper: the state donated (the page pools
    written in place), the graph definition and the configuration static, the shardings the arguments'
    (placed on the model's mesh) and the body's constraints."""
    import inspect

    from respo_jax.sampling import engine, engine_state, model_step

    programs = [model_step.prefill_prompts, model_step.admit_rows, model_step.decode_segment,
                engine_state.init_state, engine._finish]
    declared = {}
    for program in programs:
        assert isinstance(program, Program)
        assert program.in_shardings is program.out_shardings is FROM_ARGUMENTS
        names = list(inspect.signature(program.fun).parameters)
        declared[program.name] = ([names[i] for i in program.static_argnums],
                                  [names[i] for i in program.donate_argnums])
    assert declared == {
        "prefill_prompts": (["graphdef", "chunk", "step"], ["state"]),
        "admit_rows": (["graphdef", "params"], ["state"]),
        "decode_segment": (["graphdef", "params", "impl", "interpret"], ["state"]),
        "init_state": (["graphdef", "layout", "pad_token_id"], []),
        "finish": (["rows", "num_samples"], []),
    }


def test_the_step_builders_return_programs_for_the_one_wrapper():
    """What the trainer, the tests and the benchmarks call is the builders' `Program`, jitted by
    `jit_program` (the numbers are tests/test_training.py's and tests/test_exported_programs.py's)."""
    from flax import nnx

    from respo_jax.models import qwen3

    graphdef = nnx.graphdef(qwen3.Qwen3ForCausalLM(qwen3.Qwen3Config.preset("tiny"), rngs=nnx.Rngs(0)))
    step = make_policy_step(graphdef, get_objective("respo"), optax.adamw(1e-3))
    logprobs = make_logprob_fn(graphdef)
    assert isinstance(step, Program) and isinstance(logprobs, Program)
    assert (step.donate_argnums, step.static_argnums, logprobs.static_argnums) == ((0, 1), (3,), (2,))
    assert step.in_shardings is None and logprobs.out_shardings is None  # the one-device mesh


# Where `jax.jit` may still be called directly, and why: below `programs` in the import graph (the
# sharded creation of parameters and optimizer state, the objectives' analysis tools, the model's own
# tests-and-notebooks helpers) and the exported-program cache `jit_program` itself opts in to. The
# rollout engine's programs go through `jit_program` like the trainer's.
JIT_ALLOWED = {
    "respo_jax/programs.py": "the one wrapper",
    "respo_jax/exported_programs.py": "the cache `jit_program` opts in to",
    "respo_jax/sharding.py": "creates parameters and optimizer state sharded; imported by programs.py",
    "respo_jax/objectives/gradient_weight.py": "an analysis tool of the leaf objectives package",
}


def _direct_jits(path: str) -> list[int]:
    """Lines of `path` naming `jax.jit` in code (a call, a decorator, `partial(jax.jit, ...)`); docstrings
    and comments do not count."""
    import ast

    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    return sorted({node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and node.attr == "jit" and isinstance(node.value, ast.Name) and node.value.id == "jax"})


def test_training_eval_and_benchmarks_jit_only_through_jit_program():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for package in ("respo_jax", "experiments/benchmarks"):
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                relative = os.path.relpath(os.path.join(folder, name), root)
                if any(relative.startswith(allowed) for allowed in JIT_ALLOWED):
                    continue
                found += [f"{relative}:{line}" for line in _direct_jits(os.path.join(root, relative))]
    assert found == [], f"jax.jit outside respo_jax.programs.jit_program: {found}"
    assert _direct_jits(os.path.join(root, "respo_jax/programs.py"))  # the scan sees a real jit
