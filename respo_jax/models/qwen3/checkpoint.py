"""Hugging Face checkpoints in and out: ``config.json`` + safetensors (single file or sharded with
``model.safetensors.index.json``), read with the ``safetensors`` NumPy API — never pickle, no torch.

Our parameters are stored per *run* of same-kind layers with a leading ``layers`` axis and with
split head axes; this module owns the one table that maps each of them to the transformers tensor
names and ``[out, in]`` layouts, in both directions. MoE experts are read from either the hub layout
(``mlp.experts.{j}.{gate,up,down}_proj.weight``) or transformers 5's fused in-memory layout
(``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) and written in the hub layout.

Every entry reads any rectangular block of its parameter (an index in *our* layout) from the matching
slices of the transformers tensors (``safe_open(...).get_slice``), so a sharded load builds each
parameter with ``jax.make_array_from_callback`` and every process reads only the slices its devices
hold. Names and shapes of every tensor are checked before any data is read.
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

from respo_jax.json_files import read_json
from respo_jax.models.qwen3.config import Qwen3Config
from respo_jax.models.qwen3.kernels import resolve_config
from respo_jax.models.qwen3.model import Qwen3ForCausalLM
from respo_jax.sharding import ShardingRules, variable_axes

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
            index = read_json(index_path)
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

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """The tensor ``name`` exists with ``shape``; it counts as used."""
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint at {self.path}")
        got = tuple(self._handles[self._where[name]].get_slice(name).get_shape())
        if got != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {got}; this config expects {tuple(shape)}")
        self.used.add(name)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` (one slice per dimension) of tensor ``name``, reading only that block;
        NaN/inf values in it raise (a damaged or diverged checkpoint must not load silently)."""
        block = self._handles[self._where[name]].get_slice(name)[index]
        if block.dtype.kind in "fcV":  # floats (V: bfloat16 and other ml_dtypes)
            finite = np.isfinite(block)
            if not finite.all():
                bad = np.argwhere(~finite)[0].tolist()
                raise ValueError(f"tensor {name!r} in {os.path.join(self.path, self._where[name])} holds "
                                 f"{int(np.size(finite) - np.count_nonzero(finite))} NaN/inf values "
                                 f"(first at index {bad} of the block {index})")
        return block

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The whole tensor ``name``, checked to have ``shape`` (see ``check`` and ``read``)."""
        self.check(name, shape)
        return self.read(name, tuple(slice(0, n) for n in shape))


# --------------------------------------------------------------------------------------------------
# The mapping table. Each entry converts one parameter of *one* decoder layer between our layout and
# transformers' tensors under the prefix "model.layers.{i}.".
# --------------------------------------------------------------------------------------------------


Index = tuple[slice, ...]  # one slice per dimension, with explicit start and stop


@dataclasses.dataclass(frozen=True)
class _Tensor:
    sources: Callable[[SafetensorsReader, str, Qwen3Config], dict[str, tuple[int, ...]]]  # HF name -> shape
    read: Callable[[SafetensorsReader, str, Qwen3Config, Index], np.ndarray]   # a block, our layout
    write: Callable[[np.ndarray, str, Qwen3Config], dict[str, np.ndarray]]


def _merged_rows(first: slice, inner: tuple[int, ...]) -> slice:
    """Rows of a flattened [prod(dims)] axis that cover ``first`` of its leading dimension (inner
    dimensions whole)."""
    size = int(np.prod(inner))
    return slice(first.start * size, first.stop * size)


def _copy(suffix: str, shape: Callable[[Qwen3Config], tuple[int, ...]]) -> _Tensor:
    return _Tensor(sources=lambda r, p, c: {p + suffix: shape(c)},
                   read=lambda r, p, c, index: r.read(p + suffix, index),
                   write=lambda a, p, c: {p + suffix: a})


def _linear(suffix: str, in_dim: Callable, out_dims: Callable) -> _Tensor:
    """nn.Linear weight [out, in] <-> ours [in, *out_dims]."""
    def sources(r, p, c):
        return {p + suffix: (int(np.prod(out_dims(c))), in_dim(c))}

    def read(r, p, c, index):
        inner = tuple(out_dims(c))[1:]
        block = r.read(p + suffix, (_merged_rows(index[1], inner), index[0])).T
        block = block.reshape(block.shape[0], index[1].stop - index[1].start, *inner)
        return block[(slice(None), slice(None), *index[2:])]

    def write(a, p, c):
        return {p + suffix: np.ascontiguousarray(a.reshape(in_dim(c), -1).T)}
    return _Tensor(sources, read, write)


def _linear_out(suffix: str, in_dims: Callable, out_dim: Callable) -> _Tensor:
    """nn.Linear weight [out, in] <-> ours [*in_dims, out] (attention output projection)."""
    def sources(r, p, c):
        return {p + suffix: (out_dim(c), int(np.prod(in_dims(c))))}

    def read(r, p, c, index):
        inner = tuple(in_dims(c))[1:]
        block = r.read(p + suffix, (index[-1], _merged_rows(index[0], inner))).T
        block = block.reshape(index[0].stop - index[0].start, *inner, block.shape[-1])
        return block[(slice(None), *index[1:-1], slice(None))]

    def write(a, p, c):
        return {p + suffix: np.ascontiguousarray(a.reshape(-1, out_dim(c)).T)}
    return _Tensor(sources, read, write)


def _experts(name: str) -> _Tensor:
    """Expert weights ours [experts, in, out] <-> hub ``mlp.experts.{j}.{name}.weight`` [out, in], or
    transformers-5 fused ``gate_up_proj`` [experts, 2·mlp, embed] / ``down_proj`` [experts, embed, mlp]."""
    def dims(c):  # (in, out) of the expert linear
        e, m = c.hidden_size, c.moe_intermediate_size
        return (m, e) if name == "down_proj" else (e, m)

    def per_expert(p, j):
        return f"{p}mlp.experts.{j}.{name}.weight"

    def fused(p):
        return f"{p}mlp.experts.{'down_proj' if name == 'down_proj' else 'gate_up_proj'}"

    def sources(r, p, c):
        n, (i, o) = c.num_experts, dims(c)
        if per_expert(p, 0) in r:
            return {per_expert(p, j): (o, i) for j in range(n)}
        if _has_fused(r, p):
            return {fused(p): (n, o, i) if name == "down_proj" else (n, 2 * o, i)}
        raise KeyError(f"tensor {per_expert(p, 0)!r} is missing from the checkpoint at {r.path} "
                       f"(nor is the fused {p}mlp.experts.down_proj there)")

    def read(r, p, c, index):
        experts, ins, outs = index
        if per_expert(p, 0) in r:
            return np.stack([r.read(per_expert(p, j), (outs, ins)).T for j in range(experts.start, experts.stop)])
        if name == "up_proj":  # second half of the fused rows
            o = dims(c)[1]
            outs = slice(outs.start + o, outs.stop + o)
        return np.swapaxes(r.read(fused(p), (experts, outs, ins)), 1, 2)

    def write(a, p, c):
        return {per_expert(p, j): np.ascontiguousarray(a[j].T) for j in range(a.shape[0])}
    return _Tensor(sources, read, write)


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
    """Our state path -> (table entry, list of HF prefixes: one per stacked layer, or one).
    Layer paths are ``stacks/<group>/layers/<name…>`` (stacked weights, ``cfg.scan_layers``) or
    ``stacks/<group>/layers/<i>/<name…>`` (the group's i-th layer stored on its own)."""
    if path and path[0] == "stacks":
        first, count, is_moe = cfg.layer_groups[int(path[1])]
        assert path[2] == "layers", path
        table = MOE_LAYER_TENSORS if is_moe else DENSE_LAYER_TENSORS
        rest, layers = path[3:], range(first, first + count)
        if not _stacked(path):
            rest, layers = path[4:], [first + int(path[3])]
        key = tuple(str(p) for p in rest)
        if key not in table:
            raise KeyError(f"no checkpoint mapping for parameter {'.'.join(map(str, path))}")
        return table[key], [f"model.layers.{i}." for i in layers]
    key = tuple(str(p) for p in path)
    if key not in TOP_LEVEL_TENSORS:
        raise KeyError(f"no checkpoint mapping for parameter {'.'.join(map(str, path))}")
    return TOP_LEVEL_TENSORS[key], [""]


def _stacked(path: tuple) -> bool:
    """Whether the parameter at ``path`` holds a run of layers on a leading axis."""
    return bool(path) and path[0] == "stacks" and not isinstance(path[3], int)


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
                    scan_layers: bool | None = None, mesh: jax.sharding.Mesh | None = None,
                    rules: ShardingRules | None = None, attention_impl: str | None = None,
                    moe_impl: str | None = None, moe_dispatch: str | None = None) -> Qwen3ForCausalLM:
    """Load a transformers Qwen3 / Qwen3-MoE checkpoint directory into a ``Qwen3ForCausalLM``.

    ``dtype`` is the parameter dtype (and the compute dtype unless ``compute_dtype`` is given). The
    model is built abstractly (no random initialisation) and filled tensor by tensor; a missing or
    mis-shaped tensor raises naming it, as do tensors the config has no place for. The layer loop
    (``scan_layers``) and the kernels default to ``kernels.default_kernels`` of the mesh's platform;
    pass ``scan_layers`` / ``attention_impl`` / ``moe_impl`` / ``moe_dispatch`` to choose.

    On ``mesh`` (None: the 1×1×1×1 mesh over one device) with ``rules`` (default ``ShardingRules()``),
    every parameter is created directly in its ``NamedSharding`` with ``jax.make_array_from_callback``:
    each process reads from the files only the blocks its own devices hold, and no parameter is
    gathered on one device; the model's config carries the mesh and rules, so its forward runs sharded.
    """
    cfg = load_config(path, param_dtype=dtype, dtype=dtype if compute_dtype is None else compute_dtype,
                      remat=remat, scan_layers=scan_layers, mesh=mesh,
                      rules=ShardingRules() if rules is None else rules)
    cfg = resolve_config(cfg.replace(attention_impl=attention_impl, moe_impl=moe_impl,
                                     moe_dispatch=moe_dispatch))
    reader = SafetensorsReader(path)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = [(path_, var, *_locate(path_, cfg)) for path_, var in nnx.to_flat_state(state)]
    for _, _, entry, prefixes in params:  # every name and shape, before any data is read
        for prefix in prefixes:
            for name, shape in entry.sources(reader, prefix, cfg).items():
                reader.check(name, shape)
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
    param_dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    for path_, var, entry, prefixes in params:
        name = ".".join(map(str, path_))
        load = _block_reader(entry, prefixes, _stacked(path_), reader, cfg, tuple(var.shape), param_dtype, name)
        sharding = cfg.rules.sharding(cfg.mesh, variable_axes(var, name), var.shape, what=name)
        value = jax.make_array_from_callback(tuple(var.shape), sharding, load)
        var.set_value(value)
    return nnx.merge(graphdef, state)


def _block_reader(entry: _Tensor, prefixes: list[str], stacked: bool, reader: SafetensorsReader,
                  cfg: Qwen3Config, shape: tuple[int, ...], dtype: np.dtype, name: str):
    """index (slices of our parameter) -> that block as a NumPy array of ``dtype``; a stacked parameter's
    leading index picks the layers. Blocks are remembered, so devices holding the same block (replicas)
    read it once."""
    blocks: dict[tuple, np.ndarray] = {}

    def load(index) -> np.ndarray:
        index = tuple(slice(*sl.indices(size)[:2]) for sl, size in zip(index, shape))
        key = tuple((sl.start, sl.stop) for sl in index)
        if key not in blocks:
            if stacked:
                layers = range(index[0].start, index[0].stop)
                block = np.stack([entry.read(reader, prefixes[i], cfg, index[1:]) for i in layers])
            else:
                block = entry.read(reader, prefixes[0], cfg, index)
            expected = tuple(sl.stop - sl.start for sl in index)
            if block.shape != expected:
                raise ValueError(f"parameter {name}: block {key} assembled with shape {block.shape}, "
                                 f"expected {expected}")
            blocks[key] = block.astype(dtype)
        return blocks[key]

    return load


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
