"""Held-out accuracy as the paper measures it, beside greedy: sampled pass@1 with its standard error.

Greedy accuracy (one argmax response per problem) is what RL sharpening moves least; the paper reports
pass@1 from responses sampled at temperature 1 with top-p 0.7 (App. D). `pass_at_1` turns a
[problems, samples] table of correct/incorrect into the estimate and its standard error over problems;
`evaluate_held_out` generates and scores the greedy and the sampled responses of one model. The sampled
responses use one fixed seed (`EVAL_SEED`), so every run of a study is scored on the same random numbers
at the same held-out problems (common random numbers: differences between runs are not sampling noise
of the evaluation's own draws alone).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from respo_jax.sampling import EngineConfig, SamplingParams, generate
from respo_jax.distributed import to_host

EVAL_SEED = 7919  # the sampled evaluation's PRNG seed, the same for every run


def pass_at_1(correct) -> tuple[float, float]:
    """(pass@1, its standard error) from `correct: [problems, samples]` (bool or 0/1).

    pass@1 is the mean over problems of each problem's share of correct samples p_i; its standard error
    is std(p_i) / sqrt(problems) (ddof 1; 0 with one problem): the problems are the sampled units, and a
    problem's samples are not independent evidence about the population of problems."""
    correct = np.asarray(correct, np.float64)
    if correct.ndim != 2 or correct.size == 0:
        raise ValueError(f"correct must be a non-empty [problems, samples] table; got shape {correct.shape}")
    per_problem = correct.mean(axis=1)
    problems = per_problem.shape[0]
    se = float(per_problem.std(ddof=1) / np.sqrt(problems)) if problems > 1 else 0.0
    return float(per_problem.mean()), se


def evaluate_held_out(model, prompts: Sequence[list[int]], records: list[dict],
                      score: Callable[[np.ndarray, np.ndarray, list[dict]], np.ndarray], *,
                      max_new_tokens: int, eos_token_ids: tuple[int, ...], engine: EngineConfig = EngineConfig(),
                      samples: int = 0,
                      temperature: float = 1.0, top_p: float = 0.7) -> dict:
    """The held-out record of `model` on `prompts` (one per record): {"greedy_accuracy"} and, with
    `samples` > 0, {"sampled_pass_at_1", "sampled_pass_at_1_se", "sampled_samples", "sampled_temperature",
    "sampled_top_p"}; per problem, in the records' order, "greedy_correct" (0/1) and, with samples,
    "sampled_correct" (the number of correct samples), and "problem_ids" when every record has an "id",
    so that two runs evaluated on the same records can be compared problem by problem. `score(tokens [rows, width], lengths [rows], records) -> scores [rows]` scores
    responses (correct: score > 0); the sampled rows are prompt-major, `samples` per prompt. `engine`:
    the sampler's engine (the trainer passes its rollouts' one, from the `rollout.*` engine fields)."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=eos_token_ids)
    out = jax.tree.map(to_host, generate(model, list(prompts), greedy, engine=engine))
    greedy_correct = score(np.asarray(out.tokens), np.asarray(out.lengths), records) > 0
    result = {"greedy_accuracy": float(np.mean(greedy_correct)),
              "greedy_correct": greedy_correct.astype(int).tolist()}
    if all("id" in record for record in records):
        result["problem_ids"] = [str(record["id"]) for record in records]
    if samples:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                seed=EVAL_SEED, eos_token_ids=eos_token_ids, num_samples=samples)
        out = jax.tree.map(to_host, generate(model, list(prompts), params, engine=engine))
        expanded = [record for record in records for _ in range(samples)]
        scores = score(np.asarray(out.tokens), np.asarray(out.lengths), expanded)
        correct = scores.reshape(len(records), samples) > 0
        estimate, se = pass_at_1(correct)
        result.update(sampled_pass_at_1=estimate, sampled_pass_at_1_se=se, sampled_samples=samples,
                      sampled_temperature=temperature, sampled_top_p=top_p,
                      sampled_correct=correct.sum(axis=1).astype(int).tolist())
    return result


def trainer_held_out_record(trainer) -> dict | None:
    """`evaluate_held_out` of an `RLTrainer`'s current model on its task's held-out records: its
    rollouts' engine, responses scored as its rollouts are (split over the processes, failures not
    counted), `run.eval_samples` / `eval_temperature` / `eval_top_p`; None without held-out records."""
    if not trainer.held_out:
        return None
    run = trainer.config.run
    return evaluate_held_out(
        trainer.model(), [trainer.encode(rec) for rec in trainer.held_out], trainer.held_out,
        lambda tokens, lengths, records: trainer.scorer.score_shared(tokens, lengths, records, count=False),
        max_new_tokens=trainer.config.rollout.max_new_tokens, eos_token_ids=trainer.tokenizer.eos_ids,
        engine=trainer.engine, samples=run.eval_samples, temperature=run.eval_temperature,
        top_p=run.eval_top_p)
