"""End-to-end RL iterations at the real Qwen3 vocabulary: respo-jax's trainer against TRL's GRPOTrainer.

    python -m experiments.benchmarks.rl_iteration                 # M = 1, 4 with TRL, 32 respo-jax alone
    python -m experiments.benchmarks.rl_iteration --minibatch-prompts 4 --iterations 4
    python -m experiments.benchmarks.rl_iteration --micro         # pipeline check on a micro model (seconds)
    python -m experiments.benchmarks.rl_iteration --minibatch-prompts 32 --iterations 2 --sides jax
                                                                  # the paper's mini-batch, respo-jax alone
    python -m experiments.benchmarks.rl_iteration --table results/rl_iteration.json ...
                                                                  # the race table file from result files

One iteration is what an RL researcher waits for (paper §4.1): sample G responses for each of N·M
DAPO-Math prompts, score them with the strict box, compute group advantages, get log π_old, then N
policy updates of M·G responses each (GRPO, token-mean). Both sides start from
one random Qwen3 checkpoint written by `transformers` (hidden 256, 4 layers, 4/2 heads, head_dim 64,
MLP 768, tied embeddings, vocabulary 151,936), see the same prompts in the same order (the
respo-jax trainer's prompt batches, handed to TRL as an unshuffled dataset), tokenized by the same Qwen3
tokenizer, and sample with the same settings (temperature 1, no top-k/top-p, 64 new tokens).

- respo-jax (`jax`, the headline side): `respo_jax.training.loop.RLTrainer.iteration()` with its
  defaults for this host (shape buckets, micro-batches, sampler row chunks), as `experiments/train.py`
  runs it, with `rollout.old_logprobs=recompute`: log π_old from a forward pass per mini-batch, the work
  TRL does. `--jax-set KEY=VALUE ...` overrides the config of both respo-jax sides.
- respo-jax with the sampler's log-probs (`jax_sampler`): the same trainer with
  `rollout.old_logprobs=sampler`, log π_old and the rollout entropy taken from its float32 sampler (exact
  for this float32 dense model, no forward pass). It is respo-jax's own option, reported beside the
  headline (`speedup_sampler_logprobs`), not the same work as TRL's.
- TRL: `trl.GRPOTrainer` with `steps_per_generation = N` (one generation of N·M·G completions, then N
  optimizer steps of M·G), `num_iterations = 1`, `beta = 0` (no reference model), `loss_type = "dapo"`
  (token-mean), driven through its own `train()` loop; one iteration = N optimizer steps. It recomputes
  log π_old with a forward pass (its gradient accumulation, 1, is not a multiple of `steps_per_generation`).

Same advantages for all: each side runs in its own process with 2 threads (XLA's pool and
`torch.set_num_threads`), the same glibc malloc settings (`respo_jax.host_allocator`; for TRL
without the JAX part), denormals flushed to zero on both (XLA's default), and no compilation on the
PyTorch side (`torch.compile` is not used; XLA compiles as part of respo-jax's time). The sides run
one after the other, each in a process of its own that is started, runs all its iterations and ends
before the next side's starts (no side runs beside another's memory); each reports wall time and its
process's peak RSS; the headline is the median of the ratios of the sides' times at the same
iteration (the same prompts) over the iterations after the first.

Where a respo-jax side's time goes is recorded with it: per iteration the wall and process CPU seconds
(both of its threads) of the rollout, log π_old, the N updates and the rest (`PhaseClock`).

What a researcher waits for at the start is reported twice per side. The first launch's first iteration
is cold: respo-jax's persistent compilation cache (`run.compilation_cache_dir`) is a directory created
empty for the race, never the user's. After the race each side is launched again, alone, with the same
configuration, and runs one iteration: respo-jax's new process reads its programs from the cache the
first launch wrote (its iteration metrics count the cache hits, `compile_cache_hits`); TRL's shows what
its own start costs a second time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback

from experiments.benchmarks.common import SpawnedSide, peak_rss_mib
from experiments.benchmarks.race_table import TABLE_FILE, THREADS, _number, race_table, run_description, write_table
from experiments.cli import ArgumentParser, run_cli
from respo_jax.training.config import ConfigError

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "..", "shared")
DATA_DIR = os.path.normpath(os.path.join(SHARED, "data"))
TOKENIZER_DIR = os.path.normpath(os.path.join(SHARED, "tokenizers", "qwen3"))

# The benchmark's model: a random Qwen3 at the real vocabulary (the LM head is most of its FLOPs).
MODEL = dict(vocab_size=151_936, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
# The respo-jax sides: log π_old recomputed (the same work as TRL's, the headline) or the sampler's.
JAX_SIDES = {"jax": "recompute", "jax_sampler": "sampler"}
KINDS = ("jax", "jax_sampler", "trl")
MICRO_MODEL = dict(vocab_size=151_936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
LEARNING_RATE = 1e-6  # TRL's default for GRPO


@dataclasses.dataclass(frozen=True)
class RaceCase:
    """One race: M prompts per mini-batch, G responses each, N mini-batches per rollout batch;
    `jax_overrides`: `key=value` overrides of the respo-jax side's trainer config (`--jax-set`)."""

    prompts_per_minibatch: int
    group_size: int = 8
    reuse: int = 4
    max_new_tokens: int = 64
    iterations: int = 6
    micro: bool = False
    jax_overrides: tuple[str, ...] = ()

    @property
    def model(self) -> dict:
        return MICRO_MODEL if self.micro else MODEL


