"""What to sample and how much: the frozen, validated parameters of one `generate` call.

`SamplingParams` describes the sampling *distribution* (temperature, top-k, top-p) and the rollout
shape (max new tokens, EOS ids, samples per prompt, seed).  `EngineConfig` describes how the engine
schedules the rows (continuously, or in static batches) and lays out memory; it changes speed and
memory, never the result.  Both are hashable, so they serve as static
arguments of the jitted sampler: one compilation per distinct value.
"""

from __future__ import annotations

import dataclasses
import math

from respo_jax.models.qwen3.paged_kernels import check_paged_attention


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Parameters of the sampling distribution and of the rollout.

    Attributes:
      max_new_tokens: number of tokens to generate per sequence at most (> 0).
      temperature: logits are divided by it; 0 means greedy (argmax, log-prob 0 since the sampled
        distribution is a point mass). Must be finite and >= 0.
      top_p: nucleus mass in (0, 1]; 1 disables nucleus truncation.
      top_k: keep the k largest logits; 0 disables top-k truncation.
      seed: PRNG seed; the same seed, prompts and params give the same samples.
      eos_token_ids: generation of a sequence stops after it samples any of these ids.
      num_samples: samples per prompt (the GRPO group size G); the output is prompt-major.
      ignore_eos: keep sampling after an EOS id until the row's budget (as vLLM's `ignore_eos`: a
        benchmark replays a length distribution with it); EOS ids still fill `pad_token_id`.
      return_entropy: also return each token's entropy of the sampling distribution
        (`GenerateOutput.entropy`), from the draw's own exponentials; more rows than
        `logits_processing.ENTROPY_ROWS` per step cost a chunked draw, so off by default.

    Truncations compose in the order temperature -> top-k -> top-p (as in HF `transformers` and
    vLLM): top-p is computed on the temperature-scaled, top-k-renormalized distribution.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    num_samples: int = 1
    ignore_eos: bool = False
    return_entropy: bool = False

    def __post_init__(self):
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        for name in ("ignore_eos", "return_entropy"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
        _check_int("top_k", self.top_k, 0)
        _check_int("num_samples", self.num_samples, 1)
        _check_int("seed", self.seed, 0)
        if self.seed >= 2**64:
            raise ValueError(f"seed must be < 2**64 (two uint32 words seed the PRNG key), got {self.seed}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a float, got {type(value).__name__} ({value!r})")
            object.__setattr__(self, name, float(value))
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        eos = self.eos_token_ids
        if isinstance(eos, int) and not isinstance(eos, bool):
            eos = (eos,)
        try:
            eos = tuple(eos)
        except TypeError:
            raise ValueError(
                f"eos_token_ids must be a sequence of ints, got {self.eos_token_ids!r}"
            ) from None
        for token in eos:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"eos_token_ids must hold non-negative ints, got {self.eos_token_ids!r}")
        object.__setattr__(self, "eos_token_ids", eos)

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def pad_token_id(self) -> int:
        """Id written after a sequence's EOS: the first EOS id, or 0 when there is no EOS id."""
        return self.eos_token_ids[0] if self.eos_token_ids else 0



# How the engine schedules rows (`EngineConfig.scheduler`).
SCHEDULERS = ("continuous", "static")
# How a prompt length is padded (`EngineConfig.prompt_buckets`, `padded_prompt_length`).
PROMPT_BUCKET_SCHEMES = ("geometric", "linear")


