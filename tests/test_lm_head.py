"""The LM head's log-probs (`lm_head.chunked_token_logprobs`): both kernels (`vocab_chunks`, the
vocabulary-blocked online log-sum-exp, and `token_chunks`, whole-vocabulary chunks) against a float64
NumPy reference in log-probs, entropies and the gradients of hidden and weight (tied and untied,
temperature != 1, a vocabulary that is no multiple of the block width, padded token chunks and
zero-cotangent padding positions), against each other, and the memory promise read off the program:
no array larger than one [chunk tokens, vocab_chunk] block of logits."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks import lm_head as lm_head_bench
from respo_jax.models import qwen3
from respo_jax.models.qwen3.lm_head import chunked_token_logprobs

BATCH, SEQ, EMBED, VOCAB = 3, 11, 24, 1000  # distinct sizes, so a shape says which axis it has


def _case(tied: bool, seed: int):
    """hidden [batch, seq, embed], weight, targets [batch, seq], cotangent g [batch, seq] (zero on the
    last 3 positions of row 0: padding, whose target is token 0), all float32 / int32 NumPy."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((BATCH, SEQ, EMBED)).astype(np.float32)
    weight = (0.4 * rng.standard_normal((VOCAB, EMBED) if tied else (EMBED, VOCAB))).astype(np.float32)
    targets = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    # the vocabulary's last and first columns, one in the last full block of width 128 or 300
    targets[1, :4] = VOCAB - 1, VOCAB - 2, 0, 880
    g = rng.standard_normal((BATCH, SEQ)).astype(np.float32)
    g[0, -3:], targets[0, -3:] = 0.0, 0
    return hidden, weight, targets, g


def _reference(hidden, weight, targets, g, tied: bool, temperature: float):
    """float64: log p of the targets, entropies, and d(Σ g·log p)/d hidden, d weight (closed form:
    d/dz = g·(onehot − softmax)/T)."""
    h, w = hidden.astype(np.float64), weight.astype(np.float64)
    w_ev = w.T if tied else w  # [embed, vocab]
    z = h @ w_ev / temperature
    z = z - z.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    logp = np.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    entropy = -(p * logp_all).sum(-1)
    onehot = np.eye(VOCAB)[targets]
    dz = g[..., None] * (onehot - p) / temperature
    dh = dz @ w_ev.T
    dw_ev = np.einsum("bse,bsv->ev", h, dz)
    return logp, entropy, dh, dw_ev.T if tied else dw_ev


def _values_and_grads(hidden, weight, targets, g, **kw):
    """One jit: logp [batch, seq], entropy [batch, seq], and the vjp of logp with g (d hidden, d weight)."""
    def run(h, w):
        logp, vjp = jax.vjp(lambda h, w: chunked_token_logprobs(h, w, targets, **kw), h, w)
        _, entropy = chunked_token_logprobs(h, w, targets, return_entropy=True, **kw)
        return logp, entropy, *vjp(jnp.asarray(g))

    return [np.asarray(x) for x in jax.jit(run)(jnp.asarray(hidden), jnp.asarray(weight))]


