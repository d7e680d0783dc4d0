"""The rollout engine with each paged-attention kernel, the Pallas ones in their interpreter on CPU
(`paged_attention_interpret`), and "ragged", against `gather` and the step-by-step reference sampler
(`decode_reference`: the model's full forward, no pages): a tiny model at head_dim 128, in float32 and
bfloat16. Where the
kernel is exact for the dtype (`paged_kernels.KERNEL_PRECISION`) the samples are the reference's and
the log-probs agree to the dtype's round-off; pallas_tpu in float32 attends at bfloat16 precision, so
its log-probs are farther from the reference than float32 round-off, within bfloat16's."""

from __future__ import annotations

import numpy as np
import pytest

from decode_reference import assert_same, reference_generate
from respo_jax.models import qwen3
from respo_jax.models.qwen3.paged_kernels import KERNEL_PRECISION
from respo_jax.sampling import EngineConfig, SamplingParams, generate

PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]  # the second spans two pages
NEW = 5
# one decode segment over every slot: one decode program per kernel
ENGINE = dict(max_slots=4, min_decode_slots=4, page_size=16, steps_per_schedule=NEW)
# the same keys for every kernel: sampled rows are the reference's wherever the kernel is exact
PARAMS = SamplingParams(max_new_tokens=NEW, temperature=0.8, num_samples=2, seed=11)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def case(request):
    """(dtype, model, reference rows, gather's output)."""
    # head_dim 128: what pallas_tpu lowers; initializer_range 0.3: well-separated logits, so a draw does
    # not hinge on round-off
    cfg = qwen3.Qwen3Config.preset("tiny", head_dim=128, num_hidden_layers=1, initializer_range=0.3,
                                   tie_word_embeddings=False, dtype=request.param)
    model = qwen3.init_model(cfg, 3)
    reference = reference_generate(model, PROMPTS, PARAMS)
    gather = generate(model, PROMPTS, PARAMS, engine=EngineConfig(**ENGINE, paged_attention_impl="gather"))
    return request.param, model, reference, gather


def test_ragged_samples_as_gather_and_the_reference(case):
    """"ragged" is exact in both dtypes: the reference's samples, and its log-probs
    to float32 round-off in float32; in bfloat16 within bfloat16's rounding (two steps of the largest
    log-prob): its online softmax rounds other bfloat16 intermediates than the reference's dense one
    (unnormalised weights before the values' dot, the output once), so it is not gather's to the bit."""
    dtype, model, reference, gather = case
    out = generate(model, PROMPTS, PARAMS, engine=EngineConfig(**ENGINE, paged_attention_impl="ragged"))
    assert dtype in KERNEL_PRECISION["ragged"]
    bf16_tol = 2 * 2.0 ** -7 * np.abs(reference.logprobs).max()
    for want in (reference, gather):
        assert_same(out, want, logprob_tol=2e-5 if dtype == "float32" else bf16_tol)


@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_the_pallas_kernels_in_the_interpreter_sample_as_gather_and_the_reference(case, impl):
    dtype, model, reference, gather = case
    engine = EngineConfig(**ENGINE, paged_attention_impl=impl, paged_attention_interpret=True)
    out = generate(model, PROMPTS, PARAMS, engine=engine)
    # gather: the reference's log-probs to float32 round-off in either dtype (the same bfloat16 K/V, read
    # through pages); a Pallas kernel exact for float32 too; otherwise bfloat16's rounding: two steps
    # (2^-7 relative) of the largest log-prob
    assert_same(gather, reference, logprob_tol=2e-5)
    exact = dtype in KERNEL_PRECISION[impl]
    bf16_tol = 2 * 2.0 ** -7 * np.abs(reference.logprobs).max()
    assert_same(out, reference, logprob_tol=2e-5 if exact and dtype == "float32" else bf16_tol)
    if dtype == "float32" and impl == "pallas_tpu":  # not exact: bfloat16 K and V inside the kernel
        gap = np.abs(np.asarray(out.logprobs) - np.asarray(gather.logprobs)).max()
        assert not exact and 1e-4 < gap < bf16_tol, gap
    else:
        assert exact
