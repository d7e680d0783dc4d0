"""Smoke test of the benchmark harness (experiments/benchmarks): the whole `--micro` pipeline runs and
writes well-formed, self-consistent JSON and markdown, the RL-iteration race runs both sides on a micro
model; the measurement helpers do what they say. No timing is asserted — only structure, arithmetic,
the sides' settings and that both train-step sides compute the same loss."""

from __future__ import annotations

import itertools
import json
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks import __main__ as bench_main
from experiments.benchmarks import accelerator, common, race_table, rl_iteration, roofline, scaling
from experiments.cli import run_cli
from respo_jax import host_allocator
from respo_jax.models import qwen3
from respo_jax.training.config import ConfigError

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
    # The race on a micro model (vocabulary 151,936, one tiny layer), respo-jax with log π_old recomputed
    # (the headline side) against TRL: both sides run in their own
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
    status = rl_iteration.main(["--micro", "--iterations", "2", "--sides", "jax", "trl", "--name", "race",
                                "--data-dir", str(data), "--out", str(tmp_path)])
    assert status == 0
    with open(tmp_path / "race.json", encoding="utf-8") as f:
        (result,) = json.load(f)["results"]
    jax_side, trl_side = result["jax"], result["trl"]
    assert "jax_sampler" not in result and "speedup_sampler_logprobs" not in result
    assert jax_side["old_logprobs"] == "recompute" and race_table.old_logprobs_of(result) == "recompute"
    assert len(jax_side["times_s"]) == len(trl_side["times_s"]) == 2
    expected = float(np.median([t / j for t, j in zip(trl_side["times_s"][1:], jax_side["times_s"][1:])]))
    assert result["speedup"] == pytest.approx(expected, rel=1e-12)
    for side in (jax_side, trl_side):
        assert side["median_s"] == pytest.approx(float(np.median(side["times_s"][1:])))
        assert side["first_s"] == side["times_s"][0]
        assert side["peak_rss_mib"] > 100 and side["host_allocator"]["applied"] is True
        assert side["response_length"] == [4.0] * 2  # a random policy never samples EOS in 4 tokens
        launch = side["second_launch"]  # a second process, one iteration of the same configuration
        assert launch["pid"] != side["pid"] and launch["response_length"] == 4.0
        assert side["second_launch_first_s"] == launch["wall_s"] > 0
    # Cold: the race's cache starts empty, so the first launch's hits are only programs it compiles twice
    # (identical programs of two call sites); a cache left from elsewhere would serve nearly all of them.
    assert jax_side["compiles"][0] > 0 and jax_side["compile_cache_hits"][0] < jax_side["compiles"][0] / 4
    assert jax_side["cache_entries_written"] > 0
    second = jax_side["second_launch"]
    assert second["compiles"] > 0 and second["compile_cache_hits"] == second["compiles"]  # warm: all cached
    assert len(jax_side["compile_seconds"]) == 2 and jax_side["compile_fraction_after_two"] is None
    assert result["second_launch_vs_median"] == pytest.approx(jax_side["second_launch_first_s"] / jax_side["median_s"])
    assert result["cold_first_vs_trl_first"] == pytest.approx(jax_side["first_s"] / trl_side["first_s"])
    assert result["rss_ratio_trl_over_jax"] == pytest.approx(trl_side["peak_rss_mib"] / jax_side["peak_rss_mib"])
    # Where respo-jax's time went: the phases and the rest add up to each iteration's wall and CPU time,
    # and the trainer's own rollout clock encloses the rollout's phase.
    for wall_s, phases in zip(jax_side["times_s"], jax_side["phases"]):
        names = {"rollout", "old_logprobs", "updates", "other"}
        assert set(phases["wall_s"]) == set(phases["cpu_s"]) == names
        assert sum(phases["wall_s"].values()) == pytest.approx(wall_s, rel=1e-9)
        assert all(v > 0 for k, v in phases["wall_s"].items() if k != "other")
        assert phases["wall_s"]["other"] >= 0
        assert all(v >= 0 for k, v in phases["cpu_s"].items() if k != "other")
    for rollout_s, phases in zip(jax_side["rollout_seconds"], jax_side["phases"]):
        assert phases["wall_s"]["rollout"] <= rollout_s < phases["wall_s"]["rollout"] + 0.05
    assert jax_side["phase_median_s"]["wall_s"]["updates"] == jax_side["phases"][1]["wall_s"]["updates"]

    # The race table file, generated whole from that JSON (no hand-written document is edited).
    def number(x):
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    table = tmp_path / "rl_iteration_table.md"
    assert run_cli(rl_iteration.main, ["--table", str(tmp_path / "race.json"),
                                       "--table-out", str(table)]) == 0
    written = table.read_text(encoding="utf-8")
    rows = [line for line in written.splitlines() if line.startswith("| M=1, G=2, N=2 |")]
    assert len(rows) == 1, rows
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert cells == [
        "M=1, G=2, N=2", "recompute", number(jax_side["first_s"]),
        f"{number(jax_side['second_launch_first_s'])} ({second['compiles']} of {second['compiles']} programs "
        "from the cache)", number(jax_side["median_s"]), number(trl_side["first_s"]),
        number(trl_side["second_launch_first_s"]), number(trl_side["median_s"]), f"{result['speedup']:.2f}×",
        "n/a", "n/a", f"{result['second_launch_vs_median']:.2f}×",
        f"{result['cold_first_vs_trl_first']:.2f}×",
        f"{number(jax_side['peak_rss_mib'])} / n/a / {number(trl_side['peak_rss_mib'])}"]
    assert "`race.json`: `python -m experiments.benchmarks.rl_iteration --micro" in written
    race_table.write_table([str(tmp_path / "race.json")], out=str(table))
    assert table.read_text(encoding="utf-8") == written  # regenerated, not appended to
    assert "2nd launch" in (tmp_path / "race.md").read_text(encoding="utf-8")


