"""The state of this process's persistent compilation cache that every writer into it shares: whether the
cache is only read, and the first write into it that failed.

`respo_jax.training.compilation` configures the cache (and sets `state`); JAX's own cache and the
exported-program cache (`respo_jax.exported_programs`) both write into it and report here.
"""

from __future__ import annotations

import sys

# read_only: the configured cache is only read; write_failed: a write into it failed (its first message)
state: dict = {"read_only": False, "write_failed": None}


def cache_read_only() -> bool:
    """Whether the configured compilation cache is only read (an existing folder that cannot be written)."""
    return state["read_only"]


def cache_write_failed(path: str, err: BaseException | str) -> None:
    """Notes that a write into the compilation cache failed (a full or failing disk): one line on stderr
    the first time in this process; the run goes on, and `record_compile_ahead` records nothing."""
    if state["write_failed"] is None:
        reason = (err.strerror or str(err)) if isinstance(err, OSError) else " ".join(str(err).split())
        state["write_failed"] = reason
        print(f"warning: cannot write the compilation cache ({path}: {reason}); the run goes on, and what "
              "was not written is compiled again by a later launch", file=sys.stderr)