def write_checkpoint(path: str, case: RaceCase, tokenizer_dir: str, seed: int = 0) -> None:
    """One random Qwen3 checkpoint in Hugging Face format, written by transformers, for both sides."""
    write_model_checkpoint(path, case.model, tokenizer_dir, seed)


def write_model_checkpoint(path: str, model: dict, tokenizer_dir: str, seed: int = 0,
                           max_positions: int = 2048) -> None:
    """A random Qwen3 of shape `model` (`MODEL`'s keys) in Hugging Face format, written by transformers,
    for sequences of up to `max_positions` tokens."""
    import torch
    import transformers

    from respo_jax.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    config = transformers.Qwen3Config(**model, max_position_embeddings=max_positions, rope_theta=1_000_000.0,
                                      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                                      bos_token_id=None)
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


def trainer_config(case: RaceCase, checkpoint: str, data_dir: str, tokenizer_dir: str,
                   cache_dir: str = "none", old_logprobs: str = "recompute"):
    """A respo-jax side's ExperimentConfig (the trainer's own defaults for buckets and memory), its
    persistent compilation cache in `cache_dir` (`run.compilation_cache_dir`; "none": off) and where its
    log π_old comes from (`rollout.old_logprobs`: "recompute" or "sampler")."""
    from experiments.train import DEFAULT_CONFIG, load_config
    from respo_jax.training.config import RolloutConfig, apply_overrides

    return apply_overrides(load_config(DEFAULT_CONFIG), [
        "task.name=dapo_math", f"task.data_dir={data_dir}", f"task.tokenizer_dir={tokenizer_dir}",
        "task.chat_template=false", f"model.checkpoint_dir={checkpoint}", "model.scan_layers=false",
        "warmup.steps=0", "run.eval_problems=0", "run.progress=false", f"run.iterations={case.iterations}",
        f"run.compilation_cache_dir={cache_dir}",
        f"rollout.prompts_per_minibatch={case.prompts_per_minibatch}", f"rollout.group_size={case.group_size}",
        f"rollout.reuse={case.reuse}", f"rollout.max_new_tokens={case.max_new_tokens}",
        # The rollout section's own bucket (sized for DAPO-Math's 27-977-token prompts), not the default
        # experiment's 16 (sized for its 12-token synthetic prompts: a new shape every 16 tokens).
        f"rollout.prompt_bucket={RolloutConfig.prompt_bucket}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        "objective.name=grpo", "objective.hparams.eps_low=0.2", "objective.hparams.eps_high=0.2",
        f"optim.learning_rate={LEARNING_RATE}", "optim.weight_decay=0.0", "optim.max_grad_norm=1.0",
        *case.jax_overrides, f"rollout.old_logprobs={old_logprobs}",
    ])


