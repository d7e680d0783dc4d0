"""Typed configuration of `python -m experiments.evaluate`: the paper's evaluation protocol by default.

§4.1 / App. D.2: the six benchmarks, 16 samples per problem on AIME 2025, AIME 2024 and AMC 2023 and 4
on OlympiadBench, Minerva Math and MATH-500, temperature 1.0, top-p 0.7, no top-k, up to 16,384 new
tokens, the chat template when the tokenizer has one, Math-Verify scoring. Every field is overridable
as `eval.field=value` through `respo_jax.config.apply_overrides` (the machinery every config shares).
"""

from __future__ import annotations

import dataclasses

from respo_jax.config.engine import EVAL_ENGINE_DEFAULTS, EngineSection
from respo_jax.config.mesh import MeshSection
from respo_jax.config.typed import validate_sections

# Benchmark names of the evaluation (the paper's) -> `respo_jax.data.load_benchmark` names.
PAPER_BENCHMARKS = ("aime25", "aime24", "amc23", "olympiadbench", "minerva_math", "math500")
LOADER_NAMES = {"aime25": "aime25", "aime24": "aime24", "amc23": "amc23", "olympiadbench": "olympiadbench",
                "minerva_math": "minerva", "math500": "math500"}
# Samples per problem in the paper (§4.1).
PAPER_SAMPLES = {"aime25": 16, "aime24": 16, "amc23": 16, "olympiadbench": 4, "minerva_math": 4, "math500": 4}
# Held-out arithmetic problems of a synthetic-task training run (only for such runs; 4 samples each).
SYNTHETIC = "synthetic"
SYNTHETIC_SAMPLES = 4
# Column titles of the paper's Tab. 1.
DISPLAY_NAMES = {"aime25": "AIME25", "aime24": "AIME24", "amc23": "AMC23", "olympiadbench": "OlympiadBench",
                 "minerva_math": "Minerva", "math500": "MATH-500", SYNTHETIC: "Synthetic"}


