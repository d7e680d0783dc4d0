"""`python -m experiments.evaluate` end to end, and the completions file it writes.

References: a tiny random Hugging Face Qwen3 (built with `transformers`) with the real Qwen3 tokenizer on
a MATH-500 slice of ../shared/data, rescored here with Math-Verify's verl metric called directly; the
statistics recomputed from the completions; a synthetic-task training run whose greedy accuracy the
trainer logged; byte-identical completions after an interrupted run resumes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from experiments.evaluate import main
from respo_jax.data import load_benchmark
from respo_jax.eval import cluster_bootstrap
from respo_jax.eval.completions import (
    load_completions,
    repair_completions,
    scores_by_problem,
    summarize_completions,
    summary_markdown,
)
from respo_jax.eval.config import EvalConfig, EvalSettings
from respo_jax.rewards import strict_box_score
from respo_jax.training.config import apply_overrides

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"
DATA = SHARED / "data"
QWEN3_TOKENIZER = SHARED / "tokenizers" / "qwen3"
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> pathlib.Path:
    """A random 2-layer Qwen3 with the real Qwen3 vocabulary, saved by transformers, plus the tokenizer."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=151_669, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=151_645)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    for name in os.listdir(QWEN3_TOKENIZER):
        shutil.copy(QWEN3_TOKENIZER / name, path / name)
    return path


def _verl_math_verify(gold: str, pred: str) -> float:
    """verl's Math-Verify scoring, in this process (the reference for the worker pool's scores)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, math_metric

    metric = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                         pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    return float(metric(["\\boxed{" + gold + "}"], [pred])[0])


@pytest.mark.slow
def test_end_to_end_on_math500_then_resume_and_refuse_another_protocol(tiny_hf, tmp_path):
    out = tmp_path / "eval"
    args = [f"eval.checkpoint={tiny_hf}", "eval.benchmarks=math500", f"eval.data_dir={DATA}",
            f"eval.out_dir={out}", "eval.limit=3", "eval.samples=2", f"eval.max_new_tokens={MAX_NEW_TOKENS}",
            "eval.dtype=float32",
            "eval.batch_size=4", "eval.prompt_bucket=512", "eval.num_workers=2", "eval.progress=false",
            "eval.bootstrap_resamples=2000"]
    result = main(args)
    assert (result["generated"], result["skipped"]) == (6, 0)

    # completions.jsonl: every (problem, sample) once, in order, well formed and scored by Math-Verify.
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    problems = load_benchmark("math500", DATA)[:3]
    expected_keys = [(p["id"], s) for p in problems for s in range(2)]
    assert [(r["problem_id"], r["sample"]) for r in records] == expected_keys
    for record in records:
        assert record["benchmark"] == "math500" and record["verify_status"] == "ok"
        assert record["answer"] == problems[record["problem_index"]]["answer"]
        assert 0 <= record["length"] <= MAX_NEW_TOKENS
        assert record["truncated"] == (record["length"] == MAX_NEW_TOKENS)
        assert isinstance(record["text"], str) and record["text"]
        assert record["score"] == _verl_math_verify(record["answer"], record["text"])
    assert len({r["text"] for r in records}) == 6  # distinct samples (seeded per call, per row)

    # summary.json: pass@1 and the bootstrap SE recomputed from the completions.
    summary = json.loads((out / "summary.json").read_text())
    row = summary["benchmarks"]["math500"]
    expected = np.mean([np.mean([r["score"] for r in records if r["problem_index"] == i]) for i in range(3)])
    assert row["pass_at_1"] == pytest.approx(expected)
    assert (row["problems"], row["samples_per_problem"], row["completions"]) == (3, 2, 6)
    assert row["truncated_fraction"] == pytest.approx(np.mean([r["truncated"] for r in records]))
    macro = cluster_bootstrap(scores_by_problem(records), 2000, 0)
    assert (summary["macro_average"]["pass_at_1"], summary["macro_average"]["se"]) == pytest.approx(macro)
    protocol = summary["protocol"]
    assert (protocol["temperature"], protocol["top_p"], protocol["top_k"]) == (1.0, 0.7, 0)
    assert protocol["chat_template"] is True  # the Qwen3 tokenizer has one
    markdown = (out / "summary.md").read_text()
    assert "| Checkpoint | MATH-500 | Avg. |" in markdown and "| Benchmark | Problems |" in markdown

    # Interrupted mid-write: the first call's 4 lines and a torn 5th. A rerun cuts the tear, generates
    # only the last call's 2 completions (padded to the batch as before) and, its seed depending only on
    # where the call starts, reproduces them byte for byte.
    original = (out / "completions.jsonl").read_bytes()
    lines = original.splitlines(keepends=True)
    (out / "completions.jsonl").write_bytes(b"".join(lines[:4]) + lines[4][:25])
    resumed = main(args)
    assert (resumed["generated"], resumed["skipped"]) == (2, 4)
    assert (out / "completions.jsonl").read_bytes() == original
    assert main(args)["generated"] == 0  # nothing left: no model is even loaded

    with pytest.raises(RuntimeError, match=r"different protocol \(seed: 0 -> 1\)"):
        main(args + ["eval.seed=1"])
    fresh = main(args + ["eval.seed=1", "eval.overwrite=true"])
    assert fresh["generated"] == 6
    assert (out / "completions.jsonl").read_bytes() != original


@pytest.mark.slow
def test_synthetic_run_directory_restores_the_trained_policy(tmp_path):
    """A training run directory: its latest checkpoint, character tokenizer and prompt format. Greedy
    Math-Verify accuracy on the trainer's held-out problems equals the greedy accuracy it logged."""
    from experiments.train import main as train

    run = tmp_path / "run"
    train(["warmup.steps=60", "warmup.batch_size=32", "rollout.prompts_per_minibatch=2",
           "rollout.group_size=4", "rollout.reuse=2", "run.iterations=1", "run.eval_problems=16",
           "run.progress=false", f"run.out_dir={run}"])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    greedy_after = [r["greedy_accuracy"] for r in logged if r["phase"] == "eval"][-1]

    result = main([f"eval.checkpoint={run}", "eval.benchmarks=synthetic", "eval.synthetic_problems=16",
                   "eval.samples=1", "eval.temperature=0", "eval.max_new_tokens=6", "eval.dtype=float32",
                   "eval.num_workers=2", "eval.progress=false", "eval.bootstrap_resamples=100"])
    assert result["out_dir"] == str(run / "eval")
    records = load_completions(run / "eval" / "completions.jsonl")
    assert len(records) == 16 and result["checkpoint"] == "run (step 1)"
    for record in records:  # strict-box (the trainer's reward) and Math-Verify agree on integer answers
        assert record["score"] == float(strict_box_score("\\boxed{" + record["text"], record["answer"]) > 0)
    accuracy = result["benchmarks"]["synthetic"]["pass_at_1"]
    assert accuracy == pytest.approx(greedy_after) and accuracy > 0