def padded_prompt_length(length: int, bucket: int, scheme: str = "geometric") -> int:
    """The padded length of a prompt batch whose longest prompt has `length` tokens.

    "linear": `length` rounded up to a multiple of `bucket`. "geometric": the smallest `bucket · 2^k`
    (k >= 0) that holds it (JetStream pads prefills to powers of two alike). Each padded length is its
    own set of compiled programs (sampler, log π_old, update), and prompt lengths are long-tailed:
    DAPO-Math's 17k training prompts (27-977 tokens) fall in 8 linear buckets of 128 but 4 geometric
    ones, whose programs compile in about half the time; padding is at most 2× the prompt (responses
    dominate an RL batch's tokens).
    """
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1 or length < 0:
        raise ValueError(f"need bucket >= 1 and length >= 0; got bucket={bucket!r}, length={length}")
    if scheme == "linear":
        return -(-length // bucket) * bucket
    if scheme != "geometric":
        raise ValueError(f"scheme must be one of {', '.join(PROMPT_BUCKET_SCHEMES)}; got {scheme!r}")
    padded = bucket
    while padded < length:
        padded *= 2
    return padded


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules rows and lays out memory (buckets limit recompilation; none of this
    changes the samples: for one seed every setting draws the same tokens, up to float round-off ties).

    Attributes:
      scheduler: "continuous" (the default): rows are admitted into `max_slots` decode slots as others
        finish; work and memory follow the tokens rows actually generate, which matters when lengths
        are long-tailed (RL rollouts). "static": the same engine in batches of up to `max_slots` rows,
        each decoded until its last row ends (every row its own slot, its pages held to its cap): the
        static-batch baseline. See `respo_jax.sampling.engine`.
      prompt_bucket: the padded prompt length is the longest prompt rounded up to a bucket of this many
        tokens (`prompt_buckets`).
      prompt_buckets: "geometric" (the default: `prompt_bucket · 2^k`, few programs for long-tailed
        prompt lengths) or "linear" (multiples of `prompt_bucket`); see `padded_prompt_length`.
      prefill_chunk_size: prefill the padded prompt in pieces of at most this many tokens (bounds the
        activation memory of long prompts), one piece per schedule, so running rows decode between the
        pieces of a long prompt; None prefills in one pass. Either way the vocabulary projection runs
        for the last prompt token only.
      max_slots: decode slots: rows decoded together; a finished row's slot is refilled (continuous).
      steps_per_schedule: decode steps of one jitted segment between two scheduling decisions
        (continuous; a static batch runs to its end in one segment).
      min_decode_slots: a segment decodes only the occupied slots, padded to the smallest of the slot
        count's halvings (down to this many slots; `scheduler.decode_widths`) that holds them, one
        program per width: the tail of a long-tailed batch, where most slots are free, does not pay
        for the free ones (each slot's step costs a row of the [slots, vocab] LM head). >= max_slots:
        every segment decodes every slot (one program).
      decode_widths_per_octave: the widths per halving of the slot count (`scheduler.decode_widths`):
        1, the halvings; 2 (the default), also the widths between them (64 slots, min 16: 16, 22, 32,
        45, 64), so the occupied slots are padded by at most 41% rather than 100%, for twice the
        programs. On Tab. 4's long-tailed lengths with 64 slots the slot-steps decoded fall by a tenth
        (512-token cap: 17,776 to 15,872 for 12,572 tokens; 2,048 with min 4: 67,004 to 59,180).
      page_size: tokens per page of the paged KV cache.
      num_pages: pages in the pool; None: from `kv_cache_bytes`, or else enough for every slot to
        hold a row of the longest prompt and `max_new_tokens` at once (admission never waits).
      kv_cache_bytes: pool size as a byte budget for K and V of all layers (exclusive with num_pages).
      paged_attention_impl: the kernel of attention over pages: "gather" (runs everywhere; a decode
        step reads every row's pages up to the segment's longest row), "ragged" (runs everywhere; a
        decode step reads each row's own pages, so its cost follows each row's length: cheaper where
        lengths are long-tailed, a little dearer where they are short and even), or an accelerator
        kernel "pallas_tpu" / "pallas_gpu", refused on any other platform
        (`respo_jax.models.qwen3.paged_kernels`: what each lowers, how exact it is).
      paged_attention_interpret: run the Pallas kernel in the Pallas interpreter, which runs on CPU.
    """

    scheduler: str = "continuous"
    prompt_bucket: int = 16
    prompt_buckets: str = "geometric"
    prefill_chunk_size: int | None = None
    max_slots: int = 64
    steps_per_schedule: int = 32
    min_decode_slots: int = 16
    decode_widths_per_octave: int = 2
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    paged_attention_impl: str = "gather"
    paged_attention_interpret: bool = False

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}; got {self.scheduler!r}")
        _check_int("prompt_bucket", self.prompt_bucket, 1)
        if self.prompt_buckets not in PROMPT_BUCKET_SCHEMES:
            raise ValueError(f"prompt_buckets must be one of {', '.join(PROMPT_BUCKET_SCHEMES)}; got "
                             f"{self.prompt_buckets!r}")
        if self.prefill_chunk_size is not None:
            _check_int("prefill_chunk_size", self.prefill_chunk_size, 1)
        _check_int("max_slots", self.max_slots, 1)
        _check_int("steps_per_schedule", self.steps_per_schedule, 1)
        _check_int("min_decode_slots", self.min_decode_slots, 1)
        _check_int("decode_widths_per_octave", self.decode_widths_per_octave, 1)
        _check_int("page_size", self.page_size, 1)
        if self.num_pages is not None:
            _check_int("num_pages", self.num_pages, 1)
        if self.kv_cache_bytes is not None:
            _check_int("kv_cache_bytes", self.kv_cache_bytes, 1)
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ValueError(f"set num_pages ({self.num_pages}) or kv_cache_bytes ({self.kv_cache_bytes}), "
                             "not both: both size the page pool")
        check_paged_attention(self.paged_attention_impl, interpret=self.paged_attention_interpret,
                              page_size=self.page_size)
