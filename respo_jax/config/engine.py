"""The rollout engine's section of a config, declared once: `rollout.*` (training) and `eval.*` (evaluation)
both inherit it, so a knob is one field with one check whichever command sets it.

The fields are those of `respo_jax.sampling.EngineConfig` that a run chooses (their meaning is documented
there and in the comments below); the page-pool sizes take 0 for "unset" on the command line, `None` in
`EngineConfig`. A section subclass states where its defaults differ from the ones below, and this module
says why (`ROLLOUT_ENGINE_DEFAULTS`, `EVAL_ENGINE_DEFAULTS`).
"""

from __future__ import annotations

import dataclasses
import typing

from respo_jax.config.typed import ConfigError, _Section


@dataclasses.dataclass(frozen=True)
class EngineSection(_Section):
    """The engine fields shared by `rollout.*` and `eval.*` (meaning: `respo_jax.sampling.EngineConfig`).

    `scheduler`: "continuous" (the default: `max_slots` decode slots refilled as rows finish, K/V in a
    paged pool, one prefill per prompt) or "static" (batches of up to `max_slots` rows, each decoded until
    its longest row ends: a schedule of the same engine); for one seed both draw the same samples (up to
    float round-off ties). Continuous engine: `steps_per_schedule` decode steps between two scheduling
    decisions; `min_decode_slots`: a segment decodes the occupied slots padded to a halving of the slot
    count of at least this many (and, `decode_widths_per_octave` 2, the widths between the halvings), one
    program per width, so a batch's tail pays only for its live rows; `page_size` tokens per KV page; the
    pool as `num_pages` pages or a `kv_cache_bytes` budget (at most one; 0 for both: every slot can hold
    a row of the longest prompt and the longest response, so admission never waits);
    `paged_attention_impl`: "gather" or "ragged" (every platform) or the
    accelerator kernel "pallas_tpu" / "pallas_gpu" (refused at start-up on another platform, or where the
    model's head_dim or `page_size` do not lower), run on CPU in the Pallas interpreter with
    `paged_attention_interpret`.

    A subclass passes the defaults it changes as a class keyword, `class RolloutConfig(EngineSection,
    engine_defaults=ROLLOUT_ENGINE_DEFAULTS)`: the fields stay declared here, with their comments and
    checks, and only their defaults differ.
    """

    # the rollout engine: "continuous" (paged KV cache, slots refilled) or "static"
    scheduler: str = "continuous"
    # padded prompt lengths are buckets of this many tokens (one program set per bucket)
    prompt_bucket: int = 16
    # "geometric" buckets (prompt_bucket * 2^k) or "linear" (multiples of prompt_bucket)
    prompt_buckets: str = "geometric"
    max_slots: int = 64  # continuous engine: rows decoded together (a finished row's slot is refilled)
    steps_per_schedule: int = 32  # continuous engine: decode steps between two scheduling decisions
    # continuous engine: the fewest slots a decode segment runs (halvings of max_slots)
    min_decode_slots: int = 16
    # continuous engine: decode widths per halving of max_slots (1: the halvings; 2: also the ones between)
    decode_widths_per_octave: int = 2
    page_size: int = 16  # continuous engine: tokens per KV page
    num_pages: int = 0  # pages in the pool; 0: unset (kv_cache_bytes, or enough for every slot's longest row)
    kv_cache_bytes: int = 0  # the pool as a byte budget for K and V of all layers; 0: unset
    # attention over pages: "gather" (everywhere; every row pays the longest row), "ragged" (everywhere; a
    # decode step's cost follows each row's own length), "pallas_tpu" or "pallas_gpu" (their platform)
    paged_attention_impl: str = "gather"
    # run the Pallas kernel in the Pallas interpreter (TPU interpret mode / Triton interpret=True), which
    # runs on CPU: for tests, slow
    paged_attention_interpret: bool = False

    def __init_subclass__(cls, engine_defaults: typing.Mapping[str, typing.Any] | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        annotations = cls.__dict__.get("__annotations__")
        for name, value in (engine_defaults or {}).items():
            if name not in ENGINE_FIELDS:
                raise TypeError(f"{cls.__name__}: engine_defaults names {name!r}, not an engine field")
            if annotations is None:
                annotations = {}
                cls.__annotations__ = annotations
            # Redeclared with the new default: a dataclass keeps a redeclared field at its base position.
            annotations[name] = EngineSection.__annotations__[name]
            setattr(cls, name, value)

    def validate_engine(self) -> None:
        """The engine fields in range (ConfigError naming `section.field`): the one check of these fields,
        for `rollout.*` and `eval.*` alike."""
        from respo_jax.sampling.params import PROMPT_BUCKET_SCHEMES, SCHEDULERS

        self._need("scheduler", self.scheduler in SCHEDULERS, " or ".join(map(repr, SCHEDULERS)))
        self._need("prompt_buckets", self.prompt_buckets in PROMPT_BUCKET_SCHEMES,
                   " or ".join(map(repr, PROMPT_BUCKET_SCHEMES)))
        for name in ("prompt_bucket", "max_slots", "steps_per_schedule", "min_decode_slots",
                     "decode_widths_per_octave", "page_size"):
            self._need(name, getattr(self, name) >= 1, "an integer >= 1")
        for name in ("num_pages", "kv_cache_bytes"):
            self._need(name, getattr(self, name) >= 0, "an integer >= 0 (0: unset)")
        self._need("kv_cache_bytes", not (self.num_pages and self.kv_cache_bytes),
                   f"0 with {self.section}.num_pages={self.num_pages} (both size the page pool: set one)")
        self.check_kernel()

    def check_kernel(self, *, platform: str | None = None, head_dim: int | None = None) -> None:
        """The attention kernel against the engine's `platform` and the model's `head_dim` (None: not
        known yet), `respo_jax.models.qwen3.paged_kernels.check_paged_attention`: ConfigError naming
        `section.paged_attention_*`. Called by `validate_engine` and, with both, at a run's or an
        evaluation's start-up."""
        from respo_jax.models.qwen3.paged_kernels import check_paged_attention

        try:
            check_paged_attention(self.paged_attention_impl, interpret=self.paged_attention_interpret,
                                  platform=platform, head_dim=head_dim, page_size=self.page_size)
        except ValueError as err:
            raise ConfigError(f"{self.section}.{err}") from None

    def engine_config(self, **fields):
        """The sampler's `EngineConfig` of these fields (0 = unset -> None) and `fields`."""
        from respo_jax.sampling import EngineConfig  # local: the sampler imports the model, heavy to import

        engine = {name: getattr(self, name) for name in ENGINE_FIELDS}
        engine.update(num_pages=self.num_pages or None, kv_cache_bytes=self.kv_cache_bytes or None)
        return EngineConfig(**engine, **fields)


ENGINE_FIELDS = tuple(field.name for field in dataclasses.fields(EngineSection))

# Where training's rollouts and the evaluation need other defaults than the ones above, and why:
ROLLOUT_ENGINE_DEFAULTS = {
    # the default run's N·M·G = 256 rollout rows decode at once
    "max_slots": 256,
    # responses of up to 64 tokens whose rows fit the slots decode in one segment (one program and one host
    # sync per prompt bucket, no narrower tail program); a long response's finished row waits at most 64
    # steps for its slot's refill
    "steps_per_schedule": 64,
    # DAPO-Math's prompts (27-977 tokens, 76% within 128) fall in 3 geometric buckets, not the 4 of 128, and
    # each bucket is a set of sampler, log π_old and update programs; the update runs a mini-batch's prompt
    # once (`rollout.share_prompts`), so the wider padding of the short prompts costs little
    "prompt_bucket": 256,
}
EVAL_ENGINE_DEFAULTS = {
    # completions of up to 16,384 tokens: the default pool holds every slot's longest row, so 32 slots hold
    # the K/V of a 32-row batch at the cap
    "max_slots": 32,
    # pages of 64 tokens: a long row wastes at most 63 positions of its last page, and its page table stays
    # short (~260 entries at 16k tokens)
    "page_size": 64,
    # only the sampler compiles per prompt bucket (no update programs), so buckets half the rollout's cost
    # little and pad the short benchmark prompts less
    "prompt_bucket": 128,
}
