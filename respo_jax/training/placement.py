"""Where a batch's rows live when a run spans several processes: the trainer's one placer.

Each process builds only the rows its devices hold and the global array is assembled from every
process's part; host work on rows (rewards) is split evenly over the processes and the results
exchanged; device results the host needs (metrics, the rollout file) are gathered to every process
(`respo_jax.distributed`). In a single process every row is its own and nothing is exchanged.
"""

from __future__ import annotations

import dataclasses

import jax

from respo_jax.distributed import (
    gather_rows,
    process_rows,
    process_share,
    rows_from_process,
    take_rows,
    to_host,
)


@dataclasses.dataclass(frozen=True)
class RowPlacer:
    """Host-side placement of `[rows, ...]` batches split along their first dimension by `sharding`
    (the training step's batch sharding)."""

    sharding: jax.sharding.Sharding

    def rows(self, count: int):
        """This process's rows of a `count`-row batch, ascending: a slice, or an index array."""
        return process_rows(self.sharding, count)

    @staticmethod
    def take(items, part):
        """`items[part]` for a list or an array and a part from `rows` or `share`."""
        return take_rows(items, part)

    def place(self, local, count: int):
        """The global `count`-row device arrays of a tree of host arrays holding this process's `rows`."""
        return jax.tree.map(lambda x: rows_from_process(self.sharding, x, count), local)

    @staticmethod
    def share(count: int) -> slice:
        """This process's even share of `count` items of host work (e.g. the responses to score)."""
        return process_share(count)

    @staticmethod
    def gather(local, part: slice, count: int):
        """The `count` host values of which this process computed `part` (its `share`), on every process."""
        return gather_rows(local, part, count)

    @staticmethod
    def fetch(tree):
        """A tree of (possibly multi-process) device arrays as NumPy arrays holding all of them, on every
        process (a collective: every process calls it, in the same order)."""
        return jax.tree.map(to_host, tree)