# ------------------------------------------------------------------------------- cheap unit checks


def test_paper_protocol_defaults_and_config_errors():
    settings = EvalSettings(checkpoint="x")
    names = settings.benchmark_names()
    assert names == ["aime25", "aime24", "amc23", "olympiadbench", "minerva_math", "math500"]
    assert [settings.samples_for(b) for b in names] == [16, 16, 16, 4, 4, 4]
    protocol = (settings.temperature, settings.top_p, settings.top_k, settings.max_new_tokens)
    assert protocol == (1.0, 0.7, 0, 16_384)
    overridden = apply_overrides(EvalConfig(), ["eval.checkpoint=x", "eval.samples=2"])
    assert overridden.eval.samples_for("aime25") == 2
    for override, error, match in [
        ([], ValueError, "eval.checkpoint is required"),
        (["eval.checkpoint=x", "eval.benchmarks=aime25,gsm8k"], ValueError, r"unknown \['gsm8k'\]"),
        (["eval.checkpoint=x", "eval.benchmarks=math500,math500"], ValueError, "twice"),
        (["eval.checkpoint=x", "eval.benchmarks=synthetic,math500"], ValueError, "cannot be mixed"),
        (["eval.checkpoint=x", "eval.top_p=0"], ValueError, "top_p"),
        (["eval.checkpoint=x", "eval.chat_template=yes"], ValueError, "chat_template"),
        (["eval.checkpoint=x", "eval.sample=3"], KeyError, "eval has"),
        (["eval.checkpoint=x", "eval.limit=two"], ValueError, "cannot parse as int"),
    ]:
        with pytest.raises(error, match=match):
            apply_overrides(EvalConfig(), override)


