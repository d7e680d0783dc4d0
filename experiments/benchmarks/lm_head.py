"""The LM head's log-probs, forward + backward, side by side: the token-chunked kernel (a whole-vocabulary
logits chunk) against the vocabulary-blocked one (online log-sum-exp), at the real vocabulary, in GFLOP/s.

    python -m experiments.benchmarks.lm_head                               # 1024 tokens, hidden 256, 2048
    python -m experiments.benchmarks.lm_head --vocab-chunk 2048 4096 8192  # several block widths
    python -m experiments.benchmarks.lm_head --tokens 24 --hidden 16 --vocab 300 --rounds 1 --warmup 0

Each side is one jitted call: log-probs of random targets and the gradients of Σ g·log p with respect to
the hidden states and the weight (g random, standing for the loss's cotangent), the sides timed in turn
(A B A B …) after untimed warm-up calls. FLOPs per call, the same for both kernels: 8 · tokens · vocab ·
hidden (the forward's logits; in the backward the recomputed logits, d hidden and d weight); the
overlapping last vocabulary block is work the blocked kernel is not credited for. Every side's outputs
are also compared with the token-chunked kernel's (largest difference relative to its largest value).
With --peak, each case also times XLA's plain matmul of the block's GEMM shape ([tokens, hidden] @
[hidden, vocab_chunk], matmul_peak.run) in the same process: the rate the kernels' matmuls could reach.
Writes lm_head.json and lm_head.md into --out.
"""

from __future__ import annotations

import os
import sys
import time

from experiments.cli import ArgumentParser, run_cli
from respo_jax.programs import Program

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BASELINE = "token_chunks"


def side_name(impl: str, vocab_chunk: int) -> str:
    return impl if impl == BASELINE else f"{impl}[{vocab_chunk}]"


