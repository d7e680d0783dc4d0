"""KL to a reference policy, the entropy bonus and the off-policy masks against float64 transcriptions of
their reference formulas (verl's kl_penalty / agg_loss / AdaptiveKLController, DeepSeek-V3.2's sequence
masking, SkyRL's geometric-mean mask, M2PO's greedy second-moment mask) on held-out cases with padding
and empty rows; the update step's terms exact under micro-batching and differentiated correctly; the
start-up refusals; and a tiny run whose kl_ref the penalty keeps below the unpenalized run's."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_training import _keep_gradient, _policy_setup, _TINY
from tiny_runs import read_records, train, without_timings

from experiments.train import DEFAULT_CONFIG, load_config
from respo_jax.models.qwen3.lm_head import chunked_token_logprobs
from respo_jax.objectives import AGGREGATION_MODES, get_objective
from respo_jax.objectives.aggregation import loss_denominator
from respo_jax.objectives.off_policy_masks import OffPolicyMask, m2po_cutoff, mask_weights, masked_fraction
from respo_jax.objectives.regularizers import Regularizers, adaptive_kl_coef, kl_penalty, response_kl
from respo_jax.training.config import ConfigError, apply_overrides
from respo_jax.training.step import make_policy_step

# ------------------------------------------------------------------------------ float64 transcriptions


def verl_kl_penalty(logprob, ref_logprob, kind):
    """verl core_algos.kl_penalty_forward, float64 (its "+" variants take this value)."""
    logprob, ref_logprob = np.float64(logprob), np.float64(ref_logprob)
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return np.abs(logprob - ref_logprob)
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob) ** 2
    kl = np.clip(ref_logprob - logprob, -20, 20)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


def verl_agg_loss(loss_mat, mask, mode, scale=None):
    """verl core_algos.agg_loss, float64; responses with an empty mask leave the seq-mean modes."""
    loss_mat, mask = np.float64(loss_mat), np.float64(mask)
    if mode == "token-mean":
        return (loss_mat * mask).sum() / max(mask.sum(), 1)
    sums = (loss_mat * mask).sum(-1)
    lengths = mask.sum(-1)
    rows = lengths > 0
    if not rows.any():
        return 0.0
    if mode == "seq-mean-token-mean":
        return (sums[rows] / lengths[rows]).mean()
    if mode == "seq-mean-token-sum":
        return sums[rows].mean()
    return sums[rows].sum() / (rows.sum() * (mask.shape[-1] if scale is None else scale))


class VerlAdaptiveKLController:
    """verl's AdaptiveKLController."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def ref_deepseek_keep(logp, old_logp, adv, mask, delta):
    keep = []
    for i in range(len(adv)):
        n = mask[i].sum()
        kl = (np.float64(old_logp[i]) - logp[i])[mask[i] > 0].sum() / n if n else 0.0
        keep.append(not (adv[i] < 0 and kl > delta))
    return np.array(keep)


def ref_geometric_keep(logp, old_logp, mask, low, high):
    keep = []
    for i in range(logp.shape[0]):
        n = mask[i].sum()
        mean = (np.float64(logp[i]) - old_logp[i])[mask[i] > 0].sum() / n if n else 0.0
        keep.append(low <= math.exp(mean) <= high)
    return np.array(keep)


def ref_m2po_keep(logp, old_logp, mask, tau):
    """M2PO's greedy mask: drop the largest (log r)^2 one at a time until the mean of the rest is <= τ."""
    m2 = (np.float64(logp) - old_logp) ** 2
    keep = mask > 0
    while keep.any() and m2[keep].mean() > tau:
        largest = np.where(keep, m2, -np.inf)
        keep[np.unravel_index(np.argmax(largest), m2.shape)] = False
    return keep


