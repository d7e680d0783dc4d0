"""A training run's typed config: frozen dataclasses, validated at start-up, overridable by dotted keys.

A config file under `experiments/configs/` builds an `ExperimentConfig`; the command line overrides any
field with `section.field=value` (the value is parsed with the field's declared type), so every knob of
an experiment lives in one typed place and a typo fails before any compute is spent. The sections are
here; the parser, the loader and the section base are `typed`, the sections shared with the evaluation
`engine` (the rollout engine's fields) and `mesh`. `respo_jax.training.config` names them all too.
"""

from __future__ import annotations

import dataclasses
import os

from respo_jax.config.engine import ROLLOUT_ENGINE_DEFAULTS, EngineSection
from respo_jax.config.mesh import MeshSection
from respo_jax.config.typed import ConfigError, _one_line, _Section, validate_sections


# The most warm-up steps, iterations or policy updates a run may ask for: far beyond any run, and well
# inside the int32 step counters of the optimizer and its learning-rate schedule (optax counts in int32).
MAX_STEPS = 10**9
# Where log π_old comes from (`RolloutConfig.old_logprobs`).
OLD_LOGPROBS = ("auto", "sampler", "recompute")


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
    """Which Qwen3 to train: a preset name (`qwen3.Qwen3Config.preset`) plus field overrides, or a local HF dir.

    preset "" means "no random initialisation": `checkpoint_dir` must then be set (the paper configs).
    `dtype` is the compute dtype, `param_dtype` the parameters' storage dtype ("" = `dtype`); both apply
    to presets and checkpoints. The paper's runs keep float32 parameters with bfloat16 compute (FSDP
    mixed precision): bfloat16 parameters would round away AdamW updates of lr 1e-6.
    """

    section = "model"
    # a `qwen3.Qwen3Config.preset` name, randomly initialised; "" needs checkpoint_dir
    preset: str = "tiny"
    # Qwen3Config fields replacing the preset's (e.g. {"num_layers": 4}); presets only
    overrides: dict = dataclasses.field(default_factory=dict)
    checkpoint_dir: str = ""  # a Hugging Face-format directory; when set it wins over `preset`
    dtype: str = "float32"  # compute dtype: "float32" or "bfloat16"
    # parameter storage dtype ("" = dtype); the paper keeps float32 with bfloat16 compute
    param_dtype: str = ""
    remat: bool = False  # rematerialise each decoder layer in the backward pass (memory for compute)
    # Run the decoder layers as one lax.scan (compiles once per layer kind: large models, accelerators)
    # or unrolled (no per-layer slicing of stacked weights and activations: faster on CPU, see
    # docs/results/benchmarks.md; compile time grows with depth).
    scan_layers: bool = True

    def validate(self) -> None:
        from respo_jax.models import qwen3  # local: the model package is heavy to import

        self._check_types()
        self._need("dtype", self.dtype in ("float32", "bfloat16"), "'float32' or 'bfloat16'")
        self._need("param_dtype", self.param_dtype in ("", "float32", "bfloat16"),
                   "'', 'float32' or 'bfloat16' ('': model.dtype)")
        self._need("preset", bool(self.preset or self.checkpoint_dir),
                   "a preset name, or model.checkpoint_dir=<a Hugging Face Qwen3 checkpoint directory>")
        own = sorted(set(self.overrides) & {"dtype", "param_dtype", "remat", "scan_layers"})
        self._need("overrides", not own, f"no {own}: use the model.dtype / model.remat / model.scan_layers "
                   "fields instead")
        if self.checkpoint_dir:
            self._need("overrides", not self.overrides,
                       "{} with model.checkpoint_dir (the checkpoint's config.json defines the model)")
            return
        try:
            qwen3.Qwen3Config.preset(self.preset)
        except KeyError as err:
            raise ConfigError(f"model.preset={self.preset!r}: expected a known preset ({_one_line(err)})") \
                from None
        try:
            qwen3.Qwen3Config.preset(self.preset, **self.overrides)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.overrides={self.overrides!r}: {_one_line(err)}") from None

    def check_paths(self) -> None:
        """The checkpoint directory exists and its config.json parses (see `ExperimentConfig.check_paths`)."""
        from respo_jax.models import qwen3

        if not self.checkpoint_dir:
            return
        self._need("checkpoint_dir", os.path.isdir(self.checkpoint_dir),
                   "a Hugging Face checkpoint directory")
        try:
            qwen3.load_config(self.checkpoint_dir)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"model.checkpoint_dir={self.checkpoint_dir!r}: {_one_line(err)}") from None