def run(tokens: int = 1024, hidden: int = 2048, vocab: int = 151_936, vocab_chunks=(None,), rounds: int = 3,
        warmup: int = 1, dtype: str = "float32", tied: bool = True, chunk_tokens: int = 1024,
        peak: bool = False) -> dict:
    """One case: {"tokens", "hidden", "vocab", "dtype", "tied", "chunk_tokens", "flops_per_call",
    "sides": {name: {"gflops", "max_rel_diff_vs_token_chunks", "median_s", …}}, "speedup_vs_token_chunks":
    {name: ratio}, with `peak` "matmul_gflops": {width: XLA GFLOP/s of the block's GEMM}}; a
    `vocab_chunks` entry None is the kernel's default block width."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from experiments.benchmarks.common import alternate, speedup, summarize
    from respo_jax.models.qwen3.lm_head import VOCAB_CHUNK, chunked_token_logprobs

    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((1, tokens, hidden), dtype=np.float32), dtype)
    w_shape = (vocab, hidden) if tied else (hidden, vocab)
    w = jnp.asarray(rng.standard_normal(w_shape, dtype=np.float32) / np.sqrt(hidden), dtype)
    targets = jnp.asarray(rng.integers(0, vocab, (1, tokens), dtype=np.int32))
    g = jnp.asarray(rng.standard_normal((1, tokens), dtype=np.float32))

    def side(impl: str, width: int):
        def step(h, w, targets, g):
            logp, vjp = jax.vjp(lambda h, w: chunked_token_logprobs(
                h, w, targets, tied=tied, chunk_tokens=chunk_tokens, impl=impl, vocab_chunk=width), h, w)
            return (logp, *vjp(g))
        return Program(step, f"lm_head_{impl}_{width}")

    widths = sorted({VOCAB_CHUNK if c is None else int(c) for c in vocab_chunks})
    programs = {BASELINE: side(BASELINE, VOCAB_CHUNK)}
    programs.update({side_name("vocab_chunks", c): side("vocab_chunks", c) for c in widths})
    outputs = {name: [np.asarray(x, np.float32) for x in jax.block_until_ready(fn(h, w, targets, g))]
               for name, fn in programs.items()}  # also compiles every side before the clock starts
    calls = {name: (lambda fn=fn: jax.block_until_ready(fn(h, w, targets, g)))
             for name, fn in programs.items()}
    times = alternate(calls, rounds=rounds, warmup=warmup)
    flops = 8.0 * tokens * vocab * hidden
    sides = {}
    for name in programs:
        diff = max(float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
                   for a, b in zip(outputs[name], outputs[BASELINE]))
        sides[name] = {"gflops": flops / summarize(times[name])["median_s"] / 1e9,
                       "max_rel_diff_vs_token_chunks": diff, **summarize(times[name])}
    out = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": dtype, "tied": tied,
           "chunk_tokens": chunk_tokens, "flops_per_call": flops, "sides": sides,
           "speedup_vs_token_chunks": {name: speedup(times[BASELINE], times[name]) for name in programs}}
    if peak:
        from experiments.benchmarks import matmul_peak

        rows = min(tokens, chunk_tokens)
        out["matmul_gflops"] = {
            str(c): matmul_peak.run([(rows, hidden, min(c, vocab))], rounds=rounds, dtype=dtype,
                                    with_numpy=False)["xla_matmul_peak_gflops"] for c in widths}
    return out


def markdown(cases: list[dict]) -> str:
    from experiments.benchmarks.common import markdown_table

    rows = [[c["hidden"], c["tokens"], c["vocab"], name, s["median_s"], s["gflops"],
             c["speedup_vs_token_chunks"][name], s["max_rel_diff_vs_token_chunks"]]
            for c in cases for name, s in c["sides"].items()]
    table = markdown_table(["hidden", "tokens", "vocab", "kernel", "median s", "GFLOP/s", "× token_chunks",
                            "max rel. diff"], rows)
    peaks = [[c["hidden"], width, gflops]
             for c in cases for width, gflops in c.get("matmul_gflops", {}).items()]
    if peaks:
        table += "\n\nXLA matmul of the block's GEMM shape ([tokens, hidden] @ [hidden, vocab_chunk]):\n\n"
        table += markdown_table(["hidden", "vocab_chunk", "GFLOP/s"], peaks)
    return table


def _environment() -> dict:
    """What the numbers were measured on (common.environment without the PyTorch side's settings)."""
    import jax

    from respo_jax.host_allocator import host_allocator_settings

    return {"jax": jax.__version__, "jax_backend": jax.default_backend(),
            "jax_devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "host_allocator": host_allocator_settings()}


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m experiments.benchmarks.lm_head",
                            description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--vocab-chunk", type=int, nargs="+", default=None,
                        help="block widths of the vocab-chunked kernel (default: its default width)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per chunk (both kernels)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--untied", action="store_true",
                        help="an [hidden, vocab] head instead of the embedding")
    parser.add_argument("--peak", action="store_true",
                        help="also time XLA's matmul of the block's GEMM shape")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    for name in ("tokens", "vocab", "chunk_tokens", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if min(args.hidden) <= 0 or min(args.vocab_chunk or [1]) <= 0:
        parser.error("--hidden and --vocab-chunk must be positive")
    from experiments.benchmarks import common

    argv = sys.argv[1:] if argv is None else argv
    command = "python -m experiments.benchmarks.lm_head " + " ".join(argv)
    started = time.perf_counter()
    cases = [run(args.tokens, hidden, args.vocab, args.vocab_chunk or (None,), args.rounds, args.warmup,
                 args.dtype, not args.untied, args.chunk_tokens, args.peak) for hidden in args.hidden]
    payload = {"command": command.strip(), "cases": cases, "wall_s": time.perf_counter() - started,
               "environment": _environment()}
    common.write_json(os.path.join(args.out, "lm_head.json"), payload)
    table = markdown(cases)
    common.write_markdown(os.path.join(args.out, "lm_head.md"), "LM head log-probs, forward + backward", [
        ("Command", f"`{payload['command']}` — {payload['wall_s']:.0f} s, {args.dtype}, "
                    f"{'untied' if args.untied else 'tied'} head, medians of {args.rounds} rounds"),
        ("Results", table)])
    print(table)
    return 0


if __name__ == "__main__":  # a bad flag: one line, exit status 2 (experiments.cli)
    from respo_jax.host_allocator import configure_host_allocator

    configure_host_allocator()  # before JAX starts its threads, as the other benchmarks do
    sys.exit(run_cli(main, sys.argv[1:]))
