"""Default evaluation: the paper's protocol (§4.1, App. D.2) on its six benchmarks.

16 samples per problem on AIME 2025, AIME 2024 and AMC 2023, 4 on OlympiadBench, Minerva Math and
MATH-500; temperature 1.0, top-p 0.7, no top-k, up to 16,384 new tokens; Math-Verify scoring; the macro
average with its cluster-bootstrap standard error (App. D.3). Only `eval.checkpoint` must be given.

Sampling runs on the continuous engine (`eval.scheduler`): calls of 256 rows through 32 decode slots
whose page pool holds every slot's longest row (the K/V memory of a 32-row static batch at the cap);
`eval.kv_cache_bytes` sets a smaller pool (admission then waits for pages when long rows hold them),
`eval.scheduler=static` the static batch.
"""

from respo_jax.eval.config import EvalConfig


def get_config() -> EvalConfig:
    return EvalConfig()  # the defaults are the paper's protocol
