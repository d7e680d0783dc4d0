"""Train-step throughput: respo-jax's jitted policy step vs transformers + PyTorch on the same model.

One step = forward over [batch, seq] → log π of the response tokens (the vocabulary projection for the
response positions only) → ReSPO token-mean loss (detached kernel φ of Eq. 12) → backward →
global-norm clipping → AdamW. The JAX side is exactly what the trainer runs
(`respo_jax.training.step.make_policy_step`); the PyTorch side is what a user would otherwise write:
`transformers.Qwen3ForCausalLM` (same config, same weights, loaded from our `save_pretrained`
checkpoint, `logits_to_keep` = the response length) with the same objective math in torch and
`torch.optim.AdamW`, in eager mode and, where it works, under `torch.compile`. Each side runs in its
own process with the same malloc settings (`respo_jax.host_allocator`); the sides alternate.

Batches look like RL batches: prompts left-padded, responses right-padded (lengths drawn in
[len/2, len]), so neither side can take an unmasked fast path. Throughput counts processed positions
(batch × seq), which is what both sides compute on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import matmul_peak, roofline
from experiments.benchmarks.common import (
    DEFAULT_THREADS,
    SpawnedSide,
    alternate,
    configure_threads,
    current_rss_mib,
    markdown_table,
    median,
    peak_rss_mib,
    process_cpu_seconds,
    speedup,
    summarize,
)
from respo_jax.host_allocator import configure_host_allocator, host_allocator_settings, release_host_memory
from respo_jax.models import qwen3
from respo_jax.objectives import get_objective
from respo_jax.training.batch import PolicyBatch, build_sequences
from respo_jax.training.step import make_optimizer, make_policy_step

# AdamW as the trainer builds it; a small learning rate keeps repeated steps on one batch stable.
OPTIMIZER = dict(learning_rate=1e-5, weight_decay=0.01, b1=0.9, b2=0.999, max_grad_norm=1.0, warmup_steps=0)
RESPO = dict(alpha=(2.0, 1.0), beta=(0.5, 0.5), lam=(2.0, 2.0))


@dataclasses.dataclass(frozen=True)
class TrainCase:
    """A model config and the [batch, prompt_len + response_len] batch it is benchmarked on."""

    name: str
    config: qwen3.Qwen3Config
    batch: int
    seq: int
    prompt_len: int

    @property
    def response_len(self) -> int:
        return self.seq - self.prompt_len

    def with_shape(self, batch: int | None = None, seq: int | None = None) -> "TrainCase":
        """The same model on another batch shape (prompt kept at 1/8 of the sequence)."""
        seq = self.seq if seq is None else seq
        return dataclasses.replace(self, batch=self.batch if batch is None else batch, seq=seq,
                                   prompt_len=max(1, seq // 8))


_TINY = qwen3.Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                          rope_theta=10_000.0, max_position_embeddings=8192)
_SMALL = qwen3.Qwen3Config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
                           max_position_embeddings=8192)
# Same active MLP width as `small` (top-2 of 8 experts of width 768 = 1536), 4× the MLP parameters.
_SMALL_MOE = _SMALL.replace(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)
# For the smoke test: a model small enough to build, compile and step in seconds.
_MICRO = qwen3.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                           rope_theta=10_000.0, max_position_embeddings=512)

CASES = {
    "micro": TrainCase("micro", _MICRO, batch=2, seq=32, prompt_len=8),
    "tiny": TrainCase("tiny", _TINY, batch=8, seq=128, prompt_len=16),
    "small": TrainCase("small", _SMALL, batch=8, seq=512, prompt_len=64),
    "small-moe": TrainCase("small-moe", _SMALL_MOE, batch=8, seq=512, prompt_len=64),
}


# ----------------------------------------------------------------------------------------------- data


def make_batch(case: TrainCase, seed: int = 0) -> dict[str, np.ndarray]:
    """A synthetic RL batch (NumPy): random tokens, ragged prompts and responses, ±1 advantages and
    old log-probs near those of a freshly initialized model (≈ uniform: -log vocab), so log W is O(1)."""
    rng = np.random.default_rng(seed)
    vocab = case.config.vocab_size
    prompt_lens = rng.integers(max(1, case.prompt_len // 2), case.prompt_len + 1, size=case.batch)
    prompts = [rng.integers(1, vocab, size=int(n)).tolist() for n in prompt_lens]
    prompts[0] = rng.integers(1, vocab, size=case.prompt_len).tolist()  # pin the padded prompt length
    responses = rng.integers(1, vocab, size=(case.batch, case.response_len))
    lengths = rng.integers(max(1, case.response_len // 2), case.response_len + 1, size=case.batch)
    ids, positions, attention, response_mask, prompt_len = build_sequences(prompts, responses, lengths, pad_id=0)
    old_logp = (-math.log(vocab) + 0.01 * rng.standard_normal(response_mask.shape)).astype(np.float32)
    advantages = np.where(np.arange(case.batch) % 2 == 0, 1.0, -1.0).astype(np.float32)
    return dict(input_ids=ids, positions=positions, attention_mask=attention, response_mask=response_mask,
                old_logp=old_logp * response_mask, advantages=advantages, prompt_len=prompt_len)


# ---------------------------------------------------------------------------------------------- sides


def jax_side(model: qwen3.Qwen3ForCausalLM, batch: dict) -> tuple[Callable[[], float], Callable]:
    """The trainer's jitted step on `batch`. Returns (call → loss of that call, the jitted step)."""
    graphdef, params = nnx.split(model)
    params = jax.tree.map(jnp.copy, params)  # the step donates its inputs; keep `model` usable
    tx = make_optimizer(**OPTIMIZER)
    step = make_policy_step(graphdef, get_objective("respo", **RESPO), tx)
    state = {"params": params, "opt_state": tx.init(params)}
    policy_batch = PolicyBatch(
        input_ids=jnp.asarray(batch["input_ids"]), positions=jnp.asarray(batch["positions"]),
        attention_mask=jnp.asarray(batch["attention_mask"]), response_mask=jnp.asarray(batch["response_mask"]),
        old_logp=jnp.asarray(batch["old_logp"]), advantages=jnp.asarray(batch["advantages"]),
        prompt_len=int(batch["prompt_len"]))

    def call() -> float:
        state["params"], state["opt_state"], metrics = step(state["params"], state["opt_state"], policy_batch)
        jax.block_until_ready((state["params"], state["opt_state"]))
        return float(metrics["loss"])

    call.batch = policy_batch  # type: ignore[attr-defined]
    call.state = state  # type: ignore[attr-defined]
    return call, step


