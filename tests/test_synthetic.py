"""Tests of the synthetic verifiable task and its character tokenizer (respo_jax.data.synthetic).

References: SymPy evaluates every generated problem; the DAPO strict-box verifier
(respo_jax.rewards) scores the reference responses; the HF tokenizer wrapper defines the interface.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import sympy

from respo_jax.data import PromptBatches, PromptFormat, encode_prompt, render_prompt
from respo_jax.data.synthetic import (
    DIFFICULTIES,
    ArithmeticTask,
    CharTokenizer,
    evaluate,
    get_task,
)
from respo_jax.data.tokenizer import HFTokenizer, Tokenizer
from respo_jax.rewards import strict_box_score


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


def test_char_tokenizer_round_trip_and_specials(tok):
    text = "12+34=\\boxed{46}"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) == len(text)
    assert tok.encode(text, add_special_tokens=True) == [tok.bos_id] + ids
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.eos_ids) == (0, 1, 2, (2,))
    assert len(set(ids)) == len(set(text)) and min(ids) >= 3 and max(ids) < tok.vocab_size
    full = [tok.bos_id] + ids + [tok.eos_id, tok.pad_id]
    assert tok.decode(full) == text
    assert tok.decode(full, skip_special_tokens=False) == "<bos>" + text + "<eos><pad>"
    assert tok.decode([tok.vocab_size, tok.vocab_size + 5]) == "\ufffd\ufffd"  # padded model vocab
    assert tok.token_to_id("<eos>") == 2 and tok.token_to_id("7") == tok.encode("7")[0]
    with pytest.raises(ValueError, match="'a' at position 1"):
        tok.encode("1a")
    assert tok.vocab_size == 26  # 3 specials + 23 characters: small enough for a model vocab of 32


def test_char_tokenizer_has_the_hf_wrapper_interface(tok):
    assert isinstance(tok, Tokenizer)
    for method in ("encode", "decode", "apply_chat_template"):
        ours = list(inspect.signature(getattr(CharTokenizer, method)).parameters)
        theirs = list(inspect.signature(getattr(HFTokenizer, method)).parameters)
        assert ours == theirs, method
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt("1+1=", tok, PromptFormat())


def test_records_are_deterministic_in_the_seed():
    task = get_task("medium")
    first = task.make_records(200, seed=7)
    assert first == task.make_records(200, seed=7)
    assert first != task.make_records(200, seed=8)
    assert first[123] == task.record(7, 123)
    assert [r["id"] for r in first[:3]] == ["7-0", "7-1", "7-2"]


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_answers_match_sympy(difficulty):
    task = get_task(difficulty)
    for record in task.make_records(300, seed=1):
        problem = record["problem"]
        assert problem.endswith("=")
        assert record["answer"] == str(sympy.sympify(problem[:-1]))


def test_difficulty_knobs_shape_the_problems():
    task = ArithmeticTask(num_digits=3, num_operands=4, operations="+*")
    records = task.make_records(400, seed=0)
    operators = "".join(c for r in records for c in r["problem"] if c in "+-*")
    assert set(operators) == {"+", "*"} and len(operators) == 3 * 400
    assert abs(operators.count("*") / len(operators) - 0.5) < 0.06  # drawn uniformly per slot
    operands = [int(x) for r in records for x in r["problem"][:-1].replace("*", "+").split("+")]
    assert len(operands) == 4 * 400 and max(operands) < 1000 and max(operands) >= 900
    easy = get_task("easy")
    assert all(len(r["problem"]) == 4 for r in easy.make_records(200, seed=0))  # "3+4="
    with pytest.raises(KeyError, match="easy, medium, hard"):
        get_task("impossible")
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTask(operations="/")
    assert evaluate([2, 3, 4, 5], ["+", "*", "-"]) == 2 + 3 * 4 - 5


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_reference_responses_score_plus_one(difficulty, tok):
    task = get_task(difficulty)
    fmt = task.prompt_format
    for record in task.make_records(200, seed=2):
        response = task.reference_response(record["answer"], record["problem"])
        assert len(response) <= task.max_response_tokens()
        ids = tok.encode(response) + [tok.eos_id]
        text = tok.decode(ids)
        assert strict_box_score(fmt.solution_text(text), record["answer"]) == 1.0
        wrong = task.reference_response(str(int(record["answer"]) + 1), record["problem"])
        assert strict_box_score(fmt.solution_text(wrong), record["answer"]) == -1.0


def test_prompt_ends_with_the_box_and_free_format_does_not(tok):
    easy = get_task("easy")
    record = easy.record(0, 0)
    ids = encode_prompt(record["problem"], tok, easy.prompt_format)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == record["problem"] + "\\boxed{"
    free = ArithmeticTask(boxed_prefix=False)
    assert tok.decode(encode_prompt(record["problem"], tok, free.prompt_format)) == record["problem"]
    assert free.reference_response("7") == "\\boxed{7}"
    assert strict_box_score(free.prompt_format.solution_text("\\boxed{7}"), "7") == 1.0


def test_easy_level_is_reachable_by_a_uniform_policy(tok):
    """A random-init model is near-uniform over its vocabulary; on the easy level it must still hit the
    reward by chance at about the rate of writing `answer}` first: E[V^-(len(answer)+1)]."""
    task = get_task("easy")
    fmt = task.prompt_format
    records = task.make_records(1000, seed=3)
    vocab, max_new_tokens, samples = 32, 8, 40_000
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(samples, max_new_tokens))
    hits = 0
    for row, record in zip(tokens, records * (samples // len(records))):
        row = list(row)
        if tok.eos_id in row:
            row = row[: row.index(tok.eos_id)]
        hits += strict_box_score(fmt.solution_text(tok.decode(row)), record["answer"]) > 0
    floor = np.mean([float(vocab) ** -(len(r["answer"]) + 1) for r in records])
    assert hits / samples >= 0.8 * floor  # ~1/1400 for a 32-token model vocab
    assert hits / samples < 0.01  # and it is not free: the task has to be learned


def test_synthetic_records_feed_the_batches():
    records = get_task("easy").make_records(64, seed=0)
    batches = PromptBatches(records, batch_size=16, seed=0, num_epochs=1)
    seen = [r["id"] for batch in batches for r in batch]
    assert sorted(seen) == sorted(r["id"] for r in records)
