"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (single file or sharded with
``model.safetensors.index.json``), read with the ``safetensors`` NumPy API — never pickle, no torch.

Our parameters are stored per *run* of same-kind layers with a leading ``layers`` axis and with
split head axes; this module owns the one table that maps each of them to the transformers tensor
names and ``[out, in]`` layouts, in both directions. MoE experts are read from either the hub layout
(``mlp.experts.{j}.{gate,up,down}_proj.weight``) or transformers 5's fused in-memory layout
(``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) and written in the hub layout.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from respo_jax.models.qwen3.config import Qwen3Config, read_json_file
from respo_jax.models.qwen3.model import Qwen3ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsReader:
    """Lazy access to the tensors of a checkpoint directory, remembering which ones were read.

    Every tensor is checked on read: its shape against the config, its values for NaN/inf (a damaged
    or diverged checkpoint must not load silently)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index_path = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index_path):
            index = read_json_file(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index_path}: expected a 'weight_map' object of tensor name -> file name")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.path, "*.safetensors")))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no *.safetensors files (or {INDEX_FILE}) in {self.path}")
        self._handles = {}
        for name in files:
            file_path = os.path.join(self.path, name)
            if not os.path.isfile(file_path):
                raise FileNotFoundError(f"{file_path} is listed in {INDEX_FILE} but missing")
            try:
                self._handles[name] = safe_open(file_path, framework="numpy")
            except Exception as err:  # noqa: BLE001 (safetensors raises its own SafetensorError)
                raise ValueError(f"{file_path}: not a readable safetensors file ({err})") from None
        if weight_map is None:
            weight_map = {key: name for name, handle in self._handles.items() for key in handle.keys()}
        self._where: dict[str, str] = dict(weight_map)
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor ``name`` as a NumPy array, after checking it has ``shape``."""
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint at {self.path}")
        handle = self._handles[self._where[name]]
        got = tuple(handle.get_slice(name).get_shape())
        if got != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {got}; this config expects {tuple(shape)}")
        self.used.add(name)
        tensor = handle.get_tensor(name)
        if tensor.dtype.kind in "fcV":  # floats (V: bfloat16 and other ml_dtypes)
            finite = np.isfinite(tensor)
            if not finite.all():
                bad = np.argwhere(~finite)[0].tolist()
                raise ValueError(f"tensor {name!r} in {os.path.join(self.path, self._where[name])} holds "
                                 f"{int(np.size(finite) - np.count_nonzero(finite))} NaN/inf values "
                                 f"(first at index {bad})")
        return tensor


# --------------------------------------------------------------------------------------------------
# The mapping table. Each entry converts one parameter of *one* decoder layer between our layout and
# transformers' tensors under the prefix "model.layers.{i}.".
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tensor:
    read: Callable[[SafetensorsReader, str, Qwen3Config], np.ndarray]   # -> our layout
    write: Callable[[np.ndarray, str, Qwen3Config], dict[str, np.ndarray]]


def _copy(suffix: str, shape: Callable[[Qwen3Config], tuple[int, ...]]) -> _Tensor:
    return _Tensor(read=lambda r, p, c: r.get(p + suffix, shape(c)),
                   write=lambda a, p, c: {p + suffix: a})


def _linear(suffix: str, in_dim: Callable, out_dims: Callable) -> _Tensor:
    """nn.Linear weight [out, in] <-> ours [in, *out_dims]."""
    def read(r, p, c):
        out = out_dims(c)
        return r.get(p + suffix, (int(np.prod(out)), in_dim(c))).T.reshape(in_dim(c), *out)

    def write(a, p, c):
        return {p + suffix: np.ascontiguousarray(a.reshape(in_dim(c), -1).T)}
    return _Tensor(read, write)


def _linear_out(suffix: str, in_dims: Callable, out_dim: Callable) -> _Tensor:
    """nn.Linear weight [out, in] <-> ours [*in_dims, out] (attention output projection)."""
    def read(r, p, c):
        ins = in_dims(c)
        return r.get(p + suffix, (out_dim(c), int(np.prod(ins)))).T.reshape(*ins, out_dim(c))

    def write(a, p, c):
        return {p + suffix: np.ascontiguousarray(a.reshape(-1, out_dim(c)).T)}
    return _Tensor(read, write)


