"""The machine's measured matmul peak: FLOP/s of one large square matmul through XLA (jit) and NumPy.

The roofline divides a model's FLOPs per step by this number, so the MFU it reports is a fraction of
what this machine demonstrably reaches through the same compiler, not of a datasheet figure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.common import alternate, median, summarize

QUICK_SIZES = (1024, 2048)
FULL_SIZES = (512, 1024, 2048, 3072)
ACCELERATOR_SIZES = (4096, 8192)


def matmul_flops(m: int, k: int, n: int) -> float:
    """Multiply-adds of [m, k] @ [k, n], counted as 2 FLOPs each."""
    return 2.0 * m * k * n


def probe(size: int = 2048, repeats: int = 2):
    """A callable running `repeats` jitted size³ float32 matmuls (blocking) and the FLOPs it does: a
    peak reference that can be interleaved with another benchmark so both see the same machine load."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
    product = jax.jit(jnp.matmul)
    product(a, a).block_until_ready()

    def call():
        for _ in range(repeats):
            out = product(a, a)
        out.block_until_ready()

    return call, repeats * matmul_flops(size, size, size)


def run(sizes=QUICK_SIZES, rounds: int = 5, dtype: str = "float32", with_numpy: bool = True) -> dict:
    """Times `size`³ matmuls (XLA and NumPy alternated) and returns per-size GFLOP/s and the peaks.

    Returns {"xla_matmul_peak_gflops", "numpy_matmul_peak_gflops" (if with_numpy), "dtype",
    "by_size": [{"size", "xla_gflops", "numpy_gflops"?}]}.
    """
    if not sizes:
        raise ValueError("matmul_peak.run needs at least one size")
    jdtype = jnp.dtype(dtype)
    product = jax.jit(jnp.matmul)
    by_size = []
    for size in sizes:
        rng = np.random.default_rng(size)
        a_np = rng.standard_normal((size, size), dtype=np.float32)
        b_np = rng.standard_normal((size, size), dtype=np.float32)
        a = jnp.asarray(a_np, jdtype)
        b = jnp.asarray(b_np, jdtype)
        sides = {"xla": lambda: product(a, b).block_until_ready()}
        if with_numpy:
            sides["numpy"] = lambda: np.matmul(a_np, b_np)
        times = alternate(sides, rounds=rounds, warmup=1)
        flops = matmul_flops(size, size, size)
        row = {"size": size, "xla_gflops": flops / median(times["xla"]) / 1e9,
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
    columns = ["size (n×n @ n×n)", f"XLA GFLOP/s ({result['dtype']})"] + (["NumPy GFLOP/s"] if has_numpy else [])
    rows = [[r["size"], r["xla_gflops"]] + ([r["numpy_gflops"]] if has_numpy else []) for r in result["by_size"]]
    return markdown_table(columns, rows)
