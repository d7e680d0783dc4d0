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
off first). A different protocol (checkpoint, sampling, prompt format, dtype, seed, data) in the same
out_dir is refused unless `eval.overwrite=true`; the benchmark list and `eval.limit` may change
between runs (only the requested completions are generated and summarized).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import sys
import zlib
from typing import Callable

import numpy as np
from tqdm import tqdm

from experiments.train import load_config
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
from respo_jax.training.config import ExperimentConfig, apply_overrides, config_from_dict

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "eval_paper.py")
# The synthetic task's held-out stream: the same problems as the trainer's greedy evaluation
# (`respo_jax.training.loop.load_task`: task.seed + 7919), extended to `eval.synthetic_problems`.
SYNTHETIC_HELD_OUT_OFFSET = 7919
OUTPUT_FILES = ("completions.jsonl", "summary.json", "summary.md")


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


def _resolve_huggingface(path: str, settings: EvalSettings) -> Checkpoint:
    from respo_jax.models import qwen3

    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(
            f"{path}: a Hugging Face checkpoint directory needs tokenizer.json next to the weights"
        )
    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        hf_config = json.load(handle)
    tokenizer = load_tokenizer(path)
    if settings.chat_template == "true" and not tokenizer.has_chat_template:
        raise ValueError(f"eval.chat_template=true but the tokenizer in {path} has no chat template")
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype")
    dtype = settings.dtype or ("bfloat16" if declared == "bfloat16" else "float32")
    return Checkpoint(
        kind="huggingface", path=path, step=None, fingerprint=_hf_fingerprint(path), tokenizer=tokenizer,
        prompt_format=PromptFormat(chat=_chat(settings.chat_template, tokenizer.has_chat_template)),
        dtype=dtype, synthetic_task=None, synthetic_seed=0,
        build_model=lambda: qwen3.from_pretrained(path, dtype=_jnp_dtype(dtype)),
    )


def _resolve_run(path: str, settings: EvalSettings) -> Checkpoint:
    from respo_jax.training.checkpoint import latest_step

    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        run_config = config_from_dict(ExperimentConfig, json.load(handle))
    checkpoint_dir = os.path.join(path, "checkpoints")
    step = latest_step(checkpoint_dir)
    if step is None:
        raise FileNotFoundError(f"{path}: no checkpoint under {checkpoint_dir}")
    dtype = settings.dtype or run_config.model.dtype
    run_config = dataclasses.replace(run_config, model=dataclasses.replace(run_config.model, dtype=dtype))
    task_cfg = run_config.task
    if task_cfg.name == "synthetic":
        if settings.chat_template == "true":
            raise ValueError(
                "eval.chat_template=true: a synthetic-task run's character tokenizer has no chat template"
            )
        task = task_cfg.synthetic_task()
        tokenizer, prompt_format = CharTokenizer(), task.prompt_format
    else:
        task = None
        tokenizer = load_tokenizer(task_cfg.tokenizer_dir)
        prompt_format = PromptFormat(chat=_chat(settings.chat_template, task_cfg.chat_template))

    def build_model():
        from flax import nnx

        from respo_jax.training.checkpoint import restore_params
        from respo_jax.training.loop import build_model as build_run_model

        abstract = nnx.eval_shape(lambda: build_run_model(run_config, tokenizer.vocab_size))
        graphdef, abstract_state = nnx.split(abstract)
        params, _, _ = restore_params(checkpoint_dir, abstract_state, step)
        return nnx.merge(graphdef, params)

    return Checkpoint(
        kind="run", path=path, step=step, fingerprint=f"step-{step}", tokenizer=tokenizer,
        prompt_format=prompt_format, dtype=dtype, synthetic_task=task,
        synthetic_seed=task_cfg.seed + SYNTHETIC_HELD_OUT_OFFSET, build_model=build_model,
    )


def resolve_checkpoint(settings: EvalSettings) -> Checkpoint:
    """A Hugging Face directory or a training run directory (see the module docstring)."""
    path = os.path.abspath(settings.checkpoint)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"eval.checkpoint={settings.checkpoint!r} is not a directory")
    if os.path.isdir(os.path.join(path, "checkpoints")) and os.path.isfile(os.path.join(path, "config.json")):
        return _resolve_run(path, settings)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _resolve_huggingface(path, settings)
    raise FileNotFoundError(
        f"{path} is neither a Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json) nor a "
        "training run directory (config.json and checkpoints/)"
    )


