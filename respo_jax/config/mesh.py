"""The device mesh section of a config (`mesh.*`), shared by training and evaluation."""

from __future__ import annotations

import dataclasses

from respo_jax.config.typed import ConfigError, _one_line, _require, _Section


@dataclasses.dataclass(frozen=True)
class MeshSection(_Section):
    """The device mesh of the run (`respo_jax.sharding.MeshConfig`): sizes of the axes data, fsdp,
    tensor and expert; one of them may be -1 (all devices the others leave). The default puts every
    device on `data`. Parameters, optimizer state, batches, the sampler and the KV cache are placed by
    the one logical-axis table `respo_jax.sharding.ShardingRules` on this mesh."""

    section = "mesh"
    data: int = -1  # devices on the data axis (-1: those the other axes leave)
    fsdp: int = 1  # devices on the fsdp axis (parameters and optimizer state split)
    tensor: int = 1  # devices on the tensor axis (heads, MLP and vocabulary split)
    expert: int = 1  # devices on the expert axis (MoE experts split, all-to-all dispatch)
    # Let one physical axis of a TPU torus span several mesh axes (e.g. fsdp 8 x expert 8 on v5p:4x4x4),
    # which the mesh builder otherwise refuses; the exchanges of those axes then share the torus links.
    allow_split_physical_axes: bool = False
    # Devices of a rollout mesh of their own (the last ones; the trainer's mesh takes the others), with
    # rollout.async_steps >= 1; 0 (the default): the sampler runs on the trainer's mesh.
    rollout_devices: int = 0
    # devices on the rollout mesh's tensor axis (the rest on its data axis)
    rollout_tensor: int = 1

    def validate(self) -> None:
        self._check_types()
        for name in ("data", "fsdp", "tensor", "expert"):
            self._need(name, getattr(self, name) >= 1 or getattr(self, name) == -1,
                       "an integer >= 1, or -1 (fill with the devices the other axes leave)")
        fills = [name for name in ("data", "fsdp", "tensor", "expert") if getattr(self, name) == -1]
        _require(len(fills) <= 1, "mesh", {n: getattr(self, n) for n in ("data", "fsdp", "tensor", "expert")},
                 "at most one axis set to -1")
        self._need("rollout_devices", self.rollout_devices >= 0, "an integer >= 0 (0: one mesh)")
        self._need("rollout_tensor", self.rollout_tensor >= 1 and (
            not self.rollout_devices or self.rollout_devices % self.rollout_tensor == 0),
                   "an integer >= 1 dividing mesh.rollout_devices")

    def mesh_config(self):
        from respo_jax.sharding import MeshConfig

        return MeshConfig(data=self.data, fsdp=self.fsdp, tensor=self.tensor, expert=self.expert,
                          allow_split_physical_axes=self.allow_split_physical_axes)

    def axis_sizes(self, device_count: int) -> tuple[int, int, int, int]:
        """(data, fsdp, tensor, expert) for `device_count` devices; ConfigError when they do not fit."""
        try:
            return self.mesh_config().axis_sizes(device_count)
        except ValueError as err:
            raise ConfigError(f"mesh: {_one_line(err)}") from None
