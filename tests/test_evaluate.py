"""`python -m experiments.evaluate` end to end, and the completions file it writes.

References: a tiny random Hugging Face Qwen3 (built with `transformers`) with the real Qwen3 tokenizer on
a MATH-500 slice of ../shared/data, rescored here with Math-Verify's verl metric called directly; the
statistics recomputed from the completions; a synthetic-task training run whose greedy accuracy the
trainer logged; byte-identical completions after an interrupted run resumes.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.evaluate import cli, main
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
from respo_jax.training.config import ConfigError, apply_overrides

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
    # only the last call's 2 completions (padded to the batch as before) and, each sample being seeded by
    # its (benchmark, problem, sample), reproduces them byte for byte.
    original = (out / "completions.jsonl").read_bytes()
    lines = original.splitlines(keepends=True)
    (out / "completions.jsonl").write_bytes(b"".join(lines[:4]) + lines[4][:25])
    resumed = main(args)
    assert (resumed["generated"], resumed["skipped"]) == (2, 4)
    assert (out / "completions.jsonl").read_bytes() == original
    assert main(args)["generated"] == 0  # nothing left: no model is even loaded

    with pytest.raises(ConfigError, match=r"different protocol \(seed: 0 -> 1\)"):
        main(args + ["eval.seed=1"])
    fresh = main(args + ["eval.seed=1", "eval.overwrite=true"])
    assert fresh["generated"] == 6
    assert (out / "completions.jsonl").read_bytes() != original


@pytest.mark.slow
def test_synthetic_run_directory_restores_the_trained_policy(tmp_path, capsys):
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

    # A damaged checkpoint (a file that no longer matches its manifest): refused in one line, and the
    # new out_dir is not left behind.
    step_files = [path for path in (run / "checkpoints" / "1").rglob("*") if path.is_file()]
    with open(max(step_files, key=lambda path: path.stat().st_size), "ab") as handle:
        handle.write(b"x")
    out = tmp_path / "damaged_eval"
    capsys.readouterr()
    assert cli([f"eval.checkpoint={run}", "eval.benchmarks=synthetic", "eval.synthetic_problems=4",
                "eval.max_new_tokens=6", f"eval.out_dir={out}", "eval.progress=false"]) == 2
    line = _one_error_line(capsys)
    assert "the weights do not load: checkpoint step 1" in line and "does not match its SHA-256" in line
    assert not out.exists()


# ------------------------------------------------------------------------------- cheap unit checks


def test_paper_protocol_defaults():
    settings = EvalSettings(checkpoint="x")
    names = settings.benchmark_names()
    assert names == ["aime25", "aime24", "amc23", "olympiadbench", "minerva_math", "math500"]
    assert [settings.samples_for(b) for b in names] == [16, 16, 16, 4, 4, 4]
    protocol = (settings.temperature, settings.top_p, settings.top_k, settings.max_new_tokens)
    assert protocol == (1.0, 0.7, 0, 16_384)
    overridden = apply_overrides(EvalConfig(), ["eval.checkpoint=x", "eval.samples=2"])
    assert overridden.eval.samples_for("aime25") == 2


def test_eval_engine_fields_map_into_the_samplers_engine_config():
    from respo_jax.sampling import EngineConfig

    settings = EvalSettings(checkpoint="x")
    # Continuous by default; calls of several times the slots, so finished rows' slots are refilled.
    assert settings.engine_config() == EngineConfig(
        scheduler="continuous", prompt_bucket=128, max_slots=32, steps_per_schedule=32, page_size=64,
        num_pages=None, kv_cache_bytes=None)
    assert settings.batch_size >= 4 * settings.max_slots
    changed = apply_overrides(EvalConfig(), [
        "eval.checkpoint=x", "eval.scheduler=static", "eval.max_slots=6", "eval.steps_per_schedule=2",
        "eval.page_size=8", "eval.num_pages=50", "eval.paged_attention_impl=pallas_tpu",
        "eval.min_decode_slots=3"]).eval
    assert changed.engine_config() == EngineConfig(
        scheduler="static", prompt_bucket=128, max_slots=6, steps_per_schedule=2, page_size=8, num_pages=50,
        paged_attention_impl="pallas_tpu",
        min_decode_slots=3)
    budget = apply_overrides(EvalConfig(), ["eval.checkpoint=x", "eval.kv_cache_bytes=123456"]).eval
    assert (budget.engine_config().kv_cache_bytes, budget.engine_config().num_pages) == (123456, None)


def _one_error_line(capsys) -> str:
    """The command's stderr, which must be exactly one `error: ...` line (and stdout empty)."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not captured.out, captured.err
    return lines[0]


