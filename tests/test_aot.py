"""Compiling a run's programs for a TPU topology on this CPU host (`python -m experiments.aot`): tiny
programs sharded on v5e:2x2, their per-chip memory reports against bytes computed from the shapes, the
MoE's ragged all-to-all, the one-line refusal of a program that does not fit, and aot.json's keys.
libtpu (the test extra) compiles them; conftest lets the suite's workers load it together."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from experiments import aot as aot_cli
from experiments.cli import load_config
from respo_jax.host_allocator import expected_platform
from respo_jax.sampling import compile_generate
from respo_jax.sampling.scheduler import pool_pages
from respo_jax.tpu_chips import CHIPS, chip_of
from respo_jax.training import aot
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.limits import device_memory_bytes
from respo_jax.training.model_setup import build_mesh


# TPU compiles (libtpu): in the full suite, not the fast path.
pytestmark = pytest.mark.slow

# The toy MoE run with arrays that fill whole TPU tiles (head_dim 128: the paper models' and the Pallas
# kernel's), so the compiler's per-chip bytes are the shapes' bytes, on v5e:2x2 with 4 expert chips.
MOE = ["model.overrides={\"hidden_size\": 128, \"intermediate_size\": 256, \"head_dim\": 128, "
       "\"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"moe_intermediate_size\": 128, "
       "\"vocab_size\": 256}", "mesh.data=1", "mesh.expert=4", "run.eval_problems=0",
       "rollout.kv_cache_bytes=16777216", "rollout.page_size=16"]
MOE_CONFIG = "experiments/configs/toy_moe.py"


def full_bytes(tree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def moe():
    """The toy MoE run's programs at its smallest prompt bucket, compiled for v5e:2x2 (one compile for
    the tests below)."""
    devices = aot.topology_devices("v5e:2x2")
    run = aot.AbstractRun(apply_overrides(load_config(MOE_CONFIG), MOE), devices)
    bucket = run.shapes.prompt_buckets()[0]
    return run, bucket, {r.program.split("[")[0]: r for r in aot.compile_run(run, CHIPS["v5e"], [bucket])}


def test_update_step_memory_report_is_the_sharded_state_and_batch(moe):
    run, _, reports = moe
    step = reports["update_step"]
    state = aot.bytes_per_chip(run.state.params) + aot.bytes_per_chip(run.state.opt_state)
    # every parameter and moment split over the 4 chips (embed dims over (fsdp, expert), experts)
    assert state < 0.3 * (full_bytes(run.state.params) + full_bytes(run.state.opt_state))
    batch_rows = run.config.rollout.prompts_per_minibatch * run.config.rollout.group_size
    assert batch_rows % 4 == 0
    # arguments: the chip's shards of the parameters, the moments and its quarter of the batch (small
    # [rows] and scalar arrays padded to a tile: at most 4 KiB each)
    leaves = len(jax.tree.leaves((run.state.params, run.state.opt_state)))
    assert state < step.argument_bytes < state + 64 * 1024 + leaves * 4096
    # parameters and moments are donated: updated in place
    assert state <= step.alias_bytes <= step.argument_bytes
    assert step.peak_bytes_per_chip == (step.argument_bytes + step.output_bytes - step.alias_bytes
                                        + step.temp_bytes + step.code_bytes)
    assert step.fits and step.collectives["all-gather"]["count"] >= 1  # the split weights are gathered
    # the MoE's tokens go to their experts' chips by ragged all-to-all (resolved for the TPU mesh)
    assert run.model_config.moe_dispatch == "ragged_all_to_all"
    assert step.collectives["ragged-all-to-all"]["count"] >= 1
    cfg = run.model_config  # every layer is MoE: top-k experts and the router per token
    per_token = 2 * (cfg.hidden_size * cfg.vocab_size + cfg.num_hidden_layers * (
        cfg.hidden_size * cfg.head_dim * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads)
        + 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
        + cfg.hidden_size * cfg.num_experts))
    assert aot.forward_flops(cfg, 10, 0) == 10 * per_token


def test_engine_programs_hold_the_pool_the_config_sizes(moe):
    run, bucket, reports = moe
    assert {"engine_init", "engine_prefill", "engine_admit", "engine_decode", "engine_finish"} <= set(reports)
    cfg, engine = run.model_config, run.engine
    shards = 4  # the pool is split over the batch axes (data, fsdp, expert): one shard per chip here
    assert run.batch_shards == shards
    pages = pool_pages(engine, bucket=bucket, max_new_tokens=run.config.rollout.max_new_tokens, slots=0,
                       num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, itemsize=np.dtype(cfg.dtype).itemsize, shards=shards)
    pool = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (pages + 1) * engine.page_size * cfg.head_dim \
        * np.dtype(cfg.dtype).itemsize
    # each chip holds its own shard's pages (the pool / batch shards), never a replica of the whole pool
    assert run.kv_pool_bytes_per_chip == pool <= engine.kv_cache_bytes // shards
    init = reports["engine_init"]
    assert pool <= init.output_bytes < pool + 256 * 1024  # the state is the pool and a few small arrays
    decode = reports["engine_decode"]
    assert decode.argument_bytes >= pool + aot.bytes_per_chip(run.state.params)
    assert decode.alias_bytes >= pool  # the state is donated
    # the bound's HBM term: arguments and outputs once, the parameters again at every further step
    params = aot.bytes_per_chip(run.state.params)
    moved = decode.argument_bytes + decode.output_bytes + (engine.steps_per_schedule - 1) * params
    assert decode.bound_seconds == pytest.approx(max(moved / CHIPS["v5e"].hbm_bytes_per_second,
                                                     decode.flops / 4 / CHIPS["v5e"].peak_bf16_flops))


def test_a_program_that_does_not_fit_is_one_line_and_the_report_is_written(tmp_path, capsys):
    out = tmp_path / "aot"
    status = aot_cli.cli(["--config", MOE_CONFIG, "--topology", "v5e:2x2", "--out", str(out),
                          "--prompt-buckets", "32", *MOE[:-2], f"rollout.kv_cache_bytes={4 * 24 * 2**30}"])  # 24 GiB a chip
    assert status == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: engine_init[prompt=32] does not fit v5e:2x2: needs ")
    assert "a v5e chip has 16.00 GiB of HBM" in line and "rollout.kv_cache_bytes" in line
    report = json.loads((out / "aot.json").read_text())
    assert {"topology", "chips", "hbm_bytes_per_chip", "kv_cache_bytes", "batch_shards",
            "kv_pool_bytes_per_chip", "fits", "programs"} <= set(report)
    assert (report["topology"], report["chips"], report["hbm_bytes_per_chip"], report["fits"],
            report["complete"]) == ("v5e:2x2", 4, 16 * 2**30, False, True)
    first = report["programs"][0]
    assert {"program", "argument_bytes", "output_bytes", "temp_bytes", "peak_bytes_per_chip", "fits",
            "collectives", "flops"} <= set(first)
    assert first["program"] == "engine_init[prompt=32]" and not first["fits"]
    assert first["peak_bytes_per_chip"] > 16 * 2**30
    assert "engine_init[prompt=32]" in (out / "aot.md").read_text()


def test_mesh_splits_a_physical_axis_only_when_asked():
    devices = aot.topology_devices("v5p:4x4x4")
    config = apply_overrides(load_config(aot_cli.DEFAULT_CONFIG), ["mesh.data=1", "mesh.fsdp=8", "mesh.expert=8"])
    with pytest.raises(ConfigError, match=r"^mesh: .*mesh.allow_split_physical_axes=true"):
        build_mesh(config, devices)
    mesh = build_mesh(apply_overrides(config, ["mesh.allow_split_physical_axes=true"]), devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 8}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


def test_tpu_memory_comes_from_the_chip_and_the_platform_from_the_devices(monkeypatch):
    devices = aot.topology_devices("v5e:2x2")
    assert device_memory_bytes(devices) == 4 * 16 * 2**30  # the topology's devices report no memory
    with pytest.raises(ValueError, match="TPU v9"):
        chip_of("TPU v9")
    monkeypatch.delenv("JAX_PLATFORMS")
    assert expected_platform() == "cpu"  # libtpu is installed; no TPU is attached
    assert jax.devices()[0].platform == "cpu"
    with pytest.raises(ConfigError, match="--topology 'v5e:3x3'"):
        aot.topology_devices("v5e:3x3")


def test_the_pallas_tpu_kernel_compiles_inside_shard_map_on_four_chips():
    """The engine's decode with the Pallas TPU kernel, sharded over 4 chips (the pool split over the batch
    axes, attention inside shard_map), compiles for v5e:2x2 and runs the kernel (a Mosaic custom call)."""
    devices = aot.topology_devices("v5e:2x2")
    run = aot.AbstractRun(apply_overrides(load_config(MOE_CONFIG), [*MOE, "rollout.paged_attention_impl=pallas_tpu"]),
                          devices)
    compiled = {}

    def keep(name, lowered):
        compiled[name] = lowered.compile()
        return compiled[name]

    r = run.config.rollout
    compile_generate(run.model(), run.shapes.prompt_buckets()[0], r.reuse * r.prompts_per_minibatch,
                     run.sampling_params(0), engine=run.engine, compile=keep)
    def kernel_calls(program) -> int:  # the paged-attention kernel's Mosaic calls (the MoE has its own)
        return sum("tpu_custom_call" in line and "paged_attention" in line for line in program.as_text().splitlines())

    decode = [program for name, program in compiled.items() if name.startswith("engine_decode")]
    assert decode and all(kernel_calls(program) >= 1 for program in decode)
    prefill = [program for name, program in compiled.items() if name.startswith("engine_prefill")]
    assert prefill and not any(kernel_calls(program) for program in prefill)  # a prefill gathers its pages
