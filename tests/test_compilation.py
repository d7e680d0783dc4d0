"""What a run compiles: the persistent compilation cache (`run.compilation_cache_dir`: where it lives,
that a second launch of one configuration reads every program from it and trains identically, that a
changed configuration compiles anew and still trains) and the bound on programs (a fine prompt-bucket
grid refused at start-up; compiled programs dropped from memory before XLA:CPU runs out of memory
mappings, with the run unchanged).

The cache launches are subprocesses: the cache is a process-wide JAX setting, initialised once per process.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from experiments.train import DEFAULT_CONFIG, cli, load_config
from respo_jax.training import compilation
from respo_jax.training.batch import bucket_length
from respo_jax.training.compilation import configure_compilation_cache, resolve_cache_dir
from respo_jax.training.compile_ahead import compile_ahead_key
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.loop import RLTrainer
from respo_jax.training.shapes import ShapeTracker
from respo_jax.training.tasks import load_task

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
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


def test_a_test_session_compiles_into_a_fresh_cache_shared_with_the_processes_it_launches():
    """tests/conftest.py: the session's cache is a directory of its own (not the user's cache), which
    `run.compilation_cache_dir=""` resolves to, and which a process launched by a test caches every
    program into, compiled with the cheap-compile flags."""
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert os.path.isdir(cache) and resolve_cache_dir("") == cache
    assert not cache.startswith(os.path.join(os.path.expanduser("~"), ".cache"))
    code = ("import os, jax; print(jax.config.jax_compilation_cache_dir); "
            "print(jax.config.jax_persistent_cache_min_compile_time_secs); print(os.environ['XLA_FLAGS'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    launched_cache, min_seconds, flags = result.stdout.splitlines()
    assert (launched_cache, float(min_seconds)) == (cache, 0.0)
    assert {"--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"} <= \
        set(flags.split())


def _launch(out_dir: pathlib.Path, cache: pathlib.Path, *overrides: str) -> tuple[list[dict], bool]:
    """The run's metrics records, and whether it skipped its compile-ahead (the cache recorded it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)  # the run's own setting decides
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", *TINY, f"run.out_dir={out_dir}",
         f"run.compilation_cache_dir={cache}", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return records, "compile-ahead skipped" in result.stderr


def _entries(cache: pathlib.Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.name.endswith("-cache")}


def _rl(records: list[dict]) -> list[dict]:
    return [r for r in records if r["phase"] == "rl"]


def test_the_compile_ahead_key_ignores_the_run_length_unless_it_moves_the_learning_rate_warm_up():
    """A relaunch for more iterations or with another seed reads the programs compiled ahead; with
    `optim.warmup_ratio`, the warm-up length W (a constant of the update program) follows the run's length,
    and the key with it."""
    def key(*overrides: str) -> str:
        config = apply_overrides(load_config(DEFAULT_CONFIG), TINY + list(overrides))
        shapes = ShapeTracker([3, 20], config.rollout.padded_prompt_length, compile_ahead=True)
        return compile_ahead_key(config, shapes)

    base = key()
    assert key("run.iterations=7") == key("run.seed=3") == key("run.policy_updates=8") == base
    assert key("rollout.max_new_tokens=7") != base and key("optim.learning_rate=0.5") != base
    ratio = key("optim.warmup_ratio=0.5")  # W = 2 of 4 policy updates
    assert ratio != base and key("optim.warmup_ratio=0.5", "run.iterations=7") != ratio  # W = 7
    assert key("optim.warmup_steps=3", "run.iterations=7") == key("optim.warmup_steps=3") != base


