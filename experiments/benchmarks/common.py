"""Measurement plumbing shared by every benchmark: A/B alternation, sides in processes of their own,
medians and ratios, peak memory, and the JSON + markdown writers.

Why alternation: on a shared CPU the machine's speed drifts over seconds (other processes, frequency,
page cache). Running the sides in turn (A B A B …) inside one process exposes both to the same drift,
and the median of the per-round ratios cancels most of it, where two separate runs would not.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from typing import Callable, Mapping, Sequence

from respo_jax.host_allocator import host_allocator_settings

# Both frameworks get the same number of threads: all cores of the machine unless overridden.
DEFAULT_THREADS = int(os.environ.get("RESPO_BENCH_THREADS", os.cpu_count() or 1))
_TORCH_SETTINGS = {"flush_denormal": False}  # what configure_threads set (torch has no getter)


def configure_threads(threads: int = DEFAULT_THREADS) -> int:
    """Pin PyTorch's intra-op pool to `threads` (XLA's CPU client already sizes its pool to every core of
    the machine) and make PyTorch flush denormal floats to zero, as XLA:CPU does by default.

    Without the flush, PyTorch's train step slows down by orders of magnitude on steps where AdamW's
    second moments or the gradients of a freshly initialized model underflow into the denormal range
    (README.md), which would make the comparison say more about denormal arithmetic than about either
    framework. Returns `threads`.
    """
    import torch

    torch.set_num_threads(threads)
    _TORCH_SETTINGS["flush_denormal"] = bool(torch.set_flush_denormal(True))
    return threads


def alternate(sides: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 1,
              cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Times each side `rounds` times, interleaved A B A B …, after `warmup` untimed calls of each.

    Every callable must block until its work is finished (e.g. end in `block_until_ready`), since the
    wall clock is read around it. Returns {side: [seconds per round]}, rounds in call order. With a
    `cpu` dict, also fills it with the process CPU seconds (user + system, all threads) of each call:
    on a machine shared with other jobs, wall time includes waiting for a core, CPU time does not.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    if not sides:
        raise ValueError("alternate() needs at least one side to time")
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    if cpu is not None:
        cpu.update({name: [] for name in sides})
    for _ in range(rounds):
        for name, fn in sides.items():
            cpu_start = process_cpu_seconds()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            if cpu is not None:
                cpu[name].append(process_cpu_seconds() - cpu_start)
    return times


class SpawnedSide:
    """One benchmark side in a spawned process of its own, driven over a pipe by the parent: sides in
    separate processes never share an allocator, thread pools or page-cache state, and one waits idle
    on its pipe while the other runs.

    `target(conn, *args)` runs in the child and answers every request with ("ok", payload) or
    ("error", traceback text). `_reply()` returns the next payload, raising RuntimeError with the
    child's traceback on "error" and TimeoutError after `timeout_s`; `close()` sends the subclass's
    `stop_message` and terminates a child that has not exited `join_s` seconds later.
    """

    stop_message: object = "stop"
    join_s: float = 30.0

    def __init__(self, kind: str, target: Callable, args: tuple, timeout_s: float = 3600.0):
        import multiprocessing

        self.kind, self.timeout_s = kind, timeout_s
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=target, args=(child, *args), daemon=True)
        self._process.start()
        child.close()

    def _reply(self):
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(f"{self.kind} side gave no answer within {self.timeout_s:.0f} s")
        status, payload = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.kind} side failed:\n{payload}")
        return payload

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(self.stop_message)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=self.join_s)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)
        self._conn.close()


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, summed over its threads."""
    return time.process_time()  # CLOCK_PROCESS_CPUTIME_ID: ns resolution, unlike os.times()


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of an empty list of timings")
    return float(statistics.median(values))


def speedup(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """How many times faster `candidate` is than `baseline`: the median over rounds of
    baseline_time / candidate_time (paired by round, so shared drift cancels)."""
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError(
            f"paired timings must have the same non-zero length; got {len(baseline)} and {len(candidate)}"
        )
    return median([b / c for b, c in zip(baseline, candidate)])


def summarize(times: Sequence[float], units_per_call: float | None = None, unit: str = "tokens",
              cpu_times: Sequence[float] | None = None) -> dict:
    """Median and spread of one side's timings; with `units_per_call`, also the median throughput;
    with `cpu_times`, their median and the median CPU use (CPU seconds per wall second: ~ the number of
    cores the side kept busy)."""
    out = {
        "median_s": median(times),
        "min_s": float(min(times)),
        "max_s": float(max(times)),
        "rounds": len(times),
        "times_s": [float(t) for t in times],
    }
    if units_per_call is not None:
        out[f"{unit}_per_s"] = units_per_call / out["median_s"]
    if cpu_times is not None:
        out["cpu_median_s"] = median(cpu_times)
        out["cpu_times_s"] = [float(t) for t in cpu_times]
        out["cores_busy"] = median([c / w for c, w in zip(cpu_times, times)])
    return out


def peak_rss_mib() -> float:
    """Peak resident set size of this process's own address space so far, MiB: /proc's VmHWM.

    Not `ru_maxrss` where /proc exists: a spawned side inherits it from its parent (exec keeps the
    forked copy's high-water mark in the process's rusage), so every side would report at least the
    parent's peak. Falls back to `ru_maxrss` without /proc (macOS reports it in bytes, Linux in KiB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    scale = 1.0 / 1024.0 if sys.platform != "darwin" else 1.0 / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def current_rss_mib() -> float:
    """Resident set size now, MiB (from /proc; falls back to the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()


def environment() -> dict:
    """What the numbers were measured on: versions, cores, load, accelerator, malloc settings."""
    import jax
    import torch
    import transformers

    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_flush_denormal": _TORCH_SETTINGS["flush_denormal"],
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "load_average_1_5_15": [round(x, 2) for x in load],
        "host_allocator": host_allocator_settings(),  # this process's malloc settings
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_json(path: str, payload: Mapping) -> None:
    """Writes `payload` as indented JSON; NaN/inf are refused (they are not JSON)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are shown with 3 significant digits (or more for big numbers)."""
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {row!r} has {len(row)} cells; the table has {len(columns)} columns")
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def write_markdown(path: str, title: str, sections: Sequence[tuple[str, str]]) -> None:
    """Writes `# title` then each (heading, body) section, body being markdown (e.g. a table)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    parts = [f"# {title}", ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body.rstrip(), ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
