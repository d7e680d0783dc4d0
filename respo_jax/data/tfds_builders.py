"""TFDS builders for DAPO-Math-17k and the six benchmarks of §4.1, in array_record format.

array_record needs no TensorFlow: the builders prepare from a local directory (TFDS `manual_dir`, e.g.
`../shared/data` or the output of `sources.download_dataset`) and are read back with
`tfds.data_source` (random access, what `batches.PromptBatches` consumes). Records are those of
`records.py`, so every consumer sees one normalization; features are `problem`, `answer`, `id`
(text, returned as bytes by TFDS). Source order is kept (`disable_shuffling`), so index i of the
built split is record i of `load_benchmark`/`load_dapo_math`.

Importing this module registers the builders under the names of `records.SPECS`
(`aime25`, `aime24`, `amc23`, `olympiadbench`, `minerva`, `math500`, `dapo_math`):

    from respo_jax.data import tfds_builders
    builder = tfds_builders.prepare("aime24", data_dir="/tmp/tfds", manual_dir="../shared/data")
    source = tfds.data_source("aime24", data_dir="/tmp/tfds", split="test")
"""

from __future__ import annotations

import os

import tensorflow_datasets as tfds

from respo_jax.data import records

_INSTRUCTIONS = (
    "Pass the directory holding the data (the data root with one folder per dataset, or the dataset's own "
    "folder) as manual_dir. Without a local copy, run respo_jax.data.sources.download_dataset(name, root) "
    "first (network needed); it fetches the pinned public file and checks its SHA-256."
)


class _RecordsBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared body: one split of `{problem, answer, id}` text records read by `records.load_records`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Records as read by respo_jax.data.records (answers normalized per dataset)."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = _INSTRUCTIONS
    DATASET: str = ""
    SPLIT: str = "test"

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"{self.DATASET}: problem, normalized answer, source id (respo_jax.data.records).",
            features=tfds.features.FeaturesDict(
                {"problem": tfds.features.Text(), "answer": tfds.features.Text(), "id": tfds.features.Text()}
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        return {self.SPLIT: self._generate_examples(os.fspath(dl_manager.manual_dir))}

    def _generate_examples(self, manual_dir: str):
        for index, record in enumerate(records.load_records(self.DATASET, manual_dir)):
            yield index, record


class Aime25(_RecordsBuilder):
    """AIME 2025 (30 problems)."""

    DATASET = "aime25"


class Aime24(_RecordsBuilder):
    """AIME 2024 (30 problems)."""

    DATASET = "aime24"


class Amc23(_RecordsBuilder):
    """AMC 2023 (40 problems)."""

    DATASET = "amc23"


class Olympiadbench(_RecordsBuilder):
    """OlympiadBench, English text-only competition maths (675 problems)."""

    DATASET = "olympiadbench"


class Minerva(_RecordsBuilder):
    """MinervaMath (272 problems)."""

    DATASET = "minerva"


class Math500(_RecordsBuilder):
    """MATH-500 (500 problems)."""

    DATASET = "math500"


class DapoMath(_RecordsBuilder):
    """DAPO-Math-17k after deduplication (train split)."""

    DATASET = "dapo_math"
    SPLIT = "train"


BUILDERS: dict[str, type[_RecordsBuilder]] = {
    cls.DATASET: cls for cls in (Aime25, Aime24, Amc23, Olympiadbench, Minerva, Math500, DapoMath)
}


def prepare(name: str, data_dir: str | os.PathLike, manual_dir: str | os.PathLike) -> _RecordsBuilder:
    """Builds dataset `name` into `data_dir` (array_record) from `manual_dir`; returns the builder.

    A dataset already built there is reused. Read it with `builder.as_data_source(split)` or
    `tfds.data_source(name, data_dir=data_dir, split=...)`.
    """
    if name not in BUILDERS:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(BUILDERS)}")
    builder = BUILDERS[name](data_dir=os.fspath(data_dir), file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir))
    )
    return builder


def split_of(name: str) -> str:
    """The one split a builder has: "train" for dapo_math, "test" for the benchmarks."""
    if name not in BUILDERS:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(BUILDERS)}")
    return BUILDERS[name].SPLIT
