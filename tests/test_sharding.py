"""respo_jax.sharding and the sharded Qwen3 on one device: mesh configs, the rules table, kernel fields.
The multi-device checks (parameter shardings, sharded init and loading, expert parallelism and sharded
forward/backward against the single-device model) are tests/multi_device/, run by test_multi_device.py."""

from __future__ import annotations

import json

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from respo_jax.models import qwen3
from respo_jax.sharding import MESH_AXES, MeshConfig, ShardingRules, make_mesh

FE = ("fsdp", "expert")


# ---------------------------------------------------------------------------------------- MeshConfig


@pytest.mark.parametrize("config,devices,sizes", [
    (MeshConfig(data=2, fsdp=2, tensor=2, expert=1), 8, (2, 2, 2, 1)),
    (MeshConfig(expert=4), 8, (2, 1, 1, 4)),              # data=-1 fills
    (MeshConfig(data=1, fsdp=-1, tensor=2), 8, (1, 4, 2, 1)),
    (MeshConfig(), 1, (1, 1, 1, 1)),
])
def test_mesh_config_resolves_the_fill_axis(config, devices, sizes):
    assert config.axis_sizes(devices) == sizes


@pytest.mark.parametrize("kwargs,devices,match", [
    (dict(data=-1, fsdp=-1), None, "at most one mesh axis may be -1"),
    (dict(tensor=0), None, "positive integers or -1"),
    (dict(expert=2.0), None, "positive integers or -1"),
    (dict(data=3), 8, "has 3 devices, but 8 are available"),
    (dict(fsdp=3), 8, "cannot fill 8 devices"),
])
def test_mesh_config_rejects_sizes_that_do_not_fit(kwargs, devices, match):
    with pytest.raises(ValueError, match=match):
        MeshConfig(**kwargs).axis_sizes(devices)


def test_make_mesh_names_four_auto_axes_and_checks_the_device_count():
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    assert mesh.axis_names == MESH_AXES and tuple(mesh.shape.values()) == (1, 1, 1, 1)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="has 2 devices, but 1 are available"):
        make_mesh(MeshConfig(data=2), devices=jax.devices()[:1])


# --------------------------------------------------------------------------------------- the rules


def test_default_rules_spec_of_parameters_and_activations():
    rules = ShardingRules()
    assert rules.spec(("layers", "embed", "heads", "head_dim")) == P(None, FE, "tensor", None)
    assert rules.spec(("layers", "experts", "expert_embed", "expert_mlp")) == P(None, "expert", "fsdp", "tensor")
    assert rules.spec(("batch", "sequence", "activation_embed")) == P(("data", "fsdp", "expert"), None, None)
    assert rules.spec(("batch", "sequence", "vocab")) == P(("data", "fsdp", "expert"), None, "tensor")
    assert rules.spec(("vocab", None)) == P("tensor", None)


def test_a_lookup_that_reuses_a_mesh_axis_raises():
    # an activation labelled with the parameters' "embed": batch and embed both want fsdp (and expert)
    with pytest.raises(ValueError, match=r"map both 'batch' and 'embed' to mesh axis 'fsdp'"):
        ShardingRules().spec(("batch", "sequence", "embed"))
    with pytest.raises(ValueError, match=r"map both 'embed' and 'mlp' to mesh axis 'fsdp'"):
        ShardingRules().replace(mlp="fsdp").spec(("embed", "mlp"))
    with pytest.raises(ValueError, match=r"map both 'heads' and 'kv_heads' to mesh axis 'tensor'"):
        ShardingRules().spec(("heads", "kv_heads"))


def test_rules_reject_unknown_names_and_malformed_entries():
    with pytest.raises(KeyError, match="unknown logical axis 'seq'"):
        ShardingRules().spec(("batch", "seq"))
    with pytest.raises(KeyError, match=r"unknown logical axes \['hidden'\]"):
        ShardingRules().replace(hidden="tensor")
    with pytest.raises(ValueError, match="rule 'vocab' must name mesh axes"):
        ShardingRules(vocab=3)
    with pytest.raises(ValueError, match="rule 'batch' repeats a mesh axis"):
        ShardingRules(batch=("data", "data"))
    assert ShardingRules(vocab="tensor").vocab == ("tensor",) and ShardingRules(layers=None).layers == ()
    assert hash(ShardingRules()) == hash(ShardingRules())  # usable as static jit metadata