@pytest.mark.parametrize("override,match", [
    ("eval.progress=false", r"eval.checkpoint='': expected a Hugging Face checkpoint directory"),
    ("eval.benchmarks=aime25,gsm8k", r"eval.benchmarks='aime25,gsm8k': .*\(unknown: \['gsm8k'\]\)"),
    ("eval.benchmarks= , ", r"eval.benchmarks=' , ': expected a comma-separated list"),
    ("eval.benchmarks=math500,math500", r"eval.benchmarks='math500,math500': expected each benchmark at"),
    ("eval.benchmarks=synthetic,math500", r"eval.benchmarks='synthetic,math500': expected synthetic alone"),
    ("eval.max_new_tokens=0", r"eval.max_new_tokens=0: expected an integer >= 1"),
    ("eval.batch_size=-2", r"eval.batch_size=-2: expected an integer >= 1"),
    ("eval.prompt_bucket=0", r"eval.prompt_bucket=0: expected an integer >= 1"),
    ("eval.synthetic_problems=0", r"eval.synthetic_problems=0: expected an integer >= 1"),
    ("eval.bootstrap_resamples=1", r"eval.bootstrap_resamples=1: expected an integer >= 2"),
    ("eval.samples=-1", r"eval.samples=-1: expected an integer >= 0 \(0: the paper's counts\)"),
    ("eval.top_k=-1", r"eval.top_k=-1: expected an integer >= 0"),
    ("eval.limit=-3", r"eval.limit=-3: expected an integer >= 0"),
    ("eval.decode_chunk_size=1024", r"eval.decode_chunk_size no longer exists: .*eval.page_size"),
    ("eval.scheduler=paged", r"eval.scheduler='paged': expected 'continuous' or 'static'"),
    ("eval.max_slots=0", r"eval.max_slots=0: expected an integer >= 1"),
    ("eval.steps_per_schedule=0", r"eval.steps_per_schedule=0: expected an integer >= 1"),
    ("eval.page_size=0", r"eval.page_size=0: expected an integer >= 1"),
    ("eval.num_pages=-2", r"eval.num_pages=-2: expected an integer >= 0 \(0: unset\)"),
    ("eval.kv_cache_bytes=-1", r"eval.kv_cache_bytes=-1: expected an integer >= 0 \(0: unset\)"),
    ("eval.paged_attention_impl=flash", r"eval.paged_attention_impl='flash': expected one of 'gather', "),
    # an accelerator kernel on CPU devices: refused at start-up, before the checkpoint is even read
    ("eval.paged_attention_impl=pallas_gpu", r"eval.paged_attention_impl='pallas_gpu': .*runs on gpu devices; "
                                             r"the engine runs on cpu devices"),
    ("eval.num_workers=-1", r"eval.num_workers=-1: expected an integer >= 0"),
    ("eval.seed=-1", r"eval.seed=-1: expected an integer in \[0, 2\*\*64\)"),
    (f"eval.seed={2**64}", r"eval.seed=18446744073709551616: expected an integer in \[0, 2\*\*64\)"),
    ("eval.bootstrap_seed=-1", r"eval.bootstrap_seed=-1: expected an integer in \[0, 2\*\*64\)"),
    ("eval.temperature=-0.5", r"eval.temperature=-0.5: expected a number >= 0 \(0: greedy\)"),
    ("eval.temperature=nan", r"eval.temperature=nan: expected a finite number"),
    ("eval.top_p=0", r"eval.top_p=0.0: expected a number in \(0, 1\]"),
    ("eval.top_p=1.5", r"eval.top_p=1.5: expected a number in \(0, 1\]"),
    ("eval.chat_template=yes", r"eval.chat_template='yes': expected auto, true or false"),
    ("eval.dtype=float16", r"eval.dtype='float16': expected '' \(the checkpoint's\), float32 or bfloat16"),
    ("eval.verify_timeout_s=0", r"eval.verify_timeout_s=0.0: expected a number > 0"),
    ("eval.verify_timeout_s=inf", r"eval.verify_timeout_s=inf: expected a finite number"),
    ("eval.limit=two", r"eval.limit='two': cannot parse as int"),
    ("eval.overwrite=maybe", r"eval.overwrite='maybe': cannot parse as bool"),
    ("eval.sample=3", r"unknown config key 'eval.sample'; eval has \["),
    ("eval.samples", r"override 'eval.samples' is not of the form section.field=value"),
    ("mesh.data=0", r"mesh.data=0: expected an integer >= 1, or -1"),
    ("mesh.data=64", r"mesh: .*64 devices, but"),  # the trainer's mesh building: too few devices
])
def test_each_bad_eval_value_is_one_line_and_exit_2(override, match, tmp_path, capsys):
    checkpoint = [] if override == "eval.progress=false" else [f"eval.checkpoint={tmp_path / 'absent'}"]
    out = tmp_path / "out"
    assert cli([*checkpoint, f"eval.out_dir={out}", override]) == 2
    assert re.search(match, _one_error_line(capsys))
    assert os.listdir(tmp_path) == []  # refused before anything was written


