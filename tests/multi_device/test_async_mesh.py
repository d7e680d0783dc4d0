"""On 8 simulated CPU devices: an asynchronous run (rollout.async_steps = 1 and 2) on one mesh of all 8
devices
(data 8: every device trains and samples) equals the same run split into a trainer mesh (the first 4
devices, data 4) and a rollout mesh of its own (mesh.rollout_devices=4: the last 4, tensor-parallel 2 ×
data 2): every sample, reward and advantage exactly, the float metrics and parameters to float32
round-off. Round-off only, because the two runs split the sampler's and log π_behaviour's matmuls
(tensor 2 against none) and the update's batch and gradient sums (8 shards against 4) differently, so
float32 sums are added in another order (a few ulps, ~1e-7 relative, per sum), compounded over 3
iterations of 2 Adam updates: rtol 1e-5 and atol 1e-6 on the metrics and parameters (observed here: at
most 4e-7 on a metric, 6e-7 on a parameter). log π_behaviour is recomputed
(rollout.old_logprobs=recompute): in the split run on the rollout devices, under the copy held there,
and equal to the sampler's to round-off in both. The rollout copy lives on the rollout devices only,
and the reshard moves no data through the host: it runs under transfer guards that refuse a host array
(and a plain `jax.device_put` between these meshes, which reads the arrays to the host, trips them). Run by tests/test_multi_device.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments.train import DEFAULT_CONFIG, load_config
from respo_jax.training.async_rollouts import Resharder
from respo_jax.training.config import apply_overrides
from respo_jax.training.loop import RLTrainer

TINY = ['model.overrides={"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 32, '
        '"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}',
        "warmup.steps=2", "warmup.batch_size=8", "rollout.prompts_per_minibatch=2", "rollout.group_size=4",
        "rollout.reuse=2", "rollout.max_new_tokens=6", "task.overlong_buffer_length=4", "task.num_records=64",
        "run.eval_problems=0", "run.progress=false", "run.host_allocator=false", "run.iterations=3",
        "rollout.old_logprobs=recompute"]


def _run(*overrides):
    """(trainer, records, rollout files, the device sets of the log π_behaviour programs' outputs on the
    rollout mesh)."""
    trainer = RLTrainer(apply_overrides(load_config(DEFAULT_CONFIG), [*TINY, *overrides]))
    on_rollout_mesh = []
    if trainer.rollout_logprobs is not None:
        logprobs = trainer.rollout_logprobs._logprobs

        def recording(*args):
            out = logprobs(*args)
            on_rollout_mesh.append({d for x in out for d in x.sharding.device_set})
            return out

        trainer.rollout_logprobs._logprobs = recording
    records = list(trainer.warmup())
    rollouts = []
    for _ in range(trainer.config.num_iterations):
        records.append(trainer.iteration())
        rollouts.append(trainer.last_rollout)
    return trainer, records, rollouts, on_rollout_mesh


@pytest.mark.parametrize("steps", [1, 2])
def test_a_split_mesh_async_run_equals_the_one_mesh_run(steps):
    lag = f"rollout.async_steps={steps}"
    one_trainer, one, one_rollouts, _ = _run(lag, "mesh.data=8")
    split_trainer, split, split_rollouts, on_rollout_mesh = _run(lag, "mesh.data=4", "mesh.rollout_devices=4",
                                                                 "mesh.rollout_tensor=2")
    devices = jax.devices()
    assert one_trainer.rollout_logprobs is None
    assert len(on_rollout_mesh) == 3 * 2 and all(used == set(devices[4:]) for used in on_rollout_mesh)
    for records in (one, split):
        assert all(r["sampler_trainer_logp_gap"] < 1e-5 for r in records if r["phase"] == "rl")
    assert one_trainer.rollout_mesh is one_trainer.mesh and set(one_trainer.mesh.devices.flat) == set(devices)
    assert set(split_trainer.mesh.devices.flat) == set(devices[:4])
    assert set(split_trainer.rollout_mesh.devices.flat) == set(devices[4:])
    assert dict(split_trainer.rollout_mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
    rollout_copy = split_trainer.to_rollout_mesh(split_trainer.state.params)
    for leaf in jax.tree.leaves(rollout_copy):
        assert leaf.sharding.device_set <= set(devices[4:]), leaf.sharding
    resharder = Resharder(split_trainer.shardings.params, split_trainer.rollout_shardings)
    with pytest.raises(Exception, match="[Dd]isallowed host-to-device"):  # the guard is on: no host copy
        resharder(jax.tree.map(np.asarray, split_trainer.state.params))
    with pytest.raises(Exception, match="[Dd]isallowed host-to-device"):  # what a plain device_put does
        with jax.transfer_guard_host_to_device("disallow_explicit"):
            jax.device_put(split_trainer.state.params, split_trainer.rollout_shardings)
    for a, b in zip(one_rollouts, split_rollouts):
        for key in ("length", "reward", "advantage", "policy_version"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        np.testing.assert_allclose(a["log_w"], b["log_w"], atol=1e-5)
    # batch t comes from the policy after iteration max(0, t - 1 - steps): t - 1 - that versions stale
    staleness = [r.get("staleness_max") for r in split if r["phase"] == "rl"]
    assert staleness == [min(t - 1, steps) for t in (1, 2, 3)]
    for a, b in zip(one, split):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, str) or key.endswith("seconds") or key.startswith("compile"):
                continue
            np.testing.assert_allclose(b[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(one_trainer.state.params), jax.tree.leaves(split_trainer.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
