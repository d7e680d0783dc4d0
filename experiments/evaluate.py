"""Evaluate a checkpoint with the paper's protocol (§4.1, App. D.2) and write its Tab. 1 row (App. D.3).

    python -m experiments.evaluate eval.checkpoint=/models/qwen3-1.7b-respo             # the paper's protocol
    python -m experiments.evaluate eval.checkpoint=runs/respo_n8 eval.dtype=bfloat16     # a training run dir
    python -m experiments.evaluate eval.checkpoint=DIR eval.limit=3 eval.samples=2 eval.max_new_tokens=64
    python -m experiments.evaluate eval.checkpoint=runs/respo_synthetic eval.benchmarks=synthetic \\
        eval.max_new_tokens=8                                                           # a synthetic-task run

`eval.checkpoint` is a Hugging Face directory (config.json, safetensors, tokenizer.json; the chat template
is used when the tokenizer has one) or a training run directory (its latest checkpoint under
checkpoints/, its tokenizer and prompt format from its config.json). Outputs in `eval.out_dir`:

  completions.jsonl  one scored sample per line (`respo_jax.eval.completions`), append-only
  summary.json/.md   per-benchmark pass@1, the macro average and its cluster-bootstrap SE (Tab. 1)
  eval_config.json   the configuration and the protocol the completions were generated with

Rerunning the same command resumes: completions already written are skipped (a torn last line is cut
off first). Each sample is seeded by (eval.seed, benchmark, problem, sample index), never by where it
falls in a sampler call, so a resumed evaluation writes the same completions as an uninterrupted one,
whatever `eval.batch_size`. A different protocol (checkpoint, sampling, prompt format, dtype, seed,
data) in the same out_dir is refused unless `eval.overwrite=true`; the benchmark list and `eval.limit`
may change between runs (only the requested completions are generated and summarized).

Errors: everything is checked before the first write (the config, the checkpoint's files and weights,
the benchmark files, the prompts' lengths against the model's positions, the out_dir and what it holds),
and a refusal is one line on stderr with exit status 2 that leaves nothing behind; a second evaluation
writing the same out_dir is refused naming the one that holds it. A write that fails later (a full
disk) is one line naming the file and the free space, exit status 1; the completions written so far stay.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import sys
import zlib
from typing import Callable

import experiments.signals_at_start  # noqa: F401  (first: a signal during the imports below stops cleanly)

import numpy as np
from tqdm import tqdm

from experiments.cli import ArgumentParser, run_cli, run_failures
from experiments.cli import load_config
from respo_jax.data import (
    ArithmeticTask,
    CharTokenizer,
    PromptFormat,
    Tokenizer,
    encode_prompt,
    load_benchmark,
    load_tokenizer,
)
from respo_jax.eval.completions import (
    append_completions,
    completion_key,
    load_completions,
    repair_completions,
    summarize_completions,
    summary_markdown,
)
from respo_jax.eval.config import LOADER_NAMES, SYNTHETIC, EvalConfig, EvalSettings
from respo_jax.training.compilation import configure_compilation_cache
from respo_jax.training.config import ConfigError, ExperimentConfig, apply_overrides, config_from_dict
from respo_jax import runs
from respo_jax.runs import atomic_write_bytes, atomic_write_json, read_json
from respo_jax.training import preemption
from respo_jax.training.run_lock import RunLock
from respo_jax.training.write_errors import writing

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "eval_paper.py")
# The synthetic task's held-out stream: the same problems as the trainer's greedy evaluation
# (`respo_jax.training.tasks.load_task`: task.seed + 7919), extended to `eval.synthetic_problems`.
SYNTHETIC_HELD_OUT_OFFSET = 7919
OUTPUT_FILES = (runs.COMPLETIONS_FILE, runs.EVAL_SUMMARY_FILE, runs.EVAL_SUMMARY_MARKDOWN)


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint to evaluate, resolved but not yet loaded (`build_model` loads it)."""

    kind: str  # "huggingface" or "run"
    path: str  # absolute
    step: int | None  # a run's checkpoint step
    fingerprint: str  # changes when the weights on disk change
    tokenizer: Tokenizer
    prompt_format: PromptFormat
    dtype: str
    synthetic_task: ArithmeticTask | None
    synthetic_seed: int
    max_positions: int  # the model's max_position_embeddings: prompt + response must fit
    head_dim: int  # the model's attention head size (what the paged-attention kernel must lower)
    build_model: Callable[[], object]

    @property
    def label(self) -> str:
        name = os.path.basename(self.path.rstrip(os.sep))
        return f"{name} (step {self.step})" if self.step is not None else name


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One completion to produce: sample `sample` of problem `problem_index` of `benchmark`."""

    benchmark: str
    problem_index: int
    record: dict  # {"problem", "answer", "id"}
    sample: int

    @property
    def key(self) -> tuple[str, str, int]:
        return self.benchmark, self.record["id"], self.sample


# --------------------------------------------------------------------------------------------------
# Checkpoints


def _jnp_dtype(name: str):
    import jax.numpy as jnp

    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def _chat(setting: str, default: bool) -> bool:
    return default if setting == "auto" else setting == "true"


def _hf_fingerprint(path: str) -> str:
    digest = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as handle:
        digest.update(handle.read())
    for name in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        info = os.stat(name)
        digest.update(f"{os.path.basename(name)}:{info.st_size}:{info.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _refuse(settings: EvalSettings, problem: str) -> ConfigError:
    """The one-line start-up refusal of a checkpoint: `eval.checkpoint='...': <problem>`."""
    return ConfigError(f"eval.checkpoint={settings.checkpoint!r}: {' '.join(str(problem).split())}")


def _resolve_huggingface(path: str, settings: EvalSettings, mesh) -> Checkpoint:
    from respo_jax.models import qwen3

    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise _refuse(settings, "a Hugging Face checkpoint directory needs tokenizer.json next to its "
                      "weights")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise _refuse(settings, "a Hugging Face checkpoint directory needs *.safetensors weights")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
            hf_config = json.load(handle)
        model_config = qwen3.load_config(path)
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable JSON or tokenizer, foreign config
        raise _refuse(settings, err) from None
    if settings.chat_template == "true" and not tokenizer.has_chat_template:
        raise ConfigError(f"eval.chat_template='true': expected a tokenizer with a chat template; the one "
                          f"in {path} has none")
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype")
    dtype = settings.dtype or ("bfloat16" if declared == "bfloat16" else "float32")
    return Checkpoint(
        kind="huggingface", path=path, step=None, fingerprint=_hf_fingerprint(path), tokenizer=tokenizer,
        prompt_format=PromptFormat(chat=_chat(settings.chat_template, tokenizer.has_chat_template)),
        dtype=dtype, synthetic_task=None, synthetic_seed=0,
        max_positions=model_config.max_position_embeddings, head_dim=model_config.head_dim,
        build_model=lambda: qwen3.from_pretrained(path, dtype=_jnp_dtype(dtype), mesh=mesh),
    )


def _resolve_run(path: str, settings: EvalSettings, mesh) -> Checkpoint:
    from flax import nnx

    from respo_jax.training.checkpoint import latest_step, restore_params
    from respo_jax.training.model_setup import build_model as build_run_model

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
            run_config = config_from_dict(ExperimentConfig, json.load(handle))
    except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable, not JSON, not a run's config
        raise _refuse(settings, f"the run's config.json: {err}") from None
    checkpoint_dir = os.path.join(path, "checkpoints")
    step = latest_step(checkpoint_dir)
    if step is None:
        raise _refuse(settings, f"the run directory has no checkpoint under {checkpoint_dir}")
    dtype = settings.dtype or run_config.model.dtype
    run_config = dataclasses.replace(run_config, model=dataclasses.replace(run_config.model, dtype=dtype))
    task_cfg = run_config.task
    if task_cfg.name == "synthetic":
        if settings.chat_template == "true":
            raise ConfigError("eval.chat_template='true': expected auto or false; a synthetic-task run's "
                              "character tokenizer has no chat template")
        task = task_cfg.synthetic_task()
        tokenizer, prompt_format = CharTokenizer(), task.prompt_format
    else:
        task = None
        try:
            tokenizer = load_tokenizer(task_cfg.tokenizer_dir)
        except (OSError, ValueError) as err:
            raise _refuse(settings, f"the run's tokenizer (task.tokenizer_dir): {err}") from None
        prompt_format = PromptFormat(chat=_chat(settings.chat_template, task_cfg.chat_template))
    abstract = nnx.eval_shape(lambda: build_run_model(run_config, tokenizer.vocab_size, mesh))

    def build_model():
        graphdef, abstract_state = nnx.split(abstract)
        params, _, _ = restore_params(checkpoint_dir, abstract_state, step)
        return nnx.merge(graphdef, params)

    return Checkpoint(
        kind="run", path=path, step=step, fingerprint=f"step-{step}", tokenizer=tokenizer,
        prompt_format=prompt_format, dtype=dtype, synthetic_task=task,
        synthetic_seed=task_cfg.seed + SYNTHETIC_HELD_OUT_OFFSET,
        max_positions=abstract.config.max_position_embeddings, head_dim=abstract.config.head_dim,
        build_model=build_model,
    )


def resolve_checkpoint(settings: EvalSettings, mesh=None) -> Checkpoint:
    """A Hugging Face directory or a training run directory (see the module docstring), whose model
    will be built on `mesh` (None: one device); ConfigError naming eval.checkpoint when it is neither
    or its files do not read."""
    path = os.path.abspath(settings.checkpoint)
    if not os.path.isdir(path):
        raise _refuse(settings, "expected a directory (a Hugging Face checkpoint or a training run)")
    if os.path.isdir(os.path.join(path, "checkpoints")) and os.path.isfile(os.path.join(path, "config.json")):
        return _resolve_run(path, settings, mesh)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _resolve_huggingface(path, settings, mesh)
    raise _refuse(settings, "expected a Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json) "
                  "or a training run directory (config.json and checkpoints/); this has neither")


def load_model(checkpoint: Checkpoint, settings: EvalSettings):
    """The checkpoint's model with its weights (ConfigError naming eval.checkpoint when they do not
    load: a damaged safetensors file or Orbax step, missing or mis-shaped tensors)."""
    from respo_jax.training.checkpoint import CheckpointError

    try:
        return checkpoint.build_model()
    except (OSError, ValueError, KeyError, CheckpointError) as err:
        raise _refuse(settings, f"the weights do not load: {err}") from None


# --------------------------------------------------------------------------------------------------
# What to generate


def load_problems(settings: EvalSettings, checkpoint: Checkpoint) -> dict[str, list[dict]]:
    """benchmark -> its records (the first `eval.limit` when set), in the requested order. ConfigError
    for a benchmark the checkpoint cannot take, a missing or malformed benchmark file, repeated ids."""
    problems = {}
    for name in settings.benchmark_names():
        if name == SYNTHETIC:
            if checkpoint.synthetic_task is None:
                raise ConfigError("eval.benchmarks='synthetic': expected a synthetic-task training run as "
                                  f"eval.checkpoint; {checkpoint.path} is not one")
            task, count = checkpoint.synthetic_task, settings.synthetic_problems
            records = task.make_records(count, checkpoint.synthetic_seed,
                                        split="test" if task.test_fraction else "all")
        else:
            if checkpoint.synthetic_task is not None:
                raise ConfigError(f"eval.benchmarks={settings.benchmarks!r}: expected synthetic; "
                                  f"{checkpoint.path} is a synthetic-task run whose character tokenizer "
                                  f"cannot encode {name!r}")
            try:
                records = load_benchmark(LOADER_NAMES[name], settings.data_dir)
            except (OSError, ValueError) as err:  # missing, or malformed (DataFileError names file and line)
                raise ConfigError(f"eval.data_dir={settings.data_dir!r}: benchmark {name!r}: "
                                  f"{' '.join(str(err).split())}") from None
        if settings.limit:
            records = records[: settings.limit]
        ids = [record["id"] for record in records]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"eval.data_dir={settings.data_dir!r}: benchmark {name!r} has repeated problem "
                              "ids; its completions could not be told apart")
        problems[name] = records
    return problems


def work_items(problems: dict[str, list[dict]], settings: EvalSettings) -> list[WorkItem]:
    """Every wanted completion, benchmark by benchmark, problem-major."""
    return [
        WorkItem(name, index, record, sample)
        for name, records in problems.items()
        for index, record in enumerate(records)
        for sample in range(settings.samples_for(name))
    ]


def sample_id(item: WorkItem) -> int:
    """The sampler's row id of `item` (`generate(row_ids=...)`, with `eval.seed` as the seed): a stable
    32-bit hash of (benchmark, problem index, sample) alone, so a completion is the same whichever call
    and row generate it, and an interrupted evaluation resumes with exactly the uninterrupted samples."""
    words = np.random.SeedSequence(
        [zlib.crc32(item.benchmark.encode()), item.problem_index, item.sample]
    ).generate_state(1, np.uint32)
    return int(words[0])


def protocol_of(settings: EvalSettings, checkpoint: Checkpoint) -> dict:
    """Everything that decides what a completion is; a resumed run must match it exactly."""
    fmt = checkpoint.prompt_format
    return {
        "checkpoint": checkpoint.path,
        "checkpoint_kind": checkpoint.kind,
        "checkpoint_step": checkpoint.step,
        "checkpoint_fingerprint": checkpoint.fingerprint,
        "data_dir": None if checkpoint.synthetic_task else os.path.abspath(settings.data_dir),
        "samples": settings.samples,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "max_new_tokens": settings.max_new_tokens,
        "chat_template": fmt.chat,
        "prompt_template": fmt.template,
        "response_prefix": fmt.response_prefix,
        "dtype": checkpoint.dtype,
        "seed": settings.seed,
        # How samples are seeded: completions made otherwise (per sampler call, before) are not mixed in.
        "sample_seeding": "eval.seed, row id sample_id(benchmark, problem_index, sample)",
        "scorer": "math_verify (verl math_metric, App. D.2)",
    }


# --------------------------------------------------------------------------------------------------
# The output directory


def _writing(path: str, what: str):
    """`respo_jax.training.write_errors.writing`: a write the disk refuses (full, read-only) is one
    RunWriteError line naming the file, what was being written and the free space (exit status 1)."""
    return writing(what, path, after="what was written before is intact: make room and rerun to resume")


def lock_out_dir(out_dir: str) -> RunLock:
    """The exclusive lock of `out_dir` (created when missing): one writer per evaluation directory.
    ConfigError naming eval.out_dir when it cannot be written, RunLockedError (a ConfigError) naming
    the holder."""
    return RunLock.acquire(out_dir, "evaluation", key="eval.out_dir")


def check_out_dir(out_dir: str, config: EvalConfig, protocol: dict) -> None:
    """Refuses (ConfigError) an out_dir holding another protocol's outputs unless eval.overwrite.
    Reads only."""
    if config.eval.overwrite:
        return
    config_path = os.path.join(out_dir, runs.EVAL_CONFIG_FILE)
    present = [name for name in OUTPUT_FILES if os.path.exists(os.path.join(out_dir, name))]
    if os.path.exists(config_path):
        try:
            previous = read_json(config_path)["protocol"]
            changed = [f"{key}: {previous.get(key)!r} -> {protocol.get(key)!r}"
                       for key in sorted(set(previous) | set(protocol))
                       if previous.get(key) != protocol.get(key)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"eval.out_dir={out_dir!r}: eval_config.json does not read as an "
                              f"evaluation's ({' '.join(str(err).split())}); set eval.overwrite=true to "
                              "replace it") from None
        if changed:
            raise ConfigError(f"eval.out_dir={out_dir!r} holds an evaluation with a different protocol "
                              f"({'; '.join(changed)}); set eval.overwrite=true to replace it, or choose "
                              "another eval.out_dir")
    elif present:
        raise ConfigError(f"eval.out_dir={out_dir!r} holds {', '.join(present)} but no eval_config.json "
                          "saying how they were made; set eval.overwrite=true to replace them, or choose "
                          "another eval.out_dir")


def start_out_dir(out_dir: str, config: EvalConfig, protocol: dict) -> None:
    """The first write: with eval.overwrite the old outputs go; eval_config.json records this protocol."""
    if config.eval.overwrite:
        for name in OUTPUT_FILES:
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    config_path = os.path.join(out_dir, runs.EVAL_CONFIG_FILE)
    with _writing(config_path, "the evaluation's config"):
        atomic_write_json(config_path, {"config": config.to_dict(), "protocol": protocol})


def kept_completions(completions_path: str, items: list[WorkItem]) -> list[dict]:
    """The completions already in the file that this evaluation wants (a torn last line is ignored; it is
    cut before appending). ConfigError for a damaged line or a completion made for other data."""
    wanted = {item.key: item for item in items}
    try:
        existing = load_completions(completions_path, with_text=False)
    except ValueError as err:
        raise ConfigError(f"eval.out_dir: {' '.join(str(err).split())}; set eval.overwrite=true to start "
                          "again") from None
    kept = []
    for record in existing:
        item = wanted.get(completion_key(record))
        if item is None:
            continue
        if record["problem_index"] != item.problem_index or record["answer"] != item.record["answer"]:
            raise ConfigError(
                f"eval.out_dir: {completions_path}: completion {completion_key(record)} was made for "
                f"different data (problem_index {record['problem_index']}, answer {record['answer']!r}; "
                f"the data now has {item.problem_index}, {item.record['answer']!r}); set "
                "eval.overwrite=true to start again"
            )
        kept.append(record)
    if len(kept) < len(existing):
        print(f"{len(existing) - len(kept)} completion(s) in {completions_path} are outside this "
              "evaluation (other benchmarks, problems past eval.limit or more samples); kept in the "
              "file, not summarized", file=sys.stderr)
    return kept


def encode_prompts(pending: list[WorkItem], checkpoint: Checkpoint,
                   settings: EvalSettings) -> dict[tuple[str, int], list[int]]:
    """(benchmark, problem_index) -> prompt token ids of every pending problem; ConfigError when the
    longest prompt plus eval.max_new_tokens does not fit the model's positions."""
    prompt_ids: dict[tuple[str, int], list[int]] = {}
    for item in pending:
        where = (item.benchmark, item.problem_index)
        if where not in prompt_ids:
            prompt_ids[where] = encode_prompt(item.record["problem"], checkpoint.tokenizer,
                                              checkpoint.prompt_format)
    if prompt_ids:
        where, ids = max(prompt_ids.items(), key=lambda entry: len(entry[1]))
        room = checkpoint.max_positions - len(ids)
        if settings.max_new_tokens > room:
            raise ConfigError(
                f"eval.max_new_tokens={settings.max_new_tokens}: expected at most {max(room, 0)}, the "
                f"model's max_position_embeddings ({checkpoint.max_positions}) less the longest prompt "
                f"({len(ids)} tokens: {where[0]} problem {where[1]})")
    return prompt_ids


