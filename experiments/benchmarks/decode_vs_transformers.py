"""Generation throughput of our jitted JAX sampler vs `transformers.generate` (PyTorch CPU).

Both run the same random checkpoint (built with transformers, saved, loaded with
`qwen3.from_pretrained`), the same prompts and the same sampling setting (temperature 1, no
truncation, no EOS, so every row generates exactly `max_new_tokens`). transformers runs with its
default dynamic cache and with `cache_implementation="static"`; the baseline is whichever of the two
is faster at that batch size (their medians; README.md says which one won). For each
batch size the sides are timed alternately (A B C A B C ...) in one process, after one untimed warm-up
each (JAX compiles there), and the medians are compared. Throughput is generated tokens per second of a whole
`generate` call (short prompts, so the prefill is a small part of it).

    python experiments/benchmarks/decode_vs_transformers.py --config small --batch-sizes 1 8 32

`run(...)` returns the same numbers as a dict (for a benchmark suite) and, with `out_dir`, writes
`decode_vs_transformers.json` and `.md` there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import torch
import transformers

from experiments.cli import ArgumentParser, run_cli
from respo_jax.models import qwen3
from respo_jax.sampling import EngineConfig, SamplingParams, generate

# Transformers config fields of the benchmark models (random weights; architecture only).
BENCH_CONFIGS: dict[str, dict] = {
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small-moe": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True),
}
_COMMON = dict(max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False)

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _hf_model(config) -> tuple[str, transformers.PreTrainedModel]:
    """(name, transformers model with random weights) from a preset name, a field dict or a Qwen3Config."""
    if isinstance(config, str):
        if config not in BENCH_CONFIGS:
            raise KeyError(f"unknown benchmark config {config!r}; known: {sorted(BENCH_CONFIGS)}")
        name, fields = config, dict(_COMMON, **BENCH_CONFIGS[config])
    elif isinstance(config, qwen3.Qwen3Config):
        name, fields = "custom", {k: v for k, v in config.to_hf_dict().items() if k != "architectures"}
    elif isinstance(config, dict):
        name, fields = "custom", dict(_COMMON, **config)
    else:
        raise ValueError(
            f"config must be a preset name, a dict of fields or a Qwen3Config, got {type(config).__name__}"
        )
    fields.pop("model_type", None)
    moe = fields.get("num_experts", 0) > 0
    torch.manual_seed(0)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields))
    return name, model.eval()


def _time_jax(model, prompts, params, engine) -> float:
    start = time.perf_counter()
    out = generate(model, prompts, params, engine=engine)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - start


HF_CACHES = ("dynamic", "static")  # transformers' default cache, and its preallocated static cache


def _time_hf(model, input_ids, attention_mask, max_new_tokens, seed, cache: str = "dynamic") -> float:
    torch.manual_seed(seed)
    extra = {} if cache == "dynamic" else {"cache_implementation": cache}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0, **extra,
        )
    elapsed = time.perf_counter() - start
    if out.shape[1] != input_ids.shape[1] + max_new_tokens:
        generated = out.shape[1] - input_ids.shape[1]
        raise RuntimeError(f"transformers generated {generated} tokens, not {max_new_tokens}")
    return elapsed


def run(
    config_name_or_cfg="small",
    batch_sizes=(1, 8, 32),
    *,
    prompt_len: int = 16,
    max_new_tokens: int = 64,
    repeats: int = 3,
    seed: int = 0,
    out_dir: str | None = None,
) -> dict:
    """Time both samplers per batch size; return (and optionally write) the medians and ratios.

    Returns a dict: `config`, `model_fields`, `settings`, `environment`, and `results`, a list with
    one entry per batch size holding `jax_seconds` and `hf_seconds_<cache>` for each of HF_CACHES (all
    alternating repeats), `hf_cache` (the faster cache by median) with its `hf_seconds` and medians,
    the generated tokens/s of each (from the medians), `speedup` = median HF time (faster cache) /
    median JAX time, and `speedup_best` = fastest HF run / fastest JAX run.
    """
    name, hf_model = _hf_model(config_name_or_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        jax_model = qwen3.from_pretrained(tmp)
    vocab = hf_model.config.vocab_size
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    engine = EngineConfig()
    results = []
    for batch in batch_sizes:
        prompts = rng.integers(1, vocab, size=(batch, prompt_len)).tolist()
        input_ids = torch.tensor(prompts)
        attention_mask = torch.ones_like(input_ids)
        _time_jax(jax_model, prompts, params, engine)  # warm-up: compiles
        for cache in HF_CACHES:
            _time_hf(hf_model, input_ids, attention_mask, max_new_tokens, seed, cache)
        jax_s, hf_by_cache = [], {cache: [] for cache in HF_CACHES}
        for r in range(repeats):  # alternate A B C A B C so drifts in machine load hit all sides
            round_params = dataclasses.replace(params, seed=seed + r + 1)
            jax_s.append(_time_jax(jax_model, prompts, round_params, engine))
            for cache in HF_CACHES:
                hf_by_cache[cache].append(_time_hf(hf_model, input_ids, attention_mask, max_new_tokens,
                                                   seed + r + 1, cache))
        hf_cache = min(HF_CACHES, key=lambda cache: statistics.median(hf_by_cache[cache]))
        hf_s = hf_by_cache[hf_cache]
        tokens = batch * max_new_tokens
        jax_med, hf_med = statistics.median(jax_s), statistics.median(hf_s)
        results.append(dict(
            batch=batch, jax_seconds=jax_s, hf_seconds=hf_s, hf_cache=hf_cache,
            **{f"hf_seconds_{cache}": times for cache, times in hf_by_cache.items()},
            jax_median_s=jax_med, hf_median_s=hf_med,
            jax_tokens_per_s=tokens / jax_med, hf_tokens_per_s=tokens / hf_med, speedup=hf_med / jax_med,
            # Best-of-repeats ratio: on a loaded machine PyTorch's spinning threads can stall for seconds,
            # so this shows whether the median ratio owes anything to such stalls.
            speedup_best=min(hf_s) / min(jax_s),
        ))
    report = dict(
        config=name,
        model_fields={k: getattr(hf_model.config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")},
        settings=dict(prompt_len=prompt_len, max_new_tokens=max_new_tokens, repeats=repeats,
                      temperature=1.0, top_p=1.0, top_k=0, dtype="float32"),
        environment=dict(jax=jax.__version__, jax_backend=jax.default_backend(), torch=torch.__version__,
                         torch_threads=torch.get_num_threads(), transformers=transformers.__version__,
                         cpu_count=os.cpu_count(), machine=platform.machine()),
        results=results,
    )
    if out_dir is not None:
        write_report(report, out_dir)
    return report


def to_markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# Decode throughput: respo_jax sampler vs transformers.generate ({report['config']})",
        "",
        f"Model {report['model_fields']}; prompt {s['prompt_len']} tokens, {s['max_new_tokens']} new tokens, "
        f"temperature {s['temperature']}, float32; medians of {s['repeats']} alternating runs.",
        f"Environment: {report['environment']}",
        "",
        "| batch | JAX tokens/s | transformers tokens/s (faster cache) | transformers dynamic / static "
        "tokens/s | speedup (medians) | speedup (best runs) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        jax_tps, hf_tps = r["jax_tokens_per_s"], r["hf_tokens_per_s"]
        tokens = r["batch"] * s["max_new_tokens"]
        per_cache = " / ".join(f"{tokens / statistics.median(r[f'hf_seconds_{cache}']):.1f}"
                               for cache in HF_CACHES)
        lines.append(f"| {r['batch']} | {jax_tps:.1f} | {hf_tps:.1f} ({r['hf_cache']}) | {per_cache} | "
                     f"{r['speedup']:.2f}x | {r['speedup_best']:.2f}x |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_vs_transformers.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(out_dir, "decode_vs_transformers.md"), "w", encoding="utf-8") as f:
        f.write(to_markdown(report))


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", choices=sorted(BENCH_CONFIGS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    report = run(args.config, args.batch_sizes, prompt_len=args.prompt_len,
                 max_new_tokens=args.max_new_tokens, repeats=args.repeats, out_dir=args.out_dir)
    print(to_markdown(report))


if __name__ == "__main__":  # a bad flag: one line, exit status 2 (experiments.cli)
    sys.exit(run_cli(main, sys.argv[1:]))
