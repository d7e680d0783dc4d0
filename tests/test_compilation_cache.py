"""The persistent compilation cache (`run.compilation_cache_dir`): where it lives, that a second launch
of one configuration reads every program from it and trains identically, and that a changed
configuration compiles anew and still trains.

The launches are subprocesses: the cache is a process-wide JAX setting, initialised once per process.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from respo_jax.training.compilation import configure_compilation_cache, resolve_cache_dir
from respo_jax.training.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
    'model.overrides={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, '
    '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}',
    "warmup.steps=2", "warmup.batch_size=4", "rollout.prompts_per_minibatch=2", "rollout.group_size=2",
    "rollout.reuse=2", "rollout.max_new_tokens=6", "task.overlong_buffer_length=4", "task.num_records=64",
    "run.eval_problems=4", "run.iterations=2", "run.progress=false", "run.host_allocator=false",
]
# What depends on the process rather than on the run.
PROCESS_KEYS = ("rollout_seconds", "iteration_seconds", "compiles", "compile_seconds", "compile_cache_hits")


def test_the_setting_names_the_directory_the_environment_or_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir("") == str(tmp_path / "xdg" / "respo_jax" / "jax_compilation_cache")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_dir("") == str(tmp_path / "home" / ".cache" / "respo_jax" / "jax_compilation_cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "from_env"))
    assert resolve_cache_dir("") == str(tmp_path / "from_env")  # JAX's own variable wins over the default
    assert resolve_cache_dir("~/mine") == str(tmp_path / "home" / "mine")  # an explicit setting wins over it
    assert resolve_cache_dir("none") is None and resolve_cache_dir("None") is None


def test_a_cache_directory_that_cannot_be_made_is_one_line_naming_the_key(tmp_path):
    below_a_file = tmp_path / "a_file"
    below_a_file.write_text("")
    with pytest.raises(ConfigError) as err:
        configure_compilation_cache(str(below_a_file / "cache"))
    message = str(err.value)
    assert message.startswith("run.compilation_cache_dir=") and "\n" not in message
    assert "none" in message  # says how to turn it off


def _launch(out_dir: pathlib.Path, cache: pathlib.Path, *overrides: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)  # the run's own setting decides
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", *TINY, f"run.out_dir={out_dir}",
         f"run.compilation_cache_dir={cache}", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _entries(cache: pathlib.Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.name.endswith("-cache")}


def _rl(records: list[dict]) -> list[dict]:
    return [r for r in records if r["phase"] == "rl"]


@pytest.mark.slow
def test_a_second_launch_reads_every_program_from_the_cache_and_a_changed_config_compiles(tmp_path):
    cache = tmp_path / "cache"
    first = _launch(tmp_path / "first", cache)
    assert [r["compile_cache_hits"] for r in _rl(first)][0] == 0  # a cold cache serves nothing
    assert _rl(first)[0]["compiles"] > 0
    written = _entries(cache)
    assert written, "the first launch wrote no cache entry"

    second = _launch(tmp_path / "second", cache)
    for record in _rl(second):  # every program an iteration needed came from the cache ...
        assert record["compile_cache_hits"] == record["compiles"], record
    assert _rl(second)[0]["compiles"] > 0
    assert _entries(cache) == written  # ... so nothing new was written
    strip = [{k: v for k, v in r.items() if k not in PROCESS_KEYS} for r in first]
    assert [{k: v for k, v in r.items() if k not in PROCESS_KEYS} for r in second] == strip  # same run

    changed = _launch(tmp_path / "changed", cache, "rollout.max_new_tokens=7")
    first_rl = _rl(changed)[0]
    assert first_rl["compile_cache_hits"] < first_rl["compiles"]  # other programs: compiled, not reused
    assert _entries(cache) > written
    assert len(_rl(changed)) == 2  # and it trains
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in _rl(changed))