# --------------------------------------------------------------------------------------------------
# What to generate


def load_problems(settings: EvalSettings, checkpoint: Checkpoint) -> dict[str, list[dict]]:
    """benchmark -> its records (the first `eval.limit` when set), in the requested order."""
    problems = {}
    for name in settings.benchmark_names():
        if name == SYNTHETIC:
            if checkpoint.synthetic_task is None:
                raise ValueError(
                    "eval.benchmarks=synthetic needs a synthetic-task training run as eval.checkpoint"
                )
            task, count = checkpoint.synthetic_task, settings.synthetic_problems
            records = task.make_records(count, checkpoint.synthetic_seed,
                                        split="test" if task.test_fraction else "all")
        else:
            if checkpoint.synthetic_task is not None:
                raise ValueError(
                    f"{checkpoint.path} is a synthetic-task run: its character tokenizer cannot encode "
                    f"{name!r}; use eval.benchmarks=synthetic"
                )
            try:
                records = load_benchmark(LOADER_NAMES[name], settings.data_dir)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"{err} (eval.data_dir={settings.data_dir!r})") from None
        if settings.limit:
            records = records[: settings.limit]
        ids = [record["id"] for record in records]
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"benchmark {name!r} has repeated problem ids; completions could not be told apart"
            )
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


def chunk_seed(seed: int, item: WorkItem) -> int:
    """The sampler seed of a call whose first completion is `item`: a function of (seed, benchmark,
    problem, sample) only, so an interrupted run that resumes at a call boundary regenerates the
    same samples as an uninterrupted one."""
    words = np.random.SeedSequence(
        [seed, zlib.crc32(item.benchmark.encode()), item.problem_index, item.sample]
    ).generate_state(2, np.uint32)
    return int(words[0]) | (int(words[1]) << 32)


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
        "scorer": "math_verify (verl math_metric, App. D.2)",
    }


# --------------------------------------------------------------------------------------------------
# The output directory


def _write_atomic(path: str, text: str) -> None:
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


@contextlib.contextmanager
def _exclusive(out_dir: str):
    """Holds an exclusive lock on out_dir for the whole evaluation (two writers would interleave)."""
    with open(os.path.join(out_dir, ".lock"), "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another evaluation is writing to {out_dir}") from None
        yield


def prepare_out_dir(out_dir: str, config: EvalConfig, protocol: dict) -> None:
    """Refuses an out_dir holding another protocol's outputs (unless overwrite); records this one."""
    config_path = os.path.join(out_dir, "eval_config.json")
    present = [name for name in OUTPUT_FILES if os.path.exists(os.path.join(out_dir, name))]
    if config.eval.overwrite:
        for name in present:
            os.remove(os.path.join(out_dir, name))
    elif os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as handle:
            previous = json.load(handle).get("protocol", {})
        changed = [f"{key}: {previous.get(key)!r} -> {protocol.get(key)!r}"
                   for key in sorted(set(previous) | set(protocol)) if previous.get(key) != protocol.get(key)]
        if changed:
            raise RuntimeError(
                f"{out_dir} holds an evaluation with a different protocol ({'; '.join(changed)}); "
                "set eval.overwrite=true to replace it, or choose another eval.out_dir"
            )
    elif present:
        raise RuntimeError(
            f"{out_dir} holds {', '.join(present)} but no eval_config.json saying how they were made; "
            "set eval.overwrite=true to replace them, or choose another eval.out_dir"
        )
    record = {"config": config.to_dict(), "protocol": protocol}
    _write_atomic(config_path, json.dumps(record, indent=2) + "\n")


def default_out_dir(checkpoint: Checkpoint) -> str:
    if checkpoint.kind == "run":
        return os.path.join(checkpoint.path, "eval")
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


