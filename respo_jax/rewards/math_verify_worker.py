"""One Math-Verify worker process: reads JSON-line tasks on stdin, writes JSON-line results (App. D.2).

Started by `math_verify_pool.MathVerifyScorer` as `python -m respo_jax.rewards.math_verify_worker`, a
fresh interpreter (never a fork of the trainer, whose JAX runtime is multithreaded). Math-Verify bounds
its own parsing and comparison with `signal.alarm`, which only works in a process's main thread; here it
runs in this process's main thread, so those soft timeouts work, and the parent adds a hard timeout on
top by killing this process. Messages are JSON, never pickle.

Protocol: first line out is `{"ready": true, "pid": ...}`; then for each task line
`{"id", "op", "gold", "pred", ...}` one result line `{"id", "score", "status", "soft_timeout", "detail"}`
with status "ok" or "error" (an exception that Math-Verify did not handle itself; the score is then 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, BinaryIO


class _TimeoutCounter(logging.Handler):
    """Counts Math-Verify's "Timeout during ..." warnings (its alarm fired) and swallows all its logging.

    Math-Verify logs every failed extraction with the full prediction; at thousands of completions that
    would flood the trainer's stderr, so its records stop here.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.timeouts = 0

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("Timeout"):
            self.timeouts += 1


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--math-verify-timeout-s", type=int, default=5, help="0 disables the alarm")
    parser.add_argument("--memory-limit-mb", type=int, default=0, help="address-space cap; 0 = none")
    return parser.parse_args(argv)


def _extraction_targets(specs: list[dict[str, Any]]) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    targets = []
    for spec in specs:
        kind = spec["kind"]
        options = {key: value for key, value in spec.items() if key != "kind" and value is not None}
        if kind == "latex":
            targets.append(LatexExtractionConfig(**options))
        elif kind == "expr":
            targets.append(ExprExtractionConfig(**options))
        else:
            raise ValueError(f"extraction kind must be 'latex' or 'expr'; got {kind!r}")
    return targets


def _verl_score(gold: str, pred: str) -> float:
    """verl's `math_verify.compute_score`: gold wrapped in \\boxed{}, LaTeX for gold, expr+LaTeX for pred."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, math_metric

    metric = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    score, _ = metric(["\\boxed{" + gold + "}"], [pred])
    return float(score)


def _parse_verify(task: dict[str, Any], timeout_s: int | None) -> float:
    from math_verify import parse, verify

    gold = parse(task["gold"], _extraction_targets(task["gold_targets"]), parsing_timeout=timeout_s)
    pred = parse(task["pred"], _extraction_targets(task["pred_targets"]), parsing_timeout=timeout_s)
    return float(verify(gold, pred, timeout_seconds=timeout_s, **task["verify"]))


def _handle(task: dict[str, Any], timeout_s: int | None, counter: _TimeoutCounter) -> dict[str, Any]:
    from math_verify.errors import TimeoutException

    counter.timeouts = 0
    status, detail, score = "ok", "", 0.0
    try:
        if task["op"] == "verl":
            score = _verl_score(task["gold"], task["pred"])
        elif task["op"] == "parse_verify":
            score = _parse_verify(task, timeout_s)
        else:
            raise ValueError(f"op must be 'verl' or 'parse_verify'; got {task['op']!r}")
    except TimeoutException:  # a BaseException: Math-Verify's alarm fired outside its own handlers
        counter.timeouts += 1
    except Exception as error:  # noqa: BLE001 - any failure of the verifier scores 0, as in verl
        status, detail = "error", f"{type(error).__name__}: {str(error)[:300]}"
    return {
        "id": task["id"],
        "score": score,
        "status": status,
        "soft_timeout": counter.timeouts > 0,
        "detail": detail,
    }


def _write(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message, ensure_ascii=True).encode("ascii") + b"\n")
    out.flush()


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    # Keep a private copy of stdout for the protocol and point fd 1 at stderr, so that anything a library
    # prints can never corrupt a result line.
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    if args.memory_limit_mb > 0:
        import resource

        limit = args.memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    import math_verify  # noqa: F401  (import cost paid before "ready", not inside a task's timeout)

    counter = _TimeoutCounter()
    verifier_logger = logging.getLogger("math_verify")
    verifier_logger.handlers[:] = [counter]
    verifier_logger.setLevel(logging.WARNING)
    verifier_logger.propagate = False
    timeout_s = args.math_verify_timeout_s if args.math_verify_timeout_s > 0 else None

    _write(protocol_out, {"ready": True, "pid": os.getpid()})
    for line in sys.stdin.buffer:
        task = json.loads(line)
        _write(protocol_out, _handle(task, timeout_s, counter))


if __name__ == "__main__":
    main()
