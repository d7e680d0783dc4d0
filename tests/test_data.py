"""Tests of respo_jax.data: benchmark/training records, TFDS builders, batches, prompts and tokenizers.

References: the offline copies in ../shared/data (raw fields re-read independently here), the real
Qwen3 tokenizer rendered by `transformers`, and grain-independent set algebra for the batches.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import json
import os
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from respo_jax.data import (
    BENCHMARKS,
    INSTRUCTION,
    DataFileError,
    PromptBatches,
    PromptFormat,
    encode_prompt,
    encode_prompts,
    filter_overlong,
    load_benchmark,
    load_dapo_math,
    load_tokenizer,
)
from respo_jax.data import records as rec
from respo_jax.data import render_prompt, sources
from respo_jax.data.synthetic import CharTokenizer, get_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))
DATA = os.path.join(SHARED, "data")
QWEN3 = os.path.join(SHARED, "tokenizers", "qwen3")


def _raw_jsonl(relpath):
    with open(os.path.join(DATA, relpath), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# ------------------------------------------------------------------------------------------------
# Benchmarks


@pytest.mark.parametrize(
    "name,count",
    [
        ("aime25", 30),
        ("aime24", 30),
        ("amc23", 40),
        ("olympiadbench", 675),
        ("minerva", 272),
        ("math500", 500),
    ],
)
def test_benchmark_counts_and_fields(name, count):
    records = load_benchmark(name, DATA)
    assert len(records) == count
    for record in records:
        assert set(record) == {"problem", "answer", "id"}
        assert all(isinstance(v, str) for v in record.values())
        assert record["problem"].strip() and record["answer"].strip()
    assert len({r["id"] for r in records}) == count  # ids are unique within a benchmark


def test_aime_answers_drop_leading_zeros():
    raw = _raw_jsonl("aime24/test.jsonl")
    records = load_benchmark("aime24", DATA)
    assert sum(r["answer"].startswith("0") for r in raw) == 7  # "025", "073", ... in the source
    for source, record in zip(raw, records):
        assert record["answer"] == str(int(source["answer"]))
        assert not record["answer"].startswith("0") or record["answer"] == "0"
    assert {r["id"]: r["answer"] for r in records}["67"] == "25"  # source answer "025"
    raw25 = _raw_jsonl("aime25/test.escape_fixed.jsonl")
    assert [r["answer"] for r in load_benchmark("aime25", DATA)] == [str(s["answer"]) for s in raw25]


def test_amc_float_answers_become_integers():
    raw = _raw_jsonl("amc23/test.jsonl")
    records = load_benchmark("amc23", DATA)
    assert records[0]["answer"] == "27" and raw[0]["answer"] == 27.0
    for source, record in zip(raw, records):
        assert re.fullmatch(r"-?\d+", record["answer"]), record
        assert float(record["answer"]) == source["answer"]
    assert rec.normalize_amc_answer(2.5) == "2.5" and rec.normalize_amc_answer("-3.0") == "-3"


def _boxed_by_splitting(solution: str) -> str:
    """An independent extraction: the text after the last "boxed", cut where its braces balance."""
    tail = solution.split("\\boxed")[-1].lstrip()
    assert tail.startswith("{")
    depth = 0
    for pos, char in enumerate(tail):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return tail[1:pos]
    raise AssertionError("unbalanced")


def test_minerva_answer_is_last_boxed():
    raw = _raw_jsonl("minerva_math/test.jsonl")
    records = load_benchmark("minerva", DATA)
    assert records[0]["answer"] == "1.6"
    for source, record in zip(raw, records):
        assert record["answer"] == _boxed_by_splitting(source["solution"]).strip()
    assert rec.last_boxed_content("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert rec.last_boxed_content("\\boxed{1} \\boxed{2") is None  # the last box never closes
    assert rec.last_boxed_content("no box") is None


def test_olympiadbench_final_answer():
    raw = _raw_jsonl("olympiadbench/test.jsonl")
    records = load_benchmark("olympiadbench", DATA)
    for source, record in zip(raw, records):
        assert record["problem"] == source["question"]  # no record has a context
        assert record["answer"] == source["final_answer"][0].replace("$", "").strip()
        assert "$" not in record["answer"]
    multi = [r for s, r in zip(raw, records) if s["is_multiple_answer"]]
    assert len(multi) == 94 and all("," in r["answer"] for r in multi)
    assert rec.normalize_olympiad_answer(["$69$,$84$"]) == "69,84"
    assert rec.normalize_olympiad_answer(["$1$", "$2$"]) == "1,2"


def test_math500_answers_as_is():
    raw = _raw_jsonl("math500/test.jsonl")
    records = load_benchmark("math500", DATA)
    assert [r["answer"] for r in records] == [s["answer"] for s in raw]
    assert [r["id"] for r in records] == [s["unique_id"] for s in raw]


def test_aime25_as_published_is_repaired_on_reading(tmp_path):
    shutil.copy(os.path.join(DATA, "aime25", "test.jsonl"), tmp_path / "test.jsonl")
    repaired = load_benchmark("aime25", tmp_path)  # only the broken file is there: fallback + fix
    assert repaired == load_benchmark("aime25", DATA)
    broken = _raw_jsonl("aime25/test.jsonl")
    assert sum(b["problem"] != r["problem"] for b, r in zip(broken, repaired)) == 3
    assert not any("\x0c" in r["problem"] or "\t" in r["problem"] for r in repaired)


def test_data_dir_may_be_root_folder_or_file():
    by_root = load_benchmark("minerva", DATA)
    assert load_benchmark("minerva", os.path.join(DATA, "minerva_math")) == by_root
    assert load_benchmark("minerva", os.path.join(DATA, "minerva_math", "test.jsonl")) == by_root


def test_unknown_and_missing_datasets(tmp_path):
    with pytest.raises(KeyError, match="aime25.*math500"):
        load_benchmark("gsm8k", DATA)
    with pytest.raises(FileNotFoundError, match="minerva_math"):
        load_benchmark("minerva", tmp_path)


# ------------------------------------------------------------------------------------------------
# Malformed files


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_bad_json_line_names_file_and_line(tmp_path):
    path = _write(tmp_path / "test.jsonl", ['{"problem": "p", "answer": "1", "id": 0}', '{"problem": "p", '])
    with pytest.raises(DataFileError, match=re.escape(f"{path}:2: invalid JSON")) as info:
        load_benchmark("aime24", path)
    assert info.value.path == str(path) and info.value.line == 2


def test_missing_field_names_file_and_line(tmp_path):
    path = _write(
        tmp_path / "test.jsonl", ['{"problem": "p", "answer": 1.0, "id": 0}', "", '{"problem": "q", "id": 1}']
    )
    with pytest.raises(DataFileError, match=re.escape(f"{path}:3: missing field 'answer'")):
        load_benchmark("amc23", path)


def test_empty_file_is_an_error(tmp_path):
    path = _write(tmp_path / "test.jsonl", [])
    with pytest.raises(DataFileError, match=re.escape(f"{path}: empty file")):
        load_benchmark("math500", path)


def test_bad_answers_name_file_and_line(tmp_path):
    minerva = _write(
        tmp_path / "m.jsonl",
        [
            '{"problem": "p", "solution": "so \\\\boxed{2}", "idx": 0}',
            '{"problem": "p", "solution": "no box here", "idx": 1}',
        ],
    )
    with pytest.raises(DataFileError, match=re.escape(f"{minerva}:2: no closed \\boxed")):
        load_benchmark("minerva", minerva)
    aime = _write(tmp_path / "a.jsonl", ['{"problem": "p", "answer": "1/2", "id": 0}'])
    with pytest.raises(
        DataFileError, match=re.escape(f"{aime}:1: AIME answer must be a non-negative integer")
    ):
        load_benchmark("aime24", aime)
    olymp = _write(tmp_path / "o.jsonl", ['{"question": "q", "final_answer": [], "id": 0}'])
    with pytest.raises(DataFileError, match=re.escape(f"{olymp}:1: final_answer")):
        load_benchmark("olympiadbench", olymp)


def test_malformed_parquet_names_file_and_row(tmp_path):
    good = {"content": "What is 1+1?", "role": "user"}
    table = pa.table(
        {
            "prompt": [[good], [good], [{"content": "What is 2+2?", "role": "user"}]],
            "reward_model": [
                {"ground_truth": "2", "style": "rule"},
                {"ground_truth": "2", "style": "rule"},
                {"ground_truth": "", "style": "rule"},
            ],
        }
    )
    path = tmp_path / "dapo.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataFileError, match=re.escape(f"{path} (row 2): reward_model.ground_truth")):
        load_dapo_math(path)
    pq.write_table(pa.table({"prompt": [[good]]}), path)
    with pytest.raises(DataFileError, match="missing column 'reward_model'"):
        load_dapo_math(path)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataFileError, match="junk.parquet: not a readable parquet file"):
        load_dapo_math(tmp_path / "junk.parquet")


# ------------------------------------------------------------------------------------------------
# DAPO-Math-17k


@pytest.fixture(scope="module")
def dapo():
    return load_dapo_math(DATA, return_stats=True)


def test_dapo_dedup_counts(dapo):
    records, stats = dapo
    # Independent count from the raw parquet: the official preparation strips each problem text (the
    # local copy has no DAPO instruction left to remove), then group rows by exact text.
    table = pq.read_table(os.path.join(DATA, "dapo_math_17k", "dapo_math_17k.parquet"))
    problems = [p[0]["content"].strip() for p in table.column("prompt").to_pylist()]
    answers = [r["ground_truth"] for r in table.column("reward_model").to_pylist()]
    by_text = collections.defaultdict(list)
    for problem, answer in zip(problems, answers):
        by_text[problem].append(answer)
    conflicting = {p for p, a in by_text.items() if len(set(a)) > 1}
    consistent = {p for p, a in by_text.items() if len(set(a)) == 1}
    merged = sum(len(by_text[p]) - 1 for p in consistent)
    dropped = sum(len(by_text[p]) for p in conflicting)

    assert len(problems) == stats.total_rows == 17_917
    assert (stats.merged_rows, stats.conflicting_problems, stats.conflicting_rows) == (
        merged,
        len(conflicting),
        dropped,
    )
    assert (merged, len(conflicting), dropped) == (650, 12, 24)
    assert len(records) == stats.kept == 17_917 - merged - dropped == 17_243
    assert {r["problem"] for r in records} == consistent
    assert all(r["problem"] == r["problem"].strip() for r in records)
    assert all(r["answer"] == by_text[r["problem"]][0] and r["answer"].strip() for r in records)
    assert len({r["id"] for r in records}) == len(records)


def test_dapo_problem_text_mirrors_the_official_preparation():
    problem = "Let $x$ be real. Find $x$."
    raw = rec.DAPO_PROMPT_PREFIX + problem + rec.DAPO_PROMPT_SUFFIX
    assert raw.startswith("Solve the following math problem step by step.")
    assert rec.dapo_problem_text(raw) == problem
    assert rec.dapo_problem_text("\n  " + problem + "  \n") == problem
    assert rec.dapo_problem_text(problem) == problem


def test_dapo_prompt_is_chat_rendered_with_the_box_instruction(dapo, qwen3):
    record = dapo[0][0]
    text = render_prompt(record["problem"], qwen3, PromptFormat())
    assert text.startswith("<|im_start|>user\n" + record["problem"] + INSTRUCTION)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_dapo_keeps_chinese_problems(dapo):
    records, _ = dapo
    chinese = [r for r in records if re.search(r"[\u4e00-\u9fff]", r["problem"])]
    assert len(chinese) > 3_000


def test_dedup_rule_on_a_small_table():
    rows = [
        (0, "a", "1", "x0"),
        (1, "b", "2", "x1"),
        (2, "a", "1", "x2"),
        (3, "c", "3", "x3"),
        (4, "c", "4", "x4"),
    ]
    kept, stats = rec.deduplicate(rows)
    assert kept == [{"problem": "a", "answer": "1", "id": "x0"}, {"problem": "b", "answer": "2", "id": "x1"}]
    assert stats == rec.DedupStats(
        total_rows=5, kept=2, merged_rows=1, conflicting_problems=1, conflicting_rows=2
    )


# ------------------------------------------------------------------------------------------------
# Public sources and download (no network: the fetch is injected)


def test_download_checks_hash_and_writes_layout(tmp_path):
    urls = []

    def local_fetch(url):
        urls.append(url)
        return open(os.path.join(DATA, "amc23", "test.jsonl"), "rb").read()

    path = sources.download_dataset("amc23", tmp_path, fetch=local_fetch)
    assert path == str(tmp_path / "amc23" / "test.jsonl")
    assert urls == [sources.PUBLIC_SOURCES["amc23"].url]
    assert urls[0].startswith("https://raw.githubusercontent.com/QwenLM/Qwen2.5-Math/a45202b")
    assert load_benchmark("amc23", tmp_path) == load_benchmark("amc23", DATA)
    sources.download_dataset("amc23", tmp_path, fetch=lambda url: pytest.fail("fetched again"))  # cached

    with pytest.raises(ValueError, match="SHA-256"):
        sources.download_dataset("aime24", tmp_path, fetch=lambda url: b"tampered")
    assert not (tmp_path / "aime24").exists()


def test_recorded_hashes_match_the_offline_copies():
    manifest = {m["file"]: m for m in json.load(open(os.path.join(DATA, "MANIFEST.json")))}
    for name, source in sources.PUBLIC_SOURCES.items():
        relpath = f"{rec.SPECS[name].folder}/{source.filename}"
        digest = hashlib.sha256(open(os.path.join(DATA, relpath), "rb").read()).hexdigest()
        assert digest == source.sha256 == manifest[relpath]["sha256"], name
        assert (source.repo, source.commit, source.path) == (
            manifest[relpath]["source_repo"],
            manifest[relpath]["source_commit"],
            manifest[relpath]["source_path"],
        )


# ------------------------------------------------------------------------------------------------
# TFDS builders (array_record, without TensorFlow)


def test_tfds_builders_without_tensorflow(tmp_path, dapo):
    assert importlib.util.find_spec("tensorflow") is None  # the builders must not need it
    import tensorflow_datasets as tfds

    from respo_jax.data import tfds_builders

    # One builder whose configs are the datasets (it replaced one class per dataset that yielded
    # `enumerate(load_records(name))`): every built example is that record, in that order.
    assert [c.name for c in tfds_builders.RespoRecords.BUILDER_CONFIGS] == list(rec.SPECS)
    for name in (*BENCHMARKS, "dapo_math"):
        builder = tfds_builders.prepare(name, tmp_path, manual_dir=DATA)
        split = tfds_builders.split_of(name)
        assert split == ("train" if name == "dapo_math" else "test")
        assert (builder.name, builder.builder_config.name) == ("respo_records", name)
        assert builder.info.file_format.value == "array_record" and list(builder.info.splits) == [split]
        assert sorted(builder.info.features) == ["answer", "id", "problem"]
        source = tfds.data_source(f"respo_records/{name}", data_dir=str(tmp_path), split=split)
        expected = dapo[0] if name == "dapo_math" else load_benchmark(name, DATA)
        assert builder.info.splits[split].num_examples == len(source) == len(expected), name
        # every benchmark record; every 11th of DAPO-Math's 17k and its last (decoding is the cost)
        step = 11 if name == "dapo_math" else 1
        keys = sorted({*range(0, len(source), step), len(source) - 1})
        got = [{k: v.decode("utf-8") for k, v in x.items()} for x in source.__getitems__(keys)]
        assert got == [expected[i] for i in keys], name
    built = sorted(f for f in os.listdir(tmp_path / "respo_records") if not f.startswith("."))
    assert built == sorted(rec.SPECS)  # one folder per config


def test_tfds_builder_from_dataset_folder_and_unknown_name(tmp_path):
    from respo_jax.data import tfds_builders

    builder = tfds_builders.prepare("amc23", tmp_path, manual_dir=os.path.join(DATA, "amc23"))
    assert builder.info.splits["test"].num_examples == 40
    with pytest.raises(KeyError, match="known: aime25"):
        tfds_builders.prepare("gsm8k", tmp_path, manual_dir=DATA)


# ------------------------------------------------------------------------------------------------
# Batches


def _ids(batch):
    return [r["id"] for r in batch]


def test_batches_are_epoch_permutations_and_deterministic():
    source = [{"problem": f"p{i}", "answer": str(i), "id": str(i)} for i in range(23)]
    batches = list(PromptBatches(source, batch_size=5, seed=3, num_epochs=3))
    assert len(batches) == 3 * 4  # 23 // 5 batches per epoch, the remainder of 3 is dropped
    epochs = [sum((_ids(b) for b in batches[e * 4 : (e + 1) * 4]), []) for e in range(3)]
    for epoch in epochs:
        assert len(epoch) == len(set(epoch)) == 20 and set(epoch) <= {r["id"] for r in source}
    assert len({tuple(e) for e in epochs}) == 3  # a fresh shuffle each epoch
    assert epochs[0] != [str(i) for i in range(20)]
    again = list(PromptBatches(source, batch_size=5, seed=3, num_epochs=3))
    assert [_ids(b) for b in again] == [_ids(b) for b in batches]
    other = list(PromptBatches(source, batch_size=5, seed=4, num_epochs=3))
    assert [_ids(b) for b in other] != [_ids(b) for b in batches]
    other_epochs = [sum((_ids(b) for b in other[e * 4 : (e + 1) * 4]), []) for e in range(3)]
    assert other_epochs[0] != epochs[1] and other_epochs[1] != epochs[2]  # seeds are not shifted copies


def test_batches_resume_from_state():
    source = [{"problem": f"p{i}", "answer": str(i), "id": str(i)} for i in range(50)]
    run = PromptBatches(source, batch_size=8, seed=11)  # endless
    for _ in range(9):  # into the second epoch (6 batches per epoch)
        next(run)
    state = json.loads(json.dumps(run.get_state()))  # what a checkpoint stores
    expected = [_ids(next(run)) for _ in range(7)]

    resumed = PromptBatches(source, batch_size=8, seed=11)
    resumed.set_state(state)
    assert resumed.epoch == 1
    assert [_ids(next(resumed)) for _ in range(7)] == expected
    with pytest.raises(ValueError, match="seed=11 vs 12"):
        PromptBatches(source, batch_size=8, seed=12).set_state(state)
    with pytest.raises(KeyError, match="step"):
        resumed.set_state({"seed": 11})


def test_batches_end_and_reject_bad_setup():
    source = [{"problem": "p", "answer": "1", "id": str(i)} for i in range(4)]
    finite = PromptBatches(source, batch_size=2, seed=0, num_epochs=1)
    assert len(list(finite)) == 2
    with pytest.raises(StopIteration):
        next(finite)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptBatches(source, batch_size=5, seed=0)


def test_batches_over_a_tfds_data_source(tmp_path):
    import tensorflow_datasets as tfds

    from respo_jax.data import tfds_builders

    tfds_builders.prepare("amc23", tmp_path, manual_dir=DATA)
    source = tfds.data_source("respo_records/amc23", data_dir=str(tmp_path), split="test")
    from_tfds = PromptBatches(source, batch_size=8, seed=5, num_epochs=1)
    from_list = PromptBatches(load_benchmark("amc23", DATA), batch_size=8, seed=5, num_epochs=1)
    assert list(from_tfds) == list(from_list)  # same order, bytes decoded to str


# ------------------------------------------------------------------------------------------------
# Tokenizer and prompts (real Qwen3 tokenizer; transformers is the reference)


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer(QWEN3)


@pytest.fixture(scope="module")
def hf_qwen3():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3)


def test_qwen3_tokenizer_matches_transformers(qwen3, hf_qwen3):
    assert qwen3.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert qwen3.pad_id == hf_qwen3.pad_token_id == 151643
    assert qwen3.eos_ids == (hf_qwen3.eos_token_id,) == (151645,)
    assert qwen3.bos_id is None and qwen3.vocab_size == len(hf_qwen3) == 151_669
    texts = [
        "求函数 $f(x)=x^2$ 的最小值。",
        "Let $\\frac{a}{b}$ be  \n\t <|im_end|> x",
        "  spaces  ",
        "🙂 emoji",
    ]
    for text in texts:
        ids = qwen3.encode(text)
        assert ids == hf_qwen3.encode(text, add_special_tokens=False)
        assert qwen3.decode(ids) == hf_qwen3.decode(ids, skip_special_tokens=True)
        assert qwen3.decode(ids, skip_special_tokens=False) == hf_qwen3.decode(ids)


def test_prompt_template_is_the_papers():
    fmt = PromptFormat()
    assert fmt.user_message("What is 1+1?") == (
        "What is 1+1? Please reason step by step, and put your final answer within \\boxed{}."
    )
    assert PromptFormat(template="Q: {problem}\nA:").user_message("x {problem} y") == "Q: x {problem} y\nA:"
    with pytest.raises(ValueError, match="exactly once"):
        PromptFormat(template="no placeholder")


def test_chat_prompts_match_transformers(qwen3, hf_qwen3, dapo):
    problems = [load_benchmark("aime25", DATA)[18]["problem"], dapo[0][0]["problem"]]
    problems += [r["problem"] for r in dapo[0] if re.search(r"[\u4e00-\u9fff]", r["problem"])][:1]
    for problem in problems:
        messages = [{"role": "user", "content": PromptFormat().user_message(problem)}]
        expected_text = hf_qwen3.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected_ids = hf_qwen3(expected_text, add_special_tokens=False)["input_ids"]
        assert render_prompt(problem, qwen3) == expected_text
        assert encode_prompt(problem, qwen3) == expected_ids
        assert expected_text.endswith("<|im_start|>assistant\n")
    no_think = PromptFormat(chat_kwargs=(("enable_thinking", False),))
    messages = [{"role": "user", "content": no_think.user_message("2+2?")}]
    assert render_prompt("2+2?", qwen3, no_think) == hf_qwen3.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )


def test_raw_prompts_for_base_models(qwen3):
    raw = PromptFormat(chat=False)
    assert render_prompt("1+1?", qwen3, raw) == raw.user_message("1+1?")
    assert encode_prompt("1+1?", qwen3, raw) == qwen3.encode(
        raw.user_message("1+1?"), add_special_tokens=True
    )
    hinted = PromptFormat(chat=False, response_prefix="Answer: \\boxed{")
    assert render_prompt("1+1?", qwen3, hinted).endswith("Answer: \\boxed{")
    assert hinted.solution_text("2}") == "Answer: \\boxed{2}"


def test_tokenizer_dir_variants(tmp_path, qwen3, hf_qwen3):
    """A directory with chat_template.jinja and generation_config.json; one with no template at all."""
    config = json.load(open(os.path.join(QWEN3, "tokenizer_config.json")))
    template = config.pop("chat_template")
    os.symlink(os.path.join(QWEN3, "tokenizer.json"), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    variant = load_tokenizer(tmp_path)
    assert variant.eos_ids == (151645, 151643) and variant.eos_id == 151645
    assert render_prompt("x", variant) == render_prompt("x", qwen3)

    (tmp_path / "chat_template.jinja").unlink()
    bare = load_tokenizer(tmp_path)
    assert not bare.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt("x", bare)
    assert encode_prompt("x", bare, PromptFormat(chat=False)) == hf_qwen3.encode(
        PromptFormat().user_message("x")
    )
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "nowhere")


def test_encode_prompts_is_encode_prompt_batched(qwen3, hf_qwen3):
    """The trainer's start tokenizes the training set in one batch: the same ids as one prompt at a time
    (chat-rendered, raw with the tokenizer's own special tokens, and the synthetic task's tokenizer),
    checked against transformers' tokenizer for the raw form."""
    problems = ["What is $1+1$?", "long " * 300, "Find $x$ such that $x^2 = 4$.", ""]
    for fmt in (PromptFormat(), PromptFormat(chat=False)):
        batched = encode_prompts(problems, qwen3, fmt)
        assert batched == [encode_prompt(p, qwen3, fmt) for p in problems]
        assert len({len(ids) for ids in batched}) == len(problems)  # no padding to a common length
    raw = encode_prompts(problems, qwen3, PromptFormat(chat=False))
    assert raw == [hf_qwen3.encode(PromptFormat(chat=False).user_message(p)) for p in problems]
    task, chars = get_task("easy"), CharTokenizer()
    synthetic = [r["problem"] for r in task.make_records(5, seed=0)]
    assert encode_prompts(synthetic, chars, task.prompt_format) == \
        [encode_prompt(p, chars, task.prompt_format) for p in synthetic]


def test_filter_overlong(qwen3):
    records = [
        {"problem": "short", "answer": "1", "id": "0"},
        {"problem": "long " * 400, "answer": "2", "id": "1"},
    ]
    kept, dropped = filter_overlong(records, lambda p: encode_prompt(p, qwen3), max_prompt_length=64)
    assert kept == records[:1] and dropped == 1
    assert len(encode_prompt("short", qwen3)) <= 64 < len(encode_prompt("long " * 400, qwen3))