def prompt_stream(config, count: int) -> list[dict]:
    """The first `count` records the respo-jax trainer will draw (its prompt batches, in order), with
    the prompt text it tokenizes: TRL gets exactly these, unshuffled."""
    from respo_jax.data.batches import PromptBatches
    from respo_jax.data.prompts import render_prompt
    from respo_jax.training.tasks import load_task

    tokenizer, fmt, train, *_ = load_task(config)
    r = config.rollout
    batches = PromptBatches(train, batch_size=r.reuse * r.prompts_per_minibatch, seed=config.task.seed)
    records = []
    while len(records) < count:
        records.extend(next(batches))
    return [{"prompt": render_prompt(rec["problem"], tokenizer, fmt), "answer": rec["answer"],
             "prompt_tokens": len(tokenizer.encode(render_prompt(rec["problem"], tokenizer, fmt),
                                                   add_special_tokens=not fmt.chat))}
            for rec in records[:count]]


# ----------------------------------------------------------------------------------------------- sides


# An RL iteration's phases as the trainer runs them (`RLTrainer.iteration`), each the method that runs it.
PHASES = (("rollout", "next_rollout"), ("old_logprobs", "with_old_logprobs"), ("updates", "update"))


class PhaseClock:
    """Wall and process CPU seconds (all threads) of each phase of a trainer's iterations: the rollout
    with its rewards, log π_old (a forward pass per mini-batch, or the sampler's), the N updates, and
    `other` (the rest of the iteration: advantages, metrics, the first iteration's compile-ahead).

    Each phase's method is wrapped on the trainer instance; log π_old is waited for before its clock
    stops (the updates read it next, so nothing runs later than it would), the rollout and the updates
    end on the host already. `take(wall_s, cpu_s)` returns one iteration's
    {"wall_s": {phase: s}, "cpu_s": {phase: s}} and starts the next."""

    def __init__(self, trainer):
        self.totals = {}
        for phase, method in PHASES:
            setattr(trainer, method, self._timed(phase, getattr(trainer, method)))

    def _timed(self, phase: str, method):
        import jax

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(method(*args, **kwargs))
            spent = self.totals.setdefault(phase, [0.0, 0.0])
            spent[0] += time.perf_counter() - wall
            spent[1] += time.process_time() - cpu
            return out

        return timed

    def take(self, wall_s: float, cpu_s: float) -> dict:
        out = {"wall_s": {}, "cpu_s": {}}
        for i, (key, whole) in enumerate((("wall_s", wall_s), ("cpu_s", cpu_s))):
            out[key] = {phase: self.totals.get(phase, [0.0, 0.0])[i] for phase, _ in PHASES}
            out[key]["other"] = whole - sum(out[key].values())
        self.totals = {}
        return out


def _jax_side(conn, case: RaceCase, checkpoint: str, data_dir: str, tokenizer_dir: str, cache_dir: str,
              old_logprobs: str = "recompute") -> None:
    from respo_jax.host_allocator import configure_host_allocator, host_allocator_settings

    configure_host_allocator()  # as experiments/train.py does (run.host_allocator=true)
    from respo_jax.training.compilation import configure_compilation_cache
    from respo_jax.training.loop import RLTrainer

    config = trainer_config(case, checkpoint, data_dir, tokenizer_dir, cache_dir, old_logprobs)
    configure_compilation_cache(config.run.compilation_cache_dir)  # as experiments/train.py does
    trainer = RLTrainer(config)
    clock = PhaseClock(trainer)
    conn.send(("ok", {"host_allocator": host_allocator_settings(), "peak_rss_mib": peak_rss_mib(),
                      "pid": os.getpid()}))
    while conn.recv() == "iterate":
        started, cpu = time.perf_counter(), time.process_time()
        record = trainer.iteration()
        wall_s = time.perf_counter() - started
        conn.send(("ok", {"wall_s": wall_s, "peak_rss_mib": peak_rss_mib(),
                          "phases": clock.take(wall_s, time.process_time() - cpu),
                          **{k: record[k] for k in ("compiles", "compile_seconds", "compile_cache_hits",
                                                    "rollout_seconds", "response_length", "score", "loss")}}))