def test_rl_iteration_runs_one_side_process_at_a_time(monkeypatch):
    # Each side's process is started, runs all its iterations and is ended before the next side's starts.
    events = []

    class Recorded:
        def __init__(self, kind, *args):
            self.kind, self.load = kind, {"prompt_tokens": [3]}
            events.append(("start", kind))

        def iterate(self):
            events.append(("iterate", self.kind))
            return {"wall_s": 1.0, "peak_rss_mib": 1.0}

        def close(self):
            events.append(("close", self.kind))

    monkeypatch.setattr(rl_iteration, "Side", Recorded)
    case = rl_iteration.RaceCase(1, iterations=2, micro=True)
    sides = rl_iteration._first_launch(case, rl_iteration.KINDS, dict.fromkeys(rl_iteration.KINDS, ()),
                                       [{"prompt_tokens": 3}], log=lambda *a, **k: None)
    assert list(sides) == list(rl_iteration.KINDS)
    assert events == [event for kind in rl_iteration.KINDS for event in
                      [("start", kind), ("iterate", kind), ("iterate", kind), ("close", kind)]]


def test_rl_iteration_needs_two_iterations_only_against_trl(monkeypatch):
    # The ratio to TRL excludes the first iteration; respo-jax's sides alone may run one (M = 32).
    with pytest.raises(ConfigError, match="against TRL needs at least 2"):
        rl_iteration.run(rl_iteration.RaceCase(1, iterations=1, micro=True), kinds=("jax", "trl"))
    class Started(Exception):
        pass

    def write_checkpoint(*args):
        raise Started

    monkeypatch.setattr(rl_iteration, "write_checkpoint", write_checkpoint)
    with pytest.raises(Started):  # past the check: it starts writing the checkpoint
        rl_iteration.run(rl_iteration.RaceCase(1, iterations=1, micro=True), kinds=("jax", "jax_sampler"))


