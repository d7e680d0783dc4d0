"""How the train step scales, and what dropless MoE costs against the dense alternative.

- Sequence length 256…4096 at a fixed 4096 positions per step (batch = 4096 / seq): the weight matmuls
  stay constant, so the growth is attention's S² term (and its S×S score memory).
- Batch size at sequence 512: where a step becomes large enough to reach the matmul roofline.
- MoE expert block forward + backward (`run_moe`): the dropless `jax.lax.ragged_dot` path
  (`respo_jax.models.qwen3.moe.expert_ffn` with `moe_impl="ragged"`, what GPU/TPU run), the tiled dropless
  path the model uses on CPU (`moe_impl="tiled"`), and computing every expert densely for every token with the unrouted ones
  zero-weighted (the simplest alternative; num_experts / top_k × the FLOPs).

Train-step points alternate respo-jax and PyTorch eager (each in its own process, `train_step.SideProcess`);
MoE points alternate the three implementations in this process.
"""

from __future__ import annotations

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import train_step
from experiments.benchmarks.common import alternate, markdown_table, speedup, summarize
from respo_jax.models import qwen3
from respo_jax.models.qwen3.moe import expert_ffn, route
from respo_jax.programs import Program

SEQ_LENGTHS = (256, 512, 1024, 2048, 4096)
POSITIONS_PER_STEP = 4096
BATCH_SIZES = (1, 2, 4, 8)  # 16 × 512: the two sides kept ~24 GB between them and one was killed
MOE_TOKENS = (512, 2048, 8192)
MOE_SHAPES = {"8 experts, top-2": dict(num_experts=8, top_k=2, embed=512, expert_mlp=768),
              "32 experts, top-4": dict(num_experts=32, top_k=4, embed=512, expert_mlp=384)}


def dense_expert_ffn(x, indices, weights, gate_proj, up_proj, down_proj):
    """Every expert on every token, unrouted ones weighted 0: the same result as `expert_ffn`.

    x: [tokens, embed]; indices, weights: [tokens, top_k]; gate_proj, up_proj: [experts, embed,
    expert_mlp]; down_proj: [experts, expert_mlp, embed] -> [tokens, embed].
    """
    tokens = x.shape[0]
    combine = jnp.zeros((tokens, gate_proj.shape[0]), x.dtype)
    combine = combine.at[jnp.arange(tokens)[:, None], indices].add(weights.astype(x.dtype))  # [tokens, experts]
    gate = jnp.einsum("te,nem->tnm", x, gate_proj)
    up = jnp.einsum("te,nem->tnm", x, up_proj)
    y = jnp.einsum("tnm,nme->tne", jax.nn.silu(gate) * up, down_proj)
    return jnp.einsum("tne,tn->te", y, combine)


def _moe_grad_fn(ffn):
    """jit of the expert block's forward + backward w.r.t. its input and all expert weights."""

    def loss(x, gate_proj, up_proj, down_proj, indices, weights, cotangent):
        return jnp.sum(ffn(x, indices, weights, gate_proj, up_proj, down_proj) * cotangent)

    return Program(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), "moe_ffn_grad")


MOE_IMPLEMENTATIONS = {"ragged_dot": expert_ffn, "tiled": functools.partial(expert_ffn, impl="tiled"),
                       "dense": None}  # dense: below


def moe_point(tokens: int, num_experts: int, top_k: int, embed: int, expert_mlp: int, rounds: int = 3) -> dict:
    """The three expert-block implementations at one shape: timings, speedups over ragged_dot, and
    each one's max |Δ| from ragged_dot (outputs) and |Δ| of the scalar loss."""
    rng = np.random.default_rng(tokens + num_experts)
    std = 0.02
    x = jnp.asarray(rng.standard_normal((tokens, embed)), jnp.float32)
    gate = jnp.asarray(std * rng.standard_normal((num_experts, embed, expert_mlp)), jnp.float32)
    up = jnp.asarray(std * rng.standard_normal((num_experts, embed, expert_mlp)), jnp.float32)
    down = jnp.asarray(std * rng.standard_normal((num_experts, expert_mlp, embed)), jnp.float32)
    router_logits = jnp.asarray(rng.standard_normal((tokens, num_experts)), jnp.float32)
    weights, indices, _ = route(router_logits, top_k, norm_topk_prob=True)
    cotangent = jnp.asarray(rng.standard_normal((tokens, embed)), jnp.float32)
    args = (x, gate, up, down, indices, weights, cotangent)
    impls = {name: fn or dense_expert_ffn for name, fn in MOE_IMPLEMENTATIONS.items()}
    grad_fns = {name: _moe_grad_fn(fn) for name, fn in impls.items()}
    outputs = {name: fn(x, indices, weights, gate, up, down) for name, fn in impls.items()}
    values = {name: fn(*args)[0] for name, fn in grad_fns.items()}
    times = alternate({name: (lambda fn=fn: jax.block_until_ready(fn(*args))) for name, fn in grad_fns.items()},
                      rounds=rounds, warmup=1)
    active_flops = 3 * 2.0 * tokens * top_k * 3 * embed * expert_mlp  # fwd + bwd, 3 matmuls
    out = {"tokens": tokens, "num_experts": num_experts, "top_k": top_k, "embed": embed, "expert_mlp": expert_mlp}
    for name in impls:
        out[name] = summarize(times[name])
        out[name]["active_gflops"] = active_flops / out[name]["median_s"] / 1e9
        out[name]["max_abs_diff_vs_ragged"] = float(jnp.max(jnp.abs(outputs[name] - outputs["ragged_dot"])))
        out[name]["loss_abs_diff_vs_ragged"] = float(abs(values[name] - values["ragged_dot"]))
        out[name]["speedup_vs_ragged"] = speedup(times["ragged_dot"], times[name])
    return out


