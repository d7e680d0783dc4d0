"""The run's device mesh and its model, built from the config: the trainer's and the evaluation's.

A fresh Qwen3 from a preset or a local Hugging Face checkpoint, every parameter created (or read)
directly in its sharding on the run's (data, fsdp, tensor, expert) mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from respo_jax.models import qwen3
from respo_jax.sharding import ShardingRules, make_mesh
from respo_jax.training.config import ConfigError, ExperimentConfig


def build_mesh(config: ExperimentConfig, devices: list | None = None) -> jax.sharding.Mesh:
    """The run's (data, fsdp, tensor, expert) mesh (`config.mesh`) over `devices` (None: every device of
    every process, but the rollout mesh's, `trainer_devices`; or a TPU topology's to compile ahead);
    in a single process, explicit sizes multiplying to fewer devices use the first ones (e.g. a
    one-device run on a host with eight). ConfigError when the sizes do not fit the devices."""
    devices = trainer_devices(config, devices)
    sizes = [getattr(config.mesh, axis) for axis in ("data", "fsdp", "tensor", "expert")]
    if -1 not in sizes and math.prod(sizes) < len(devices) and jax.process_count() == 1:
        devices = devices[:math.prod(sizes)]
    config.mesh.axis_sizes(len(devices))  # a ConfigError naming the mesh keys
    try:
        return make_mesh(config.mesh.mesh_config(), devices)
    except (ValueError, NotImplementedError) as err:  # e.g. mesh axes that would split a physical axis
        raise ConfigError(f"mesh: {str(err).splitlines()[0]} (mesh.allow_split_physical_axes=true allows "
                          "splitting one)") from None


def trainer_devices(config: ExperimentConfig, devices: list | None = None) -> list:
    """The devices of the trainer's mesh: all of `devices` (None: `jax.devices()`), or those
    `mesh.rollout_devices` leaves (the first ones; ConfigError when it leaves none)."""
    devices, split = list(jax.devices() if devices is None else devices), config.mesh.rollout_devices
    if split and split >= len(devices):
        raise ConfigError(f"mesh.rollout_devices={split}: expected fewer than the {len(devices)} devices, "
                          "so the trainer keeps some")
    return devices[:len(devices) - split]


def rollout_devices(config: ExperimentConfig) -> list:
    """The devices of the rollout mesh (`mesh.rollout_devices`, the last ones); empty without a split."""
    split = config.mesh.rollout_devices
    return jax.devices()[len(jax.devices()) - split:] if split else []


def declared_model_config(config: ExperimentConfig) -> qwen3.Qwen3Config:
    """The model's config as its checkpoint (config.json) or its preset with `model.overrides` declares
    it (the keys were checked when the config was validated), read before the model is built or its
    weights read; `build_model` builds from it."""
    model = config.model
    if model.checkpoint_dir:
        try:
            return qwen3.load_config(model.checkpoint_dir)
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"model.checkpoint_dir={model.checkpoint_dir!r}: {err}") from None
    return qwen3.Qwen3Config.preset(model.preset, **model.overrides)


def build_model(config: ExperimentConfig, vocab_size: int, mesh: jax.sharding.Mesh | None = None,
                rules: ShardingRules = ShardingRules()) -> nnx.Module:
    """A fresh Qwen3 from the preset (vocabulary sized to the task's tokenizer), or a local HF checkpoint;
    both in `model.dtype` compute with `model.param_dtype` parameters, kernels chosen for the mesh's
    platform by `qwen3.resolve_config` unless `model.overrides` names them. With `mesh`, every
    parameter is created (or read) directly in its sharding by `rules`, and the model's forward runs
    under them (None: the one-device mesh)."""
    dtype = config.model.dtype
    param_dtype = config.model.param_dtype or dtype
    if config.model.checkpoint_dir:
        try:
            return qwen3.from_pretrained(config.model.checkpoint_dir, dtype=jnp.dtype(param_dtype),
                                         compute_dtype=jnp.dtype(dtype), remat=config.model.remat,
                                         scan_layers=config.model.scan_layers, mesh=mesh, rules=rules)
        except (OSError, ValueError, KeyError) as err:  # a damaged or foreign checkpoint: the user's to fix
            raise ConfigError(f"model.checkpoint_dir={config.model.checkpoint_dir!r}: {err}") from None
    model_cfg = declared_model_config(config).replace(
        vocab_size=config.model.overrides.get("vocab_size", vocab_size), remat=config.model.remat,
        scan_layers=config.model.scan_layers, dtype=dtype, param_dtype=param_dtype)
    if model_cfg.vocab_size < vocab_size:
        raise ConfigError(f"model.overrides.vocab_size={model_cfg.vocab_size}: expected at least the "
                          f"tokenizer's {vocab_size}")
    try:  # kernels the overrides leave None are chosen for the mesh's platform
        model_cfg = qwen3.resolve_config(model_cfg.replace(rules=rules), mesh)
    except ValueError as err:  # e.g. experts that do not split over mesh.expert
        raise ConfigError(f"mesh: {err}") from None
    return qwen3.init_model(model_cfg, seed=config.run.seed)


def rollout_placement(config: ExperimentConfig, model_cfg: qwen3.Qwen3Config, mesh: jax.sharding.Mesh,
                      rules: ShardingRules, graphdef: nnx.GraphDef, param_shardings) -> tuple:
    """The sampler's (mesh, model structure, parameter shardings): the trainer's (`mesh`, `graphdef`,
    `param_shardings`), or with `mesh.rollout_devices` a rollout mesh of its own (the last devices,
    `mesh.rollout_tensor` of them on its tensor axis, the rest on data) under the same `rules`."""
    devices = config.mesh.rollout_devices
    if not devices:
        return mesh, graphdef, param_shardings
    from respo_jax.sharding import MeshConfig, state_shardings

    tensor = config.mesh.rollout_tensor
    rollout_mesh = make_mesh(MeshConfig(data=devices // tensor, tensor=tensor), rollout_devices(config))
    abstract = nnx.eval_shape(lambda: qwen3.init_model(model_cfg.replace(mesh=rollout_mesh), seed=0))
    rollout_graphdef, params = nnx.split(abstract)
    return rollout_mesh, rollout_graphdef, state_shardings(params, rollout_mesh, rules)