def default_out_dir(checkpoint: Checkpoint) -> str:
    if checkpoint.kind == "run":
        return os.path.join(checkpoint.path, runs.EVAL_DIR)
    return os.path.join("runs", "eval", os.path.basename(checkpoint.path.rstrip(os.sep)))


# --------------------------------------------------------------------------------------------------
# Generation and scoring


def _decode(tokenizer: Tokenizer, tokens: np.ndarray, length: int) -> tuple[str, int, bool]:
    """(text, length without EOS, truncated) of one sampled row."""
    ids = tokens[:length]
    finished = length > 0 and int(ids[-1]) in tokenizer.eos_ids
    if finished:
        ids = ids[:-1]
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True), len(ids), not finished


def generate_and_score(pending: list[WorkItem], checkpoint: Checkpoint, settings: EvalSettings, model,
                       prompt_ids: dict[tuple[str, int], list[int]], handle,
                       on_records: Callable[[list[dict]], None]) -> None:
    """Samples every pending completion in calls of `batch_size` sequences (each seeded by `sample_id`
    under `eval.seed`), scores them with Math-Verify and appends them to `handle` call by call
    (`on_records` sees each call's records)."""
    from respo_jax.rewards import MathVerifyScorer
    from respo_jax.sampling import SamplingParams, generate

    tokenizer, fmt = checkpoint.tokenizer, checkpoint.prompt_format
    engine = settings.engine_config()  # eval.scheduler, eval.max_slots, ... (continuous by default)
    params = SamplingParams(
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
        top_k=settings.top_k, seed=settings.seed, eos_token_ids=tokenizer.eos_ids,
    )
    scorer = MathVerifyScorer(num_workers=settings.num_workers or None, timeout_s=settings.verify_timeout_s)
    with scorer:
        for start in range(0, len(pending), settings.batch_size):
            chunk = pending[start : start + settings.batch_size]
            prompts = [prompt_ids[(item.benchmark, item.problem_index)] for item in chunk]
            row_ids = [sample_id(item) for item in chunk]
            if len(pending) > settings.batch_size:
                # A short last call is padded with copies of its last row (outputs dropped): the sampler
                # then reuses the full calls' compilation. Rows are seeded by their ids, not positions.
                padding = settings.batch_size - len(prompts)
                prompts, row_ids = prompts + [prompts[-1]] * padding, row_ids + [row_ids[-1]] * padding
            out = generate(model, prompts, params, engine=engine, row_ids=row_ids)
            tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            decoded = [_decode(tokenizer, tokens[row], int(lengths[row])) for row in range(len(chunk))]
            outcomes = scorer.run_verl([fmt.solution_text(text) for text, _, _ in decoded],
                                       [item.record["answer"] for item in chunk])
            records = [
                {
                    "benchmark": item.benchmark, "problem_id": item.record["id"],
                    "problem_index": item.problem_index, "sample": item.sample, "length": length,
                    "truncated": truncated, "score": outcome.score, "verify_status": outcome.status,
                    "answer": item.record["answer"], "text": text,
                }
                for item, (text, length, truncated), outcome in zip(chunk, decoded, outcomes)
            ]
            with _writing(handle.name, "completions"):
                append_completions(handle, records)
            on_records(records)
            signum, _ = preemption.stop_agreed()
            if signum and start + settings.batch_size < len(pending):
                done = start + len(chunk)
                raise preemption.Preempted(
                    f"{preemption.signal_name(signum)} after {done} of {len(pending)} pending completions: "
                    f"they are in {handle.name}; resume: rerun the same command", signum)


