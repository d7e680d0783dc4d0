"""What a run checks before it builds or reads a model, so that a refusal costs seconds, not minutes: the
reference checkpoint, the response length against the model's positions, the sampler's memory against
the devices' and the attention kernel against the platform, and what the mesh and the MoE options need.
Each refusal is a `ConfigError` of one line naming the key to change.
"""

from __future__ import annotations

from jax.sharding import Mesh

from respo_jax.models import qwen3
from respo_jax.sharding import ShardingRules, axis_size
from respo_jax.training.config import ConfigError, ExperimentConfig
from respo_jax.training.limits import check_limits, device_memory_bytes
from respo_jax.training.model_setup import declared_model_config, rollout_devices


def check_reference_checkpoint(config: ExperimentConfig) -> None:
    """objective.reference_checkpoint, when set, holds at least one step."""
    path = config.objective.reference_checkpoint
    if path:
        from respo_jax.training.checkpoint import latest_step

        if latest_step(path) is None:
            raise ConfigError(f"objective.reference_checkpoint={path!r}: expected a checkpoints folder "
                              "holding at least one step")


def check_before_build(config: ExperimentConfig, mesh: Mesh, longest_prompt: int) -> None:
    """Response length against the model's positions and the sampler's KV cache against the memory of
    the trainer's and the rollout mesh's devices (`respo_jax.training.limits`), from the model's declared
    config alone; the engine's attention kernel against the rollout devices' platform and the model's
    head_dim (either schedule). `longest_prompt`:
    tokens of the longest training or held-out prompt."""
    model_cfg = declared_model_config(config)
    config.rollout.check_kernel(platform=qwen3.kernels.platform(rollout_devices(config) or mesh),
                                head_dim=model_cfg.head_dim)
    # The engine's batch shards: the trainer mesh's (a rollout mesh of its own: checked as one pool).
    shards = 1 if config.mesh.rollout_devices else axis_size(mesh, ShardingRules().mesh_axes("batch"))
    check_limits(config, model_cfg, longest_prompt,
                 device_memory_bytes([*mesh.devices.flat, *rollout_devices(config)]),
                 trainer_devices=mesh.devices.size, batch_shards=shards)


def check_mesh_fits(config: ExperimentConfig, model_cfg: qwen3.Qwen3Config, mesh: Mesh,
                    rules: ShardingRules) -> None:
    """What the mesh and the MoE options need of the built model, checked before any compute."""
    r, shards = config.rollout, axis_size(mesh, rules.mesh_axes("batch"))
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