def _trl_side(conn, case: RaceCase, checkpoint: str, tokenizer_dir: str, records: list[dict]) -> None:
    from respo_jax.host_allocator import configure_host_allocator, host_allocator_settings

    configure_host_allocator(jax_dispatch=False)  # the same malloc settings; this process runs no JAX
    import datasets
    import torch
    import transformers
    import trl

    from respo_jax.rewards import strict_box_score

    torch.set_num_threads(THREADS)
    torch.set_flush_denormal(True)  # XLA:CPU flushes denormals by default
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt_tokens = [len(tokenizer(text=r["prompt"])["input_ids"]) for r in records]  # as TRL tokenizes them
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])

    def strict_box(prompts, completions, answer, **_):
        return [strict_box_score(c, a) for c, a in zip(completions, answer)]

    class Driver(transformers.TrainerCallback):
        """Hands control to the parent after every N optimizer steps (one TRL iteration)."""

        def __init__(self):
            self.steps, self.started = 0, None

        def on_train_begin(self, args, state, control, **_):
            if conn.recv() != "iterate":
                control.should_training_stop = True
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            self.steps += 1
            if self.steps % case.reuse:
                return
            metrics = trainer._metrics["train"]
            conn.send(("ok", {"wall_s": time.perf_counter() - self.started, "peak_rss_mib": peak_rss_mib(),
                              "response_length": float(metrics["completions/mean_length"][-1])
                              if metrics.get("completions/mean_length") else None}))
            if conn.recv() != "iterate":
                control.should_training_stop = True
            self.started = time.perf_counter()

    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=case.prompts_per_minibatch * case.group_size,
            gradient_accumulation_steps=1, num_generations=case.group_size, steps_per_generation=case.reuse,
            num_iterations=1, max_completion_length=case.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", learning_rate=LEARNING_RATE,
            weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
            max_steps=case.reuse * case.iterations, shuffle_dataset=False, seed=0, use_cpu=True, bf16=False,
            report_to="none", save_strategy="no", logging_steps=case.reuse, disable_tqdm=True,
            dataloader_num_workers=0,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=strict_box, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[Driver()])
        conn.send(("ok", {"host_allocator": host_allocator_settings(), "peak_rss_mib": peak_rss_mib(),
                          "prompt_tokens": prompt_tokens, "trl": trl.__version__, "pid": os.getpid()}))
        trainer.train()


def _side_main(conn, kind: str, *args) -> None:
    try:
        (_trl_side if kind == "trl" else _jax_side)(conn, *args)
    except Exception:  # noqa: BLE001 (reported to the parent)
        conn.send(("error", traceback.format_exc()))


class Side(SpawnedSide):
    """A side's process (one launch); `iterate()` runs one RL iteration there and returns its record.
    `load` is what the side reported once ready, `load_s` the seconds from spawning it until then."""

    join_s = 60.0

    def __init__(self, kind: str, *args, timeout_s: float = 3600.0):
        started = time.perf_counter()
        super().__init__(kind, _side_main, (kind, *args), timeout_s=timeout_s)
        self.load = self._reply()
        self.load_s = time.perf_counter() - started
        self.records: list[dict] = []

    def iterate(self) -> dict:
        self._conn.send("iterate")
        record = self._reply()
        self.records.append(record)
        return record


# ------------------------------------------------------------------------------------------------ race

CACHE_ENTRY_SUFFIX = "-cache"  # how JAX names the file of one program in the persistent compilation cache


def _cache_entries(cache_dir: str) -> int:
    return sum(1 for name in os.listdir(cache_dir) if name.endswith(CACHE_ENTRY_SUFFIX))


def _log_iteration(log, case: RaceCase, label: str, kind: str, record: dict) -> None:
    compiled = (f", {record['compiles']} compilations ({record['compile_cache_hits']} from the cache, "
                f"{record['compile_seconds']:.1f} s)" if "compiles" in record else "")
    log(f"[rl_iteration] M={case.prompts_per_minibatch} {label} {kind}: {record['wall_s']:.2f} s, "
        f"peak RSS {record['peak_rss_mib']:.0f} MiB{compiled}", flush=True)


