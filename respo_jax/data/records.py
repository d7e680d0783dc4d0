"""Readers for the paper's training set and six benchmarks (§4.1): each yields `{problem, answer, id}`.

Every dataset is published in its own layout; the readers here are the one place that turns a local
file into uniform records with the answer normalized per dataset, so the TFDS builders, scripts and
notebooks all see the same data. A malformed file fails with the file and line (or parquet row) named.

Per-dataset answer rules (the reference an evaluator compares against):
  aime25, aime24  integer, written without leading zeros ("025" -> "25", 70 -> "70")
  amc23           a float that is an integer is written as one (27.0 -> "27"); other values as given
  math500         the `answer` field as is (LaTeX)
  minerva         the content of the last brace-balanced `\\boxed{...}` in `solution`
  olympiadbench   `final_answer` (a list; every local record has exactly one string, multi-answer
                  problems keep the source's comma-joined form inside it, e.g. "$69$,$84$"); several
                  list entries are joined with "," as the source joins multiple answers, then the
                  inline-math `$` delimiters are removed ("$69$,$84$" -> "69,84"; "$\\frac{41}{12}$" ->
                  "\\frac{41}{12}"). The unit, when the problem has one, is a separate field and is not
                  part of the answer.
  dapo_math       `reward_model.ground_truth` as is (an integer string; the strict-box verifier compares
                  it exactly); the problem text prepared as the official ReSPO recipe does
                  (`dapo_problem_text`: DAPO's answer-format prefix and suffix removed, then stripped)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
from typing import Any, Callable, Iterator

from respo_jax.rewards.strict_box import brace_balanced_content

logger = logging.getLogger(__name__)

Record = dict[str, str]


class DataFileError(ValueError):
    """A data file that cannot be read as the dataset it claims to be; names the file and line/row."""

    def __init__(self, path: str | os.PathLike, line: int | None, message: str, *, unit: str = "line"):
        self.path = os.fspath(path)
        self.line = line
        where = self.path if line is None else f"{self.path}:{line}"
        if line is not None and unit != "line":
            where = f"{self.path} ({unit} {line})"
        super().__init__(f"{where}: {message}")


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset lives inside a data root and what the paper's copy contains.

    folder/filename: the layout of `../shared/data` (and of `download_dataset`'s output).
    fallback_filename: read (with `fallback_fix` applied to each raw record) when `filename` is absent.
    expected_records: the count of the paper's copy (after deduplication for DAPO-Math), for reference.
    samples_per_problem: evaluation samples per problem in the paper (§4.1); 0 for the training set.
    """

    name: str
    folder: str
    filename: str
    expected_records: int
    samples_per_problem: int
    fallback_filename: str | None = None


BENCHMARKS: tuple[str, ...] = ("aime25", "aime24", "amc23", "olympiadbench", "minerva", "math500")

SPECS: dict[str, DatasetSpec] = {
    "aime25": DatasetSpec("aime25", "aime25", "test.escape_fixed.jsonl", 30, 16, "test.jsonl"),
    "aime24": DatasetSpec("aime24", "aime24", "test.jsonl", 30, 16),
    "amc23": DatasetSpec("amc23", "amc23", "test.jsonl", 40, 16),
    "olympiadbench": DatasetSpec("olympiadbench", "olympiadbench", "test.jsonl", 675, 4),
    "minerva": DatasetSpec("minerva", "minerva_math", "test.jsonl", 272, 4),
    "math500": DatasetSpec("math500", "math500", "test.jsonl", 500, 4),
    "dapo_math": DatasetSpec("dapo_math", "dapo_math_17k", "dapo_math_17k.parquet", 17_279, 0),
}


# ---------------------------------------------------------------------------------------------------
# Answer normalization (pure functions of one field)


def last_boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, braces balanced; None if absent or unclosed.

    Every `{` and `}` after the opening brace counts (no escape handling), which is how the MATH
    solutions are written; `\\boxed {x}` (space before the brace) is accepted too.
    """
    matches = list(re.finditer(r"\\boxed\s*\{", text))
    return brace_balanced_content(text, matches[-1].end()) if matches else None  # None: the last box never closes


def normalize_aime_answer(value: Any) -> str:
    """An AIME answer (an integer 0..999, stored as int or as a string with leading zeros) -> "25"."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"AIME answer must be an integer or a digit string; got {value!r}")
    text = str(value).strip()
    if not re.fullmatch(r"\d+", text):
        raise ValueError(f"AIME answer must be a non-negative integer; got {value!r}")
    return str(int(text))