def _assert_close(got, want, what, rtol=1e-5):
    scale = float(np.max(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_both_kernels_equal_the_float64_reference_and_each_other(tied):
    """Values, entropies and both gradients at float32 round-off, for block widths that do not divide the
    vocabulary (128 and 300: a narrower last block; one wider than the vocabulary), one or several token
    chunks (a padded last one: 11 positions in chunks of 4), temperatures 1, 0.7 and 1.6."""
    hidden, weight, targets, g = _case(tied, seed=int(tied))
    settings = ((1.0, 12, 128), (0.7, 3, 300), (1.6, 64, 4096))  # temperature, chunk_tokens, vocab_chunk
    for temperature, chunk_tokens, vocab_chunk in settings:
        want = _reference(hidden, weight, targets, g, tied, temperature)
        kw = dict(tied=tied, temperature=temperature, chunk_tokens=chunk_tokens)
        new = _values_and_grads(hidden, weight, targets, g, impl="vocab_chunks", vocab_chunk=vocab_chunk,
                                **kw)
        old = _values_and_grads(hidden, weight, targets, g, impl="token_chunks", **kw)  # keeps the softmax
        redo = _values_and_grads(hidden, weight, targets, g, impl="token_chunks", keep_probs_bytes=0, **kw)
        whole = _values_and_grads(hidden, weight, targets, g, impl="token_chunks", lse_lanes=1, **kw)
        names = ("logp", "entropy", "d hidden", "d weight")
        for name, got_new, got_old, got_redo, got_whole, ref in zip(names, new, old, redo, whole, want):
            what = f"{name} at T={temperature}, chunk_tokens={chunk_tokens}, vocab_chunk={vocab_chunk}"
            assert got_new.shape == ref.shape and got_new.dtype == np.float32, what
            _assert_close(got_new, ref, what)
            _assert_close(got_old, ref, what + " (token_chunks)")
            _assert_close(got_redo, ref, what + " (token_chunks, softmax recomputed)")
            _assert_close(got_whole, ref, what + " (token_chunks, log-sum-exp over whole rows)")
            _assert_close(got_new, got_old, what + " (vocab_chunks vs token_chunks)")
        # the padding positions get no gradient, the others do
        assert np.all(new[2][0, -3:] == 0) and np.all(np.abs(new[2][1:]).max(-1) > 0)


@pytest.mark.parametrize("vocab", [151_936, 1000, 1001], ids=["lanes128", "lanes8", "whole_rows"])
def test_row_logsumexp_equals_the_float64_reference(vocab):
    """``row_logsumexp`` (the vocabulary as [vocab / lanes, lanes]; 151,936 = 128 · 1187, 1000 = 8 · 125,
    1001 odd: jax.nn.logsumexp) against float64 NumPy, on rows where a lane's max differs from the row's
    by far more than float32's exponent range (a row near -300 with -inf lanes, a row with -inf in
    half of it), and rows of all -inf (-inf, not NaN) or with one +inf (+inf)."""
    from respo_jax.models.qwen3.lm_head import row_logsumexp

    rng = np.random.default_rng(vocab)
    z = (5 * rng.standard_normal((4, vocab)) - 100).astype(np.float32)
    z[1, : vocab // 2] = -np.inf
    z[2] = -300 + rng.standard_normal(vocab)
    z[2, ::8] = -np.inf  # whole lanes of -inf where the lanes are 8 wide (or a divisor of 8)
    z64 = z.astype(np.float64)
    top = z64.max(-1, keepdims=True)
    want = np.log(np.exp(z64 - top).sum(-1)) + top[:, 0]
    _assert_close(np.asarray(row_logsumexp(jnp.asarray(z))), want, f"vocab {vocab}", rtol=1e-6)
    edge = np.full((2, vocab), -np.inf, np.float32)
    edge[1, 3] = np.inf
    assert np.asarray(row_logsumexp(jnp.asarray(edge))).tolist() == [-np.inf, np.inf]


def test_token_chunks_keeps_the_softmax_for_the_backward_only_when_it_fits():
    """The backward of ``token_chunks`` recomputes the logits (a third matmul besides d hidden and
    d weight) unless the forward's [tokens, vocab] float32 softmax fits in `keep_probs_bytes`: chunks of
    12 tokens hold 4 positions of each of the 3 rows, 11 positions padded to 3 chunks, so
    3·3·4·VOCAB·4 bytes is the bound."""
    hidden, weight, targets, g = _case(True, seed=2)
    need = 3 * BATCH * 4 * VOCAB * 4  # chunks of max(1, 12 // 3) = 4 positions: 3 chunks

    def dots(keep_probs_bytes: int) -> int:
        def grads(h, w):
            _, vjp = jax.vjp(lambda h, w: chunked_token_logprobs(
                h, w, targets, tied=True, chunk_tokens=12, impl="token_chunks",
                keep_probs_bytes=keep_probs_bytes), h, w)
            return vjp(jnp.asarray(g))
        return str(jax.make_jaxpr(grads)(jnp.asarray(hidden), jnp.asarray(weight))).count("dot_general")

    assert (dots(need), dots(need - 1), dots(0)) == (3, 4, 4)


def test_bfloat16_inputs_match_the_token_chunked_kernel():
    """bf16 hidden and weight (the training dtype): the same bf16 matmul inputs and the same bf16
    logits cotangent in both kernels; only float32 summation orders differ (before the final bf16
    rounding of the gradients)."""
    hidden, weight, targets, g = _case(True, seed=5)
    kw = dict(tied=True, temperature=0.8, chunk_tokens=12)
    args = (jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(weight, jnp.bfloat16), targets, g)
    new = _values_and_grads(*args, impl="vocab_chunks", vocab_chunk=128, **kw)
    old = _values_and_grads(*args, impl="token_chunks", **kw)
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), new, old):
        assert a.dtype == b.dtype and a.dtype == (np.float32 if name in ("logp", "entropy") else jnp.bfloat16)
        _assert_close(a.astype(np.float32), b.astype(np.float32), name, rtol=1e-2)


def _shapes_in_jaxpr(jaxpr) -> list[tuple[int, ...]]:
    """Every value's shape in a jaxpr and the jaxprs nested in it (loop bodies, custom-vjp rules)."""
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    out += _shapes_in_jaxpr(sub)
    return out


def _shapes_in_hlo(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"\b(?:f32|bf16|s32|pred|u32|f64)\[([0-9,]*)\]", text)]


