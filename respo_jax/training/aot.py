"""Every program of a training run compiled ahead of time for a TPU topology on any host, with the
compiler's per-chip memory report: whether a run fits a pod is learnt on a CPU, not on the pod.

A topology's devices (`jax.experimental.topologies`, from libtpu) carry the run's mesh
(`model_setup.build_mesh`); the model, the optimizer state and the batches are abstract values in the
run's shardings (`jax.eval_shape`: no weight is read or created, nothing runs); the programs are the
trainer's own (`compile_ahead.compile_bucket` per prompt bucket: the engine's init, prefill, admission,
decode widths and output, log π_old, the update step; the held-out evaluation's engine) lowered and
compiled for the topology. `ProgramReport` holds one program's per-chip bytes, its collectives and its
analytic FLOPs; `AotReport` the run's.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from respo_jax.models import qwen3
from respo_jax.sampling import SamplingParams, compile_generate
from respo_jax.sharding import ShardingRules, axis_size, optimizer_state_shardings, state_shardings
from respo_jax.tpu_chips import TpuChip, chip_of
from respo_jax.training import compile_ahead, startup
from respo_jax.training.batch import batch_sharding
from respo_jax.training.batch_layout import BatchLayout
from respo_jax.training.config import ConfigError, ExperimentConfig, derive
from respo_jax.training.model_setup import build_mesh, build_model
from respo_jax.training.placement import RowPlacer
from respo_jax.training.shapes import ShapeTracker
from respo_jax.training.step import StepShardings, run_optimizer, run_step_programs

# XLA collective op names in a compiled module's HLO text (async ones as their -start half)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")
_COLLECTIVE_LINE = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(
    sorted(COLLECTIVES, key=len, reverse=True)) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)"
                    r"\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
         "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "f8e4m3fn": 8, "f8e5m2": 8}


def topology_devices(name: str) -> list:
    """The devices of TPU topology `name` (e.g. "v5e:2x2", "v5p:2x2x2"), for a mesh to compile for;
    ConfigError naming the flag when libtpu is missing or does not know the topology."""
    try:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as err:  # noqa: BLE001 (libtpu raises RuntimeError / ValueError / XlaRuntimeError)
        raise ConfigError(f"--topology {name!r}: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}"
                          " (needs libtpu: pip install 'jax[tpu]'; topologies look like v5e:2x2, "
                          "v5p:2x2x2, v6e:2x2)") from None


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {"count", "bytes"}} of the collectives in a compiled module's HLO text: each op as written
    (one inside a loop body counted once), its bytes those of its result (the largest array of an
    async op's result tuple)."""
    found: dict[str, dict[str, int]] = {}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE_LINE.search(line)
        if not match or "-done" in line.split("=", 1)[1].split("(", 1)[0]:
            continue
        sizes = [math.prod(int(d) for d in m["dims"].split(",") if d) * _BITS[m["dtype"]] // 8
                 for m in _ARRAY.finditer(match["shape"])]
        entry = found.setdefault(match["op"], {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += max(sizes, default=0)
    return found


def matmul_params_per_token(cfg: qwen3.Qwen3Config) -> int:
    """Weights a token multiplies by on its way through the model (MoE: its `num_experts_per_tok`
    experts and the router): attention q/k/v/o, the MLP or experts of each layer, the LM head."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    total = cfg.hidden_size * cfg.vocab_size
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe and cfg.is_moe_layer(layer):
            mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
        else:
            mlp = 3 * h * cfg.intermediate_size
        total += attention + mlp
    return total


def forward_flops(cfg: qwen3.Qwen3Config, tokens: int, context: float) -> float:
    """Analytic FLOPs of a forward over `tokens` tokens attending to `context` keys each on average:
    2 per weight a token multiplies by, and 4 · layers · heads · head_dim per key (q·k and p·v)."""
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context
    return tokens * (2 * matmul_params_per_token(cfg) + attention)


@dataclasses.dataclass
class ProgramReport:
    """One compiled program, per chip: `argument_bytes`, `output_bytes`, `temp_bytes`, `code_bytes`,
    `alias_bytes` (outputs in donated arguments' buffers), `peak_bytes_per_chip` = arguments + outputs
    - aliased + temporaries + code; `collectives` ({op: {count, bytes}}); `flops` (analytic, the whole
    program over every chip; None where not modelled) and its `bound_seconds`: a lower bound on one call,
    max(FLOPs per chip / peak bf16 FLOP/s, bytes that must cross HBM per chip / HBM bandwidth)."""

    program: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    code_bytes: int
    alias_bytes: int
    peak_bytes_per_chip: int
    fits: bool
    collectives: dict
    flops: float | None
    bound_seconds: float | None
    error: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class AbstractPlacer(RowPlacer):
    """A `RowPlacer` whose batches are abstract: `jax.ShapeDtypeStruct`s in the step's batch sharding."""

    def place(self, local, count: int):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((count, *np.shape(x)[1:]), np.asarray(x).dtype,
                                                           sharding=self.sharding), local)


def _with_shardings(tree, shardings):
    """`tree` (abstract; nnx Variables or arrays) with each value a `jax.ShapeDtypeStruct` in its
    sharding of `shardings` (a prefix: one sharding per Variable or array)."""
    def one(sharding, x):
        if isinstance(x, nnx.Variable):
            value = x.get_value()
            return x.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, shardings, tree)


def without_data(config: ExperimentConfig) -> ExperimentConfig:
    """`config` with the task's data and tokenizer paths, which compiling ahead does not read, set to a
    placeholder where unset (a paper config leaves them to the user)."""
    unread = {key: "(not read ahead of time)" for key in ("data_dir", "tokenizer_dir")
              if not getattr(config.task, key)}
    return derive(config, task=unread)


class AbstractRun:
    """What `compile_ahead.compile_bucket` reads of an `RLTrainer`, built the trainer's way on `devices`
    (a topology's) but abstract: parameters and optimizer state as `jax.ShapeDtypeStruct`s in their
    shardings. The model is the declared one (`model.preset` with `model.overrides`, or a checkpoint's
    config.json; no weight is read), its vocabulary the declared one, prompts up to
    `task.max_prompt_tokens` tokens."""

    programs = None  # no program cache: every program is lowered here
    kv_pool_bytes_per_chip: int | None = None  # set by `compile_run` from the engine's compiled init

    def __init__(self, config: ExperimentConfig, devices: list):
        self.config = config = without_data(config).validate()
        r, objective = config.rollout, config.objective
        declared = startup.declared_model_config(config)
        if config.model.checkpoint_dir:  # its config.json's shapes, no weights
            fields = {f.name for f in dataclasses.fields(qwen3.Qwen3Config)} - {
                "mesh", "rules", "dtype", "param_dtype", "remat", "scan_layers"}
            overrides = {name: getattr(declared, name) for name in fields}
            config = derive(config, model={"checkpoint_dir": "", "preset": "tiny",
                                           "overrides": {**overrides, **dict(config.model.overrides)}})
        self.mesh, self.rules = build_mesh(config, devices), ShardingRules()
        eos = declared.eos_token_id if declared.eos_token_id is not None else 0
        self.tokenizer = types.SimpleNamespace(pad_id=0, eos_ids=tuple(np.atleast_1d(eos).tolist()),
                                               vocab_size=declared.vocab_size)
        model = nnx.eval_shape(lambda: build_model(config, declared.vocab_size, self.mesh, self.rules))
        self.model_config = model.config
        startup.check_mesh_fits(config, model.config, self.mesh, self.rules)
        graphdef, params = nnx.split(model)
        param_sh = state_shardings(params, self.mesh, self.rules)
        params = _with_shardings(params, param_sh)
        self.param_bytes_per_chip = bytes_per_chip(params)
        tx = run_optimizer(config)
        opt_sh = optimizer_state_shardings(tx, params, param_sh)
        self.state = types.SimpleNamespace(graphdef=graphdef, params=params,
                                           opt_state=_with_shardings(jax.eval_shape(tx.init, params), opt_sh))
        self.shardings = StepShardings(params=param_sh, opt_state=opt_sh, batch=batch_sharding(self.mesh, self.rules),
                                       replicated=NamedSharding(self.mesh, PartitionSpec()))
        self.batch_shards = axis_size(self.mesh, self.rules.mesh_axes("batch"))
        self.layout = BatchLayout(r, 0, AbstractPlacer(self.shardings.batch), self.batch_shards, 1)
        self.correction = objective.correction()
        self.engine = r.engine_config()
        self.old_logprobs_source = r.old_logprobs_source(dtype=config.model.dtype, moe=model.config.is_moe,
                                                         correction=self.correction is not None)
        self.policy_step, self.old_logprobs = run_step_programs(config, graphdef, tx, self.shardings,
                                                                self.mesh)
        lengths = range(1, config.task.max_prompt_tokens + 1)
        self.shapes = ShapeTracker(lengths, r.padded_prompt_length, compile_ahead=r.compile_ahead)

    def model(self) -> nnx.Module:
        return nnx.merge(self.state.graphdef, self.state.params)

    def sampling_params(self, seed: int) -> SamplingParams:
        from respo_jax.training.loop import RLTrainer

        return RLTrainer.sampling_params(self, seed)


def compile_run(run: AbstractRun, chip: TpuChip, prompt_buckets: list[int] | None = None,
                held_out: bool = True, on_report: Callable[[list], None] | None = None) -> list[ProgramReport]:
    """Compiles every program of `run` for its mesh's devices (`prompt_buckets`: these prompt buckets'
    programs; None: every bucket up to `task.max_prompt_tokens`), the held-out evaluation's with
    `held_out` and `run.eval_problems` > 0; each program's `ProgramReport` against `chip`, also passed
    to `on_report` (the reports so far) as it is made. A program the compiler refuses for memory is
    reported with `fits` False and the compiler's line as `error` (the rest of its bucket's engine, or
    of its bucket, is then not compiled)."""
    config, reports = run.config, []
    buckets = prompt_buckets or run.shapes.prompt_buckets()
    chips = run.mesh.devices.size

    def compile_program(prompt_len: int, prefix: str = ""):
        def compile(name: str, lowered):
            label = f"{prefix}{name}[prompt={prompt_len}]" if "[" not in name else \
                f"{prefix}{name[:-1]},prompt={prompt_len}]"
            flops = analytic_flops(run, name, prompt_len)
            try:
                compiled = lowered.compile()
            except Exception as err:  # noqa: BLE001 (XlaRuntimeError: RESOURCE_EXHAUSTED)
                message = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
                if "RESOURCE_EXHAUSTED" not in message and "exceeds" not in message:
                    raise
                reports.append(refused_report(label, message, flops))
                if on_report is not None:
                    on_report(reports)
                raise _Refused() from None
            reread = max(decode_steps(run, name) - 1, 0) * run.param_bytes_per_chip
            reports.append(program_report(label, compiled, chip, chips, flops, reread))
            if name == "engine_init" and not prefix:
                run.kv_pool_bytes_per_chip = pool_bytes_per_chip(compiled.out_info)
            if on_report is not None:
                on_report(reports)
            return compiled

        return compile

    for prompt_len in buckets:
        try:
            compile_ahead.compile_bucket(run, run.model(), prompt_len, compile_program(prompt_len))
        except _Refused:
            continue
    if held_out and config.run.eval_problems:
        prompt_len = max(buckets)
        greedy = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, temperature=0.0,
                                eos_token_ids=run.tokenizer.eos_ids)
        try:
            compile_generate(run.model(), prompt_len, config.run.eval_problems, greedy, engine=run.engine,
                             compile=compile_program(prompt_len, "held_out_"))
        except _Refused:
            pass
    return reports