def normalize_amc_answer(value: Any) -> str:
    """An AMC answer stored as a float: an integral value is written as an integer (27.0 -> "27")."""
    if isinstance(value, bool):
        raise ValueError(f"AMC answer must be a number or a string; got {value!r}")
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+\.0*", text):
            return str(int(float(text)))
        return text
    raise ValueError(f"AMC answer must be a number or a string; got {value!r}")


def normalize_olympiad_answer(final_answer: Any) -> str:
    """OlympiadBench `final_answer` (a list of LaTeX strings in `$...$`) -> one string without `$`.

    Entries are joined with "," (the source's own separator for multi-answer problems); unescaped `$`
    delimiters are removed so that a multi-span answer like "$69$,$84$" stays well formed ("69,84").
    """
    if isinstance(final_answer, str):
        final_answer = [final_answer]
    if (
        not isinstance(final_answer, list)
        or not final_answer
        or not all(isinstance(a, str) for a in final_answer)
    ):
        raise ValueError(f"final_answer must be a non-empty list of strings; got {final_answer!r}")
    joined = ",".join(a.strip() for a in final_answer)
    return re.sub(r"(?<!\\)\$", "", joined).strip()


def fix_aime25_escapes(text: str) -> str:
    """Repairs the three broken LaTeX escapes of AIME 2025 as published (JSON turned `\\f` into a form
    feed and `\\t` into a tab): form feed -> `\\f`, tab + "riangle" -> `\\triangle`."""
    return text.replace("\x0c", "\\f").replace("\t" + "riangle", "\\triangle")