def _first_launch(case: RaceCase, kinds: tuple[str, ...], args: dict, records: list[dict], log) -> dict[str, Side]:
    """Every side in `kinds` launched and run for `case.iterations` iterations, one side after the other:
    each side's process is started, runs all its iterations and ends before the next side's starts, so
    no side runs (or starts) beside another's memory."""
    sides = {}
    for kind in kinds:
        side = sides[kind] = Side(kind, *args[kind])
        try:
            if kind == "trl" and side.load["prompt_tokens"] != [r["prompt_tokens"] for r in records]:
                raise RuntimeError("TRL's tokenizer gives other prompt lengths than respo-jax's")
            for index in range(case.iterations):
                _log_iteration(log, case, f"iteration {index + 1}", kind, side.iterate())
        finally:
            side.close()
    return sides


def _second_launch(kind: str, args: tuple, case: RaceCase, log) -> Side:
    """The same side launched again, in a process of its own, for its first iteration only."""
    side = Side(kind, *args)
    try:
        _log_iteration(log, case, "second launch, iteration 1", kind, side.iterate())
    finally:
        side.close()
    return side


def run(case: RaceCase, data_dir: str = DATA_DIR, tokenizer_dir: str = TOKENIZER_DIR, log=print,
        kinds: tuple[str, ...] = KINDS, second_launch: bool = True) -> dict:
    """Runs `case.iterations` iterations of each side in `kinds`, one side after the other, then (with
    `second_launch`) launches each side again, alone, for one iteration; returns `summary`'s record.

    respo-jax's compilation cache (`run.compilation_cache_dir`) is a directory created empty for this
    race, never the user's cache, one per respo-jax side: the first launch's first iteration is cold, and
    the second launch of the same configuration (a new process) reads the programs the first launch
    wrote."""
    if case.iterations < (2 if "trl" in kinds and len(kinds) > 1 else 1):
        raise ConfigError(f"--iterations {case.iterations}: a race against TRL needs at least 2 (the first "
                          "is excluded from the ratio)")
    with tempfile.TemporaryDirectory(prefix="rl_iteration_") as work:
        checkpoint = os.path.join(work, "checkpoint")
        caches = {kind: os.path.join(work, f"compilation_cache_{kind}") for kind in JAX_SIDES}
        for cache_dir in caches.values():
            os.makedirs(cache_dir)
        write_checkpoint(checkpoint, case, tokenizer_dir)
        config = trainer_config(case, checkpoint, data_dir, tokenizer_dir)
        records = prompt_stream(config, case.iterations * case.reuse * case.prompts_per_minibatch)
        args = {kind: (case, checkpoint, data_dir, tokenizer_dir, caches[kind], source)
                for kind, source in JAX_SIDES.items()}
        args["trl"] = (case, checkpoint, tokenizer_dir, records)
        first = _first_launch(case, kinds, args, records, log)
        entries = {kind: _cache_entries(caches[kind]) for kind in JAX_SIDES if kind in kinds}
        second = {kind: _second_launch(kind, args[kind], case, log) for kind in (kinds if second_launch else ())}
    return summary(case, first, second, records, entries)


