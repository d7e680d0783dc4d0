"""The limits a run can be checked against before it writes anything: positions and memory.

A response budget beyond the model's positions, or a sampler chunk whose KV cache cannot fit in all the
memory there is, would otherwise fail after warm-up (or grow for minutes first) with a half-made run
directory behind it. `check_limits` refuses both at start-up (ConfigError, one line naming the key);
it is deliberately conservative on memory — only a cache larger than the devices' whole memory is
refused, since the cache grows with the responses and most runs never reach the worst case. The cache
checked is the engine's page pool (`rollout.num_pages` / `kv_cache_bytes`, or its default of a full row
per slot), which must also hold one row of the longest prompt (the engine's own rule,
`respo_jax.sampling.scheduler`). A run
with a reference policy (`objective.kl_coef` > 0 or `log_kl_ref`) holds a second copy of the parameters,
and an asynchronous one (`rollout.async_steps` = k) k more (2k with a rollout mesh, and the reshard's
transient replicated copy on every device of both meshes), counted with the cache.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from respo_jax.models import qwen3
from respo_jax.models.qwen3.kernels import platform
from respo_jax.sampling.params import padded_prompt_length
from respo_jax.sampling.scheduler import Scheduler, engine_slots, pool_pages
from respo_jax.tpu_chips import chip_of
from respo_jax.training.async_rollouts import reshard_transient_copies
from respo_jax.training.config import ConfigError, ExperimentConfig


def kv_cache_bytes(model_cfg, rows: int, slots: int, dtype) -> int:
    """Bytes of K and V for `rows` sequences of `slots` tokens:
    [layers, rows, slots, kv_heads, head_dim] twice (`respo_jax.models.qwen3.init_cache`)."""
    per_token = model_cfg.num_hidden_layers * model_cfg.num_key_value_heads * model_cfg.head_dim
    return 2 * rows * slots * per_token * np.dtype(dtype).itemsize


def parameter_bytes(model_cfg, dtype) -> int:
    """Bytes of the model's parameters stored in `dtype`, counted from the abstract model (nothing is
    allocated)."""
    abstract = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    return count * np.dtype(dtype).itemsize


def _check_reference(config: ExperimentConfig, model_cfg, cache_bytes: int, memory_bytes: int | None,
                     trainer_devices: int = 1) -> None:
    """The parameter copies a run holds beside the policy's — the reference policy's, and an asynchronous
    run's behaviour parameters of the k batches in flight (twice with a rollout mesh of its own: the
    trainer-side snapshot and the rollout copy) plus, with a rollout mesh, the reshard's transient
    replicated copy on each of the `trainer_devices` and rollout devices (`reshard_transient_copies`)
    — and the sampler's cache together fit `memory_bytes` (None: not checked); nothing to check
    without such copies."""
    objective, steps, split = config.objective, config.rollout.async_steps, config.mesh.rollout_devices
    behaviour = steps * (2 if split else 1)
    if steps:
        behaviour += reshard_transient_copies(trainer_devices, split)
    copies = int(objective.uses_reference) + behaviour
    if memory_bytes is None or not copies:
        return
    held = copies * parameter_bytes(model_cfg, config.model.param_dtype or config.model.dtype)
    if held + cache_bytes <= memory_bytes:
        return
    if not behaviour:
        key = (f"objective.kl_coef={objective.kl_coef}" if objective.kl_coef
               else f"objective.log_kl_ref={objective.log_kl_ref}")
        raise ConfigError(
            f"{key}: the reference policy's parameters ({held / 2**30:.1f} GiB) and the sampler's KV "
            f"cache ({cache_bytes / 2**30:.1f} GiB) take more than the {memory_bytes / 2**30:.1f} GiB of "
            "memory of the devices; expected a smaller model, cache or no reference (kl_coef=0)")
    raise ConfigError(
        f"rollout.async_steps={steps}: {copies} more copies of the parameters (the batches in flight' "
        f"behaviour policies{', the reference policy' if objective.uses_reference else ''}"
        f"{', the reshard onto the rollout mesh (a whole copy per device)' if split else ''}: "
        f"{held / 2**30:.1f} GiB) and the sampler's KV cache ({cache_bytes / 2**30:.1f} GiB) take more than "
        f"the {memory_bytes / 2**30:.1f} GiB of memory of the devices; expected a smaller model, cache or "
        "async_steps")


def device_memory_bytes(devices) -> int | None:
    """The memory of `devices` in all: each accelerator's `bytes_limit`, or for a TPU that reports none
    (a topology's device compiled for ahead) its chip's HBM (`respo_jax.tpu_chips`; ValueError for a
    TPU kind the table lacks); on CPU the host's RAM (once per process). None when it cannot be told."""
    devices = list(devices)
    if devices and platform(devices) == "cpu":
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError):
            return None
        return ram * len({d.process_index for d in devices})
    total = 0
    for device in devices:
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 (backends without memory statistics raise various types)
            stats = {}
        if "bytes_limit" in stats:
            total += int(stats["bytes_limit"])
        elif device.platform == "tpu":
            total += chip_of(device.device_kind).hbm_bytes
        else:
            return None
    return total


