"""The one place that asks which backend a model runs on: it gives a model without a mesh the
1×1×1×1 mesh over one device, and turns the kernel fields left to it (``None``) into the choice for
the mesh's platform. Entry points (``Qwen3ForCausalLM``, ``init_model``, ``from_pretrained``, the
trainer, the evaluation) call ``resolve_config`` once; below them every model runs under a mesh and
reads plain fields, so a CPU test runs the program a TPU pod runs, only smaller.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from respo_jax.sharding import MeshConfig, axis_size, make_mesh

if TYPE_CHECKING:  # the config imports nothing from here
    from respo_jax.models.qwen3.config import Qwen3Config

# The fields this module fills when a config leaves them None.
KERNEL_FIELDS = ("attention_impl", "moe_impl", "moe_dispatch", "scan_layers", "lm_head_impl",
                 "lm_head_forward_impl")


def platform(where: jax.sharding.Mesh | Sequence[jax.Device]) -> str:
    """The platform of a mesh's (or a list's) devices: ``"cpu"``, ``"gpu"`` (``"cuda"``, ``"rocm"``)
    or ``"tpu"``."""
    devices = where.devices.flat if isinstance(where, jax.sharding.Mesh) else where
    return next(iter(devices)).platform


def is_accelerator(name: str) -> bool:
    return name in ("gpu", "cuda", "rocm", "tpu")


def default_kernels(backend: str) -> dict[str, str | bool]:
    """The kernel choices for a platform (``"cpu"``, ``"gpu"``, ``"tpu"``).

    - attention_impl: ``causal_blocks`` (query blocks that skip fully masked key blocks; about half
      the score FLOPs and memory of ``dense``) everywhere.
    - moe_impl: ``ragged`` (``lax.ragged_dot``, the grouped-matmul kernel) on GPU/TPU; ``tiled`` on CPU,
      where XLA lowers ``ragged_dot`` to work and memory proportional to rows × experts.
    - moe_dispatch (expert parallelism): ``ragged_all_to_all`` on GPU/TPU (sends only the routed
      rows); ``all_to_all`` with dropless padded buffers on CPU, where XLA:CPU does not implement
      ``ragged_all_to_all``.
    - scan_layers (the layer loop, training and decoding alike): ``False`` on CPU, where the weights
      are stored per layer and the layers unrolled (a scan over stacked weights copies every layer's
      weight slice at every step: about half of a batch-1 decode step); ``True`` on GPU/TPU, where
      the scan keeps the compile time independent of the depth.
    """
    accelerated = is_accelerator(backend)
    return dict(attention_impl="causal_blocks",
                moe_impl="ragged" if accelerated else "tiled",
                moe_dispatch="ragged_all_to_all" if accelerated else "all_to_all",
                scan_layers=accelerated)


def default_lm_head_impl(platform_name: str, vocab_shards: int) -> str:
    """The log-prob head (``lm_head.chunked_token_logprobs``) for a platform and the number of devices
    the vocabulary is split over. ``token_chunks`` (whole-vocabulary logits per token chunk) on CPU,
    where it runs faster though with a larger temp buffer (docs/results/measurements.md; measured by
    experiments/benchmarks/lm_head.py), and wherever the vocabulary is
    split over devices (slicing vocabulary blocks out of the sharded weight would gather it on every device);
    ``vocab_chunks`` (vocabulary blocks with an online log-sum-exp: no [tokens, vocab] logits beyond a
    block) on an accelerator with the vocabulary whole, where memory is what the head costs."""
    return "token_chunks" if platform_name == "cpu" or vocab_shards > 1 else "vocab_chunks"


def default_lm_head_forward_impl(vocab_shards: int) -> str:
    """The log-prob head of passes that take no gradient (log π_old and the rollout entropy,
    ``Qwen3ForCausalLM.token_logprobs(..., forward_only=True)``): ``vocab_chunks`` on every platform
    with the vocabulary whole, since its forward keeps each [tokens, vocab block] of logits in the
    caches through the log-sum-exp and entropy passes and so runs 1,024-token chunks at no more memory
    than a block, where the whole-vocabulary chunks must stay at 64 tokens for memory (faster on CPU
    too: docs/results/measurements.md). ``token_chunks`` where the vocabulary is
    split over devices (``default_lm_head_impl``)."""
    return "token_chunks" if vocab_shards > 1 else "vocab_chunks"


def update_compiler_options(platform_name: str) -> dict[str, str] | None:
    """XLA options of the policy-update program (``training.step.make_policy_step``) on a platform.

    On CPU, YNNPACK takes only the update's matmuls, not its elementwise and reduce fusions: the LM
    head's log-sum-exp over [tokens, vocab] logits runs an order of magnitude slower as a YNNPACK reduce
    fusion than as XLA's own loop fusion (docs/results/measurements.md). Only this program:
    process-wide, the same setting slowed the sampler and the log π_old pass. None (the
    compiler's defaults) elsewhere."""
    if platform_name == "cpu":
        return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
    return None


@functools.cache
def _one_device_mesh(device: jax.Device) -> jax.sharding.Mesh:
    return make_mesh(MeshConfig(data=1), [device])


def default_mesh() -> jax.sharding.Mesh:
    """The mesh of a model nobody placed: 1×1×1×1 over JAX's first device."""
    return _one_device_mesh(jax.devices()[0])


def resolve_config(cfg: "Qwen3Config", mesh: jax.sharding.Mesh | None = None) -> "Qwen3Config":
    """``cfg`` with a mesh (``mesh``, else its own, else ``default_mesh()``) and every kernel field it
    leaves None set to ``default_kernels`` of that mesh's platform (``lm_head_impl``:
    ``default_lm_head_impl`` of the platform and the vocabulary's shards under ``cfg.rules``;
    ``lm_head_forward_impl``: ``default_lm_head_forward_impl``); explicit fields are kept. A
    resolved config comes back unchanged."""
    mesh = mesh if mesh is not None else cfg.mesh if cfg.mesh is not None else default_mesh()
    unset = [name for name in KERNEL_FIELDS if getattr(cfg, name) is None]
    if mesh is cfg.mesh and not unset:
        return cfg
    vocab_shards = axis_size(mesh, cfg.rules.vocab)
    defaults = dict(default_kernels(platform(mesh)),
                    lm_head_impl=default_lm_head_impl(platform(mesh), vocab_shards),
                    lm_head_forward_impl=default_lm_head_forward_impl(vocab_shards))
    return cfg.replace(mesh=mesh, **{name: defaults[name] for name in unset})
