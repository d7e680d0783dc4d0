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
    """A run's task as `load_task` builds it. `prompt_ids[problem]`: the tokens of a training or held-out
    problem's prompt in `prompt_format` (int32), tokenized once at the start (DAPO-Math's by the overlong
    filter's pass): the trainer's prompt buckets need their lengths, its rollouts the tokens."""

    tokenizer: Tokenizer
    prompt_format: PromptFormat
    train: list[dict]
    held_out: list[dict]
    synthetic: ArithmeticTask | None
    prompt_ids: dict[str, np.ndarray]

    @property
    def train_prompt_lengths(self) -> list[int]:
        """`train_prompt_lengths[i]`: the tokens of `train[i]`'s prompt."""
        return [len(self.prompt_ids[rec["problem"]]) for rec in self.train]


def _token_arrays(problems: list[str], tokenizer: Tokenizer, prompt_format: PromptFormat) -> dict:
    return {problem: np.asarray(ids, np.int32)
            for problem, ids in zip(problems, encode_prompts(problems, tokenizer, prompt_format))}


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
        problems = list(dict.fromkeys(rec["problem"] for rec in [*train, *held_out]))
        return Task(tokenizer, task.prompt_format, train, held_out, task,
                    _token_arrays(problems, tokenizer, task.prompt_format))
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
    prompt_ids = _token_arrays([rec["problem"] for rec in records], tokenizer, prompt_format)  # one pass
    records, _ = filter_overlong(records, prompt_ids.__getitem__, task_cfg.max_prompt_tokens)
    if len(records) <= num_eval:
        raise ConfigError(f"run.eval_problems={num_eval}: expected fewer than the task's {len(records)} "
                          f"prompts of at most task.max_prompt_tokens={task_cfg.max_prompt_tokens} tokens")
    order = np.random.default_rng(task_cfg.seed).permutation(len(records))
    records = [records[i] for i in order]
    return Task(tokenizer, prompt_format, records[num_eval:], records[:num_eval], None,
                {rec["problem"]: prompt_ids[rec["problem"]] for rec in records})
