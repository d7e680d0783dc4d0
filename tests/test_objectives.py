"""Tests of the objectives of respo_jax.objectives (losses, gradients, micro-batch accumulation,
metrics, empty and extreme inputs, errors) against the float64 NumPy reference of
tests/objective_refs.py; the kernels are tested in tests/test_objective_kernels.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from respo_jax.objectives import (
    OBJECTIVES,
    combine_loss_terms,
    get_objective,
    grpo_objective,
    gspo_objective,
    respo_kernel,
    respo_objective,
    sequence_log_ratio,
    vespo_objective,
)
from objective_refs import (
    OBJECTIVE_CASES,
    PROPERTY_SETTINGS,
    batch_for,
    case_id,
    case_modes,
    f32,
    make_batch,
    make_gspo_batch,
    name_modes,
    ref_log_w,
    ref_loss_and_grad,
    ref_respo_minus,
    ref_respo_plus,
    ref_token_loss_and_coefficient,
)


# ----------------------------------------------------------------------------- objectives: values, gradients


@pytest.mark.parametrize("case, mode", case_modes(), ids=lambda x: x if isinstance(x, str) else case_id(x))
def test_objective_loss_and_gradient_match_float64_reference(case, mode):
    name, hparams = case
    objective = get_objective(name, aggregation=mode, **hparams)
    batch = batch_for(name, seed=3 + len(hparams))
    logp, old_logp, adv, mask = f32(*batch)
    ref_loss, ref_grad = ref_loss_and_grad(name, dict(objective.hparams), mode, *batch)

    def loss_fn(x):
        return objective(x, old_logp, adv, mask)[0]

    loss, grad = jax.value_and_grad(loss_fn)(logp)
    jit_loss, jit_grad = jax.jit(jax.value_and_grad(loss_fn))(logp)
    for got_loss, got_grad in ((loss, grad), (jit_loss, jit_grad)):
        np.testing.assert_allclose(float(got_loss), ref_loss, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_grad), ref_grad, rtol=1e-4, atol=1e-7)
    assert np.any(np.abs(ref_grad) > 1e-3)  # the reference is not trivially zero


def test_gspo_and_grpo_test_data_exercise_both_clipped_and_unclipped_tokens():
    for objective, batch in ((gspo_objective, make_gspo_batch()), (grpo_objective, make_batch())):
        _, metrics = objective(*f32(*batch))
        assert 0.0 < float(metrics["clip_fraction_low"]) and 0.0 < float(metrics["clip_fraction_high"])
        assert float(metrics["clip_fraction"]) < 1.0


def test_registry_defaults_are_the_papers_table_3_and_the_reference_codes():
    assert dict(respo_objective.hparams) == {"alpha": (2.0, 1.0), "beta": (0.5, 0.5), "lam": (2.0, 2.0)}
    assert dict(vespo_objective.hparams) == {"beta": (2.0, 3.0), "lam": (3.0, 2.0)}
    assert dict(grpo_objective.hparams) == {"eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": 3.0}
    assert dict(gspo_objective.hparams) == {"eps_low": 3e-4, "eps_high": 4e-4, "log_ratio_cap": 10.0}
    assert gspo_objective.aggregation == "seq-mean-token-mean"
    assert dict(get_objective("cispo").hparams) == {"eps_max": 5.0}
    assert dict(get_objective("sapo").hparams) == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert get_objective("sapo").aggregation == "seq-mean-token-mean"
    luspo = get_objective("luspo")
    assert dict(luspo.hparams) == {"eps_low": 2e-3, "eps_high": 2.5e-3, "log_ratio_cap": 10.0}
    assert luspo.aggregation == "seq-mean-token-sum"
    dr_grpo = get_objective("dr_grpo")
    assert dict(dr_grpo.hparams)["clip_ratio_c"] is None and dr_grpo.aggregation == "seq-mean-token-sum-norm"
    assert dr_grpo.scale_advantages is False and grpo_objective.scale_advantages is True
    assert respo_objective == get_objective("respo") and respo_objective.aggregation == "token-mean"
    custom = get_objective("grpo", eps_high=0.28, aggregation="seq-mean-token-sum")
    assert custom.config == {"eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": 3.0,
                             "aggregation": "seq-mean-token-sum", "loss_scale_factor": None,
                             "scale_advantages": True}
    assert get_objective("grpo", **custom.config) == custom
    assert set(OBJECTIVES) == {"respo", "vespo", "grpo", "gspo", "cispo", "sapo", "luspo", "dr_grpo"}


def test_respo_gradient_is_phi_times_advantage_over_token_count():
    """The contract: d loss / d logp[i, t] = -phi(W_i) A_i mask[i, t] / sum(mask) under token-mean."""
    logp, old_logp, adv, mask = f32(*make_batch(seed=7))
    grad = jax.grad(lambda x: respo_objective(x, old_logp, adv, mask)[0])(logp)
    phi = respo_kernel(sequence_log_ratio(logp, old_logp, mask), adv)
    expected = -(phi * adv)[:, None] * mask / jnp.sum(mask)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-6, atol=1e-9)


def test_objectives_are_hashable_static_arguments_of_jit():
    logp, old_logp, adv, mask = f32(*make_batch())

    @jax.jit
    def step(x):
        return {name: get_objective(name)(x, old_logp, adv, mask)[0] for name in OBJECTIVES}

    eager = {name: float(get_objective(name)(logp, old_logp, adv, mask)[0]) for name in OBJECTIVES}
    jitted = {name: float(v) for name, v in step(logp).items()}
    for name in OBJECTIVES:
        np.testing.assert_allclose(jitted[name], eager[name], rtol=1e-6)
    static_loss = jax.jit(lambda obj, x: obj(x, old_logp, adv, mask)[0], static_argnums=0)
    np.testing.assert_allclose(float(static_loss(vespo_objective, logp)), eager["vespo"], rtol=1e-6)
    assert hash(get_objective("grpo", eps_high=0.28)) == hash(get_objective("grpo", eps_high=0.28))


# ----------------------------------------------------------------------------- micro-batch accumulation


@pytest.mark.parametrize("name, mode", name_modes())
def test_micro_batch_accumulation_equals_full_batch(name, mode):
    objective = get_objective(name, aggregation=mode)
    logp, old_logp, adv, mask = f32(*batch_for(name, seed=11))
    full_loss, full_grad = jax.value_and_grad(lambda x: objective(x, old_logp, adv, mask)[0])(logp)
    denominator = objective.denominator(mask)
    splits = [slice(0, 4), slice(4, 8)]  # ragged token counts; the first holds the empty response
    losses, grads, terms = [], [], []
    for rows in splits:
        mb = (old_logp[rows], adv[rows], mask[rows])
        loss, grad = jax.value_and_grad(lambda x: objective(x, *mb, denominator=denominator)[0])(logp[rows])
        losses.append(loss)
        grads.append(grad)
        terms.append(objective.loss_terms(logp[rows], *mb)[0])
    np.testing.assert_allclose(float(sum(losses)), float(full_loss), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(np.concatenate(grads), np.asarray(full_grad), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(float(combine_loss_terms(terms)), float(full_loss), rtol=1e-6, atol=1e-8)
    # Without the mini-batch denominator the micro-batch losses are *not* the full-batch loss.
    local = sum(float(objective(logp[r], old_logp[r], adv[r], mask[r])[0]) for r in splits)
    assert not np.isclose(local, float(full_loss), rtol=1e-3)


# ----------------------------------------------------------------------------- metrics


def ref_metrics(name, hp, logp, old_logp, adv, mask):
    logp, old_logp, adv, mask = (np.asarray(x, np.float64) for x in (logp, old_logp, adv, mask))
    _, coefficient = ref_token_loss_and_coefficient(name, hp, logp, old_logp, adv, mask)
    lengths = mask.sum(axis=1)
    non_empty = lengths > 0
    log_w = ref_log_w(name, logp, old_logp, mask)[non_empty]
    seq_coef = (coefficient * mask).sum(axis=1)[non_empty] / lengths[non_empty]
    a = adv[non_empty]
    pos, neg, low = a > 0, a < 0, log_w < -1.0
    mass = seq_coef * np.abs(a)
    return {
        "token_count": mask.sum(),
        "response_count": non_empty.sum(),
        "log_w_mean": log_w.mean(),
        "log_w_min": log_w.min(),
        "log_w_max": log_w.max(),
        "positive_low_w_fraction": (pos & low).sum() / pos.sum(),
        "coef_mean_pos": seq_coef[pos].mean(),
        "coef_mean_neg": seq_coef[neg].mean(),
        "coef_mass_pos": mass[pos].sum(),
        "coef_mass_neg": mass[neg].sum(),
        "positive_low_w_mass_share": mass[pos & low].sum() / mass[pos].sum(),
    }


@pytest.mark.parametrize("case", OBJECTIVE_CASES, ids=case_id)
def test_metrics_match_float64_reference(case):
    name, hparams = case
    objective = get_objective(name, **hparams)
    batch = batch_for(name) if name in ("gspo", "luspo") else make_batch(drift=0.6)
    _, metrics = objective(*f32(*batch))
    expected = ref_metrics(name, dict(objective.hparams), *batch)
    assert 0.0 < expected["positive_low_w_fraction"] < 1.0 or name in ("gspo", "luspo")
    for key, value in expected.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_metrics_on_a_hand_built_batch():
    # Three one-token responses: log W = -2 (A = +1), 0 (A = +2), 1 (A = -1.5); one empty response.
    old_logp = np.array([[-1.0], [-1.0], [-1.0], [-1.0]])
    logp = old_logp + np.array([[-2.0], [0.0], [1.0], [5.0]])
    mask = np.array([[1.0], [1.0], [1.0], [0.0]])
    adv = np.array([1.0, 2.0, -1.5, 3.0])
    _, m = respo_objective(*f32(logp, old_logp, adv, mask))
    phi_low, phi_neg = ref_respo_plus(math.exp(-2.0)), ref_respo_minus(math.e)
    expected = {
        "token_count": 3.0,
        "response_count": 3.0,
        "log_w_mean": -1.0 / 3.0,
        "log_w_min": -2.0,
        "log_w_max": 1.0,
        "positive_low_w_fraction": 0.5,
        "coef_mean_pos": (phi_low + 1.0) / 2.0,
        "coef_mean_neg": phi_neg,
        "coef_mass_pos": phi_low * 1.0 + 1.0 * 2.0,
        "coef_mass_neg": phi_neg * 1.5,
        "positive_low_w_mass_share": phi_low / (phi_low + 2.0),
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(float(m[key]), value, rtol=1e-5, err_msg=key)


def test_grpo_clip_fractions_count_tokens_whose_gradient_is_clipped():
    # Token ratios 1.5 (A>0: clipped high), 0.5 (A>0: not clipped), 0.5 (A<0: clipped low), 1.5 (A<0: not).
    log_ratio = np.log(np.array([[1.5, 0.5], [0.5, 1.5]]))
    old_logp = np.full((2, 2), -1.0)
    _, m = grpo_objective(*f32(old_logp + log_ratio, old_logp, np.array([1.0, -1.0]), np.ones((2, 2))))
    assert float(m["clip_fraction_high"]) == 0.25 and float(m["clip_fraction_low"]) == 0.25
    assert float(m["clip_fraction"]) == 0.5
    np.testing.assert_allclose(float(m["coef_mean_pos"]), 0.25, rtol=1e-6)  # (0 + 0.5) / 2
    np.testing.assert_allclose(float(m["coef_mean_neg"]), 0.75, rtol=1e-6)  # (0 + 1.5) / 2


# ----------------------------------------------------------------------------- empty and extreme inputs


@pytest.mark.parametrize("name, mode", name_modes())
def test_all_empty_responses_give_zero_loss_zero_gradient_and_finite_metrics(name, mode):
    objective = get_objective(name, aggregation=mode)
    logp, old_logp, adv, _ = f32(*make_batch())
    mask = jnp.zeros_like(logp)
    (loss, metrics), grad = jax.value_and_grad(objective, has_aux=True)(logp, old_logp, adv, mask)
    assert float(loss) == 0.0
    assert not np.any(np.asarray(grad))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["token_count"]) == 0.0


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_extreme_log_w_gives_finite_loss_gradient_and_metrics(name):
    # +-1e4 in log W before the clamp, spread over the tokens, for both advantage signs.
    seq = 4
    old_logp = np.full((4, seq), -1.0)
    logp = old_logp + np.array([[2500.0], [-2500.0], [2500.0], [-2500.0]])
    adv = np.array([1.0, 1.0, -1.0, -1.0])
    inputs = f32(logp, old_logp, adv, np.ones((4, seq)))
    (loss, metrics), grad = jax.value_and_grad(get_objective(name), has_aux=True)(*inputs)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["log_w_max"]) == 20.0 and float(metrics["log_w_min"]) == -20.0


def _value_and_grad_fns():
    # Dr.GRPO's constant L as the trainer sets it (the generation budget); without one it would be the
    # padded width (verl's fallback), which padding columns change by design.
    def objective(name):
        return get_objective(name, loss_scale_factor=8.0) if name == "dr_grpo" else get_objective(name)

    return {name: jax.jit(jax.value_and_grad(objective(name), has_aux=True)) for name in sorted(OBJECTIVES)}


_JITTED = _value_and_grad_fns()


PADDED_SHAPE = (4, 6)
PROPERTY_SHAPES = [(1, 1), (2, 4), (3, 5)]


@st.composite
def policy_batches(draw, extreme=True, shapes=None):
    # A few shapes only, so the jitted objectives compile once per shape; masks vary the rest.
    batch, seq = draw(st.sampled_from(shapes or PROPERTY_SHAPES))
    size = batch * seq
    elements = st.floats(-3e3, 3e3) if extreme else st.floats(-3.0, 3.0)
    old_logp = np.asarray(draw(st.lists(st.floats(-50.0, 0.0), min_size=size, max_size=size))).reshape(
        batch, seq
    )
    delta = np.asarray(draw(st.lists(elements, min_size=size, max_size=size))).reshape(batch, seq)
    mask = np.asarray(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=size, max_size=size))).reshape(
        batch, seq
    )
    adv = np.asarray(
        draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 1e3, -1e3, 0.37]), min_size=batch, max_size=batch))
    )
    return old_logp + delta, old_logp, adv, mask


@PROPERTY_SETTINGS
@given(
    batch=st.one_of(policy_batches(), policy_batches(shapes=[PADDED_SHAPE])),
    name=st.sampled_from(sorted(OBJECTIVES)),
)
def test_property_loss_gradient_and_metrics_are_finite(batch, name):
    (loss, metrics), grad = _JITTED[name](*f32(*batch))
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(np.asarray(grad)))
    assert all(np.isfinite(float(v)) for v in metrics.values())
    mask = batch[3]
    assert not np.any(np.asarray(grad)[mask == 0])  # padding receives no gradient


@PROPERTY_SETTINGS
@given(
    batch=policy_batches(extreme=False),
    name=st.sampled_from(sorted(OBJECTIVES)),
    pad_value=st.sampled_from([0.0, -7.0, 123.0, -np.inf]),
)
def test_property_loss_is_invariant_to_padding_columns_and_rows(batch, name, pad_value):
    logp, old_logp, adv, mask = batch
    batch_size, seq = logp.shape
    (loss, metrics), grad = _JITTED[name](*f32(logp, old_logp, adv, mask))

    def pad(x, value):  # extra response columns and extra (empty) response rows up to PADDED_SHAPE
        out = np.full(PADDED_SHAPE, value)
        out[:batch_size, :seq] = x
        return out

    padded = (
        pad(logp, pad_value),
        pad(old_logp, -pad_value),
        np.concatenate([adv, [1.0, -2.0, 0.5]])[:4],
        pad(mask, 0.0),
    )
    (padded_loss, padded_metrics), padded_grad = _JITTED[name](*f32(*padded))
    np.testing.assert_allclose(float(padded_loss), float(loss), rtol=1e-6, atol=1e-7)
    padded_grad = np.asarray(padded_grad)
    np.testing.assert_allclose(padded_grad[:batch_size, :seq], np.asarray(grad), rtol=1e-6, atol=1e-9)
    assert not np.any(padded_grad[batch_size:]) and not np.any(padded_grad[:, seq:])
    for key in metrics:
        np.testing.assert_allclose(
            float(padded_metrics[key]), float(metrics[key]), rtol=1e-6, atol=1e-7, err_msg=key
        )


# ----------------------------------------------------------------------------- errors


def test_unknown_objective_and_hyperparameters_are_named():
    with pytest.raises(KeyError, match="unknown objective 'ppo'"):
        get_objective("ppo")
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['foo'\] for objective 'respo'"):
        get_objective("respo", foo=1)
    with pytest.raises(ValueError, match=r"\['clip'\] for objective 'grpo'"):
        get_objective("grpo", clip=0.2)
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        get_objective("vespo", aggregation="mean")


@pytest.mark.parametrize(
    "name, hparams, message",
    [
        ("respo", {"beta": (1.5, 0.5)}, r"respo, positive branch: beta must lie in \[0, 1\]"),
        ("respo", {"lam": (2.0, -1.0)}, "respo, negative branch: lam must be >= 0"),
        ("respo", {"alpha": 2.0}, r"alpha must be a \(positive-branch, negative-branch\) pair"),
        ("respo", {"alpha": (2.0, float("nan"))}, r"alpha\[1\] must be finite"),
        ("vespo", {"beta": (-1.0, 3.0)}, "vespo, positive branch: beta must be >= 0"),
        ("grpo", {"eps_low": 1.5}, r"grpo: eps_low must lie in \(0, 1\)"),
        ("gspo", {"eps_high": 0.0}, "gspo: eps_high must be > 0"),
        ("grpo", {"eps_high": "0.28"}, "grpo: eps_high must be a real number"),
    ],
)
def test_invalid_hyperparameter_values_are_rejected(name, hparams, message):
    with pytest.raises(ValueError, match=message):
        get_objective(name, **hparams)


def _bad_inputs():
    logp, old_logp, adv, mask = (np.asarray(x, np.float32) for x in make_batch())
    nan_logp = logp.copy()
    nan_logp[0, 0] = np.nan
    inf_old = old_logp.copy()
    inf_old[1, 0] = np.inf
    half_mask = mask.copy()
    half_mask[0, 0] = 0.5
    nan_adv = adv.copy()
    nan_adv[2] = np.nan
    return [
        ((logp, old_logp[:, :-1], adv, mask), r"old_logp has shape \(8, 8\); logp has \(8, 9\)"),
        ((logp, old_logp, adv, mask[:-1]), r"mask has shape \(7, 9\); logp has \(8, 9\)"),
        ((logp, old_logp, adv[:-1], mask), r"advantages has shape \(7,\); expected \[batch\] = \(8,\)"),
        ((logp[0], old_logp[0], adv, mask[0]), r"logp must have shape \[batch, seq\]; got shape \(9,\)"),
        ((logp, old_logp, adv, mask.astype(bool)), "mask must be a floating-point array; got dtype bool"),
        (
            (logp, old_logp, adv, mask.astype(np.int32)),
            "mask must be a floating-point array; got dtype int32",
        ),
        ((logp.astype(np.int32), old_logp, adv, mask), "logp must be a floating-point array"),
        (
            (nan_logp, old_logp, adv, mask),
            r"logp has 1 NaN/inf value\(s\) at response tokens .* first at \[0, 0\]",
        ),
        ((logp, inf_old, adv, mask), r"old_logp has 1 NaN/inf value\(s\) .* first at \[1, 0\]: inf"),
        ((logp, old_logp, adv, half_mask), r"mask entries must be 0 or 1; found \[0.5\]"),
        ((logp, old_logp, nan_adv, mask), r"advantages contain NaN/inf at rows \[2\]"),
        ((logp[:0], old_logp[:0], adv[:0], mask[:0]), r"logp is empty: shape \(0, 9\)"),
    ]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_bad_inputs_raise_clear_value_errors(name):
    objective = get_objective(name)
    for inputs, message in _bad_inputs():
        with pytest.raises(ValueError, match=message):
            objective(*inputs)


def test_shape_errors_are_raised_under_jit_and_padding_may_hold_non_finite_values():
    logp, old_logp, adv, mask = f32(*make_batch())
    with pytest.raises(ValueError, match=r"old_logp has shape \(8, 8\)"):
        jax.jit(respo_objective)(logp, old_logp[:, :-1], adv, mask)
    # Under grad the non-differentiated arguments are still concrete and still checked.
    bad_old = old_logp.at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"old_logp has 1 NaN/inf value\(s\)"):
        jax.grad(lambda x: respo_objective(x, bad_old, adv, mask)[0])(logp)
    garbage = jnp.where(mask > 0, logp, jnp.nan)
    loss, _ = respo_objective(garbage, jnp.where(mask > 0, old_logp, -jnp.inf), adv, mask)
    np.testing.assert_allclose(float(loss), float(respo_objective(logp, old_logp, adv, mask)[0]), rtol=1e-6)
