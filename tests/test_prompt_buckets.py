"""Prompt buckets (`respo_jax.sampling.params.padded_prompt_length`): geometric buckets bound the number of
compiled programs for long-tailed prompt lengths, and padding never changes what the engines sample."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams, generate
from respo_jax.sampling.params import padded_prompt_length
from respo_jax.training.config import ConfigError, ExperimentConfig, apply_overrides


def test_padded_prompt_length_linear_and_geometric():
    assert [padded_prompt_length(n, 16, "linear") for n in (0, 1, 16, 17, 48, 49)] == [0, 16, 16, 32, 48, 64]
    assert [padded_prompt_length(n, 16) for n in (0, 1, 16, 17, 33, 64, 65, 977)] == [16, 16, 16, 32, 64, 64,
                                                                                    128, 1024]
    for n in range(1, 5000, 7):  # the smallest bucket · 2^k that holds n
        padded = padded_prompt_length(n, 128)
        power = padded // 128
        assert padded >= n and (padded == 128 or padded // 2 < n) and power & (power - 1) == 0
    # DAPO-Math's long tail at bucket 128 (27..977 tokens; its 17k prompts: 8 linear buckets, 4 geometric).
    lengths = [27, 96, 168, 335, 692, 977]
    assert len({padded_prompt_length(n, 128, "linear") for n in lengths}) == 5
    assert sorted({padded_prompt_length(n, 128) for n in lengths}) == [128, 256, 512, 1024]
    with pytest.raises(ValueError, match="scheme must be one of geometric, linear"):
        padded_prompt_length(5, 16, "pow2")
    with pytest.raises(ValueError, match="bucket >= 1"):
        padded_prompt_length(5, 0)


def test_the_field_is_validated_in_the_engine_and_at_start_up():
    with pytest.raises(ValueError, match="prompt_buckets must be one of geometric, linear"):
        EngineConfig(prompt_buckets="exponential")
    with pytest.raises(ConfigError, match=r"rollout.prompt_buckets='pow2': expected 'geometric' or 'linear'"):
        apply_overrides(ExperimentConfig(), ["rollout.prompt_buckets=pow2"]).validate()
    config = apply_overrides(ExperimentConfig(),
                             ["rollout.prompt_buckets=linear", "rollout.prompt_bucket=16"])
    assert config.rollout.engine_config().prompt_buckets == "linear"
    assert config.rollout.padded_prompt_length(40) == 48
    assert ExperimentConfig().rollout.padded_prompt_length(300) == 512  # the default: geometric over 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                  initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt")
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).save_pretrained(path)
    return qwen3.from_pretrained(path)


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_geometric_and_linear_buckets_sample_the_same_tokens(model, scheduler):
    # Longest prompt 37 tokens at bucket 8: padded to 40 (linear) or 64 (geometric). Left padding is
    # masked and positions are explicit, so the samples are the same and log-probs equal to round-off.
    prompts = [list(range(3, 40)), [5, 9, 17], [100, 4, 4, 4, 4, 4, 4, 4, 4, 11]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, num_samples=2, seed=7, eos_token_ids=(2,))
    engine = EngineConfig(scheduler=scheduler, prompt_bucket=8, max_slots=4, page_size=4,
                          steps_per_schedule=3)
    geometric = generate(model, prompts, params, engine=engine)
    linear = generate(model, prompts, params, engine=dataclasses.replace(engine, prompt_buckets="linear"))
    np.testing.assert_array_equal(np.asarray(geometric.tokens), np.asarray(linear.tokens))
    np.testing.assert_array_equal(np.asarray(geometric.lengths), np.asarray(linear.lengths))
    np.testing.assert_allclose(np.asarray(geometric.logprobs), np.asarray(linear.logprobs), atol=2e-5)
