"""Math-Verify scoring of evaluation completions in a persistent pool of worker processes (App. D.2).

The paper scores every benchmark completion with Math-Verify exactly as verl does (the gold answer
wrapped in `\\boxed{}` and parsed as LaTeX; the completion parsed as expression and LaTeX; 1 if they
verify as equal, else 0). Math-Verify bounds its work with `signal.alarm`, which fails outside a main
thread and cannot interrupt long C-level SymPy work, and a trainer's JAX runtime must not be forked.
So the scorer runs Math-Verify in fresh interpreter processes (`respo_jax.rewards.math_verify_worker`,
started with spawn semantics: a new `python -m ...`, not `fork`) that talk JSON lines over pipes,
enforces a hard per-call timeout by killing and replacing the worker, recycles every worker after a
fixed number of tasks, and scores a timed-out or crashed call 0 while the rest of the batch proceeds.

A plain `subprocess` pool is used rather than `multiprocessing`: `multiprocessing`'s spawn start method
re-imports the parent's `__main__` (a training script, with JAX) in every worker and moves data with
pickle; a worker launched as a module imports only Math-Verify and exchanges JSON.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any, Literal, NamedTuple, Sequence

import numpy as np

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Extraction:
    """One Math-Verify extraction target as plain data: `LatexExtractionConfig` or `ExprExtractionConfig`.

    `None` fields keep Math-Verify's defaults (`boxed_match_priority=50`, `try_extract_without_anchor=True`).
    """

    kind: Literal["latex", "expr"]
    boxed_match_priority: int | None = None  # latex only
    try_extract_without_anchor: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("latex", "expr"):
            raise ValueError(f"Extraction.kind must be 'latex' or 'expr'; got {self.kind!r}")
        if self.kind == "expr" and self.boxed_match_priority is not None:
            raise ValueError("boxed_match_priority applies to kind='latex' only; got it for kind='expr'")


LATEX = Extraction("latex")
EXPR = Extraction("expr")


@dataclasses.dataclass(frozen=True)
class VerifyCall:
    """A general `verify(parse(gold, gold_targets), parse(pred, pred_targets), ...)` call.

    The defaults are Math-Verify's own (`parse` with LaTeX then expression targets; `verify` with
    `float_rounding=6, strict=True, allow_set_relation_comp=False`), so `VerifyCall(gold, pred)` is
    `verify(parse(gold), parse(pred))`. The paper's scorer is `MathVerifyScorer.score_batch`, not this.
    """

    gold: str
    pred: str
    gold_targets: tuple[Extraction, ...] = (LATEX, EXPR)
    pred_targets: tuple[Extraction, ...] = (LATEX, EXPR)
    float_rounding: int = 6
    strict: bool = True
    allow_set_relation_comp: bool = False

    def task(self) -> dict[str, Any]:
        for name in ("gold", "pred"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"VerifyCall.{name} must be a str; got {type(getattr(self, name)).__name__}")
        return {
            "op": "parse_verify",
            "gold": self.gold,
            "pred": self.pred,
            "gold_targets": [dataclasses.asdict(target) for target in self.gold_targets],
            "pred_targets": [dataclasses.asdict(target) for target in self.pred_targets],
            "verify": {
                "float_rounding": self.float_rounding,
                "strict": self.strict,
                "allow_set_relation_comp": self.allow_set_relation_comp,
            },
        }


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What happened to one call: its score and why.

    status: "ok" (Math-Verify answered; `soft_timeout` says whether its own alarm fired, which scores 0),
    "error" (Math-Verify raised; 0), "timeout" (the hard timeout killed the worker; 0), "crash" (the
    worker died, e.g. out of memory; 0). `seconds` runs from dispatch to answer.
    """

    score: float
    status: Literal["ok", "error", "timeout", "crash"]
    seconds: float
    soft_timeout: bool = False
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class ScorerStats:
    """Counters over the scorer's lifetime (a snapshot)."""

    calls: int = 0
    correct: int = 0
    hard_timeouts: int = 0  # worker killed at `timeout_s`
    soft_timeouts: int = 0  # Math-Verify's own alarm fired; the worker survived
    errors: int = 0
    crashes: int = 0
    workers_started: int = 0
    workers_recycled: int = 0  # retired after `max_tasks_per_worker` tasks
    workers_killed: int = 0  # killed on a hard timeout