def test_rules_name_the_mesh_axes_a_mesh_lacks():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"mesh axes \['expert', 'fsdp'\], which the mesh"):
        ShardingRules().sharding(mesh, ("batch", None))
    with pytest.raises(ValueError, match="sharding rules name mesh axes"):
        qwen3.Qwen3Config.preset("tiny", mesh=mesh)


# ------------------------------------------------------------------------------- kernels and config


def test_kernel_choices_are_validated_fields_resolved_once_for_the_platform():
    """A preset leaves the kernels and the layer loop to the resolver (None); the entry points
    (Qwen3ForCausalLM, init_model) give it the 1x1x1x1 mesh and the platform's choices, keep explicit
    ones, and a resolved config resolves to itself."""
    cfg = qwen3.Qwen3Config.preset("tiny-moe")
    assert (cfg.attention_impl, cfg.moe_impl, cfg.moe_dispatch, cfg.scan_layers, cfg.mesh) == (None,) * 5
    assert qwen3.default_kernels("cpu") == dict(attention_impl="causal_blocks", moe_impl="tiled",
                                                moe_dispatch="all_to_all", scan_layers=False)
    for backend in ("gpu", "tpu"):
        assert qwen3.default_kernels(backend) == dict(attention_impl="causal_blocks", moe_impl="ragged",
                                                      moe_dispatch="ragged_all_to_all", scan_layers=True)
    resolved = qwen3.init_model(cfg, 0).config
    assert dict(resolved.mesh.shape) == dict(data=1, fsdp=1, tensor=1, expert=1)
    assert list(resolved.mesh.devices.flat) == jax.devices()[:1]
    platform = jax.devices()[0].platform
    kernels = qwen3.default_kernels(platform)
    assert {k: getattr(resolved, k) for k in kernels} == kernels
    assert qwen3.resolve_config(resolved) is resolved
    assert qwen3.Qwen3ForCausalLM(resolved, rngs=nnx.Rngs(0)).config is resolved
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    chosen = qwen3.resolve_config(cfg.replace(moe_impl="ragged", scan_layers=True), mesh)
    assert (chosen.mesh, chosen.moe_impl, chosen.scan_layers) == (mesh, "ragged", True)
    assert chosen.moe_dispatch == qwen3.default_kernels(platform)["moe_dispatch"]
    for field, value in (("attention_impl", "flash"), ("moe_impl", "dense"), ("moe_dispatch", "allgather"),
                         ("scan_layers", "yes")):
        with pytest.raises(ValueError, match=f"{field} must be"):
            cfg.replace(**{field: value})


def test_runtime_fields_stay_out_of_config_json():
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    cfg = qwen3.Qwen3Config.preset("tiny-moe", moe_impl="ragged", attention_impl="dense", mesh=mesh,
                                   rules=ShardingRules().replace(sequence="tensor"))
    hf = cfg.to_hf_dict()
    json.dumps(hf)
    assert not {"attention_impl", "moe_impl", "moe_dispatch", "mesh", "rules", "remat", "scan_layers"} & set(hf)
    assert qwen3.Qwen3Config.from_hf_dict(hf) == qwen3.Qwen3Config.preset("tiny-moe")


def test_expert_parallelism_needs_tokens_split_over_the_expert_axes():
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    rules = ShardingRules().replace(batch=("data", "fsdp"))
    with pytest.raises(ValueError, match=r"experts are split over mesh axes \('expert',\), but tokens only"):
        qwen3.Qwen3Config.preset("tiny-moe", mesh=mesh, rules=rules)
    qwen3.Qwen3Config.preset("tiny", mesh=mesh, rules=rules)  # a dense model has no experts to place
    explicit = jax.make_mesh((1, 1, 1, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 4,
                             devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="Auto axis types"):
        qwen3.Qwen3Config.preset("tiny", mesh=explicit)


def test_from_pretrained_picks_the_platform_kernels_unless_told(tmp_path):
    cfg = qwen3.Qwen3Config.preset("tiny-moe")
    qwen3.save_pretrained(qwen3.init_model(cfg, 0), tmp_path)
    default = qwen3.from_pretrained(tmp_path)
    assert default.config == qwen3.resolve_config(cfg)  # the mesh, kernels and layer loop init_model gets
    chosen = qwen3.from_pretrained(tmp_path, moe_impl="ragged", attention_impl="dense")
    assert (chosen.config.moe_impl, chosen.config.attention_impl) == ("ragged", "dense")
    assert chosen.config.moe_dispatch == default.config.moe_dispatch
