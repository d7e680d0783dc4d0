"""The trainer on a device mesh and its MoE features: the `mesh` config section, Routing Replay (R3)
from the sampler through the trainer's log-probs, the load-balancing loss, run_info.json, the
multi-process environment and the host allocator's platform choice. (Shardings of every parameter,
expert parallelism and sharded forward/backward on 8 devices: tests/test_sharding.py.)"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.train import load_config, main
from respo_jax.distributed import distributed_env, gather_rows, process_rows, process_share, take_rows
from respo_jax.host_allocator import expected_platform
from respo_jax.models import qwen3
from respo_jax.sampling import SamplingParams, generate
from respo_jax.training.batch import build_sequences, replay_routing, response_logprobs
from respo_jax.training.config import ConfigError, ExperimentConfig, apply_overrides
from respo_jax.training.loop import RLTrainer

TOY_MOE = "experiments/configs/toy_moe.py"


# ------------------------------------------------------------------------------------------ config


def test_mesh_section_parses_validates_and_resolves():
    config = apply_overrides(ExperimentConfig(),
                             ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "mesh.expert=4"])
    assert config.mesh.axis_sizes(8) == (2, 1, 1, 4)
    assert ExperimentConfig().mesh.axis_sizes(8) == (8, 1, 1, 1)  # default: every device on data
    with pytest.raises(ConfigError, match="mesh.tensor=0: expected an integer >= 1, or -1"):
        apply_overrides(ExperimentConfig(), ["mesh.tensor=0"])
    with pytest.raises(ConfigError, match="at most one axis set to -1"):
        apply_overrides(ExperimentConfig(), ["mesh.fsdp=-1"])
    with pytest.raises(ConfigError, match="mesh: mesh .* has 3 devices, but 8 are available"):
        apply_overrides(ExperimentConfig(), ["mesh.data=3"]).mesh.axis_sizes(8)
    with pytest.raises(ConfigError, match="objective.load_balancing_weight=-1.0"):
        apply_overrides(ExperimentConfig(), ["objective.load_balancing_weight=-1"])


def test_trainer_start_refuses_what_the_mesh_or_model_cannot_run():
    base = ["run.progress=false", "warmup.steps=0", "run.eval_problems=0"]
    with pytest.raises(ConfigError, match="rollout.routing_replay: needs an MoE model"):
        RLTrainer(apply_overrides(ExperimentConfig(), base + ["rollout.routing_replay=true"]))
    with pytest.raises(ConfigError, match="mesh: .* has 2 devices, but 1 are available"):
        RLTrainer(apply_overrides(ExperimentConfig(), base + ["mesh.data=2"]))


# ------------------------------------------------------------------------------------ routing replay


def test_replay_routing_lays_the_sampler_experts_out_like_the_model_input():
    # 1 layer, 2 rows, top-1: the sampler's prompts are left-padded to 4, the batch's to 3.
    prompt_routing = np.array([[[[0], [0], [5], [6]], [[0], [7], [1], [2]]]])    # [1, 2, 4, 1]
    routing = np.array([[[[3], [4], [0]], [[5], [0], [0]]]])                       # [1, 2, 3, 1]
    out = replay_routing(prompt_routing, routing, prompt_len=3, response_len=2)
    assert out.shape == (2, 1, 3 + 2 - 1, 1) and out.dtype == np.int32  # rows first, last slot dropped
    np.testing.assert_array_equal(out[0, 0, :, 0], [0, 5, 6, 3])
    np.testing.assert_array_equal(out[1, 0, :, 0], [7, 1, 2, 5])
    with pytest.raises(ValueError, match="routing covers 3 generated tokens; the batch has 4"):
        replay_routing(prompt_routing, routing, prompt_len=3, response_len=4)


@pytest.mark.slow
def test_routing_replay_gives_the_sampler_experts_and_shrinks_the_logprob_gap():
    """A sampler that computes in bfloat16 (as a vLLM rollout does) and a trainer in float32, on the same
    parameters: some tokens' top-k experts differ between them (the model runs one program, so the same
    precision on both sides would route alike). Replayed, the trainer's forward routes every real token
    exactly as the sampler did, and its log-probs move closer to the sampler's."""
    cfg = qwen3.Qwen3Config.preset("tiny-moe", initializer_range=0.05)
    model = qwen3.init_model(cfg, seed=0)
    sampler = qwen3.init_model(cfg.replace(dtype="bfloat16"), seed=0)  # float32 parameters, bf16 compute
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, n).tolist() for n in (5, 9, 3, 7)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, num_samples=2)
    out = generate(sampler, prompts, params,
                   return_routing=True)
    rows = [p for p in prompts for _ in range(2)]
    ids, positions, attention, response_mask, prompt_len = build_sequences(
        rows, np.asarray(out.tokens), np.asarray(out.lengths), pad_id=0)
    routing = replay_routing(out.prompt_routing, out.routing, prompt_len, response_mask.shape[1])

    forward = jax.jit(lambda m, r: m.forward(ids[:, :-1], positions[:, :-1], attention[:, :-1], routing=r,
                                             return_routing=True).routing)
    real = attention[:, :-1] > 0
    sampler_experts = np.sort(np.swapaxes(routing, 0, 1), axis=-1)[:, real]
    own = np.sort(np.asarray(forward(model, None)), axis=-1)[:, real]
    replayed = np.sort(np.asarray(forward(model, jnp.swapaxes(routing, 0, 1))), axis=-1)[:, real]
    np.testing.assert_array_equal(replayed, sampler_experts)
    assert np.any(own != sampler_experts)  # there was something to replay

    logprobs = jax.jit(lambda m, r: response_logprobs(m, ids, positions, attention, prompt_len, routing=r))
    sampler_logp = np.asarray(out.logprobs) * response_mask

    def gap(r):
        trainer_logp = np.asarray(logprobs(model, r)) * response_mask
        return float(np.abs(trainer_logp - sampler_logp).sum() / response_mask.sum())

    assert gap(routing) < gap(None), (gap(routing), gap(None))