# ---------------------------------------------------------------------------------------------------
# File readers


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; bad JSON, a byte that is not UTF-8, a non-object or
    an empty file raise DataFileError naming the file and line."""
    count = 0
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataFileError(
                    path, lineno,
                    f"invalid UTF-8 byte {raw[err.start]:#04x} at byte {err.start + 1} of the line",
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError(path, lineno, f"invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise DataFileError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            count += 1
            yield lineno, obj
    if count == 0:
        raise DataFileError(path, None, "empty file: expected one JSON record per line")


def _field(obj: dict, key: str, path: str | os.PathLike, lineno: int) -> Any:
    if key not in obj or obj[key] is None:
        raise DataFileError(path, lineno, f"missing field {key!r} (fields present: {sorted(obj)})")
    return obj[key]


def _text_field(obj: dict, key: str, path: str | os.PathLike, lineno: int) -> str:
    value = _field(obj, key, path, lineno)
    if not isinstance(value, str) or not value.strip():
        raise DataFileError(path, lineno, f"field {key!r} must be a non-empty string; got {value!r}")
    return value


def _make_record(problem: str, answer: str, record_id: Any, path, lineno: int) -> Record:
    if not answer:
        raise DataFileError(path, lineno, "the normalized answer is empty")
    return {"problem": problem, "answer": answer, "id": str(record_id)}


def _normalized(fn: Callable[[Any], str], value: Any, path, lineno: int) -> str:
    try:
        return fn(value)
    except ValueError as err:
        raise DataFileError(path, lineno, str(err)) from None


def _non_empty_text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"the answer must be a non-empty string; got {value!r}")
    return value


def _read_problem_answer_id(
    path, answer_field: str, normalize: Callable[[Any], str], id_field: str,
    fix_problem: Callable[[str], str] | None = None,
) -> list[Record]:
    """Records of a JSONL file with `problem`, an answer field (normalized) and an id field."""
    records = []
    for lineno, obj in read_jsonl(path):
        problem = _text_field(obj, "problem", path, lineno)
        if fix_problem is not None:
            problem = fix_problem(problem)
        answer = _normalized(normalize, _field(obj, answer_field, path, lineno), path, lineno)
        records.append(_make_record(problem, answer, _field(obj, id_field, path, lineno), path, lineno))
    return records


def _read_aime(path, fix_escapes: bool = False) -> list[Record]:
    return _read_problem_answer_id(path, "answer", normalize_aime_answer, "id",
                                   fix_aime25_escapes if fix_escapes else None)


def _read_amc(path) -> list[Record]:
    return _read_problem_answer_id(path, "answer", normalize_amc_answer, "id")


def _read_math500(path) -> list[Record]:
    return _read_problem_answer_id(path, "answer", _non_empty_text, "unique_id")


def _read_minerva(path) -> list[Record]:
    records = []
    for lineno, obj in read_jsonl(path):
        problem = _text_field(obj, "problem", path, lineno)
        boxed = last_boxed_content(_text_field(obj, "solution", path, lineno))
        if boxed is None:
            raise DataFileError(path, lineno, "no closed \\boxed{...} in 'solution' to take the answer from")
        records.append(_make_record(problem, boxed.strip(), _field(obj, "idx", path, lineno), path, lineno))
    return records


def _read_olympiadbench(path) -> list[Record]:
    records = []
    for lineno, obj in read_jsonl(path):
        question = _text_field(obj, "question", path, lineno)
        context = obj.get("context")
        problem = f"{context}\n{question}" if isinstance(context, str) and context.strip() else question
        answer = _normalized(
            normalize_olympiad_answer, _field(obj, "final_answer", path, lineno), path, lineno
        )
        records.append(_make_record(problem, answer, _field(obj, "id", path, lineno), path, lineno))
    return records


_READERS: dict[str, Callable[..., list[Record]]] = {
    "aime25": _read_aime,
    "aime24": _read_aime,
    "amc23": _read_amc,
    "olympiadbench": _read_olympiadbench,
    "minerva": _read_minerva,
    "math500": _read_math500,
}


def resolve_data_file(name: str, data_dir: str | os.PathLike) -> tuple[str, bool]:
    """The file to read for dataset `name` and whether it is the fallback (needs `fallback` fixes).

    `data_dir` may be the data root (holding `aime25/`, `minerva_math/`, ...), the dataset's own
    folder, or the data file itself.
    """
    spec = _spec(name)
    data_dir = os.fspath(data_dir)
    if os.path.isfile(data_dir):
        return data_dir, os.path.basename(data_dir) == spec.fallback_filename
    candidates = []
    for filename, is_fallback in ((spec.filename, False), (spec.fallback_filename, True)):
        if filename is None:
            continue
        for folder in (os.path.join(data_dir, spec.folder), data_dir):
            candidate = os.path.join(folder, filename)
            candidates.append(candidate)
            if os.path.isfile(candidate):
                return candidate, is_fallback
    raise FileNotFoundError(f"no data file for {name!r}; looked for: {', '.join(candidates)}")


def _spec(name: str) -> DatasetSpec:
    if name not in SPECS:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(SPECS)}")
    return SPECS[name]


def load_benchmark(name: str, data_dir: str | os.PathLike) -> list[Record]:
    """The records of benchmark `name` (one of BENCHMARKS) as `{"problem", "answer", "id"}` dicts.

    `data_dir`: the data root, the benchmark's folder, or its file. Answers are normalized per the
    table in this module's docstring; ids are the source's ids as strings.
    """
    if name not in _READERS:
        raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    path, is_fallback = resolve_data_file(name, data_dir)
    if name == "aime25":
        return _read_aime(path, fix_escapes=is_fallback)
    return _READERS[name](path)


# ---------------------------------------------------------------------------------------------------
# DAPO-Math-17k


@dataclasses.dataclass(frozen=True)
class DedupStats:
    """What deduplication of DAPO-Math-17k did: total_rows = kept + merged_rows + conflicting_rows.

    merged_rows: extra copies of a problem text whose copies all carry the same answer (one is kept).
    conflicting_problems: problem texts that appear with different answers; all their copies
    (conflicting_rows) are dropped, since no single reward is right for them.
    """

    total_rows: int
    kept: int
    merged_rows: int
    conflicting_problems: int
    conflicting_rows: int


# DAPO-Math-17k wraps each problem in an instruction for an "Answer: ..." last line. The official ReSPO
# preparation (its prepare-data script over open-r1/DAPO-Math-17k-Processed) removes this prefix and
# suffix, strips the text and appends the boxed instruction as the user message (prompts.DEFAULT_TEMPLATE).
DAPO_PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def dapo_problem_text(raw: str) -> str:
    """The problem text of a DAPO-Math prompt as the official preparation makes it: DAPO's answer-format
    prefix and suffix removed (wherever they occur), then surrounding whitespace stripped."""
    return raw.replace(DAPO_PROMPT_PREFIX, "").replace(DAPO_PROMPT_SUFFIX, "").strip()


def read_dapo_rows(path: str | os.PathLike) -> list[tuple[int, str, str, str]]:
    """(row, problem, answer, id) for each row of the DAPO-Math parquet (verl layout).

    problem = `dapo_problem_text(prompt[0].content)` (the local copy already lacks DAPO's instruction;
    306 of its texts carry surrounding whitespace, which the official preparation strips),
    answer = reward_model.ground_truth, id = extra_info.index (else the row number). Rows are numbered
    from 0; a missing column or an empty field raises DataFileError naming the file and row.
    """
    import pyarrow.parquet as pq  # local import: only the DAPO reader needs pyarrow

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise DataFileError(path, None, f"not a readable parquet file ({err})") from None
    if table.num_rows == 0:
        raise DataFileError(path, None, "empty file: expected DAPO-Math rows")
    for column in ("prompt", "reward_model"):
        if column not in table.column_names:
            raise DataFileError(path, None, f"missing column {column!r} (columns: {table.column_names})")
    prompts = table.column("prompt").to_pylist()
    rewards = table.column("reward_model").to_pylist()
    extra = (
        table.column("extra_info").to_pylist()
        if "extra_info" in table.column_names
        else [None] * len(prompts)
    )
    rows = []
    for row, (prompt, reward, info) in enumerate(zip(prompts, rewards, extra)):
        if not prompt or not isinstance(prompt[0], dict) or not isinstance(prompt[0].get("content"), str):
            raise DataFileError(path, row, "prompt[0].content is missing", unit="row")
        problem = dapo_problem_text(prompt[0]["content"])
        answer = (reward or {}).get("ground_truth")
        if not isinstance(answer, str) or not answer.strip():
            raise DataFileError(
                path, row, f"reward_model.ground_truth must be a non-empty string; got {answer!r}", unit="row"
            )
        if not problem.strip():
            raise DataFileError(path, row, "prompt[0].content is empty", unit="row")
        index = (info or {}).get("index")
        rows.append((row, problem, answer, str(index if index is not None else row)))
    return rows


def deduplicate(rows: list[tuple[int, str, str, str]]) -> tuple[list[Record], DedupStats]:
    """Keeps one copy of each problem text whose copies agree on the answer; drops every copy of a
    problem text seen with different answers. Texts are compared exactly (no whitespace folding).
    Order: first occurrence."""
    answers: dict[str, set[str]] = collections.defaultdict(set)
    for _, problem, answer, _ in rows:
        answers[problem].add(answer)
    kept: list[Record] = []
    seen: set[str] = set()
    merged = conflicting_rows = 0
    for _, problem, answer, record_id in rows:
        if len(answers[problem]) > 1:
            conflicting_rows += 1
        elif problem in seen:
            merged += 1
        else:
            seen.add(problem)
            kept.append({"problem": problem, "answer": answer, "id": record_id})
    stats = DedupStats(
        total_rows=len(rows),
        kept=len(kept),
        merged_rows=merged,
        conflicting_problems=sum(1 for a in answers.values() if len(a) > 1),
        conflicting_rows=conflicting_rows,
    )
    return kept, stats


def load_dapo_math(data_dir: str | os.PathLike, return_stats: bool = False):
    """DAPO-Math-17k, deduplicated (see `deduplicate`), Chinese problems kept.

    On the paper's copy: 17,917 rows = 17,243 kept + 650 duplicate rows merged + 24 rows of 12 problems
    with conflicting answers dropped. Texts are compared exactly after `dapo_problem_text` (so texts
    differing only in surrounding whitespace are one problem, as the model sees them).

    `data_dir`: the data root, the `dapo_math_17k/` folder, or the parquet file. Returns the records,
    or `(records, DedupStats)` with `return_stats=True`; the counts are also logged at INFO level.
    """
    path, _ = resolve_data_file("dapo_math", data_dir)
    records, stats = deduplicate(read_dapo_rows(path))
    logger.info(
        "DAPO-Math %s: %d rows -> %d kept (%d duplicate rows merged; %d problems with conflicting answers, "
        "%d rows dropped)",
        path,
        stats.total_rows,
        stats.kept,
        stats.merged_rows,
        stats.conflicting_problems,
        stats.conflicting_rows,
    )
    return (records, stats) if return_stats else records


def load_records(name: str, data_dir: str | os.PathLike) -> list[Record]:
    """Any dataset of SPECS by name: a benchmark or "dapo_math"."""
    return load_dapo_math(data_dir) if name == "dapo_math" else load_benchmark(name, data_dir)
