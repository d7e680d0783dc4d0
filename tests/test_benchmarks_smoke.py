"""Smoke test of the benchmark harness (experiments/benchmarks): the whole `--micro` pipeline runs and
writes well-formed, self-consistent JSON and markdown, the RL-iteration race runs both sides on a micro
model; the measurement helpers do what they say. No timing is asserted — only structure, arithmetic,
the sides' settings and that both train-step sides compute the same loss."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks import __main__ as bench_main
from experiments.benchmarks import accelerator, common, rl_iteration, roofline, scaling
from respo_jax import host_allocator
from respo_jax.models import qwen3

QUICK_KEYS = ("train_step_speedup", "train_step_speedup_tiny", "decode_speedup_b1", "decode_speedup_b32",
              "objective_fraction", "mfu", "xla_matmul_peak_gflops")


@pytest.fixture(scope="module", autouse=True)
def _restore_denormals():
    """The benchmarks make the CPU flush denormals to zero (process-wide FTZ/DAZ, see
    `common.configure_threads`); give other tests in this worker back IEEE arithmetic afterwards."""
    yield
    import torch

    torch.set_flush_denormal(False)


@pytest.fixture(scope="module")
def micro_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as patch:  # keep this pytest worker's malloc and JAX settings
        patch.setattr(host_allocator, "configure_host_allocator",
                      lambda: {"applied": False, "reason": "test"})
        status = bench_main.main(["--micro", "--out", str(out)])
    with open(out / "micro.json", encoding="utf-8") as f:
        report = json.load(f)
    return status, report, out


@pytest.mark.slow
def test_micro_pipeline_writes_headline_keys(micro_report):
    status, report, out = micro_report
    assert status == 0, report["errors"]
    assert report["errors"] == {}
    for key in QUICK_KEYS:
        value = report[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    assert "targets" not in report  # a benchmark reports measurements, not an issue's targets
    markdown = (out / "micro.md").read_text(encoding="utf-8")
    assert "| train_step_speedup |" in markdown and "Decode" in markdown and "Matmul peak" in markdown


@pytest.mark.slow
def test_micro_ratios_are_consistent_with_recorded_times(micro_report):
    _, report, _ = micro_report
    small = report["train_step"]["small"]
    jax_times, torch_times = small["jax"]["times_s"], small["torch_eager"]["times_s"]
    assert len(jax_times) == len(torch_times) == small["jax"]["rounds"]
    expected = float(np.median([t / j for t, j in zip(torch_times, jax_times)]))
    assert report["train_step_speedup"] == pytest.approx(expected, rel=1e-12)
    assert small["jax"]["tokens_per_s"] == pytest.approx(small["tokens_per_step"] / np.median(jax_times))
    # MFU pairs each step with the matmul probe timed in the same round (same machine load).
    probe_flops = 2.0 * 2048**3 * 2
    per_round = [small["flops"]["total"] / s / (probe_flops / p)
                 for s, p in zip(jax_times, small["matmul_probe"]["times_s"])]
    assert report["mfu_paired"] == pytest.approx(float(np.median(per_round)), rel=1e-12)
    assert small["mfu_vs_peak_run"] == pytest.approx(small["jax"]["gflops"] / report["xla_matmul_peak_gflops"])
    # The headline MFU divides by the best matmul FLOP/s of the run (peak run or probe), so it is the
    # smaller of the two fractions.
    best = max(report["xla_matmul_peak_gflops"], small["matmul_probe"]["gflops"])
    assert report["mfu"] == pytest.approx(small["jax"]["gflops"] / best)
    probe_fraction = small["jax"]["gflops"] / small["matmul_probe"]["gflops"]
    assert report["mfu"] <= min(small["mfu_vs_peak_run"], probe_fraction)
    assert small["jax"]["gflops"] == pytest.approx(small["flops"]["total"] / np.median(jax_times) / 1e9)
    step = report["objective_cost"]
    assert step["objective_fraction"] == pytest.approx(step["objective_seconds"] / small["jax"]["median_s"])
    for row in report["decode"]["results"]:
        assert report[f"decode_speedup_b{row['batch']}"] == pytest.approx(row["speedup"])


@pytest.mark.slow
def test_side_processes_run_with_their_declared_settings(micro_report):
    # The respo-jax side runs as the CPU trainer does (host allocator configured in its own process);
    # the PyTorch baseline gets the same malloc settings (and no JAX flag: it runs no JAX).
    _, report, _ = micro_report
    small = report["train_step"]["small"]
    assert small["jax"]["host_allocator"]["applied"] is True
    assert small["jax"]["host_allocator"]["jax_cpu_enable_async_dispatch"] is False
    assert small["torch_eager"]["host_allocator"]["applied"] is True
    assert small["torch_eager"]["host_allocator"]["mallopt"] == small["jax"]["host_allocator"]["mallopt"]
    assert "jax_cpu_enable_async_dispatch" not in small["torch_eager"]["host_allocator"]


@pytest.mark.slow
def test_rl_iteration_race_runs_both_sides_on_the_same_work(tmp_path):
    # The race on a micro model (vocabulary 151,936, one tiny layer): both sides run in their own
    # processes with the same malloc settings, see the same prompts (the harness checks their token
    # counts agree), and the record's ratios, RSS and compile counts are consistent. respo-jax's first
    # launch compiles into an empty cache of the race's own; its second launch is another process whose
    # first iteration reads every program from that cache. The data: the first 32 rows of DAPO-Math-17k
    # (both processes would otherwise read and tokenize all 17,917).
    import pyarrow.parquet as pq

    from respo_jax.data.records import resolve_data_file

    data = tmp_path / "data" / "dapo_math_17k.parquet"
    data.parent.mkdir()
    pq.write_table(pq.read_table(resolve_data_file("dapo_math", rl_iteration.DATA_DIR)[0]).slice(0, 32), data)
    status = rl_iteration.main(["--micro", "--iterations", "3", "--data-dir", str(data), "--out", str(tmp_path)])
    assert status == 0
    with open(tmp_path / "rl_iteration_micro.json", encoding="utf-8") as f:
        (result,) = json.load(f)["results"]
    jax_side, trl_side = result["jax"], result["trl"]
    assert len(jax_side["times_s"]) == len(trl_side["times_s"]) == 3
    expected = float(np.median([t / j for t, j in zip(trl_side["times_s"][1:], jax_side["times_s"][1:])]))
    assert result["speedup"] == pytest.approx(expected, rel=1e-12)
    for side in (jax_side, trl_side):
        assert side["median_s"] == pytest.approx(float(np.median(side["times_s"][1:])))
        assert side["first_s"] == side["times_s"][0]
        assert side["peak_rss_mib"] > 100 and side["host_allocator"]["applied"] is True
        assert side["response_length"] == [4.0] * 3  # a random policy never samples EOS in 4 tokens
        launch = side["second_launch"]  # a second process, one iteration of the same configuration
        assert launch["pid"] != side["pid"] and launch["response_length"] == 4.0
        assert side["second_launch_first_s"] == launch["wall_s"] > 0
    assert jax_side["compiles"][0] > 0 and jax_side["compile_cache_hits"][0] == 0  # cold: nothing cached
    assert jax_side["cache_entries_written"] > 0
    second = jax_side["second_launch"]
    assert second["compiles"] > 0 and second["compile_cache_hits"] == second["compiles"]  # warm: all cached
    assert len(jax_side["compile_seconds"]) == 3 and 0 <= jax_side["compile_fraction_after_two"] < 1
    assert result["second_launch_vs_median"] == pytest.approx(jax_side["second_launch_first_s"] / jax_side["median_s"])
    assert result["cold_first_vs_trl_first"] == pytest.approx(jax_side["first_s"] / trl_side["first_s"])
    assert result["rss_ratio_trl_over_jax"] == pytest.approx(trl_side["peak_rss_mib"] / jax_side["peak_rss_mib"])

    # README.md's race table, regenerated from that JSON between its markers; the rest is left as it was.
    def number(x):
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    readme = tmp_path / "README.md"
    original = open(rl_iteration.README, encoding="utf-8").read()
    readme.write_text(original, encoding="utf-8")
    rl_iteration.rewrite_readme([str(tmp_path / "rl_iteration_micro.json")], readme=str(readme))
    written = readme.read_text(encoding="utf-8")
    rows = [line for line in written.splitlines() if line.startswith("| M=1, G=2, N=2 |")]
    assert len(rows) == 1, rows
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells == [
        "M=1, G=2, N=2", number(jax_side["first_s"]),
        f"{number(jax_side['second_launch_first_s'])} ({second['compiles']} of {second['compiles']} programs "
        "from the cache)", number(jax_side["median_s"]), number(trl_side["first_s"]),
        number(trl_side["second_launch_first_s"]), number(trl_side["median_s"]), f"{result['speedup']:.2f}×",
        f"{result['second_launch_vs_median']:.2f}×", f"{result['cold_first_vs_trl_first']:.2f}×",
        f"{number(jax_side['peak_rss_mib'])} / {number(trl_side['peak_rss_mib'])}"]
    before, _, rest = original.partition(rl_iteration.TABLE_BEGIN)
    after = rest[rest.index(rl_iteration.TABLE_END):]
    assert written.startswith(before) and written.endswith(after)
    assert "`rl_iteration_micro.json`: `python -m experiments.benchmarks.rl_iteration --micro" in written
    rl_iteration.rewrite_readme([str(tmp_path / "rl_iteration_micro.json")], readme=str(readme))
    assert readme.read_text(encoding="utf-8") == written  # regenerated, not appended to
    assert "2nd launch" in (tmp_path / "rl_iteration_micro.md").read_text(encoding="utf-8")


def test_rl_iteration_readme_needs_its_markers_and_a_result_file(tmp_path, capsys):
    from experiments.cli import run_cli

    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nno table markers here\n", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        rl_iteration.replace_marked_section(readme.read_text(encoding="utf-8"), "| a |")
    assert "\n" not in str(err.value) and rl_iteration.TABLE_BEGIN in str(err.value)
    missing = tmp_path / "nothing.json"
    assert run_cli(rl_iteration.main, ["--readme", str(missing)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith(f"error: --readme {missing}: ") and "\n" not in message


@pytest.mark.slow
def test_both_train_step_sides_compute_the_same_loss(micro_report):
    # Same weights (through our HF checkpoint writer), same batch: the first ReSPO loss of the JAX step
    # and of the transformers + torch step agree, so the ratio compares equal work.
    _, report, _ = micro_report
    small = report["train_step"]["small"]
    assert small["loss_rel_diff"] < 1e-4, (small["jax"]["first_loss"], small["torch_eager"]["first_loss"])
    assert small["jax"]["first_loss"] != 0.0


def test_alternate_interleaves_sides_after_warmup():
    calls = []
    times = common.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert [len(v) for v in times.values()] == [3, 3]
    assert common.speedup([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0  # median of 2, 4, 3
    with pytest.raises(ValueError, match="same non-zero length"):
        common.speedup([1.0], [1.0, 2.0])


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_roofline_parameter_count_matches_the_model(preset):
    cfg = qwen3.Qwen3Config.preset(preset)
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    stored = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert roofline.total_params(cfg) == stored
    # Active matmul parameters: all but the norms and (if untied) the input embedding table, since the
    # output projection is a matmul even when tied; MoE: minus the unrouted experts.
    norms = cfg.hidden_size * (1 + 2 * cfg.num_hidden_layers) + 2 * cfg.head_dim * cfg.num_hidden_layers
    expected = stored - norms - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    if cfg.is_moe:
        unrouted = cfg.num_experts - cfg.num_experts_per_tok
        expected -= cfg.num_moe_layers * unrouted * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert roofline.active_matmul_params(cfg) == expected
    flops = roofline.train_step_flops(cfg, batch=2, seq=8)
    assert flops["matmul"] == 6 * expected * 16
    assert flops["attention"] == 3 * 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 8 * 16


def test_moe_implementations_agree_and_ratios_are_consistent():
    point = scaling.moe_point(tokens=64, num_experts=4, top_k=2, embed=16, expert_mlp=8, rounds=2)
    for name in ("tiled", "dense"):  # dense all-experts (the benchmark's own) and tiled equal ragged_dot
        assert point[name]["max_abs_diff_vs_ragged"] < 1e-5
        assert point[name]["loss_abs_diff_vs_ragged"] < 1e-4
        expected = np.median([r / t for r, t in zip(point["ragged_dot"]["times_s"], point[name]["times_s"])])
        assert point[name]["speedup_vs_ragged"] == pytest.approx(expected)
    assert point["ragged_dot"]["speedup_vs_ragged"] == 1.0


def test_accelerator_mode_runs_on_cpu_with_a_tiny_preset():
    result = accelerator.run(preset="tiny", batch=2, seq=16, decode_batches=(1,), prompt_len=4, new_tokens=(2, 4),
                             matmul_sizes=(64,), bandwidth_mb=4, rounds=1, dtype="float32")
    assert 0 < result["mfu"] and math.isfinite(result["mfu"])
    assert result["train"]["flops"]["total"] > 0
    (decode,) = result["decode"]
    assert decode["batch"] == 1 and decode["step_bytes"] > 0 and decode["bandwidth_utilization"] > 0