def _phase_medians(records: list[dict]) -> dict | None:
    """{"wall_s" | "cpu_s": {phase: median over `records`}} of the records' `phases`; None without."""
    from experiments.benchmarks.common import median

    phases = [r["phases"] for r in records if r.get("phases")]
    if not phases:
        return None
    return {clock: {phase: median([p[clock][phase] for p in phases]) for phase in phases[0][clock]}
            for clock in ("wall_s", "cpu_s")}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def summary(case: RaceCase, first: dict[str, Side], second: dict[str, Side], records: list[dict],
            cache_entries: dict[str, int]) -> dict:
    """The race's JSON record. Per side (`jax`: log π_old recomputed; `jax_sampler`: the sampler's;
    `trl`): `first_s` (the first iteration, respo-jax's cache cold),
    `second_launch_first_s` (the first iteration of the second launch; None without one), `median_s`
    (iterations after the first), `peak_rss_mib` (the first launch's process), `times_s`, and the second
    launch's own record under `second_launch` (its process id, start-up seconds and iteration record).
    Top level: `speedup` (median of the per-iteration TRL / respo-jax ratios after the first, log π_old
    recomputed on both sides), `speedup_sampler_logprobs` (the same with the `jax_sampler` side),
    `second_launch_vs_median`, `cold_first_vs_trl_first` and `rss_ratio_trl_over_jax` (of the `jax`
    side; None where a side or a launch did not run). A respo-jax side also has `phases` (per
    iteration, `PhaseClock.take`'s wall and CPU seconds of the rollout, log π_old, the updates and the
    rest) and `phase_median_s` (their medians over the iterations after the first)."""
    from experiments.benchmarks.common import median

    out = {"case": dataclasses.asdict(case), "model": case.model, "threads": THREADS,
           "prompt_tokens_mean": sum(r["prompt_tokens"] for r in records) / len(records),
           "trl_version": first["trl"].load["trl"] if "trl" in first else None}
    for kind, side in first.items():
        wall = [r["wall_s"] for r in side.records]
        relaunch = second.get(kind)
        out[kind] = {"times_s": wall, "first_s": wall[0],
                     "second_launch_first_s": relaunch.records[0]["wall_s"] if relaunch else None,
                     "median_s": median(wall[1:]) if wall[1:] else None,
                     "peak_rss_mib": max(r["peak_rss_mib"] for r in side.records),
                     "pid": side.load["pid"], "load_s": side.load_s,
                     "response_length": [r.get("response_length") for r in side.records],
                     "host_allocator": side.load["host_allocator"],
                     "second_launch": ({"pid": relaunch.load["pid"], "load_s": relaunch.load_s, **relaunch.records[0]}
                                       if relaunch else None)}
    for kind in JAX_SIDES:
        if kind not in first:
            continue
        jax_records, jax_side = first[kind].records, out[kind]
        jax_side["old_logprobs"] = JAX_SIDES[kind]
        for key in ("compiles", "compile_seconds", "compile_cache_hits", "rollout_seconds", "phases"):
            jax_side[key] = [r.get(key) for r in jax_records]
        jax_side["phase_median_s"] = _phase_medians(jax_records[1:])
        after_two = jax_records[2:]
        jax_side["compile_fraction_after_two"] = (
            sum(r["compile_seconds"] for r in after_two) / sum(r["wall_s"] for r in after_two) if after_two else None)
        jax_side["cache_entries_written"] = cache_entries.get(kind)  # by the first launch
    if "jax" in first:
        out["second_launch_vs_median"] = _ratio(out["jax"]["second_launch_first_s"], out["jax"]["median_s"])
    if "trl" in first:
        trl_times = out["trl"]["times_s"][1:]
        for kind, key in (("jax", "speedup"), ("jax_sampler", "speedup_sampler_logprobs")):
            if kind in first:
                out[key] = median([t / j for t, j in zip(trl_times, out[kind]["times_s"][1:])])
    if "jax" in first and "trl" in first:
        jax_side, trl_side = out["jax"], out["trl"]
        out["cold_first_vs_trl_first"] = jax_side["first_s"] / trl_side["first_s"]
        out["rss_ratio_trl_over_jax"] = trl_side["peak_rss_mib"] / jax_side["peak_rss_mib"]
    return out


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m experiments.benchmarks.rl_iteration",
                            description=__doc__.split("\n")[0])
    parser.add_argument("--minibatch-prompts", type=int, nargs="+", default=[1, 4, 32],
                        help="M values to race")
    parser.add_argument("--iterations", type=int, default=6, help="iterations per side (the first is excluded)")
    parser.add_argument("--micro", action="store_true", help="micro model, M=1, G=2, N=2, 4 new tokens")
    parser.add_argument("--sides", nargs="+", choices=KINDS, default=list(KINDS),
                        help="which sides run (jax: log π_old recomputed; jax_sampler: the sampler's; "
                             "without trl: times and peak RSS, no ratio)")
    parser.add_argument("--jax-only-above", type=int, default=4, metavar="M",
                        help="above this M the respo-jax sides run alone (TRL does not finish there)")
    parser.add_argument("--jax-only-iterations", type=int, default=2,
                        help="iterations per side of the cases the respo-jax sides run alone")
    parser.add_argument("--name", default=None,
                        help="the result files' stem in --out (default rl_iteration, or one naming the "
                             "sides and M values when --sides leaves one out)")
    parser.add_argument("--no-second-launch", action="store_true",
                        help="skip each side's second launch (its first iteration, respo-jax's cache warm)")
    parser.add_argument("--jax-set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="overrides of both respo-jax sides' trainer config (not rollout.old_logprobs: "
                             "each side sets its own)")
    parser.add_argument("--data-dir", default=DATA_DIR)
    parser.add_argument("--tokenizer-dir", default=TOKENIZER_DIR)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="no race: write the race table file from these result files")
    parser.add_argument("--table-out", default=TABLE_FILE, help=f"the race table file (default {TABLE_FILE})")
    args = parser.parse_args(argv)
    if args.table:
        write_table(args.table, args.table_out)
        print(f"wrote the race table {args.table_out} from {', '.join(args.table)}")
        return 0
    command = "python -m experiments.benchmarks.rl_iteration " + " ".join(argv if argv is not None else sys.argv[1:])
    from experiments.benchmarks import common

    started = time.perf_counter()
    overrides = tuple(args.jax_set)
    if any(item.split("=", 1)[0].strip() == "rollout.old_logprobs" for item in overrides):
        raise ConfigError("--jax-set rollout.old_logprobs: each respo-jax side sets its own "
                          "(jax: recompute, jax_sampler: sampler); choose them with --sides")
    for flag in ("iterations", "jax_only_iterations"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    kinds = tuple(kind for kind in KINDS if kind in args.sides)

    def case_kinds(m: int) -> tuple[str, ...]:
        return tuple(k for k in kinds if k != "trl" or m <= args.jax_only_above)

    if args.micro:
        cases = [RaceCase(1, group_size=2, reuse=2, max_new_tokens=4, iterations=args.iterations, micro=True,
                          jax_overrides=overrides)]
    else:
        cases = [RaceCase(m, jax_overrides=overrides,
                          iterations=args.iterations if "trl" in case_kinds(m) else args.jax_only_iterations)
                 for m in args.minibatch_prompts]
    for case in cases:  # the side's own config with the overrides; a bad one: one line before anything runs
        placeholder = os.path.join(args.out, "checkpoint")  # validate() reads no files
        for source in JAX_SIDES.values():
            config = trainer_config(case, placeholder, args.data_dir, args.tokenizer_dir, old_logprobs=source)
            config.validate()
    stem = "rl_iteration_micro" if args.micro else "rl_iteration"
    if kinds != KINDS:
        stem += "_" + "_".join(kinds) + "_m" + "_".join(str(m) for m in args.minibatch_prompts)
    stem = args.name or stem
    results = []
    for case in cases:  # the files are rewritten after each case: a run stopped later keeps what it measured
        kinds_here = case_kinds(case.prompts_per_minibatch)
        results.append(run(case, args.data_dir, args.tokenizer_dir, kinds=kinds_here,
                           second_launch=not args.no_second_launch))
        payload = {"command": command.strip(), "results": results, "wall_s": time.perf_counter() - started,
                   "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}
        common.write_json(os.path.join(args.out, f"{stem}.json"), payload)
        common.write_markdown(os.path.join(args.out, f"{stem}.md"), "RL iteration: respo-jax vs TRL GRPOTrainer", [
            ("Command", run_description(payload)), ("Results", race_table(results))])
    if os.path.abspath(args.out) == DEFAULT_OUT and not args.micro:  # the docs' results from the JSON
        from experiments.benchmarks import report

        report.regenerate()
    for r in results:
        sides = "; ".join(f"{kind} {_number(r[kind]['median_s'])} s/iter (first {_number(r[kind]['first_s'])} s, "
                          f"second launch {_number(r[kind]['second_launch_first_s'])} s), peak RSS "
                          f"{r[kind]['peak_rss_mib']:.0f} MiB" for kind in kinds if kind in r)
        ratio = "".join(f", {key} {r[key]:.2f}x" for key in ("speedup", "speedup_sampler_logprobs")
                        if key in r)
        print(f"M={r['case']['prompts_per_minibatch']}: {sides}{ratio}")
    return 0


if __name__ == "__main__":  # a bad flag: one line, exit status 2 (experiments.cli)
    sys.exit(run_cli(main, sys.argv[1:]))