def torch_respo_loss(logp, old_logp, advantages, mask):
    """ReSPO token-mean loss in torch, the same math as `respo_jax.objectives` with the default
    hyperparameters: log W = clamp(Σ mask·(logp − old_logp), ±20); φ = φ₀·exp(λ(1 − φ₀)) with
    φ₀ = [1 + β(W^(α−1) − 1)]^(1/(α−1)) (α = 1: W^β) per sign of A (Eq. 12), detached;
    loss = −Σ φ·A·logp·mask / Σ mask. logp, old_logp, mask: [batch, seq]; advantages: [batch]."""
    import torch

    valid = mask > 0
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    with torch.no_grad():
        log_w = torch.where(valid, logp - old_logp, torch.zeros_like(logp)).sum(-1).clamp(-20.0, 20.0)
        branches = []
        for alpha, beta, lam in zip(RESPO["alpha"], RESPO["beta"], RESPO["lam"]):
            if alpha == 1.0:
                log_phi0 = beta * log_w
            else:
                log_phi0 = torch.log1p(beta * torch.expm1((alpha - 1.0) * log_w)) / (alpha - 1.0)
            phi0 = torch.exp(log_phi0)
            branches.append(phi0 * torch.exp(lam * (1.0 - phi0)))
        phi = torch.where(advantages >= 0, branches[0], branches[1])
    token_loss = -(phi * advantages)[:, None] * logp * mask
    return token_loss.sum() / mask.sum().clamp(min=1.0)


