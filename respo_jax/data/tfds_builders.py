"""One TFDS builder for DAPO-Math-17k and the six benchmarks of §4.1, in array_record format.

array_record needs no TensorFlow: the builder prepares from a local directory (TFDS `manual_dir`, e.g.
`../shared/data` or the output of `sources.download_dataset`) and is read back with
`tfds.data_source` (random access, what `batches.PromptBatches` consumes). Records are those of
`records.py`, so every consumer sees one normalization; features are `problem`, `answer`, `id`
(text, returned as bytes by TFDS). Source order is kept (`disable_shuffling`), so index i of the
built split is record i of `load_benchmark`/`load_dapo_math`.

The datasets differ only in their name and split, so they are the `BUILDER_CONFIGS` of one builder
(TFDS's mechanism for variants of one dataset), named as in `records.SPECS` (`aime25`, `aime24`,
`amc23`, `olympiadbench`, `minerva`, `math500`, `dapo_math`). TFDS calls a config `builder/config`:

    from respo_jax.data import tfds_builders
    builder = tfds_builders.prepare("aime24", data_dir="/tmp/tfds", manual_dir="../shared/data")
    source = tfds.data_source("respo_records/aime24", data_dir="/tmp/tfds", split="test")
"""

from __future__ import annotations

import dataclasses
import os

import tensorflow_datasets as tfds

from respo_jax.data import records

_INSTRUCTIONS = (
    "Pass the directory holding the data (the data root with one folder per dataset, or the dataset's own "
    "folder) as manual_dir. Without a local copy, run respo_jax.data.sources.download_dataset(name, root) "
    "first (network needed); it fetches the pinned public file and checks its SHA-256."
)


@dataclasses.dataclass(eq=False)
class RecordsConfig(tfds.core.BuilderConfig):
    """One dataset of `records.SPECS` (the config's `name`) and the one split it has."""

    split: str = "test"


class RespoRecords(tfds.core.GeneratorBasedBuilder):
    """One split of `{problem, answer, id}` text records read by `records.load_records`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Records as read by respo_jax.data.records (answers normalized per dataset)."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = _INSTRUCTIONS
    BUILDER_CONFIGS = [
        RecordsConfig(name="aime25", description="AIME 2025."),
        RecordsConfig(name="aime24", description="AIME 2024."),
        RecordsConfig(name="amc23", description="AMC 2023."),
        RecordsConfig(name="olympiadbench", description="OlympiadBench, English text-only competition math."),
        RecordsConfig(name="minerva", description="MinervaMath."),
        RecordsConfig(name="math500", description="MATH-500."),
        RecordsConfig(name="dapo_math", description="DAPO-Math-17k after deduplication.", split="train"),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Problem, normalized answer and source id of each record (respo_jax.data.records).",
            features=tfds.features.FeaturesDict(
                {"problem": tfds.features.Text(), "answer": tfds.features.Text(), "id": tfds.features.Text()}
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        return {self.builder_config.split: self._generate_examples(os.fspath(dl_manager.manual_dir))}

    def _generate_examples(self, manual_dir: str):
        for index, record in enumerate(records.load_records(self.builder_config.name, manual_dir)):
            yield index, record


CONFIGS: dict[str, RecordsConfig] = {config.name: config for config in RespoRecords.BUILDER_CONFIGS}


def _config(name: str) -> RecordsConfig:
    if name not in CONFIGS:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(CONFIGS)}")
    return CONFIGS[name]


def prepare(name: str, data_dir: str | os.PathLike, manual_dir: str | os.PathLike) -> RespoRecords:
    """Builds dataset `name` into `data_dir` (array_record) from `manual_dir`; returns the builder.

    A dataset already built there is reused. Read it with `builder.as_data_source(split)` or
    `tfds.data_source(f"respo_records/{name}", data_dir=data_dir, split=...)`.
    """
    config = _config(name).name
    builder = RespoRecords(config=config, data_dir=os.fspath(data_dir), file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir))
    )
    return builder


def split_of(name: str) -> str:
    """The one split a dataset has: "train" for dapo_math, "test" for the benchmarks."""
    return _config(name).split