def _experts(name: str) -> _Tensor:
    """Expert weights ours [experts, in, out] <-> hub ``mlp.experts.{j}.{name}.weight`` [out, in], or
    transformers-5 fused ``gate_up_proj`` [experts, 2·mlp, embed] / ``down_proj`` [experts, embed, mlp]."""
    def dims(c):  # (in, out) of the expert linear
        e, m = c.hidden_size, c.moe_intermediate_size
        return (m, e) if name == "down_proj" else (e, m)

    def read(r, p, c):
        n, (i, o) = c.num_experts, dims(c)
        per_expert = [f"{p}mlp.experts.{j}.{name}.weight" for j in range(n)]
        if per_expert[0] not in r and not _has_fused(r, p):
            raise KeyError(f"tensor {per_expert[0]!r} is missing from the checkpoint at {r.path} "
                           f"(nor is the fused {p}mlp.experts.down_proj there)")
        if per_expert[0] in r:
            return np.stack([r.get(key, (o, i)).T for key in per_expert])
        if name == "down_proj":
            return np.swapaxes(r.get(f"{p}mlp.experts.down_proj", (n, o, i)), 1, 2)
        fused = r.get(f"{p}mlp.experts.gate_up_proj", (n, 2 * o, i))
        half = fused[:, :o] if name == "gate_proj" else fused[:, o:]
        return np.swapaxes(half, 1, 2)

    def write(a, p, c):
        return {f"{p}mlp.experts.{j}.{name}.weight": np.ascontiguousarray(a[j].T) for j in range(a.shape[0])}
    return _Tensor(read, write)


def _has_fused(r: SafetensorsReader, prefix: str) -> bool:
    return f"{prefix}mlp.experts.down_proj" in r


_E = lambda c: c.hidden_size  # noqa: E731
_ATTN_AND_NORMS: dict[tuple[str, ...], _Tensor] = {
    ("input_layernorm", "weight"): _copy("input_layernorm.weight", lambda c: (c.hidden_size,)),
    ("post_attention_layernorm", "weight"): _copy("post_attention_layernorm.weight",
                                                  lambda c: (c.hidden_size,)),
    ("attn", "q_norm", "weight"): _copy("self_attn.q_norm.weight", lambda c: (c.head_dim,)),
    ("attn", "k_norm", "weight"): _copy("self_attn.k_norm.weight", lambda c: (c.head_dim,)),
    ("attn", "q_proj"): _linear("self_attn.q_proj.weight", _E, lambda c: (c.num_attention_heads, c.head_dim)),
    ("attn", "k_proj"): _linear("self_attn.k_proj.weight", _E, lambda c: (c.num_key_value_heads, c.head_dim)),
    ("attn", "v_proj"): _linear("self_attn.v_proj.weight", _E, lambda c: (c.num_key_value_heads, c.head_dim)),
    ("attn", "o_proj"): _linear_out("self_attn.o_proj.weight",
                                    lambda c: (c.num_attention_heads, c.head_dim), _E),
}
DENSE_LAYER_TENSORS: dict[tuple[str, ...], _Tensor] = {
    **_ATTN_AND_NORMS,
    ("mlp", "gate_proj"): _linear("mlp.gate_proj.weight", _E, lambda c: (c.intermediate_size,)),
    ("mlp", "up_proj"): _linear("mlp.up_proj.weight", _E, lambda c: (c.intermediate_size,)),
    ("mlp", "down_proj"): _linear("mlp.down_proj.weight", lambda c: c.intermediate_size,
                                  lambda c: (c.hidden_size,)),
}
MOE_LAYER_TENSORS: dict[tuple[str, ...], _Tensor] = {
    **_ATTN_AND_NORMS,
    ("mlp", "router"): _linear("mlp.gate.weight", _E, lambda c: (c.num_experts,)),
    ("mlp", "gate_proj"): _experts("gate_proj"),
    ("mlp", "up_proj"): _experts("up_proj"),
    ("mlp", "down_proj"): _experts("down_proj"),
}
TOP_LEVEL_TENSORS: dict[tuple[str, ...], _Tensor] = {
    ("embed_tokens",): _copy("model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    ("norm", "weight"): _copy("model.norm.weight", lambda c: (c.hidden_size,)),
    ("lm_head",): _linear("lm_head.weight", _E, lambda c: (c.vocab_size,)),
}


def _locate(path: tuple, cfg: Qwen3Config):
    """Our state path -> (table entry, list of HF prefixes: one per stacked layer, or [""])."""
    if path and path[0] == "stacks":
        first, count, is_moe = cfg.layer_groups[int(path[1])]
        assert path[2] == "layers", path
        table = MOE_LAYER_TENSORS if is_moe else DENSE_LAYER_TENSORS
        key = tuple(str(p) for p in path[3:])
        if key not in table:
            raise KeyError(f"no checkpoint mapping for parameter {'.'.join(map(str, path))}")
        return table[key], [f"model.layers.{i}." for i in range(first, first + count)]
    key = tuple(str(p) for p in path)
    if key not in TOP_LEVEL_TENSORS:
        raise KeyError(f"no checkpoint mapping for parameter {'.'.join(map(str, path))}")
    return TOP_LEVEL_TENSORS[key], [""]


def _stacked(path: tuple) -> bool:
    return bool(path) and path[0] == "stacks"


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike, **overrides) -> Qwen3Config:
    """``Qwen3Config`` from ``path/config.json`` (keyword overrides replace fields)."""
    config_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"no config.json in {os.fspath(path)}")
    return Qwen3Config.from_json_file(config_path, **overrides)


