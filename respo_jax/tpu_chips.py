"""What a TPU chip holds and how fast it computes: HBM bytes, peak bfloat16 FLOP/s and HBM bandwidth per
chip, by the device kind JAX reports, for a memory check and a step's lower bound where the device
itself says nothing (a topology's devices when compiling ahead on a CPU host report no memory).
"""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One chip: `hbm_bytes`, `peak_bf16_flops` (FLOP/s, dense bfloat16 matmul), `hbm_bytes_per_second`."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_second: float


# Google Cloud's published per-chip figures (cloud.google.com/tpu/docs/<version>, "System architecture"):
#   v4:  32 GiB HBM2, 275 TFLOP/s bf16, 1,200 GB/s  (tpu/docs/v4)
#   v5e: 16 GiB HBM2, 197 TFLOP/s bf16,   819 GB/s  (tpu/docs/v5e)
#   v5p: 95 GiB HBM2e, 459 TFLOP/s bf16, 2,765 GB/s (tpu/docs/v5p)
#   v6e: 32 GiB HBM,  918 TFLOP/s bf16, 1,640 GB/s  (tpu/docs/v6e)
CHIPS = {
    "v4": TpuChip("v4", 32 * GIB, 275e12, 1200e9),
    "v5e": TpuChip("v5e", 16 * GIB, 197e12, 819e9),
    "v5p": TpuChip("v5p", 95 * GIB, 459e12, 2765e9),
    "v6e": TpuChip("v6e", 32 * GIB, 918e12, 1640e9),
}

# `jax.Device.device_kind` of each chip (as libtpu names them) -> CHIPS key
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def chip_of(device_kind: str) -> TpuChip:
    """The chip of a TPU `device_kind`; ValueError naming the kinds known when it is none of them."""
    key = DEVICE_KINDS.get(device_kind)
    if key is None:
        raise ValueError(f"TPU device kind {device_kind!r} is not in respo_jax.tpu_chips; known: "
                         f"{sorted(DEVICE_KINDS)}")
    return CHIPS[key]
