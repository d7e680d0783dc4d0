"""vLLM's CPU backend generating a rollout workload: one request per row with its own `max_tokens` and
`ignore_eos`, prefix caching on. Runs in the vLLM venv (`experiments.benchmarks.vllm_side`), not in
the project's: it imports only the standard library and vLLM. `vllm_side.run_worker` imports it there
and calls `main()` (it is not one of the project's entry points).

Request (JSON on stdin): checkpoint (a Hugging Face directory), tokenizer, prompts (`[rows]` lists of
token ids), budgets (`[rows]` new tokens each), seed, threads, block_size, kv_cache_gib, max_model_len,
max_num_seqs (the most requests decoded at once: the continuous engine's slots), warmup and rounds
(generations of the whole workload; the first `warmup` untimed).
Result (JSON on stdout, on the line that starts with `RESULT_PREFIX`): vllm and torch versions, per
round `wall_s`, `useful_tokens` and `generated_tokens`, `peak_rss_mb` (this process: vLLM's engine runs
in it) and `kv_cache_bytes` (the KV blocks vLLM allocated: blocks × block_size × bytes per token).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


RESULT_PREFIX = "vllm_worker result: "  # the result line (vLLM logs to stdout too)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _kv_cache_bytes(llm, config: dict, block_size: int) -> int | None:
    """The KV blocks vLLM allocated × their bytes (K and V over all layers, float32)."""
    engine = llm.llm_engine
    cache = getattr(engine, "cache_config", None) or engine.vllm_config.cache_config
    blocks = getattr(cache, "num_gpu_blocks", None)
    if not blocks:
        return None
    token_bytes = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    return int(blocks) * block_size * token_bytes


def main() -> int:
    request = json.loads(sys.stdin.read())
    threads = int(request["threads"])
    # Before vLLM is imported: its engine in this process (so this process's peak RSS is its own), its
    # OpenMP pool on `threads` cores, its KV cache of the requested size.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request["kv_cache_gib"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import vllm

    torch.set_num_threads(threads)
    llm = vllm.LLM(model=request["checkpoint"], tokenizer=request["tokenizer"], dtype="float32",
                   seed=request["seed"], enable_prefix_caching=True, block_size=request["block_size"],
                   max_model_len=request["max_model_len"], max_num_seqs=int(request["max_num_seqs"]))
    with open(os.path.join(request["checkpoint"], "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    prompts = [{"prompt_token_ids": list(p)} for p in request["prompts"]]
    params = [vllm.SamplingParams(max_tokens=int(b), ignore_eos=True, temperature=1.0, top_p=1.0, top_k=0,
                                  detokenize=False) for b in request["budgets"]]
    rounds = []
    for _ in range(request["warmup"] + request["rounds"]):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        rounds.append({"wall_s": wall, "generated_tokens": sum(lengths),
                       "useful_tokens": sum(min(n, int(b)) for n, b in zip(lengths, request["budgets"])),
                       "peak_rss_mb": _peak_rss_mib()})
    print(RESULT_PREFIX + json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "rounds": rounds,
                      "peak_rss_mb": _peak_rss_mib(),
                      "kv_cache_bytes": _kv_cache_bytes(llm, config, request["block_size"])}))
    return 0

