"""respo-jax: off-policy RL for LLM reasoning in JAX, built around ReSPO (Reshaped Sequence Policy Optimization).

Subpackages (import the one you need; nothing heavy is imported here), lower layers first:
  config      typed configuration shared by training and evaluation: the section machinery, the rollout
              engine's section (`rollout.*`, `eval.*`), `mesh.*`; imports no other subpackage
  objectives  pure policy objectives (ReSPO, VESPO, GSPO, GRPO, ...), group advantages, loss aggregation,
              App. E.3's positive-branch statistics, the objective registry
  models      Qwen3 (dense and MoE) in Flax NNX with Hugging Face safetensors in and out
  sampling    the rollout sampler `generate`: continuous batching over a paged KV cache (decode slots
              refilled as rows finish), exact log-probs of the distribution sampled from
  rewards     DAPO strict-box verifier, overlong penalty, Math-Verify evaluator, the reward registry
  data        benchmark/training datasets, prompts, tokenizers, a synthetic verifiable task
  symbolic    SymPy proofs of the paper's derivations (App. A), tied to the JAX kernels
  eval        the evaluation's protocol and statistics, rollout files, App. E.3 tables, run reports
  training    the RL trainer: experiment config, loop, jitted policy step, checkpoints, run directories

Modules:
  sharding           device meshes and the one logical-axis table (`ShardingRules`)
  distributed        multi-process start-up from the environment
  runs               a run directory's files: names, atomic writes, JSON / JSONL reads
  json_files, files  JSON reads that name file and line; file hashes and copies
  registry           the name -> spec registry behind `OBJECTIVES` and `REWARDS`
  compilation_cache  the persistent compilation cache's shared state (read-only, failed writes)
  programs           the one jit wrapper (`Program`, `jit_program`) of the trainer's, the evaluation's and
                     the engine's programs
  exported_programs  traced programs kept on disk beside the compilation cache for fast relaunches
  host_allocator     XLA:CPU host-memory settings applied at start-up
"""

__version__ = "0.1.0"
