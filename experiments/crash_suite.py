"""Randomized crash tests: kill a training run with SIGKILL and SIGTERM at random points, resume it, and
compare it with an uninterrupted run.

    python -m experiments.crash_suite --out /tmp/crash --seed 7 [training overrides ...]

The kill points are chosen by progress through what the run writes (its lock file, metrics.jsonl's
records, rollout files, checkpoint folders), never by wall time, so a loaded machine still hits every
phase: start-up, warm-up, rollout, update, checkpoint save and final evaluation. One training run is
killed at one point of each phase in turn (each resume continues from the previous kill), with SIGTERM
or SIGKILL drawn per point from `--seed`, which is printed first so that a failure replays. Each point
is drawn when its process starts, beyond everything the earlier kills left (a SIGTERM may let the run go
one step past its point), so the process being killed is the one that reaches it. What is checked:
- SIGTERM: exit status 143 and exactly one line on stderr (`stopped: SIGTERM ...`, no traceback), and
  the checkpoint it names is the iteration the log reached (the step in flight), in the warm-up the
  warm-up step it reached, or none before the first step; a signal during the final evaluation may
  let the run finish (exit status 0);
- SIGKILL: the process is gone (the resume repairs what it left);
- after the last resume: metrics.jsonl (timings aside) equals the uninterrupted run's.
Exit status 0 when every check holds, else 1 with one line per failed check.

`tests/test_preemption.py` runs it (slow) on the tiny configuration of `tests/tiny_runs.py`, and uses
`crash_command` to kill an evaluation's sampler call and a sweep's cell the same way, comparing their
outputs and the last checkpoint's arrays bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Callable

from respo_jax import runs
from respo_jax.training.checkpoint import MANIFEST, list_steps
from respo_jax.training.warmup_checkpoint import WARMUP_DIR

POLL_SECONDS = 0.01


@dataclasses.dataclass(frozen=True)
class KillPoint:
    """Kill with `signum` when `reached(out_dir)` first holds: `phase` is what the run is doing then."""

    phase: str
    where: str
    signum: int
    reached: Callable[[str], bool]


def complete_records(path: str) -> int:
    """Newline-terminated lines of a JSONL file (0 when absent)."""
    try:
        with open(path, "rb") as handle:
            return handle.read().count(b"\n")
    except OSError:
        return 0


def _held_by(pid: int) -> Callable[[str], bool]:
    def reached(out_dir: str) -> bool:
        try:
            with open(os.path.join(out_dir, ".lock"), encoding="utf-8") as handle:
                return json.loads(handle.read()).get("pid") == pid
        except (OSError, ValueError):
            return False
    return reached


def _records(count: int) -> Callable[[str], bool]:
    return lambda out_dir: complete_records(os.path.join(out_dir, runs.METRICS_FILE)) >= count


def _rollout_file(iteration: int) -> Callable[[str], bool]:
    return lambda out_dir: os.path.exists(os.path.join(out_dir, runs.ROLLOUT_DIR,
                                                       runs.rollout_file_name(iteration)))


def _checkpoint_entries(out_dir: str) -> list[int]:
    """The steps with an entry in checkpoints/: finished, or begun (Orbax's temporary folder) or set aside."""
    try:
        names = os.listdir(os.path.join(out_dir, runs.CHECKPOINT_DIR))
    except OSError:
        return []
    return sorted({int(name.split(".")[0]) for name in names if name.split(".")[0].isdigit()})


def _checkpoint_started(step: int) -> Callable[[str], bool]:
    """An entry of checkpoints/ for `step` exists (Orbax's temporary folder while it saves)."""
    return lambda out_dir: step in _checkpoint_entries(out_dir)


def _checkpoint_finished(step: int) -> Callable[[str], bool]:
    return lambda out_dir: os.path.exists(os.path.join(out_dir, runs.CHECKPOINT_DIR, str(step), MANIFEST))


PHASES = ("start-up", "warm-up", "rollout", "update", "checkpoint save", "final evaluation")


@dataclasses.dataclass(frozen=True)
class Left:
    """What the kills so far left in a run directory, read before the next launch: complete metrics
    records, the last RL iteration they log, the last rollout file's iteration and the steps with an
    entry in checkpoints/. A kill point is chosen beyond all of them, so that only the process about to
    be killed can reach it (a resume first cuts the log and the rollout files back to its checkpoint)."""

    records: int
    iteration: int
    rollout: int
    checkpoints: tuple[int, ...]

    @classmethod
    def read(cls, out_dir: str) -> "Left":
        records = runs.read_jsonl(os.path.join(out_dir, runs.METRICS_FILE)).records
        try:
            names = os.listdir(os.path.join(out_dir, runs.ROLLOUT_DIR))
        except OSError:
            names = []
        rollouts = [int(m.group(1)) for m in map(runs.ROLLOUT_FILE.fullmatch, names) if m]
        return cls(complete_records(os.path.join(out_dir, runs.METRICS_FILE)),
                   max([r["iteration"] for r in records if r.get("phase") == "rl"], default=0),
                   max(rollouts, default=0), tuple(_checkpoint_entries(out_dir)))


def training_point(phase: str, rng: random.Random, left: Left, warmup_steps: int, iterations: int,
                   checkpoint_every: int, evaluates: bool) -> tuple[str, Callable[[str], bool] | None] | None:
    """(where, event) of a kill point of `phase` that only the next process can reach, given what the
    earlier kills `left`; None when the run has no room left for it. The start-up event (None) is the
    lock file of the process being killed. The update point leaves room for a checkpoint save after
    it, before the last one, even when its SIGTERM lands after a step boundary and the run goes one
    iteration further."""
    assert warmup_steps >= 2 and iterations >= 6 and checkpoint_every >= 3
    first_rl = warmup_steps + int(evaluates)  # records before RL iteration 1
    done = max(left.iteration, left.rollout, max(left.checkpoints, default=0))
    saves = list(range(checkpoint_every, iterations, checkpoint_every))  # the periodic checkpoints
    if phase == "start-up":
        return "the process took the run directory's lock", None
    if phase == "warm-up":
        step = left.records + 1
        return (f"warm-up step {step} logged", _records(step)) if step <= warmup_steps else None
    if phase == "rollout":  # iteration `after` logged: the next one's rollout runs
        after = done + rng.randint(1, 2)
        return (f"RL iteration {after} logged", _records(first_rl + after)) if after <= iterations else None
    if phase == "update":  # its rollout file: the update runs
        room = (saves[-1] - 2) if saves else iterations - 1
        update_of = max(done + 1, min(done + rng.randint(1, 2), room))
        return (f"rollout file of iteration {update_of} written", _rollout_file(update_of)
                ) if update_of <= iterations else None
    if phase == "checkpoint save":
        save = next((step for step in saves if step > done), iterations)
        return (f"checkpoint step {save} begun", _checkpoint_started(save)) if save > done else None
    if phase == "final evaluation" and iterations not in left.checkpoints:
        return f"the last checkpoint (step {iterations}) finished", _checkpoint_finished(iterations)
    return None


def launch(command: list[str], env: dict, cwd: str) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def kill_at(process: subprocess.Popen, out_dir: str, reached: Callable[[str], bool] | None,
            signum: int, timeout: float) -> tuple[bool, str]:
    """Waits until `reached(out_dir)` (None: this process holds the lock), sends `signum`; returns
    (whether the signal was sent before the process ended, its stderr)."""
    reached = reached or _held_by(process.pid)
    deadline = time.monotonic() + timeout
    sent = False
    while process.poll() is None and time.monotonic() < deadline:
        if reached(out_dir):
            process.send_signal(signum)
            sent = True
            break
        time.sleep(POLL_SECONDS)
    _, stderr = process.communicate(timeout=timeout)
    return sent, stderr


def check_stopped(returncode: int, stderr: str, signum: int, out_dir: str, phase: str) -> list[str]:
    """What is wrong with how a killed process ended (empty: nothing)."""
    if signum == signal.SIGKILL:
        return [] if returncode == -signal.SIGKILL else [f"{phase}: SIGKILL gave exit status {returncode}"]
    problems = []
    if returncode == 0 and phase == "evaluation":
        return []  # the sampler call in flight was the last one
    if returncode == 0 and phase == "final evaluation":  # it finished, and with it the run
        if "came during the final evaluation: it finished" not in stderr or "Traceback" in stderr:
            return [f"{phase}: the run finished without its line: {stderr[-2000:]}"]
        return []
    if returncode != 128 + signum:
        problems.append(f"{phase}: {signal.Signals(signum).name} gave exit status {returncode}, "
                        f"expected {128 + signum}: {stderr[-2000:]}")
    lines = [line for line in stderr.splitlines() if line.startswith("stopped: ")]
    if len(lines) != 1 or "Traceback" in stderr or "error:" in stderr:
        problems.append(f"{phase}: expected one 'stopped:' line, got: {stderr[-2000:]}")
    if out_dir is None or not lines:
        return problems
    records = runs.read_jsonl(os.path.join(out_dir, runs.METRICS_FILE)).records
    iterations = [r["iteration"] for r in records if r["phase"] == "rl"]
    steps = list_steps(os.path.join(out_dir, runs.CHECKPOINT_DIR))
    if iterations or "checkpoint step" in lines[0]:
        in_flight = iterations[-1] if iterations else 0
        if not steps or steps[-1] != in_flight or f"checkpoint step {in_flight} saved" not in lines[0]:
            problems.append(f"{phase}: the log reached iteration {in_flight}, the checkpoints are {steps}: "
                            f"{lines[0]}")
    elif "warm-up checkpoint at step" in lines[0]:  # the warm-up steps logged: the step in flight
        steps = list_steps(os.path.join(out_dir, runs.CHECKPOINT_DIR, WARMUP_DIR))
        warmups = [r for r in records if r["phase"] == "warmup"]
        if not steps or steps[-1] != len(warmups) or f"at step {len(warmups)} of" not in lines[0]:
            problems.append(f"{phase}: the log reached warm-up step {len(warmups)}, the warm-up checkpoints "
                            f"are {steps}: {lines[0]}")
    elif "no checkpoint yet" not in lines[0]:
        problems.append(f"{phase}: before the first checkpoint the line says: {lines[0]}")
    return problems


def random_signals(rng: random.Random, phases: tuple[str, ...]) -> list[tuple[str, int]]:
    """Every phase, each with SIGTERM or SIGKILL drawn from `rng`."""
    return [(phase, rng.choice((signal.SIGTERM, signal.SIGKILL))) for phase in phases]


def every_phase_one_sigint(rng: random.Random, phases: tuple[str, ...]) -> list[tuple[str, int]]:
    """Every phase with SIGTERM, but for one RL phase (rollout or update, drawn from `rng`) with SIGINT
    (Ctrl-C), which must stop the run the same way (exit status 130)."""
    sigint = rng.choice(("rollout", "update"))
    return [(phase, signal.SIGINT if phase == sigint else signal.SIGTERM) for phase in phases]


def some_phases(signum: int, count: int) -> Callable[[random.Random, tuple[str, ...]], list[tuple[str, int]]]:
    """`count` phases drawn from `rng` (in the run's order), each with `signum`."""
    return lambda rng, phases: [(phases[i], signum) for i in sorted(rng.sample(range(len(phases)), count))]


def crash_training(command: Callable[..., list[str]], env: dict, cwd: str, out_dir: str, seed: int,
                   warmup_steps: int, iterations: int, checkpoint_every: int, evaluates: bool,
                   choose: Callable = random_signals, timeout: float = 300) -> tuple[list[str], list[str]]:
    """Kills one training run in the phases `choose(rng, PHASES)` picks, with the signal it gives each,
    in turn, resuming after each, then resumes it to the end; each kill point is drawn from `rng` when
    its process starts, beyond what the kills before it left (`training_point`). `command(out_dir,
    *overrides)` is the training command line. Returns (what happened, one line per kill; problems)."""
    rng = random.Random(seed)
    log, problems = [], []
    for index, (phase, signum) in enumerate(choose(rng, PHASES)):
        point = training_point(phase, rng, Left.read(out_dir), warmup_steps, iterations, checkpoint_every,
                               evaluates)
        name = signal.Signals(signum).name
        if point is None:
            log.append(f"{name} at {phase}: skipped, the kills before it left no room")
            continue
        where, reached = point
        extra = ("run.resume=true",) if index else ()
        process = launch(command(out_dir, *extra), env, cwd)
        sent, stderr = kill_at(process, out_dir, reached, signum, timeout)
        if not sent:
            problems.append(f"{phase}: the run ended (status {process.returncode}) before {where}: "
                            f"{stderr[-2000:]}")
            continue
        log.append(f"{name} at {phase} ({where}): exit status {process.returncode}")
        problems += check_stopped(process.returncode, stderr, signum, out_dir, phase)
    final = subprocess.run(command(out_dir, "run.resume=true"), cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=timeout)
    if final.returncode != 0:
        problems.append(f"the last resume failed ({final.returncode}): {final.stderr[-2000:]}")
    return log, problems


def crash_command(command: list[str], env: dict, cwd: str, progress: Callable[[], int], at: int,
                  signum: int, phase: str, timeout: float = 300) -> tuple[int | None, str]:
    """Runs `command` (an evaluation, a sweep), sends `signum` once `progress() >= at`, and reruns it to
    the end; returns (the killed process's exit status, None when it ended before the point; what went
    wrong, "" when nothing: `check_stopped`'s problems of `phase`, or the rerun's failure)."""
    process = launch(command, env, cwd)
    sent, stderr = kill_at(process, "", lambda _: progress() >= at, signum, timeout)
    status = process.returncode if sent else None
    rerun = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if status is not None:
        problems = check_stopped(status, stderr, signum, None, phase)
        if problems:
            return status, "; ".join(problems)
    if rerun.returncode != 0:
        return status, f"rerun failed ({rerun.returncode}): {rerun.stderr[-2000:]}"
    return status, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a folder for the runs")
    parser.add_argument("--seed", type=int, default=None, help="the kill points' seed (default: random)")
    parser.add_argument("overrides", nargs="*",
                        help="training overrides (warm-up >= 2 steps, >= 6 iterations)")
    args = parser.parse_args(argv)
    seed = random.randrange(2**31) if args.seed is None else args.seed
    print(f"crash suite seed {seed}", flush=True)
    env = dict(os.environ)
    overrides = ["run.iterations=8", "run.checkpoint_every=3", "warmup.steps=2", "run.progress=false",
                 *args.overrides]

    def command(out_dir: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "experiments.train", *overrides, f"run.out_dir={out_dir}", *extra]

    reference, crashed = os.path.join(args.out, "reference"), os.path.join(args.out, "crashed")
    subprocess.run(command(reference), check=True, env=env)
    log, problems = crash_training(command, env, os.getcwd(), crashed, seed, 2, 8, 3, True)
    print("\n".join(log))
    want = runs.read_jsonl(os.path.join(reference, runs.METRICS_FILE)).records
    got = runs.read_jsonl(os.path.join(crashed, runs.METRICS_FILE)).records
    timing = ("rollout_seconds", "iteration_seconds", "compiles", "compile_seconds", "compile_cache_hits")
    strip = lambda records: [{k: v for k, v in r.items() if k not in timing} for r in records]  # noqa: E731
    if strip(got) != strip(want):
        problems.append("metrics.jsonl differs from the uninterrupted run's")
    print("\n".join(problems) or "every resume equals the uninterrupted run")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