def check_prompt_buckets(prompt_lengths, prompt_bucket: int, max_buckets: int,
                         scheme: str = "geometric") -> None:
    """The training prompts' lengths fall in at most `max_buckets` prompt buckets of `prompt_bucket`
    tokens under `scheme` (`rollout.prompt_buckets`; `rollout.max_prompt_buckets`), else a ConfigError
    naming a coarser `rollout.prompt_bucket` that fits: each bucket compiles its own programs, and
    XLA:CPU keeps every program's code mapped."""
    lengths = sorted(prompt_lengths)
    buckets = len({padded_prompt_length(n, prompt_bucket, scheme) for n in lengths})
    if buckets <= max_buckets:
        return
    fits = prompt_bucket
    while len({padded_prompt_length(n, fits, scheme) for n in lengths}) > max_buckets:
        fits += 16
    raise ConfigError(
        f"rollout.prompt_bucket={prompt_bucket}: the training prompts ({lengths[0]}-{lengths[-1]} tokens) "
        f"fall in {buckets} {scheme} prompt buckets, more than rollout.max_prompt_buckets={max_buckets} "
        "(each bucket compiles its own sampler, log pi_old and update programs, and XLA:CPU runs out of "
        f"memory mappings after a few dozen); set rollout.prompt_bucket={fits} or more"
        + (" (or rollout.prompt_buckets=geometric)" if scheme == "linear" else ""))


def check_limits(config: ExperimentConfig, model_cfg, longest_prompt: int, memory_bytes: int | None,
                 trainer_devices: int = 1, batch_shards: int = 1) -> None:
    """ConfigError (one line) when `config`'s responses cannot be generated by `model_cfg`: the longest
    prompt (`longest_prompt` tokens, unpadded, as the sampler checks it) + rollout.max_new_tokens beyond
    max_position_embeddings, or the engine's page pool (`_check_page_pool`) larger than `memory_bytes`
    (None: not checked; the memory of the trainer's `trainer_devices` and of the rollout devices), with the
    parameter copies (`_check_reference`). `batch_shards`: the engine's batch shards, each with a pool of
    its own (`sampling.scheduler.pool_pages`)."""
    r = config.rollout
    positions = getattr(model_cfg, "max_position_embeddings", None)
    if positions is not None and longest_prompt + r.max_new_tokens > positions:
        raise ConfigError(
            f"rollout.max_new_tokens={r.max_new_tokens}: the longest prompt ({longest_prompt} tokens) + "
            f"max_new_tokens = {longest_prompt + r.max_new_tokens} exceeds the model's "
            f"max_position_embeddings ({positions}); expected at most {max(positions - longest_prompt, 0)}")
    _check_page_pool(config, model_cfg, longest_prompt, memory_bytes, trainer_devices, batch_shards)


def _check_page_pool(config: ExperimentConfig, model_cfg, longest_prompt: int, memory_bytes: int | None,
                     trainer_devices: int = 1, shards: int = 1) -> None:
    """The rollout engine's page pool, sized as the engine sizes it (`scheduler.pool_pages`, for the
    rollouts' or the held-out evaluation's rows, the more of the two, one pool per batch shard): each
    shard's pool holds one row of the longest prompt and max_new_tokens (as the engine's Scheduler
    counts pages), and the shards' pools together (each device holds its own shard's) fit
    `memory_bytes` (None: not checked)."""
    r = config.rollout
    key = (f"rollout.kv_cache_bytes={r.kv_cache_bytes}" if r.kv_cache_bytes else
           f"rollout.num_pages={r.num_pages}" if r.num_pages else f"rollout.max_slots={r.max_slots}")
    engine = r.engine_config()
    rows = max(r.reuse * r.prompts_per_minibatch * r.group_size,
               config.run.eval_problems * max(1, config.run.eval_samples))  # greedy, then sampled
    slots = engine_slots(r.max_slots, rows, shards)
    try:
        num_pages = pool_pages(engine, bucket=r.padded_prompt_length(longest_prompt),
                               max_new_tokens=r.max_new_tokens, slots=slots,
                               num_layers=model_cfg.num_hidden_layers, kv_heads=model_cfg.num_key_value_heads,
                               head_dim=model_cfg.head_dim, itemsize=np.dtype(config.model.dtype).itemsize,
                               shards=shards)
        # the engine's own rule for a pool too small for one row
        Scheduler([longest_prompt], r.group_size, [r.max_new_tokens] * r.group_size,
                  max_new_tokens=r.max_new_tokens, max_slots=slots, steps_per_schedule=r.steps_per_schedule,
                  page_size=r.page_size, num_pages=num_pages, shards=shards)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None
    # every shard's pages + its scratch page
    needed = shards * (num_pages + 1) * kv_cache_bytes(model_cfg, 1, r.page_size, config.model.dtype)
    if memory_bytes is not None and needed > memory_bytes:
        total = shards * num_pages
        raise ConfigError(
            f"{key}: the rollout engine's page pool ({total} pages of {r.page_size} tokens) takes "
            f"{needed / 2**30:.1f} GiB, more than the {memory_bytes / 2**30:.1f} GiB of memory of the devices; "
            "set a smaller rollout.kv_cache_bytes (admission waits for pages; no row is cut)")
    _check_reference(config, model_cfg, needed, memory_bytes, trainer_devices)