def _oversized(shapes, weight_shape, block_rows: int, width: int) -> list[tuple[int, ...]]:
    """Shapes beyond one [block_rows, width] block of logits: anything with a vocabulary-sized axis
    other than the weight (and its gradient), or more than block_rows·width elements on a block-wide
    axis other than a block of the weight."""
    def too_big(s):
        if VOCAB in s:
            return tuple(s) != tuple(weight_shape)
        return width in s and int(np.prod(s)) > block_rows * width and sorted(s) != sorted((width, EMBED))

    return sorted({s for s in shapes if too_big(s)})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_no_tokens_by_vocab_array_in_the_forward_and_backward_program(tied):
    """The jaxpr and the compiled HLO of log-probs + gradient hold nothing with a vocabulary-sized axis
    but the weight and its gradient, and no block beyond [chunk tokens, vocab_chunk]; the same check
    finds the [chunk tokens, vocab] logits of the token-chunked kernel (so it can fail)."""
    hidden, weight, targets, g = _case(tied, seed=3)
    chunk_tokens, width = 12, 128  # 3 rows × 4 positions per token chunk

    def loss(impl):
        def f(h, w):
            logp = chunked_token_logprobs(h, w, targets, tied=tied, temperature=0.9,
                                          chunk_tokens=chunk_tokens, impl=impl, vocab_chunk=width)
            return jnp.sum(logp * g)
        return jax.grad(f, argnums=(0, 1))

    args = (jnp.asarray(hidden), jnp.asarray(weight))
    for impl in ("vocab_chunks", "token_chunks"):
        jaxpr = jax.make_jaxpr(loss(impl))(*args)
        hlo = jax.jit(loss(impl)).lower(*args).compile().as_text()
        for where, shapes in (("jaxpr", _shapes_in_jaxpr(jaxpr.jaxpr)), ("HLO", _shapes_in_hlo(hlo))):
            assert weight.shape in shapes, (impl, where)  # the parser sees the program's arrays
            found = _oversized(shapes, weight.shape, chunk_tokens, width)
            if impl == "vocab_chunks":
                assert not found, (where, found)
            else:
                logits = {(chunk_tokens, VOCAB), (BATCH, chunk_tokens // BATCH, VOCAB)}
                assert logits & set(found), (where, found)


def test_the_resolved_kernel_and_bad_arguments():
    """On CPU (where it measured faster) and with a split vocabulary the head is `token_chunks`, on an
    accelerator with the vocabulary whole `vocab_chunks`; an explicit choice is kept; a bad kernel name or
    block width is one ValueError naming it."""
    from respo_jax.models.qwen3.kernels import default_lm_head_impl

    assert [default_lm_head_impl(p, n) for p, n in (("cpu", 1), ("gpu", 1), ("tpu", 1), ("gpu", 2))] == [
        "token_chunks", "vocab_chunks", "vocab_chunks", "token_chunks"]
    cfg = qwen3.Qwen3Config.preset("tiny")
    assert cfg.lm_head_impl is None
    assert qwen3.resolve_config(cfg).lm_head_impl == "token_chunks"  # the tests run on CPU
    assert qwen3.resolve_config(cfg.replace(lm_head_impl="vocab_chunks")).lm_head_impl == "vocab_chunks"
    with pytest.raises(ValueError, match="lm_head_impl must be one of"):
        cfg.replace(lm_head_impl="fused")
    hidden, weight, targets, _ = _case(True, seed=0)
    bad_arguments = ((dict(impl="fused"), "impl must be one of"), (dict(vocab_chunk=0), "vocab_chunk must"),
                     (dict(vocab_chunk=2.5), "vocab_chunk must"), (dict(lse_lanes=0), "lse_lanes must"))
    for bad, match in bad_arguments:
        with pytest.raises(ValueError, match=match):
            chunked_token_logprobs(jnp.asarray(hidden), jnp.asarray(weight), targets, tied=True, **bad)


def test_the_forward_only_kernel_is_resolved_apart_and_gives_the_same_log_probs():
    """Passes without a gradient (log π_old, entropy) run `lm_head_forward_impl`: `vocab_chunks` with the
    vocabulary whole on every platform (CPU too), `token_chunks` with it split; a model's forward-only
    log-probs and entropies equal its differentiated kernel's to float32 round-off."""
    from respo_jax.models.qwen3.kernels import default_lm_head_forward_impl

    assert [default_lm_head_forward_impl(n) for n in (1, 2)] == ["vocab_chunks", "token_chunks"]
    cfg = qwen3.Qwen3Config.preset("tiny")
    resolved = qwen3.resolve_config(cfg)
    assert cfg.lm_head_forward_impl is None and resolved.lm_head_forward_impl == "vocab_chunks"
    assert resolved.lm_head_impl == "token_chunks"  # the differentiated head on CPU
    assert qwen3.resolve_config(cfg.replace(lm_head_forward_impl="token_chunks")).lm_head_forward_impl == \
        "token_chunks"
    with pytest.raises(ValueError, match="lm_head_forward_impl must be one of"):
        cfg.replace(lm_head_forward_impl="fused")
    model = qwen3.Qwen3ForCausalLM(cfg.replace(vocab_size=5000), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 5000, (3, 40)), jnp.int32)
    graphdef, params = nnx.split(model)
    run = jax.jit(qwen3.token_logprobs, static_argnames=qwen3.TOKEN_LOGPROBS_STATIC)
    want = run(graphdef, params, ids[:, :-1], ids[:, 1:], start=10, temperature=0.7, return_entropy=True)
    got = run(graphdef, params, ids[:, :-1], ids[:, 1:], start=10, temperature=0.7, return_entropy=True,
              forward_only=True, chunk_size=64)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    def lowered(**kwargs) -> str:
        return run.lower(graphdef, params, ids[:, :-1], ids[:, 1:], chunk_size=64, **kwargs).as_text()

    # Whole-vocabulary [tokens, 5000] logits in the differentiated kernel only: the blocked one ran.
    assert "x5000xf32>" in lowered() and "x5000xf32>" not in lowered(forward_only=True)


def test_the_side_by_side_benchmark_runs_at_a_tiny_size(tmp_path):
    """experiments.benchmarks.lm_head at a tiny size: both kernels timed, the same loss and gradients
    (their agreement is part of the report), a GFLOP/s figure per side; no timing is asserted."""
    argv = ["--tokens", "24", "--hidden", "16", "--vocab", "300", "--vocab-chunk", "64", "128",
            "--rounds", "1", "--warmup", "0", "--peak", "--out", str(tmp_path)]
    assert lm_head_bench.main(argv) == 0
    report = json.loads((tmp_path / "lm_head.json").read_text(encoding="utf-8"))
    assert "| vocab_chunks[64] |" in (tmp_path / "lm_head.md").read_text(encoding="utf-8")
    (case,) = report["cases"]
    assert case["hidden"] == 16
    assert set(case["sides"]) == {"token_chunks", "vocab_chunks[64]", "vocab_chunks[128]"}
    assert set(case["matmul_gflops"]) == {"64", "128"} and min(case["matmul_gflops"].values()) > 0
    for side in case["sides"].values():
        assert side["gflops"] > 0 and side["max_rel_diff_vs_token_chunks"] < 1e-4


def test_a_bfloat16_weight_is_not_copied_in_float32():
    """The compiled gradient of a bf16 head holds one float32 array of the weight's size (the gradient's
    accumulator), not also a float32 copy of the weight (what XLA:CPU makes of a bf16 dynamic-slice in a
    loop: the kernel slices the weight's bits instead)."""
    hidden, weight, targets, g = _case(True, seed=4)
    args = (jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(weight, jnp.bfloat16))

    def grad(h, w):
        return jax.grad(lambda h, w: jnp.sum(g * chunked_token_logprobs(
            h, w, targets, tied=True, chunk_tokens=12, vocab_chunk=128)), argnums=(0, 1))(h, w)

    temp = jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert weight.size * 4 <= temp < 1.5 * weight.size * 4, temp


@pytest.mark.parametrize("impl", ["vocab_chunks", "token_chunks"])
def test_a_diagnostic_entropy_leaves_the_log_probs_gradient_as_without_it(impl):
    """`return_entropy=True` without `entropy_gradient`: the same log-probs and the same gradient of them
    as without the entropy to round-off (the softmax kept or not), the entropy that of the float64
    reference."""
    hidden, weight, targets, g = _case(True, 3)
    kwargs = dict(tied=True, temperature=0.7, chunk_tokens=8, impl=impl, vocab_chunk=256)

    def loss(h, w, **extra):
        out = chunked_token_logprobs(h, w, targets, **kwargs, **extra)
        logp = out[0] if isinstance(out, tuple) else out
        return jnp.sum(logp * g), out

    for keep in (0, 1 << 30):
        (_, plain), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            hidden, weight, keep_probs_bytes=keep)
        (_, (logp, entropy)), grads_e = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            hidden, weight, keep_probs_bytes=keep, return_entropy=True)
        np.testing.assert_allclose(logp, plain, rtol=1e-6, atol=1e-6)
        for a, b in zip(grads_e, grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert np.abs(np.asarray(grads[1])).max() > 0
    logits = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64).T / 0.7
    logq = logits - logits.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    np.testing.assert_allclose(entropy, -(np.exp(logq) * logq).sum(-1), rtol=1e-5, atol=1e-5)