def test_rl_iteration_summary_reports_the_sampler_mode_beside_the_headline():
    # Three sides' records (respo-jax recomputing log π_old, respo-jax with the sampler's, TRL): the
    # headline `speedup` is TRL over the recomputing side, `speedup_sampler_logprobs` TRL over the
    # sampler side, each the median of the per-iteration quotients after the first.
    from types import SimpleNamespace

    def side(times, rss, **load):
        records = [{"wall_s": t, "peak_rss_mib": rss, "compiles": 1, "compile_seconds": 0.1,
                    "compile_cache_hits": 0, "rollout_seconds": t / 2, "response_length": 4.0} for t in times]
        return SimpleNamespace(records=records, load_s=1.0,
                               load={"pid": 1, "host_allocator": {}, "trl": "0", **load})

    first = {"jax": side([9.0, 2.0, 4.0, 3.0], 500.0), "jax_sampler": side([8.0, 1.0, 2.0, 2.0], 490.0),
             "trl": side([5.0, 10.0, 12.0, 9.0], 1000.0)}
    records = [{"prompt_tokens": 10}]
    result = rl_iteration.summary(rl_iteration.RaceCase(1, iterations=4), first, {}, records,
                                  {"jax": 3, "jax_sampler": 2})
    assert result["speedup"] == float(np.median([10 / 2, 12 / 4, 9 / 3]))
    assert result["speedup_sampler_logprobs"] == float(np.median([10 / 1, 12 / 2, 9 / 2]))
    assert result["jax"]["old_logprobs"] == "recompute" and result["jax_sampler"]["old_logprobs"] == "sampler"
    assert result["rss_ratio_trl_over_jax"] == 2.0 and result["cold_first_vs_trl_first"] == 9.0 / 5.0
    assert (result["jax"]["cache_entries_written"], result["jax_sampler"]["cache_entries_written"]) == (3, 2)
    assert result["jax"]["phase_median_s"] is None  # records without phase clocks
    clocks = [{"wall_s": {"rollout": t / 2, "updates": t / 4, "other": t / 4}, "cpu_s": {"rollout": t}}
              for t in (1.0, 2.0, 6.0, 4.0)]
    for record, phases in zip(first["jax"].records, clocks):
        record["phases"] = phases
    medians = rl_iteration.summary(rl_iteration.RaceCase(1, iterations=4), first, {}, records, {})["jax"]
    assert medians["phase_median_s"] == {"wall_s": {"rollout": 2.0, "updates": 1.0, "other": 1.0},
                                         "cpu_s": {"rollout": 4.0}}
    row = race_table.race_table([result]).splitlines()[-1]
    assert "| 10 | 3.00× | 2 | 6.00× | n/a | 1.80× |" in row and row.endswith("| 500 / 490 / 1,000 |")
    alone = rl_iteration.summary(rl_iteration.RaceCase(32, iterations=4),
                                 {k: first[k] for k in ("jax", "jax_sampler")}, {}, records, {})
    assert "speedup" not in alone and "speedup_sampler_logprobs" not in alone


