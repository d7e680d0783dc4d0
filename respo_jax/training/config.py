"""Typed experiment configuration: frozen dataclasses, validated at start-up, overridable by dotted keys.

A config file under `experiments/configs/` builds an `ExperimentConfig`; the command line overrides any
field with `section.field=value` (the value is parsed with the field's declared type), so every knob of
an experiment lives in one typed place and a typo fails before any compute is spent.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, TypeVar


ConfigT = TypeVar("ConfigT")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which Qwen3 to train: a preset name (`qwen3.Qwen3Config.preset`) plus field overrides, or a local HF dir.

    preset "" means "no random initialisation": `checkpoint_dir` must then be set (the paper configs).
    `dtype` is the compute dtype, `param_dtype` the parameters' storage dtype ("" = `dtype`); both apply
    to presets and checkpoints. The paper's runs keep float32 parameters with bfloat16 compute (FSDP
    mixed precision): bfloat16 parameters would round away AdamW updates of lr 1e-6.
    """

    preset: str = "tiny"
    overrides: dict = dataclasses.field(default_factory=dict)
    checkpoint_dir: str = ""  # a Hugging Face-format directory; when set it wins over `preset`
    dtype: str = "float32"
    param_dtype: str = ""
    remat: bool = False
    # Run the decoder layers as one lax.scan (compiles once per layer kind: large models, accelerators)
    # or unrolled (no per-layer slicing of stacked weights and activations: faster on CPU, e.g. the
    # benchmarks' tiny train step 44 -> 39 ms, small 3.8 -> 3.6 s; compile time grows with depth).
    scan_layers: bool = True

    def validate(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"model.dtype must be 'float32' or 'bfloat16'; got {self.dtype!r}")
        if self.param_dtype not in ("", "float32", "bfloat16"):
            raise ValueError(
                f"model.param_dtype must be '', 'float32' or 'bfloat16'; got {self.param_dtype!r}"
            )
        if not self.preset and not self.checkpoint_dir:
            raise ValueError(
                "model.preset is empty: set model.checkpoint_dir to a Hugging Face Qwen3 checkpoint"
            )
        own = sorted(set(self.overrides) & {"dtype", "param_dtype", "remat", "scan_layers"})
        if own:
            raise ValueError(f"model.overrides sets {own}: use the model.dtype / model.remat / "
                             "model.scan_layers fields instead")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The verifiable task and its reward.

    name: "synthetic" (arithmetic in `\\boxed{}`, in-process tokenizer: the CPU experiment) or "dapo_math"
      (the paper's training set, from `data_dir`, tokenized with the HF tokenizer in `tokenizer_dir`).
    The reward is the strict-box score (±1, App. D.1) plus, when `overlong_buffer_length` > 0, DAPO's
    overlong penalty (0 up to max_new_tokens − buffer, linear to −`overlong_penalty_factor` at the limit).
    """

    name: str = "synthetic"
    difficulty: str = "easy"  # synthetic only
    num_records: int = 100_000  # synthetic only: size of the prompt pool the batches shuffle
    data_dir: str = ""  # dapo_math: data root, its dapo_math_17k/ folder or the parquet file
    tokenizer_dir: str = ""  # dapo_math: a directory with tokenizer.json
    # dapo_math: render prompts with the tokenizer's chat template, as the official preparation does (it
    # stores each prompt as a chat message, so verl templates even the Base model); the start-up fails
    # when the tokenizer has none. The synthetic task has its own raw format.
    chat_template: bool = True
    max_prompt_tokens: int = 1024  # prompts above this are dropped once, before batching (paper §4.1)
    overlong_buffer_length: int = 0
    overlong_penalty_factor: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.name not in ("synthetic", "dapo_math"):
            raise ValueError(f"task.name must be 'synthetic' or 'dapo_math'; got {self.name!r}")
        if self.name == "dapo_math" and not (self.data_dir and self.tokenizer_dir):
            raise ValueError("task.name='dapo_math' needs task.data_dir and task.tokenizer_dir")
        if self.num_records < 1 or self.max_prompt_tokens < 1:
            raise ValueError(f"task.num_records and task.max_prompt_tokens must be >= 1; got {self}")
        if self.overlong_buffer_length < 0 or self.overlong_penalty_factor < 0:
            raise ValueError("task.overlong_buffer_length and task.overlong_penalty_factor must be >= 0")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Rollout sizes of paper §4.1: a rollout batch of `reuse * prompts_per_minibatch` prompts, `group_size`
    responses each, split into `reuse` (= N) consecutive mini-batches, one policy update each."""

    prompts_per_minibatch: int = 8  # M
    group_size: int = 8  # G
    reuse: int = 4  # N, the rollout-reuse ratio
    max_new_tokens: int = 8
    temperature: float = 1.0  # the trainer's log-probs use the same temperature (verl divides the logits)
    top_p: float = 1.0
    top_k: int = 0
    # How the rollout batch is split into the N mini-batches: "consecutive" (the paper: prompt-major
    # order, mini-batch k = prompts [kM, (k+1)M)) or "balanced" (verl's trainer.balance_batch: responses
    # reordered by sequence-length workload over `balance_ranks` data-parallel ranks first).
    minibatch_order: str = "consecutive"
    balance_ranks: int = 1

    def validate(self) -> None:
        for name in ("prompts_per_minibatch", "group_size", "reuse", "max_new_tokens", "balance_ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1; got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for training rollouts; got {self.temperature}")
        if self.minibatch_order not in ("consecutive", "balanced"):
            raise ValueError(
                f"rollout.minibatch_order must be 'consecutive' or 'balanced'; got {self.minibatch_order!r}"
            )
        if (self.prompts_per_minibatch * self.group_size) % self.balance_ranks:
            raise ValueError(
                f"rollout.balance_ranks={self.balance_ranks} must divide a mini-batch's "
                f"{self.prompts_per_minibatch * self.group_size} responses"
            )


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The policy objective by registry name, its hyperparameters and the loss aggregation mode."""

    name: str = "respo"
    hparams: dict = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        if not self.name:
            raise ValueError("objective.name must be set")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping and a linear warm-up of the learning rate, then constant.

    schedule_per: the schedule's step — "update" (each policy update) or "rollout" (each rollout batch,
      as verl steps its scheduler once per `update_actor`: all N updates of rollout batch k run at
      lr * min(1, k / W), so the first batch runs at lr 0 while Adam's moments still accumulate).
    warmup_steps W in that unit, or warmup_ratio: W = int(warmup_ratio * total steps) (verl's
      lr_warmup_steps_ratio); at most one of the two.
    """

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    schedule_per: str = "update"

    def validate(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"optim.learning_rate must be > 0; got {self.learning_rate}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"optim.max_grad_norm must be > 0; got {self.max_grad_norm}")
        if self.warmup_steps < 0 or not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"optim.warmup_steps must be >= 0 and optim.warmup_ratio in [0, 1); got {self}")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set optim.warmup_steps or optim.warmup_ratio, not both")
        if self.schedule_per not in ("update", "rollout"):
            raise ValueError(f"optim.schedule_per must be 'update' or 'rollout'; got {self.schedule_per!r}")


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up that turns a random init into a weak "base model" with non-zero reward,
    so that RL has a signal (the paper starts from a pretrained base model)."""

    steps: int = 0
    batch_size: int = 64
    learning_rate: float = 3e-3

    def validate(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.learning_rate <= 0:
            raise ValueError(f"warmup fields out of range: {self}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Run length, seed and where results go."""

    iterations: int = 40  # rollout batches
    # When > 0, the run length in policy updates instead (the paper fixes 1,024 for every N): the run
    # has policy_updates / rollout.reuse iterations, and `iterations` is not read.
    policy_updates: int = 0
    seed: int = 0
    out_dir: str = "runs/respo_synthetic"
    checkpoint_every: int = 0  # 0: only at the end
    resume: bool = False  # continue from the latest checkpoint under out_dir/checkpoints
    eval_problems: int = 128  # held-out problems for the greedy accuracy before and after (0: none)
    progress: bool = True
    # Keep XLA's host buffers mapped between steps (respo_jax.host_allocator); applied at start-up.
    host_allocator: bool = True

    def validate(self) -> None:
        if self.iterations < 1 or self.policy_updates < 0:
            raise ValueError(f"run.iterations must be >= 1 and run.policy_updates >= 0; got {self}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optim: OptimConfig = OptimConfig()
    warmup: WarmupConfig = WarmupConfig()
    run: RunConfig = RunConfig()

    def validate(self) -> "ExperimentConfig":
        missing = self.missing_paths()
        if missing:
            raise ValueError(
                "this configuration reads local files that are not set; pass them on the command line: "
                + " ".join(missing)
            )
        for field in dataclasses.fields(self):
            getattr(self, field.name).validate()
        if self.run.policy_updates % self.rollout.reuse:
            raise ValueError(
                f"run.policy_updates={self.run.policy_updates} is not a multiple of rollout.reuse="
                f"{self.rollout.reuse} (each rollout batch gives N updates)"
            )
        if self.warmup.steps and self.task.name != "synthetic":
            raise ValueError("warmup.steps > 0 needs reference responses: only task.name='synthetic' has them")
        if self.task.overlong_buffer_length > self.rollout.max_new_tokens:
            raise ValueError(
                f"task.overlong_buffer_length={self.task.overlong_buffer_length} exceeds "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens}"
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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


def _parse_value(raw: str, annotation: Any, key: str) -> Any:
    """Parses a command-line string as the field's declared type (`dict` fields take JSON)."""
    target = annotation if isinstance(annotation, type) else typing.get_origin(annotation) or annotation
    try:
        if target is bool:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return lowered in ("true", "1")
        if target is int:
            return int(raw)
        if target is float:
            return float(raw)
        if target is str:
            return raw
        if target is dict:
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
    except ValueError as err:
        raise ValueError(f"override {key}={raw!r}: cannot parse as {getattr(target, '__name__', target)}") from err
    raise TypeError(f"override {key}: unsupported field type {annotation!r}")


def apply_overrides(config: ConfigT, overrides: list[str]) -> ConfigT:
    """Returns `config` with `section.field=value` overrides applied; unknown keys raise KeyError.

    `config` is any frozen dataclass whose fields are frozen section dataclasses and which has a
    `validate()` returning itself (`ExperimentConfig`, `respo_jax.eval.config.EvalConfig`).
    Sub-keys of dict fields are allowed too: `objective.hparams.eps_high=0.28` (the value parsed as JSON,
    falling back to a plain string).
    """
    sections = {field.name: type(getattr(config, field.name)) for field in dataclasses.fields(config)}
    hints = {name: typing.get_type_hints(cls) for name, cls in sections.items()}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in sections:
            raise KeyError(f"unknown config key {key!r}; sections are {sorted(sections)}")
        section_name, field_name, rest = parts[0], parts[1], parts[2:]
        section = getattr(config, section_name)
        field_types = hints[section_name]
        if field_name not in field_types:
            raise KeyError(f"unknown config key {key!r}; {section_name} has {sorted(field_types)}")
        if rest:
            if field_types[field_name] is not dict and typing.get_origin(field_types[field_name]) is not dict:
                raise KeyError(f"config key {key!r}: {section_name}.{field_name} is not a dict field")
            try:
                sub_value = json.loads(raw)
            except json.JSONDecodeError:
                sub_value = raw
            value = dict(getattr(section, field_name))
            value[".".join(rest)] = sub_value
        else:
            value = _parse_value(raw, field_types[field_name], key)
        config = dataclasses.replace(config, **{section_name: dataclasses.replace(section, **{field_name: value})})
    return config.validate()


def config_from_dict(config_type: type[ConfigT], data: dict) -> ConfigT:
    """Rebuilds a config from its `to_dict()` form (e.g. a run's `config.json`), then validates it.

    A section or field missing from `data` takes its default (a file written before the field existed);
    an unknown section or field raises KeyError naming it.
    """
    if not isinstance(data, dict):
        raise ValueError(f"a {config_type.__name__} dict must be a JSON object; got {type(data).__name__}")
    section_types = typing.get_type_hints(config_type)
    unknown = sorted(set(data) - set(section_types))
    if unknown:
        raise KeyError(
            f"unknown config sections {unknown}; {config_type.__name__} has {sorted(section_types)}"
        )
    sections = {}
    for name, section_type in section_types.items():
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise ValueError(f"config section {name!r} must be an object; got {values!r}")
        known = {field.name for field in dataclasses.fields(section_type)}
        extra = sorted(set(values) - known)
        if extra:
            raise KeyError(f"unknown config fields {name}.{extra}; {name} has {sorted(known)}")
        sections[name] = section_type(**values)
    return config_type(**sections).validate()
