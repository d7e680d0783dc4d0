"""The paper's shared training settings (§4.1, Tabs. 2-3) on DAPO-Math-17k, for the two model configs.

Not a runnable config itself (no get_config): `qwen3_1p7b_dapo.py` and `qwen3_30b_a3b_dapo.py` add what
differs per model. The objective's own registered settings apply: ReSPO, VESPO and GRPO aggregate with
token-mean (Tab. 2), GSPO with seq-mean-token-mean as verl's GSPO loss always does.
"""

from respo_jax.training.config import ExperimentConfig, derive


# The rollout engine (continuous batching over a paged KV cache, as the paper's vLLM rollouts). Pages of
# 64 tokens: a row wastes at most 63 slots of its last page (< 2% of a mean response of ~3.3k tokens at
# the 1.7B run's cap, Tab. 4) and a 16k-token row's page table has ~260 entries. The pool is a byte
# budget, since the responses' lengths, not rows x the cap, decide what is held: with the Tab. 4 length
# distribution a busy slot holds ~E[L^2] / (2 E[L]) ~ 5.5k tokens on average at the 15,360 cap (a slot
# is more often held by a long row), ~2.9k at 8,192. Each model file sets max_slots and the budget
# from its bfloat16 K/V bytes per token; when long rows take the pool, admission waits (never drops a
# row). A static batch of 256 rows x (prompt + cap) would hold ~450 GiB of K/V at 1.7B. Raise max_slots
# and kv_cache_bytes together on devices with more memory.
PAGE_SIZE = 64


def paper_dapo_config(
    max_new_tokens: int, out_dir: str, *, max_slots: int, kv_cache_bytes: int,
    task: dict | None = None,
) -> ExperimentConfig:
    """M = 32 prompts x G = 8 responses per mini-batch, N = 8 mini-batches per rollout batch (16 / 32 by
    override: rollout.reuse=16), 1,024 policy updates whatever N; AdamW lr 1e-6, weight decay 0.1, grad
    clip 1.0, warm-up over the first 5% of rollout batches (first batch at lr 0), no KL term; bfloat16
    compute on float32 parameters; the continuous rollout engine with `max_slots` decode slots and a
    `kv_cache_bytes` page pool. Paths are the user's: model.checkpoint_dir, task.data_dir,
    task.tokenizer_dir (a run without them stops at start-up naming them). `task`: further task fields of
    the model's run (DAPO's overlong penalty)."""
    return derive(
        ExperimentConfig(),  # G = 8, temperature 1 without truncation, ReSPO, no warm-up, Adam's betas
        model={"preset": "", "dtype": "bfloat16", "param_dtype": "float32", "remat": True},
        task={"name": "dapo_math", **(task or {})},  # with the chat template, prompts of <= 1,024 tokens
        rollout={"prompts_per_minibatch": 32, "reuse": 8, "max_new_tokens": max_new_tokens,
                 "max_slots": max_slots, "page_size": PAGE_SIZE, "kv_cache_bytes": kv_cache_bytes},
        optim={"learning_rate": 1e-6, "weight_decay": 0.1, "warmup_ratio": 0.05, "schedule_per": "rollout"},
        run={"policy_updates": 1024, "out_dir": out_dir, "eval_problems": 0, "checkpoint_every": 8},
    )
