"""Rollout generation: `generate` and `compile_generate`, the sampler's entry points over the one engine
(`respo_jax.sampling.engine.Engine`).

The rollouts feed the off-policy update of the paper (Sec. 4.1: G samples per prompt, reused for N
mini-batches), so besides tokens the sampler returns pi_old(o_t | q, o_<t): the log-prob of each
sampled token under the distribution it was drawn from (see `logits_processing`), and, for MoE
models, the routed experts of every generated token (for Routing Replay).

Schedules. `EngineConfig.scheduler` picks how the engine schedules rows, never what they sample:
"continuous" (the default) refills a finished row's slot between decode segments; "static" runs
batches of up to `max_slots` rows, each until its last row ends. Prompts are left-padded to a bucketed
length (pads are masked and never attended; a real token's position is its index within its own
prompt), K/V live in a paged pool, and every program runs the model's own forward.

Randomness. Row r (of the prompt-major, sample-expanded batch) at step t uses the key
`fold_in(fold_in(seed_key, id_r), t)` with `seed_key = fold_in(key(seed % 2**32), seed // 2**32)` and
`id_r` the row's id: `row_ids[r]` when the caller gives them, else its row index r. A row's draws
depend only on the seed, its id and its own context, not on the batch size, the schedule or the other
prompts; with ids of its own (the evaluation's (benchmark, problem, sample)) not on its position either.
The seed and the ids are traced arguments, so new ones do not recompile.

Output conventions. `tokens[r, t]` for t >= lengths[r] holds `SamplingParams.pad_token_id` (the first
EOS id, or 0 without EOS ids) and `logprobs[r, t]` holds 0 there; `lengths` counts the EOS token and
is at most the row's budget.
"""

from __future__ import annotations

from typing import Callable, Sequence

from respo_jax.sampling.engine import Engine, check_call
from respo_jax.sampling.engine_state import GenerateOutput
from respo_jax.sampling.params import EngineConfig, SamplingParams

__all__ = ["GenerateOutput", "compile_generate", "generate"]


def compile_generate(
    model,
    prompt_len: int,
    num_prompts: int,
    params: SamplingParams,
    *,
    return_routing: bool = False,
    engine: EngineConfig = EngineConfig(),
    compile: Callable | None = None,
) -> None:
    """Compile, without running, the programs `generate` runs for `num_prompts` prompts whose longest
    is `prompt_len` tokens (every prefill size, admission and decode width), so the later call finds
    them compiled.

    Why: a trainer knows the prompt buckets its data can need before its first rollout; compiling
    them then keeps compilation out of the run's later iterations (`RLTrainer.compile_ahead`).
    `compile(name, lowered) -> compiled` as in `Engine.compile`."""
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1 or num_prompts < 1:
        raise ValueError(f"need prompt_len >= 1 and num_prompts >= 1, got {prompt_len} and {num_prompts}")
    check_call(model, [[0] * prompt_len] * num_prompts, params, return_routing, None, None, engine)
    Engine(model, [prompt_len] * num_prompts, params, engine, return_routing).compile(compile)


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    return_routing: bool = False,
    engine: EngineConfig = EngineConfig(),
    row_ids: Sequence[int] | None = None,
    row_max_new_tokens: Sequence[int] | None = None,
) -> GenerateOutput:
    """Sample `params.num_samples` continuations of every prompt.

    Args:
      model: a `qwen3.Qwen3ForCausalLM` (its config carries the mesh and kernels it was built with).
      prompts: token-id lists of any (non-zero) lengths.
      params: sampling distribution and limits (static: a new value compiles once).
      return_routing: also return the routed experts of prompt and generated tokens (MoE only).
      engine: the schedule (`EngineConfig.scheduler`: "continuous" by default, or "static") and the
        memory layout: slots, pages, buckets, prefill chunks.
      row_ids: `[len(prompts) * num_samples]` ints in [0, 2**32), one per output row (prompt-major),
        that seed the rows' random draws instead of their row indices (the default): a row with the
        same id, prompt and params gets the same sample wherever it sits in the batch.
      row_max_new_tokens: `[len(prompts) * num_samples]` ints in [1, params.max_new_tokens], each
        row's own budget (vLLM's per-request max_tokens; None: max_new_tokens for every row). A row
        stops at its budget as at an EOS: pad tokens and log-prob 0 after it. A row's draws do not
        depend on its budget, so a shorter budget gives a prefix of the longer one's sample.
    The sampler runs under the model config's `mesh` and `rules` (`respo_jax.sharding`), as the
    trainer does: decode slots and output rows split over the `batch` axes (padded with filler to a
    multiple of those axes' size), the page pools by their kv heads and over the `batch` axes with the
    slots that use them, and the parameters stay where they are. In a run of several processes every
    process passes the same arguments; the outputs are global arrays split like the batch.
    Returns:
      GenerateOutput with rows in prompt-major order (`len(prompts) * num_samples` rows).
    """
    prompts, ids, budgets = check_call(model, prompts, params, return_routing, row_ids, row_max_new_tokens,
                                       engine)
    run = Engine(model, [len(p) for p in prompts], params, engine, return_routing)
    return run.run(prompts, ids, budgets)