def test_rl_iteration_table_needs_a_result_file(tmp_path, capsys):

    missing = tmp_path / "nothing.json"
    out = tmp_path / "table.md"
    assert run_cli(rl_iteration.main, ["--table", str(missing), "--table-out", str(out)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith(f"error: --table {missing}: ") and "\n" not in message
    (tmp_path / "other.json").write_text('{"results": []}', encoding="utf-8")
    assert run_cli(rl_iteration.main, ["--table", str(tmp_path / "other.json"), "--table-out", str(out)]) == 2
    assert "not a result file of this race" in capsys.readouterr().err and not out.exists()


def test_rl_iteration_table_file_is_generated_from_the_committed_results():
    """The committed race table is what `--table` writes from every committed race result file."""
    from experiments.benchmarks import report

    results = os.path.dirname(race_table.TABLE_FILE)
    committed = open(race_table.TABLE_FILE, encoding="utf-8").read()
    sources = [line.split("`")[1] for line in committed.splitlines() if line.startswith("- `")]
    assert sources == [os.path.basename(p) for p in report.result_files("rl_iteration*.json")]
    assert sources[0] == "rl_iteration.json" and "rl_iteration_micro.json" not in sources
    payloads = []
    for name in sources:
        with open(os.path.join(results, name), encoding="utf-8") as f:
            payloads.append((name, json.load(f)))
    assert race_table.table_block(payloads) == committed


def test_benchmarks_results_pages_are_regenerated_from_the_committed_json():
    """The README's and the docs page's results blocks and the race table are, byte for byte, what the
    report step writes from the committed results/*.json (no hand-edited numbers)."""
    from experiments.benchmarks import report

    written = report.targets()
    assert set(written) >= {report.README, report.DOCS_PAGE, race_table.TABLE_FILE}
    for path, text in written.items():
        assert open(path, encoding="utf-8").read() == text, path
    readme = written[report.README]
    for name in ("race", "rollout"):
        marker = f"<!-- generated: {name} -->"
        assert marker in readme and marker in written[report.DOCS_PAGE]
    # Each committed result's headline appears in the README's block, computed from its file.
    with open(os.path.join(report.RESULTS, "rollout_engine.json"), encoding="utf-8") as f:
        rollout = json.load(f)
    assert f"| {rollout['continuous']['useful_tokens_per_s']:,.0f} |" in readme


def test_benchmarks_report_replaces_only_the_generated_blocks():
    from experiments.benchmarks import report

    page = "intro\n<!-- generated: race -->\nold numbers\n<!-- end generated: race -->\nprose 1.5×\n"
    assert report.render(page, {"race": "| new |"}) == (
        "intro\n<!-- generated: race -->\n\n| new |\n\n<!-- end generated: race -->\nprose 1.5×\n")
    once = report.render(page, {"race": "x"})
    assert report.render(once, {"race": "x"}) == once
    with pytest.raises(ConfigError, match="unknown generated block 'race'"):
        report.render(page, {"rollout": "y"})
    payload = {"command": "python -m experiments.benchmarks.rl_iteration", "wall_s": 1.0, "results": [
        {"case": {"prompts_per_minibatch": 4, "jax_overrides": []}, "speedup": 7.5,
         "speedup_sampler_logprobs": 9.0,
         "jax": {"old_logprobs": "recompute", "median_s": 2.0, "peak_rss_mib": 100.0},
         "trl": {"median_s": 15.0, "peak_rss_mib": 200.0}},
        {"case": {"prompts_per_minibatch": 1, "jax_overrides": []}, "speedup": 6.0,
         "jax": {"median_s": 1.0, "peak_rss_mib": 100.0}, "trl": {"median_s": 6.0, "peak_rss_mib": 200.0}}]}
    rows = report.race_headline([("r.json", payload)]).splitlines()[2:]
    assert rows[0] == ("| M=4 | recompute | 7.50× | ≥ 7× (met) | 9.00× | 2 / 15 | 100 / 200 | `r.json` |")
    # A record whose respo-jax side took the sampler's log-probs is not TRL's work: no target claimed.
    assert rows[1].startswith("| M=1 | sampler (auto) | 6.00× | — | n/a |")


def test_rl_iteration_jax_set_overrides_the_trainer_config_or_stops_in_one_line(tmp_path, capsys):

    paths = (str(tmp_path / "checkpoint"), str(tmp_path), str(tmp_path))
    case = rl_iteration.RaceCase(1, jax_overrides=("rollout.max_new_tokens=8",))
    config = rl_iteration.trainer_config(case, *paths)
    assert config.rollout.old_logprobs == "recompute" and config.rollout.max_new_tokens == 8
    assert rl_iteration.trainer_config(case, *paths, old_logprobs="sampler").rollout.old_logprobs == "sampler"
    out = tmp_path / "out"
    assert run_cli(rl_iteration.main, ["--jax-set", "rollout.temperature=hot", "--out", str(out)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: rollout.temperature='hot'")
    assert "\n" not in message and not out.exists()  # refused before anything ran or was written
    # Each respo-jax side sets its own log π_old source; an override of it is refused in one line.
    assert run_cli(rl_iteration.main, ["--jax-set", "rollout.old_logprobs=sampler", "--out", str(out)]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: --jax-set rollout.old_logprobs: each respo-jax side sets its own")
    assert "\n" not in message and not out.exists()


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


@pytest.mark.slow  # the accelerator benchmark end to end: in the full suite, not the fast path
def test_accelerator_mode_runs_on_cpu_with_a_tiny_preset():
    result = accelerator.run(preset="tiny", batch=2, seq=16, decode_batches=(1,), prompt_len=4, new_tokens=(2, 4),
                             matmul_sizes=(64,), bandwidth_mb=4, rounds=1, dtype="float32")
    assert 0 < result["mfu"] and math.isfinite(result["mfu"])
    assert result["train"]["flops"]["total"] > 0
    (decode,) = result["decode"]
    assert decode["batch"] == 1 and decode["step_bytes"] > 0 and decode["bandwidth_utilization"] > 0


# ------------------------------------------------------------------------------------ rollout engine


def test_rollout_engine_budgets_follow_the_tab4_deciles():
    # Stratified over the ten deciles: the rows of decile k lie between its scaled edges (rounded up), so
    # at most the rows of the deciles below k fall under edge k, at least those rows lie at or below its
    # ceiling, and the tenth decile sits at the cap.
    from experiments.benchmarks import rollout_engine

    rows, cap = 128, 512
    budgets = rollout_engine.draw_budgets(rows, cap, seed=0)
    edges = np.asarray(rollout_engine.TAB4_DECILES) * cap / rollout_engine.TAB4_CAP
    assert budgets.shape == (rows,) and budgets.min() >= 1 and budgets.max() == cap
    per_decile = np.arange(rows) * 10 // rows
    for k in range(1, 10):
        below = int(np.sum(per_decile < k))
        assert np.sum(budgets < edges[k - 1]) <= below <= np.sum(budgets <= np.ceil(edges[k - 1])), k
    assert np.sum(budgets == cap) >= np.sum(per_decile == 9)
    np.testing.assert_array_equal(budgets, rollout_engine.draw_budgets(rows, cap, seed=0))
    assert not np.array_equal(budgets, rollout_engine.draw_budgets(rows, cap, seed=1))


def test_rollout_engine_scheduler_replay_matches_closed_forms():
    # One sample per prompt, a segment long enough for every budget: with a slot per row every row runs in
    # the first segment and holds its prompt + budget pages at once; with one slot the rows run one after
    # another and the peak is the largest row. The static schedule (each batch decoded to its end) alike.
    from experiments.benchmarks import rollout_engine
    from respo_jax.sampling import EngineConfig

    prompt_lengths, budgets, page = [5, 9, 16], np.array([7, 1, 12]), 4
    need = [-(-(n + b) // page) for n, b in zip(prompt_lengths, budgets)]
    cases = ((3, sum(need), 3 + 3 * 11, 1), (1, max(need), int(budgets.sum()), 3))
    for (slots, peak, decoded, segments), scheduler in itertools.product(cases, ("continuous", "static")):
        engine = EngineConfig(scheduler=scheduler, max_slots=slots, page_size=page, steps_per_schedule=16)
        replay = rollout_engine.replay_schedule(prompt_lengths, 1, budgets, 16, engine, num_pages=64)
        assert replay == {"peak_pages": peak, "decoded_tokens": decoded, "segments": segments}, slots


@pytest.mark.slow
def test_rollout_engine_benchmark_reports_consistent_sides(tmp_path):
    # The whole benchmark on a micro model: three side processes, the JSON contract's keys, and numbers
    # that agree with each other (every row generates exactly its budget; ratios are quotients of the
    # side values; each JAX side's KV bytes within its pool). Data: the first 32 DAPO-Math rows.
    import pyarrow.parquet as pq

    from experiments.benchmarks import rollout_engine
    from respo_jax.data.records import resolve_data_file

    data = tmp_path / "data" / "dapo_math_17k.parquet"
    data.parent.mkdir()
    pq.write_table(pq.read_table(resolve_data_file("dapo_math", rl_iteration.DATA_DIR)[0]).slice(0, 32), data)
    # vLLM's side with no venv: skipped with its one line, never replaced by another number.
    absent = tmp_path / "no-venv"
    assert rollout_engine.main(["--micro", "--sides", "static", "continuous", "vllm", "transformers",
                                "--vllm-venv", str(absent), "--data-dir", str(data),
                                "--out", str(tmp_path)]) == 0
    with open(tmp_path / "rollout_engine_micro.json", encoding="utf-8") as f:
        report = json.load(f)
    assert report["vllm_skipped"].startswith(f"vLLM side skipped: no venv at {absent}")
    assert "vllm" not in report and report["speedup_vs_vllm"] is None
    budgets = np.array(report["workload"]["budgets"])
    assert len(budgets) == report["workload"]["rows"] == 8
    assert report["workload"]["useful_tokens"] == budgets.sum()
    for kind in ("static", "continuous", "transformers"):
        side = report[kind]
        for key in ("useful_tokens_per_s", "seconds", "peak_rss_mb", "peak_kv_bytes"):
            value = side[key]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (kind, key)
        assert side["useful_tokens"] == side["generated_tokens"] == budgets[: side["rows"]].sum(), kind
        assert side["useful_tokens_per_s"] == pytest.approx(side["useful_tokens"] / side["seconds"],
                                                            rel=1e-12)
        assert side["seconds"] == pytest.approx(float(np.median(side["times_s"])), rel=1e-12)
    assert report["transformers"]["rows"] == 2
    for kind in ("static", "continuous"):
        assert report[kind]["compiles_warmup"] > 0 and report[kind]["compiles_timed"] == 0
    continuous, static, hf = report["continuous"], report["static"], report["transformers"]
    tokens_per_s = "useful_tokens_per_s"
    assert report["speedup_vs_static"] == pytest.approx(continuous[tokens_per_s] / static[tokens_per_s])
    kv = "peak_kv_bytes"
    assert report["kv_bytes_vs_static"] == pytest.approx(continuous[kv] / static[kv])
    assert report["speedup_vs_transformers"] == pytest.approx(continuous[tokens_per_s] / hf[tokens_per_s])
    assert report["samples_identical"] is True
    model = rl_iteration.MICRO_MODEL
    token_bytes = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * 4
    prompts = report["workload"]["prompt_tokens"]
    assert report["engine"]["static"]["max_slots"] == 8  # one static batch of every row
    for side in (static, continuous):
        assert 0 < side["peak_kv_bytes"] <= side["pool_kv_bytes"]
    assert continuous["peak_kv_bytes"] <= static["peak_kv_bytes"]
    rows = [n for n in prompts for _ in range(4)][:2]
    assert hf["peak_kv_bytes"] >= sum(n + b for n, b in zip(rows, budgets[:2])) * token_bytes
    markdown = (tmp_path / "rollout_engine_micro.md").read_text(encoding="utf-8")
    assert "| continuous | 8 |" in markdown and "useful tokens/s" in markdown


def test_vllm_side_request_and_absent_venv(tmp_path):
    # The vLLM worker's request: every row with its own budget, a KV cache of whole GiB holding every
    # row's prompt and budget in pages at once; an absent venv is one line naming it.
    from experiments.benchmarks import rollout_engine, vllm_side, vllm_worker

    rows, budgets = [[1] * 20, [2] * 5], np.array([30, 3])
    settings = {"page_size": 16, "seed": 3, "threads": 2, "warmup": 1, "rounds": 2, "max_slots": 64}
    model = rollout_engine.WIDE_MODEL
    request = rollout_engine.vllm_request("ckpt", "tok", rows, budgets, settings, model, 60)
    token_bytes = 8 * 2 * 8 * 64 * 4
    pages = -(-(20 + 30) // 32) + -(-(5 + 3) // 32)  # vLLM's CPU attention: blocks of a multiple of 32
    assert request["kv_cache_gib"] == max(1, math.ceil(pages * 32 * token_bytes / 2**30)) == 1
    assert request["budgets"] == [30, 3] and request["prompts"] == rows and request["block_size"] == 32
    assert request["max_num_seqs"] == 2  # the engine's slots, at most the rows
    json.dumps(request)  # JSON on the worker's stdin, nothing else
    # vLLM's peak blocks, every row admitted at once: a prompt's full blocks shared by its G rows.
    assert rollout_engine.vllm_peak_blocks([32], 1, [100], 32) == 1 + 4  # 132 tokens: 5 blocks
    assert rollout_engine.vllm_peak_blocks([32], 3, [100, 1, 1], 32) == 1 + 4  # the short rows freed by then
    assert rollout_engine.vllm_peak_blocks([32], 3, [1, 1, 1], 32) == 1 + 3  # one own block each
    assert rollout_engine.vllm_peak_blocks([40, 8], 2, [30, 3, 1, 60], 32) == 1 + 4
    # One row at a time (max_seqs 1): the largest single row, its prompt's full block included.
    assert rollout_engine.vllm_peak_blocks([32], 3, [100, 1, 1], 32, max_seqs=1) == 1 + 4
    assert rollout_engine.vllm_peak_blocks([40, 8], 2, [30, 3, 1, 60], 32, max_seqs=1) == 3  # 40+30 or 8+60
    # Two at a time: rows 0 and 3 overlap (row 0 at 70 tokens: 2 blocks of its own, row 3 at 34: 2).
    assert rollout_engine.vllm_peak_blocks([40, 8], 2, [30, 3, 1, 60], 32, max_seqs=2) == 1 + 2 + 2
    assert vllm_worker.RESULT_PREFIX == vllm_side.RESULT_PREFIX
    assert vllm_side.unavailable(str(tmp_path / "none")) == (
        f"vLLM side skipped: no venv at {tmp_path / 'none'} "
        "(python -m experiments.benchmarks.vllm_side --build)")


def test_rollout_engine_replay_takes_the_engine_schedulers_decisions(monkeypatch):
    # The benchmark's peak KV bytes of the continuous engine come from replaying its scheduler for rows
    # that run to their budgets: the replay must see the pages in use and the segments the engine's own
    # run sees (recorded by a Scheduler that logs after each decision), with slots refilled mid-run.
    from respo_jax.models import qwen3
    from respo_jax.sampling import EngineConfig, SamplingParams, engine as engine_module, generate, scheduler

    from experiments.benchmarks import rollout_engine

    seen = []

    class Recording(scheduler.Scheduler):
        def schedule(self):
            plan = super().schedule()
            seen.append(self.cache.pages_in_use)
            return plan

    monkeypatch.setattr(engine_module, "Scheduler", Recording)
    cfg = qwen3.Qwen3Config.preset("tiny")
    model = qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (5, 9, 3)]
    budgets = rollout_engine.draw_budgets(9, 24, seed=3)
    engine = EngineConfig(scheduler="continuous", max_slots=2, steps_per_schedule=4, page_size=4)
    params = SamplingParams(max_new_tokens=24, seed=0, num_samples=3, ignore_eos=True, eos_token_ids=(1,))
    out = generate(model, prompts, params, engine=engine, row_max_new_tokens=budgets)
    np.testing.assert_array_equal(np.asarray(out.lengths), budgets)
    dims = {"num_hidden_layers": cfg.num_hidden_layers, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim}
    pool = rollout_engine.engine_pool_pages([len(p) for p in prompts], 3, 24, engine, dims, 4)
    replay = rollout_engine.replay_schedule([len(p) for p in prompts], 3, budgets, 24, engine, pool)
    assert len(seen) > 2 and (replay["peak_pages"], replay["segments"]) == (max(seen), len(seen))


def test_the_report_renders_the_decode_per_kernel_case():
    # `rollout_engine --decode-ragged`'s JSON (`decode_ragged`) as one line of the rollout block: each
    # kernel's median step per case and the file's own quotient; such a file is not a rollout case.
    from experiments.benchmarks import report

    def case(gather, ragged):
        return {"gather": {"step_ms_median": gather}, "ragged": {"step_ms_median": ragged},
                "gather_vs_ragged": gather / ragged}

    payload = {"command": "python -m experiments.benchmarks.rollout_engine --decode-ragged", "slots": 64,
               "long_tokens": 2048, "short_tokens": [100, 400], "uniform_tokens": 256,
               "cases": {"long_tail": case(150.0, 90.0), "uniform": case(68.0, 80.0)}}
    assert report.decode_per_kernel([("d.json", payload)]) == (
        "- Decode step per attention kernel, 64 slots: one slot at 2,048 tokens, the rest at 100-400: gather "
        "150.0 ms, ragged 90.0 ms (1.67×); every slot at 256: gather 68.0 ms, ragged 80.0 ms (0.85×) "
        "(`d.json`: `python -m experiments.benchmarks.rollout_engine --decode-ragged`)")