# ------------------------------------------------------------------------------------ the trainer


@pytest.mark.slow
def test_toy_moe_run_replays_routing_adds_the_balancing_loss_and_writes_run_info(tmp_path):
    config = load_config(TOY_MOE)
    assert config.rollout.routing_replay and config.objective.load_balancing_weight > 0
    out = tmp_path / "run"
    main(["--config", TOY_MOE, f"run.out_dir={out}", "run.iterations=1", "warmup.steps=2",
          "run.eval_problems=0", "run.progress=false", "rollout.reuse=1"])
    info = json.loads((out / "run_info.json").read_text())
    assert info["devices"] == jax.device_count() == 1
    assert info["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    model_cfg = qwen3.Qwen3Config.preset("tiny-moe")
    n = model_cfg.num_experts * model_cfg.moe_intermediate_size * model_cfg.hidden_size * 3
    assert info["param_bytes_total"] == info["param_bytes_max_per_device"] > 4 * n * 2  # 2 MoE layers
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"][0]
    # transformers' normalisation: a uniform router gives top_k; a random init is near it
    assert 0.5 * model_cfg.num_experts_per_tok < rl["load_balancing_loss"] < 4 * model_cfg.num_experts_per_tok
    # with replay, trainer and sampler run the same experts: in float32 their log-probs agree to round-off
    assert rl["sampler_trainer_logp_gap"] < 1e-5


# ------------------------------------------------------------------------------ processes and hosts


def test_distributed_env_reads_the_launch_or_explains_what_is_missing():
    assert distributed_env({}) is None
    assert distributed_env({"JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is None
    assert distributed_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
                            "JAX_COORDINATOR_ADDRESS": "localhost:1234"}) == {
        "coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1}
    assert distributed_env({"RESPO_DISTRIBUTED": "1"}) == {
        "coordinator_address": None, "num_processes": None, "process_id": None}  # JAX detects the cluster
    with pytest.raises(ValueError, match="needs JAX_COORDINATOR_ADDRESS"):
        distributed_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match="expected 0 <= JAX_PROCESS_ID < JAX_NUM_PROCESSES"):
        distributed_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"})
    with pytest.raises(ValueError, match="expected integers"):
        distributed_env({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"})


def test_host_allocator_platform_is_decided_before_jax_starts(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert expected_platform() == "gpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert expected_platform() == "cpu"


def test_one_process_supplies_every_row():
    """The multi-process data helpers in one process: every row is this process's, nothing to exchange.
    (Two processes, each laying out and scoring only its own rows: tests/test_multiprocess.py.)"""
    assert process_rows(None, 6) == slice(0, 6) == process_share(6)
    assert take_rows(["a", "b", "c"], np.array([0, 2])) == ["a", "c"]
    np.testing.assert_array_equal(gather_rows(np.arange(6.0), process_share(6), 6), np.arange(6.0))
    with pytest.raises(ValueError, match="one process must supply every row of 6"):
        gather_rows(np.arange(3.0), slice(0, 3), 6)