@dataclasses.dataclass(frozen=True)
class TaskConfig(_Section):
    """The verifiable task and its reward.

    name: "synthetic" (arithmetic in `\\boxed{}`, in-process tokenizer: the CPU experiment) or "dapo_math"
      (the paper's training set, from `data_dir`, tokenized with the HF tokenizer in `tokenizer_dir`).
    The reward is `reward` (a name in `respo_jax.rewards.reward_names()`: the strict-box score ±1 of
    App. D.1 by default, `math_verify`, or one registered with `register_reward`) plus, when
    `overlong_buffer_length` > 0, DAPO's overlong penalty (0 up to max_new_tokens − buffer, linear to
    −`overlong_penalty_factor` at the limit).
    """

    section = "task"
    name: str = "synthetic"
    difficulty: str = "easy"  # synthetic only
    # synthetic only: ArithmeticTask fields replacing the difficulty level's (e.g. {"num_operands": 5})
    overrides: dict = dataclasses.field(default_factory=dict)
    num_records: int = 100_000  # synthetic only: size of the prompt pool the batches shuffle
    data_dir: str = ""  # dapo_math: data root, its dapo_math_17k/ folder or the parquet file
    tokenizer_dir: str = ""  # dapo_math: a directory with tokenizer.json
    # dapo_math: render prompts with the tokenizer's chat template, as the official preparation does (it
    # stores each prompt as a chat message, so verl templates even the Base model); the start-up fails
    # when the tokenizer has none. The synthetic task has its own raw format.
    chat_template: bool = True
    max_prompt_tokens: int = 1024  # prompts above this are dropped once, before batching (paper §4.1)
    # DAPO's overlong penalty: its buffer in tokens before max_new_tokens (0: off)
    overlong_buffer_length: int = 0
    # the overlong penalty at max_new_tokens (linear from 0 over the buffer)
    overlong_penalty_factor: float = 1.0
    seed: int = 0  # seed of the task's prompt pool and its shuffled order
    reward: str = "strict_box"  # the training reward by name (respo_jax.rewards.registry)

    def validate(self) -> None:
        from respo_jax.data.synthetic import DIFFICULTIES

        self._check_types()
        self._need("name", self.name in ("synthetic", "dapo_math"), "'synthetic' or 'dapo_math'")
        if self.name == "synthetic":
            self._need("difficulty", self.difficulty in DIFFICULTIES, f"one of {sorted(DIFFICULTIES)}")
            self.synthetic_task()
        else:
            self._need("overrides", not self.overrides, "{} with task.name='dapo_math' (synthetic only)")
            self._need("data_dir", bool(self.data_dir), "a data directory for task.name='dapo_math'")
            self._need("tokenizer_dir", bool(self.tokenizer_dir),
                       "a tokenizer directory for task.name='dapo_math'")
        self._need("num_records", self.num_records >= 1, "an integer >= 1")
        self._need("max_prompt_tokens", self.max_prompt_tokens >= 1, "an integer >= 1")
        self._need("overlong_buffer_length", self.overlong_buffer_length >= 0,
                   "an integer >= 0 (0: no overlong penalty)")
        self._need("overlong_penalty_factor", self.overlong_penalty_factor >= 0, "a number >= 0")
        self._need("seed", self.seed >= 0, "an integer >= 0")

    def synthetic_task(self):
        """The synthetic task: the difficulty level with `overrides` (ConfigError naming a bad one)."""
        from respo_jax.data.synthetic import get_task

        try:
            return get_task(self.difficulty, **self.overrides)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"task.overrides={self.overrides!r}: {_one_line(err)}") from None

    def check_paths(self) -> None:
        """The reward is registered in this process (a --config file may register it, so this is a
        start-up check, not validation: another process, e.g. an evaluation, reads the config without
        it); dapo_math: the data file and tokenizer.json exist (see `ExperimentConfig.check_paths`)."""
        from respo_jax.data.records import resolve_data_file
        from respo_jax.rewards.registry import reward_names

        self._need("reward", self.reward in reward_names(),
                   f"a registered reward, one of {reward_names()} (register_reward adds one)")
        if self.name != "dapo_math":
            return
        try:
            resolve_data_file("dapo_math", self.data_dir)
        except FileNotFoundError as err:
            raise ConfigError(f"task.data_dir={self.data_dir!r}: {_one_line(err)}") from None
        self._need("tokenizer_dir", os.path.isfile(os.path.join(self.tokenizer_dir, "tokenizer.json")),
                   "a directory with tokenizer.json")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(EngineSection, engine_defaults=ROLLOUT_ENGINE_DEFAULTS):
    """Rollout sizes of paper §4.1: a rollout batch of `reuse * prompts_per_minibatch` prompts, `group_size`
    responses each, split into `reuse` (= N) mini-batches, one policy update each.

    Shapes and memory (they change speed and memory, never the result):
    - `prompt_bucket`, `response_bucket`: padded prompt and response lengths are rounded up to
      buckets of these (responses at most `max_new_tokens`), in the sampler and in the update
      batches alike, so each program compiles once per bucket rather than once per batch.
      `prompt_buckets`: "geometric" (the default: prompt_bucket · 2^k, e.g. 256, 512, 1024) or
      "linear" (multiples of prompt_bucket), `respo_jax.sampling.params.padded_prompt_length`.
    - `max_tokens_per_microbatch`: a mini-batch (and the recomputation of log π_old) runs in
      micro-batches of whole responses of at most this many prompt + response tokens, whose gradients
      are accumulated exactly; memory then no longer grows with M·G. The default fits the CPU
      configuration of experiments/benchmarks/rl_iteration.py on a 24 GB host.
    - The engine's fields (`scheduler`, `prompt_bucket`, `prompt_buckets`, `max_slots`, `steps_per_schedule`,
      `min_decode_slots`, `decode_widths_per_octave`, `page_size`, `num_pages`, `kv_cache_bytes`,
      `paged_attention_impl`) are
      `respo_jax.config.engine.EngineSection`'s, declared once for `rollout.*` and `eval.*`; why the
      rollout's defaults differ from the library's: `ROLLOUT_ENGINE_DEFAULTS`. The held-out evaluation
      uses the same engine.
    - `compile_ahead`: at the start of the first iteration, compile the sampler, log π_old and update
      programs for every prompt bucket the training prompts can need (at the longest response
      bucket), so no later iteration stops to compile when a batch meets a new bucket
      (`RLTrainer.compile_ahead`). Costs start-up time for buckets a short run may never meet.
    - `max_prompt_buckets`: the most prompt buckets the training prompts may fall in (checked at
      start-up). Each bucket is its own set of sampler, log π_old and update programs, and every
      program XLA:CPU compiles keeps its code mapped in the process: a fine grid over long-tailed prompt
      lengths (DAPO-Math at `prompt_bucket=16`: 50 buckets, ~1,200 mappings each for a small model)
      exhausts the kernel's per-process limit (vm.max_map_count, 65,530) and the compiler crashes.

    Where log π_old comes from (`old_logprobs`, resolved once at start-up by `old_logprobs_source`):
    "recompute" runs a forward pass over each mini-batch under the rollout's parameters before the
    updates (verl's default: its vLLM sampler computes in other kernels and precisions), except the first
    mini-batch of a synchronous rollout, whose update's own forward is under those parameters and gives
    it (`training.step.old_logprobs_from_update`; TRL's on-policy path does the same); "sampler" takes
    the sampler's own log-probs of the tokens it drew, and the rollout entropy from the sampler too
    (verl's rollout-correction "bypass mode"): the same parameters, distribution and float32 math, so
    the same numbers to round-off, without the pass (N forward passes an iteration, N − 1 with
    synchronous rollouts, and their programs). It needs the sampled distribution to be the model's (no
    top-k/top-p truncation) and no rollout correction (which measures that very gap), and an attention kernel
    exact for the model's dtype (`paged_kernels.KERNEL_PRECISION`: not "pallas_tpu" in float32, which attends
    at bfloat16 precision).
    "auto" (the default) picks "sampler" when, besides, the model computes in float32 and a MoE model
    replays its routing (otherwise the sampler's and the trainer's experts may differ at router ties),
    and "recompute" otherwise.
    """

    section = "rollout"
    retired = {"sampler_max_rows": "the rollout engine decodes at most rollout.max_slots rows at once "
                                   "(rollout.scheduler=static: batches of rollout.max_slots rows)"}
    prompts_per_minibatch: int = 8  # M
    group_size: int = 8  # G
    reuse: int = 4  # N, the rollout-reuse ratio
    max_new_tokens: int = 8  # the longest response, in tokens (the rollout's cap)
    temperature: float = 1.0  # the trainer's log-probs use the same temperature (verl divides the logits)
    top_p: float = 1.0  # nucleus truncation of the sampled distribution (1: none)
    top_k: int = 0  # top-k truncation of the sampled distribution (0: none)
    # How the rollout batch is split into the N mini-batches: "consecutive" (the paper: prompt-major
    # order, mini-batch k = prompts [kM, (k+1)M)) or "balanced" (verl's trainer.balance_batch: responses
    # reordered by sequence-length workload over `balance_ranks` data-parallel ranks first).
    minibatch_order: str = "consecutive"
    balance_ranks: int = 1  # data-parallel ranks of the "balanced" mini-batch order
    # The update runs each mini-batch prompt once for its G responses (PolicyBatch.prompt_group): the
    # same log-probs and gradients without G - 1 copies of the prompt's forward and backward. It applies
    # where a mini-batch's rows are prompt-major groups on one batch shard: "consecutive" order, a dense
    # model without Routing Replay (a MoE's load-balancing loss counts every row's prompt), one device
    # on the mesh's batch axes; elsewhere every row runs its own prompt.
    share_prompts: bool = True
    response_bucket: int = 64  # padded response lengths are multiples of this (at most max_new_tokens)
    # prompt + response tokens per micro-batch; gradients accumulated exactly
    max_tokens_per_microbatch: int = 16384
    compile_ahead: bool = True  # compile every prompt bucket's programs before the first rollout
    # Routing Replay (R3, MoE only): the sampler records the experts it routed every token to, and the
    # recomputation of log π_old and every policy forward reuse them (gate weights still come from the
    # current router, which keeps its gradient), so sampler and trainer run the same experts.
    routing_replay: bool = False
    # the most prompt buckets the training prompts may fall in (checked at start-up)
    max_prompt_buckets: int = 16
    # DAPO dynamic sampling (verl's algorithm.filter_groups): drop the groups whose G responses all get
    # the same raw accuracy (reward > 0, before the overlong penalty) and draw the next prompt batches
    # until N·M informative groups are kept (extras dropped) or `max_generation_batches` were generated;
    # then train on the groups kept (`RLTrainer.iteration`).
    filter_groups: bool = False
    max_generation_batches: int = 10  # dynamic sampling: prompt batches drawn per iteration, at most
    old_logprobs: str = "auto"  # "auto", "sampler" or "recompute" (above)
    # Asynchronous rollouts (`respo_jax.training.async_rollouts`): the batch of iteration t is generated
    # by the policy after iteration t - 1 - async_steps (the initial one before that), its generation
    # overlapping the updates of the iterations between; 0 (the default): the synchronous loop.
    async_steps: int = 0

    def validate(self) -> None:
        from respo_jax.sampling import SamplingParams

        self._check_types()
        for name in ("prompts_per_minibatch", "reuse", "max_new_tokens", "balance_ranks", "response_bucket",
                     "max_tokens_per_microbatch", "max_prompt_buckets",
                     "max_generation_batches"):
            self._need(name, getattr(self, name) >= 1, "an integer >= 1")
        self._need("async_steps", self.async_steps >= 0, "an integer >= 0 (0: synchronous)")
        self.validate_engine()
        self._need("minibatch_order", self.minibatch_order in ("consecutive", "balanced"),
                   "'consecutive' or 'balanced'")
        responses = self.prompts_per_minibatch * self.group_size
        self._need("balance_ranks", responses % self.balance_ranks == 0,
                   f"a divisor of a mini-batch's {responses} responses")
        self._need("group_size", self.group_size >= 2,
                   "an integer >= 2 (a group of one response always gets advantage 0)")
        self._need("temperature", self.temperature > 0,
                   "a number > 0 (training rollouts sample; greedy decoding has no log-probs)")
        self._need("top_p", 0 < self.top_p <= 1, "a number in (0, 1] (1: no nucleus truncation)")
        self._need("top_k", self.top_k >= 0, "an integer >= 0 (0: no top-k truncation)")
        self._need("old_logprobs", self.old_logprobs in OLD_LOGPROBS, f"one of {', '.join(OLD_LOGPROBS)}")
        self._need("old_logprobs", self.old_logprobs != "sampler" or self.samples_model_distribution,
                   "'auto' or 'recompute' with rollout.top_k or rollout.top_p set: the sampler's log-probs "
                   "are then of the truncated distribution, not of the policy")
        self._need("filter_groups", not (self.filter_groups and self.routing_replay),
                   "false with rollout.routing_replay=true (dynamic sampling does not keep the routing of "
                   "the groups it collects)")
        try:  # the sampler's own checks, so a rollout never fails after warm-up
            SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                           top_k=self.top_k, num_samples=self.group_size)
        except ValueError as err:
            raise ConfigError(f"rollout: {_one_line(err)}") from None

    @property
    def samples_model_distribution(self) -> bool:
        """Whether the rollout samples the model's own (temperature-scaled) distribution: no truncation."""
        return self.top_k == 0 and self.top_p == 1.0

    def old_logprobs_source(self, *, dtype: str, moe: bool, correction: bool) -> str:
        """`old_logprobs` resolved for a model computing in `dtype`, MoE or not, with rollout correction
        on or off: "sampler" or "recompute" (the class docstring says when and why)."""
        if self.old_logprobs != "auto":
            return self.old_logprobs
        exact = (self.samples_model_distribution and dtype == "float32" and self.kernel_exact(dtype)
                 and (self.routing_replay or not moe))
        return "sampler" if exact and not correction else "recompute"

    def kernel_exact(self, dtype: str) -> bool:
        """Whether the engine's attention kernel computes at `dtype`'s own precision
        (`respo_jax.models.qwen3.paged_kernels.KERNEL_PRECISION`)."""
        from respo_jax.models.qwen3.paged_kernels import kernel_exact

        return kernel_exact(self.paged_attention_impl, dtype)

    def padded_prompt_length(self, length: int) -> int:
        """The padded length of a batch whose longest prompt has `length` tokens (`prompt_bucket`,
        `prompt_buckets`): the sampler's and the update batches' prompt axis."""
        from respo_jax.sampling.params import padded_prompt_length

        return padded_prompt_length(length, self.prompt_bucket, self.prompt_buckets)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig(_Section):
    """The policy objective by registry name, its hyperparameters and the loss aggregation mode."""

    section = "objective"
    name: str = "respo"  # the policy objective by registry name (respo_jax.objectives.OBJECTIVES)
    # the objective's hyperparameters over its registry defaults (e.g. {"eps_high": 0.28})
    hparams: dict = dataclasses.field(default_factory=dict)
    # MoE only: weight of the router load-balancing loss (Switch Transformer, transformers' normalisation)
    # added to the policy loss; 0 = not added (its value is still logged for MoE models). Qwen3-MoE
    # checkpoints' config.json say router_aux_loss_coef=0.001 for pre-training.
    load_balancing_weight: float = 0.0
    # Rollout correction between the sampler's log-probs and log π_old ({}: off), e.g.
    # {"level": "token", "mode": "truncate", "threshold": 2.0}: `respo_jax.objectives.RolloutCorrection`.
    rollout_correction: dict = dataclasses.field(default_factory=dict)
    # Weight of the KL to the reference policy in the loss (verl's kl_loss_coef, TRL's beta), >= 0; with
    # kl_in_reward, the initial weight of the KL penalty in the reward (verl's kl_ctrl.kl_coef). 0 (the
    # default): no reference policy is held or run.
    kl_coef: float = 0.0
    # The per-token KL estimator, verl's names: "k1" (log-ratio), "k2" (half its square), "k3" (the
    # low-variance e^x - x - 1, clamped to ±10, verl's low_var_kl) or "abs"; a trailing "+" keeps the
    # value and takes the gradient of k2 (straight-through). k3: verl's and TRL's default.
    kl_estimator: str = "k3"
    # Put the KL in the reward instead of the loss (verl's use_kl_in_reward): each response's score loses
    # kl_coef · Σ_t kl(π_old, π_ref) before the group advantages. Off by default, as in verl.
    kl_in_reward: bool = False
    # kl_in_reward only: verl's adaptive KL controller's target mean KL per response (> 0); 0 (the
    # default): the coefficient stays kl_coef (fixed controller). Set together with kl_horizon.
    kl_target: float = 0.0
    # kl_in_reward only: the adaptive controller's horizon in responses (> 0); 0 with kl_target 0.
    kl_horizon: float = 0.0
    # The reference policy: "" (the default) the parameters RL starts from (after any warm-up); else a
    # respo-jax checkpoint folder (a run's checkpoints/, its latest step) read onto the model's shapes.
    reference_checkpoint: str = ""
    # Compute and log kl_ref with kl_coef = 0 too (the control run of a KL comparison); costs the
    # reference's memory and one forward per mini-batch. Off by default.
    log_kl_ref: bool = False
    # Weight of the entropy bonus (verl's entropy_coeff), >= 0: the loss loses entropy_coef · agg(H), H the
    # token entropy of the policy's distribution, aggregated like the objective. 0 (the default): no
    # entropy is computed in the update.
    entropy_coef: float = 0.0
    # An off-policy mask on the objective's token loss ({}: off): {"kind": "deepseek_v32", "delta": δ},
    # {"kind": "geometric", "low": 0.99, "high": 1.01} or {"kind": "m2po", "threshold": 0.04}:
    # `respo_jax.objectives.OffPolicyMask`.
    off_policy_mask: dict = dataclasses.field(default_factory=dict)
    # AReaL's decoupled objective: the objective's ratio is taken against π_prox, the policy at the start
    # of the iteration's updates (recomputed), and each token's loss is weighted by π_prox / π_behaviour
    # (the policy that generated it). False (the default): the ratio is against the behaviour policy.
    decoupled: bool = False

    def validate(self) -> None:
        from respo_jax.objectives import OBJECTIVES, get_objective
        from respo_jax.objectives.regularizers import check_kl_estimator

        self._check_types()
        self._need("load_balancing_weight", self.load_balancing_weight >= 0, "a finite number >= 0")
        self._need("name", self.name in OBJECTIVES, f"one of {sorted(OBJECTIVES)}")
        try:  # the registry checks names and ranges of the hyperparameters
            get_objective(self.name, **self.hparams)
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"objective.hparams={self.hparams!r}: {_one_line(err)}") from None
        self.correction()
        self._need("kl_coef", self.kl_coef >= 0, "a finite number >= 0")
        self._need("entropy_coef", self.entropy_coef >= 0, "a finite number >= 0")
        try:
            check_kl_estimator(self.kl_estimator)
        except ValueError as err:
            raise ConfigError(f"objective.kl_estimator={self.kl_estimator!r}: {_one_line(err)}") from None
        self._need("kl_in_reward", not self.kl_in_reward or self.kl_coef > 0,
                   "false with objective.kl_coef=0 (a penalty of weight 0)")
        self._need("kl_target", self.kl_target >= 0, "a finite number >= 0")
        self._need("kl_horizon", self.kl_horizon >= 0, "a finite number >= 0")
        self._need("kl_target", not self.kl_target or self.kl_in_reward,
                   "0 without objective.kl_in_reward=true (the adaptive controller sets the reward's "
                   "KL weight)")
        self._need("kl_horizon", bool(self.kl_target) == bool(self.kl_horizon),
                   "> 0 exactly when objective.kl_target > 0 (the adaptive controller needs both)")
        self._need("reference_checkpoint", not self.reference_checkpoint or self.uses_reference,
                   "'' with objective.kl_coef=0 and objective.log_kl_ref=false (no reference is used)")
        self._need("reference_checkpoint", not self.reference_checkpoint
                   or os.path.isdir(self.reference_checkpoint), "an existing checkpoint folder")
        self._need("log_kl_ref", not (self.log_kl_ref and self.kl_coef > 0),
                   "false with objective.kl_coef > 0 (kl_ref is logged anyway)")
        self.regularizers()

    @property
    def uses_reference(self) -> bool:
        """Whether the run holds a reference policy and computes its log-probs."""
        return self.kl_coef > 0 or self.log_kl_ref

    def regularizers(self):
        """The typed `Regularizers` of the update step (the KL term only when it is in the loss);
        ConfigError naming the key for a bad mask."""
        from respo_jax.objectives.off_policy_masks import OffPolicyMask
        from respo_jax.objectives.regularizers import Regularizers

        try:
            mask = OffPolicyMask.from_dict(self.off_policy_mask)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"objective.off_policy_mask={self.off_policy_mask!r}: {_one_line(err)}") \
                from None
        return Regularizers(kl_coef=0.0 if self.kl_in_reward else float(self.kl_coef),
                            kl_estimator=self.kl_estimator, entropy_coef=float(self.entropy_coef), mask=mask)

    def correction(self):
        """The typed `RolloutCorrection` (None: off); ConfigError naming the key for a bad one."""
        from respo_jax.objectives import RolloutCorrection

        try:
            return RolloutCorrection.from_dict(self.rollout_correction)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"objective.rollout_correction={self.rollout_correction!r}: {_one_line(err)}") \
                from None


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Section):
    """AdamW with global-norm clipping and a linear warm-up of the learning rate, then constant.

    schedule_per: the schedule's step — "update" (each policy update) or "rollout" (each rollout batch,
      as verl steps its scheduler once per `update_actor`: all N updates of rollout batch k run at
      lr * min(1, k / W), so the first batch runs at lr 0 while Adam's moments still accumulate).
    warmup_steps W in that unit, or warmup_ratio: W = int(warmup_ratio * total steps) (verl's
      lr_warmup_steps_ratio); at most one of the two.
    """

    section = "optim"
    learning_rate: float = 1e-3  # AdamW's peak learning rate
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.999  # AdamW's second-moment decay
    max_grad_norm: float = 1.0  # gradients are clipped to this global norm
    warmup_steps: int = 0  # linear learning-rate warm-up length W in schedule_per units (0: none)
    warmup_ratio: float = 0.0  # W = int(warmup_ratio * total steps) instead (verl's lr_warmup_steps_ratio)
    schedule_per: str = "update"

    def validate(self) -> None:
        self._check_types()
        self._need("learning_rate", self.learning_rate > 0, "a finite number > 0")
        self._need("weight_decay", self.weight_decay >= 0, "a finite number >= 0")
        self._need("b1", 0 <= self.b1 < 1, "a number in [0, 1)")
        self._need("b2", 0 <= self.b2 < 1, "a number in [0, 1)")
        self._need("max_grad_norm", self.max_grad_norm > 0, "a finite number > 0")
        self._need("warmup_steps", self.warmup_steps >= 0, "an integer >= 0")
        self._need("warmup_ratio", 0 <= self.warmup_ratio < 1, "a number in [0, 1)")
        self._need("warmup_ratio", not (self.warmup_steps and self.warmup_ratio),
                   "0 with optim.warmup_steps > 0 (set one of the two, not both)")
        self._need("schedule_per", self.schedule_per in ("update", "rollout"), "'update' or 'rollout'")