def torch_side(torch_model, batch: dict, compile_model: bool = False) -> Callable[[], float]:
    """One eager (or `torch.compile`d) PyTorch train step per call; returns that call's loss."""
    import torch

    ids = torch.from_numpy(np.asarray(batch["input_ids"], np.int64))
    positions = torch.from_numpy(np.asarray(batch["positions"], np.int64))
    attention = torch.from_numpy(np.asarray(batch["attention_mask"], np.int64))
    mask = torch.from_numpy(batch["response_mask"])
    old_logp = torch.from_numpy(batch["old_logp"])
    advantages = torch.from_numpy(batch["advantages"])
    start = int(batch["prompt_len"]) - 1
    targets = ids[:, start + 1:]
    response_len = targets.shape[1]
    optimizer = torch.optim.AdamW(torch_model.parameters(), lr=OPTIMIZER["learning_rate"],
                                  betas=(OPTIMIZER["b1"], OPTIMIZER["b2"]),
                                  weight_decay=OPTIMIZER["weight_decay"], eps=1e-8)
    forward = torch.compile(torch_model) if compile_model else torch_model

    def call() -> float:
        optimizer.zero_grad(set_to_none=True)
        # The vocabulary projection for the response positions only, as respo-jax's step computes it.
        logits = forward(input_ids=ids[:, :-1], attention_mask=attention[:, :-1],
                         position_ids=positions[:, :-1],
                         logits_to_keep=response_len).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        loss = torch_respo_loss(logp, old_logp, advantages, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), OPTIMIZER["max_grad_norm"])
        optimizer.step()
        return float(loss.detach())

    return call


# -------------------------------------------------------------------------------------------- memory


