"""The rollout sampler (paper Sec. 4.1): one engine over a paged KV cache, with exact sampling log-probs.

    from respo_jax.sampling import generate, SamplingParams
    out = generate(model, prompts, SamplingParams(max_new_tokens=256, temperature=1.0, top_p=0.7))
    out.tokens [batch, max_new_tokens], out.lengths [batch], out.logprobs [batch, max_new_tokens]

Modules: `generate` (the entry points), `params` (`SamplingParams`, `EngineConfig`), `engine` (the
`Engine` driver and its host loop), `scheduler` (which rows run), `paged_cache` (which pages hold them),
`model_step` (the jitted prefill, admission and decode programs: the model's forward + sampling),
`engine_state` (the device state and `GenerateOutput`), `logits_processing` (temperature, top-k, top-p
and their log-probs). Rows are scheduled continuously by default; `EngineConfig(scheduler="static")`
runs static batches of the same engine (the same samples for one seed).
"""

from respo_jax.sampling.engine import left_pad
from respo_jax.sampling.generate import GenerateOutput, compile_generate, generate
from respo_jax.sampling.logits_processing import sample, sampling_logprobs, truncate
from respo_jax.sampling.params import EngineConfig, SamplingParams

__all__ = [
    "EngineConfig", "GenerateOutput", "SamplingParams", "compile_generate", "generate", "left_pad", "sample",
    "sampling_logprobs", "truncate",
]