# --------------------------------------------------------------------------------------------------
# Main


def evaluate(config: EvalConfig) -> dict:
    """Runs (or resumes) the evaluation `config` describes; returns the summary plus bookkeeping.

    Everything is checked before the first write (ConfigError, nothing left behind): the checkpoint and
    its weights, the benchmark files, the prompts' lengths, the out_dir's lock, protocol and completions.
    SIGTERM / SIGINT (`respo_jax.training.preemption`): the sampler call in flight finishes and its
    completions are appended, then `Preempted` (exit status 143 / 130, one line); rerunning resumes."""
    with preemption.handling():
        preemption.stop_at_start()  # one that came while the program started: before the first write
        return _evaluate(config)


def _evaluate(config: EvalConfig) -> dict:
    from respo_jax.training.loop import build_mesh

    from respo_jax.models.qwen3.kernels import platform

    settings = config.eval
    configure_compilation_cache(settings.compilation_cache_dir, key="eval.compilation_cache_dir")
    mesh = build_mesh(config)  # the trainer's: `mesh.*` over the devices, a ConfigError if they do not fit
    settings.check_kernel(platform=platform(mesh))  # the engine's kernel on these devices: before any read
    checkpoint = resolve_checkpoint(settings, mesh)
    settings.check_kernel(head_dim=checkpoint.head_dim)  # and the model's head_dim, once its config is read
    problems = load_problems(settings, checkpoint)
    protocol = protocol_of(settings, checkpoint)
    items = work_items(problems, settings)
    out_dir = settings.out_dir or default_out_dir(checkpoint)
    completions_path = os.path.join(out_dir, runs.COMPLETIONS_FILE)
    lock = lock_out_dir(out_dir)
    try:
        check_out_dir(out_dir, config, protocol)
        kept = [] if settings.overwrite else kept_completions(completions_path, items)
        done = {completion_key(record) for record in kept}
        pending = [item for item in items if item.key not in done]
        prompt_ids = encode_prompts(pending, checkpoint, settings)
        model = load_model(checkpoint, settings) if pending else None
    except BaseException:
        lock.release(remove_if_created=True)
        raise
    with lock:
        start_out_dir(out_dir, config, protocol)
        with _writing(completions_path, "the completions file (cutting a torn last line)"):
            repair_completions(completions_path)

        missing_per_problem: dict[tuple[str, int], int] = {}
        for item in pending:
            where = (item.benchmark, item.problem_index)
            missing_per_problem[where] = missing_per_problem.get(where, 0) + 1
        total_problems = sum(len(records) for records in problems.values())
        running = {"score": sum(r["score"] for r in kept), "count": len(kept)}
        bar = tqdm(total=total_problems, initial=total_problems - len(missing_per_problem),
                   desc=f"eval {checkpoint.label}", unit="problem", disable=not settings.progress)

        def on_records(records: list[dict]) -> None:
            finished = 0
            for record in records:
                where = (record["benchmark"], record["problem_index"])
                missing_per_problem[where] -= 1
                finished += missing_per_problem[where] == 0
            running["score"] += sum(r["score"] for r in records)
            running["count"] += len(records)
            bar.update(finished)
            bar.set_postfix(bench=records[-1]["benchmark"], acc=f"{running['score'] / running['count']:.3f}")

        if pending:
            with _writing(completions_path, "completions"):
                handle = open(completions_path, "ab")
            with handle:
                generate_and_score(pending, checkpoint, settings, model, prompt_ids, handle, on_records)
        bar.close()

        wanted = {item.key for item in items}
        records = load_completions(completions_path, with_text=False)
        records = [record for record in records if completion_key(record) in wanted]
        summary = summarize_completions(records, list(problems), settings.bootstrap_resamples,
                                        settings.bootstrap_seed)
        summary = {"checkpoint": checkpoint.label, "protocol": protocol, **summary}
        markdown = summary_markdown(summary, checkpoint.label)
        heading = f"# Evaluation of {checkpoint.label}\n\n"
        summary_json, summary_md = (os.path.join(out_dir, name)
                                    for name in (runs.EVAL_SUMMARY_FILE, runs.EVAL_SUMMARY_MARKDOWN))
        with _writing(summary_json, "the summary"):
            atomic_write_json(summary_json, summary)
        with _writing(summary_md, "the summary"):
            atomic_write_bytes(summary_md, (heading + markdown).encode("utf-8"))
    print(markdown)
    print(f"completions: {completions_path}\nsummary:     {os.path.join(out_dir, 'summary.md')}")
    return {**summary, "out_dir": out_dir, "generated": len(pending), "skipped": len(kept)}


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("overrides", nargs="*", help="eval.field=value overrides")
    args = parser.parse_args(argv)
    return evaluate(apply_overrides(load_config(args.config, EvalConfig), args.overrides))


def cli(argv: list[str]) -> int:
    """`main` for the command line: a refused start (a bad eval.* value, a missing or broken checkpoint
    or benchmark file, an out_dir held by another evaluation or holding another protocol; nothing
    written) exits with status 2, an evaluation that fails once started with status 1, each with one
    line on stderr."""
    return run_cli(main, argv, failures=run_failures())


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
