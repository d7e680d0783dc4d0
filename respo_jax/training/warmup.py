"""The supervised warm-up before RL: next-token steps on the synthetic task's reference responses, with
an AdamW of their own, make the fresh model a weak "base model" that RL then sharpens (`warmup.*`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from respo_jax.data.synthetic import operand_count
from respo_jax.sharding import init_optimizer_state, optimizer_state_shardings
from respo_jax.training.batch import build_sequences
from respo_jax.training.step import NonFiniteError, make_optimizer, make_sft_step


@dataclasses.dataclass(frozen=True)
class WarmupPosition:
    """Where the supervised warm-up stands: `step` steps done, its AdamW's `opt_state` and the
    problem stream's random-generator state (NumPy's `bit_generator.state`, a JSON-able dict)."""

    step: int
    opt_state: object
    rng_state: dict


def warmup_optimizer(trainer):
    """The warm-up's AdamW and its state's shardings (on `trainer`'s parameters')."""
    tx = make_optimizer(trainer.config.warmup.learning_rate, 0.0, 0.9, 0.999, 1.0, 0)
    return tx, optimizer_state_shardings(tx, trainer.state.params, trainer.shardings.params)


def warmup_opt_state_like(trainer):
    """A fresh state of the warm-up optimizer: the structure, shapes and shardings a restore fills."""
    return init_optimizer_state(warmup_optimizer(trainer)[0], trainer.state.params, trainer.shardings.params)


def sft_warmup(trainer, start: WarmupPosition | None = None) -> Iterator[dict]:
    """`warmup.steps` supervised steps of `trainer`'s parameters (an `RLTrainer`; updated in place), one
    record {"phase": "warmup", "step", "sft_loss"} per step, from the first step or from `start` (a
    warm-up checkpoint's position; the trainer holds its parameters); NonFiniteError when a step is not
    finite. After each step `trainer.warmup_position` is what resumes the warm-up there, bit for bit."""
    cfg = trainer.config.warmup
    if cfg.steps == 0:
        return
    if trainer.task is None:
        raise ValueError("warmup needs reference responses: only the synthetic task has them")
    state, shardings, placer, tokenizer = trainer.state, trainer.shardings, trainer.placer, trainer.tokenizer
    tx, opt_shardings = warmup_optimizer(trainer)
    opt_state = start.opt_state if start else init_optimizer_state(tx, state.params, shardings.params)
    step = make_sft_step(state.graphdef, tx, shardings.params, opt_shardings, shardings.batch)
    rng = np.random.default_rng(trainer.config.run.seed + 1)
    if start:
        rng.bit_generator.state = start.rng_state
    for index in range(start.step if start else 0, cfg.steps):
        records = warmup_records(trainer.task, trainer.config.task.seed, rng, cfg.batch_size,
                                 cfg.operand_range(trainer.task))
        prompts = [trainer.encode(r) for r in records]
        responses = [tokenizer.encode(trainer.task.reference_solution(r)) + [tokenizer.eos_id]
                     for r in records]
        width = max(len(r) for r in responses)
        padded = np.array([r + [tokenizer.pad_id] * (width - len(r)) for r in responses], np.int32)
        lengths = np.array([len(r) for r in responses], np.int32)
        part = placer.rows(len(records))  # this process's rows only
        ids, positions, attention, response_mask, prompt_len = build_sequences(
            placer.take(prompts, part), padded[part], lengths[part], tokenizer.pad_id,
            prompt_len=max(len(p) for p in prompts))
        loss_mask = np.zeros(ids.shape, np.float32)
        loss_mask[:, prompt_len:] = response_mask
        inputs = placer.place([ids, positions, attention, loss_mask], len(records))
        state.params, opt_state, loss, finite = step(state.params, opt_state, *inputs)
        loss = float(loss)
        if not (np.isfinite(loss) and bool(finite)):
            quantity = f"sft_loss is {loss}" if not np.isfinite(loss) else "the parameters hold NaN/inf"
            raise NonFiniteError(f"warm-up step {index + 1}: {quantity}; the run stops before any checkpoint")
        trainer.warmup_position = WarmupPosition(index + 1, opt_state, rng.bit_generator.state)
        yield {"phase": "warmup", "step": index + 1, "sft_loss": loss}


def warmup_records(task, seed: int, rng: np.random.Generator, count: int,
                   operands: tuple[int, int] | None = None) -> list[dict]:
    """`count` random problems of the synthetic `task`'s warm-up stream (`task.seed` `seed`); never a
    held-out test problem when the task has a test split. With `operands` (smallest, largest), only
    problems with that many operands: the task's stream, the others skipped (so the counts in range
    keep their relative frequencies, and the full range leaves the stream as it is)."""
    low, high = operands or task.operand_counts
    records: list[dict] = []
    while len(records) < count:
        for i in rng.integers(0, 2**31, size=count - len(records)):
            record = task.record(seed + 1_000_003, int(i))
            if ((not task.test_fraction or task.split_of(record["problem"]) == "train")
                    and low <= operand_count(record["problem"]) <= high):
                records.append(record)
    return records
