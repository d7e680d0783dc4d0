"""Registering objectives without editing the package: a member of the (alpha, beta, lambda) family and an
arbitrary kernel of log W, checked against float64 NumPy references, the registry's validation, and the
trainer resolving a user-registered name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from respo_jax.objectives import (
    BUILTIN_OBJECTIVES,
    OBJECTIVES,
    ObjectiveSpec,
    TokenLoss,
    get_objective,
    kernel_objective,
    register_objective,
    reshaping_objective,
    response_gradient_weight,
    unregister_objective,
)


@pytest.fixture(autouse=True)
def clean_registry():
    """Every test leaves the registry as the package ships it."""
    yield
    for name in sorted(set(OBJECTIVES) - BUILTIN_OBJECTIVES):
        unregister_objective(name)
    assert set(OBJECTIVES) == BUILTIN_OBJECTIVES


def sech_kernel(log_w, advantages, width, negative_scale):
    """A user kernel: 1/cosh(log W / width), scaled on the negative branch."""
    phi = 1.0 / jnp.cosh(log_w / width)
    return jnp.where(advantages >= 0, phi, negative_scale * phi)


def reference_reshaped(w, alpha, beta, lam):
    phi0 = w**beta if alpha == 1.0 else ((1.0 - beta) + beta * w ** (alpha - 1.0)) ** (1.0 / (alpha - 1.0))
    return phi0 * np.exp(lam * (1.0 - phi0))


def batch(seed=0, rows=6, seq=5):
    rng = np.random.default_rng(seed)
    old_logp = rng.uniform(-3.0, -0.5, (rows, seq))
    logp = old_logp + rng.normal(0.0, 0.4, (rows, seq))
    lengths = rng.integers(1, seq + 1, rows)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float64)
    adv = rng.normal(0.0, 1.0, rows)
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1
    return logp, old_logp, adv, mask


def expected_token_mean_grad(phi, logp, old_logp, adv, mask):
    return -(phi * adv)[:, None] * mask / mask.sum()


def as_f32(*arrays):
    return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def test_a_family_member_registers_and_trains_with_its_kernel():
    alpha, beta, lam = (3.0, 1.0), (0.5, 0.5), (1.5, 2.0)
    objective = register_objective("respo_a3", reshaping_objective(alpha=alpha, beta=beta, lam=lam))
    assert objective == get_objective("respo_a3") and objective.aggregation == "token-mean"
    assert dict(objective.hparams) == {"alpha": alpha, "beta": beta, "lam": lam}
    logp, old_logp, adv, mask = batch()
    grad = jax.grad(lambda x: objective(x, *as_f32(old_logp, adv, mask))[0])(jnp.asarray(logp, jnp.float32))
    w = np.exp(((logp - old_logp) * mask).sum(-1))
    phi = np.where(adv >= 0, reference_reshaped(w, alpha[0], beta[0], lam[0]),
                   reference_reshaped(w, alpha[1], beta[1], lam[1]))
    np.testing.assert_allclose(np.asarray(grad), expected_token_mean_grad(phi, logp, old_logp, adv, mask),
                               rtol=2e-5, atol=1e-8)
    # Overridable by name like any objective; with ReSPO's parameters it is ReSPO.
    as_respo = get_objective("respo_a3", alpha=(2.0, 1.0), lam=[2.0, 2.0])
    inputs = as_f32(logp, old_logp, adv, mask)
    assert float(as_respo(*inputs)[0]) == pytest.approx(float(get_objective("respo")(*inputs)[0]), rel=1e-6)
    with pytest.raises(ValueError, match=r"\(alpha, beta, lam\) kernel, positive branch: beta must lie in"):
        get_objective("respo_a3", beta=(1.5, 0.5))


def test_a_user_function_of_log_w_registers_as_an_objective():
    spec = kernel_objective(sech_kernel, defaults={"width": 2.0, "negative_scale": 0.5})
    objective = register_objective("sech", spec)
    assert dict(objective.hparams) == {"width": 2.0, "negative_scale": 0.5}
    logp, old_logp, adv, mask = batch(seed=1)
    grad = jax.grad(lambda x: objective(x, *as_f32(old_logp, adv, mask))[0])(jnp.asarray(logp, jnp.float32))
    log_w = ((logp - old_logp) * mask).sum(-1)
    phi = np.where(adv >= 0, 1.0, 0.5) / np.cosh(log_w / 2.0)
    np.testing.assert_allclose(np.asarray(grad), expected_token_mean_grad(phi, logp, old_logp, adv, mask),
                               rtol=2e-5, atol=1e-8)
    # The per-response outputs and the Fig. 1 weight come from the same kernel.
    out = objective.evaluate(*as_f32(logp, old_logp, adv, mask))
    np.testing.assert_allclose(np.asarray(out.responses["phi"]), phi, rtol=2e-5)
    grid = np.linspace(-6.0, 6.0, 25)
    wide = get_objective("sech", width=4.0)
    np.testing.assert_allclose(response_gradient_weight(wide, grid, -1.0), 0.5 / np.cosh(grid / 4.0),
                               rtol=2e-5)
    assert float(out.metrics["coef_mean_pos"]) > 0
    # The common keys work as for built-ins.
    seq_mean = get_objective("sech", aggregation="seq-mean-token-mean", scale_advantages=False)
    assert seq_mean.aggregation == "seq-mean-token-mean" and seq_mean.scale_advantages is False


def test_registration_validates_names_and_specs():
    spec = kernel_objective(sech_kernel, defaults={"width": 2.0, "negative_scale": 1.0})
    with pytest.raises(ValueError, match="built in and cannot be replaced"):
        register_objective("respo", spec)
    register_objective("sech", spec)
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        register_objective("sech", spec)
    narrower = kernel_objective(sech_kernel, defaults={"width": 0.5, "negative_scale": 1.0})
    assert dict(register_objective("sech", narrower, replace=True).hparams)["width"] == 0.5
    for bad in ("", "2fast", "my kernel", "a.b", None):
        with pytest.raises(ValueError, match="must start with a letter"):
            register_objective(bad, spec)
    with pytest.raises(TypeError, match="needs an ObjectiveSpec"):
        register_objective("mine", sech_kernel)
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        get_objective("sech", widht=3.0)
    with pytest.raises(ValueError, match="width must be a real number"):
        get_objective("sech", width="wide")
    with pytest.raises(ValueError, match="built in and cannot be removed"):
        unregister_objective("grpo")
    with pytest.raises(KeyError, match="no registered objective"):
        unregister_objective("nothing")


@pytest.mark.parametrize(
    "kernel, match",
    [
        (lambda log_w, adv: -jnp.ones_like(log_w), "finite weights >= 0"),
        (lambda log_w, adv: jnp.exp(-5.0 * log_w), "finite weights >= 0"),  # W^-5 overflows at log W = -20
        (lambda log_w, adv: jnp.sqrt(log_w), "finite weights >= 0"),  # NaN below W = 1
        (lambda log_w, adv: jnp.ones((2,)), "one weight per response"),
        (lambda log_w, adv, nope: log_w, "the kernel failed"),
        ("not a function", "kernel must be a function"),
    ],
)
def test_bad_kernels_are_refused_before_registration(kernel, match):
    with pytest.raises((ValueError, TypeError), match=match):
        kernel_objective(kernel)
    assert set(OBJECTIVES) == BUILTIN_OBJECTIVES


def test_bad_specs_are_refused_with_the_field_named():
    good = kernel_objective(sech_kernel, defaults={"width": 2.0, "negative_scale": 1.0})
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        dataclasses.replace(good, aggregation="token-sum")
    with pytest.raises(ValueError, match="may not define the common keys"):
        dataclasses.replace(good, defaults={"aggregation": "token-mean"})
    with pytest.raises(ValueError, match="token_log_ratio_clamp"):
        dataclasses.replace(good, token_log_ratio_clamp=-1.0)
    with pytest.raises(TypeError, match="token_loss must be callable"):
        ObjectiveSpec("respo", {}, dict)
    with pytest.raises(TypeError, match="scale_advantages must be a bool"):
        dataclasses.replace(good, scale_advantages="yes")
    with pytest.raises(ValueError, match="must be a number or a"):
        kernel_objective(sech_kernel, defaults={"width": (1.0, 2.0, 3.0), "negative_scale": 1.0})
    with pytest.raises(ValueError, match="negative branch: lam must be >= 0"):
        reshaping_objective(alpha=(2.0, 1.0), beta=(0.5, 0.5), lam=(2.0, -1.0))


def exploding_token_loss(logp, old_logp, advantages, mask, log_w):
    """A REINFORCE loss weighted by W^5, which overflows float32 at the clamp log W = 20."""
    weight = jax.lax.stop_gradient(jnp.exp(5.0 * log_w))
    loss = -(weight * advantages)[:, None] * logp
    return TokenLoss(loss=loss, coefficient=jnp.broadcast_to(weight[:, None], logp.shape), metrics={})


def test_a_failing_probe_leaves_the_registry_unchanged():
    spec = ObjectiveSpec(exploding_token_loss, {}, lambda h: h)
    with pytest.raises(ValueError, match="'w5' was not registered: non-finite output: loss"):
        register_objective("w5", spec)
    assert "w5" not in OBJECTIVES
    register_objective("sech", kernel_objective(sech_kernel, defaults={"width": 2.0, "negative_scale": 1.0}))
    before = OBJECTIVES["sech"]
    with pytest.raises(ValueError, match="'sech' was not registered"):
        register_objective("sech", spec, replace=True)
    assert OBJECTIVES["sech"] is before
    with pytest.raises(ValueError, match="'bad' was not registered: .*widht"):
        register_objective("bad", ObjectiveSpec(exploding_token_loss, {"widht": 1.0}, lambda h: h))


def test_the_trainer_resolves_a_user_registered_objective(tmp_path):
    """objective.name / objective.hparams of the config reach a user kernel inside the jitted update."""
    from experiments.train import DEFAULT_CONFIG, load_config
    from respo_jax.training.batch import PolicyBatch, build_sequences
    from respo_jax.training.config import ConfigError, apply_overrides
    from respo_jax.training.loop import RLTrainer

    register_objective("sech", kernel_objective(sech_kernel, defaults={"width": 2.0, "negative_scale": 1.0}))
    config = apply_overrides(load_config(DEFAULT_CONFIG), [
        "objective.name=sech", "objective.hparams.width=0.25", "objective.hparams.negative_scale=0.5",
        "warmup.steps=0", "run.progress=false", "run.eval_problems=0", "optim.learning_rate=3e-2",
        f"run.out_dir={tmp_path}",
    ])
    trainer = RLTrainer(config)
    assert trainer.objective == get_objective("sech", width=0.25, negative_scale=0.5)
    prompts = [[1, 5, 13, 4, 16]] * 4
    responses = np.array([[6, 24, 2], [7, 24, 2], [8, 24, 2], [9, 24, 2]])
    ids, positions, attention, response_mask, prompt_len = build_sequences(
        prompts, responses, np.full(4, 3), 0)
    advantages = np.array([1.5, -0.5, -0.5, -0.5], np.float32)
    batch = PolicyBatch(jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(attention),
                        jnp.asarray(response_mask), jnp.zeros(response_mask.shape), jnp.asarray(advantages),
                        prompt_len)
    batch = batch.replace(old_logp=trainer.old_logprobs(trainer.state.params, batch, None)[0])
    for _ in range(2):  # the second update sees the first one's drift: log W != 0
        trainer.state.params, trainer.state.opt_state, metrics = trainer.policy_step(
            trainer.state.params, trainer.state.opt_state, batch)
    log_w = np.asarray(metrics["responses"]["log_w"], np.float64)
    assert np.all(np.abs(log_w) > 1e-3), log_w
    expected = np.where(advantages >= 0, 1.0, 0.5) / np.cosh(log_w / 0.25)
    np.testing.assert_allclose(np.asarray(metrics["responses"]["phi"]), expected, rtol=1e-5, atol=1e-7)
    # A typo fails at start-up (config validation), naming the registered objectives, the user's included.
    with pytest.raises(ConfigError, match=r"objective.name='sehc': expected one of \[.*'sech'"):
        apply_overrides(config, ["objective.name=sehc"])