def test_bad_checkpoint_and_out_dir_are_refused(tmp_path, tiny_hf):
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face checkpoint"):
        main([f"eval.checkpoint={tmp_path}", "eval.progress=false"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "completions.jsonl").write_text("")
    with pytest.raises(RuntimeError, match="no eval_config.json"):
        main([f"eval.checkpoint={tiny_hf}", f"eval.out_dir={out}", f"eval.data_dir={DATA}",
              "eval.progress=false"])
    with pytest.raises(ValueError, match="needs a synthetic-task training run"):
        main([f"eval.checkpoint={tiny_hf}", "eval.benchmarks=synthetic", f"eval.out_dir={tmp_path / 'o2'}"])


def _record(benchmark="b", problem_index=0, sample=0, score=1.0, length=5, truncated=False):
    return {"benchmark": benchmark, "problem_id": f"p{problem_index}", "problem_index": problem_index,
            "sample": sample, "length": length, "truncated": truncated, "score": score, "verify_status": "ok",
            "answer": "1", "text": "t"}


def test_completions_file_torn_tail_duplicates_and_bad_lines(tmp_path, caplog):
    path = tmp_path / "completions.jsonl"
    good = "".join(json.dumps(_record(sample=s)) + "\n" for s in range(2))
    path.write_text(good + '{"benchmark": "b", "probl')
    assert len(load_completions(path)) == 2 and "torn last line" in caplog.text
    without_text = sorted(set(_record()) - {"text"})
    assert [sorted(r) for r in load_completions(path, with_text=False)] == [without_text] * 2
    assert repair_completions(path) == len('{"benchmark": "b", "probl')
    assert path.read_text() == good and repair_completions(path) == 0
    path.write_text(good + json.dumps(_record(sample=1)) + "\n")
    with pytest.raises(ValueError, match=r":3: completion \('b', 'p0', 1\) was already recorded on line 2"):
        load_completions(path)
    path.write_text(good + "not json\n" + json.dumps(_record(sample=3)) + "\n")
    with pytest.raises(ValueError, match=":3: invalid JSON"):
        load_completions(path)
    bad = _record()
    bad["truncated"] = "no"
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=":1: field 'truncated' must be bool"):
        load_completions(path)
    assert load_completions(tmp_path / "absent.jsonl") == []


def test_summary_by_hand():
    records = [_record("a", 0, 0, 1.0), _record("a", 0, 1, 0.0, 9, True), _record("a", 1, 0, 1.0),
               _record("a", 1, 1, 1.0), _record("b", 0, 0, 0.0), _record("b", 0, 1, 0.0)]
    summary = summarize_completions(records, ["b", "a"], num_resamples=500, seed=0)
    assert list(summary["benchmarks"]) == ["b", "a"]
    assert summary["benchmarks"]["a"]["pass_at_1"] == 0.75  # problems (0.5, 1.0)
    assert summary["benchmarks"]["a"]["truncated_fraction"] == 0.25
    assert summary["benchmarks"]["a"]["mean_length"] == 6.0
    assert summary["macro_average"]["pass_at_1"] == 0.375  # (0.75 + 0) / 2
    markdown = summary_markdown(summary, "ckpt")
    assert "| ckpt | 0.0 | 75.0 | 37.5 ± " in markdown
    with pytest.raises(ValueError, match=r"no completions for benchmark\(s\) \['c'\]"):
        summarize_completions(records, ["a", "b", "c"])
    with pytest.raises(ValueError, match="not in the requested list"):
        summarize_completions(records, ["a"])


def test_a_runs_config_json_round_trips_and_unknown_fields_are_named():
    from experiments.train import DEFAULT_CONFIG, load_config
    from respo_jax.training.config import ExperimentConfig, config_from_dict

    overrides = ["objective.name=grpo", "objective.hparams.eps_high=0.28"]  # respo has no eps_high
    config = apply_overrides(load_config(DEFAULT_CONFIG), overrides)
    assert config_from_dict(ExperimentConfig, json.loads(json.dumps(config.to_dict()))) == config
    data = config.to_dict()
    del data["optim"]  # a field or section written before it existed takes its default
    assert config_from_dict(ExperimentConfig, data).optim == ExperimentConfig().optim
    data["rollout"]["reuse_ratio"] = 4
    with pytest.raises(KeyError, match=r"unknown config fields rollout.\['reuse_ratio'\]"):
        config_from_dict(ExperimentConfig, data)
    with pytest.raises(KeyError, match=r"unknown config sections \['trainer'\]"):
        config_from_dict(ExperimentConfig, {"trainer": {}})
