"""The one jit wrapper of the training programs (`respo_jax.training.programs`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from respo_jax.objectives import get_objective
from respo_jax.training.programs import Program
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