def from_pretrained(path: str | os.PathLike, dtype=jnp.float32, *, compute_dtype=None, remat: bool = False,
                    scan_layers: bool = True) -> Qwen3ForCausalLM:
    """Load a transformers Qwen3 / Qwen3-MoE checkpoint directory into a ``Qwen3ForCausalLM``.

    ``dtype`` is the parameter dtype (and the compute dtype unless ``compute_dtype`` is given). The
    model is built abstractly (no random initialisation) and filled tensor by tensor; a missing or
    mis-shaped tensor raises naming it, as do tensors the config has no place for.
    """
    cfg = load_config(path, param_dtype=dtype, dtype=dtype if compute_dtype is None else compute_dtype,
                      remat=remat, scan_layers=scan_layers)
    reader = SafetensorsReader(path)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    param_dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    for path_, var in nnx.to_flat_state(state):
        entry, prefixes = _locate(path_, cfg)
        arrays = [entry.read(reader, prefix, cfg) for prefix in prefixes]
        value = np.stack(arrays) if _stacked(path_) else arrays[0]
        if value.shape != tuple(var.shape):
            raise ValueError(f"parameter {'.'.join(map(str, path_))}: assembled shape {value.shape}, "
                             f"model expects {tuple(var.shape)}")
        var.set_value(jnp.asarray(value.astype(param_dtype)))
    unexpected = reader.names() - reader.used
    if cfg.tie_word_embeddings and "lm_head.weight" in reader:
        # Some tied checkpoints store the shared matrix twice; a different one means the config is wrong.
        shape = (cfg.vocab_size, cfg.hidden_size)
        lm_head = reader.get("lm_head.weight", shape)
        embed = reader.get("model.embed_tokens.weight", shape)
        if not np.array_equal(lm_head, embed):
            diff = float(np.max(np.abs(lm_head.astype(np.float32) - embed.astype(np.float32))))
            raise ValueError(
                f"{os.path.join(reader.path, 'config.json')} sets tie_word_embeddings=true, but "
                f"lm_head.weight differs from model.embed_tokens.weight (max |diff| {diff:.3g}): loading "
                "would use the wrong output layer; set tie_word_embeddings to false if the checkpoint has "
                "its own lm_head"
            )
        unexpected.discard("lm_head.weight")
    if unexpected:
        raise ValueError(f"checkpoint at {reader.path} has tensors this config does not use: "
                         f"{sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
    return nnx.merge(graphdef, state)


def hf_state_dict(model: Qwen3ForCausalLM, dtype=None) -> dict[str, np.ndarray]:
    """The model's parameters as transformers-named NumPy arrays in ``[out, in]`` layout (``dtype``:
    optional cast, default the parameter dtype)."""
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        entry, prefixes = _locate(path, cfg)
        value = np.asarray(jax.device_get(var[...]))
        if dtype is not None:
            value = value.astype(np.dtype(jnp.dtype(dtype)))
        layers = value if _stacked(path) else [value]
        for prefix, layer_value in zip(prefixes, layers):
            out.update(entry.write(np.asarray(layer_value), prefix, cfg))
    return out


def save_pretrained(model: Qwen3ForCausalLM, out_dir: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` and safetensors (sharded with an index above ``max_shard_bytes``) that
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads back."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    cfg = model.config
    if dtype is not None:
        cfg = cfg.replace(param_dtype=dtype)
    tensors = hf_state_dict(model, dtype)
    for stale in glob.glob(os.path.join(out_dir, "model*.safetensors")) + [os.path.join(out_dir, INDEX_FILE)]:
        if os.path.exists(stale):  # an older save would otherwise shadow or mix with this one
            os.remove(stale)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, filename), metadata=metadata)
        weight_map.update({name: filename for name in shard})
    total_size = int(sum(t.nbytes for t in tensors.values()))
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
