"""What a run checks before it builds or reads a model, so that a refusal costs seconds, not minutes: the
reference checkpoint, the response length against the model's positions, the sampler's memory against
the devices' and the attention kernel against the platform, and what the mesh and the MoE options need.
Each refusal is a `ConfigError` of one line naming the key to change.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import Mesh

from respo_jax.models import qwen3
from respo_jax.models.qwen3.paged_attention import check_paged_attention_impl
from respo_jax.sharding import ShardingRules
from respo_jax.training.config import ConfigError, ExperimentConfig
from respo_jax.training.limits import check_limits, device_memory_bytes
from respo_jax.training.model_setup import rollout_devices


def batch_shards(mesh: Mesh, rules: ShardingRules) -> int:
    """Devices a batch's rows are split over (the "batch" rule's mesh axes)."""
    return math.prod(mesh.shape[a] for a in rules.mesh_axes("batch"))


def check_reference_checkpoint(config: ExperimentConfig) -> None:
    """objective.reference_checkpoint, when set, holds at least one step."""
    path = config.objective.reference_checkpoint
    if path:
        from respo_jax.training.checkpoint import latest_step

        if latest_step(path) is None:
            raise ConfigError(f"objective.reference_checkpoint={path!r}: expected a checkpoints folder "
                              "holding at least one step")


def declared_model_config(config: ExperimentConfig) -> qwen3.Qwen3Config:
    """The model's config as its checkpoint (config.json) or its preset with `model.overrides` declares
    it, read before the model is built or its weights read."""
    model = config.model
    if model.checkpoint_dir:
        try:
            return qwen3.load_config(model.checkpoint_dir)
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"model.checkpoint_dir={model.checkpoint_dir!r}: {err}") from None
    fields = {f.name for f in dataclasses.fields(qwen3.Qwen3Config)}
    return qwen3.Qwen3Config.preset(model.preset, **{k: v for k, v in model.overrides.items() if k in fields})


def check_before_build(config: ExperimentConfig, mesh: Mesh, longest_prompt: int) -> None:
    """Response length against the model's positions and the sampler's KV cache against the memory of
    the trainer's and the rollout mesh's devices (`respo_jax.training.limits`), from the model's declared
    config alone; the continuous engine's attention kernel against the mesh's platform. `longest_prompt`:
    tokens of the longest training or held-out prompt."""
    r = config.rollout
    if r.scheduler == "continuous":
        try:
            check_paged_attention_impl(r.paged_attention_impl, qwen3.kernels.platform(mesh))
        except ValueError as err:
            raise ConfigError(f"rollout.paged_attention_impl={r.paged_attention_impl!r}: {err}") from None
    # The engine's batch shards: the trainer mesh's (a rollout mesh of its own: checked as one pool).
    shards = 1 if config.mesh.rollout_devices else batch_shards(mesh, ShardingRules())
    check_limits(config, declared_model_config(config), longest_prompt,
                 device_memory_bytes([*mesh.devices.flat, *rollout_devices(config)]),
                 trainer_devices=mesh.devices.size, batch_shards=shards)


def check_mesh_fits(config: ExperimentConfig, model_cfg: qwen3.Qwen3Config, mesh: Mesh,
                    rules: ShardingRules) -> None:
    """What the mesh and the MoE options need of the built model, checked before any compute."""
    r, shards = config.rollout, batch_shards(mesh, rules)
    if (r.routing_replay or config.objective.load_balancing_weight) and not model_cfg.is_moe:
        key = "rollout.routing_replay" if r.routing_replay else "objective.load_balancing_weight"
        raise ConfigError(f"{key}: needs an MoE model (num_experts > 0); the model is dense")
    sizes = {"rollout.prompts_per_minibatch * rollout.group_size": r.prompts_per_minibatch * r.group_size}
    if config.warmup.steps:
        sizes["warmup.batch_size"] = config.warmup.batch_size
    for key, rows in sizes.items():
        if rows % shards:
            raise ConfigError(f"{key}={rows}: expected a multiple of the {shards} devices the batch is "
                              f"split over (mesh axes {rules.mesh_axes('batch')} of {dict(mesh.shape)})")
