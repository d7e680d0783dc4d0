"""The machine's measured matmul peak: the best FLOP/s of float32 matmuls through XLA (jit) and NumPy,
over square sizes and the GEMM shapes of the benchmarked models.

The roofline divides a model's FLOPs per step by this number, so the MFU it reports is a fraction of
what this machine demonstrably reaches through the same compiler, not of a datasheet figure. Run it in a
process with `respo_jax.host_allocator` configured: with glibc's default malloc every call page-faults
its output in again (a 2048² float32 output is 16 MiB), which under-measures the peak (README.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.common import alternate, median, summarize
from respo_jax.programs import Program

# A size n is the n×n @ n×n matmul; (m, k, n) is [m, k] @ [k, n]. (4096, 512, 1536) is the small
# config's MLP up-projection over its 8 × 512 tokens, the kind of GEMM its train step is made of.
QUICK_SIZES = (1024, 2048, (4096, 512, 1536))
FULL_SIZES = (512, 1024, 2048, 3072, (4096, 512, 1536), (4096, 1536, 512))
ACCELERATOR_SIZES = (4096, 8192)


def gemm_shape(size) -> tuple[int, int, int]:
    """(m, k, n) of a size entry: an int n (square) or an (m, k, n) triple."""
    if isinstance(size, int):
        return size, size, size
    m, k, n = size
    return int(m), int(k), int(n)


def shape_label(size) -> str:
    m, k, n = gemm_shape(size)
    return f"{m}" if m == k == n else f"{m}×{k} @ {k}×{n}"


def matmul_flops(m: int, k: int, n: int) -> float:
    """Multiply-adds of [m, k] @ [k, n], counted as 2 FLOPs each."""
    return 2.0 * m * k * n


def probe(size: int = 2048, repeats: int = 2):
    """A callable running `repeats` jitted size³ float32 matmuls (blocking) and the FLOPs it does: a
    peak reference that can be interleaved with another benchmark so both see the same machine load."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
    product = Program(jnp.matmul, "matmul")
    product(a, a).block_until_ready()

    def call():
        for _ in range(repeats):
            out = product(a, a)
        out.block_until_ready()

    return call, repeats * matmul_flops(size, size, size)


def run(sizes=QUICK_SIZES, rounds: int = 5, dtype: str = "float32", with_numpy: bool = True) -> dict:
    """Times each matmul of `sizes` (XLA, then NumPy) and returns per-shape GFLOP/s and the peaks.

    Returns {"xla_matmul_peak_gflops", "numpy_matmul_peak_gflops" (if with_numpy), "dtype",
    "by_size": [{"size", "shape": [m, k, n], "xla_gflops", "numpy_gflops"?}]}.
    """
    if not sizes:
        raise ValueError("matmul_peak.run needs at least one size")
    jdtype = jnp.dtype(dtype)
    product = Program(jnp.matmul, "matmul")
    by_size = []
    for size in sizes:
        m, k, n = gemm_shape(size)
        rng = np.random.default_rng(m * k + n)
        a_np = rng.standard_normal((m, k), dtype=np.float32)
        b_np = rng.standard_normal((k, n), dtype=np.float32)
        a = jnp.asarray(a_np, jdtype)
        b = jnp.asarray(b_np, jdtype)
        # Not alternated: OpenBLAS's threads keep spinning for a while after each NumPy call, and
        # XLA's matmul right after one runs far below its speed alone (README.md).
        times = alternate({"xla": lambda: product(a, b).block_until_ready()}, rounds=rounds, warmup=2)
        if with_numpy:
            times.update(alternate({"numpy": lambda: np.matmul(a_np, b_np)}, rounds=rounds, warmup=2))
        flops = matmul_flops(m, k, n)
        row = {"size": shape_label(size), "shape": [m, k, n], "xla_gflops": flops / median(times["xla"]) / 1e9,
               "xla": summarize(times["xla"])}
        if with_numpy:
            row["numpy_gflops"] = flops / median(times["numpy"]) / 1e9
            row["numpy"] = summarize(times["numpy"])
        by_size.append(row)
    out = {"dtype": dtype, "by_size": by_size,
           "xla_matmul_peak_gflops": max(r["xla_gflops"] for r in by_size)}
    if with_numpy:
        out["numpy_matmul_peak_gflops"] = max(r["numpy_gflops"] for r in by_size)
    return out


def markdown(result: dict) -> str:
    from experiments.benchmarks.common import markdown_table

    has_numpy = "numpy_matmul_peak_gflops" in result
    columns = ["shape (n: n×n @ n×n)", f"XLA GFLOP/s ({result['dtype']})"] + (["NumPy GFLOP/s"] if has_numpy else [])
    rows = [[r["size"], r["xla_gflops"]] + ([r["numpy_gflops"]] if has_numpy else []) for r in result["by_size"]]
    return markdown_table(columns, rows)
