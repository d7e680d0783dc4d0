"""Qwen3 / Qwen3-MoE configuration: the architecture fields of a Hugging Face ``config.json`` plus the
run-time choices our Flax port reads (dtypes, rematerialization, layer scan, kernels, mesh and
sharding rules). Only the architecture fields travel through ``config.json``.

One frozen dataclass serves both the dense (``model_type="qwen3"``) and the sparse
(``model_type="qwen3_moe"``) model: ``num_experts == 0`` means dense. Presets carry the published
``config.json`` values of the Qwen3 checkpoints the paper uses (Qwen3-1.7B, Qwen3-30B-A3B, §4.1)
and their siblings, plus tiny shapes for tests and CPU runs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from respo_jax.json_files import read_json
from respo_jax.sharding import ShardingRules, axis_size

_DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("causal_blocks", "dense")
MOE_IMPLS = ("ragged", "tiled")
MOE_DISPATCHES = ("all_to_all", "ragged_all_to_all")
LM_HEAD_IMPLS = ("vocab_chunks", "token_chunks")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture + run-time options of a Qwen3 causal LM.

    Field names follow the classic Hugging Face ``config.json`` names. ``dtype`` is the compute dtype
    (activations, matmul inputs), ``param_dtype`` the storage dtype of the parameters; RMSNorm
    statistics, router softmax, attention softmax and log-probs are always float32.
    ``remat`` wraps each decoder layer in ``jax.checkpoint`` (activations are recomputed in the
    backward pass); ``scan_layers`` runs each run of same-kind layers as one ``lax.scan`` so the
    compile time does not grow with depth (``False`` stores every layer's weights on their own and
    unrolls a Python loop over them: faster on CPU, also for decoding, compile time grows with depth).

    Kernels (``attention_impl``, ``moe_impl``, ``moe_dispatch``, the log-prob head ``lm_head_impl``
    (differentiated: the policy update) and ``lm_head_forward_impl`` (no gradient: log π_old, entropy),
    and the layer loop ``scan_layers``; see ``kernels.default_kernels`` and
    ``kernels.default_lm_head_impl`` for what each does) are explicit fields; ``None`` (the default)
    leaves the choice to ``kernels.resolve_config``, which the entry points (``Qwen3ForCausalLM``,
    ``init_model``, ``from_pretrained``) call once with the mesh: ``mesh`` None there means the
    1×1×1×1 mesh over one device. A built model's config always has a mesh and plain kernel fields,
    so every backend and mesh runs the same program, only the named kernels differ. ``rules`` (the
    logical-axis table) maps the activations' and parameters' logical names onto the mesh; MoE layers
    run expert-parallel inside ``shard_map`` (tokens exchanged with the devices owning their experts).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Mixture of experts (num_experts == 0: dense Qwen3).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    # Special tokens (carried through config.json round trips).
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Run-time options.
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    scan_layers: bool | None = None
    attention_impl: str | None = None
    moe_impl: str | None = None
    moe_dispatch: str | None = None
    lm_head_impl: str | None = None
    lm_head_forward_impl: str | None = None
    mesh: jax.sharding.Mesh | None = None
    rules: ShardingRules = ShardingRules()

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("dtype", _dtype_name(self.dtype, "dtype"))
        set_("param_dtype", _dtype_name(self.param_dtype, "param_dtype"))
        set_("mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
            if self.decoder_sparse_step <= 0:
                raise ValueError(f"decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} outside [0, {self.num_hidden_layers})")
        for name, allowed in (("attention_impl", ATTENTION_IMPLS), ("moe_impl", MOE_IMPLS),
                              ("moe_dispatch", MOE_DISPATCHES), ("lm_head_impl", LM_HEAD_IMPLS),
                              ("lm_head_forward_impl", LM_HEAD_IMPLS)):
            if getattr(self, name) not in (*allowed, None):
                raise ValueError(f"{name} must be one of {allowed} (or None: chosen for the platform), "
                                 f"got {getattr(self, name)!r}")
        if self.scan_layers not in (True, False, None):
            raise ValueError(f"scan_layers must be a bool (or None: chosen for the platform), got "
                             f"{self.scan_layers!r}")
        if not isinstance(self.rules, ShardingRules):
            raise TypeError(f"rules must be a respo_jax.sharding.ShardingRules, got {type(self.rules).__name__}")
        if self.mesh is not None:
            self._check_mesh()

    def _check_mesh(self) -> None:
        """The rules fit the mesh; MoE experts split evenly over the expert axes, whose devices must
        also split the tokens (expert parallelism exchanges tokens along those axes)."""
        self.rules.check_mesh(self.mesh)
        if not self.is_moe:
            return
        expert_axes = self.rules.mesh_axes("experts")
        shards = axis_size(self.mesh, expert_axes)
        if self.num_experts % shards:
            raise ValueError(f"num_experts={self.num_experts} does not split over mesh axes {expert_axes} "
                             f"({shards} devices)")
        token_axes = set(self.rules.mesh_axes("batch")) | set(self.rules.mesh_axes("sequence"))
        if not set(expert_axes) <= token_axes:
            raise ValueError(f"experts are split over mesh axes {expert_axes}, but tokens only over "
                             f"{sorted(token_axes)} (rules 'batch' + 'sequence'); expert parallelism needs "
                             "the tokens split over the expert axes too")

    # ----------------------------------------------------------------------------------------------
    # Layer layout
    # ----------------------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else "qwen3"

    def is_moe_layer(self, layer: int) -> bool:
        """Transformers' rule: sparse unless listed in ``mlp_only_layers`` or off the sparse step."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def layer_groups(self) -> tuple[tuple[int, int, bool], ...]:
        """Maximal runs of consecutive same-kind layers: ``(first_layer, num_layers, is_moe)``.

        Each run is stored stacked and scanned, so heterogeneous MoE/dense stacks still compile in
        time proportional to the number of runs, not the depth.
        """
        groups: list[list] = []
        for i in range(self.num_hidden_layers):
            kind = self.is_moe_layer(i)
            if groups and groups[-1][2] == kind:
                groups[-1][1] += 1
            else:
                groups.append([i, 1, kind])
        return tuple((first, count, kind) for first, count, kind in groups)

    def replace(self, **changes: Any) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------------
    # Presets
    # ----------------------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Qwen3Config":
        """A named configuration: ``"qwen3-1.7b"`` (or ``"1.7b"``, ``"Qwen/Qwen3-1.7B"``), … ,
        ``"tiny"``, ``"tiny-moe"``; keyword overrides replace fields (e.g. ``dtype="bfloat16"``)."""
        key = name.lower().split("/")[-1]
        if key.startswith("qwen3-"):
            key = key[len("qwen3-"):]
        key = key.removesuffix("-base")
        if key not in PRESETS:
            raise KeyError(f"unknown Qwen3 preset {name!r}; known: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[key], **overrides)

    # ----------------------------------------------------------------------------------------------
    # Hugging Face config.json
    # ----------------------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides: Any) -> "Qwen3Config":
        """Parse a transformers ``config.json`` dict (classic names or transformers-5 names).

        Accepts ``num_experts`` or ``num_local_experts``, ``rope_theta`` (+ ``rope_scaling``) or
        ``rope_parameters``. Rejects what this port does not implement (other model types, rope
        scaling, sliding-window attention, attention biases, non-SiLU activations) by name.
        """
        model_type = hf.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"unsupported model_type {model_type!r}; expected 'qwen3' or 'qwen3_moe'")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise KeyError(f"config.json lacks required field(s) {missing}")
        rope_theta, rope_type = _rope_from_hf(hf)
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported; only 'default' rotary embeddings")
        if hf.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported "
                             "(Qwen3 checkpoints use full attention)")
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias=True is not supported (Qwen3 projections have no bias)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
        heads = int(hf["num_attention_heads"])
        kw: dict[str, Any] = dict(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )
        if model_type == "qwen3_moe":
            num_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
            kw.update(
                num_experts=int(num_experts),
                num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            )
            if kw["num_experts"] == 0:
                raise ValueError("model_type 'qwen3_moe' with num_experts=0; use model_type 'qwen3'")
        dtype = hf.get("dtype", hf.get("torch_dtype"))
        if dtype in _DTYPES:
            kw["param_dtype"] = kw["dtype"] = dtype
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, **overrides: Any) -> "Qwen3Config":
        """From a ``config.json``; invalid JSON raises ValueError naming the file and line."""
        hf = read_json(path)
        if not isinstance(hf, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
        try:
            return cls.from_hf_dict(hf, **overrides)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` transformers (4.51+ and 5.x) reads back into the same model (classic
        field names, as published on the hub)."""
        hf: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.is_moe:
            hf.update({
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers),
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": False,
            })
        return hf


def _dtype_name(value: Any, field: str) -> str:
    name = jnp.dtype(value).name
    if name not in _DTYPES:
        raise ValueError(f"{field} must be one of {_DTYPES}, got {value!r}")
    return name


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, str]:
    """``(rope_theta, rope_type)`` from either ``rope_parameters`` (transformers 5) or the classic
    ``rope_theta`` + ``rope_scaling`` pair."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), str(params.get("rope_type", params.get("type", "default")))
    scaling = hf.get("rope_scaling") or {}
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    return float(hf.get("rope_theta", 10000.0)), rope_type


_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                     max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
                     param_dtype="bfloat16", dtype="bfloat16")

# Values from the published config.json of Qwen/Qwen3-{0.6B,...,235B-A22B} (the "-Base" releases share
# the architecture; they differ only in eos_token_id=151643 and max_position_embeddings=32768).
PRESETS: dict[str, Qwen3Config] = {
    "0.6b": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                        **_QWEN3_COMMON),
    "1.7b": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                        **_QWEN3_COMMON),
    "4b": Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                      **_QWEN3_COMMON),
    "8b": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, **_QWEN3_COMMON),
    "14b": Qwen3Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=8, **_QWEN3_COMMON),
    "32b": Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                       num_attention_heads=64, num_key_value_heads=8, **_QWEN3_COMMON),
    "30b-a3b": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                           num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                           num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                           **_QWEN3_COMMON),
    "235b-a22b": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                             num_attention_heads=64, num_key_value_heads=4, num_experts=128,
                             num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
                             **_QWEN3_COMMON),
    # Tiny shapes for tests and CPU runs (vocab large enough for byte-level toy tokenizers).
    "tiny": Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                        max_position_embeddings=2048, tie_word_embeddings=True),
    "tiny-moe": Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            rope_theta=10000.0, max_position_embeddings=2048, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}