def run_moe(tokens=MOE_TOKENS, shapes=None, rounds: int = 3) -> list[dict]:
    """`moe_point` for every shape (default MOE_SHAPES) and token count."""
    shapes = MOE_SHAPES if shapes is None else shapes
    return [dict(moe_point(t, **shape, rounds=rounds), shape=name) for name, shape in shapes.items() for t in tokens]


def run(case: str = "small", rounds: int = 2, seq_lengths=SEQ_LENGTHS, batch_sizes=BATCH_SIZES,
        positions_per_step: int = POSITIONS_PER_STEP, seed: int = 0) -> dict:
    """The sequence and batch sweeps of `case`; returns {"case", "positions_per_step", "seq": [...],
    "batch": [...]}, each point a `train_step.compare` record."""
    base = train_step.CASES[case]
    with tempfile.TemporaryDirectory() as checkpoint:
        qwen3.save_pretrained(qwen3.Qwen3ForCausalLM(base.config, rngs=nnx.Rngs(seed)), checkpoint)
        sides = train_step.start_sides(checkpoint)  # one process per side, reused for every shape
        try:
            def point(shape_case):
                batch = train_step.make_batch(shape_case, seed)
                return train_step.compare(shape_case, sides, batch, rounds=rounds, warmup=1)

            seq_points = [point(base.with_shape(batch=max(1, positions_per_step // s), seq=s)) for s in seq_lengths]
            batch_points = [point(base.with_shape(batch=b, seq=base.seq)) for b in batch_sizes]
        finally:
            train_step.close_sides(sides)
    return {"case": case, "positions_per_step": positions_per_step, "seq": seq_points, "batch": batch_points}


def _slim(point: dict) -> list:
    return [point["batch"], point["seq"], point["jax"]["median_s"], point["torch_eager"]["median_s"],
            point["speedup_vs_torch_eager"], point["jax"]["gflops"], point["jax"]["step_rss_growth_mib"],
            point["torch_eager"]["step_rss_growth_mib"]]


def markdown(result: dict) -> str:
    columns = ["batch", "seq", "respo-jax s/step", "torch eager s/step", "speedup", "respo-jax GFLOP/s",
               "respo-jax step RSS growth MiB", "torch step RSS growth MiB"]
    seq = markdown_table(columns, [_slim(p) for p in result["seq"]])
    batch = markdown_table(columns, [_slim(p) for p in result["batch"]])
    return (f"### Step time vs sequence length ({result['positions_per_step']} positions per step)\n\n{seq}\n\n"
            f"### Step time vs batch size\n\n{batch}\n")


def moe_markdown(points: list[dict]) -> str:
    rows = [[p["shape"], p["tokens"], p["ragged_dot"]["median_s"], p["tiled"]["median_s"], p["dense"]["median_s"],
             p["tiled"]["speedup_vs_ragged"], p["dense"]["speedup_vs_ragged"], p["ragged_dot"]["active_gflops"],
             p["tiled"]["active_gflops"], f"{max(p['tiled']['max_abs_diff_vs_ragged'], p['dense']['max_abs_diff_vs_ragged']):.1e}"]
            for p in points]
    return markdown_table(["shape", "tokens", "ragged_dot s", "tiled s", "dense s", "tiled speedup", "dense speedup",
                           "ragged GFLOP/s (active)", "tiled GFLOP/s (active)", "max |Δ| vs ragged"], rows)


def plot(result: dict | None, moe: list[dict] | None, path: str) -> None:
    """Up to three panels (seq, batch, MoE) into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = (2 if result else 0) + (1 if moe else 0)
    if not panels:
        raise ValueError("plot() needs sweep results or MoE points")
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if result:
        seq = result["seq"]
        ax = axes.pop(0)
        ax.plot([p["seq"] for p in seq], [p["jax"]["median_s"] for p in seq], "o-", label="respo-jax")
        ax.plot([p["seq"] for p in seq], [p["torch_eager"]["median_s"] for p in seq], "s--", label="torch eager")
        ax.set(xscale="log", xlabel="sequence length", ylabel="s / step",
               title=f"{result['positions_per_step']} positions per step")
        ax.set_xticks([p["seq"] for p in seq], [str(p["seq"]) for p in seq])
        batch = result["batch"]
        ax = axes.pop(0)
        ax.plot([p["batch"] for p in batch], [p["jax"]["tokens_per_s"] for p in batch], "o-", label="respo-jax")
        ax.plot([p["batch"] for p in batch], [p["torch_eager"]["tokens_per_s"] for p in batch], "s--",
                label="torch eager")
        ax.set(xscale="log", xlabel=f"batch (seq {batch[0]['seq']})", ylabel="tokens / s",
               title="throughput vs batch")
        ax.set_xticks([p["batch"] for p in batch], [str(p["batch"]) for p in batch])
    if moe:
        ax = axes.pop(0)
        styles = {"ragged_dot": "o-", "tiled": "^-", "dense": "s--"}
        for index, shape in enumerate(dict.fromkeys(p["shape"] for p in moe)):
            pts = [p for p in moe if p["shape"] == shape]
            for name, style in styles.items():
                ax.plot([p["tokens"] for p in pts], [p[name]["median_s"] for p in pts], style, color=f"C{index}",
                        label=f"{name}, {shape}")
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="s (fwd + bwd)", title="MoE expert block")
    for ax in fig.axes:
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # keep only the set ticks' labels
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
