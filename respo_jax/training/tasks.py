"""The training task of a run: its tokenizer, prompt format and the training / held-out records.

Synthetic arithmetic (in-process tokenizer, a test split when the task has one) or DAPO-Math-17k
(paper §4.1: prompts over `task.max_prompt_tokens` dropped once, then a seeded shuffle), built from
the config alone, so the trainer, the evaluation and the benchmarks draw the same records.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from respo_jax.data.prompts import PromptFormat, encode_prompts, filter_overlong
from respo_jax.data.records import load_dapo_math
from respo_jax.data.synthetic import ArithmeticTask, CharTokenizer
from respo_jax.data.tokenizer import Tokenizer, load_tokenizer
from respo_jax.training.config import ConfigError, ExperimentConfig


class Task(NamedTuple):
    """A run's task as `load_task` builds it. `train_prompt_lengths[i]`: the tokens of `train[i]`'s
    prompt in `prompt_format` (the trainer's prompt buckets need them; DAPO-Math's are counted by the
    overlong filter's tokenization, so the start tokenizes the training set once)."""

    tokenizer: Tokenizer
    prompt_format: PromptFormat
    train: list[dict]
    held_out: list[dict]
    synthetic: ArithmeticTask | None
    train_prompt_lengths: list[int]


def load_task(config: ExperimentConfig) -> Task:
    """The run's `Task`: tokenizer, prompt format, training and held-out records, the synthetic task (None
    for DAPO-Math) and the training prompts' lengths."""
    task_cfg, num_eval = config.task, config.run.eval_problems
    if task_cfg.name == "synthetic":
        task = task_cfg.synthetic_task()
        train_split, test_split = ("train", "test") if task.test_fraction else ("all", "all")
        train = task.make_records(task_cfg.num_records, task_cfg.seed, split=train_split)
        held_out = task.make_records(num_eval, task_cfg.seed + 7919, split=test_split) if num_eval else []
        tokenizer = CharTokenizer()
        lengths = [len(ids) for ids in encode_prompts([rec["problem"] for rec in train], tokenizer,
                                                      task.prompt_format)]
        return Task(tokenizer, task.prompt_format, train, held_out, task, lengths)
    try:
        tokenizer = load_tokenizer(task_cfg.tokenizer_dir)
    except (OSError, ValueError) as err:
        raise ConfigError(f"task.tokenizer_dir={task_cfg.tokenizer_dir!r}: {err}") from None
    if task_cfg.chat_template and not tokenizer.has_chat_template:
        raise ConfigError(
            f"task.chat_template=true (the default for dapo_math, as the official data preparation renders every "
            f"prompt as a chat message) but the tokenizer in {task_cfg.tokenizer_dir!r} has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja); set task.chat_template=false to "
            "render raw prompts"
        )
    prompt_format = PromptFormat(chat=task_cfg.chat_template)
    records = load_dapo_math(task_cfg.data_dir)
    problems = [rec["problem"] for rec in records]
    prompt_ids = dict(zip(problems, encode_prompts(problems, tokenizer, prompt_format)))  # one batched pass
    records, _ = filter_overlong(records, prompt_ids.__getitem__, task_cfg.max_prompt_tokens)
    if len(records) <= num_eval:
        raise ConfigError(f"run.eval_problems={num_eval}: expected fewer than the task's {len(records)} "
                          f"prompts of at most task.max_prompt_tokens={task_cfg.max_prompt_tokens} tokens")
    order = np.random.default_rng(task_cfg.seed).permutation(len(records))
    records = [records[i] for i in order]
    train = records[num_eval:]
    return Task(tokenizer, prompt_format, train, records[:num_eval], None,
                [len(prompt_ids[rec["problem"]]) for rec in train])