def bytes_per_chip(tree) -> int:
    """Bytes of a tree of abstract sharded arrays that each chip holds, from their shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def pool_bytes_per_chip(state) -> int:
    """Bytes of an engine state's K/V page pools (`EngineState.k_pages`, `v_pages`, abstract) each chip
    holds."""
    return bytes_per_chip((state.k_pages, state.v_pages))


class _Refused(Exception):
    """A program the compiler refused for memory (already reported): the programs after it are skipped."""


def decode_steps(run: AbstractRun, name: str) -> int:
    """Tokens per slot one call of program `name` decodes (the engine's segment), 0 for other programs."""
    if not name.startswith("engine_decode"):
        return 0
    return run.config.rollout.max_new_tokens if run.engine.scheduler == "static" else run.engine.steps_per_schedule


def analytic_flops(run: AbstractRun, name: str, prompt_len: int) -> float | None:
    """Analytic FLOPs of one call of program `name` at prompt bucket `prompt_len` (`forward_flops`), over
    every chip; None for programs without matmuls worth counting (init, admission, output)."""
    cfg, r = run.model_config, run.config.rollout
    rows = r.prompts_per_minibatch * r.group_size
    seq = prompt_len + r.max_new_tokens
    if name in ("update_step", "update_step_old_logprobs", "log_pi_old"):
        forward = forward_flops(cfg, rows * seq, seq / 2)
        # forward + backward (2x the forward), + the forward again under remat
        return forward * ((4 if cfg.remat else 3) if name.startswith("update_step") else 1)
    if name.startswith("engine_decode"):
        width = int(re.search(r"width=(\d+)", name)[1])
        return forward_flops(cfg, width * decode_steps(run, name), prompt_len + r.max_new_tokens / 2)
    if name.startswith("engine_prefill"):
        count = int(re.search(r"prompts=(\d+)", name)[1])
        chunk = min(prompt_len, run.engine.prefill_chunk_size or prompt_len)
        return forward_flops(cfg, count * chunk, prompt_len / 2)
    return None


def program_report(name: str, compiled, chip: TpuChip, chips: int, flops: float | None,
                   reread_bytes: int = 0) -> ProgramReport:
    """`ProgramReport` of a compiled program (`compiled.memory_analysis()` is per chip). The bound's HBM
    term: the arguments read and the outputs written once, and `reread_bytes` more (a decode segment
    reads its parameters again at every step after the first)."""
    memory = compiled.memory_analysis()
    argument, output = int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes)
    temp, code = int(memory.temp_size_in_bytes), int(memory.generated_code_size_in_bytes)
    alias = int(memory.alias_size_in_bytes)
    peak = argument + output - alias + temp + code
    moved = argument + output + reread_bytes
    bound = max((flops or 0.0) / chips / chip.peak_bf16_flops, moved / chip.hbm_bytes_per_second)
    return ProgramReport(program=name, argument_bytes=argument, output_bytes=output, temp_bytes=temp,
                         code_bytes=code, alias_bytes=alias, peak_bytes_per_chip=peak,
                         fits=peak <= chip.hbm_bytes, collectives=collectives(compiled.as_text()),
                         flops=flops, bound_seconds=bound)