@dataclasses.dataclass(frozen=True)
class WarmupConfig(_Section):
    """Supervised warm-up that turns a random init into a weak "base model" with non-zero reward,
    so that RL has a signal (the paper starts from a pretrained base model)."""

    section = "warmup"
    steps: int = 0  # supervised warm-up steps before RL (0: none; synthetic task only)
    batch_size: int = 64  # reference responses per warm-up step
    learning_rate: float = 3e-3  # the warm-up's Adam learning rate
    # The warm-up's problems have at least this many operands (0: the synthetic task's smallest count);
    # with max_operands, a range inside the task's, so RL and the held-out problems may reach beyond it.
    min_operands: int = 0
    # The warm-up's problems have at most this many operands (0: the synthetic task's largest count)
    max_operands: int = 0

    def validate(self) -> None:
        self._check_types()
        self._need("steps", 0 <= self.steps <= MAX_STEPS, f"an integer in [0, {MAX_STEPS:_}] (0: no warm-up)")
        self._need("batch_size", self.batch_size >= 1, "an integer >= 1")
        self._need("learning_rate", self.learning_rate > 0, "a finite number > 0")
        for name in ("min_operands", "max_operands"):
            self._need(name, getattr(self, name) == 0 or getattr(self, name) >= 2,
                       "0 (the task's bound) or an integer >= 2")

    def operand_range(self, task) -> tuple[int, int]:
        """The operand counts (smallest, largest; bounds included) of the warm-up's problems on the
        synthetic `task` (an ArithmeticTask): `min_operands` / `max_operands`, 0 standing for the task's."""
        low, high = task.operand_counts
        return self.min_operands or low, self.max_operands or high