class RssPeak:
    """Largest resident set size seen (sampled every `interval` s) while the context is open, MiB."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = 0.0
        self._stop = threading.Event()

    def __enter__(self) -> "RssPeak":
        self.before = current_rss_mib()
        self.peak = self.before
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_mib())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mib())


# -------------------------------------------------------------------------------------- side processes
#
# Each side runs in its own process, driven one step at a time from the parent, so the sides still
# alternate (A B A B …) but never share an allocator, thread pools or page cache state: in one process a
# JAX step right after a PyTorch step was much slower (twice the kernel time in page faults; README.md),
# which would have been a property of the harness, not of either framework. While one
# side runs, the other waits on its pipe and uses no CPU.


@dataclasses.dataclass(frozen=True)
class SideSpec:
    """How one side runs: framework, whether its process starts with `configure_host_allocator()`
    (respo_jax.host_allocator: glibc keeps large host buffers mapped between steps) and, for torch,
    whether the model is `torch.compile`d."""

    framework: str
    host_allocator: bool
    compile: bool = False
    label: str = ""


SIDES = {
    # What the CPU trainer runs (experiments/train.py, experiments/configs/respo_synthetic.py): host
    # allocator configured, layers unrolled (model.scan_layers=false).
    "jax": SideSpec("jax", host_allocator=True, label="respo-jax"),
    # transformers + PyTorch given the same malloc settings: the headline baseline.
    "torch_eager": SideSpec("torch", host_allocator=True, label="torch eager"),
    "torch_compile": SideSpec("torch", host_allocator=True, compile=True, label="torch.compile"),
    # PyTorch as a user runs it out of the box (glibc defaults), for reference.
    "torch_eager_glibc": SideSpec("torch", host_allocator=False, label="torch eager, glibc defaults"),
}
SIDE_KINDS = tuple(SIDES)
DEFAULT_SIDES = ("jax", "torch_eager")


def _side_main(conn, kind: str, checkpoint: str, threads: int) -> None:
    """A side's process: load the checkpoint, then serve ("batch", dict) / ("step", None) /
    ("probe", None) / ("stop", None) requests, answering ("ok", result) or ("error", traceback)."""
    import traceback

    try:
        spec = SIDES[kind]
        if spec.host_allocator:  # first, before any JAX or PyTorch thread allocates
            configure_host_allocator(jax_dispatch=spec.framework == "jax")
        if spec.framework == "jax":
            model = qwen3.from_pretrained(checkpoint, scan_layers=False)
        else:
            configure_threads(threads)
            model = _torch_model_from_dir(checkpoint)
        probe = None
        call = None
        conn.send(("ok", {"peak_rss_mib": peak_rss_mib(), "host_allocator": host_allocator_settings()}))
        while True:
            command, argument = conn.recv()
            if command == "stop":
                return
            if command == "batch":
                call = None  # frees the last shape's step state, so the trim below can return it
                if spec.host_allocator:  # a new shape: drop the last shape's heap holes first
                    release_host_memory()
                call = jax_side(model, argument)[0] if spec.framework == "jax" else torch_side(
                    model, argument, compile_model=spec.compile)
                conn.send(("ok", None))
                continue
            if command == "probe":
                if probe is None:
                    probe = matmul_peak.probe()
                fn, flops = probe
            elif command == "step":
                if call is None:
                    raise RuntimeError("step requested before a batch was set")
                fn, flops = call, None
            else:
                raise ValueError(f"unknown side command {command!r}")
            with RssPeak() as rss:
                cpu_start, system_start, start = process_cpu_seconds(), os.times().system, time.perf_counter()
                loss = fn()
                wall, cpu = time.perf_counter() - start, process_cpu_seconds() - cpu_start
                system = os.times().system - system_start
            conn.send(("ok", {"loss": loss, "wall_s": wall, "cpu_s": cpu, "system_s": system, "flops": flops,
                              "rss_growth_mib": rss.peak - rss.before, "peak_rss_mib": peak_rss_mib()}))
    except Exception:  # noqa: BLE001 (reported to the parent, which raises it)
        conn.send(("error", traceback.format_exc()))


class SideProcess(SpawnedSide):
    """One benchmark side (`kind` in SIDE_KINDS) in a spawned process holding the model of `checkpoint`.

    `set_batch(batch)` builds its step for a batch (the first step compiles); `step()` runs one and
    returns its loss, keeping {"loss", "wall_s", "cpu_s", "rss_growth_mib", "peak_rss_mib"} in
    `records`; `probe()` runs `matmul_peak.probe` in the same process, kept in `probe_records`.
    """

    stop_message = ("stop", None)

    def __init__(self, kind: str, checkpoint: str, threads: int = DEFAULT_THREADS, timeout_s: float = 3600.0):
        if kind not in SIDE_KINDS:
            raise ValueError(f"unknown side {kind!r}; expected one of {SIDE_KINDS}")
        super().__init__(kind, _side_main, (kind, checkpoint, threads), timeout_s=timeout_s)
        self.records: list[dict] = []
        self.probe_records: list[dict] = []
        self._started = False

    def _request(self, command: str, argument=None):
        if not self._started:  # the load answer of __init__, awaited lazily so sides start in parallel
            self.load = self._reply()
            self._started = True
        self._conn.send((command, argument))
        return self._reply()

    def set_batch(self, batch: dict) -> None:
        self._request("batch", batch)

    def step(self) -> float:
        record = self._request("step")
        self.records.append(record)
        return record["loss"]

    def probe(self) -> None:
        self.probe_records.append(self._request("probe"))

    def __enter__(self) -> "SideProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _torch_model_from_dir(checkpoint: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).train()


def torch_model_from(model: qwen3.Qwen3ForCausalLM):
    """transformers' model with our model's exact weights (through our HF checkpoint writer)."""
    with tempfile.TemporaryDirectory() as tmp:
        qwen3.save_pretrained(model, tmp)
        return _torch_model_from_dir(tmp)


# ------------------------------------------------------------------------------------------------ run


def _series(records: list[dict], rounds: int, key: str) -> list[float]:
    return [r[key] for r in records[-rounds:]]


def compare(case: TrainCase, sides: dict[str, SideProcess], batch: dict, rounds: int, warmup: int,
            peak_gflops: float | None = None, probe_peak: bool = False) -> dict:
    """Alternates the `sides` (SideProcess by kind; "jax" and "torch_eager" required, their models
    loaded from one checkpoint) on `batch`; returns the JSON-ready record described in `run`. With
    `probe_peak`, a 2048³ XLA matmul in the JAX process joins the alternation, so the MFU compares the
    step with the matmul peak *under the same load*."""
    for side in sides.values():
        side.set_batch(batch)
        side.records.clear()
    steps = {kind: side.step for kind, side in sides.items()}
    if probe_peak:
        sides["jax"].probe_records.clear()
        steps["matmul_probe"] = sides["jax"].probe
    alternate(steps, rounds=rounds, warmup=warmup)  # the sides time themselves, in their own processes
    flops = roofline.train_step_flops(case.config, case.batch, case.seq)
    tokens = case.batch * case.seq
    out = {"case": case.name, "batch": case.batch, "seq": case.seq, "prompt_len": case.prompt_len,
           "tokens_per_step": tokens, "real_tokens_per_step": int(batch["attention_mask"].sum()),
           "flops": flops}
    wall = {kind: _series(side.records, rounds, "wall_s") for kind, side in sides.items()}
    cpu = {kind: _series(side.records, rounds, "cpu_s") for kind, side in sides.items()}
    for kind, side in sides.items():
        summary = summarize(wall[kind], tokens, cpu_times=cpu[kind])
        summary["gflops"] = flops["total"] / summary["median_s"] / 1e9
        summary["system_median_s"] = median(_series(side.records, rounds, "system_s"))  # kernel time
        summary["step_rss_growth_mib"] = max(_series(side.records, rounds, "rss_growth_mib"))
        summary["peak_rss_mib"] = side.records[-1]["peak_rss_mib"]
        summary["first_loss"] = side.records[0]["loss"]
        summary["host_allocator"] = side.load["host_allocator"]
        out[kind] = summary
    # respo-jax's speedup over every other side (per-round median ratio): speedup_vs_torch_eager, ...
    for kind in sides:
        if kind != "jax":
            out[f"speedup_vs_{kind}"] = speedup(wall[kind], wall["jax"])
    out["cpu_time_ratio_torch_eager_over_jax"] = speedup(cpu["torch_eager"], cpu["jax"])
    first_jax, first_torch = out["jax"]["first_loss"], out["torch_eager"]["first_loss"]
    out["loss_rel_diff"] = abs(first_jax - first_torch) / max(abs(first_torch), 1e-12)
    if probe_peak:
        probe_records = sides["jax"].probe_records
        probe_flops = probe_records[-1]["flops"]
        probe = summarize(_series(probe_records, rounds, "wall_s"), cpu_times=_series(probe_records, rounds, "cpu_s"))
        probe["gflops"] = probe_flops / probe["median_s"] / 1e9
        out["matmul_probe"] = probe

        def paired(step_times, probe_times):  # per round: (step FLOP/s) / (matmul FLOP/s); median
            return median([flops["total"] / s / (probe_flops / p) for s, p in zip(step_times, probe_times)])

        out["mfu_paired"] = paired(wall["jax"], probe["times_s"])
        out["mfu_torch_eager"] = paired(wall["torch_eager"], probe["times_s"])
        out["mfu_cpu_time"] = paired(cpu["jax"], probe["cpu_times_s"])
    if peak_gflops:
        out["mfu_vs_peak_run"] = out["jax"]["gflops"] / peak_gflops
        out["peak_run_gflops"] = peak_gflops
    if probe_peak or peak_gflops:
        # The conservative MFU: the step's median FLOP/s over the best matmul FLOP/s seen in this run
        # (the peak run's best shape or the interleaved probe, whichever was faster).
        best = max(peak_gflops or 0.0, out["matmul_probe"]["gflops"] if probe_peak else 0.0)
        out["best_matmul_gflops"] = best
        out["mfu"] = out["jax"]["gflops"] / best
    return out


def start_sides(checkpoint: str, kinds=DEFAULT_SIDES) -> dict[str, SideProcess]:
    """The side processes (`SIDES` keys; "jax" and "torch_eager" required) for one checkpoint; they
    load in parallel."""
    missing = {"jax", "torch_eager"} - set(kinds)
    if missing:
        raise ValueError(f"sides must include {sorted(missing)}; got {tuple(kinds)}")
    return {kind: SideProcess(kind, checkpoint) for kind in kinds}


def close_sides(sides: dict[str, SideProcess]) -> None:
    for side in sides.values():
        side.close()


def run(case: str | TrainCase = "small", rounds: int = 3, warmup: int = 1, sides=DEFAULT_SIDES,
        torch_compile: bool = False, peak_gflops: float | None = None, probe_peak: bool = False,
        seed: int = 0) -> dict:
    """Benchmarks one case, the `sides` (SIDES keys) alternating; returns the JSON-ready record.

    Keys: case, batch, seq, tokens_per_step, flops (roofline.train_step_flops), one summary per side
    (wall and CPU seconds per step, tokens_per_s, gflops, step_rss_growth_mib, the side process's
    peak_rss_mib, first_loss), speedup_vs_<side> for every side but jax (per-round median ratio),
    cpu_time_ratio_torch_eager_over_jax, loss_rel_diff (first-step losses of jax and torch_eager, which
    start from the same weights); with `probe_peak`, matmul_probe and mfu_paired (per-round step FLOP/s
    over the interleaved matmul's FLOP/s); with `probe_peak` or `peak_gflops`, mfu (median step FLOP/s
    over the best matmul FLOP/s of the run). `torch_compile` adds that side; its failures are reported
    as torch_compile_error instead of failing the run.
    """
    case = CASES[case] if isinstance(case, str) else case
    with tempfile.TemporaryDirectory() as checkpoint:
        qwen3.save_pretrained(qwen3.Qwen3ForCausalLM(case.config, rngs=nnx.Rngs(seed)), checkpoint)
        batch = make_batch(case, seed)
        processes = start_sides(checkpoint, sides)
        compile_error = None
        try:
            if torch_compile:
                processes["torch_compile"] = SideProcess("torch_compile", checkpoint)
                try:  # one compiled step, or the reason it does not work here
                    processes["torch_compile"].set_batch(batch)
                    processes["torch_compile"].step()
                except (RuntimeError, TimeoutError) as err:
                    compile_error = str(err).strip().splitlines()[-1][:300]
                    processes.pop("torch_compile").close()
            out = compare(case, processes, batch, rounds, warmup, peak_gflops, probe_peak)
        finally:
            close_sides(processes)
    if compile_error:
        out["torch_compile_error"] = compile_error
    return out


def markdown(results: list[dict]) -> str:
    """One row per case: respo-jax against each other side that ran (tokens/s and respo-jax's speedup)."""
    others = [kind for kind in SIDE_KINDS if kind != "jax" and any(kind in r for r in results)]
    columns = ["case", "batch × seq", "respo-jax tok/s"]
    for kind in others:
        columns += [f"{SIDES[kind].label} tok/s", f"speedup vs {SIDES[kind].label}"]
    columns += ["respo-jax GFLOP/s", "MFU", "loss |Δ|/|loss|"]
    rows = []
    for r in results:
        row = [r["case"], f"{r['batch']} × {r['seq']}", r["jax"]["tokens_per_s"]]
        for kind in others:
            row += ([r[kind]["tokens_per_s"], r[f"speedup_vs_{kind}"]] if kind in r else ["n/a", "n/a"])
        row += [r["jax"]["gflops"], r.get("mfu", "n/a"), f"{r['loss_rel_diff']:.1e}"]
        rows.append(row)
    return markdown_table(columns, rows)
