"""Scoring a batch of responses with a registered reward (`respo_jax.rewards.registry`), failures contained.

A fast reward runs in the trainer, one response after another; a slow one runs in a persistent pool of
worker processes with a hard per-call timeout (`RewardPool`: the Math-Verify pool's machinery with
`respo_jax.rewards.reward_worker` as its worker), and the built-in `math_verify` in the Math-Verify pool
itself. A response whose reward raises, returns a non-finite or non-numeric value, times out or crashes
its worker gets the reward's `failure_score`, and its status says which (FAILED, TIMED_OUT), so the
trainer can count them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import sys
from typing import Sequence

import numpy as np

from respo_jax.rewards.math_verify_pool import MathVerifyScorer, Outcome, ScorerStats
from respo_jax.rewards.registry import RewardSpec

SCORED, FAILED, TIMED_OUT = 0, 1, 2  # per-response status; TIMED_OUT responses are failed ones too


class RewardPool(MathVerifyScorer):
    """Worker processes running the slow reward `spec` (found again from `spec.source` by each worker),
    `spec.timeout_s` per call; see `MathVerifyScorer` for the pool's guarantees."""

    def __init__(self, spec: RewardSpec) -> None:
        if spec.source is None:
            raise ValueError(f"reward {spec.name!r} is not a slow reward with a source to load")
        self.spec = spec
        super().__init__(num_workers=spec.workers or min(8, os.cpu_count() or 1),
                         timeout_s=spec.timeout_s, memory_limit_mb=0)

    def _worker_argv(self, math_verify_timeout_s: int, memory_limit_mb: int) -> list[str]:
        kind, source = self.spec.source
        return [sys.executable, "-m", "respo_jax.rewards.reward_worker", f"--source-kind={kind}",
                f"--source={source}", f"--name={self.spec.name}"]

    def _worker_env(self) -> dict[str, str]:
        env = super()._worker_env()  # and whatever the trainer can import (the reward's module)
        paths = env["PYTHONPATH"].split(os.pathsep) + [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        return env

    def _check_starts(self, failed_starts: int, worker) -> None:
        if failed_starts >= 3:
            kind, source = self.spec.source
            raise RuntimeError(f"workers of reward {self.spec.name!r} fail to start ({failed_starts} "
                               f"attempts, last exit code {worker.proc.returncode}): they load the {kind} "
                               f"{source!r}; see their stderr above")

    def run_rewards(self, records: Sequence[dict], responses: Sequence[str]) -> list[Outcome]:
        """One call of the reward per (record, response), in parallel; the Outcome of each."""
        return self._run([{"op": "reward", "record": dict(record), "response": response}
                          for record, response in zip(records, responses)])


class RewardScorer:
    """`scorer(records, responses) -> (scores, status)`: the reward of each response, float32 [batch],
    and its status, int8 [batch] (SCORED, FAILED or TIMED_OUT; failed ones hold `failure_score`).
    Owns the worker pool of a slow reward, started at the first call; `close()` stops it."""

    def __init__(self, spec: RewardSpec) -> None:
        self.spec = spec
        self._pool: MathVerifyScorer | None = None

    def __call__(self, records: Sequence[dict], responses: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if len(records) != len(responses):
            raise ValueError(f"{len(records)} records and {len(responses)} responses")
        if not self.spec.slow:
            results = [self._call(record, response) for record, response in zip(records, responses)]
        else:
            if self._pool is None:
                self._pool = (MathVerifyScorer(num_workers=self.spec.workers or min(8, os.cpu_count() or 1),
                                               timeout_s=self.spec.timeout_s)
                              if self.spec.name == "math_verify" else RewardPool(self.spec))
            if self.spec.name == "math_verify":  # verl's 0/1 as ±1
                outcomes = self._pool.run_verl(list(responses), [record["answer"] for record in records])
                outcomes = [dataclasses.replace(o, score=2.0 * o.score - 1.0) for o in outcomes]
            else:
                outcomes = self._pool.run_rewards(records, responses)
            results = [self._checked(o.score) if o.status == "ok" else
                       (self.spec.failure_score, TIMED_OUT if o.status == "timeout" else FAILED)
                       for o in outcomes]
        scores = np.array([score for score, _ in results], np.float32).reshape(len(results))
        status = np.array([code for _, code in results], np.int8).reshape(len(results))
        return scores, status

    @property
    def stats(self) -> ScorerStats | None:
        """The worker pool's counters (workers started, killed on a timeout, ...); None until a slow reward's
        first call starts the pool (a fast reward has none)."""
        return None if self._pool is None else self._pool.stats

    def _call(self, record: dict, response: str) -> tuple[float, int]:
        try:
            value = self.spec.fn(record, response)
        except Exception:  # noqa: BLE001 - a failure of the reward is one failed response, not a crashed run
            return self.spec.failure_score, FAILED
        return self._checked(value)

    def _checked(self, value) -> tuple[float, int]:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return self.spec.failure_score, FAILED
        return float(value), SCORED

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