def _case(seed, rows=7, width=9, scale=0.5):
    """Held-out log-probs with ragged responses, one empty row and one full row."""
    rng = np.random.default_rng(seed)
    old = -rng.gamma(2.0, 1.0, (rows, width))
    logp = old + scale * rng.standard_normal((rows, width))
    ref = old + scale * rng.standard_normal((rows, width))
    lengths = rng.integers(1, width + 1, rows)
    lengths[1], lengths[-1] = 0, width
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float64)
    adv = rng.choice([-1.5, -0.5, 0.5, 1.5], rows)
    return logp, old, ref, mask, adv


# ------------------------------------------------------------------------------ KL, entropy, controller


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "k3+", "k1+"])
def test_kl_penalty_is_verls_with_its_clamps_and_straight_through_gradient(estimator):
    logp, _, ref, mask, _ = _case(0, scale=2.0)
    # k3's clamps: the log-ratio at ±20, the value at 10
    logp[0, :3] = ref[0, :3] - np.array([25.0, 12.0, -25.0])
    got = np.asarray(kl_penalty(jnp.float32(logp), jnp.float32(ref), estimator), np.float64)
    want = verl_kl_penalty(np.float32(logp), np.float32(ref), estimator.rstrip("+"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    grad = jax.grad(lambda x: jnp.sum(kl_penalty(x, jnp.float32(ref), estimator)))(jnp.float32(logp))
    grad = np.asarray(grad)
    diff = np.float64(np.float32(logp)) - np.float32(ref)
    if estimator.endswith("+"):  # verl: backward of 0.5 (logp - ref)^2
        want_grad = diff
    elif estimator == "k3":  # d/dlogp (e^x - x - 1), x = ref - logp, 0 where a clamp binds
        x = -diff
        inside = (np.abs(x) < 20) & (np.exp(x) - x - 1 < 10)
        want_grad = np.where(inside, 1 - np.exp(np.clip(x, -20, 20)), 0.0)
    else:
        want_grad = {"k1": np.ones_like(diff), "abs": np.sign(diff), "k2": diff}[estimator]
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_the_kl_and_entropy_terms_are_verls_agg_loss_with_the_objectives_denominator(mode):
    logp, _, ref, mask, _ = _case(1)
    entropy = np.random.default_rng(2).gamma(2.0, 1.0, logp.shape)
    regs = Regularizers(kl_coef=0.3, kl_estimator="k3", entropy_coef=0.02)
    den = loss_denominator(jnp.float32(mask), mode, 6.0)
    logp, ref, entropy32 = jnp.float32(logp), jnp.float32(ref), jnp.float32(entropy)
    total = regs.loss_total(logp, ref, entropy32, jnp.float32(mask), mode, 6.0)
    want = (0.3 * verl_agg_loss(verl_kl_penalty(np.asarray(logp), np.asarray(ref), "k3"), mask, mode, 6.0)
            - 0.02 * verl_agg_loss(entropy, mask, mode, 6.0))
    np.testing.assert_allclose(float(total / den), want, rtol=1e-5, atol=1e-6)
    empty = jnp.zeros_like(jnp.float32(mask))  # no response token at all: nothing is added
    assert float(regs.loss_total(logp, ref, entropy32, empty, mode, 6.0)) == 0


def test_response_kl_and_the_adaptive_controller_are_verls():
    logp, old, ref, mask, _ = _case(3)
    total, mean = response_kl(jnp.float32(old), jnp.float32(ref), jnp.float32(mask), "k3")
    kld = verl_kl_penalty(np.float32(old), np.float32(ref), "k3") * mask
    np.testing.assert_allclose(np.asarray(total), kld.sum(-1), rtol=1e-5, atol=1e-6)
    want_mean = kld.sum(-1) / np.maximum(mask.sum(-1), 1)
    np.testing.assert_allclose(np.asarray(mean), want_mean, rtol=1e-5, atol=1e-6)
    controller, value = VerlAdaptiveKLController(0.05, 0.02, 500), 0.05
    for current in (0.001, 0.019, 0.021, 0.5, 0.02):
        controller.update(current, 64)
        value = adaptive_kl_coef(value, current, 64, 0.02, 500)
        assert value == pytest.approx(controller.value, rel=1e-12)


def test_the_chunked_heads_entropy_gradient_is_the_dense_float64_gradient():
    """Both head kernels: d/d(hidden, weight) of Σ a·log p(target) + c·H equals float64 central
    differences of the dense softmax, at a temperature, tied and untied."""
    rng = np.random.default_rng(4)
    b, s, e, v, temperature = 2, 3, 4, 11, 0.7
    h = rng.standard_normal((b, s, e)).astype(np.float32)
    t = rng.integers(0, v, (b, s))
    a, c = rng.standard_normal((b, s)), rng.standard_normal((b, s))
    for tied in (False, True):
        w = rng.standard_normal((v, e) if tied else (e, v)).astype(np.float32)

        def dense(h64, w64):
            z = (np.einsum("bse,ve->bsv", h64, w64) if tied else h64 @ w64) / temperature
            top = z.max(-1, keepdims=True)
            logq = z - np.log(np.exp(z - top).sum(-1, keepdims=True)) - top
            logp = np.take_along_axis(logq, t[..., None], -1)[..., 0]
            return float((a * logp - c * (np.exp(logq) * logq).sum(-1)).sum())

        def numeric(x, f):
            grad, x = np.zeros(x.shape), np.float64(x)
            for idx in np.ndindex(x.shape):
                d = np.zeros_like(x)
                d[idx] = 1e-6
                grad[idx] = (f(x + d) - f(x - d)) / 2e-6
            return grad

        want_h = numeric(h, lambda x: dense(x, np.float64(w)))
        want_w = numeric(w, lambda x: dense(np.float64(h), x))
        for impl in ("vocab_chunks", "token_chunks"):
            def loss(h_, w_):
                logp, entropy = chunked_token_logprobs(
                    h_, w_, jnp.asarray(t), tied=tied, temperature=temperature, chunk_tokens=2,
                    return_entropy=True, entropy_gradient=True, impl=impl, vocab_chunk=4)
                return jnp.sum(a * logp + c * entropy)

            got_h, got_w = jax.grad(loss, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
            np.testing.assert_allclose(np.asarray(got_h), want_h, rtol=0, atol=5e-5 * np.abs(want_h).max())
            np.testing.assert_allclose(np.asarray(got_w), want_w, rtol=0, atol=5e-5 * np.abs(want_w).max())


# ------------------------------------------------------------------------------ masks


def test_the_sequence_masks_are_their_papers_formulas_with_padding_and_empty_rows():
    for seed in range(4):
        logp, old, _, mask, adv = _case(10 + seed, scale=0.2)
        args = (jnp.float32(logp), jnp.float32(old), jnp.float32(adv), jnp.float32(mask))
        deepseek = np.asarray(mask_weights(OffPolicyMask("deepseek_v32", delta=0.02), *args))
        want = ref_deepseek_keep(np.float32(logp), np.float32(old), adv, mask, 0.02)[:, None] * mask
        np.testing.assert_array_equal(deepseek, want)
        geometric = np.asarray(mask_weights(OffPolicyMask("geometric", low=0.95, high=1.05), *args))
        want = ref_geometric_keep(np.float32(logp), np.float32(old), mask, 0.95, 1.05)[:, None] * mask
        np.testing.assert_array_equal(geometric, want)
        assert deepseek[1].sum() == geometric[1].sum() == 0  # the empty row: nothing to mask or keep
        fraction = float(masked_fraction(jnp.float32(geometric), jnp.float32(mask)))
        assert fraction == pytest.approx(1 - geometric.sum() / mask.sum())


def test_m2po_masks_the_largest_second_moments_until_the_mean_fits():
    for seed, tau in ((20, 0.04), (21, 0.01), (22, 0.2), (23, 10.0)):
        logp, old, _, mask, adv = _case(seed, rows=6, width=7, scale=0.3)
        got = np.asarray(mask_weights(OffPolicyMask("m2po", threshold=tau), jnp.float32(logp),
                                      jnp.float32(old), jnp.float32(adv), jnp.float32(mask)))
        want = ref_m2po_keep(np.float32(logp), np.float32(old), mask, tau)
        np.testing.assert_array_equal(got, want * mask)
        kept = (np.float64(np.float32(logp)) - np.float32(old)) ** 2
        if got.sum():
            assert kept[got > 0].mean() <= tau * (1 + 1e-6)
    assert float(m2po_cutoff(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3)), 0.04)) == np.inf


# ------------------------------------------------------------------------------ the update step


def _with_reference(batch, seed=1):
    rng = np.random.default_rng(seed)
    ref = batch.old_logp + 0.2 * rng.standard_normal(batch.old_logp.shape).astype(np.float32)
    return batch.replace(ref_logp=ref * batch.response_mask)


@pytest.mark.parametrize("objective, mask", [
    ("grpo", {"kind": "m2po", "threshold": 0.05}),  # token-mean, the batch-wide mask
    ("gspo", {"kind": "deepseek_v32", "delta": 0.02}),  # seq-mean-token-mean
    ("respo", {"kind": "geometric", "low": 0.97, "high": 1.03}),
])
@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_the_regularized_step_is_exact_under_micro_batching(objective, mask):
    """KL + entropy + mask: micro-batches of 4 rows (the last padded) apply the one-shot gradient and
    report its metrics; each mask removes some but not all tokens here."""
    graphdef, params, batch = _policy_setup()
    batch = _with_reference(batch)
    regs = Regularizers(kl_coef=0.2, entropy_coef=0.01, mask=OffPolicyMask.from_dict(mask))
    tx = optax.chain(_keep_gradient(), optax.sgd(0.0))
    step = make_policy_step(graphdef, get_objective(objective), tx, temperature=0.8, regularizers=regs)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    _, (one, _), one_metrics = step(copy(params), tx.init(params), batch, None)
    assert 0 < float(one_metrics["off_policy_masked_fraction"]) < 1
    for rows in (4,):
        _, (got, _), metrics = step(copy(params), tx.init(params), batch, rows)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one)):
            b = np.asarray(b)
            np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-5 * np.abs(b).max())
        for key in ("loss", "kl_ref", "entropy_bonus", "off_policy_masked_fraction"):
            np.testing.assert_allclose(float(metrics[key]), float(one_metrics[key]), rtol=1e-5, err_msg=key)


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_the_kl_and_entropy_gradients_are_those_of_the_dense_model():
    """The step's gradient with kl_coef and entropy_coef minus the plain step's is the gradient of
    (kl_coef · Σ agg(k3) − entropy_coef · Σ agg(H)) / D computed from the model's dense logits."""
    graphdef, params, batch = _policy_setup()
    batch = _with_reference(batch)
    temperature, objective = 0.8, get_objective("grpo")
    tx = optax.chain(_keep_gradient(), optax.sgd(0.0))
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    grads = {}
    for name, regs in (("plain", None), ("regularized", Regularizers(kl_coef=0.5, entropy_coef=0.05))):
        step = make_policy_step(graphdef, objective, tx, temperature=temperature, regularizers=regs)
        _, (grads[name], _), metrics = step(copy(params), tx.init(params), batch)
    mask = batch.response_mask
    start, width = batch.prompt_len - 1, mask.shape[1]

    def dense_terms(p):
        model = nnx.merge(graphdef, p)
        ids = batch.input_ids
        logits = model(ids[:, :-1], positions=batch.positions[:, :-1],
                       attention_mask=batch.attention_mask[:, :-1])[:, start:start + width]
        logq = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        logp = jnp.take_along_axis(logq, ids[:, start + 1:start + 1 + width, None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
        den = loss_denominator(mask, objective.aggregation)
        kl = jnp.sum(jnp.where(mask > 0, kl_penalty(logp, batch.ref_logp, "k3"), 0.0)) / den
        return (0.5 * kl - 0.05 * jnp.sum(jnp.where(mask > 0, entropy, 0.0)) / den), (kl, entropy)

    want, (kl, _) = jax.jit(jax.grad(dense_terms, has_aux=True))(params)
    assert float(metrics["kl_ref"]) == pytest.approx(float(kl), rel=1e-4)
    for reg, plain, dense in zip(*(jax.tree.leaves(g) for g in (grads["regularized"], grads["plain"], want))):
        diff, dense = np.asarray(reg) - np.asarray(plain), np.asarray(dense)
        np.testing.assert_allclose(diff, dense, rtol=0, atol=2e-4 * max(np.abs(dense).max(), 1e-6))


def test_without_regularizers_the_step_is_the_same_program():
    """No reference, no entropy, no mask: the update lowers to the program the step had without the
    option (and the batch carries no reference log-probs)."""
    graphdef, params, batch = _policy_setup()
    tx = optax.adamw(1e-3)
    plain = make_policy_step(graphdef, get_objective("respo"), tx)
    inactive = make_policy_step(graphdef, get_objective("respo"), tx, regularizers=Regularizers())
    assert batch.ref_logp is None
    for rows in (None, 4):
        want = plain.lower(params, tx.init(params), batch, rows).as_text()
        assert inactive.lower(params, tx.init(params), batch, rows).as_text() == want
    assert not load_config(DEFAULT_CONFIG).objective.uses_reference
    assert not load_config(DEFAULT_CONFIG).objective.regularizers().active


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("overrides, message", [
    (["objective.kl_coef=-0.1"], "objective.kl_coef=-0.1: expected a finite number >= 0"),
    (["objective.entropy_coef=-1"], "objective.entropy_coef=-1.0: expected a finite number >= 0"),
    (["objective.kl_coef=0.1", "objective.kl_estimator=k4"],
     "objective.kl_estimator='k4': unknown KL estimator"),
    (["objective.kl_in_reward=true"], "objective.kl_in_reward=True: expected false with objective.kl_coef=0"),
    (["objective.kl_coef=0.1", "objective.kl_target=0.1", "objective.kl_horizon=100"],
     "objective.kl_target=0.1: expected 0 without objective.kl_in_reward=true"),
    (["objective.kl_coef=0.1", "objective.kl_in_reward=true", "objective.kl_target=0.1"],
     "objective.kl_horizon=0.0: expected > 0 exactly when objective.kl_target > 0"),
    (["objective.reference_checkpoint=/tmp"], "objective.reference_checkpoint='/tmp': expected '' with"),
    (["objective.kl_coef=0.1", "objective.reference_checkpoint=/no/such/folder"],
     "objective.reference_checkpoint='/no/such/folder': expected an existing checkpoint folder"),
    (["objective.kl_coef=0.1", "objective.log_kl_ref=true"],
     "objective.log_kl_ref=True: expected false with"),
    (['objective.off_policy_mask={"kind": "m3po"}'], "kind='m3po': expected one of"),
    (['objective.off_policy_mask={"kind": "deepseek_v32"}'], "needs delta (no published default)"),
    (['objective.off_policy_mask={"kind": "geometric", "delta": 0.1}'], "kind 'geometric' takes only"),
    (['objective.off_policy_mask={"kind": "geometric", "low": 1.2}'], "expected low < 1 < high"),
    (['objective.off_policy_mask={"kind": "m2po", "threshold": 0}'],
     "threshold=0: expected a finite number > 0"),
    (['objective.off_policy_mask={"threshold": 0.1}'], "needs a 'kind'"),
])
def test_bad_regularizer_settings_are_one_line_start_up_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(load_config(DEFAULT_CONFIG), overrides)
    text = str(info.value)
    assert "\n" not in text and message in text, text


def test_the_reference_memory_is_counted_by_the_start_up_limits():
    from respo_jax.models import qwen3
    from respo_jax.training.limits import check_limits, parameter_bytes

    model_cfg = qwen3.Qwen3Config.preset("tiny", vocab_size=64)
    config = apply_overrides(load_config(DEFAULT_CONFIG), ["objective.kl_coef=0.1"])
    params = parameter_bytes(model_cfg, config.model.dtype)
    abstract = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    assert params == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))

    from tiny_runs import fits_limits, least_memory

    cache = least_memory(load_config(DEFAULT_CONFIG), model_cfg)  # the sampler's cache alone
    assert not fits_limits(config, model_cfg, cache + params - 1)
    assert fits_limits(config, model_cfg, cache + params)
    with pytest.raises(ConfigError, match=r"^objective\.kl_coef=0\.1: the reference policy's parameters"):
        check_limits(config, model_cfg, 10, cache)