def generate_and_score(pending: list[WorkItem], checkpoint: Checkpoint, settings: EvalSettings, handle,
                       on_records: Callable[[list[dict]], None]) -> None:
    """Samples every pending completion in calls of `batch_size` sequences, scores them with Math-Verify
    and appends them to `handle` call by call (`on_records` sees each call's records)."""
    from respo_jax.rewards import MathVerifyScorer
    from respo_jax.sampling import EngineConfig, SamplingParams, generate

    tokenizer, fmt = checkpoint.tokenizer, checkpoint.prompt_format
    engine = EngineConfig(prompt_bucket=settings.prompt_bucket,
                          decode_chunk_size=settings.decode_chunk_size or None)
    prompt_ids: dict[tuple[str, int], list[int]] = {}
    model = checkpoint.build_model()
    scorer = MathVerifyScorer(num_workers=settings.num_workers or None, timeout_s=settings.verify_timeout_s)
    with scorer:
        for start in range(0, len(pending), settings.batch_size):
            chunk = pending[start : start + settings.batch_size]
            prompts = []
            for item in chunk:
                where = (item.benchmark, item.problem_index)
                if where not in prompt_ids:
                    prompt_ids[where] = encode_prompt(item.record["problem"], tokenizer, fmt)
                prompts.append(prompt_ids[where])
            if len(pending) > settings.batch_size:
                # A short last call is padded with copies of its last prompt (outputs dropped): the sampler
                # then reuses the full calls' compilation. Rows keep their indices, hence their samples.
                prompts += [prompts[-1]] * (settings.batch_size - len(prompts))
            params = SamplingParams(
                max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                top_p=settings.top_p, top_k=settings.top_k, seed=chunk_seed(settings.seed, chunk[0]),
                eos_token_ids=tokenizer.eos_ids,
            )
            out = generate(model, prompts, params, engine=engine)
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
            append_completions(handle, records)
            on_records(records)


# --------------------------------------------------------------------------------------------------
# Main


def evaluate(config: EvalConfig) -> dict:
    """Runs (or resumes) the evaluation `config` describes; returns the summary plus bookkeeping."""
    settings = config.eval
    configure_compilation_cache(settings.compilation_cache_dir, key="eval.compilation_cache_dir")
    checkpoint = resolve_checkpoint(settings)
    problems = load_problems(settings, checkpoint)
    protocol = protocol_of(settings, checkpoint)
    out_dir = settings.out_dir or default_out_dir(checkpoint)
    os.makedirs(out_dir, exist_ok=True)
    completions_path = os.path.join(out_dir, "completions.jsonl")
    with _exclusive(out_dir):
        prepare_out_dir(out_dir, config, protocol)
        repair_completions(completions_path)
        items = work_items(problems, settings)
        wanted = {item.key: item for item in items}
        existing = load_completions(completions_path, with_text=False)
        kept = []
        for record in existing:
            item = wanted.get(completion_key(record))
            if item is None:
                continue
            if record["problem_index"] != item.problem_index or record["answer"] != item.record["answer"]:
                raise RuntimeError(
                    f"{completions_path}: completion {completion_key(record)} was made for different data "
                    f"(problem_index {record['problem_index']}, answer {record['answer']!r}; the data now "
                    f"has {item.problem_index}, {item.record['answer']!r}); set eval.overwrite=true to start "
                    "again"
                )
            kept.append(record)
        if len(kept) < len(existing):
            print(f"{len(existing) - len(kept)} completion(s) in {completions_path} are outside this "
                  "evaluation (other benchmarks, problems past eval.limit or more samples); kept in the "
                  "file, not summarized", file=sys.stderr)
        done = {completion_key(record) for record in kept}
        pending = [item for item in items if item.key not in done]

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
            with open(completions_path, "ab") as handle:
                generate_and_score(pending, checkpoint, settings, handle, on_records)
        bar.close()

        records = load_completions(completions_path, with_text=False)
        records = [record for record in records if completion_key(record) in wanted]
        summary = summarize_completions(records, list(problems), settings.bootstrap_resamples,
                                        settings.bootstrap_seed)
        summary = {"checkpoint": checkpoint.label, "protocol": protocol, **summary}
        _write_atomic(os.path.join(out_dir, "summary.json"), json.dumps(summary, indent=2) + "\n")
        markdown = summary_markdown(summary, checkpoint.label)
        heading = f"# Evaluation of {checkpoint.label}\n\n"
        _write_atomic(os.path.join(out_dir, "summary.md"), heading + markdown)
    print(markdown)
    print(f"completions: {completions_path}\nsummary:     {os.path.join(out_dir, 'summary.md')}")
    return {**summary, "out_dir": out_dir, "generated": len(pending), "skipped": len(kept)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a config file defining get_config()")
    parser.add_argument("overrides", nargs="*", help="eval.field=value overrides")
    args = parser.parse_args(argv)
    return evaluate(apply_overrides(load_config(args.config, EvalConfig), args.overrides))


if __name__ == "__main__":
    main(sys.argv[1:])
