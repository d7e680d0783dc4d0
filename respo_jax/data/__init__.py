"""Data for respo-jax: the paper's training set and benchmarks (§4.1), prompts, tokenizers, batches and a
synthetic verifiable task for CPU-scale runs.

  records        load_benchmark / load_dapo_math: `{problem, answer, id}` with per-dataset answers
  sources        the pinned public file of each dataset and an explicit `download_dataset`
  tfds_builders  one TFDS builder (array_record, no TensorFlow), a config per dataset; import it to register
  prompts        the paper's prompt template, chat-rendered or raw
  tokenizer      any Hugging Face tokenizer directory through `tokenizers` (+ its chat template)
  synthetic      arithmetic in `\\boxed{}` with a character tokenizer built in-process
  batches        deterministic, resumable prompt batches on grain
"""

from respo_jax.data.batches import PromptBatches
from respo_jax.data.prompts import (
    DEFAULT_TEMPLATE,
    INSTRUCTION,
    PromptFormat,
    encode_prompt,
    encode_prompts,
    filter_overlong,
    render_prompt,
)
from respo_jax.data.records import (
    BENCHMARKS,
    SPECS,
    DataFileError,
    DedupStats,
    last_boxed_content,
    load_benchmark,
    load_dapo_math,
    load_records,
)
from respo_jax.data.sources import PUBLIC_SOURCES, download_dataset
from respo_jax.data.synthetic import DIFFICULTIES, ArithmeticTask, CharTokenizer, get_task
from respo_jax.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BENCHMARKS",
    "DEFAULT_TEMPLATE",
    "DIFFICULTIES",
    "INSTRUCTION",
    "PUBLIC_SOURCES",
    "SPECS",
    "ArithmeticTask",
    "CharTokenizer",
    "DataFileError",
    "DedupStats",
    "HFTokenizer",
    "PromptBatches",
    "PromptFormat",
    "Tokenizer",
    "download_dataset",
    "encode_prompt",
    "encode_prompts",
    "filter_overlong",
    "get_task",
    "last_boxed_content",
    "load_benchmark",
    "load_dapo_math",
    "load_records",
    "load_tokenizer",
    "render_prompt",
]
