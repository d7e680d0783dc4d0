"""The shapes a run's programs meet, and the upkeep a new shape calls for.

Each prompt bucket is its own set of sampler, log π_old and update programs, and each new policy-batch
shape its own program: `rollout.compile_ahead` compiles every prompt bucket of the training prompts at
the start, so no later iteration stops to compile. On XLA:CPU a process also keeps every compiled
program's code mapped, and the freed temporaries of earlier shapes stay as heap holes a new shape does
not fit, so a new shape first drops the compiled programs when the process nears its memory-map limit
(`respo_jax.training.compilation.drop_programs_near_map_limit`) and returns the heap's free memory to
the OS (`respo_jax.host_allocator`, when configured) once it holds more than `KEEP_FREE_FRACTION` of the
machine's memory.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Callable, Iterable

from respo_jax.host_allocator import host_allocator_settings, release_host_memory
from respo_jax.training.compilation import drop_programs_near_map_limit

# A new batch shape returns the heap's free memory to the OS only when it exceeds this fraction of the
# machine's memory (4 GiB of 24). Why: on a VM the pages given back cost ~2 s per GB when the next step
# touches them, and the next steps' temps are about the size of the last ones (measured: docs/results/
# benchmarks.md); the bound keeps a sweep over growing shapes from accumulating heap holes.
KEEP_FREE_FRACTION = 1 / 6


class ShapeTracker:
    """The prompt lengths of the training prompts, whether compile-ahead is still to run, and the
    policy-batch shapes run so far."""

    def __init__(self, prompt_lengths: Iterable[int], padded_length: Callable[[int], int],
                 compile_ahead: bool):
        """`padded_length`: a batch's padded prompt length from its longest prompt's
        (`RolloutConfig.padded_prompt_length`)."""
        self.prompt_lengths = set(prompt_lengths)
        self.padded_length = padded_length
        self._compile_ahead_pending = compile_ahead
        self._batch_shapes: set[tuple] = set()

    def prompt_buckets(self) -> list[int]:
        """The padded prompt lengths the training prompts can need (every batch's longest prompt falls in
        the bucket of one of them), ascending."""
        return sorted({self.padded_length(length) for length in self.prompt_lengths})

    def compile_ahead(self, compile_bucket: Callable[[int], None]) -> int:
        """Runs `compile_bucket(prompt_len)` for every prompt bucket (dropping the compiled programs from
        memory when the process nears its map limit), then returns the freed heap to the OS; returns the
        number of buckets."""
        self._compile_ahead_pending = False
        buckets = self.prompt_buckets()
        for prompt_len in buckets:
            compile_bucket(prompt_len)
            drop_programs_if_needed()
        self.release_host_memory()  # what compiling freed, before the first step allocates
        return len(buckets)

    def skip_compile_ahead(self) -> None:
        """Marks the compile-ahead done without compiling (its programs are read when first needed)."""
        self._compile_ahead_pending = False

    def compile_ahead_once(self, compile_ahead: Callable[[], int]) -> None:
        """Calls `compile_ahead` (the caller's, which calls this tracker's) unless a compile-ahead has run
        or none was asked for (`rollout.compile_ahead=false`)."""
        if self._compile_ahead_pending:
            compile_ahead()

    def batch_shape(self, shape: tuple) -> None:
        """Notes a policy batch of `shape` about to run; the first time: programs dropped when needed
        (new programs follow) and the heap's free memory returned to the OS."""
        if shape in self._batch_shapes:
            return
        self._batch_shapes.add(shape)
        drop_programs_if_needed()
        self.release_host_memory(keep_free_bytes=keep_free_bytes())

    @staticmethod
    def release_host_memory(keep_free_bytes: int = 0) -> None:
        """Python's unreachable reference cycles collected (the programs just traced and lowered leave
        some, holding their intermediate representation), then the heap's free memory back to the OS
        (`respo_jax.host_allocator`), when it is configured and the heap holds more than
        `keep_free_bytes` free."""
        gc.collect()
        if host_allocator_settings()["applied"]:
            release_host_memory(keep_free_bytes)


def keep_free_bytes() -> int:
    """`KEEP_FREE_FRACTION` of this machine's physical memory, in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * KEEP_FREE_FRACTION)


def drop_programs_if_needed() -> None:
    """`respo_jax.training.compilation.drop_programs_near_map_limit`, said on stderr when it drops."""
    maps = drop_programs_near_map_limit()
    if maps is not None:
        print(f"dropped the compiled programs from memory: this process held {maps[0]:,} of its {maps[1]:,} "
              "memory mappings (vm.max_map_count); programs needed again are reloaded from the compilation "
              "cache", file=sys.stderr)
