"""Accelerator mode (GPU/TPU): the paper's Qwen3-1.7B shapes in bfloat16, against the device's own
measured limits.

- Train step: the trainer's jitted ReSPO step; MFU = model FLOPs (roofline) / time / measured bf16
  matmul peak.
- Decode: the sampler's generated-token time, from two `generate` calls of different lengths (their
  difference cancels the prefill); bandwidth utilization = the bytes a decode step must read (weights +
  KV cache, `roofline.decode_step_bytes`) / step time / measured copy bandwidth.

Nothing here is compared with PyTorch (the installed torch is CPU-only). The same code runs on CPU with
a small preset, which is how the smoke test keeps it working without an accelerator.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import matmul_peak, roofline, train_step
from experiments.benchmarks.common import alternate, median, summarize
from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams, generate
from respo_jax.programs import Program


def measured_bandwidth_gbs(megabytes: int = 1024, rounds: int = 5) -> float:
    """Device memory bandwidth of an elementwise copy-scale (reads and writes every byte once), GB/s."""
    n = megabytes * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    scale = Program(lambda a: a * 1.0001, "copy_scale")
    times = alternate({"copy": lambda: scale(x).block_until_ready()}, rounds=rounds, warmup=1)["copy"]
    return 2 * n * 4 / median(times) / 1e9


def decode_point(model, batch: int, prompt_len: int, new_tokens: tuple[int, int], peak_bw_gbs: float,
                 rounds: int = 3) -> dict:
    """Per-token decode time at `batch` rows from generate(short) vs generate(long) (same prompts)."""
    cfg = model.config
    rng = np.random.default_rng(batch)
    prompts = rng.integers(1, cfg.vocab_size, size=(batch, prompt_len)).tolist()
    short, long = new_tokens
    engine = EngineConfig()

    def gen(n):
        out = generate(model, prompts, SamplingParams(max_new_tokens=n, temperature=1.0, seed=0), engine=engine)
        jax.block_until_ready(out.tokens)

    times = alternate({"short": lambda: gen(short), "long": lambda: gen(long)}, rounds=rounds, warmup=1)
    step_s = max((median(times["long"]) - median(times["short"])) / (long - short), 1e-9)
    context = prompt_len + (short + long) // 2
    cache_bytes = jnp.dtype(cfg.dtype).itemsize  # the sampler's KV cache is in the compute dtype
    step_bytes = roofline.decode_step_bytes(cfg, batch, context, jnp.dtype(cfg.param_dtype).itemsize, cache_bytes)
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": list(new_tokens),
            "short": summarize(times["short"]), "long": summarize(times["long"]),
            "decode_step_s": step_s, "tokens_per_s": batch / step_s,
            "step_bytes": step_bytes, "achieved_gbs": step_bytes / step_s / 1e9,
            "bandwidth_utilization": step_bytes / step_s / 1e9 / peak_bw_gbs}


def run(preset: str = "qwen3-1.7b", batch: int = 8, seq: int = 2048, decode_batches=(1, 32),
        prompt_len: int = 128, new_tokens: tuple[int, int] = (64, 320), matmul_sizes=matmul_peak.ACCELERATOR_SIZES,
        bandwidth_mb: int = 2048, rounds: int = 3, remat: bool = False, dtype: str = "bfloat16") -> dict:
    """Train-step MFU and decode bandwidth utilization of `preset` on the default JAX device."""
    started = time.perf_counter()
    cfg = qwen3.resolve_config(qwen3.Qwen3Config.preset(preset, dtype=dtype, param_dtype=dtype, remat=remat))
    peak = matmul_peak.run(matmul_sizes, rounds=rounds, dtype=dtype, with_numpy=False)
    bandwidth = measured_bandwidth_gbs(bandwidth_mb, rounds=rounds)
    case = train_step.TrainCase(preset, cfg, batch=batch, seq=seq, prompt_len=max(1, seq // 8))
    model = qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    call, _ = train_step.jax_side(model, train_step.make_batch(case))
    times = alternate({"step": call}, rounds=rounds, warmup=1)["step"]
    flops = roofline.train_step_flops(cfg, batch, seq)
    step = summarize(times, batch * seq)
    step["gflops"] = flops["total"] / step["median_s"] / 1e9
    decode = [decode_point(model, b, prompt_len, new_tokens, bandwidth, rounds=rounds) for b in decode_batches]
    return {"device": str(jax.devices()[0]), "backend": jax.default_backend(), "preset": preset, "dtype": dtype,
            "remat": remat, "matmul": peak, "matmul_peak_gflops": peak["xla_matmul_peak_gflops"],
            "bandwidth_gbs": bandwidth, "train": {"batch": batch, "seq": seq, "flops": flops, "jax": step},
            "mfu": step["gflops"] / peak["xla_matmul_peak_gflops"], "decode": decode,
            "wall_s": time.perf_counter() - started}


def markdown(result: dict) -> str:
    from experiments.benchmarks.common import markdown_table

    train = result["train"]
    head = markdown_table(
        ["device", "preset", "dtype", "batch × seq", "tokens/s", "TFLOP/s", "matmul peak TFLOP/s", "MFU",
         "copy bandwidth GB/s"],
        [[result["device"], result["preset"], result["dtype"], f"{train['batch']} × {train['seq']}",
          train["jax"]["tokens_per_s"], train["jax"]["gflops"] / 1e3, result["matmul_peak_gflops"] / 1e3,
          result["mfu"], result["bandwidth_gbs"]]])
    decode = markdown_table(
        ["decode batch", "ms / step", "tokens/s", "GB/s needed", "bandwidth utilization"],
        [[d["batch"], 1e3 * d["decode_step_s"], d["tokens_per_s"], d["achieved_gbs"], d["bandwidth_utilization"]]
         for d in result["decode"]])
    return f"{head}\n\n{decode}\n"
