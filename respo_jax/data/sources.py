"""Where each dataset of the paper (§4.1) comes from, and an explicit download into the local layout.

Nothing here touches the network unless `download_dataset` is called. The files it fetches are the
exact published files the readers in `records.py` parse, pinned to a commit and checked by SHA-256,
so a fresh download reproduces the offline copies byte for byte. `hf_dataset` names a Hugging Face
copy of the same benchmark (the one the paper cites, for AIME 2025/2024 and AMC 2023); its layout
differs from the pinned file, so it is for reference only and never fetched.

  aime25        inclusionAI/AReaL @ f55fe68: evaluation/data/aime25/test.jsonl
                  (on the Hub as opencompass/AIME2025)
  aime24        QwenLM/Qwen2.5-Math @ a45202b: evaluation/data/aime24/test.jsonl
                  (on the Hub as Maxwell-Jia/AIME_2024)
  amc23         QwenLM/Qwen2.5-Math @ a45202b: evaluation/data/amc23/test.jsonl
                  (on the Hub as math-ai/amc23)
  olympiadbench QwenLM/Qwen2.5-Math @ a45202b: evaluation/data/olympiadbench/test.jsonl
                  (on the Hub as Hothan/OlympiadBench)
  minerva       QwenLM/Qwen2.5-Math @ a45202b: evaluation/data/minerva_math/test.jsonl
                  (on the Hub as math-ai/minervamath)
  math500       hkust-nlp/simpleRL-reason @ cf1c785: examples/simplelr_math_eval/data/math500/test.jsonl
                  (on the Hub as HuggingFaceH4/MATH-500)
  dapo_math     MasterVito/SvS @ 9fd8f35: data/dapo_math_17k.parquet
                  (on the Hub as BytedTsinghua-SIA/DAPO-Math-17k)

AIME 2025 is downloaded as published (`test.jsonl`); `load_benchmark` repairs its three broken LaTeX
escapes on reading (`records.fix_aime25_escapes`). The DAPO file is the 17,917-row copy of
DAPO-Math-17k (the Hugging Face original repeats its problems, 1M-10M rows).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import urllib.request
from typing import Callable

from respo_jax.data.records import SPECS
from respo_jax.files import file_sha256


@dataclasses.dataclass(frozen=True)
class PublicSource:
    """One pinned public file: `https://raw.githubusercontent.com/{repo}/{commit}/{path}`."""

    repo: str
    commit: str
    path: str
    sha256: str
    filename: str  # the name it is stored under inside the dataset's folder
    hf_dataset: str

    @property
    def url(self) -> str:
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"


_QWEN = ("QwenLM/Qwen2.5-Math", "a45202bd16f1ec06f433442dc1152d0074773465")

PUBLIC_SOURCES: dict[str, PublicSource] = {
    "aime25": PublicSource(
        "inclusionAI/AReaL",
        "f55fe685c661b0117d888fcae47d6f46e9a85087",
        "evaluation/data/aime25/test.jsonl",
        "b4e273c02d3e7fe1b74b59eae768fc8230bfb0f79539890cb56f4361caac0331",
        "test.jsonl",
        "opencompass/AIME2025",
    ),
    "aime24": PublicSource(
        *_QWEN,
        "evaluation/data/aime24/test.jsonl",
        "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac",
        "test.jsonl",
        "Maxwell-Jia/AIME_2024",
    ),
    "amc23": PublicSource(
        *_QWEN,
        "evaluation/data/amc23/test.jsonl",
        "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4",
        "test.jsonl",
        "math-ai/amc23",
    ),
    "olympiadbench": PublicSource(
        *_QWEN,
        "evaluation/data/olympiadbench/test.jsonl",
        "bb8c1e38a16ea9eacb77530315a674d883f267fbff79183effc53681b4fcc416",
        "test.jsonl",
        "Hothan/OlympiadBench",
    ),
    "minerva": PublicSource(
        *_QWEN,
        "evaluation/data/minerva_math/test.jsonl",
        "0e656b430d3a0a1dab6aa853f453ba3805e28e2cabe4fc72486a897cc09d8ba2",
        "test.jsonl",
        "math-ai/minervamath",
    ),
    "math500": PublicSource(
        "hkust-nlp/simpleRL-reason",
        "cf1c7858bfc145a27aa733e75d930d34f0d318a6",
        "examples/simplelr_math_eval/data/math500/test.jsonl",
        "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
        "test.jsonl",
        "HuggingFaceH4/MATH-500",
    ),
    "dapo_math": PublicSource(
        "MasterVito/SvS",
        "9fd8f35375b31b8632b52e715296c264a3ad4176",
        "data/dapo_math_17k.parquet",
        "246ae23df97c9eae8126cb4da780e9a0a31d10110e16eed144bcecbf2132d535",
        "dapo_math_17k.parquet",
        "BytedTsinghua-SIA/DAPO-Math-17k",
    ),
}


def _fetch_url(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (fixed https URLs above)
        return response.read()


def download_dataset(
    name: str, data_root: str | os.PathLike, fetch: Callable[[str], bytes] = _fetch_url
) -> str:
    """Fetches dataset `name`'s pinned file into `data_root/<folder>/` and returns its path.

    The bytes must match the recorded SHA-256 (else ValueError, nothing written). An existing file with
    the right hash is kept. `fetch(url) -> bytes` is injectable (a mirror, or a test).
    """
    if name not in PUBLIC_SOURCES:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(PUBLIC_SOURCES)}")
    source = PUBLIC_SOURCES[name]
    folder = os.path.join(os.fspath(data_root), SPECS[name].folder)
    target = os.path.join(folder, source.filename)
    if os.path.isfile(target) and file_sha256(target) == source.sha256:
        return target
    payload = fetch(source.url)
    digest = hashlib.sha256(payload).hexdigest()
    if digest != source.sha256:
        raise ValueError(f"{source.url}: SHA-256 is {digest}, expected {source.sha256}; not saved")
    os.makedirs(folder, exist_ok=True)
    partial = target + ".partial"
    with open(partial, "wb") as handle:
        handle.write(payload)
    os.replace(partial, target)
    return target