def test_a_config_file_with_a_wrongly_typed_field_is_one_line(tmp_path, capsys):
    config = tmp_path / "eval_config.py"
    config.write_text("from respo_jax.eval.config import EvalConfig, EvalSettings\n\n"
                      "def get_config():\n    return EvalConfig(EvalSettings(checkpoint='x', samples='2'))\n")
    assert cli(["--config", str(config)]) == 2
    assert _one_error_line(capsys) == "error: eval.samples='2': expected an integer"
    assert cli(["--config", str(tmp_path / "missing.py")]) == 2
    assert "no such file" in _one_error_line(capsys)
    assert cli(["--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in _one_error_line(capsys)


def test_refused_starts_are_one_line_and_leave_nothing_behind(tiny_hf, tmp_path, capsys):
    """A missing or broken checkpoint, benchmark file, prompt length or out_dir: exit 2, one line naming
    it, and no out_dir left (today's broken checkpoint left .lock, completions.jsonl, eval_config.json)."""
    from respo_jax.training.config import ExperimentConfig

    out = tmp_path / "out"
    args = [f"eval.out_dir={out}", f"eval.data_dir={DATA}", "eval.benchmarks=math500", "eval.limit=2",
            "eval.samples=1", "eval.max_new_tokens=4", "eval.num_workers=1", "eval.progress=false"]

    def refused(*extra) -> str:
        assert cli([*args, *extra]) == 2
        line = _one_error_line(capsys)
        assert not out.exists(), os.listdir(out)
        return line

    def copy(name: str) -> pathlib.Path:
        return pathlib.Path(shutil.copytree(tiny_hf, tmp_path / name))

    assert "expected a directory" in refused(f"eval.checkpoint={tmp_path / 'absent'}")
    (tmp_path / "empty").mkdir()
    assert "this has neither" in refused(f"eval.checkpoint={tmp_path / 'empty'}")
    broken_json = copy("broken_json")
    (broken_json / "config.json").write_text("{")
    assert refused(f"eval.checkpoint={broken_json}").startswith(f"error: eval.checkpoint='{broken_json}': ")
    no_weights = copy("no_weights")
    (no_weights / "model.safetensors").unlink()
    assert "needs *.safetensors weights" in refused(f"eval.checkpoint={no_weights}")
    damaged = copy("damaged")
    with open(damaged / "model.safetensors", "r+b") as handle:
        handle.truncate(64)
    line = refused(f"eval.checkpoint={damaged}")
    assert "the weights do not load" in line and "not a readable safetensors file" in line
    run = tmp_path / "run_without_checkpoint"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(ExperimentConfig().to_dict()))
    assert "the run directory has no checkpoint under" in refused(f"eval.checkpoint={run}")

    hf = f"eval.checkpoint={tiny_hf}"
    assert "expected a synthetic-task training run" in refused(hf, "eval.benchmarks=synthetic")
    line = refused(hf, "eval.paged_attention_impl=pallas_tpu", "eval.paged_attention_interpret=true")
    assert line == ("error: eval.paged_attention_impl='pallas_tpu': needs head_dim a multiple of 128 (Pallas "
                    "TPU blocks); the model's is 16 (use 'gather')"), line
    bad_data = tmp_path / "bad_data"
    (bad_data / "math500").mkdir(parents=True)
    (bad_data / "math500" / "test.jsonl").write_text('{"problem": "1+1?"\n')
    line = refused(hf, f"eval.data_dir={bad_data}")
    assert line.startswith(f"error: eval.data_dir='{bad_data}': benchmark 'math500': ")
    assert "test.jsonl" in line
    assert "benchmark 'math500'" in refused(hf, f"eval.data_dir={tmp_path / 'empty'}")
    line = refused(hf, "eval.max_new_tokens=10000000")
    assert re.search(r"eval.max_new_tokens=10000000: expected at most \d+, the model's max_position_"
                     r"embeddings \(2048\) less the longest prompt", line), line
    (tmp_path / "a_file").write_text("")
    assert cli([*args, hf, f"eval.out_dir={tmp_path / 'a_file' / 'eval'}"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: eval.out_dir={str(tmp_path / 'a_file' / 'eval')!r}: cannot write the run "
                           "directory") and "choose a writable directory" in line, line

    # An out_dir with another protocol's (or an unexplained) outputs: refused, its files untouched.
    out.mkdir()
    (out / "completions.jsonl").write_text("")
    assert cli([*args, hf]) == 2
    assert "no eval_config.json saying how they were made" in _one_error_line(capsys)
    (out / "eval_config.json").write_text(json.dumps({"protocol": {"seed": 5}}))
    before = {name: (out / name).read_bytes() for name in os.listdir(out) if name != ".lock"}
    assert cli([*args, hf]) == 2
    assert "holds an evaluation with a different protocol" in _one_error_line(capsys)
    assert {name: (out / name).read_bytes() for name in os.listdir(out) if name != ".lock"} == before


def test_a_second_evaluation_of_one_out_dir_is_refused_naming_the_holder(tiny_hf, tmp_path, capsys):
    from respo_jax.training.run_lock import RunLock

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from respo_jax.training.run_lock import RunLock; "
         "lock = RunLock.acquire(sys.argv[1], 'evaluation'); print('held', flush=True); time.sleep(120)",
         str(out)],
        stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert holder.stdout.readline() == "held\n"
        assert cli([f"eval.checkpoint={tiny_hf}", f"eval.out_dir={out}", f"eval.data_dir={DATA}",
                    "eval.benchmarks=math500", "eval.limit=1", "eval.max_new_tokens=4",
                    "eval.progress=false"]) == 2
        line = _one_error_line(capsys)
        assert f"'{out}' is being written by another process (evaluation, pid {holder.pid} on" in line
        assert os.listdir(out) == [".lock"]  # nothing written next to the holder's lock
    finally:
        holder.kill()
        holder.wait()
    RunLock.acquire(str(out), "evaluation").release()  # the kernel dropped the killed holder's lock


REPO = pathlib.Path(__file__).resolve().parents[1]


def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _resume_args(tiny_hf, out, batch_size=2) -> list[str]:
    """6 MATH-500 problems x 2 samples in calls of `batch_size` rows: 12 completions, 6 calls at 2."""
    return [f"eval.checkpoint={tiny_hf}", "eval.benchmarks=math500", f"eval.data_dir={DATA}",
            f"eval.out_dir={out}", "eval.limit=6", "eval.samples=2", "eval.max_new_tokens=24",
            "eval.dtype=float32", f"eval.batch_size={batch_size}", "eval.prompt_bucket=512",
            "eval.num_workers=1", "eval.progress=false", "eval.bootstrap_resamples=100"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_hf, tmp_path_factory) -> bytes:
    """completions.jsonl of an evaluation run start to end in this process."""
    out = tmp_path_factory.mktemp("uninterrupted") / "eval"
    assert main(_resume_args(tiny_hf, out))["generated"] == 12
    return (out / "completions.jsonl").read_bytes()


@pytest.mark.slow
def test_the_static_engine_writes_the_continuous_engines_completions(tiny_hf, uninterrupted, tmp_path):
    """For one seed both engines draw the same samples: the completions file is the same bytes (the
    engine is not part of the protocol), with another slot count and schedule length too."""
    static = tmp_path / "static"
    assert main(_resume_args(tiny_hf, static) + ["eval.scheduler=static"])["generated"] == 12
    assert (static / "completions.jsonl").read_bytes() == uninterrupted
    slots = tmp_path / "slots"
    assert main(_resume_args(tiny_hf, slots, batch_size=6) + ["eval.max_slots=4", "eval.steps_per_schedule=5",
                                                               "eval.page_size=16"])["generated"] == 12
    assert (slots / "completions.jsonl").read_bytes() == uninterrupted


@pytest.mark.slow
def test_kill_9_torn_line_and_rerun_write_the_uninterrupted_completions(tiny_hf, uninterrupted, tmp_path):
    """`python -m experiments.evaluate` killed with SIGKILL after its first call, a torn line appended, then
    rerun: completions.jsonl is byte-identical to an uninterrupted run's, with the same eval.batch_size
    and with another (the resumed calls start at other rows: samples are keyed by problem and sample)."""
    out = tmp_path / "killed"
    completions = out / "completions.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "experiments.evaluate", *_resume_args(tiny_hf, out)],
                               cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while process.poll() is None and not (completions.exists() and b"\n" in completions.read_bytes()):
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    written = completions.read_bytes()
    done = written.count(b"\n")
    assert 1 <= done < 12 and uninterrupted.startswith(written[: written.rindex(b"\n") + 1])
    with open(completions, "ab") as handle:
        handle.write(b'{"benchmark": "math500", "problem_id": "test/prealgebra/')  # a torn last line
    other = tmp_path / "killed_other_batch"
    shutil.copytree(out, other)

    resumed = main(_resume_args(tiny_hf, out))
    assert (resumed["skipped"], resumed["generated"]) == (done, 12 - done)
    assert completions.read_bytes() == uninterrupted
    resumed = main(_resume_args(tiny_hf, other, batch_size=3))
    assert (resumed["skipped"], resumed["generated"]) == (done, 12 - done)
    assert (other / "completions.jsonl").read_bytes() == uninterrupted


@pytest.mark.slow
def test_a_full_disk_while_appending_is_one_line_exit_1_and_a_rerun_resumes(tiny_hf, uninterrupted,
                                                                           tmp_path, capsys, monkeypatch):
    import experiments.evaluate as evaluate_module

    out = tmp_path / "eval"
    calls = []
    real_append = evaluate_module.append_completions

    def append_until_the_disk_is_full(handle, records):
        calls.append(len(records))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_append(handle, records)

    monkeypatch.setattr(evaluate_module, "append_completions", append_until_the_disk_is_full)
    assert cli(_resume_args(tiny_hf, out)) == 1
    line = _one_error_line(capsys)
    assert line.startswith(f"error: cannot write completions to {out / 'completions.jsonl'}: No space left "
                           "on device [errno 28] (") and "MiB free of" in line, line
    assert line.endswith("make room and rerun to resume"), line
    assert (out / "completions.jsonl").read_bytes() == b"".join(uninterrupted.splitlines(keepends=True)[:2])
    monkeypatch.setattr(evaluate_module, "append_completions", real_append)
    assert main(_resume_args(tiny_hf, out))["generated"] == 10
    assert (out / "completions.jsonl").read_bytes() == uninterrupted


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
