"""Shared pieces of the 8-device checks (tests/multi_device/): meshes, the tiny dense and MoE models built
once per process on one device and on each mesh, a batch with a left-padded row, and the default sharding
rules' parameter specs written out. Every check compares a sharded computation against the same one on a
single device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from respo_jax.models import qwen3
from respo_jax.sharding import MeshConfig, make_mesh

if jax.device_count() != 8:
    raise RuntimeError(f"the multi-device checks need 8 devices, found {jax.device_count()}: run them under "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_multi_device.py does)")


FE = ("fsdp", "expert")  # the default rules' embed axes


def mesh_of(data, fsdp, tensor, expert):
    return make_mesh(MeshConfig(data, fsdp, tensor, expert))


def tiny(moe: bool, **changes) -> qwen3.Qwen3Config:
    # initializer_range 0.2: well-separated router logits, so top-k never hinges on float rounding
    changes.setdefault("scan_layers", True)  # stacked weights: the layout the spec tables name
    return qwen3.Qwen3Config.preset("tiny-moe" if moe else "tiny", initializer_range=0.2, **changes)


@functools.cache
def model_of(moe: bool, shape: tuple[int, int, int, int] | None):
    """init_model(seed 1) of the tiny dense / MoE config, on one device (shape None) or a mesh; shared by
    the checks so that each sharded program is compiled once."""
    cfg = tiny(moe)
    return qwen3.init_model(cfg if shape is None else cfg.replace(mesh=mesh_of(*shape)), 1)


def batch(cfg, b=8, s=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
    mask = np.ones((b, s), np.int32)
    mask[1, :3] = 0  # a left-padded row
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, jnp.asarray(positions, jnp.int32), jnp.asarray(mask)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def flat_params(model):
    return {".".join(map(str, path)): var[...] for path, var in nnx.to_flat_state(nnx.state(model))}


def spec_of(array) -> tuple:
    spec = tuple(array.sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


# Default-rule specs, written out (not derived from the rules): [layers, …] for stacked weights.
DENSE_SPECS = {
    "embed_tokens": ("tensor", FE),
    "norm.weight": (FE,),
    "stacks.0.layers.input_layernorm.weight": (None, FE),
    "stacks.0.layers.post_attention_layernorm.weight": (None, FE),
    "stacks.0.layers.attn.q_proj": (None, FE, "tensor", None),
    "stacks.0.layers.attn.k_proj": (None, FE, "tensor", None),
    "stacks.0.layers.attn.v_proj": (None, FE, "tensor", None),
    "stacks.0.layers.attn.o_proj": (None, "tensor", None, FE),
    "stacks.0.layers.attn.q_norm.weight": (None, None),
    "stacks.0.layers.attn.k_norm.weight": (None, None),
    "stacks.0.layers.mlp.gate_proj": (None, FE, "tensor"),
    "stacks.0.layers.mlp.up_proj": (None, FE, "tensor"),
    "stacks.0.layers.mlp.down_proj": (None, "tensor", FE),
}
MOE_SPECS = {
    **{k: v for k, v in DENSE_SPECS.items() if ".mlp." not in k},
    "lm_head": (FE, "tensor"),
    "stacks.0.layers.mlp.router": (None, FE, None),
    "stacks.0.layers.mlp.gate_proj": (None, "expert", "fsdp", "tensor"),
    "stacks.0.layers.mlp.up_proj": (None, "expert", "fsdp", "tensor"),
    "stacks.0.layers.mlp.down_proj": (None, "expert", "tensor", "fsdp"),
}