@dataclasses.dataclass(frozen=True)
class EvalSettings(EngineSection, engine_defaults=EVAL_ENGINE_DEFAULTS):
    """What to evaluate, with which protocol, and where the outputs go (section `eval`).

    checkpoint: a Hugging Face directory (config.json, safetensors, tokenizer.json) or a training run
      directory (config.json + checkpoints/: its latest checkpoint, tokenizer and prompt format).
    benchmarks: comma-separated names from PAPER_BENCHMARKS, or "synthetic" for a synthetic-task run.
    out_dir: "" writes to <run>/eval for a run directory and runs/eval/<name> for a Hugging Face one.
    samples: samples per problem for every benchmark; 0 keeps the paper's (16 / 4, see PAPER_SAMPLES).
    chat_template: "auto" (a run's own prompt format; for a Hugging Face directory the chat template
      when the tokenizer has one), "true" or "false".
    dtype: parameter and compute dtype ("float32", "bfloat16"); "" keeps the checkpoint's (a run's
      model.dtype; a Hugging Face config.json's dtype, float32 when it names neither).
    limit: the first `limit` problems of each benchmark (smoke runs); 0 for all.
    batch_size: sequences (problems x samples) per sampler call (completions are written call by call,
      so a rerun resumes from the last call); a few times max_slots, so the continuous engine refills
      a finished row's slot from the same call.
    scheduler / max_slots / steps_per_schedule / min_decode_slots / decode_widths_per_octave / page_size /
      num_pages / kv_cache_bytes / paged_attention_impl / paged_attention_interpret / prompt_bucket /
      prompt_buckets: the sampler's engine, declared once for `eval.*` and `rollout.*`
      (`respo_jax.config.engine.EngineSection`; why evaluation's defaults differ: `EVAL_ENGINE_DEFAULTS`);
      max_slots bounds the KV cache in memory. Not part of the protocol: for one seed every engine
      setting gives the same completions (up to float round-off ties).
    num_workers: Math-Verify worker processes (0: the CPU count, at most 32).
    overwrite: discard the outputs already in out_dir and start again (otherwise a rerun resumes, and a
      different protocol in the same out_dir is refused).
    """

    section = "eval"
    retired = {"decode_chunk_size": "the engine's attention reads only the pages a row holds (pages of "
                                    "eval.page_size tokens)"}
    checkpoint: str = ""
    benchmarks: str = ",".join(PAPER_BENCHMARKS)
    data_dir: str = "../shared/data"  # the benchmarks' data root
    out_dir: str = ""
    samples: int = 0
    temperature: float = 1.0  # sampling temperature (the paper: 1.0)
    top_p: float = 0.7  # nucleus truncation (the paper: 0.7)
    top_k: int = 0  # top-k truncation (0: none)
    max_new_tokens: int = 16_384  # the longest completion, in tokens
    chat_template: str = "auto"
    dtype: str = ""
    limit: int = 0
    synthetic_problems: int = 500  # held-out problems of a synthetic-task run (benchmarks="synthetic")
    batch_size: int = 256
    seed: int = 0  # each sample's seed is derived from this and (benchmark, problem, sample)
    num_workers: int = 0
    verify_timeout_s: float = 20.0  # Math-Verify's time limit per completion, in seconds
    bootstrap_resamples: int = 10_000  # cluster-bootstrap resamples of the macro average's standard error
    bootstrap_seed: int = 0  # the bootstrap's seed
    overwrite: bool = False
    progress: bool = True  # show a progress bar on stderr
    compilation_cache_dir: str = ""  # as run.compilation_cache_dir: "" the default cache, "none" off

    def benchmark_names(self) -> list[str]:
        return [name.strip() for name in self.benchmarks.split(",") if name.strip()]

    def samples_for(self, benchmark: str) -> int:
        """Samples per problem on `benchmark`: `samples`, or the paper's count when it is 0."""
        if self.samples:
            return self.samples
        return SYNTHETIC_SAMPLES if benchmark == SYNTHETIC else PAPER_SAMPLES[benchmark]

    def validate(self) -> None:
        """Every field typed and in range (`ConfigError`: one line naming key, value and what is allowed).
        Pure: whether the checkpoint and data exist is checked by `experiments.evaluate` at start-up."""
        self._check_types()
        self._need("checkpoint", bool(self.checkpoint.strip()),
                   "a Hugging Face checkpoint directory or a training run directory")
        names = self.benchmark_names()
        known = (*PAPER_BENCHMARKS, SYNTHETIC)
        self._need("benchmarks", bool(names), f"a comma-separated list of {', '.join(known)}")
        unknown = [name for name in names if name not in known]
        self._need("benchmarks", not unknown, f"names from {', '.join(known)} (unknown: {unknown})")
        self._need("benchmarks", len(set(names)) == len(names), "each benchmark at most once")
        self._need("benchmarks", SYNTHETIC not in names or len(names) == 1,
                   "synthetic alone (a synthetic-task run), not mixed with math benchmarks")
        for name in ("max_new_tokens", "batch_size", "synthetic_problems"):
            self._need(name, getattr(self, name) >= 1, "an integer >= 1")
        self.validate_engine()
        self._need("bootstrap_resamples", self.bootstrap_resamples >= 2, "an integer >= 2")
        for name, zero in (("samples", "the paper's counts"), ("top_k", "no top-k"),
                           ("limit", "all problems"),
                           ("num_workers", "the CPU count")):
            self._need(name, getattr(self, name) >= 0, f"an integer >= 0 (0: {zero})")
        for name in ("seed", "bootstrap_seed"):
            self._need(name, 0 <= getattr(self, name) < 2**64, "an integer in [0, 2**64)")
        self._need("temperature", self.temperature >= 0, "a number >= 0 (0: greedy)")
        self._need("top_p", 0 < self.top_p <= 1, "a number in (0, 1]")
        self._need("chat_template", self.chat_template in ("auto", "true", "false"), "auto, true or false")
        self._need("dtype", self.dtype in ("", "float32", "bfloat16"),
                   "'' (the checkpoint's), float32 or bfloat16")
        self._need("verify_timeout_s", self.verify_timeout_s > 0, "a number > 0 (seconds)")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    eval: EvalSettings = EvalSettings()
    mesh: MeshSection = MeshSection()  # the devices the model runs on, as the trainer's `mesh.*`

    def validate(self) -> "EvalConfig":
        validate_sections(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