class _InFlight(NamedTuple):
    """The call a worker is busy with: its place in the batch, its protocol id and its time limits."""

    slot: int
    task_id: int
    start: float
    deadline: float


class _Worker:
    """One worker process and the parent's view of it."""

    def __init__(self, argv: list[str], env: dict[str, str], start_timeout_s: float) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buffer = bytearray()
        self.ready = False
        self.start_deadline = time.monotonic() + start_timeout_s
        self.tasks_done = 0
        self.task: _InFlight | None = None

    def read_lines(self) -> list[bytes] | None:
        """Complete lines available now; None once the worker has closed its stdout (it exited)."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:  # spurious wake-up: nothing to read yet
            return []
        if not chunk:
            return None
        self.buffer += chunk
        *lines, rest = self.buffer.split(b"\n")
        self.buffer = bytearray(rest)
        return lines

    def send(self, payload: bytes) -> bool:
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._close_pipes()

    def retire(self, grace_s: float = 2.0) -> None:
        """Ask the worker to exit (EOF on its stdin); kill it if it does not within `grace_s`."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class MathVerifyScorer:
    """A persistent pool of Math-Verify worker processes for scoring thousands of completions.

        with MathVerifyScorer(num_workers=8) as scorer:
            scores = scorer.score_batch(completions, gold_answers)   # float32 [batch] of 0/1
            print(scorer.stats)

    Every call ends within `timeout_s` of reaching a worker (plus the moment it takes to notice); a call
    that runs longer is scored 0, its worker is killed and replaced, and the other calls of the batch are
    unaffected. Workers are
    started at construction (their imports are not charged to any call) and kept between batches.
    Not thread-safe for concurrent batches: a lock serializes them.

    Args:
      num_workers: worker processes (default: the CPU count, at most 32 as in verl).
      timeout_s: hard wall-clock limit per call. verl's own pool uses 20 s, which covers Math-Verify's
        internal limits (5 s per parse, 5 s per comparison, 2 s for printing).
      math_verify_timeout_s: the `parsing_timeout`/`timeout_seconds` (integer seconds, `signal.alarm`)
        given to Math-Verify for `verify_batch` calls; 0 disables them. `score_batch` runs verl's exact
        `math_metric` call, which always uses Math-Verify's defaults (5 s).
      max_tasks_per_worker: a worker is replaced after this many calls (bounds SymPy cache growth).
      memory_limit_mb: address-space limit of each worker (`RLIMIT_AS`); 0 for none.
      start_timeout_s: how long a worker may take to import Math-Verify before the scorer gives up.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = 20.0,
        math_verify_timeout_s: int = 5,
        max_tasks_per_worker: int = 1000,
        memory_limit_mb: int = 4096,
        start_timeout_s: float = 120.0,
    ) -> None:
        if num_workers is None:
            num_workers = min(32, os.cpu_count() or 1)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1; got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {timeout_s!r}")
        if not isinstance(math_verify_timeout_s, int) or math_verify_timeout_s < 0:
            raise ValueError(f"math_verify_timeout_s must be an int >= 0 (signal.alarm takes whole seconds); "
                             f"got {math_verify_timeout_s!r}")
        if not isinstance(max_tasks_per_worker, int) or max_tasks_per_worker < 1:
            raise ValueError(f"max_tasks_per_worker must be an int >= 1; got {max_tasks_per_worker!r}")
        if not isinstance(memory_limit_mb, int) or memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be an int >= 0; got {memory_limit_mb!r}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.max_tasks_per_worker = max_tasks_per_worker
        self.start_timeout_s = float(start_timeout_s)
        self._argv = self._worker_argv(math_verify_timeout_s, memory_limit_mb)
        self._env = self._worker_env()
        self._selector = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._stats = collections.Counter()
        self._next_id = 0
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(num_workers):
            self._start_worker()

    # ----------------------------------------------------------------------------------------- public

    def score_batch(self, solutions: Sequence[str], golds: Sequence[str]) -> np.ndarray:
        """verl's Math-Verify score of each completion.

        solutions: [batch] completions; golds: [batch] gold answers (LaTeX, without `\\boxed{}`).
        Returns float32 [batch] of 0.0/1.0.
        """
        return _scores(self.run_verl(solutions, golds))

    def run_verl(self, solutions: Sequence[str], golds: Sequence[str]) -> list[Outcome]:
        """`score_batch` with the full `Outcome` of each call."""
        if len(solutions) != len(golds):
            raise ValueError(
                f"solutions and golds must have the same length; got {len(solutions)} and {len(golds)}"
            )
        tasks = []
        for index, (solution, gold) in enumerate(zip(solutions, golds)):
            if not isinstance(solution, str) or not isinstance(gold, str):
                raise ValueError(
                    f"item {index}: solution and gold must be str; got {type(solution).__name__} and "
                    f"{type(gold).__name__}"
                )
            tasks.append({"op": "verl", "gold": gold, "pred": solution})
        return self._run(tasks)

    def verify_batch(self, calls: Sequence[VerifyCall]) -> np.ndarray:
        """General `parse`/`verify` calls (see `VerifyCall`): calls [batch] -> float32 [batch] of 0/1."""
        return _scores(self.run_calls(calls))

    def run_calls(self, calls: Sequence[VerifyCall]) -> list[Outcome]:
        """`verify_batch` with the full `Outcome` of each call."""
        return self._run([call.task() for call in calls])

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for monitoring)."""
        return [worker.proc.pid for worker in self._workers]

    @property
    def stats(self) -> ScorerStats:
        names = [field.name for field in dataclasses.fields(ScorerStats)]
        return ScorerStats(**{name: self._stats[name] for name in names})

    def close(self) -> None:
        """Stop all workers. Idempotent; the scorer cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in list(self._workers):
                self._remove(worker)
                worker.retire()
            self._selector.close()

    def __enter__(self) -> "MathVerifyScorer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down modules already
            pass

    # ---------------------------------------------------------------------------------------- private

    def _worker_argv(self, math_verify_timeout_s: int, memory_limit_mb: int) -> list[str]:
        """The command line of one worker (a subclass runs another worker with the same protocol)."""
        return [
            sys.executable,
            "-m",
            "respo_jax.rewards.math_verify_worker",
            f"--math-verify-timeout-s={math_verify_timeout_s}",
            f"--memory-limit-mb={memory_limit_mb}",
        ]

    def _worker_env(self) -> dict[str, str]:
        """The workers' environment: the parent's, with this package importable."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        return env

    def _start_worker(self) -> _Worker:
        worker = _Worker(self._argv, self._env, self.start_timeout_s)
        self._selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
        self._workers.append(worker)
        self._stats["workers_started"] += 1
        return worker

    def _remove(self, worker: _Worker) -> None:
        self._workers.remove(worker)
        self._selector.unregister(worker.proc.stdout)

    def _run(self, tasks: list[dict[str, Any]]) -> list[Outcome]:
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifyScorer is closed")
            try:
                return self._run_locked(tasks)
            except BaseException:
                # Interrupted (Ctrl-C, a failed start): kill the workers still busy with this batch so
                # that none of their late answers can land in a later batch; idle workers stay.
                for worker in list(self._workers):
                    if worker.task is not None:
                        self._remove(worker)
                        worker.kill()
                raise

    def _run_locked(self, tasks: list[dict[str, Any]]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(tasks)
        queue = collections.deque(range(len(tasks)))
        remaining = len(tasks)
        failed_starts = 0
        while remaining:
            while len(self._workers) < self.num_workers:
                self._start_worker()
            for worker in self._workers:
                if worker.ready and worker.task is None and queue:
                    self._dispatch(worker, queue.popleft(), tasks, queue)
            now = time.monotonic()
            deadlines = [w.task.deadline for w in self._workers if w.task is not None]
            deadlines += [w.start_deadline for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.0
            for key, _ in self._selector.select(timeout=wait_s):
                worker = key.data
                lines = worker.read_lines()
                try:
                    messages = [json.loads(line) for line in lines or []]
                except ValueError:  # a garbled line: treat the worker as crashed
                    messages, lines = [], None
                for message in messages:
                    remaining -= self._on_message(worker, message, outcomes)
                if lines is None:  # the worker exited (or garbled its output)
                    self._remove(worker)
                    worker.kill()
                    if worker.task is not None:
                        remaining -= self._finish(worker, outcomes, "crash", "worker exited mid-call")
                    elif not worker.ready:
                        failed_starts += 1
                        self._check_starts(failed_starts, worker)
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.task is not None and now >= worker.task.deadline:
                    self._remove(worker)
                    worker.kill()
                    self._stats["workers_killed"] += 1
                    remaining -= self._finish(worker, outcomes, "timeout", f"killed after {self.timeout_s} s")
                elif not worker.ready and now >= worker.start_deadline:
                    self._remove(worker)
                    worker.kill()
                    failed_starts += 1
                    self._check_starts(failed_starts, worker)
        while len(self._workers) < self.num_workers:  # replace killed/retired workers now, not next batch
            self._start_worker()
        return [outcome for outcome in outcomes if outcome is not None]

    def _check_starts(self, failed_starts: int, worker: _Worker) -> None:
        if failed_starts >= 3:
            raise RuntimeError(
                f"Math-Verify workers fail to start ({failed_starts} attempts; last exit code "
                f"{worker.proc.returncode}); is `math-verify` installed for {sys.executable}? "
                "See the worker's stderr above."
            )

    def _dispatch(
        self, worker: _Worker, slot: int, tasks: list[dict[str, Any]], queue: collections.deque
    ) -> None:
        task_id = self._next_id
        self._next_id += 1
        start = time.monotonic()
        worker.task = _InFlight(slot, task_id, start, start + self.timeout_s)
        payload = json.dumps({"id": task_id, **tasks[slot]}, ensure_ascii=True).encode("ascii") + b"\n"
        if not worker.send(payload):
            # The worker died while idle: give the task back and let the read loop see the exit.
            worker.task = None
            queue.appendleft(slot)

    def _on_message(self, worker: _Worker, message: dict[str, Any], outcomes: list[Outcome | None]) -> int:
        if message.get("ready"):
            worker.ready = True
            return 0
        if worker.task is None or message.get("id") != worker.task.task_id:
            return 0  # not the answer to the call in flight: ignore rather than misattribute
        soft = bool(message["soft_timeout"])
        self._stats["soft_timeouts"] += int(soft)
        done = self._finish(worker, outcomes, message["status"], message["detail"], message["score"], soft)
        worker.tasks_done += 1
        if worker.tasks_done >= self.max_tasks_per_worker:
            self._remove(worker)
            worker.retire()
            self._stats["workers_recycled"] += 1
        return done

    def _finish(
        self,
        worker: _Worker,
        outcomes: list[Outcome | None],
        status: str,
        detail: str,
        score: float = 0.0,
        soft: bool = False,
    ) -> int:
        """Record the outcome of `worker`'s call; returns 1 (one call of the batch done)."""
        call, worker.task = worker.task, None
        score = float(score) if status == "ok" else 0.0
        outcomes[call.slot] = Outcome(score, status, time.monotonic() - call.start, soft, detail)
        self._stats["calls"] += 1
        self._stats["correct"] += int(score == 1.0)
        failure_counter = {"error": "errors", "timeout": "hard_timeouts", "crash": "crashes"}.get(status)
        if failure_counter is not None:
            self._stats[failure_counter] += 1
        return 1


def _scores(outcomes: list[Outcome]) -> np.ndarray:
    return np.asarray([outcome.score for outcome in outcomes], dtype=np.float32).reshape(len(outcomes))


_default_scorer: MathVerifyScorer | None = None
_default_lock = threading.Lock()


def math_verify_score(solution: str, gold: str, timeout_s: float = 20.0) -> float:
    """verl's Math-Verify score (0.0 or 1.0) of one completion against one gold answer (App. D.2).

    Runs in a lazily created module-level one-worker `MathVerifyScorer` (closed at interpreter exit), so
    one call never hangs and works from any thread; calls are serialized. For many completions use
    `MathVerifyScorer.score_batch`, which runs them in parallel.
    """
    global _default_scorer
    with _default_lock:
        if _default_scorer is None or _default_scorer.timeout_s != timeout_s:
            if _default_scorer is not None:
                _default_scorer.close()
            _default_scorer = MathVerifyScorer(num_workers=1, timeout_s=timeout_s)
        return float(_default_scorer.score_batch([solution], [gold])[0])


@atexit.register
def _close_default_scorer() -> None:
    if _default_scorer is not None:
        _default_scorer.close()