# Where metric rows go (`run.loggers`, `respo_jax.training.trackers`): metrics.jsonl always, plus those named.
TRACKERS = ("jsonl", "tensorboard", "wandb")


def parse_loggers(value: str) -> tuple[str, ...] | None:
    """The trackers named in `value` ("jsonl,tensorboard"), jsonl first and always; None if a name is
    unknown."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if any(name not in TRACKERS for name in names):
        return None
    return tuple(dict.fromkeys(["jsonl", *names]))


@dataclasses.dataclass(frozen=True)
class RunConfig(_Section):
    """Run length, seed and where results go."""

    section = "run"
    iterations: int = 40  # rollout batches
    # When > 0, the run length in policy updates instead (the paper fixes 1,024 for every N): the run
    # has policy_updates / rollout.reuse iterations, and `iterations` is not read.
    policy_updates: int = 0
    seed: int = 0  # the RL seed (sampling, shuffles); the model's init follows it too
    # the run directory (config, metrics, checkpoints, rollouts, curves)
    out_dir: str = "runs/respo_synthetic"
    checkpoint_every: int = 0  # 0: only at the end
    # Also checkpoint at the first iteration boundary this many minutes after the last checkpoint (0:
    # never), which bounds what a hard kill (kill -9, a lost host) can cost; SIGTERM and SIGINT checkpoint
    # anyway (respo_jax.training.preemption). 30: a checkpoint of a billion-parameter model takes seconds,
    # and half an hour is what a preemptible slice loses at most.
    checkpoint_every_minutes: float = 30.0
    resume: bool = False  # continue the run in out_dir from its latest intact checkpoint (see run_dir)
    overwrite: bool = False  # delete the run in out_dir first (its config, metrics, checkpoints, ...)
    eval_problems: int = 128  # held-out problems for the greedy accuracy before and after (0: none)
    progress: bool = True  # show a progress bar on stderr
    # Keep XLA's host buffers mapped between steps (respo_jax.host_allocator); applied at start-up.
    host_allocator: bool = True
    # Where every metric row goes: "jsonl" (metrics.jsonl, always on) plus "tensorboard" and/or "wandb",
    # comma-separated (respo_jax.training.trackers; pip install -e ".[tracking]").
    loggers: str = "jsonl"
    # The persistent XLA compilation cache (respo_jax.training.compilation.resolve_cache_dir): "" is
    # $JAX_COMPILATION_CACHE_DIR or ~/.cache/respo_jax/jax_compilation_cache, "none" turns it off.
    compilation_cache_dir: str = ""
    # With a compilation cache, on one device in one process: keep the traced programs there too
    # (respo_jax.exported_programs), so a relaunch neither traces nor lowers them; false: the cache only.
    export_programs: bool = True
    # Sampled pass@1 beside the greedy accuracy (respo_jax.training.held_out): samples per held-out
    # problem (0: greedy only), at this temperature and top-p (the paper: 1 and 0.7).
    eval_samples: int = 0
    eval_temperature: float = 1.0  # sampled held-out pass@1: the temperature
    eval_top_p: float = 0.7  # sampled held-out pass@1: the top-p

    def validate(self) -> None:
        self._check_types()
        self._need("iterations", 1 <= self.iterations <= MAX_STEPS, f"an integer in [1, {MAX_STEPS:_}]")
        self._need("eval_samples", 0 <= self.eval_samples <= 1024, "an integer in [0, 1024] (0: greedy only)")
        self._need("eval_temperature", self.eval_temperature > 0.0, "a finite number > 0")
        self._need("eval_top_p", 0.0 < self.eval_top_p <= 1.0, "a number in (0, 1]")
        self._need("policy_updates", 0 <= self.policy_updates <= MAX_STEPS,
                   f"an integer in [0, {MAX_STEPS:_}] (0: run.iterations decides)")
        self._need("seed", 0 <= self.seed < 2**32, "an integer in [0, 2**32)")
        self._need("out_dir", bool(self.out_dir.strip()), "a directory path")
        self._need("checkpoint_every", self.checkpoint_every >= 0, "an integer >= 0 (0: only at the end)")
        self._need("checkpoint_every_minutes", self.checkpoint_every_minutes >= 0,
                   "a number of minutes >= 0 (0: no time-based checkpoints)")
        self._need("eval_problems", self.eval_problems >= 0, "an integer >= 0 (0: no eval)")
        self._need("overwrite", not (self.resume and self.overwrite),
                   "false with run.resume=true (continue the run, or replace it: not both)")
        self._need("loggers", parse_loggers(self.loggers) is not None,
                   f"comma-separated names among {list(TRACKERS)} (jsonl is always on)")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optim: OptimConfig = OptimConfig()
    warmup: WarmupConfig = WarmupConfig()
    run: RunConfig = RunConfig()
    mesh: MeshSection = MeshSection()

    def validate(self) -> "ExperimentConfig":
        """Checks every field and the relations between them; raises `ConfigError` (one line) or returns
        self."""
        missing = self.missing_paths()
        if missing:
            raise ConfigError("this configuration reads local files that are not set; pass them on the "
                              "command line: " + " ".join(missing))
        validate_sections(self)
        task, rollout = self.task, self.rollout
        self.run._need("policy_updates", self.run.policy_updates % rollout.reuse == 0,
                       f"a multiple of rollout.reuse={rollout.reuse} (each rollout batch gives N updates)")
        key = "policy_updates" if self.run.policy_updates else "iterations"
        self.run._need(key, self.num_iterations * rollout.reuse <= MAX_STEPS,
                       f"at most {MAX_STEPS:_} policy updates in all (rollout.reuse={rollout.reuse} per "
                       "iteration)")
        self.warmup._need("steps", not (self.warmup.steps and task.name != "synthetic"),
                          "0 with task.name='dapo_math' (the warm-up needs the reference responses "
                          "of 'synthetic')")
        sampler_corrected = rollout.old_logprobs == "sampler" and bool(self.objective.rollout_correction)
        rollout._need("old_logprobs", not sampler_corrected,
                      "'auto' or 'recompute' with objective.rollout_correction set: the correction weighs "
                      "log π_old against the sampler's log-probs, which 'sampler' makes the same")
        inexact = rollout.old_logprobs == "sampler" and not rollout.kernel_exact(self.model.dtype)
        rollout._need("old_logprobs", not inexact,
                      f"'auto' or 'recompute' with rollout.paged_attention_impl="
                      f"{rollout.paged_attention_impl!r} and model.dtype={self.model.dtype!r}: that kernel "
                      "is not exact for that dtype (paged_kernels.KERNEL_PRECISION), so the sampler's "
                      "log-probs are not log π_old's")
        self.mesh._need("rollout_devices", not self.mesh.rollout_devices or rollout.async_steps >= 1,
                        "0 with rollout.async_steps=0 (a separate rollout mesh serves asynchronous rollouts)")
        objective = self.objective
        objective._need("decoupled", not (objective.decoupled and objective.rollout_correction),
                        "false with objective.rollout_correction set (both weigh the tokens by the "
                        "sampler's log-probs: use one)")
        task._need("overlong_buffer_length", task.overlong_buffer_length <= rollout.max_new_tokens,
                   f"at most rollout.max_new_tokens={rollout.max_new_tokens}")
        ranged = self.warmup.min_operands or self.warmup.max_operands
        self.warmup._need("max_operands" if self.warmup.max_operands else "min_operands",
                          not (ranged and task.name != "synthetic"),
                          "0 with task.name='dapo_math' (an operand range is the synthetic task's)")
        if task.name == "synthetic":
            synthetic = task.synthetic_task()
            low, high = synthetic.operand_counts
            first, last = self.warmup.operand_range(synthetic)
            self.warmup._need("max_operands" if self.warmup.max_operands else "min_operands",
                              low <= first <= last <= high,
                              f"a range inside the task's {low}-{high} operands (min_operands <= "
                              f"max_operands; 0: the task's bound); got {first}-{last}")
            needed = synthetic.max_response_tokens() + 1
            rollout._need("max_new_tokens", rollout.max_new_tokens >= needed,
                          f">= {needed}: a correct answer of the {task.difficulty!r} task takes {needed} "
                          "tokens with EOS")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check_paths(self) -> "ExperimentConfig":
        """Checks the local files the config names (model checkpoint, task data, tokenizer) exist and
        parse, and that the reward is registered here; `ConfigError` otherwise. Separate from `validate`,
        which is pure: a saved config stays valid where its files (or a user reward) are not (e.g.
        evaluated on another machine). The trainer calls both."""
        self.model.check_paths()
        self.task.check_paths()
        return self

    def missing_paths(self) -> list[str]:
        """The `key=<what>` overrides this config needs before it can run (paper configs leave them unset)."""
        missing = []
        if not self.model.preset and not self.model.checkpoint_dir:
            missing.append("model.checkpoint_dir=<a Hugging Face Qwen3 checkpoint directory>")
        if self.task.name == "dapo_math":
            if not self.task.data_dir:
                missing.append("task.data_dir=<the data root, its dapo_math_17k/ folder or the parquet file>")
            if not self.task.tokenizer_dir:
                missing.append("task.tokenizer_dir=<a directory with tokenizer.json>")
        return missing

    @property
    def num_iterations(self) -> int:
        """Rollout batches in the run: run.policy_updates / rollout.reuse when set, else run.iterations."""
        if self.run.policy_updates:
            return self.run.policy_updates // self.rollout.reuse
        return self.run.iterations

    @property
    def lr_warmup_steps(self) -> int:
        """Warm-up length W in the schedule's unit (policy updates or rollout batches)."""
        if self.optim.warmup_steps:
            return self.optim.warmup_steps
        total = self.num_iterations * (self.rollout.reuse if self.optim.schedule_per == "update" else 1)
        return int(self.optim.warmup_ratio * total)
