"""The rollout sampler: prefill + jitted decode loop with exact sampling log-probs (paper Sec. 4.1).

    from respo_jax.sampling import generate, SamplingParams
    out = generate(model, prompts, SamplingParams(max_new_tokens=256, temperature=1.0, top_p=0.7))
    out.tokens [batch, max_new_tokens], out.lengths [batch], out.logprobs [batch, max_new_tokens]

The engine is continuous batching over a paged KV cache by default; `engine=EngineConfig(scheduler=
"static")` decodes a static batch instead (the same samples for one seed).
"""

from respo_jax.sampling.generate import GenerateOutput, compile_generate, generate, left_pad
from respo_jax.sampling.logits_processing import sample, sampling_logprobs, truncate
from respo_jax.sampling.params import EngineConfig, SamplingParams

__all__ = [
    "EngineConfig", "GenerateOutput", "SamplingParams", "compile_generate", "generate", "left_pad", "sample",
    "sampling_logprobs", "truncate",
]