# ------------------------------------------------------------------------------ runs


@pytest.mark.slow
def test_a_kl_penalty_keeps_the_policy_closer_to_its_reference(jit_cache, tmp_path):
    """Same seed, 4 iterations: with objective.kl_coef = 10 the logged kl_ref (k3, token mean) stays below
    the unpenalized run's (which logs it with log_kl_ref) from the second iteration on."""
    runs = {}
    for name, override in (("control", "objective.log_kl_ref=true"), ("penalized", "objective.kl_coef=10")):
        result = train(jit_cache, tmp_path / name, "run.iterations=4", override)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[name] = [r["kl_ref"] for r in read_records(tmp_path / name) if r["phase"] == "rl"]
    assert runs["control"][0] == pytest.approx(runs["penalized"][0], rel=1e-6)  # one shared first rollout
    assert all(p < c for p, c in zip(runs["penalized"][1:], runs["control"][1:])), runs


@pytest.mark.slow
def test_a_run_with_a_reference_resumes_exactly(jit_cache, tmp_path):
    """KL in the reward with the adaptive controller, an entropy bonus and a mask: stopped after 2
    iterations and resumed to 4, the records equal the uninterrupted run's (reference and coefficient
    come back from the checkpoint)."""
    args = ("objective.kl_coef=0.5", "objective.kl_in_reward=true", "objective.kl_target=0.01",
            "objective.kl_horizon=50", "objective.entropy_coef=0.01",
            'objective.off_policy_mask={"kind": "m2po", "threshold": 0.01}')
    whole = train(jit_cache, tmp_path / "whole", "run.iterations=4", *args)
    assert whole.returncode == 0, whole.stderr[-2000:]
    part = train(jit_cache, tmp_path / "part", "run.iterations=2", *args)
    assert part.returncode == 0, part.stderr[-2000:]
    resumed = train(jit_cache, tmp_path / "part", "run.iterations=4", "run.resume=true", *args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want, got = (without_timings(read_records(tmp_path / n)) for n in ("whole", "part"))
    assert [r for r in got if r["phase"] == "rl"] == [r for r in want if r["phase"] == "rl"]
    assert len({r["kl_reward_coef"] for r in want if r["phase"] == "rl"}) > 1
    # objective.reference_checkpoint: the reference is that run's last step, not this run's start.
    other = train(jit_cache, tmp_path / "other", "run.iterations=1", "objective.kl_coef=0.5",
                  f"objective.reference_checkpoint={tmp_path / 'whole' / 'checkpoints'}")
    assert other.returncode == 0, other.stderr[-2000:]
    fresh = [r["kl_ref"] for r in read_records(tmp_path / "part") if r["phase"] == "rl"][0]
    assert [r["kl_ref"] for r in read_records(tmp_path / "other") if r["phase"] == "rl"][0] > 2 * fresh