_NEEDED = re.compile(r"\((?P<size>[\d.]+)(?P<unit>[KMGT]?)\)")


def refused_report(name: str, message: str, flops: float | None) -> ProgramReport:
    """The report of a program the compiler refused for memory: what it needed (the first size the
    compiler's line names; 0 when it names none) as the peak."""
    match = _NEEDED.search(message)
    needed = 0
    if match:
        needed = int(float(match["size"]) * 1024 ** " KMGT".index(match["unit"] or " "))
    return ProgramReport(program=name, argument_bytes=0, output_bytes=0, temp_bytes=0, code_bytes=0,
                         alias_bytes=0, peak_bytes_per_chip=needed, fits=False, collectives={}, flops=flops,
                         bound_seconds=None, error=message)


def refusal_line(report: ProgramReport, chip: TpuChip, topology: str) -> str:
    """The one line that refuses a run whose program `report` does not fit a chip of `topology`."""
    needs = f"{report.peak_bytes_per_chip / 2**30:.2f} GiB a chip" if report.peak_bytes_per_chip else \
        f"more than it has ({report.error})"
    return (f"{report.program} does not fit {topology}: needs {needs}, a {chip.name} chip has "
            f"{chip.hbm_bytes / 2**30:.2f} GiB of HBM; lower rollout.max_tokens_per_microbatch (the update "
            "step's activations) or rollout.kv_cache_bytes (the engine's pool), or spread the run over more "
            "chips (mesh.*, --topology)")


def aot_report(run: AbstractRun, topology: str, reports: list[ProgramReport]) -> dict:
    """aot.json's content: the topology, its chips and their HBM, the engine's pool and how it is split,
    whether every program fits, and the programs' reports."""
    chip = chip_of(next(iter(run.mesh.devices.flat)).device_kind)
    return {
        "topology": topology,
        "chips": int(run.mesh.devices.size),
        "chip": chip.name,
        "hbm_bytes_per_chip": chip.hbm_bytes,
        "mesh": dict(run.mesh.shape),
        "kv_cache_bytes": run.config.rollout.kv_cache_bytes,
        "batch_shards": run.batch_shards,
        "kv_pool_bytes_per_chip": run.kv_pool_bytes_per_chip,
        "fits": all(r.fits for r in reports),
        "programs": [r.to_json() for r in reports],
    }