@pytest.mark.slow
def test_a_second_launch_reads_every_program_from_the_cache_and_a_changed_config_compiles(tmp_path):
    cache = tmp_path / "cache"
    first, skipped = _launch(tmp_path / "first", cache)
    assert not skipped  # a cold cache: compiled ahead, and recorded
    assert len(list((cache / compilation.COMPILED_AHEAD_DIR).iterdir())) == 1
    assert [r["compile_cache_hits"] for r in _rl(first)][0] == 0  # a cold cache serves nothing
    assert _rl(first)[0]["compiles"] > 0
    written = _entries(cache)
    assert written, "the first launch wrote no cache entry"

    # A relaunch for a longer run: its length shapes no program, so the same record, the same programs.
    second, skipped = _launch(tmp_path / "second", cache, "run.iterations=3")
    assert skipped  # the record: each program read from the cache when first needed
    assert len(_rl(second)) == 3
    for record in _rl(second):  # every program an iteration needed came from the cache ...
        assert record["compile_cache_hits"] == record["compiles"], record
    assert _rl(second)[0]["compiles"] > 0
    assert _entries(cache) == written  # ... so nothing new was written

    def strip(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in PROCESS_KEYS} for r in records]

    assert first[-1]["phase"] == "eval"  # the final evaluation; up to it, the same run
    assert strip(second)[:len(first) - 1] == strip(first)[:-1]

    changed, skipped = _launch(tmp_path / "changed", cache, "rollout.max_new_tokens=7")
    assert not skipped  # another configuration's record is not this one's
    first_rl = _rl(changed)[0]
    assert first_rl["compile_cache_hits"] < first_rl["compiles"]  # other programs: compiled, not reused
    assert _entries(cache) > written
    assert len(_rl(changed)) == 2  # and it trains
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in _rl(changed))


@pytest.mark.slow
def test_a_fine_prompt_bucket_grid_is_refused_at_start_up_naming_a_bucket_that_fits(tmp_path, capsys):
    """DAPO-Math at the synthetic task's 16-token bucket with linear buckets: 50 prompt buckets, whose
    programs once crashed the compiler (vm.max_map_count exhausted, ~1,200 mappings per bucket measured
    for a small model). The default geometric buckets hold the same prompts in 6."""
    out = tmp_path / "run"
    dapo = ["task.name=dapo_math", f"task.data_dir={SHARED / 'data'}",
            f"task.tokenizer_dir={SHARED / 'tokenizers' / 'qwen3'}", "task.chat_template=false", "warmup.steps=0"]
    assert cli(TINY + dapo + ["rollout.prompt_bucket=16", "rollout.prompt_buckets=linear",
                              f"run.out_dir={out}"]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and message.startswith("error: rollout.prompt_bucket=16: ")
    assert "50 linear prompt buckets, more than rollout.max_prompt_buckets=16" in message, message
    assert not out.exists()  # refused before anything was written
    fits = int(message.split("set rollout.prompt_bucket=")[1].split()[0])
    config = apply_overrides(load_config(DEFAULT_CONFIG), TINY + dapo)
    tokenizer, fmt, train, *_ = load_task(config)
    from respo_jax.data.prompts import encode_prompt

    lengths = {len(encode_prompt(rec["problem"], tokenizer, fmt)) for rec in train}
    assert len({bucket_length(n, fits) for n in lengths}) <= 16 < len({bucket_length(n, fits - 16) for n in lengths})
    # The default (geometric) buckets: 16 · 2^k from the shortest prompt (27 tokens) to the longest (977).
    geometric = RLTrainer(apply_overrides(config, ["rollout.prompt_bucket=16"]))
    assert geometric.shapes.prompt_buckets() == [32, 64, 128, 256, 512, 1024]  # accepted


@pytest.mark.slow
def test_programs_dropped_near_the_mapping_limit_leave_the_run_unchanged(monkeypatch, capsys):
    def run() -> list[dict]:
        trainer = RLTrainer(apply_overrides(load_config(DEFAULT_CONFIG), TINY + ["rollout.compile_ahead=true"]))
        return [{k: v for k, v in trainer.iteration().items() if k not in PROCESS_KEYS} for _ in range(2)]

    reference = run()
    assert "dropped the compiled programs" not in capsys.readouterr().err
    held = compilation.memory_maps()
    assert held is not None and 0 < held[0] < held[1]  # Linux: the count and the limit are read
    drops = []

    def near_the_limit():
        drops.append(1)
        return 100, 101  # as if this process were about to exhaust its mappings

    monkeypatch.setattr(compilation, "memory_maps", near_the_limit)
    assert run() == reference  # every program dropped at every new shape, reloaded or recompiled: same run
    assert drops and "dropped the compiled programs from memory: this process held 100 of its 101" \
        in capsys.readouterr().err
